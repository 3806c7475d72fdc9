"""Size buckets: one compiled program that calls a collective at several sizes runs a schedule per size."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl
from jaxccl.errors import ArgumentError, ScheduleError
from jaxccl.runtime import native
from jaxccl.runtime.communicator import size_bucket
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.synth import baselines
from jaxccl.topology import rail

TOPO = rail(hosts=2, gpus_per_host=4)
SMALL, LARGE = 256, 4096  # elements per rank: AllGather messages of 8 KiB and 128 KiB (float32)


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))


def _program(lib, mesh):
    """Two AllGathers of different sizes and a psum_scatter in one jitted program over both mesh axes."""

    def body(small, large, grads):
        axes = ("a", "b")
        return (
            lib.all_gather(small, axes, tiled=True),
            lib.all_gather(large, axes, tiled=True),
            lib.psum_scatter(grads, axes, tiled=True),
        )

    spec = P(("a", "b"))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec, spec)))


def _inputs(seed):
    rng = np.random.default_rng(seed)
    data = [rng.standard_normal(8 * n).astype(np.float32) + 0.25 for n in (SMALL, LARGE, 8 * SMALL)]
    return [np.where(d == 0, 1.0, d).astype(np.float32) for d in data]


def _check(f, ref, seed):
    xs = _inputs(seed)
    for got, want in zip(f(*xs), ref(*xs)):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.fixture
def comm():
    c = jaxccl.Communicator(
        _mesh(), ("a", "b"), topology=TOPO, backend="cpu", link_emulation=LinkEmulation(), size_buckets=True
    )
    yield c
    c.close()


def test_two_sizes_run_two_schedules_in_one_program_and_swap_without_recompiling(comm):
    mesh = _mesh()
    f, ref = _program(jaxccl, mesh), _program(jax.lax, mesh)
    small_b, large_b = 8 * SMALL * 4, 8 * LARGE * 4  # message sizes (AllGather output per rank)
    ring = baselines.ring_allgather(8)
    comm.install("all_gather", ring, nbytes=large_b)
    with comm:
        _check(f, ref, 0)
        assert f._cache_size() == 1
        s_small, s_large = comm.slot("all_gather", small_b), comm.slot("all_gather", large_b)
        assert s_small != s_large and comm.slot("all_gather") in (s_small, s_large)
        assert native.launch_count(s_small) == native.launch_count(s_large) == 1
        assert comm.launched_schedule("all_gather", nbytes=small_b).name == "direct_allgather"
        assert comm.launched_schedule("all_gather", nbytes=large_b).name == "ring_allgather"
        assert native.last_launch_version(s_large) == native.current_version(s_large)
        # each slot holds the compilation of its bucket's schedule
        for nb, sched in ((small_b, comm.schedule("all_gather")), (large_b, ring)):
            st = comm.swap_state("all_gather", nbytes=nb)
            assert (
                st["current_checksum"]
                == jaxccl.schedule.table.header(jaxccl.schedule.table.compiled_table(sched, num_slots=8))["checksum"]
            )
        assert set(comm.buckets("all_gather")) == {size_bucket(small_b), size_bucket(large_b)}
        # a bucket swap: only the small slot changes, the program is not recompiled
        tree = jaxccl.synth.all_gather(TOPO)
        before = native.current_version(s_large)
        comm.install("all_gather", tree, nbytes=small_b)
        _check(f, ref, 1)
        assert comm.launched_schedule("all_gather", nbytes=small_b).name == tree.name
        assert native.current_version(s_large) == before
        # without a size: every bucket runs it, own schedules dropped
        comm.install("all_gather", baselines.ring_allgather(8, bidirectional=True))
        _check(f, ref, 2)
        assert comm.buckets("all_gather") == {size_bucket(small_b): None, size_bucket(large_b): None}
        names = {comm.launched_schedule("all_gather", nbytes=nb).name for nb in (small_b, large_b)}
        assert names == {comm.schedule("all_gather").name}
        assert native.last_launch_version(s_small) == native.current_version(s_small)
        assert native.last_launch_version(s_large) == native.current_version(s_large)
        assert f._cache_size() == 1
    slots = [s_small, s_large]
    comm.close()
    for s in slots:  # close() released every bucket's slot
        with pytest.raises(jaxccl.JaxcclError):
            native.swap_state(s)


def test_bucket_slots_are_measured_and_timed(comm):
    mesh = _mesh()
    f, ref = _program(jaxccl, mesh), _program(jax.lax, mesh)
    with comm:
        _check(f, ref, 3)
    for nb in (8 * SMALL * 4, 8 * LARGE * 4):
        assert native.last_launch_seconds(comm.slot("all_gather", nb)) > 0
    assert comm.telemetry().samples.sum() > 0  # the measurements of the bucket slots reached the network


def test_bucket_bad_input():
    mesh = _mesh()
    plain = jaxccl.Communicator(mesh, ("a", "b"), backend="cpu")
    with pytest.raises(ArgumentError, match="size_buckets"):
        plain.install("all_gather", baselines.ring_allgather(8), nbytes=1024)
    assert plain.slot("all_gather", 1024) == plain.slot("all_gather")  # no buckets: one slot
    comm = jaxccl.Communicator(mesh, ("a", "b"), backend="cpu", size_buckets=True)
    for bad in (0, -5, 1.5, "8", True):
        with pytest.raises(ArgumentError, match="nbytes"):
            comm.install("all_gather", baselines.ring_allgather(8), nbytes=bad)
    with pytest.raises(ScheduleError):
        comm.install("all_gather", baselines.ring_allgather(4), nbytes=1024)
    with pytest.raises(ScheduleError):
        comm.install("all_gather", baselines.direct_reduce_scatter(8), nbytes=1024)
    with pytest.raises(ArgumentError, match="size_buckets"):
        jaxccl.Communicator(mesh, ("a", "b"), backend="cpu", size_buckets=1)
    assert comm.buckets("all_gather") == {}


def test_ppermute_buckets_follow_the_bucket_schedule():
    mesh = _mesh()
    comm = jaxccl.Communicator(mesh, ("a", "b"), backend="ppermute", size_buckets=True)
    f, ref = _program(jaxccl, mesh), _program(jax.lax, mesh)
    comm.install("all_gather", baselines.ring_allgather(8), nbytes=8 * LARGE * 4)
    with comm:
        _check(f, ref, 4)
    assert comm.launched_schedule("all_gather", nbytes=8 * LARGE * 4).name == "ring_allgather"
