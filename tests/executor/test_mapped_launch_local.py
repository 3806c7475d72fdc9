"""The mapped-launch harness in one process: the CUDA interpreter's protocol on host threads, against NumPy.

``jaxccl._native._mapped_launch_run`` runs a launch the way the CUDA executor does across processes (core
API, ``start_mapped_proxy``, flag regions kept per slot, a new epoch per launch), each rank's threadblocks
on host threads (xla_ffi/transport/handshake_harness.h). Here every rank of the attached group is in this
process, so the threads' protocol is checked without a second process (tests/distributed/test_mapped_launch.py
runs it across two).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxccl.distributed.transport import unavailable_reason

native = pytest.importorskip("jaxccl.runtime.native", reason="jaxccl._native is not built (pip install -e .)")
pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"{unavailable_reason()}")

N = 4


@pytest.fixture
def local_group():
    """A one-process transport attached with every rank of a group of N in this process."""
    from jaxccl.distributed.transport import ProcessTransport

    with ProcessTransport(0, 1) as t:
        native.module().set_process_group(t._t.capsule(), 0, [[0] * N])
        try:
            yield
        finally:
            native.module().clear_process_group()


def _schedules():
    from jaxccl.runtime.default_schedules import direct_allgather
    from jaxccl.synth.baselines import direct_reduce_scatter, ordered_allreduce, ring_allgather, ring_allreduce

    return [
        ("all_gather", direct_allgather(N), np.float32, 0),
        ("all_gather", ring_allgather(N), np.float32, 4),
        ("reduce_scatter", direct_reduce_scatter(N), np.float32, 0),
        ("all_reduce", ordered_allreduce(N), np.float32, 0),
        ("all_reduce", ring_allreduce(N), np.int32, 3),
    ]


def _expected(collective: str, inputs: list[np.ndarray], elems: int) -> list[np.ndarray]:
    def ordered_sum(blocks):
        acc = np.zeros_like(blocks[0])
        for b in blocks:
            acc = acc + b
        return acc

    if collective == "all_gather":
        return [np.concatenate(inputs)] * N
    if collective == "reduce_scatter":
        return [ordered_sum([x[r * elems : (r + 1) * elems] for x in inputs]) for r in range(N)]
    return [ordered_sum(inputs)] * N


@pytest.mark.parametrize("case", range(5))
def test_harness_runs_the_interpreter_protocol_bitwise(local_group, case):
    collective, schedule, dtype, tiles = _schedules()[case]
    slot = native.new_slot()
    native.install(slot, schedule, num_slots=2)
    rng = np.random.default_rng(case)
    elems = 3000
    size = elems * (N if collective == "reduce_scatter" else 1)
    for launch in range(3):  # the slot's regions are reused with a new epoch each time
        if dtype == np.int32:
            inputs = [rng.integers(1, 2**20, size, dtype=np.int32) for _ in range(N)]
        else:
            inputs = [(rng.standard_normal(size) * 10 + 0.25).astype(dtype) for _ in range(N)]
        want = _expected(collective, inputs, elems)
        outs = [np.zeros_like(w) for w in want]
        result = native.module()._mapped_launch_run(slot, 0, list(range(N)), inputs, outs, 0, "host", tiles)
        assert result["error"] == "" and result["rank_errors"] == [(0, 0, 0)] * N, result
        assert all(o.tobytes() == w.tobytes() for o, w in zip(outs, want)), (case, launch)
    assert native.launch_count(slot) == 3
    native.remove(slot)


def test_harness_names_what_is_missing(local_group):
    from jaxccl.runtime.default_schedules import direct_allgather

    slot = native.new_slot()
    native.install(slot, direct_allgather(N))
    x = [np.ones(8, np.float32) for _ in range(N)]
    outs = [np.zeros(8 * N, np.float32) for _ in range(N)]
    result = native.module()._mapped_launch_run(slot, 0, [0, 1], x[:2], outs[:2])
    assert "runs 4 ranks of group 0, got 2 calls" in result["error"]
    result = native.module()._mapped_launch_run(slot, 3, list(range(N)), x, outs)
    assert "group 3 is not one of the 1 groups" in result["error"]
    result = native.module()._mapped_launch_run(slot, 0, list(range(N)), x, [np.zeros(8, np.float32)] * N)
    assert "output has 8 elements" in result["error"]
    native.module().clear_process_group()
    result = native.module()._mapped_launch_run(slot, 0, list(range(N)), x, outs)
    assert "jaxccl.distributed.transport.attach" in result["error"]
    native.remove(slot)
