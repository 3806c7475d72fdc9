#!/usr/bin/env bash
# Smoke check of a built wheel with no compiler anywhere on the PATH:
#   .ci/check_wheel.sh WHEEL
# installs WHEEL (and binary wheels only of its dependencies, from PyPI) into a fresh venv whose PATH holds the
# venv's bin/ and a few symlinked tools, checks that no cc/c++/gcc/g++/nvcc/cmake can be found, then runs
# `jaxccl demo`, `jaxccl bench` (small sizes) and the bench across 2 processes over the UCX transport.
# PYTHON picks the interpreter that makes the venv (default python3).
set -euo pipefail
[ $# -eq 1 ] && [ -f "$1" ] || { echo "usage: $0 WHEEL" >&2; exit 2; }
WHEEL="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
PYTHON="$(command -v "${PYTHON:-python3}")"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m venv "$WORK/venv"

# The PATH the install and the runs see: the venv's bin and symlinks to the tools a shell script needs.
mkdir "$WORK/bin"
for tool in env sh bash cat date ls mkdir rm uname; do
  ln -s "$(command -v "$tool")" "$WORK/bin/$tool"
done
export PATH="$WORK/venv/bin:$WORK/bin"
hash -r
for tool in cc c++ gcc g++ nvcc cmake; do
  if found="$(command -v "$tool")"; then
    echo "a compiler tool is on the PATH: $found" >&2
    exit 1
  fi
done
cd "$WORK"  # away from any source checkout: the installed package is what runs

t0=$(date +%s)
python -m pip install --quiet --upgrade pip
python -m pip install --quiet --only-binary=:all: "$WHEEL"
t1=$(date +%s)
echo "installed in $((t1 - t0)) s"
for tool in cc c++ gcc g++ nvcc cmake; do
  if found="$(command -v "$tool")"; then
    echo "installing the wheel put a compiler tool on the PATH: $found" >&2
    exit 1
  fi
done
python - <<'PY'
import jaxccl
from jaxccl.distributed import transport

reason = transport.unavailable_reason()
if reason is not None:
    raise SystemExit(reason)
print("jaxccl", jaxccl.__file__, "with the transport between processes")
PY

jaxccl demo --quiet --json demo.json  # the whole demo: it has no shorter mode
t2=$(date +%s)
jaxccl bench --collectives all_gather,psum -b 4K -e 64K -n 3 -w 1 --quiet
t3=$(date +%s)
jaxccl bench --collectives all_gather -b 4K -e 16K -n 3 -w 1 --devices 2 --processes 2 --quiet
t4=$(date +%s)
echo "demo $((t2 - t1)) s, bench $((t3 - t2)) s, bench across 2 processes $((t4 - t3)) s"
echo "wheel check passed"
