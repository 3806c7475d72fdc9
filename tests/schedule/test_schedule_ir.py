"""The Schedule IR data model: construction, layout, JSON round trip, digest, builder."""

import dataclasses

import pytest

import jaxccl
from jaxccl.schedule import (
    Buffer,
    Collective,
    Handle,
    Op,
    OpKind,
    Schedule,
    ScheduleBuilder,
    Threadblock,
    chunk_bounds,
    period_elements,
)


def pair_allgather() -> Schedule:
    b = ScheduleBuilder("all_gather", num_ranks=2, chunks_per_period=1)
    for r in range(2):
        b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        b.transfer(r, 1 - r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
    return b.build(name="pair", info={"note": "hand-made"})


def test_layout_of_each_collective():
    assert Collective.ALL_GATHER.buffer_chunks(4, 2) == (2, 8)
    assert Collective.ALL_TO_ALL.buffer_chunks(4, 2) == (8, 8)
    assert Collective.REDUCE_SCATTER.buffer_chunks(4, 2) == (8, 2)
    assert Collective.ALL_REDUCE.buffer_chunks(4, 2) == (2, 2)
    assert period_elements("all_gather", 4, 10) == 10
    assert period_elements("all_to_all", 4, 12) == 3
    with pytest.raises(jaxccl.ScheduleError, match="split evenly"):
        period_elements("reduce_scatter", 4, 10)


def test_chunk_bounds_tile_the_buffer_and_keep_classes_equal():
    period, elems = 3, 10
    bounds = [chunk_bounds(i, period, elems) for i in range(3 * period)]
    flat = [e for lo, hi in bounds for e in range(lo, hi)]
    assert flat == list(range(3 * elems))
    for i in range(3 * period):
        lo, hi = bounds[i]
        lo0, hi0 = bounds[i % period]
        assert hi - lo == hi0 - lo0
    # more chunks than elements: some chunks are empty, still tiling
    assert [chunk_bounds(i, 4, 2) for i in range(4)] == [(0, 0), (0, 1), (1, 1), (1, 2)]


def test_json_round_trip_preserves_everything():
    s = pair_allgather().replace(algbw=1.5e9, bound=2e9)
    back = Schedule.from_json(s.to_json())
    assert back == s and back.digest == s.digest
    assert back.info == {"note": "hand-made"} and back.algbw == 1.5e9


def test_digest_covers_the_program_only():
    s = pair_allgather()
    assert s.replace(name="other", info={}).digest == s.digest
    ops = list(s.ranks[0][0].ops)
    ops[0] = Op(OpKind.COPY, Buffer.INPUT, 0, Buffer.OUTPUT, 1)
    changed = s.replace(ranks=((s.ranks[0][0].__class__(tuple(ops)),) + s.ranks[0][1:],) + s.ranks[1:])
    assert changed.digest != s.digest


def test_builder_threadblocks_and_dependencies():
    b = ScheduleBuilder("all_gather", num_ranks=3, chunks_per_period=1)
    for r in range(3):
        b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
    h = b.transfer(0, 1, (Buffer.INPUT, 0), (Buffer.OUTPUT, 0))
    b.transfer(1, 2, (Buffer.OUTPUT, 0), (Buffer.OUTPUT, 0), after=[h])
    s = b.build()
    send_tb = next(tb for tb in s.ranks[1] if tb.send_peer == 2)
    recv_tb_index = next(i for i, tb in enumerate(s.ranks[1]) if tb.recv_peer == 0)
    assert send_tb.ops[0].deps == ((recv_tb_index, 0),)
    with pytest.raises(jaxccl.ScheduleError, match="rank 0"):
        b.transfer(1, 2, (Buffer.OUTPUT, 0), (Buffer.OUTPUT, 0), after=[Handle(0, 0, 0)])
    with pytest.raises(jaxccl.ScheduleError, match="itself"):
        b.transfer(1, 1, (Buffer.INPUT, 0), (Buffer.OUTPUT, 0))
    with pytest.raises(jaxccl.ScheduleError, match="out of range"):
        b.copy(3, (Buffer.INPUT, 0), (Buffer.OUTPUT, 0))


def test_malformed_ops_and_schedules_are_refused():
    with pytest.raises(jaxccl.ScheduleError, match="count"):
        Op(OpKind.SEND, Buffer.INPUT, 0, count=0)
    with pytest.raises(jaxccl.ScheduleError, match="src"):
        Op(OpKind.COPY, None, 0, Buffer.OUTPUT, 0)
    with pytest.raises(jaxccl.ScheduleError, match="num_ranks"):
        Schedule(Collective.ALL_GATHER, 2, 1, ((Threadblock(()),),))
    with pytest.raises(jaxccl.ScheduleError, match="malformed"):
        Schedule.from_json("[")
    with pytest.raises(jaxccl.ScheduleError, match="schema"):
        Schedule.from_json('{"schema": "nope"}')
    with pytest.raises(ValueError):
        OpKind("zz")


def test_builder_places_ops_on_chosen_threadblocks_and_shares_equal_ops():
    # a 3-rank ring all_gather with fused ops, one threadblock per rank (as the ring baselines write it)
    b = ScheduleBuilder("all_gather", num_ranks=3, chunks_per_period=1)
    for r in range(3):
        tb = b.threadblock(r, send_peer=(r + 1) % 3, recv_peer=(r - 1) % 3)
        assert b.threadblock(r, send_peer=(r + 1) % 3, recv_peer=(r - 1) % 3) == tb == 0
        b.op(r, tb, OpKind.SEND, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        b.op(r, tb, OpKind.COPY, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        prev, prev2 = (r - 1) % 3, (r - 2) % 3
        b.op(r, tb, OpKind.RECV_COPY_SEND, (Buffer.OUTPUT, prev), (Buffer.OUTPUT, prev))
        last = b.op(r, tb, OpKind.RECV, (Buffer.OUTPUT, prev2), (Buffer.OUTPUT, prev2))
        assert last == Handle(r, 0, 3)
    s = b.build(name="ring3").validate()
    assert s.num_threadblocks == 3 and s.num_ops == 12
    assert [op.kind for op in s.ranks[1][0].ops] == [OpKind.SEND, OpKind.COPY, OpKind.RECV_COPY_SEND, OpKind.RECV]
    # equal ops are one object, on any rank or threadblock
    b = ScheduleBuilder("all_reduce", num_ranks=2, chunks_per_period=1)
    ops = [b.op(r, b.threadblock(r), OpKind.COPY, (Buffer.INPUT, 0), (Buffer.OUTPUT, 0)) for r in range(2)]
    s = b.build()
    assert s.ranks[0][0].ops[ops[0].op] is s.ranks[1][0].ops[ops[1].op]


def test_builder_op_dependencies_and_errors():
    b = ScheduleBuilder("all_gather", num_ranks=2, chunks_per_period=1)
    local = b.threadblock(0)
    peer = b.threadblock(0, send_peer=1, recv_peer=1, channel=2)
    got = b.op(0, peer, OpKind.RECV, (Buffer.INPUT, 0), (Buffer.OUTPUT, 1))
    same = b.op(0, peer, OpKind.RECV, (Buffer.INPUT, 0), (Buffer.OUTPUT, 1), after=[got])  # own tb: no dep
    copy = b.op(0, local, OpKind.COPY, (Buffer.INPUT, 0), (Buffer.OUTPUT, 0), after=[None, got, same, got])
    tbs = b.build().ranks[0]
    assert tbs[local].ops[copy.op].deps == ((1, 0), (1, 1))
    assert tbs[peer].ops[same.op].deps == () and (tbs[peer].send_peer, tbs[peer].channel) == (1, 2)
    with pytest.raises(jaxccl.ScheduleError, match="no threadblock 5"):
        b.op(0, 5, OpKind.NOP)
    with pytest.raises(jaxccl.ScheduleError, match="out of range"):
        b.op(7, 0, OpKind.NOP)
    with pytest.raises(jaxccl.ScheduleError, match="out of range"):
        b.threadblock(-1)
    with pytest.raises(jaxccl.ScheduleError, match="not on rank 1"):
        b.op(1, b.threadblock(1), OpKind.NOP, after=[got])
    with pytest.raises(jaxccl.ScheduleError, match="tuples"):
        b.op(0, local, OpKind.COPY, [Buffer.INPUT, 0], (Buffer.OUTPUT, 0))
    with pytest.raises(jaxccl.ScheduleError, match="needs a src"):
        b.op(0, local, OpKind.COPY, None, (Buffer.OUTPUT, 0))


def test_unchecked_constructors_equal_the_checked_ones():
    fields = (OpKind.RECV_REDUCE_COPY, Buffer.SCRATCH, 4, Buffer.OUTPUT, 2, 3, ((0, 1), (2, 0)))
    fast, slow = Op.unchecked(*fields), Op(*fields)
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    tb_fast, tb_slow = Threadblock.unchecked((fast,), 2, 1, 1), Threadblock((slow,), 2, 1, 1)
    assert tb_fast == tb_slow and hash(tb_fast) == hash(tb_slow)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.count = 1
