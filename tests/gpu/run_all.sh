#!/usr/bin/env bash
# Everything issue 28 checks on a GPU, in one run on one GPU. Budget: 8 minutes. Estimate: 372 s (6.2 min)
# on one H100/H200 machine with 16 cores; every step has a hard limit (tests/gpu/run_all.py, STEPS), the
# run stops at JAXCCL_GPU_BUDGET_S (default 470 s) whatever is left, and this script kills it 60 s later.
#
#   step            estimate  what
#   gpu                  2 s  nvidia-smi -L lists a GPU; else it prints "skipped: no GPU visible" and exits 0
#   build              100 s  a venv, pip install -e . with JAXCCL_CUDA=ON (offline; wheels from JAXCCL_GPU_WHEELS)
#   probe               15 s  the CUDA module loads; the UCX transport and its transports; JAX's CUDA plugin
#   core                60 s  tests/gpu/check_core.py: the executor core on the GPU vs the CPU core and jax.lax
#   measurement         30 s  tests/gpu/check_measurement.py --quick (needs JAX's CUDA plugin)
#   cpu_reference       40 s  the collectives on the CPU executor, 2 and 4 processes: the bitwise reference
#   mp2                 75 s  2 processes share the GPU: collectives, hot-swap, meter, overhead, swap latency,
#                             16 MiB AllGather vs jax.lax
#   mp4                 50 s  4 processes share the GPU: collectives
#   total              372 s
#
# Usage: bash tests/gpu/run_all.sh [--json PATH] [--python PY] [--only STEP,...] [--platform cpu]
# It prints one line per check, "check <name>: ok|FAILED|skipped  <numbers>", then where the JSON file is
# ($OUT/gpu_summary.json where OUT is set, else tests/gpu/results/run_all.json) with the log beside it.
# Exit status 1 if a check FAILED. tests/gpu/README.md says more.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
budget="${JAXCCL_GPU_BUDGET_S:-470}"
export JAXCCL_GPU_BUDGET_S="$budget"
if ! command -v "$python" >/dev/null 2>&1; then
  echo "FAILED: no $python on PATH (set PYTHON)"
  exit 1
fi
if command -v timeout >/dev/null 2>&1; then
  exec timeout -k 10 "$((${budget%.*} + 60))" "$python" -u "$here/run_all.py" "$@"
fi
exec "$python" -u "$here/run_all.py" "$@"
