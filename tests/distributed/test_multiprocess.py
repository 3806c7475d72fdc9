"""Two JAX processes x 4 CPU devices on loopback (gloo): the ppermute backend across processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).parents[1] / "workers" / "multiprocess_worker.py"
ROOT = WORKER.parent.parent
TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_ppermute_backend_across_two_processes():
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for var in ("XLA_FLAGS", "PJRT_NPROC"):  # the workers set their own device count
        env.pop(var, None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail(f"workers did not finish within {TIMEOUT_S} s:\n" + "\n----\n".join(o[-3000:] for o in outs))
    report = "\n----\n".join(
        f"process {i} (rc {p.returncode}):\n{o[-4000:]}" for i, (p, o) in enumerate(zip(procs, outputs))
    )
    assert all(p.returncode == 0 for p in procs), report
    for out in outputs:
        assert "ALL OK" in out, report
        checks = [line for line in out.splitlines() if line.startswith("CHECK ")]
        assert len(checks) == 12, report  # 4 collectives x 2 dtypes, + 4 ordered-sum checks
        assert not any("MISMATCH" in c for c in checks), report
