#!/usr/bin/env bash
# The base image every image of docker/ builds FROM: Debian bookworm made here with
# debootstrap (no registry can be reached, so nothing is pulled) and imported with
# `docker import`. Prints the image name, hicache-l3/base:<hash>.
#
# <hash> covers this script and the package list, so the image is made once per content:
# a second run finds the image in the engine (or the root tarball in the cache directory,
# $HICACHE_L3_DOCKER_CACHE, default ~/.cache/hicache-l3/docker) and skips debootstrap.
# The image trusts what the host trusts: the host's CA bundle ($SSL_CERT_FILE, default
# /etc/ssl/certs/ca-certificates.crt) is added as a layer and pip/Python are pointed at it,
# so `docker build --network host` installs packages the way the host does (behind a
# TLS-intercepting proxy too). The debootstrap root is cached apart from that layer.
# Needs root, debootstrap (apt-get installed when missing) and DOCKER_HOST set.
set -euo pipefail

suite=bookworm
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# python3 for the engines and the runner; libibverbs1 librdmacm1 libnuma1 are Mooncake's
# shared libraries; util-linux gives the runner `unshare`.
include=python3,python3-venv,ca-certificates,libibverbs1,librdmacm1,libnuma1,util-linux,procps
cache=${HICACHE_L3_DOCKER_CACHE:-$HOME/.cache/hicache-l3/docker}

ca_bundle=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
root_hash=$(echo "base.sh root v1 $suite $mirror $include" | sha256sum | cut -c1-16)
hash=$( { cat "$0"; cat "$ca_bundle" 2>/dev/null || true; echo "$root_hash"; } | sha256sum | cut -c1-16)
root_image="hicache-l3/base-root:$root_hash"
image="hicache-l3/base:$hash"
docker=(docker)
[ -x /usr/bin/docker ] && docker=(/usr/bin/docker)  # the client matching docker.io's daemon

if "${docker[@]}" image inspect "$image" >/dev/null 2>&1; then
  echo "$image"
  exit 0
fi
tarball="$cache/base-root-$root_hash.tar"
if [ ! -s "$tarball" ]; then
  if ! command -v debootstrap >/dev/null; then
    echo "base.sh: apt-get install debootstrap" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  fi
  mkdir -p "$cache"
  root=$(mktemp -d "${TMPDIR:-/tmp}/hicache-l3-base.XXXXXX")
  trap 'rm -rf "$root" "$tarball.part"' EXIT
  echo "base.sh: debootstrap --variant=minbase $suite (about a minute)" >&2
  debootstrap --variant=minbase --include="$include" "$suite" "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -n 30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
  rm -f "$root.log"
  # Smaller image: no apt lists or package cache.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -cf "$tarball.part" .
  mv "$tarball.part" "$tarball"
  rm -rf "$root"
  trap - EXIT
fi
if ! "${docker[@]}" image inspect "$root_image" >/dev/null 2>&1; then
  "${docker[@]}" import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' "$tarball" "$root_image" >/dev/null
fi
context=$(mktemp -d "${TMPDIR:-/tmp}/hicache-l3-base-ca.XXXXXX")
trap 'rm -rf "$context"' EXIT
if [ -s "$ca_bundle" ]; then cp "$ca_bundle" "$context/host-ca.crt"; else : >"$context/host-ca.crt"; fi
cat >"$context/Dockerfile" <<DOCKERFILE
FROM $root_image
COPY host-ca.crt /etc/ssl/certs/host-ca.crt
RUN if [ -s /etc/ssl/certs/host-ca.crt ]; then :; else cp /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/host-ca.crt; fi
ENV PIP_CERT=/etc/ssl/certs/host-ca.crt SSL_CERT_FILE=/etc/ssl/certs/host-ca.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/host-ca.crt
DOCKERFILE
"${docker[@]}" build -q --network host -t "$image" "$context" >/dev/null
echo "$image"
