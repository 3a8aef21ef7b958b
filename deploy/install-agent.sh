#!/bin/sh
# Put jetserve's agent on a Jetson: a venv in /opt/jetserve (base install, no torch), the CLI in
# /usr/local/bin, the config and the unit. Run as root from a checkout:
#   sudo deploy/install-agent.sh FLEET BROKER_HOST [PASSWORD]
set -eu
[ $# -ge 2 ] || { echo "usage: $0 FLEET BROKER_HOST [PASSWORD]" >&2; exit 2; }
fleet=$1 broker=$2 src=$(cd "$(dirname "$0")/.." && pwd) device=$(hostname -s)

python3 -m venv /opt/jetserve
/opt/jetserve/bin/pip install --quiet "$src"
ln -sf /opt/jetserve/bin/jetserve /usr/local/bin/jetserve
install -d -m 0755 /etc/jetserve
if [ $# -ge 3 ]; then
  umask 077 && printf '%s\n' "$3" > /etc/jetserve/mqtt-password
fi
[ -f /etc/jetserve/jetserve.toml ] || cat > /etc/jetserve/jetserve.toml <<TOML
[agent]
fleet = "$fleet"
device-id = "$device"
mqtt-host = "$broker"
mqtt-port = 8883
mqtt-tls = true
mqtt-user = "$device"
mqtt-password-file = "/etc/jetserve/mqtt-password"
TOML
install -m 0644 "$src/systemd/jetserve-agent.service" /etc/systemd/system/
systemctl daemon-reload
systemctl enable --now jetserve-agent.service
jetserve doctor
