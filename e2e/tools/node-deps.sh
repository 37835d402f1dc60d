#!/usr/bin/env bash
# Installs what the real node and the image builds need from Debian's packages (root only; a no-op
# when everything is there): containerd + runc (the node's runtime), the CNI plugins (pod network),
# iptables + conntrack (kube-proxy), debootstrap (the local Debian base image), docker.io (dockerd, the
# image builder; run by the harness with its own data root, no bridge, no iptables), gcc (the pause
# binary, built static).
# Exit 0: all present. Exit 2: missing and not root (the caller skips the real node with this message).
set -euo pipefail
declare -A cmd_pkg=(
    [containerd]=containerd [runc]=runc [iptables]=iptables [conntrack]=conntrack
    [debootstrap]=debootstrap [dockerd]=docker.io [gcc]=gcc
)
missing=()
for c in "${!cmd_pkg[@]}"; do command -v "$c" >/dev/null || missing+=("${cmd_pkg[$c]}"); done
[[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)
[[ -f /usr/lib/x86_64-linux-musl/libc.a || -f /usr/lib/x86_64-linux-gnu/libc.a ]] || missing+=(libc6-dev)
if ((${#missing[@]} == 0)); then
    exit 0
fi
if ((EUID != 0)); then
    echo "node-deps.sh: missing Debian packages ${missing[*]} and not root to install them" >&2
    exit 2
fi
echo "node-deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
# No service is started on install (policy-rc.d / no init): the harness starts its own daemons.
apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
