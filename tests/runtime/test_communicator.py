"""Communicator: scope, defaults, install/hot-swap without recompiling, validation, many async steps."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl
from jaxccl.errors import ScheduleError
from jaxccl.runtime import communicator as comm_mod
from jaxccl.schedule import Buffer, ScheduleBuilder
from jaxccl.synth import baselines

N = 4


def _mesh(n: int = N) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("d",))


def _jit(fn, mesh, out_specs=None):
    out_specs = P("d") if out_specs is None else out_specs
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=out_specs))


def _x(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _fold(terms):
    acc = np.zeros_like(terms[0])
    for t in terms:  # ((0 + a) + b) + ...: float32 adds in the given order
        acc = acc + t
    return acc


def _reduce_scatter_in_order(x: np.ndarray, n: int, order_of) -> np.ndarray:
    """psum_scatter(tiled, dim 0) of per-device blocks, owner r summing sources in order_of(r)."""
    blocks = x.reshape(n, n, -1)  # [source, destination block, elements]
    return np.concatenate([_fold([blocks[s, r] for s in order_of(r)]) for r in range(n)])


@functools.cache
def _rs_program():
    return _jit(lambda v: jaxccl.psum_scatter(v, "d", tiled=True), _mesh())


@pytest.mark.parametrize("backend", ["cpu", "ppermute"])
def test_install_changes_the_result_path(backend):
    """A ring ReduceScatter sums in ring order, not rank order: the result shows which schedule ran."""
    x = _x((N * N * 64,), seed=1)
    comm = jaxccl.Communicator(_mesh(), "d", backend=backend)
    f = _rs_program()
    ordered = _reduce_scatter_in_order(x, N, lambda r: range(N))
    ring = _reduce_scatter_in_order(x, N, lambda r: [(r + 1 + k) % N for k in range(N)])
    assert ordered.tobytes() != ring.tobytes()  # the data tells the two orders apart
    with comm:
        before = np.asarray(f(x))
        size = f._cache_size()
        comm.install("psum_scatter", baselines.ring_reduce_scatter(N))
        after = np.asarray(f(x))
        assert comm.schedule("reduce_scatter").name == "ring_reduce_scatter"
        # native backends swap the table under the compiled program; ppermute retraces once
        assert f._cache_size() == (size if backend == "cpu" else size + 1)
    assert before.tobytes() == ordered.tobytes()
    assert after.tobytes() == ring.tobytes()


def test_hot_swap_without_recompiling_even_with_another_chunk_count():
    from jaxccl.runtime import native

    mesh = _mesh(8)
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    traces = []

    def body(v):
        traces.append(1)
        return jaxccl.all_gather(v, "d", tiled=True)

    f = _jit(body, mesh)
    x = _x((8 * 30,), seed=2)  # 30 elements per rank: chunk sizes differ for C=4
    want = np.asarray(_jit(lambda v: jax.lax.all_gather(v, "d", tiled=True), mesh)(x))
    slot = comm.slot("all_gather")
    with comm:
        assert np.asarray(f(x)).tobytes() == want.tobytes()
        assert f._cache_size() == 1
        for s in (baselines.ring_allgather(8, channels=4), baselines.recursive_doubling_allgather(8)):
            comm.install("all_gather", s)
            version = comm.swap_state("all_gather")["staged_version"]
            assert version > native.current_version(slot)  # staged, not active yet
            assert np.asarray(f(x)).tobytes() == want.tobytes()
            assert f._cache_size() == 1 and len(traces) == 1
            assert native.last_launch_version(slot) == version == native.current_version(slot)
        assert comm.schedule("all_gather").name == "recursive_doubling_allgather"


def test_scope_selects_the_communicator_and_retraces_per_communicator():
    mesh = _mesh()
    x = _x((N * 8,), seed=3)
    f = _jit(lambda v: jaxccl.all_to_all(v, "d", 0, 0, tiled=True), mesh)
    want = np.asarray(_jit(lambda v: jax.lax.all_to_all(v, "d", 0, 0, tiled=True), mesh)(x))
    a = jaxccl.Communicator(mesh, "d", backend="cpu")
    b = jaxccl.Communicator(mesh, "d", backend="ppermute")
    outs = [f(x)]  # the default communicator
    with a:
        outs.append(f(x))
        with b:
            outs.append(f(x))
            assert comm_mod.current("d") is b
        assert comm_mod.current("d") is a
    assert comm_mod.current("d") is None
    assert f._cache_size() == 3
    assert all(np.asarray(o).tobytes() == want.tobytes() for o in outs)


def test_defaults_and_backend_resolution():
    mesh = _mesh()
    comm = jaxccl.Communicator(mesh, "d")
    assert comm.backend == "cpu"  # "auto" without CUDA support
    names = {c: comm.schedule(c).name for c in ("all_gather", "all_to_all", "reduce_scatter", "all_reduce")}
    assert names == {
        "all_gather": "direct_allgather",
        "all_to_all": "direct_alltoall",
        "reduce_scatter": "direct_reduce_scatter",
        "all_reduce": "direct_allreduce",
    }
    assert comm.schedule("psum_scatter") is comm.schedule("reduce_scatter")
    default = comm_mod.default_communicator("d", N)
    assert default is comm_mod.default_communicator("d", N)
    assert default.schedule("all_gather").num_ranks == N


@pytest.mark.parametrize("backend", ["cpu", "ppermute"])
def test_psum_as_reduce_scatter_plus_all_gather(backend):
    """With a topology and no all_reduce schedule, psum is ReduceScatter + AllGather (padded to N)."""
    mesh = _mesh()
    comm = jaxccl.Communicator(mesh, "d", topology=jaxccl.topology.single_node(N), backend=backend)
    assert comm.schedule("all_reduce") is None
    x = _x((N * 7, 3), seed=4)  # 21 elements per rank: not a multiple of N
    f = _jit(lambda v: jaxccl.psum(v, "d"), mesh, out_specs=P())
    want = _jit(lambda v: jax.lax.psum(v, "d"), mesh, out_specs=P())(x)
    with comm:
        got = f(x)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def _broken_all_gather(n: int):
    """Rank 0's chunk never reaches rank n-1: the interpreter must refuse it."""
    b = ScheduleBuilder("all_gather", num_ranks=n, chunks_per_period=1)
    for r in range(n):
        b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        for d in range(n):
            if d != r and not (r == 0 and d == n - 1):
                b.transfer(r, d, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
    return b.build(name="broken")


def test_install_validates():
    comm = jaxccl.Communicator(_mesh(), "d", backend="ppermute")
    with pytest.raises(ScheduleError, match="N=8 ranks.*4 devices"):
        comm.install("all_gather", baselines.ring_allgather(8))
    with pytest.raises(ScheduleError, match="implements all_to_all, not all_gather"):
        comm.install("all_gather", baselines.direct_alltoall(N))
    with pytest.raises(ScheduleError):
        comm.install("all_gather", _broken_all_gather(N))
    with pytest.raises(ValueError, match="unknown collective"):
        comm.install("broadcast", baselines.ring_allgather(N))
    assert comm.schedule("all_gather").name == "direct_allgather"  # nothing changed


def test_record_staged_takes_only_a_validated_schedule_that_fits():
    comm = jaxccl.Communicator(_mesh(), "d", backend="ppermute")
    ring = baselines.ring_allgather(N)
    with pytest.raises(ScheduleError, match="has not passed validate"):
        comm.record_staged("all_gather", ring)
    with pytest.raises(ScheduleError, match="implements all_to_all, not all_gather"):
        comm.record_staged("all_gather", baselines.direct_alltoall(N).validate())
    assert comm.schedule("all_gather").name == "direct_allgather"  # refusals change nothing
    comm.record_staged("all_gather", ring.validate())
    assert comm.schedule("all_gather") is ring


def test_constructor_errors():
    mesh = _mesh()
    with pytest.raises(ValueError, match="no axis 'x'.*\\('d',\\)"):
        jaxccl.Communicator(mesh, "x")
    with pytest.raises(ValueError, match="backend='nccl' is not one of 'cpu', 'cuda', 'ppermute', 'auto'"):
        jaxccl.Communicator(mesh, "d", backend="nccl")
    with pytest.raises(ValueError, match="8 GPUs but mesh axis 'd' has 4"):
        jaxccl.Communicator(mesh, "d", topology=jaxccl.topology.single_node(8))


def test_wrong_axis_size_in_scope():
    comm = jaxccl.Communicator(_mesh(), "d", backend="ppermute")
    f = _jit(lambda v: jaxccl.all_gather(v, "d"), _mesh(2))
    with comm, pytest.raises(ValueError, match="built for 4"):
        f(_x((4,)))


def test_300_async_steps_on_8_devices():
    mesh = _mesh(8)
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    # all_to_all (0 -> 0) twice is the identity; +1 per step keeps every step's output distinct
    step = jax.jit(
        jax.shard_map(
            lambda v: jaxccl.all_to_all(v, "d", 0, 0, tiled=True) + 1, mesh=mesh, in_specs=P("d"), out_specs=P("d")
        )
    )
    x0 = np.random.default_rng(5).integers(-100, 100, size=(8 * 8 * 16,)).astype(np.int32)
    y = x0
    with comm:
        for _ in range(300):  # no blocking in between: XLA queues the launches
            y = step(y)
        y = np.asarray(y)
    assert y.tobytes() == (x0 + 300).tobytes()


def test_stage_validated_refuses_what_does_not_fit_and_checks_unvalidated():
    mesh = _mesh()
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    running = comm.schedule("all_gather")
    with pytest.raises(ScheduleError, match=r"stage_validated\('all_gather'\): .* is for N=8 ranks but axis 'd' has 4"):
        comm.stage_validated("all_gather", baselines.ring_allgather(8).validate())
    with pytest.raises(ScheduleError, match="implements reduce_scatter, not all_gather"):
        comm.stage_validated("all_gather", baselines.ring_reduce_scatter(N).validate())
    # Never validated and wrong (a receive that lands nowhere useful): the interpreter runs and refuses it.
    b = ScheduleBuilder("all_gather", num_ranks=N, chunks_per_period=1)
    for r in range(N):
        b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
    broken = b.build()
    assert not broken.validated
    with pytest.raises(ScheduleError):
        comm.stage_validated("all_gather", broken)
    assert comm.schedule("all_gather") is running
    f = _jit(lambda v: jaxccl.all_gather(v, "d", tiled=True), mesh)
    x = _x((N * 8,), seed=3)
    with comm:
        assert np.array_equal(np.asarray(f(x)).reshape(N, -1), np.tile(x, (N, 1)))


def test_close_and_garbage_collection_free_the_native_slots():
    import gc

    from jaxccl.runtime import native
    from jaxccl.runtime.emulated import LinkEmulation

    mesh = _mesh()
    topo = jaxccl.topology.rail(hosts=2, gpus_per_host=2)
    jax.clear_caches()  # programs of earlier tests hold their communicators' slots
    gc.collect()
    base = native.stats()["slots"]
    f = _jit(lambda v: jaxccl.all_gather(v, "d", tiled=True), mesh)
    for k in range(20):  # used in a jitted program, then dropped without close(): garbage collection frees them
        used = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu", link_emulation=LinkEmulation())
        with used:
            f(_x((N * 4,), seed=k)).block_until_ready()
    del used
    gc.collect()
    assert native.stats()["slots"] > base  # the programs traced with them are still cached: they keep the slots
    jax.clear_caches()
    gc.collect()
    assert native.stats()["slots"] == base
    for _ in range(20):  # never used in a program: freed as soon as they are dropped
        jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu", link_emulation=LinkEmulation())
    gc.collect()
    assert native.stats()["slots"] == base
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    assert native.stats()["slots"] > base
    comm.close()
    comm.close()  # idempotent
    assert comm.closed and native.stats()["slots"] == base
    with pytest.raises(jaxccl.ExecutorError, match="is closed"):
        comm.install("all_gather", baselines.ring_allgather(N))
    with pytest.raises(Exception, match="is closed"), comm:
        f(_x((N * 4,)))
