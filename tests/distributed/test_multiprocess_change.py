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

from jaxccl.distributed.launch import launch
from jaxccl.distributed.transport import unavailable_reason as transport_unavailable

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(transport_unavailable() is not None, reason=str(transport_unavailable())),
]

WORKER = Path(__file__).parents[1] / "workers" / "multiprocess_change_worker.py"
STEPS = 40


@pytest.mark.parametrize("seed", [0, 1])
def test_changes_across_two_processes_stay_bitwise(seed):
    results = launch(
        [sys.executable, str(WORKER), "4", str(STEPS), str(seed)], 2, env={"JAXCCL_TIMEOUT_S": "60"}, timeout_s=400
    )
    report = "\n".join(f"--- process {i} (rc {r.returncode}):\n{r.output[-4000:]}" for i, r in enumerate(results))
    assert all(r.returncode == 0 for r in results), report
    counts = set()
    for r in results:
        assert "ALL OK" in r.output and "MISMATCH" not in r.output, report
        counts.add(re.search(r"COUNTS (.*)", r.output).group(1))
    assert len(counts) == 1, report  # every process took the same steps
    fields = dict(kv.split("=") for kv in counts.pop().split())
    assert int(fields["collectives"]) == 4 * STEPS  # every collective after every step
    assert int(fields["swaps"]) >= STEPS // 3 and int(fields["reinstalls"]) >= 1, fields
