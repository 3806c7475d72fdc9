"""Mapped launches across processes on a CPU: what a GPU adds to the proxy is only memory and launch wiring.

Each test starts 2 processes of 2 ranks each (tests/workers/mapped_launch_worker.py), joined by the UCX
transport, whose launches run through ``jaxccl._native._mapped_launch_run``: every local rank's
threadblocks are host threads that follow the CUDA interpreter's protocol over flag regions in host
memory, and the one proxy starts through the core API's ``start_mapped_proxy``, as for the CUDA
executor (xla_ffi/transport/handshake_harness.h). Results are compared bitwise with NumPy on both
wire layouts (a message and its trailer in one transfer, or apart as from device memory).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxccl.distributed.launch import ProcessResult, launch
from jaxccl.distributed.transport import unavailable_reason as transport_unavailable

WORKER = Path(__file__).parents[1] / "workers" / "mapped_launch_worker.py"
TRANSPORT = transport_unavailable()
PEER_FAILED = 7  # core/protocol.h, ProtocolError::kPeerFailed
pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(TRANSPORT is not None, reason=f"{TRANSPORT}")]


def _report(results: list[ProcessResult]) -> str:
    return "\n----\n".join(f"process {r.process_id} (rc {r.returncode}):\n{r.output[-4000:]}" for r in results)


def test_mapped_launches_across_two_processes_are_bitwise_and_fail_by_name():
    results = launch([sys.executable, str(WORKER), "checks"], 2, env={"JAXCCL_TIMEOUT_S": "30"}, timeout_s=300)
    report = _report(results)
    assert all(r.returncode == 0 for r in results), report
    for r in results:
        checks = [line for line in r.output.splitlines() if line.startswith("CHECK ")]
        assert len(checks) == 2 * 5 + 1 + 2 + 1 + 2, report  # 2 wires x 5 tables, meter, after each failure
        assert all(re.match(r"CHECK .* ok( |$)", line) for line in checks), report
        assert "ALL OK" in r.output, report
    # Process 0 sends a message and its trailer in one transfer, process 1 as two: the first to receive the
    # other's refuses it by its size (when it posts the receive, or when the message arrives); the other may
    # then wait for messages never sent, until its deadline.
    wires = [re.search(r"WIRES (.*)", r.output).group(1) for r in results]
    assert "in process 1" in wires[0] and "in process 0" in wires[1], report
    assert "expected 16384 and a trailer of 16" in wires[0] or "larger than the 16384-byte receive" in wires[1], report
    out = results[0].output
    refused = re.search(r"REFUSED \[(.*?)\] (.*)", out)
    assert refused, report
    assert "stale message" in refused.group(2) and "from process 1" in refused.group(2), report
    assert refused.group(1) == f"({PEER_FAILED}, -1, -1), ({PEER_FAILED}, -1, -1)", report  # the ranks stopped
    deadline = re.search(r"DEADLINE \[(.*?)\] (.*)", out)
    assert deadline, report
    assert "deadline exceeded" in deadline.group(2) and "in process 1" in deadline.group(2), report
    assert deadline.group(1) == f"({PEER_FAILED}, -1, -1), ({PEER_FAILED}, -1, -1)", report


def test_a_killed_process_fails_the_mapped_launch_naming_it():
    def kill_when_ready(procs: list[subprocess.Popen]) -> None:
        for line in procs[0].stdout:
            if "START" in line:
                break
        time.sleep(0.5)  # process 0 is inside its launch now
        os.kill(procs[-1].pid, signal.SIGKILL)

    deadline_s = 20.0
    results = launch(
        [sys.executable, str(WORKER), "kill"],
        2,
        env={"JAXCCL_TIMEOUT_S": str(deadline_s)},
        timeout_s=200,
        during=kill_when_ready,
    )
    report = _report(results)
    assert results[0].returncode == 0, report
    match = re.search(r"RESULT ([\d.]+) ([\d,]+) (.*)", results[0].output)
    assert match, report
    seconds, codes, message = float(match.group(1)), match.group(2), match.group(3)
    assert "process 1" in message, message
    assert codes == f"{PEER_FAILED},{PEER_FAILED}", report  # kPeerFailed reached both local ranks' error words
    assert seconds < deadline_s + 5, seconds
