#!/usr/bin/env bash
# One call on a machine with a CUDA GPU, from the repository root: the GPU test suite,
# then the benchmark table (printed last). Logs and results go to $OUT when it is set.
# Nothing is installed: it uses the python3 found on PATH and the packages it has.
set -o pipefail
cd "$(dirname "$0")/.."
out="${OUT:-artifacts/gpu_check}"
mkdir -p "$out"
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py "$@" 2>&1 | tee "$out/gpu_check.log"
