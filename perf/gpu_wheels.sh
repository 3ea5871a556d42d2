#!/usr/bin/env bash
# The wheels a GPU machine without this project's dependencies needs to run perf/gpu_check.sh
# (Python 3.12; torch, transformers, triton and numpy 2 are there already): downloaded into .gpuw/,
# which git ignores. Leave numpy out: that machine's transformers needs its numpy 2.
# Usage (repo root, on a machine with PyPI): bash perf/gpu_wheels.sh
# There (the folder carried along): python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpuw/*.whl
#   && export PYTHONPATH=/tmp/site:$PWD && OUT=... bash perf/gpu_check.sh
set -euo pipefail
out=.gpuw
mkdir -p "$out"
grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
for spec in msgspec pyzmq "xgrammar<0.3" apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection \
    "typing-extensions>=4.16" tritonclient python-rapidjson; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$out" "$spec"
done
du -sh "$out"
