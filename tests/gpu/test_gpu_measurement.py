"""The CUDA executor's measurement: its host API (wherever jaxccl._native_cuda is built, GPU or not) and
tests/gpu/check_measurement.py in quick mode (where a CUDA device exists).

The check needs a JAX process whose default backend is the GPU, so it runs in a
subprocess; on machines without a GPU it is skipped.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import jaxccl

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _cuda_module():
    from jaxccl.runtime import native

    cu = native._cuda_module()  # jaxccl's own build or the cuda12 plugin's
    if cu is None:
        pytest.skip(f"no CUDA module: {native.cuda_status()[1]}")
    if not hasattr(cu, "measure_configure"):
        pytest.skip("jaxccl._native_cuda predates measurement (rebuild it)")
    return cu


def test_measure_api_checks_settings_and_starts_empty():
    cu = _cuda_module()
    before = cu.measure_settings()
    try:
        cu.measure_configure(True, np.array([0, 0, 1, 1], np.int64), 2, 1, 8)
        assert cu.measure_settings() == {
            "enabled": True,
            "host_of_rank": [0, 0, 1, 1],
            "intra_threshold": 2,
            "inter_threshold": 1,
            "slots_per_tb": 8,
            "min_window_bytes": 32 << 10,
        }
        for bad, match in [
            ({"host_of_rank": [0, -1]}, r"host_of_rank\[1\] = -1"),
            ({"intra_threshold": 0}, "thresholds must be >= 1"),
            ({"inter_threshold": -2}, "thresholds must be >= 1"),
            ({"slots_per_tb": 0}, "slots_per_tb must be in 1..65536"),
            ({"host_of_rank": list(range(65))}, "at most 64 ranks"),
            ({"min_window_bytes": -1}, "min_window_bytes must be >= 0"),
        ]:
            with pytest.raises(ValueError, match=match):
                cu.measure_configure(True, **bad)
        assert cu.measure_settings()["slots_per_tb"] == 8  # a refused call changes nothing
        cu.measure_reset()
        raw, dropped = cu.measure_drain()
        assert isinstance(raw, bytes) and len(raw) % 32 == 0 and dropped == 0
        st = cu.measure_stats()
        assert st["cache_entry_bytes"] == 24 and st["cache_entries_per_tb"] == 32
        assert st["dropped"] == 0 and st["used"] == 0 and st["records"] == 0
        assert cu.MEASUREMENT_VERSION == 1
    finally:
        cu.measure_configure(
            before["enabled"],
            before["host_of_rank"],
            before["intra_threshold"],
            before["inter_threshold"],
            before["slots_per_tb"],
            before["min_window_bytes"],
        )


@pytest.mark.skipif(not jaxccl.has_cuda_support(), reason="no CUDA device or jaxccl._native_cuda")
def test_measurement_on_gpu(tmp_path):
    out = tmp_path / "gpu_measurement.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(HERE / "check_measurement.py"), "--quick", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    if result.get("skipped"):
        pytest.skip(result["reason"])
    failed = [c for c in result["checks"] if not c["ok"]]
    assert result["all_ok"] and not failed, failed
