#!/usr/bin/env bash
# Make a Debian bookworm base image without any image registry: debootstrap a minimal root
# filesystem from Debian's packages (python3.11 and the programs the services run), then
# import it. Kept as long as an image of that tag and package list exists.
# Usage: scripts/build_base_image.sh [TAG]   (env: ENGINE=docker|podman, DEBIAN_MIRROR)
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-localhost/riptide-base:bookworm}"
engine="${ENGINE:-$(command -v podman >/dev/null && echo podman || echo docker)}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
packages="python3,python3-venv,redis-server,bubblewrap,procps,git"

if [ "$("$engine" image inspect --format '{{index .Config.Labels "riptide.base.packages"}}' \
        "$tag" 2>/dev/null)" = "$packages" ]; then
  echo "base image $tag is up to date"
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "install debootstrap first" >&2; exit 1; }
rootfs="$(mktemp -d "${TMPDIR:-/tmp}/riptide-rootfs.XXXXXX")"
trap 'rm -rf "$rootfs"' EXIT
echo "debootstrap bookworm ($packages) from $mirror"
debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
  || { tail -20 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"
# Package caches and docs only make the image bigger.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
       "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
tar -C "$rootfs" -c . | "$engine" import \
  --change 'CMD ["/bin/bash"]' --change "LABEL riptide.base.packages=$packages" - "$tag" >/dev/null
echo "base image $tag imported"
