#!/usr/bin/env bash
# Every GPU figure of docs/performance.md in one command, written as JSON to $OUT (or
# bench/gpu/out): bench/gpu/suite.py, after putting the carried wheels in place.
#
#   bench/gpu/run.sh                 # on the GPU machine, about 8 minutes
#   bench/gpu/run.sh --dry-run       # every part on the CPU with tiny shapes
#   bench/gpu/run.sh --only 1b_compiled,moe --budget-s 300
#
# A machine without network gets the packages torch does not bring (torchdata, tomli-w and,
# for the FP8 parts, torchao) as wheels in bench/gpu/wheels/ (bench/gpu/fetch_wheels.sh
# downloads them); they go into a private directory on PYTHONPATH, never over the
# machine's own torch. Without torchao the FP8 parts record the one-line refusal.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-bench/gpu/out}"
mkdir -p "$out"
python="${PYTHON:-python3}"
if compgen -G "bench/gpu/wheels/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/kempnerforge-gpu-site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --root-user-action=ignore \
        --upgrade --target "$site" bench/gpu/wheels/*.whl || echo "run.sh: could not install the wheels" >&2
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Fewer fragmentation failures for the 8B shape, whose optimizer state fills most of the GPU.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
"$python" bench/gpu/suite.py --out "$out" "$@" 2>&1 | tee "$out/run.log"
