"""examples/multihost_transformer.py: one command, TP inside a process, FSDP across, bitwise equal to jax.lax."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from jaxccl.distributed.transport import unavailable_reason

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "multihost_transformer.py"
TRANSPORT = unavailable_reason()

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(TRANSPORT is not None, reason=f"{TRANSPORT}"),
]


def test_four_processes_train_bitwise_with_the_loop_on(tmp_path):
    # 4 processes x 2 devices: the data axis (FSDP, the loop's communicator, with a topology) spans 4
    # processes, so its psum's order matters (with 2 every order is the same sum).
    report_path = tmp_path / "report.json"
    argv = [sys.executable, str(SCRIPT), "--processes", "4", "--devices", "2", "--steps", "3"]
    proc = subprocess.run(
        [*argv, "--json", str(report_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(report_path.read_text())
    assert report["processes"] == 4 and report["config"]["data"] == 4 and report["config"]["model"] == 2
    assert report["bitwise_equal"] and report["loss_lax"] == report["loss_jaxccl"] and len(report["loss_lax"]) == 3
    launches = report["native_launches"]  # every collective of the step ran on the native executor
    assert all(launches[f"data {c}"] > 0 for c in ("all_gather", "reduce_scatter", "all_reduce"))
    assert launches["model all_reduce"] > 0 and launches["('data', 'model') all_reduce"] > 0
    assert report["loop"] and report["loop_errors"] == []
    assert report["loop_measured"] > 0  # the loop measured the links between processes
    assert "bitwise equal" in proc.stdout and "[Gloo]" not in proc.stdout
