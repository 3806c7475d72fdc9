"""tests/gpu/check_core.py where a CUDA device and jaxccl._native_cuda exist (skipped elsewhere).

The check runs JAX on CPU for its references and the CUDA core through the module's test entry, in a
subprocess so that its JAX setup (8 CPU devices) does not depend on this process's.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import jaxccl

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.skipif(not jaxccl.has_cuda_support(), reason="no CUDA device or jaxccl._native_cuda")
def test_core_on_one_gpu(tmp_path):
    out = tmp_path / "gpu_core.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)  # the check sets its own device count
    proc = subprocess.run(
        [sys.executable, str(HERE / "check_core.py"), "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    if result.get("skipped"):
        pytest.skip(result["reason"])
    assert result["all_ok"], [c for c in result["checks"] if not c["ok"]]
