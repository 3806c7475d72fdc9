#!/usr/bin/env bash
# Checks that the CUDA executor compiles (sm_90 unless CUDA_ARCH says otherwise), on any machine with
# nvcc, GPU or not: configures the project with JAXCCL_CUDA=ON into a temporary build directory and
# builds jaxccl._native_cuda. Needs the Python that has jax and nanobind (PYTHON, default python).
#   tests/gpu/build_check.sh            # sm_90
#   CUDA_ARCH=80 tests/gpu/build_check.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-python}"
arch="${CUDA_ARCH:-90}"
if ! command -v nvcc >/dev/null 2>&1; then
  echo "skipped: no nvcc on PATH"
  exit 0
fi
build="$(mktemp -d "${TMPDIR:-/tmp}/jaxccl-cuda-check.XXXXXX")"
trap 'rm -rf "$build"' EXIT
nanobind_dir="$("$python" -c 'import nanobind; print(nanobind.cmake_dir())')"
cmake -S "$here" -B "$build" -G Ninja -DJAXCCL_CUDA=ON -DJAXCCL_TRANSPORT=AUTO -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DPython_EXECUTABLE="$(command -v "$python")" -Dnanobind_DIR="$nanobind_dir" >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
cmake --build "$build" --target _native_cuda -j "${JOBS:-2}" 2>&1 | tee "$build/build.log" | grep -E "(error|warning):" || true
if [ "${PIPESTATUS[0]}" -ne 0 ] || [ ! -f "$(ls "$build"/_native_cuda*.so 2>/dev/null | head -1)" ]; then
  echo "FAILED: the CUDA executor does not build for sm_$arch"
  tail -40 "$build/build.log"
  exit 1
fi
echo "ok: the CUDA executor builds for sm_$arch ($(nvcc --version | tail -1))"
