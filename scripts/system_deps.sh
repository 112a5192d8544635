#!/usr/bin/env bash
# Make sure the system programs Riptide needs are installed: install them with apt when we
# are root, otherwise say exactly what to install. Usage: scripts/system_deps.sh PROGRAM:PACKAGE...
set -euo pipefail
missing=()
for pair in "$@"; do
  program="${pair%%:*}"; package="${pair##*:}"
  command -v "$program" >/dev/null 2>&1 || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing system packages: ${missing[*]}"
  # Wait for another apt run to finish rather than fail on its lock.
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    "${missing[@]}" >/dev/null
else
  echo "missing system packages: ${missing[*]}" >&2
  echo "install them first, e.g.: sudo apt-get install -y ${missing[*]}" >&2
  echo "(macOS: brew install redis; the local sandbox needs Linux with bubblewrap)" >&2
  exit 1
fi
