#!/usr/bin/env bash
# The GPU check (docs/gpu.md): pytest -m gpu, the Triton kernels timed against their references and
# SDPA, speculative decoding smoke runs. Under 7 minutes on an H200; torch and triton only, no network.
#   bench/gpu_check.sh               results in $OUT/ if set, else docs/bench/ (gpu-check.json, .txt)
#   bench/gpu_check.sh --cpu-smoke   tiny shapes on the CPU, kernels interpreted (gpu-check-cpu-smoke.*)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && py=.venv/bin/python
out="${OUT:-$root/docs/bench}"
mkdir -p "$out"
name=gpu-check
for a in "$@"; do [ "$a" = --cpu-smoke ] && name=gpu-check-cpu-smoke; done
export PYTHONPATH="$root/api:$root/bench:$root/worker${PYTHONPATH:+:$PYTHONPATH}"
timeout 415 "$py" -m specfleet_bench.gpu_check --json "$out/$name.json" "$@" 2>&1 | tee "$out/$name.txt"
exit "${PIPESTATUS[0]}"
