"""The C++ CPU executor behind ``jaxccl_cpu_collective``, driven directly through ``jax.ffi.ffi_call``.

Every collective result is compared bitwise with ``jax.lax`` (or, for
reductions in a non-XLA order, with numpy summing in the schedule's order) on
random data. Schedules come from :class:`jaxccl.schedule.ScheduleBuilder` or
are written out op by op where a test needs a particular op kind.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from handmade import ring_all_gather
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxccl.errors import ExecutorError, ScheduleError
from jaxccl.schedule import Buffer, Op, OpKind, ScheduleBuilder, Threadblock, make_schedule
from jaxccl.schedule.table import compile_table, seal

native = pytest.importorskip("jaxccl.runtime.native", reason="jaxccl._native is not built (pip install -e .)")

I, O, S = Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH
AXIS = "x"
SIZES = [1, 2, 3, 4, 8]


# ----------------------------------------------------------------------------- schedules


def relay_all_gather(n: int, c: int = 1):
    """One threadblock per rank; forwards go through a reused scratch range (rcs, staged sends)."""
    if n == 1:
        return make_schedule("all_gather", 1, c, [[Threadblock((Op(OpKind.COPY, I, 0, O, 0, c),))]])
    ranks = []
    for r in range(n):
        ops = [Op(OpKind.COPY, I, 0, O, r * c, c), Op(OpKind.SEND, I, 0, None, 0, c)]
        for k in range(1, n - 1):
            ops += [Op(OpKind.RECV_COPY_SEND, None, 0, S, 0, c), Op(OpKind.COPY, S, 0, O, ((r - k) % n) * c, c)]
        ops += [Op(OpKind.RECV, None, 0, S, 0, c), Op(OpKind.COPY, S, 0, O, ((r + 1) % n) * c, c)]
        ranks.append([Threadblock(tuple(ops), send_peer=(r + 1) % n, recv_peer=(r - 1) % n)])
    return make_schedule("all_gather", n, c, ranks, scratch_chunks=c, name="relay")


def forwarding_all_to_all(n: int, c: int = 1):
    """Direct all_to_all, except that s -> s+2 travels through scratch on rank s+1."""
    b = ScheduleBuilder("all_to_all", num_ranks=n, chunks_per_period=c, scratch_chunks=n * c)
    for s in range(n):
        b.copy(s, (I, s * c), (O, s * c), c)
        for d in range(n):
            if d == s:
                continue
            if n > 2 and d == (s + 2) % n:
                m = (s + 1) % n
                h = b.transfer(s, m, (I, d * c), (S, s * c), c)
                b.transfer(m, d, (S, s * c), (O, s * c), c, after=[h])
            else:
                b.transfer(s, d, (I, d * c), (O, s * c), c)
    return b.build(name="forwarding")


def ordered_reduce_scatter(n: int, c: int = 1):
    """Chunk r is summed along ranks 0, 1, ..., n-1 (XLA:CPU's order), then sent to rank r."""
    b = ScheduleBuilder("reduce_scatter", num_ranks=n, chunks_per_period=c, scratch_chunks=n * c)
    for r in range(n):
        if n == 1:
            b.copy(0, (I, 0), (O, 0), c)
            break
        h = None
        for k in range(1, n):
            last = k == n - 1 and r == n - 1
            src = (I, r * c) if k == 1 else (S, r * c)
            dst = (O, 0) if last else (S, r * c)
            h = b.transfer(k - 1, k, src, dst, c, reduce=True, reduce_with=(I, r * c), after=[h] if h else [])
        if r != n - 1:
            b.transfer(n - 1, r, (S, r * c), (O, 0), c, after=[h])
    return b.build(name="ordered", info={"ordered_reduction": True})


def ring_reduce_scatter(n: int, c: int = 1):
    """NCCL's ring reduce-scatter with rrs: block b is summed along b+1, b+2, ..., b."""
    if n == 1:
        return make_schedule("reduce_scatter", 1, c, [[Threadblock((Op(OpKind.COPY, I, 0, O, 0, c),))]])
    ranks = []
    for r in range(n):
        ops = [Op(OpKind.SEND, I, ((r - 1) % n) * c, None, 0, c)]
        ops += [Op(OpKind.RECV_REDUCE_SEND, I, ((r - 2 - j) % n) * c, None, 0, c) for j in range(n - 2)]
        ops.append(Op(OpKind.RECV_REDUCE_COPY, I, r * c, O, 0, c))
        ranks.append([Threadblock(tuple(ops), send_peer=(r + 1) % n, recv_peer=(r - 1) % n)])
    return make_schedule("reduce_scatter", n, c, ranks, name="ring-rrs")


def chain_all_reduce(n: int, c: int = 1):
    """Sum along 0..n-1 with rrs, rrcs on n-1, then forward the result 0, 1, ..., n-2 (rcs)."""
    if n == 1:
        return make_schedule("all_reduce", 1, c, [[Threadblock((Op(OpKind.COPY, I, 0, O, 0, c),))]])
    ranks = []
    for r in range(n):
        if r == 0:
            ops = [Op(OpKind.SEND, I, 0, None, 0, c)]
            ops.append(Op(OpKind.RECV_COPY_SEND if n > 2 else OpKind.RECV, None, 0, O, 0, c))
        elif r < n - 1:
            ops = [Op(OpKind.RECV_REDUCE_SEND, I, 0, None, 0, c)]
            ops.append(Op(OpKind.RECV_COPY_SEND if r < n - 2 else OpKind.RECV, None, 0, O, 0, c))
        else:
            ops = [Op(OpKind.RECV_REDUCE_COPY_SEND, I, 0, O, 0, c)]
        ranks.append([Threadblock(tuple(ops), send_peer=(r + 1) % n, recv_peer=(r - 1) % n)])
    return make_schedule("all_reduce", n, c, ranks, name="chain", info={"ordered_reduction": True})


def gather_reduce_all_reduce(n: int, c: int = 1):
    """Every rank gathers all inputs into scratch, then sums them locally in rank order (cpy, re, nop chains)."""
    b = ScheduleBuilder("all_reduce", num_ranks=n, chunks_per_period=c, scratch_chunks=n * c)
    for r in range(n):
        recv = {s: b.transfer(s, r, (I, 0), (S, s * c), c) for s in range(n) if s != r}
        src = [(I, 0) if s == r else (S, s * c) for s in range(n)]
        h = b.copy(r, src[0], (O, 0), c, after=list(recv.values()))  # multi-dependency: nop chain
        for s in range(1, n):
            h = b.reduce(r, src[s], (O, 0), c, after=[h])
    return b.build(name="gather-reduce", info={"ordered_reduction": True})


def deadlocking(n: int = 2):
    """Both ranks receive before they send."""

    def prog(r):
        return [Threadblock((Op(OpKind.RECV, None, 0, O, 1 - r, 1), Op(OpKind.SEND, I, 0)), 1 - r, 1 - r)]

    return make_schedule("all_gather", 2, 1, [prog(0), prog(1)])


# ----------------------------------------------------------------------------- running


def mesh_of(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (AXIS,))


def out_elems(coll: str, n: int, in_elems: int) -> int:
    return {"all_gather": n * in_elems, "reduce_scatter": in_elems // n}.get(coll, in_elems)


def ffi_collective(x, *, slot: int, n: int, coll: str, site: int = 1):
    """The raw FFI call inside shard_map: flat input, coords = [axis_index, 0]."""
    flat = x.reshape(-1)
    coords = jnp.stack([lax.axis_index(AXIS), 0]).astype(jnp.int32)
    out_type = jax.ShapeDtypeStruct((out_elems(coll, n, flat.size),), x.dtype)
    y = jax.ffi.ffi_call("jaxccl_cpu_collective", out_type)(
        flat, coords, slot=np.int64(slot), site=np.int64(site), axis_size=np.int64(n), reduce_op=np.int64(0)
    )
    # ffi_call types its result as unvarying; it differs per device, so say so for check_vma.
    return lax.pcast(y, AXIS, to="varying")


def sharded(mesh: Mesh, x: np.ndarray):
    return jax.device_put(x, NamedSharding(mesh, P(AXIS)))


def run(schedule, x: np.ndarray, *, num_slots: int = 8, validate: bool = True):
    """Installs `schedule` in a fresh slot and runs it on the global array x (rank r owns block r).

    The schedule is first checked by the reference interpreter, except the deliberately broken ones.
    """
    if validate:
        schedule.validate(num_slots=num_slots)
    n = schedule.num_ranks
    slot = native.new_slot()
    try:
        native.install(slot, compile_table(schedule, num_slots=num_slots))
        body = lambda v: ffi_collective(v, slot=slot, n=n, coll=schedule.collective.value)  # noqa: E731
        f = jax.jit(jax.shard_map(body, mesh=mesh_of(n), in_specs=P(AXIS), out_specs=P(AXIS)))
        return np.asarray(f(sharded(mesh_of(n), x)))
    finally:
        native.remove(slot)


def lax_ref(fn, n: int, x: np.ndarray) -> np.ndarray:
    f = jax.jit(jax.shard_map(fn, mesh=mesh_of(n), in_specs=P(AXIS), out_specs=P(AXIS)))
    return np.asarray(f(sharded(mesh_of(n), x)))


def random(shape, dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -(2**30)), min(info.max, 2**30), size=shape, dtype=dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def assert_bitwise(a: np.ndarray, b: np.ndarray):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), "results differ bitwise"


@pytest.fixture
def short_timeout():
    old = native.get_timeout()
    native.set_timeout(0.5)
    yield 0.5
    native.set_timeout(old)


# ----------------------------------------------------------------------------- collectives


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("c, per_rank", [(1, 24), (3, 25), (4, 2)])  # (4, 2): chunks of zero elements
def test_ring_all_gather(n, c, per_rank):
    x = random((n * per_rank,), np.float32, seed=n)
    got = run(ring_all_gather(n, c), x)
    assert_bitwise(got, lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), n, x))


def test_relay_deadlocks_exactly_when_the_interpreter_says_so(short_timeout):
    # With one slot every rank's rcs waits for its downstream neighbour's rcs to free the slot.
    s = relay_all_gather(3, 1)
    with pytest.raises(ScheduleError, match="deadlock with num_slots=1"):
        s.validate(num_slots=1)
    with pytest.raises(Exception, match=r"deadline exceeded: rank [012], threadblock 0, op [0-9] \('(rcs|r)'"):
        run(s, random((3 * 4,), np.float32), num_slots=1, validate=False)
    s.validate(num_slots=2)
    x = random((3 * 4,), np.float32)
    assert_bitwise(run(s, x, num_slots=2), lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), 3, x))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("num_slots", [2, 8])
def test_relay_all_gather_staged(n, num_slots):
    x = random((n * 30,), np.float32, seed=2)
    got = run(relay_all_gather(n, 2), x, num_slots=num_slots)
    assert_bitwise(got, lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), n, x))


@pytest.mark.parametrize(
    "dtype", [np.int8, np.uint16, np.int16, np.uint32, np.bool_, np.complex64, ml_dtypes.bfloat16, np.float16]
)
def test_copies_work_for_any_dtype(dtype):
    n = 4
    x = random((n * 13,), dtype, seed=5)
    got = run(ring_all_gather(n, 2), x)
    assert got.dtype == np.dtype(dtype)
    assert_bitwise(got, lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), n, x))


@pytest.mark.parametrize("n", SIZES)
def test_forwarding_all_to_all(n):
    c = 2
    x = random((n * n * 7,), np.float32, seed=n)
    got = run(forwarding_all_to_all(n, c), x)
    ref = lax_ref(lambda v: lax.all_to_all(v, AXIS, 0, 0, tiled=True), n, x)
    assert_bitwise(got, ref)


def _np_sum(blocks, order, dtype):
    """The blocks summed in `order` from the additive identity, as XLA and the executors do (-0 + -0 is +0)."""
    acc = blocks[order[0]].astype(dtype)
    if len(order) > 1 and (np.issubdtype(np.dtype(dtype), np.floating) or dtype == ml_dtypes.bfloat16):
        acc = (np.zeros((), dtype) + acc).astype(dtype)
    with np.errstate(over="ignore"):  # overflow to inf is part of what the f16 case checks
        for k in order[1:]:
            acc = (acc + blocks[k]).astype(dtype)
    return acc


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.int32])
def test_ordered_reduce_scatter(n, dtype):
    per = 10
    x = random((n * n * per,), dtype, seed=n)
    got = run(ordered_reduce_scatter(n, 2), x)
    inputs = x.reshape(n, n, per)  # [source rank, destination block, element]
    want = np.concatenate([_np_sum(inputs[:, r], list(range(n)), dtype) for r in range(n)])
    assert_bitwise(got, want)
    if dtype in (np.float32, np.int32):  # XLA:CPU sums in ascending rank order too
        assert_bitwise(got, lax_ref(lambda v: lax.psum_scatter(v, AXIS, tiled=True), n, x))


@pytest.mark.parametrize("n", SIZES)
def test_ring_reduce_scatter_rrs(n):
    per = 9
    x = random((n * n * per,), np.float32, seed=3)
    got = run(ring_reduce_scatter(n, 3), x)
    inputs = x.reshape(n, n, per)
    want = np.concatenate([_np_sum(inputs[:, b], [(b + k) % n for k in range(1, n + 1)], np.float32) for b in range(n)])
    assert_bitwise(got, want)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("build", [chain_all_reduce, gather_reduce_all_reduce])
def test_all_reduce(n, build):
    per = 33
    x = random((n * per,), np.float32, seed=n)
    got = run(build(n, 3), x)
    want = np.tile(_np_sum(x.reshape(n, per), list(range(n)), np.float32), n)
    assert_bitwise(got, want)
    assert_bitwise(got, lax_ref(lambda v: lax.psum(v, AXIS), n, x))


def test_f16_special_values_round_like_numpy():
    n = 2
    vals = np.array([65504, 60000, 1e-7, -1e-7, 6e-8, np.inf, -0.0, 0.5, 2049, 3.0], np.float16)
    x = np.concatenate([vals, vals[::-1]])
    got = run(ordered_reduce_scatter(n, 1), np.concatenate([x, x[::-1]]))
    inputs = np.concatenate([x, x[::-1]]).reshape(n, n, -1)
    want = np.concatenate([_np_sum(inputs[:, r], [0, 1], np.float16) for r in range(n)])
    assert_bitwise(got, want)


# ----------------------------------------------------------------------------- errors


def test_unsupported_reduction_dtype():
    x = random((4 * 4,), np.float32).astype(jnp.float8_e4m3fn)  # every dtype case: tests/schedule/test_reductions.py
    with pytest.raises(Exception, match="a sum reduction of dtype F8E4M3FN is not supported"):
        run(ordered_reduce_scatter(4), x)


def test_malformed_tables_are_refused():
    good = compile_table(ring_all_gather(4))
    native.validate_table(good)
    slot = native.new_slot()
    try:
        cases = {
            0: (0x12345678, "word 0 \\(header magic\\)"),
            1: (1, "word 1 \\(header version\\).*unsupported table version"),
            3: (0, "word 3 \\(header num_ranks\\) = 0: num_ranks must be in 1"),
            6: (5, "word 6 \\(header output_chunks\\).*has 4 output chunks"),
            8: (0, "word 8 \\(header num_slots\\)"),
            14: (7, "word 14 \\(header checksum\\).*checksum mismatch"),
            15: (7, "word 15 \\(header reserved\\)"),
            16: (1, "word 16 \\(rank 0 first_threadblock\\)"),
        }
        tb0 = 16 + 2 * 4
        op0 = tb0 + 8 * 12
        cases[tb0 + 1] = (0, "threadblock 0 send_peer.*another rank")
        cases[tb0 + 6] = (5, "threadblock 0 send_conn")
        cases[op0] = (42, "op 0 \\[rank 0, threadblock 0, op 0\\] kind")
        cases[op0 + 3] = (0, "input buffer is read-only")
        cases[op0 + 5] = (9, r"op 0 \[rank 0, threadblock 0, op 0\] count\) = 9: chunks 0..8 of INPUT exceed its 1")
        cases[op0 + 4] = (4, r"dst_off\) = 4: chunks 4..4 of OUTPUT exceed its 4 chunks")
        cases[op0 + 6] = (7, "dependency threadblock")
        cases[op0 + 9] = (1, "reserved, must be 0")
        for word, (value, match) in cases.items():
            bad = good.copy()
            bad[word] = value
            if word != 14:
                bad = seal(bad)  # past the checksum: what the structural checks say
            with pytest.raises(ExecutorError, match=match):
                native.install(slot, bad)
        with pytest.raises(ExecutorError, match="table has 15 words"):
            native.install(slot, good[:15])
        with pytest.raises(ExecutorError, match="implies"):
            native.install(slot, seal(good[:-1]))
        assert native.current_version(slot) == 0  # nothing was installed
        assert native.install(slot, good) == 1
    finally:
        native.remove(slot)
    with pytest.raises(ExecutorError, match=r"schedule slot \d+ was removed"):
        native.install(slot, good)


def test_wrong_axis_size():
    x = random((8 * 4,), np.float32)
    slot = native.new_slot()
    native.install(slot, ring_all_gather(4))
    try:
        body = lambda v: ffi_collective(v, slot=slot, n=8, coll="all_gather")  # noqa: E731
        f = jax.jit(jax.shard_map(body, mesh=mesh_of(8), in_specs=P(AXIS), out_specs=P(AXIS)))
        with pytest.raises(Exception, match="schedule for N=4 installed on an axis of size 8"):
            np.asarray(f(sharded(mesh_of(8), x)))
    finally:
        native.remove(slot)


def test_wrong_output_size():
    n = 4
    slot = native.new_slot()
    native.install(slot, ring_all_gather(n))
    try:

        def body(v):
            coords = jnp.stack([lax.axis_index(AXIS), 0]).astype(jnp.int32)
            out = jax.ShapeDtypeStruct((v.size * n + 1,), v.dtype)
            y = jax.ffi.ffi_call("jaxccl_cpu_collective", out)(
                v, coords, slot=np.int64(slot), site=np.int64(1), axis_size=np.int64(n), reduce_op=np.int64(0)
            )
            return lax.pcast(y, AXIS, to="varying")

        f = jax.jit(jax.shard_map(body, mesh=mesh_of(n), in_specs=P(AXIS), out_specs=P(AXIS)))
        with pytest.raises(Exception, match="output has 17 elements; all_gather of 4 input elements"):
            np.asarray(f(sharded(mesh_of(n), random((n * 4,), np.float32))))
    finally:
        native.remove(slot)


def test_missing_rank_times_out_and_process_stays_usable(short_timeout):
    n = 4
    slot = native.new_slot()
    native.install(slot, ring_all_gather(n))
    try:

        def body(v):
            call = lambda u: ffi_collective(u, slot=slot, n=n, coll="all_gather")  # noqa: E731
            return lax.cond(lax.axis_index(AXIS) == 0, call, lambda u: jnp.tile(u, n), v)

        f = jax.jit(jax.shard_map(body, mesh=mesh_of(n), in_specs=P(AXIS), out_specs=P(AXIS)))
        x = random((n * 4,), np.float32)
        t0 = time.perf_counter()
        with pytest.raises(Exception, match=r"timed out after 0.5 s: ranks 1, 2, 3 of 4 did not arrive \(arrived: 0\)"):
            np.asarray(f(sharded(mesh_of(n), x)))
        assert time.perf_counter() - t0 < 30
        # The process still runs collectives, and the failed entry does not outlive its grace period.
        assert_bitwise(run(ring_all_gather(n), x), lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), n, x))
        time.sleep(2 * short_timeout + 0.2)
        assert native.stats()["pending_rendezvous"] == 0
    finally:
        native.remove(slot)


def test_deadlocking_schedule_errors_by_deadline(short_timeout):
    x = random((2 * 3,), np.float32)
    with pytest.raises(Exception, match=r"deadline exceeded: rank [01], threadblock 0, op 0 \('r' from rank [01]"):
        run(deadlocking(), x, validate=False)
    assert native.stats()["pending_rendezvous"] == 0
    # Still usable afterwards.
    assert_bitwise(run(ring_all_gather(2), x), lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), 2, x))


def test_slot_bound_deadlock(short_timeout):
    # Rank 1 consumes channel 0 only after a channel-1 message that rank 0 sends after its second channel-0
    # send: with 2 slots per connection that works, with 1 slot the second send waits forever.
    def send(**kw):
        return Op(OpKind.SEND, I, 0, None, 0, 1, **kw)

    def recv(off, **kw):
        return Op(OpKind.RECV, None, 0, O, off, 1, **kw)

    r0 = [Threadblock((send(), send()), 1, -1, 0), Threadblock((send(deps=((0, 1),)),), 1, -1, 1)]
    r1 = [Threadblock((Op(OpKind.NOP, deps=((1, 0),)), recv(0), recv(0)), -1, 0, 0), Threadblock((recv(0),), -1, 0, 1)]
    r0.append(Threadblock((Op(OpKind.COPY, I, 0, O, 0, 1),)))
    s = make_schedule("all_gather", 2, 1, [r0, r1])
    x = random((2 * 3,), np.float32)
    run(s, x, num_slots=2, validate=False)
    with pytest.raises(Exception, match=r"deadline exceeded: rank [01], threadblock [01], op [0-9]"):
        run(s, x, num_slots=1, validate=False)


# ----------------------------------------------------------------------------- registry, hot swap, dispatch


def test_hot_swap_keeps_one_compilation():
    n = 8
    slot = native.new_slot()
    try:
        native.install(slot, ring_all_gather(n, 1))
        body = lambda v: ffi_collective(v, slot=slot, n=n, coll="all_gather")  # noqa: E731
        f = jax.jit(jax.shard_map(body, mesh=mesh_of(n), in_specs=P(AXIS), out_specs=P(AXIS)))
        x = random((n * 20,), np.float32, seed=7)
        ref = lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), n, x)
        xs = sharded(mesh_of(n), x)
        assert_bitwise(np.asarray(f(xs)), ref)
        for version, schedule in [(2, ring_all_gather(n, 4)), (3, relay_all_gather(n, 3)), (4, ring_all_gather(n, 1))]:
            assert native.install(slot, schedule) == version
            assert_bitwise(np.asarray(f(xs)), ref)
            assert native.last_launch_version(slot) == version
        assert native.launch_count(slot) == 4
        assert f._cache_size() == 1
    finally:
        native.remove(slot)


def test_back_to_back_async_steps():
    n = 8
    slot = native.new_slot()
    try:
        native.install(slot, ring_all_gather(n, 2))

        def step(v):
            y = ffi_collective(v, slot=slot, n=n, coll="all_gather")
            return y.reshape(n, -1).sum(0) * 0.5  # back to one block: the next step's input

        f = jax.jit(jax.shard_map(step, mesh=mesh_of(n), in_specs=P(AXIS), out_specs=P(AXIS)))
        g = jax.jit(
            jax.shard_map(
                lambda v: lax.all_gather(v, AXIS, tiled=True).reshape(n, -1).sum(0) * 0.5,
                mesh=mesh_of(n),
                in_specs=P(AXIS),
                out_specs=P(AXIS),
            )
        )
        x = sharded(mesh_of(n), random((n * 16,), np.float32, seed=1))
        a, b = x, x
        for _ in range(300):  # no blocking in between: XLA queues them asynchronously
            a, b = f(a), g(b)
        assert_bitwise(np.asarray(a), np.asarray(b))
        assert native.launch_count(slot) == 300
    finally:
        native.remove(slot)


def test_site_inside_scan_and_two_sites():
    n = 4
    slot = native.new_slot()
    try:
        native.install(slot, ring_all_gather(n, 1))

        def body(v, gather):
            def it(carry, _):
                y = gather(carry, 1)
                z = gather(carry * 2.0, 2)
                return (y.reshape(n, -1).sum(0) + z.reshape(n, -1).max(0)) * 0.25, None

            return lax.scan(it, v, None, length=5)[0]

        ours = lambda v, site: ffi_collective(v, slot=slot, n=n, coll="all_gather", site=site)  # noqa: E731
        theirs = lambda v, site: lax.all_gather(v, AXIS, tiled=True)  # noqa: E731
        x = random((n * 6,), np.float32, seed=4)
        got = lax_ref(lambda v: body(v, ours), n, x)
        assert_bitwise(got, lax_ref(lambda v: body(v, theirs), n, x))
        assert native.launch_count(slot) == 10
    finally:
        native.remove(slot)


def test_timeout_setter_validates():
    with pytest.raises(ExecutorError, match="positive"):
        native.set_timeout(0)
    with pytest.raises(ExecutorError, match="positive"):
        native.set_timeout(float("nan"))


def test_missing_schedule():
    slot = native.new_slot()
    try:
        body = lambda v: ffi_collective(v, slot=slot, n=2, coll="all_gather")  # noqa: E731
        f = jax.jit(jax.shard_map(body, mesh=mesh_of(2), in_specs=P(AXIS), out_specs=P(AXIS)))
        with pytest.raises(Exception, match=f"no schedule installed in slot {slot}"):
            np.asarray(f(sharded(mesh_of(2), random((4,), np.float32))))
    finally:
        native.remove(slot)


def test_install_while_launching_keeps_each_launch_on_one_table():
    # Tables with 1 and 3 chunks per period disagree on every message: a launch mixing them would fail.
    n = 8
    tables = [compile_table(ring_all_gather(n, 1)), compile_table(relay_all_gather(n, 3))]
    slot = native.new_slot()
    stop = threading.Event()

    def swapper():
        k = 0
        while not stop.is_set():
            native.install(slot, tables[k % 2])
            k += 1
            time.sleep(0.0005)

    try:
        native.install(slot, tables[0])
        body = lambda v: ffi_collective(v, slot=slot, n=n, coll="all_gather")  # noqa: E731
        f = jax.jit(jax.shard_map(body, mesh=mesh_of(n), in_specs=P(AXIS), out_specs=P(AXIS)))
        x = random((n * 12,), np.float32, seed=9)
        ref = lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), n, x)
        xs = sharded(mesh_of(n), x)
        thread = threading.Thread(target=swapper)
        thread.start()
        outs = [f(xs) for _ in range(60)]
        for y in outs:
            assert_bitwise(np.asarray(y), ref)
        stop.set()
        thread.join()
        assert native.current_version(slot) > 2  # the swapper really raced the launches
        assert native.launch_count(slot) == 60
    finally:
        stop.set()
        native.remove(slot)


# ----------------------------------------------------------------------------- rendezvous state machine


def _arrive_all(calls):
    """Runs (run, site, group, rank, n, timeout[, delay]) arrivals on threads; returns their results in order."""
    results = [None] * len(calls)

    def go(i, call):
        if len(call) > 6:
            time.sleep(call[6])
        results[i] = native._native._test_arrive(*call[:6])

    threads = [threading.Thread(target=go, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_rendezvous_meets_per_occurrence():
    # Two occurrences of one site in one launch, arriving interleaved, meet separately; groups are independent.
    calls = [(1001, 7, g, r, 3, 5.0) for _ in range(2) for g in (0, 1) for r in range(3)]
    assert _arrive_all(calls) == ["ok"] * len(calls)
    assert native._native._test_rendezvous_stats()["pending"] == 0


def test_rendezvous_timeout_names_missing_ranks_and_late_arrivals_fail():
    calls = [(2002, 1, 0, 0, 3, 0.3), (2002, 1, 0, 2, 3, 0.3), (2002, 1, 0, 1, 3, 0.3, 0.45)]
    on_time_0, on_time_2, late = _arrive_all(calls)
    assert on_time_0 == on_time_2
    assert "timed out after 0.3 s: rank 1 of 3 did not arrive (arrived: 0, 2)" in on_time_0
    assert "rank 1 arrived after the rendezvous at site 1, group 0, occurrence 0 had already failed" in late
    assert native._native._test_rendezvous_stats()["pending"] == 0  # every rank accounted for: entry gone


def test_rendezvous_tombstones_and_counters_expire():
    assert "did not arrive" in _arrive_all([(3003, 1, 0, 0, 2, 0.2)])[0]
    assert native._native._test_rendezvous_stats()["pending"] == 1  # kept so that rank 1 would get the error
    time.sleep(0.3)
    _arrive_all([(3004, 1, 0, r, 1, 0.2) for r in range(1)])  # any later call prunes
    time.sleep(2 * 0.2 + 1.1)
    assert native._native._test_rendezvous_stats() == {"pending": 0, "occurrence_entries": 0}


def test_rendezvous_rank_that_cannot_join_fails_the_waiting_ranks_at_once():
    # Rank 1's call is refused before it arrives (its communicator closed under it): ranks 0 and 2, already
    # waiting with a 20 s deadline, fail with its reason now; a rank that comes later gets the same error.
    why = "jaxccl: schedule slot 9 was removed: the communicator that owned it is closed"
    waiting = [(5005, 1, 0, 0, 4, 20.0), (5005, 1, 0, 2, 4, 20.0)]
    t0 = time.monotonic()
    abandon = threading.Timer(0.2, native._native._test_abandon, args=(5005, 1, 0, 1, 4, 20.0, why))
    abandon.start()
    out = _arrive_all(waiting)
    abandon.join()
    assert time.monotonic() - t0 < 5.0, out
    expected = f"jaxccl: rank 1 could not join the rendezvous at site 1, group 0, occurrence 0: {why}"
    assert out == [expected, expected]
    late = _arrive_all([(5005, 1, 0, 3, 4, 20.0)])[0]
    assert "rank 3 arrived after the rendezvous" in late and why in late
    assert native._native._test_rendezvous_stats()["pending"] == 0  # all four accounted for


def test_rendezvous_duplicate_ranks_and_size_changes():
    # Two calls claiming rank 0 are two occurrences of rank 0: each waits for a rank 1 that never comes.
    out = _arrive_all([(4004, 1, 0, 0, 2, 0.3), (4004, 1, 0, 0, 2, 0.3)])
    assert all("rank 1 of 2 did not arrive (arrived: 0)" in o for o in out)
    out = _arrive_all([(4005, 1, 0, 0, 2, 0.3), (4005, 1, 0, 1, 3, 0.3, 0.05)])
    assert "was called with axis sizes 2 and 3" in out[1]
    assert "rank 1 of 2 did not arrive" in out[0]


# ----------------------------------------------------------------------------- CUDA


def test_cuda_module_attaches_when_built():
    cuda = native._cuda_module()
    if cuda is None:
        pytest.skip("jaxccl._native_cuda was not built (no CUDA compiler at build time)")
    assert cuda.attached()
    assert "jaxccl_cuda_collective" in cuda.registrations()
    assert native.has_cuda_support() == (cuda.device_count() > 0)


@pytest.mark.skipif(not native.has_cuda_support(), reason="needs the CUDA executor and a visible GPU")
def test_cuda_ring_all_gather():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("needs JAX with at least 2 GPUs")
    n = len(gpus)
    mesh = Mesh(np.array(gpus), (AXIS,))
    for schedule in (ring_all_gather(n, 2), relay_all_gather(n, 2)):
        slot = native.new_slot()
        try:
            native.install(slot, schedule)

            def body(v, slot=slot):
                coords = jnp.stack([lax.axis_index(AXIS), 0]).astype(jnp.int32)
                y = jax.ffi.ffi_call("jaxccl_cuda_collective", jax.ShapeDtypeStruct((v.size * n,), v.dtype))(
                    v, coords, slot=np.int64(slot), site=np.int64(1), axis_size=np.int64(n), reduce_op=np.int64(0)
                )
                return lax.pcast(y, AXIS, to="varying")

            x = jax.device_put(random((n * 1000,), np.float32), NamedSharding(mesh, P(AXIS)))
            got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))(x)
            ref = jax.jit(
                jax.shard_map(
                    lambda v: lax.all_gather(v, AXIS, tiled=True), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)
                )
            )(x)
            assert_bitwise(np.asarray(got), np.asarray(ref))
        finally:
            native.remove(slot)


def test_timeout_from_environment(monkeypatch):
    old = native.get_timeout()
    try:
        monkeypatch.setenv(native.TIMEOUT_ENV, "12.5")
        native._timeout_from_env()
        assert native.get_timeout() == 12.5
        monkeypatch.setenv(native.TIMEOUT_ENV, "soon")
        with pytest.raises(ExecutorError, match="JAXCCL_TIMEOUT_S='soon' is not a number"):
            native._timeout_from_env()
        monkeypatch.setenv(native.TIMEOUT_ENV, "-1")
        with pytest.raises(ExecutorError, match="positive"):
            native._timeout_from_env()
    finally:
        native.set_timeout(old)
