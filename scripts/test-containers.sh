#!/usr/bin/env bash
# The container part of `make test`: a private dockerd (scripts/dockerd.sh), the images of
# docker/ (built once per content), then, in container mode, the Mooncake and NIXL OBJ
# conformance modules (same test names as the local run) and the hosts-as-containers
# test. dockerd, its containers and its data are gone when this exits, pass or fail;
# only the debootstrap root tarball stays cached (docker/base.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

started=$(date +%s)
dir=$(mktemp -d "${TMPDIR:-/tmp}/hicache-l3-dockerd.XXXXXX")
trap 'bash scripts/dockerd.sh stop "$dir"; echo "containers: $(( $(date +%s) - started ))s in all"' EXIT
export "$(bash scripts/dockerd.sh start "$dir")"
export TESTCONTAINERS_RYUK_DISABLED=true

echo "containers: base image $(bash docker/base.sh) ($(( $(date +%s) - started ))s)"
"$PY" -m hicache_l3.engines.containers build
echo "containers: images ready ($(( $(date +%s) - started ))s)"
# The loopback shim in the test process too, as for the local run (Makefile; empty if unbuilt).
shim=$("$PY" -c 'from hicache_l3.engines.loopback import SHIM; print(SHIM or "")')
LD_PRELOAD="$shim" "$PY" -m pytest -q -p no:randomly -rs --engines=containers \
  tests/conformance/test_mooncake.py tests/conformance/test_nixl_obj.py tests/containers "$@"
