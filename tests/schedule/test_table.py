"""The compiled schedule table (docs/schedule-ir.md, "Compiled table (version 2)")."""

from __future__ import annotations

import os

import numpy as np
import pytest
from handmade import ring_all_gather

from jaxccl.errors import ExecutorError, ScheduleError
from jaxccl.schedule import Buffer, Op, OpKind, ScheduleBuilder, Threadblock, make_schedule
from jaxccl.schedule import table as tbl
from jaxccl.schedule.table import compile_table, decode, header
from jaxccl.synth import baselines

I, O, S = Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH


def test_header_and_sizes():
    s = ring_all_gather(4, 3)
    t = compile_table(s, num_slots=5)
    assert t.dtype == np.int32 and t.ndim == 1
    h = header(t)
    assert h["magic"] == 0x4C43434A and t[0] == 0x4C43434A
    assert h["version"] == 2 and h["collective"] == 0 and h["num_ranks"] == 4
    assert h["chunks_per_period"] == 3 and h["input_chunks"] == 3 and h["output_chunks"] == 12
    assert h["num_slots"] == 5 and h["scratch_chunks"] == 0 and h["flags"] == 0
    assert h["num_threadblocks"] == s.num_threadblocks == 12
    assert h["num_ops"] == s.num_ops  # no multi-deps: no nops added
    assert h["num_connections"] == 4
    assert h["digest_low32"] == int(s.digest, 16) & 0xFFFFFFFF
    assert h["checksum"] == tbl.checksum(t) and h["reserved"] == 0
    assert t.size == 16 + 2 * 4 + 8 * h["num_threadblocks"] + 10 * h["num_ops"]
    d = decode(t)
    assert [r[1] for r in d["ranks"]] == [3, 3, 3, 3]
    assert [r[0] for r in d["ranks"]] == [0, 3, 6, 9]


def test_ops_and_connections_round_trip():
    s = ring_all_gather(3, 2)
    d = decode(compile_table(s))
    rows = iter(d["ops"])
    conns = {}
    for g, tb_row in enumerate(d["threadblocks"]):
        r = tb_row["rank"]
        tb = s.ranks[r][g - d["ranks"][r][0]]
        assert (tb_row["send_peer"], tb_row["recv_peer"], tb_row["channel"]) == (tb.send_peer, tb.recv_peer, 0)
        if tb.send_peer >= 0:
            conns.setdefault(tb_row["send_conn"], set()).add(("send", r, tb.send_peer))
        if tb.recv_peer >= 0:
            conns.setdefault(tb_row["recv_conn"], set()).add(("recv", tb.recv_peer, r))
        for op in tb.ops:
            row = next(rows)
            assert row["kind"] == op.kind.code and row["count"] == op.count
            if op.kind is OpKind.SEND:
                assert (row["src_buf"], row["src_off"], row["dst_buf"]) == (int(op.src), op.src_off, -1)
            elif op.kind is OpKind.RECV:
                assert (row["dst_buf"], row["dst_off"], row["src_buf"]) == (int(op.dst), op.dst_off, -1)
            assert row["reserved"] == 0
    # Every connection id names one sender and one receiver of the same pair.
    assert sorted(conns) == [0, 1, 2]
    for ends in conns.values():
        (_, a, b), (_, a2, b2) = sorted(ends)
        assert (a, b) == (a2, b2)


def test_ring_sends_are_direct():
    # Forwarded chunks are written once (by the receive) before they are sent: all sends are direct.
    d = decode(compile_table(ring_all_gather(4)))
    sends = [o for o in d["ops"] if o["kind"] == OpKind.SEND.code]
    assert sends and all(o["flags"] == tbl.OP_FLAG_DIRECT for o in sends)
    assert all(o["flags"] == 0 for o in d["ops"] if o["kind"] != OpKind.SEND.code)


def _relay_all_gather(n: int, c: int = 1):
    """Single-threadblock ring whose forwards go through one reused scratch range (rcs)."""
    ranks = []
    for r in range(n):
        ops = [Op(OpKind.COPY, I, 0, O, r * c, c), Op(OpKind.SEND, I, 0, None, 0, c)]
        for k in range(1, n - 1):
            ops += [Op(OpKind.RECV_COPY_SEND, None, 0, S, 0, c), Op(OpKind.COPY, S, 0, O, ((r - k) % n) * c, c)]
        ops += [Op(OpKind.RECV, None, 0, S, 0, c), Op(OpKind.COPY, S, 0, O, ((r - n + 1) % n) * c, c)]
        ranks.append([Threadblock(tuple(ops), send_peer=(r + 1) % n, recv_peer=(r - 1) % n)])
    return make_schedule("all_gather", n, c, ranks, scratch_chunks=c)


def test_rewritten_source_is_staged():
    d = decode(compile_table(_relay_all_gather(4)))
    by_kind = {}
    for o in d["ops"]:
        by_kind.setdefault(o["kind"], set()).add(o["flags"])
    assert by_kind[OpKind.SEND.code] == {tbl.OP_FLAG_DIRECT}  # from INPUT
    assert by_kind[OpKind.RECV_COPY_SEND.code] == {0}  # scratch 0 is written n-1 times


def test_write_must_happen_before_send():
    # Rank 0 writes scratch in its local threadblock and sends it from another one, once without
    # ordering (not direct) and once after a dependency on the write (direct).
    def build(ordered: bool):
        write = Op(OpKind.COPY, I, 0, S, 0, 1)
        send = Op(OpKind.SEND, S, 0, None, 0, 1, deps=((0, 0),) if ordered else ())
        r0 = [Threadblock((write,)), Threadblock((send,), send_peer=1)]
        r1 = [Threadblock((Op(OpKind.RECV, None, 0, O, 0, 1),), recv_peer=0)]
        return make_schedule("all_reduce", 2, 1, [r0, r1], scratch_chunks=1)

    flags = {o["flags"] for o in decode(compile_table(build(False)))["ops"] if o["kind"] == 0}
    assert flags == {0}
    flags = {o["flags"] for o in decode(compile_table(build(True)))["ops"] if o["kind"] == 0}
    assert flags == {tbl.OP_FLAG_DIRECT}


def test_reduce_send_is_never_direct():
    rrs = Op(OpKind.RECV_REDUCE_SEND, I, 0, None, 0, 1)
    r0 = [Threadblock((Op(OpKind.SEND, I, 0, None, 0, 1),), send_peer=1)]
    r1 = [Threadblock((rrs,), send_peer=2, recv_peer=0)]
    r2 = [Threadblock((Op(OpKind.RECV_REDUCE_COPY, I, 0, O, 0, 1),), recv_peer=1)]
    s = make_schedule("all_reduce", 3, 1, [r0, r1, r2])
    ops = decode(compile_table(s))["ops"]
    assert [o["flags"] for o in ops] == [tbl.OP_FLAG_DIRECT, 0, 0]


def test_multi_deps_become_nop_chains():
    b = ScheduleBuilder("all_reduce", num_ranks=3, chunks_per_period=1, scratch_chunks=3)
    recvs = [b.transfer(src, 0, (I, 0), (S, src), 1) for src in (1, 2)]
    b.copy(0, (I, 0), (O, 0), after=recvs)  # two dependencies
    s = b.build()
    d = decode(compile_table(s))
    assert d["header"]["num_ops"] == s.num_ops + 1
    first, count = d["ranks"][0]
    tbs = d["threadblocks"][first : first + count]
    local = next(row for row in tbs if row["send_peer"] == row["recv_peer"] == -1)
    ops = d["ops"][local["first_op"] : local["first_op"] + local["num_ops"]]
    assert [o["kind"] for o in ops] == [OpKind.NOP.code, OpKind.COPY.code]
    assert ops[0]["count"] == 0 and ops[0]["src_buf"] == ops[0]["dst_buf"] == -1
    assert {(o["dep_tb"], o["dep_op"]) for o in ops} == {(h.tb, h.op) for h in recvs}


def test_dependency_indices_are_remapped():
    # tb 1 op 1 has two deps, so tb 1 gains a nop and a dependency on (1, 1) must become (1, 2).
    r0 = [
        Threadblock((Op(OpKind.COPY, I, 0, S, 0, 1), Op(OpKind.COPY, I, 1, S, 1, 1))),
        Threadblock((Op(OpKind.NOP), Op(OpKind.COPY, S, 0, O, 0, 1, deps=((0, 0), (0, 1))))),
        Threadblock((Op(OpKind.COPY, S, 1, O, 1, 1, deps=((1, 1),)),)),
    ]
    s = make_schedule("all_gather", 1, 2, [r0], scratch_chunks=2)
    ops = decode(compile_table(s))["ops"]
    assert [o["kind"] for o in ops] == [6, 6, 8, 8, 6, 6]
    assert (ops[3]["dep_tb"], ops[3]["dep_op"]) == (0, 0)
    assert (ops[4]["dep_tb"], ops[4]["dep_op"]) == (0, 1)
    assert (ops[5]["dep_tb"], ops[5]["dep_op"]) == (1, 2)


def test_ordered_reduction_flag_and_digest():
    b = ScheduleBuilder("all_reduce", num_ranks=1, chunks_per_period=1)
    b.copy(0, (I, 0), (O, 0))
    s = b.build(info={"ordered_reduction": True})
    h = header(compile_table(s))
    assert h["flags"] == tbl.FLAG_ORDERED_REDUCTION
    assert h["digest_low32"] == int(s.digest[-8:], 16)


def _one_tb(*ops, send=-1, recv=-1, n=1, c=1):
    return make_schedule("all_gather", n, c, [[Threadblock(tuple(ops), send, recv)]] + [[]] * (n - 1))


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: _one_tb(Op(OpKind.COPY, I, 0, I, 0, 1)), "read-only"),
        (lambda: _one_tb(Op(OpKind.COPY, I, 0, O, 1, 1)), "exceed"),
        (lambda: _one_tb(Op(OpKind.SEND, I, 0), send=1, n=2), "no threadblock receiving"),
        (lambda: _one_tb(Op(OpKind.SEND, I, 0)), "no send peer"),
        (lambda: _one_tb(Op(OpKind.COPY, I, 0, O, 0, 1, deps=((3, 0),))), "names no op"),
        (lambda: _one_tb(Op(OpKind.COPY, I, 0, O, 1, 1), n=2, c=2), "chunk class"),
        (lambda: _one_tb(send=0, n=2), "another rank"),
    ],
)
def test_structural_errors(build, match):
    with pytest.raises(ScheduleError, match=match):
        compile_table(build())


def test_mismatched_message_counts():
    r0 = [Threadblock((Op(OpKind.SEND, I, 0, None, 0, 1),), send_peer=1)]
    r1 = [Threadblock((Op(OpKind.RECV, None, 0, O, 0, 2),), recv_peer=0)]
    with pytest.raises(ScheduleError, match="counts and chunk classes must match"):
        compile_table(make_schedule("all_gather", 2, 1, [r0, r1]))


def test_num_slots_must_be_positive():
    with pytest.raises(ScheduleError, match="num_slots"):
        compile_table(ring_all_gather(2), num_slots=0)


def test_deadlocking_schedule_still_compiles():
    # Both ranks receive before they send: the executor must time out on it, so it must compile.
    def prog(r):
        return [Threadblock((Op(OpKind.RECV, None, 0, O, 1 - r, 1), Op(OpKind.SEND, I, 0)), 1 - r, 1 - r)]

    t = compile_table(make_schedule("all_gather", 2, 1, [prog(0), prog(1)]))
    assert header(t)["num_ops"] == 4


# ------------------------------------------------------------------ what the registry accepts


def _native():
    from jaxccl.runtime import native

    return native


def test_checksum_is_zlib_crc32_of_the_other_words():
    import zlib

    t = compile_table(ring_all_gather(4, 2))
    others = np.concatenate([t[: tbl.CHECKSUM_WORD], t[tbl.CHECKSUM_WORD + 1 :]]).astype("<i4")
    assert header(t)["checksum"] == zlib.crc32(others.tobytes())
    assert np.array_equal(tbl.seal(t), t)


def test_registry_refuses_any_changed_word():
    native = _native()
    t = compile_table(ring_all_gather(4, 2))
    native.validate_table(t)
    rng = np.random.default_rng(0)
    for word in range(2, t.size):  # past magic and version: the checksum is the first thing that differs
        bad = t.copy()
        bad[word] ^= np.int32(1 << int(rng.integers(0, 31)))
        with pytest.raises(ExecutorError, match="checksum mismatch"):
            native.validate_table(bad)


def test_scratch_is_declared_exactly():
    native = _native()
    t = compile_table(_relay_all_gather(4, 2).replace(scratch_chunks=100_000_000))
    assert header(t)["scratch_chunks"] == 2  # what the ops use, not what the schedule declared
    native.validate_table(t)
    for scratch in (1, 3):
        bad = t.copy()
        bad[7] = scratch
        with pytest.raises(ExecutorError, match="SCRATCH exceed|declares exactly the scratch"):
            native.validate_table(tbl.seal(bad))


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


@pytest.mark.parametrize(
    "word, value, match",
    [
        (13, 2**26, "more connections than threadblocks"),
        (13, 2**31 - 1, "more connections than threadblocks"),
        (7, 2**31 - 1, "chunk cells, above the limit"),
        (4, 2**28, "output chunks"),
        (9, 2**31 - 1, "implies"),
        (10, 2**31 - 1, "implies"),
        (3, 2**31 - 1, "num_ranks must be in"),
    ],
)
def test_header_sizes_are_bounded_before_anything_is_allocated(word, value, match):
    native = _native()
    bad = compile_table(ring_all_gather(4)).copy()
    bad[word] = value
    if word == 4:  # a consistent header asking for a huge period: sizes agree, the cell limit refuses
        bad[5], bad[6] = value, 4 * value
        match = "chunk cells, above the limit"
    peak = _peak_rss_mib()
    with pytest.raises(ExecutorError, match=match):
        native.validate_table(tbl.seal(bad))
    assert _peak_rss_mib() - peak < 64


def test_python_reader_bounds_counts():
    bad = compile_table(ring_all_gather(2)).copy()
    bad[9] = -3  # threadblocks
    bad[10] += 3 * tbl.TB_WORDS // tbl.OP_WORDS  # keeps nothing consistent; the reader must not reshape
    with pytest.raises(ScheduleError, match="negative count|implies"):
        decode(bad)
    bad = compile_table(ring_all_gather(2)).copy()
    bad[13] = 2**31 - 1
    assert decode(bad)["header"]["num_connections"] == 2**31 - 1  # decoding sizes nothing by it


def test_chunk_cell_limit_is_the_interpreters():
    from jaxccl.schedule.interpreter import MAX_CHUNK_CELLS

    native = _native()
    c = MAX_CHUNK_CELLS // 2 + 1  # one rank, input and output of c chunks: just over the limit
    b = ScheduleBuilder("all_reduce", num_ranks=1, chunks_per_period=c)
    b.copy(0, (I, 0), (O, 0), c)
    with pytest.raises(ExecutorError, match=f"{2 * c} chunk cells, above the limit of {MAX_CHUNK_CELLS}"):
        native.validate_table(compile_table(b.build()))
    with pytest.raises(ScheduleError, match="too large to check"):
        b.build().validate()


def test_thousands_of_threadblocks_run_bitwise_and_cost_no_threads():
    # 8,248 threadblocks on 8 ranks (the review's schedule size that used to need 8,192 worker threads).
    import jax
    from jax.sharding import Mesh
    from programs import all_gather_pair

    import jaxccl

    n, c = 8, 1017  # per rank: c local copies, 7 sends, 7 receives = 1031 threadblocks
    ranks = []
    for r in range(n):
        tbs = [Threadblock((Op(OpKind.COPY, I, j, O, r * c + j, 1),)) for j in range(c)]
        tbs += [Threadblock((Op(OpKind.SEND, I, 0, None, 0, c),), send_peer=d) for d in range(n) if d != r]
        tbs += [Threadblock((Op(OpKind.RECV, None, 0, O, d * c, c),), recv_peer=d) for d in range(n) if d != r]
        ranks.append(tbs)
    s = make_schedule("all_gather", n, c, ranks)
    assert s.num_threadblocks == 8248
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    comm.install("all_gather", s)
    f, ref = all_gather_pair(mesh)
    threads = []
    with comm:
        for k in range(3):
            x = np.random.default_rng(k).standard_normal(n * c * 2).astype(np.float32) + 0.5
            got, want = np.asarray(f(x)), np.asarray(ref(x))
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
            threads.append(len(os.listdir("/proc/self/task")))
    comm.close()
    assert threads[0] == threads[-1]


@pytest.mark.parametrize(
    "build",
    [
        lambda: ring_all_gather(4, 3),
        lambda: _relay_all_gather(4, 2),
        lambda: baselines.ordered_allreduce(4),
        lambda: baselines.ring_reduce_scatter(4),
        lambda: baselines.direct_alltoall(4),
        lambda: baselines.ring_allreduce(4, channels=2),
    ],
)
def test_verify_accepts_what_compile_table_emits(build):
    s = build()
    for slots in (4, 8):
        t = compile_table(s, num_slots=slots)
        again = tbl.verify(t)
        assert again.collective == s.collective and again.num_ranks == s.num_ranks
        assert np.array_equal(compile_table(tbl.schedule_of(t), num_slots=slots)[15:], t[15:])


def test_verify_refuses_a_sealed_table_the_compiler_would_not_write():
    native = _native()
    t = compile_table(ring_all_gather(4))
    d = decode(t)
    first_send = next(k for k, o in enumerate(d["ops"]) if o["kind"] == OpKind.SEND.code)
    word = tbl.HEADER_WORDS + tbl.RANK_WORDS * 4 + tbl.TB_WORDS * len(d["threadblocks"]) + tbl.OP_WORDS * first_send
    wrong = t.copy()
    wrong[word + 8] = 0  # a direct send made staged: runs right, but it is not what the compiler writes
    native.validate_table(tbl.seal(wrong))
    with pytest.raises(ScheduleError, match=f"table word {word + 8} is not what compile_table writes"):
        tbl.verify(tbl.seal(wrong))
    with pytest.raises(ScheduleError, match="checksum"):
        tbl.verify(wrong)
    wrong = t.copy()
    wrong[word + 9] = 5  # reserved: no schedule has it
    with pytest.raises(ScheduleError):
        tbl.verify(tbl.seal(wrong))
