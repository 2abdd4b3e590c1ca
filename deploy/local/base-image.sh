#!/usr/bin/env bash
# Make the Dockerfile's base image locally, for hosts that reach no container registry
# (only a Debian mirror): a minimal Debian bookworm with Python 3.11, imported as
# ${1:-pinfeed-base:bookworm}. Needs root, debootstrap and a running Docker engine.
#
#   deploy/local/base-image.sh pinfeed-base:bookworm
#   docker build --build-arg PYTHON_IMAGE=pinfeed-base:bookworm ...
set -euo pipefail
tag=${1:-pinfeed-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag exists"
    exit 0
fi
root=$(mktemp -d /tmp/pinfeed-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -20 "$root.log"; exit 1; }
rm -f "$root.log"
# What an official python image leaves out too: apt lists and caches.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$tag" >/dev/null
echo "base image $tag made"
