#!/bin/sh
# Add (or change) a broker account: the controller (`jetserve-fleet`) or a device (its device id).
#   deploy/add-user.sh PASSWORD_FILE NAME [PASSWORD]
# Without PASSWORD a random one is made and printed once: put it in the device's
# /etc/jetserve/mqtt-password (mode 0600) and point --mqtt-password-file at it.
set -eu
[ $# -ge 2 ] || { echo "usage: $0 PASSWORD_FILE NAME [PASSWORD]" >&2; exit 2; }
file=$1 name=$2
password=${3:-$(head -c 18 /dev/urandom | base64 | tr -d '/+=')}
case $name in *[!A-Za-z0-9_.-]*|'') echo "$0: bad name '$name'" >&2; exit 2;; esac
if [ -f "$file" ]; then
  mosquitto_passwd -b "$file" "$name" "$password"
else
  mosquitto_passwd -c -b "$file" "$name" "$password"
fi
chmod 0600 "$file"
[ $# -ge 3 ] || echo "$name: $password"
