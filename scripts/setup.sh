#!/usr/bin/env bash
# Set up everything the bench and the tests need on a fresh machine: system libraries
# (as root), the virtual env in .venv with the pinned CPU torch, and every engine package.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(libibverbs1 librdmacm1 libnuma1 iproute2)  # Mooncake's shared libraries; ss
apt_packages+=(glusterfs-server glusterfs-client fio)  # the glusterfs engine (two FUSE mounts); fio
command -v cc >/dev/null || apt_packages+=(gcc libc6-dev)  # builds hicache_l3._batch_io (C batch I/O), _keys, _host_pages
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  for p in "${apt_packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

unset PYTHONDONTWRITEBYTECODE
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch is pinned here only (a CPU build); pyproject.toml never pins it.
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e '.[all]'
echo "setup: .venv ready"
