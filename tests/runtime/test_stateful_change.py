"""Model-based testing of change (the CI profile of ``tests/support/stateful_machine.py``).

:class:`~stateful_machine.ChangeMachine` installs, reinstalls (``A -> B -> A``),
stages at agreed calls, hot-swaps from another thread, resizes, changes dtypes,
injects link faults and reopens communicators, over every baseline and
synthesized schedule of every collective, checking every result bitwise
against ``jax.lax`` and every launch's table version against the model. Here
it runs a short, derandomized profile (a fresh harness per example, so a
failing example replays from the same state); ``benchmarks/correctness/stateful_change.py``
runs the same machine for an hour, batched.

Two direct checks go with it: the sequence that first showed the executor's
stale-region bug (recursive doubling -> ring -> recursive doubling AllGather,
64 float32 per rank), and that both checkers (on the host, and inside the
batched program) report a deliberately wrong schedule.
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from stateful_machine import SIZE_LEVELS, ChangeMachine, CheckFailure, Harness  # noqa: E402

from jaxccl.schedule import Buffer, Schedule, ScheduleBuilder  # noqa: E402

N = 8
LEVEL_64 = next(i for i, (elems, _) in enumerate(SIZE_LEVELS) if elems == 64)
EXECUTOR_TIMEOUT_S = 15.0  # a stuck collective fails in seconds, not the default minute (shrinking replays it)


@pytest.fixture(autouse=True, scope="module")
def _short_executor_deadline():
    from jaxccl.runtime import native

    before = native.get_timeout()
    native.set_timeout(EXECUTOR_TIMEOUT_S)
    yield
    native.set_timeout(before)


class CIChange(ChangeMachine):
    """A fresh harness (communicators, model) per example; one collective per jitted call, compared on the host."""

    harness_factory = staticmethod(lambda: Harness(mode="host", strict=False))
    owns_harness = True
    raise_at_teardown = True


TestStatefulChange = CIChange.TestCase
# 12 examples of 20 steps run every rule at least 8 times (about 12 s); the long profile runs for an hour.
TestStatefulChange.settings = settings(
    max_examples=12,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def test_recursive_doubling_ring_recursive_doubling_all_gather():
    """The reported sequence, on a fresh default communicator each time: every result bitwise equal to jax.lax.

    The bug it found showed on some runs only (a receiver read a flag word left by the other
    schedule's layout before the sender wrote it), so the sequence runs five times.
    """
    h = Harness(mode="host", strict=True)
    try:
        for _ in range(5):
            h.reopen("plain", check=False)
            h.model("plain").level, h.model("plain").dtype = LEVEL_64, "float32"
            for key in ("recursive_doubling", "ring", "recursive_doubling"):
                h.install("plain", "all_gather", key)
                h.call("plain", "all_gather")
        assert h.stats.collectives == 15 and not h.failures
    finally:
        h.close()


def _swapped_all_gather(n: int) -> Schedule:
    """A wrong AllGather: rank n-1 receives the blocks of ranks 0 and 1 in each other's places."""
    b = ScheduleBuilder("all_gather", num_ranks=n, chunks_per_period=1)
    for r in range(n):
        b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        for k in range(1, n):
            d = (r + k) % n
            pos = 1 - r if d == n - 1 and r in (0, 1) else r
            b.transfer(r, d, (Buffer.INPUT, 0), (Buffer.OUTPUT, pos))
    return b.build(name="swapped_all_gather")


@pytest.mark.parametrize("mode", ["host", "batched"])
def test_checkers_report_a_wrong_schedule(mode):
    """Both checkers see a schedule that delivers two blocks to the wrong places (never a silent pass)."""
    h = Harness(mode=mode, strict=False, batch=(4,) * len(SIZE_LEVELS))
    try:
        cm = h.model("plain")
        cm.level = LEVEL_64
        cm.comm.stage_validated("all_gather", _swapped_all_gather(N), interpreter=False)
        ran = h.call("plain", "all_gather", settle=False)
        assert h.stats.mismatching_collectives == ran == (1 if mode == "host" else 4)
        if mode == "host":  # two blocks of one rank
            assert h.stats.mismatching_elements == 2 * SIZE_LEVELS[LEVEL_64][0]
            assert "wrong: rank 7 blocks [0, 1]" in h.failures[0]
        else:
            assert "(4 of 4 collectives differ on rank 7)" in h.failures[0]
        with pytest.raises(CheckFailure):
            h.strict = True
            h.call("plain", "all_gather", settle=False)
    finally:
        h.close()
    assert cm.comm.closed
