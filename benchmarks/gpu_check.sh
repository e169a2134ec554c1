#!/usr/bin/env bash
# One call on a machine with a CUDA GPU, from anywhere: every section of gpu_check.py
# (compile, bit checks, torch agreement, the CUDA tests, compute-sanitizer memcheck /
# racecheck / synccheck, the GB/s table), within --budget (450 s by default, under 8
# minutes with start-up). The table of sections is printed last; the exit status is 0
# only when no section failed. Logs and results go to $OUT when it is set (else
# artifacts/gpu_check): gpu_check.log, env.json, checks.json, bench.json, bench.csv and
# logs.tar.gz (the pytest and sanitizer logs). Nothing is installed: it uses the python3
# on PATH.
set -o pipefail
cd "$(dirname "$0")/.."
out="${OUT:-artifacts/gpu_check}"
mkdir -p "$out"
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py "$@" 2>&1 | tee "$out/gpu_check.log"
status=$?
# The per-run logs (pytest, sanitizers) in one archive, beside the five result files.
logs=$(cd "$out" && ls pytest-*.log sanitizer-*.log 2>/dev/null)
if [ -n "$logs" ]; then
    # shellcheck disable=SC2086
    (cd "$out" && tar czf logs.tar.gz $logs && rm -f $logs)
fi
exit "$status"
