#!/usr/bin/env bash
# Fetch the wheels the GPU check needs on a GPU machine that has no network (benchmarks/gpu/run.sh installs them
# there): TRL 1.16 and what its image lacks (datasets, dill, multiprocess), and crc32c, for CPython 3.12 on
# manylinux x86_64, into ./.whl of the repository (ignored by git: this adds /.whl/ to .git/info/exclude).
# The project itself is built from the working tree on the machine (run.sh), so it never goes stale.
# Usage: bash benchmarks/gpu/fetch_wheels.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/../.."
dest="${1:-.whl}"
mkdir -p "$dest"
if [ -d .git ] && ! grep -qx "/.whl/" .git/info/exclude 2>/dev/null; then
    echo "/.whl/" >> .git/info/exclude
fi
# the pins: what the image lacks (KINDS.md of the device tool: it has accelerate, transformers, peft, pandas,
# pyarrow, xxhash, fsspec, huggingface-hub, psutil, jinja2, ...), at the versions tested on CPU here
wheels=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 crc32c==2.9.post0)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
         manylinux_2_5_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dest" "${wheels[@]}"
# one version of each: a second one stops the whole install there
for name in trl datasets dill multiprocess crc32c; do
    count=$(find "$dest" -maxdepth 1 -iname "${name}-*.whl" | wc -l)
    if [ "$count" != 1 ]; then
        echo "fetch_wheels: $count wheels of $name in $dest (need exactly 1); remove the others" >&2
        exit 1
    fi
done
ls -1 "$dest"
du -sh "$dest"
