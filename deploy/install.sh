#!/bin/sh
# Put jetserve on a Jetson: a venv in /opt/jetserve, the CLI in /usr/local/bin, one config file
# (/etc/jetserve/jetserve.toml) and the systemd units. Run as root from a checkout:
#   sudo deploy/install.sh [--service] FLEET BROKER_HOST [PASSWORD]
# Without --service only the agent is installed (base install, no torch; JetPack 5's Python 3.8
# is enough). With --service the inference service comes too: it needs Python >= 3.10
# (JetPack 6+) and NVIDIA's PyTorch wheel for this JetPack installed system-wide first, which
# the venv sees (--system-site-packages) instead of pulling a generic torch from PyPI.
set -eu
service=0
if [ "${1:-}" = "--service" ]; then service=1; shift; fi
[ $# -ge 2 ] || { echo "usage: $0 [--service] FLEET BROKER_HOST [PASSWORD]" >&2; exit 2; }
fleet=$1 broker=$2 src=$(cd "$(dirname "$0")/.." && pwd) device=$(hostname -s)

if [ $service = 1 ]; then
  python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
    echo "the service needs Python >= 3.10 (JetPack 6 or newer); run 'jetserve doctor' to see what this device allows" >&2
    exit 1; }
  python3 -c 'import torch' 2>/dev/null || {
    echo "install NVIDIA's PyTorch wheel for this JetPack first (system-wide), then run this again" >&2
    exit 1; }
  python3 -m venv --system-site-packages /opt/jetserve
  /opt/jetserve/bin/pip install --quiet "$src[serve]"
  # Bytecode for torch and Triton, written now where a wheel installed without it would have
  # every start of the service compile their sources again (seconds each time).
  python3 -m compileall -q -j 0 $(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))') \
    $(python3 -c 'import os, triton; print(os.path.dirname(triton.__file__))' 2>/dev/null) >/dev/null || true
else
  python3 -m venv /opt/jetserve
  /opt/jetserve/bin/pip install --quiet "$src"
fi
ln -sf /opt/jetserve/bin/jetserve /usr/local/bin/jetserve
# One system user for the service and the agent (the GPU nodes belong to video/render).
id jetserve >/dev/null 2>&1 || useradd --system --home-dir /var/lib/jetserve --shell /usr/sbin/nologin \
  --groups video,render jetserve
install -d -m 0755 /etc/jetserve
if [ $# -ge 3 ]; then
  printf '%s\n' "$3" | install -m 0640 -g jetserve /dev/stdin /etc/jetserve/mqtt-password
fi
[ -f /etc/jetserve/jetserve.toml ] || cat > /etc/jetserve/jetserve.toml <<TOML
[serve]
# model = "/var/lib/jetserve/models/qwen3-0.6b"   # without it: the bundled demo model
max-num-seqs = 8
max-num-batched-tokens = 512

[agent]
fleet = "$fleet"
device-id = "$device"
mqtt-host = "$broker"
mqtt-port = 8883
mqtt-tls = true
mqtt-user = "$fleet/$device"   # the broker account: deploy/add-user.sh device $fleet $device
mqtt-password-file = "/etc/jetserve/mqtt-password"
TOML
[ $service = 0 ] || install -m 0644 "$src/systemd/jetserve.service" /etc/systemd/system/
install -m 0644 "$src/systemd/jetserve-agent.service" /etc/systemd/system/
systemctl daemon-reload
[ $service = 0 ] || systemctl enable --now jetserve.service
systemctl enable --now jetserve-agent.service
jetserve doctor
