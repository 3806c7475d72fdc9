#!/usr/bin/env bash
# Checks that the CUDA executor compiles, its launches across processes included (kernels/launch.cu,
# kernels/mapped_memory.cu), for sm_80 and sm_90 in one configure (ARCHS="80;90" unless set), on any
# machine with nvcc, GPU or not: configures the project with JAXCCL_CUDA=ON into a temporary build
# directory and builds jaxccl._native_cuda. A warning in jaxccl's own sources fails the check (-Wall
# -Wextra). Needs the Python that has jax and nanobind (PYTHON, default python). About 1.5 min on 2 cores.
#   tests/gpu/build_check.sh              # sm_80 and sm_90
#   ARCHS=90 tests/gpu/build_check.sh     # one architecture (CMAKE_CUDA_ARCHITECTURES syntax)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-python}"
archs="${ARCHS:-80;90}"
if ! command -v nvcc >/dev/null 2>&1; then
  echo "skipped: no nvcc on PATH"
  exit 0
fi
start=$SECONDS
build="$(mktemp -d "${TMPDIR:-/tmp}/jaxccl-cuda-check.XXXXXX")"
trap 'rm -rf "$build"' EXIT
nanobind_dir="$("$python" -c 'import nanobind; print(nanobind.cmake_dir())')"
cmake -S "$here" -B "$build" -G Ninja -DJAXCCL_CUDA=ON -DJAXCCL_TRANSPORT=AUTO -DCMAKE_CUDA_ARCHITECTURES="$archs" \
  -DPython_EXECUTABLE="$(command -v "$python")" -Dnanobind_DIR="$nanobind_dir" >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
set +e
cmake --build "$build" --target _native_cuda -j "${JOBS:-2}" >"$build/build.log" 2>&1
rc=$?
set -e
grep -E "(error|warning)( #[0-9A-Za-z-]+)?:" "$build/build.log" || true
if [ "$rc" -ne 0 ] || [ ! -f "$(ls "$build"/_native_cuda*.so 2>/dev/null | head -1)" ]; then
  echo "FAILED: the CUDA executor does not build for architectures $archs"
  tail -40 "$build/build.log"
  exit 1
fi
if grep -E "(kernels|xla_ffi)/[^ ]*\.(cu|cuh|cc|h)\(?[0-9]*\)?[:(].*warning" "$build/build.log" >/dev/null; then
  echo "FAILED: the CUDA executor compiles with warnings in jaxccl's sources (above)"
  exit 1
fi
echo "ok: the CUDA executor builds for architectures $archs in $((SECONDS - start)) s ($(nvcc --version | tail -1))"
