#!/bin/sh
# Add (or change) a broker account in DIR/passwd (DIR: this script's directory unless -d DIR).
#   deploy/add-user.sh [-d DIR] device FLEET DEVICE [PASSWORD]   user FLEET/DEVICE: its own topics only
#   deploy/add-user.sh [-d DIR] controller NAME [PASSWORD]       reads the fleet, sends commands
# A controller also gets its `user NAME` block in DIR/acl. Without PASSWORD a random one is made
# and printed once: put it in the device's /etc/jetserve/mqtt-password (mode 0640, group jetserve).
# The broker reads both files at start and on SIGHUP (`docker compose kill -s HUP mosquitto`).
set -eu
usage() { echo "usage: $0 [-d DIR] device FLEET DEVICE [PASSWORD] | controller NAME [PASSWORD]" >&2; exit 2; }
dir=$(dirname "$0")
if [ "${1:-}" = "-d" ]; then [ $# -ge 2 ] || usage; dir=$2; shift 2; fi
check() { case $1 in [A-Za-z0-9]*) ;; *) echo "$0: bad name '$1'" >&2; exit 2;; esac
          case $1 in *[!A-Za-z0-9_.-]*) echo "$0: bad name '$1'" >&2; exit 2;; esac
          [ ${#1} -le 64 ] || { echo "$0: name '$1' is longer than 64" >&2; exit 2; }; }
role=${1:-}
case $role in
  device) [ $# -ge 3 ] || usage; check "$2"; check "$3"; name=$2/$3; shift 3;;
  controller) [ $# -ge 2 ] || usage; check "$2"; name=$2; shift 2;;
  *) usage;;
esac
password=${1:-$(head -c 18 /dev/urandom | base64 | tr -d '/+=')}
if [ -f "$dir/passwd" ]; then
  mosquitto_passwd -b "$dir/passwd" "$name" "$password"
else
  (umask 077 && mosquitto_passwd -c -b "$dir/passwd" "$name" "$password")
fi
chmod 0600 "$dir/passwd"
if [ "$role" = controller ] && ! grep -qx "user $name" "$dir/acl"; then
  printf '\nuser %s\ntopic read jetserve/v1/#\ntopic write jetserve/v1/+/+/cmd\n' "$name" >> "$dir/acl"
fi
[ $# -ge 1 ] || echo "$name: $password"
