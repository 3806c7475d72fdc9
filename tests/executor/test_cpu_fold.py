"""CPU executor folds: waiting for a late term never deadlocks, and a fold that writes its receivers' copies
gives jax.lax's bits."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl
from jaxccl.schedule import Buffer, Schedule, ScheduleBuilder

I, O = Buffer.INPUT, Buffer.OUTPUT


def _dependent_term_allreduce() -> Schedule:
    """2-rank AllReduce in which rank 0's fold of chunk 0 gets its second term only after it started.

    Rank 0 copies its own term of chunk 0, then sends its chunk-1 term; rank 1 sends its chunk-0 term
    only once that arrived. A fold that waited for all its terms before starting would wait forever.
    """
    b = ScheduleBuilder("all_reduce", num_ranks=2, chunks_per_period=2)
    head = b.copy(0, (I, 0), (O, 0))
    got = b.transfer(0, 1, (I, 1), (O, 1), after=[head])
    folded0 = b.transfer(1, 0, (I, 0), (O, 0), after=[got], reduce=True, recv_after=[head])
    folded1 = b.reduce(1, (I, 1), (O, 1), after=[got])
    b.transfer(0, 1, (O, 0), (O, 0), channel=1, after=[folded0])
    b.transfer(1, 0, (O, 1), (O, 1), channel=1, after=[folded1])
    return b.build(name="dependent_term_allreduce", info={"ordered_reduction": True})


@pytest.mark.parametrize("dtype", [np.float32, np.int32, jax.numpy.bfloat16])
def test_fold_whose_term_depends_on_its_own_progress_completes(dtype):
    schedule = _dependent_term_allreduce().validate(ordered_reduction=True)
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    x = (np.random.default_rng(3).standard_normal(2 * 2 * 1024) * 100).astype(dtype)
    f = jax.jit(jax.shard_map(lambda v: jaxccl.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    ref = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    with comm:
        comm.install("psum", schedule)
        assert comm.schedule("all_reduce").name == "dependent_term_allreduce"
        for _ in range(3):
            out = np.asarray(f(x))
    assert out.tobytes() == np.asarray(ref(x)).tobytes()
    assert np.any(out != 0)


@pytest.mark.parametrize("n", [2, 8])
def test_default_allreduce_receivers_copies_match_lax(n):
    """The default AllReduce's broadcast is written by the folding rank; every rank's copy is lax's."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    x = np.random.default_rng(n).standard_normal(n * n * 4099).astype(np.float32)
    f = jax.jit(jax.shard_map(lambda v: jaxccl.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    ref = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    with jaxccl.Communicator(mesh, "d", backend="cpu"):
        outs = [np.asarray(f(x)) for _ in range(3)]
    expected = np.asarray(ref(x)).tobytes()
    assert all(o.tobytes() == expected for o in outs)
