#!/usr/bin/env bash
# A bundle for a GPU node without internet access that already has Python, a CUDA build of
# torch and transformers: Riptide's other Python dependencies as wheels, redis-server and
# bubblewrap as Debian packages, and SmolLM2-135M's GGUF file in parts of at most PART_MB
# (for transfers with a size limit). Install it there with scripts/offline_install.sh; parts
# may travel in several folders and be installed one folder at a time.
#
#   scripts/offline_bundle.sh OUT_DIR            (run from a checkout after `make smollm2`)
#   PY_VERSION=3.12 PART_MB=40 scripts/offline_bundle.sh OUT_DIR
set -euo pipefail
out=${1:?usage: scripts/offline_bundle.sh OUT_DIR}
py_version=${PY_VERSION:-3.12}
part_mb=${PART_MB:-40}
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
mkdir -p "$out/wheels" "$out/debs" "$out/model"

# Riptide's runtime dependencies and theirs (and gguf's, to read the model), at the versions
# this checkout's environment holds; torch, transformers, tokenizers, numpy and triton are the
# node's own.
pins=$("$python" - "$py_version" <<'PY'
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement

NODE = {"torch", "transformers", "tokenizers", "numpy", "triton", "pip", "setuptools", "wheel"}
env = {"extra": "", "python_version": sys.argv[1], "sys_platform": "linux"}
seen: set[str] = set()


def walk(requirement: str) -> None:
    req = Requirement(requirement)
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if (req.marker and not req.marker.evaluate(env)) or name in NODE or name in seen:
        return
    seen.add(name)
    dist = md.distribution(req.name)
    print(f"{dist.metadata['Name']}=={dist.version}")
    for sub in dist.requires or []:
        walk(sub)


for top in md.distribution("riptide").requires or []:
    walk(top)
walk("gguf")
PY
)
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py_version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d "$out/wheels" $pins

# redis-server (a link into redis-tools) and bwrap, with the libraries a CUDA image may lack.
(cd "$out/debs" && apt-get download redis-server redis-tools liblzf1 libjemalloc2 libatomic1 \
    bubblewrap 2>/dev/null)

gguf=$("$python" -c 'from services.common.model_fetch import gguf_path; print(gguf_path("smollm2-135m"))')
split -b "${part_mb}M" -d "$gguf" "$out/model/$(basename "$gguf").part-"
(cd "$out/model" && sha256sum "$gguf" | awk -v n="$(basename "$gguf")" '{print $1"  "n}' > SHA256SUM)
du -sh "$out"/*
