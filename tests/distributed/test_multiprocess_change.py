"""Model-based test of change across 2 processes: agreed swaps, A -> B -> A, sizes, dtypes, reopened communicators.

The short profile across processes of the state machine in ``tests/support/stateful_machine.py``
(``tests/workers/multiprocess_change_worker.py`` says which rules and why a seeded walk): 2 processes of
4 CPU devices on jaxccl's transport, every collective after every step compared bitwise with
``jax.lax`` in every process.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from jaxccl.distributed.launch import ProcessResult, launch
from jaxccl.distributed.transport import unavailable_reason as transport_unavailable

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(transport_unavailable() is not None, reason=str(transport_unavailable())),
]

WORKER = Path(__file__).parents[1] / "workers" / "multiprocess_change_worker.py"
STEPS = 40
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def job() -> list[ProcessResult]:
    """One job walks every seed in turn (a job's start costs about as much as a walk)."""
    argv = [sys.executable, str(WORKER), "4", str(STEPS), ",".join(map(str, SEEDS))]
    return launch(argv, 2, env={"JAXCCL_TIMEOUT_S": "60"}, timeout_s=500)


def _walk(output: str, seed: int) -> str | None:
    """What the walk of ``seed`` printed, up to its COUNTS line; None where it did not finish."""
    match = re.search(rf"^SEED {seed}\n(.*?^COUNTS [^\n]*)$", output, re.M | re.S)
    return match.group(1) if match else None


@pytest.mark.parametrize("seed", SEEDS)
def test_changes_across_two_processes_stay_bitwise(job, seed):
    report = "\n".join(f"--- process {i} (rc {r.returncode}):\n{r.output[-4000:]}" for i, r in enumerate(job))
    assert all(r.returncode == 0 or "FAILED" in r.output.splitlines() for r in job), report  # a mismatch: its seed's
    counts = set()
    for r in job:
        walk = _walk(r.output, seed)
        assert walk is not None and "MISMATCH" not in walk, report
        counts.add(re.search(r"COUNTS (.*)", walk).group(1))
    assert len(counts) == 1, report  # every process took the same steps
    fields = dict(kv.split("=") for kv in counts.pop().split())
    assert int(fields["collectives"]) == 4 * STEPS  # every collective after every step
    assert int(fields["swaps"]) >= STEPS // 3 and int(fields["reinstalls"]) >= 1, fields
