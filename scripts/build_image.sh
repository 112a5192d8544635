#!/usr/bin/env bash
# Build the Riptide image from Dockerfile without network: download every wheel Riptide
# needs (CPU torch pinned) into the build context first, then build with `--network none`
# and `pip install --no-index`. Wheels are cached per requirement set, so a rebuild
# downloads nothing. PYTHON (a Python 3.11 with pip; default .venv/bin/python) downloads
# them, and scripts/complete_wheels.py adds what an older 3.11.x in the image also needs.
# Usage: scripts/build_image.sh [TAG]
# env: BASE_IMAGE (default python:3.11-slim), ENGINE=docker|podman, EXTRAS (default
#      daytona), TORCH_SPEC (default torch==2.13.0), PYTHON, RIPTIDE_CACHE_DIR,
#      BUILD_NETWORK (default none; `host` for a base that still needs apt packages)
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-riptide:latest}"
engine="${ENGINE:-$(command -v docker >/dev/null && docker info >/dev/null 2>&1 && echo docker || echo podman)}"
base="${BASE_IMAGE:-python:3.11-slim}"
extras="${EXTRAS-daytona}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
python="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
cache="${RIPTIDE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/riptide}"
context_wheels=.riptide/image/wheels

# What the image installs: the build backend, the pinned torch, Riptide's dependencies.
requirements="$("$python" - "$extras" "$torch_spec" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
extras = [e for e in sys.argv[1].split(",") if e]
reqs = list(project["build-system"]["requires"]) + [sys.argv[2]]
reqs += project["project"]["dependencies"]
for extra in extras:
    reqs += project["project"]["optional-dependencies"][extra]
print("\n".join(reqs))
PY
)"
key="$(printf '%s\n' "$requirements" | sha256sum | cut -c1-16)"
wheels="$cache/wheels-$key"
if [ ! -f "$wheels/.complete" ]; then
  echo "downloading wheels into $wheels"
  mkdir -p "$wheels"
  printf '%s\n' "$requirements" >"$wheels/requirements.txt"
  download() { "$python" -m pip download --quiet --only-binary=:all: --dest "$wheels" "$@"; }
  download -r "$wheels/requirements.txt"
  # pip resolved the markers for this interpreter; add what an older 3.11.x also needs.
  for _ in 1 2 3; do
    extra="$("$python" scripts/complete_wheels.py "$wheels")"
    [ -z "$extra" ] && break
    mapfile -t extra_reqs <<<"$extra"
    download "${extra_reqs[@]}"
  done
  touch "$wheels/.complete"
fi
rm -rf "$context_wheels"
mkdir -p "$(dirname "$context_wheels")"
cp -al "$wheels" "$context_wheels" 2>/dev/null || cp -a "$wheels" "$context_wheels"

network="${BUILD_NETWORK:-none}"
echo "building $tag from $base with $engine (network: $network)"
"$engine" build --network "$network" --build-arg BASE_IMAGE="$base" \
  --build-arg WHEELS="$context_wheels" -t "$tag" -f Dockerfile .
