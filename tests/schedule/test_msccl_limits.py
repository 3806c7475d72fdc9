"""MSCCL export within the MSCCL runtime's limits: steps over ``cnt`` 72 split, the rest refused clearly.

A split export is re-imported, validated and run bitwise against ``jax.lax``
for every collective.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from programs import collective

import jaxccl
from jaxccl.errors import ScheduleError
from jaxccl.schedule import Schedule, from_msccl_xml
from jaxccl.schedule.msccl_xml import MSCCL_MAX_COUNT, split_counts, to_msccl_xml
from jaxccl.synth import direct_alltoall, ring_allgather, ring_allreduce, ring_reduce_scatter

N = 4
COARSE = 100  # every chunk of the baseline becomes 100: every op moves more than MSCCL's 72


def coarse(s: Schedule, k: int) -> Schedule:
    """``s`` with each chunk cut into ``k`` (every offset and count times ``k``): the same program."""
    ranks = tuple(
        tuple(
            tb.__class__(
                tuple(
                    op.__class__(op.kind, op.src, op.src_off * k, op.dst, op.dst_off * k, op.count * k, op.deps)
                    for op in tb.ops
                ),
                tb.send_peer,
                tb.recv_peer,
                tb.channel,
            )
            for tb in tbs
        )
        for tbs in s.ranks
    )
    return s.replace(chunks_per_period=s.chunks_per_period * k, scratch_chunks=s.scratch_chunks * k, ranks=ranks)


SCHEDULES = {
    "all_gather": lambda: ring_allgather(N, channels=2),
    "all_to_all": lambda: direct_alltoall(N),
    "reduce_scatter": lambda: ring_reduce_scatter(N),
    "all_reduce": lambda: ring_allreduce(N, channels=2),
}


@pytest.mark.parametrize("coll", sorted(SCHEDULES))
def test_steps_over_the_count_limit_are_split_and_run_bitwise(coll):
    big = coarse(SCHEDULES[coll](), COARSE)
    big.validate()
    assert max(op.count for tbs in big.ranks for tb in tbs for op in tb.ops) > MSCCL_MAX_COUNT
    text = to_msccl_xml(big)
    counts = [int(c) for c in re.findall(r' cnt="(\d+)"', text)]
    assert counts and max(counts) <= MSCCL_MAX_COUNT
    split = from_msccl_xml(text)
    assert split.num_ops > big.num_ops
    split.validate()

    mesh = Mesh(np.array(jax.devices()[:N]), ("d",))
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    comm.install(coll, split)
    rng = np.random.default_rng(11)
    elems = N * big.chunks_per_period * 3  # per rank: whole chunks of every buffer
    if coll in ("reduce_scatter", "all_reduce"):  # ring sums: integers make every order exact
        x = rng.integers(-1000, 1000, size=N * elems).astype(np.int32) | 1
    else:
        x = (rng.standard_normal(N * elems) + 0.25).astype(np.float32)

    def run(lib):
        body = lambda v: collective(lib, coll, v)  # noqa: E731
        return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x))

    with comm:
        got = run(jaxccl)
    want = run(jax.lax)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    comm.close()


def test_split_keeps_dependencies_on_the_last_piece():
    s = coarse(ring_allreduce(N, channels=2), COARSE)
    split = split_counts(s, MSCCL_MAX_COUNT)
    split.validate()
    for tbs, new_tbs in zip(s.ranks, split.ranks):
        # Index of the last piece of every original op, per threadblock.
        ends = [np.cumsum([-(-op.count // MSCCL_MAX_COUNT) for op in tb.ops]) - 1 for tb in tbs]
        for tb, new_tb in zip(tbs, new_tbs):
            assert sum(op.count for op in new_tb.ops) == sum(op.count for op in tb.ops)
            assert max(op.count for op in new_tb.ops) <= MSCCL_MAX_COUNT
            assert sum(len(op.deps) for op in new_tb.ops) == sum(len(op.deps) for op in tb.ops)
            for op in new_tb.ops:
                assert all(di in ends[dt] for dt, di in op.deps)
    assert split_counts(s, 10**9) is s
    with pytest.raises(ScheduleError, match="max_count"):
        split_counts(s, 0)


def test_limits_that_cannot_be_split_are_refused():
    with pytest.raises(ScheduleError, match="needs 301 steps .* allows 256"):
        to_msccl_xml(ring_allgather(300))
    with pytest.raises(ScheduleError, match="39 threadblocks on channel 0; the MSCCL runtime allows 32"):
        to_msccl_xml(direct_alltoall(40))
