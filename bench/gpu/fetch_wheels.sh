#!/usr/bin/env bash
# Download the wheels bench/gpu/run.sh installs on a GPU machine without network: the
# packages kempnerforge needs beside torch, numpy and safetensors, and torchao for FP8.
# Run where pip reaches PyPI, then carry bench/gpu/wheels/ with the tree (about 4 MB).
#
#   bench/gpu/fetch_wheels.sh [python-version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")"
version="${1:-3.12}"
python3 -m pip download --no-deps --only-binary=:all: --python-version "$version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels \
    torchao==0.18.0 torchdata==0.11.0 tomli-w==1.2.0
ls -l wheels
