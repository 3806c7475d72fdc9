"""The reference interpreter catches every class of broken schedule."""

from __future__ import annotations

import pytest

from jaxccl.errors import ScheduleError
from jaxccl.schedule import Buffer, Op, OpKind, ScheduleBuilder, Threadblock, make_schedule
from jaxccl.schedule.interpreter import OpRef, check, simulate_rounds
from jaxccl.synth import direct_reduce_scatter, ordered_allreduce, ring_allgather, ring_reduce_scatter

I, O, S = Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH
K = OpKind


def op(kind, src=None, dst=None, count=1, deps=()):
    return Op(
        kind,
        None if src is None else src[0],
        0 if src is None else src[1],
        None if dst is None else dst[0],
        0 if dst is None else dst[1],
        count,
        deps,
    )


def pair_allgather(c=1, *, recv_dst=None, send_src=None, copy=True, slots_msgs=None):
    """2-rank all_gather: each rank sends its c chunks to the other, one message each."""
    progs = []
    for r in range(2):
        p = 1 - r
        ops = [op(K.SEND, send_src or (I, k), (O, r * c + k)) for k in range(c)]
        if copy:
            ops.append(op(K.COPY, (I, 0), (O, r * c), count=c))
        ops += [op(K.RECV, (O, p * c + k), recv_dst or (O, p * c + k)) for k in range(c)]
        progs.append([Threadblock(tuple(ops), p, p, 0)])
    return make_schedule("all_gather", 2, c, progs)


# ------------------------------------------------------------------------ positive
def test_valid_pair_and_report():
    rep = check(pair_allgather(3))
    assert rep.num_ops == 2 * 7
    assert rep.num_messages == 6
    assert rep.num_connections == 2
    assert rep.max_in_flight == 3
    assert rep.num_slots == 8


def test_builder_schedule_validates():
    b = ScheduleBuilder("all_gather", num_ranks=3, chunks_per_period=1)
    for r in range(3):
        b.copy(r, (I, 0), (O, r))
        for d in range(3):
            if d != r:
                b.transfer(r, d, (I, 0), (O, r))
    assert check(b.build()).num_messages == 6


# ---------------------------------------------------------------------------- data
def test_wrong_chunk_all_to_all():
    progs = []
    for r in range(2):
        p = 1 - r
        # Rank 0 sends its own block (chunk 0) instead of rank 1's block (chunk 1).
        src = (I, 0) if r == 0 else (I, p)
        ops = (op(K.SEND, src, (O, r)), op(K.COPY, (I, r), (O, r)), op(K.RECV, None, (O, p)))
        progs.append([Threadblock(ops, p, p, 0)])
    s = make_schedule("all_to_all", 2, 1, progs)
    with pytest.raises(
        ScheduleError, match=r"rank 1 output chunk 0: expected input chunk 1 of rank 0, got input chunk 0"
    ):
        check(s)


def test_wrong_destination_leaves_chunk_unwritten():
    # Each rank receives its peer's chunk over its own copy.
    with pytest.raises(
        ScheduleError, match="rank 0 output chunk 0: expected input chunk 0 of rank 0, got input chunk 0 of rank 1"
    ):
        check(pair_allgather(1, recv_dst=(O, 0)))


def test_missing_copy():
    with pytest.raises(ScheduleError, match=r"rank 0 output chunk 0: expected input chunk 0 of rank 0, got nothing"):
        check(pair_allgather(1, copy=False))


def test_missing_copy_in_ring():
    s = ring_allgather(4)
    ranks = [list(tbs) for tbs in s.ranks]
    tb = ranks[2][0]
    ranks[2][0] = Threadblock(tuple(o for o in tb.ops if o.kind is not K.COPY), tb.send_peer, tb.recv_peer, 0)
    with pytest.raises(ScheduleError, match="rank 2 output chunk 2: .*got nothing"):
        check(s.replace(ranks=tuple(map(tuple, ranks))))


def test_read_before_write():
    progs = []
    for r in range(2):
        p = 1 - r
        ops = (op(K.SEND, (O, r), (O, r)), op(K.COPY, (I, 0), (O, r)), op(K.RECV, None, (O, p)))
        progs.append([Threadblock(ops, p, p, 0)])
    with pytest.raises(ScheduleError, match="reads output chunk 0 of rank 0 before anything wrote it"):
        check(make_schedule("all_gather", 2, 1, progs))


def test_double_counted_reduction():
    # 2-rank all_reduce; rank 0 folds its own input in twice.
    r0 = [
        Threadblock((op(K.SEND, (I, 0)), op(K.RECV_REDUCE_COPY, (I, 0), (O, 0))), 1, 1, 0),
        Threadblock((op(K.REDUCE, (I, 0), (O, 0), deps=[(0, 1)]),), -1, -1, 0),
    ]
    r1 = [Threadblock((op(K.SEND, (I, 0)), op(K.RECV_REDUCE_COPY, (I, 0), (O, 0))), 0, 0, 0)]
    with pytest.raises(
        ScheduleError, match=r"rank 0 output chunk 0: expected the sum over all 2 ranks .* sum of 3 terms"
    ):
        check(make_schedule("all_reduce", 2, 1, [r0, r1]))


def test_reduction_of_wrong_chunks():
    # reduce_scatter, C=1: rank 1 reduces chunk 0 of rank 0 into its chunk-1 sum.
    r0 = [Threadblock((op(K.SEND, (I, 0)), op(K.RECV_REDUCE_COPY, (I, 0), (O, 0))), 1, 1, 0)]
    r1 = [Threadblock((op(K.SEND, (I, 0)), op(K.RECV_REDUCE_COPY, (I, 1), (O, 0))), 0, 0, 0)]
    with pytest.raises(
        ScheduleError, match=r"rank 1 output chunk 0: expected the sum over all 2 ranks of input chunk 1"
    ):
        check(make_schedule("reduce_scatter", 2, 1, [r0, r1]))


# ------------------------------------------------------------------------ ordering
def test_wrong_reduction_order_when_ordered_requested():
    s = ring_reduce_scatter(3)
    check(s)
    with pytest.raises(ScheduleError, match="ascending rank order"):
        check(s, ordered_reduction=True)
    # The flag in info turns the check on by default.
    with pytest.raises(ScheduleError, match="ascending rank order"):
        s.replace(info={"ordered_reduction": True}).validate()


def test_hand_made_fold_in_wrong_order():
    # 3-rank reduce_scatter; rank 0 folds (x0 + x2) + x1 instead of (x0 + x1) + x2.
    def sender(owner):
        return op(K.SEND, (I, owner), (O, 0))

    r0 = [
        Threadblock((op(K.COPY, (I, 0), (O, 0)),), -1, -1, 0),
        Threadblock((sender(1), op(K.RECV_REDUCE_COPY, (O, 0), (O, 0), deps=[(2, 1)])), 1, 1, 0),
        Threadblock((sender(2), op(K.RECV_REDUCE_COPY, (O, 0), (O, 0), deps=[(0, 0)])), 2, 2, 0),
    ]
    good = direct_reduce_scatter(3)
    s = good.replace(ranks=(tuple(r0), *good.ranks[1:]), info={})
    check(s)  # the right leaves ...
    with pytest.raises(ScheduleError, match="rank 0 output chunk 0: the reduction does not sum in ascending"):
        check(s, ordered_reduction=True)


def test_ordered_baselines_pass_ordered():
    check(direct_reduce_scatter(5), ordered_reduction=True)
    check(ordered_allreduce(5), ordered_reduction=True)


# --------------------------------------------------------------------- execution
def test_deadlock_by_slots():
    s = pair_allgather(9)  # each rank sends 9 messages before it receives one
    with pytest.raises(ScheduleError, match=r"deadlock with num_slots=8: 2 threadblock\(s\) blocked") as e:
        check(s)
    assert "waits for a free slot towards rank 1" in str(e.value)
    assert "8 unconsumed messages" in str(e.value)
    assert check(s, num_slots=9).max_in_flight == 9


def test_deadlock_by_receive_order():
    # Both ranks receive first: a classic deadlock for any number of slots.
    progs = []
    for r in range(2):
        p = 1 - r
        ops = (op(K.COPY, (I, 0), (O, r)), op(K.RECV, None, (O, p)), op(K.SEND, (I, 0), (O, r)))
        progs.append([Threadblock(ops, p, p, 0)])
    with pytest.raises(
        ScheduleError, match="deadlock(.|\n)*wait cycle(.|\n)*rank 0 tb 0 op 1 \\(r\\) waits for a message from rank 1"
    ):
        check(make_schedule("all_gather", 2, 1, progs), num_slots=1000)


def test_deadlock_names_the_wait_cycle_before_its_victims():
    # Ranks 1 and 2 both receive from each other first (the cycle); rank 1's send to rank 0 waits for that
    # receive, and rank 0 for the send (two victims, listed first in rank order before this change).
    def tb(ops, send, recv):
        return Threadblock(tuple(ops), send, recv, 0)

    progs = [
        [tb([op(K.COPY, (I, 0), (O, 0)), op(K.RECV, None, (O, 1))], -1, 1), tb([op(K.SEND, (I, 0), (O, 0))], 2, -1)],
        [
            tb([op(K.COPY, (I, 0), (O, 1)), op(K.RECV, None, (O, 2)), op(K.SEND, (I, 0), (O, 1))], 2, 2),
            tb([op(K.SEND, (I, 0), (O, 1), deps=[(0, 1)])], 0, -1),
        ],
        [
            tb([op(K.COPY, (I, 0), (O, 2)), op(K.RECV, None, (O, 1)), op(K.SEND, (I, 0), (O, 2))], 1, 1),
            tb([op(K.RECV, None, (O, 0))], -1, 0),
        ],
    ]
    with pytest.raises(ScheduleError) as e:
        check(make_schedule("all_gather", 3, 1, progs), num_slots=1000)
    text = str(e.value)
    cycle, _, rest = text.partition("also blocked:")
    assert "wait cycle of 2 threadblock(s)" in cycle
    assert "rank 1 tb 0 op 1 (r) waits for a message from rank 2" in cycle
    assert "rank 2 tb 0 op 1 (r) waits for a message from rank 1" in cycle
    assert "rank 0 tb 0 op 1 (r)" in rest and "rank 1 tb 1 op 0 (s) waits for dependency" in rest
    assert "rank 0" not in cycle


def test_dependency_cycle():
    good = pair_allgather(1)
    tbs = list(good.ranks[0])
    a = Threadblock((op(K.NOP, deps=[(2, 0)]),), -1, -1, 0)
    b = Threadblock((op(K.NOP, deps=[(1, 0)]),), -1, -1, 0)
    s = good.replace(ranks=((*tbs, a, b), good.ranks[1]))
    with pytest.raises(ScheduleError, match="dependency cycle on rank 0: rank 0 tb [12] op 0 \\(nop\\) -> rank 0 tb"):
        check(s)


def test_cycle_through_program_order():
    # tb0: [nop dep (1,1)] ; tb1: [nop dep (0,0)?]. tb1 op1 waits on tb0 op0 which waits on tb1 op1.
    t0 = Threadblock((op(K.NOP, deps=[(1, 1)]), op(K.COPY, (I, 0), (O, 0))), -1, -1, 0)
    t1 = Threadblock((op(K.NOP), op(K.NOP, deps=[(0, 0)])), -1, -1, 0)
    s = make_schedule("all_gather", 1, 1, [[t0, t1]])
    with pytest.raises(ScheduleError, match="dependency cycle on rank 0"):
        check(s)


def test_race_write_write():
    s = pair_allgather(1)
    local = Threadblock((op(K.COPY, (I, 0), (O, 0)),), -1, -1, 0)  # second writer of output chunk 0, unordered
    s = s.replace(ranks=(s.ranks[0], (*s.ranks[1], local)))
    with pytest.raises(ScheduleError, match="race on rank 1 output chunk 0: rank 1 tb [01] op [02] .*unordered"):
        check(s)


def test_race_read_then_overwrite_and_fix_by_dependency():
    def build(with_dep):
        # Rank 0 stages its chunk in scratch, sends it from there, then reuses the scratch chunk.
        local_ops = [op(K.COPY, (I, 0), (S, 0)), op(K.COPY, (I, 0), (O, 0))]
        local_ops.append(op(K.COPY, (O, 0), (S, 0), deps=[(1, 0)] if with_dep else []))
        r0 = [
            Threadblock(tuple(local_ops), -1, -1, 0),
            Threadblock((op(K.SEND, (S, 0), (O, 0), deps=[(0, 0)]), op(K.RECV, None, (O, 1))), 1, 1, 0),
        ]
        r1 = pair_allgather(1).ranks[1]
        return make_schedule("all_gather", 2, 1, [r0, r1], scratch_chunks=1)

    check(build(True))
    with pytest.raises(ScheduleError, match="race on rank 0 scratch chunk 0"):
        check(build(False))


def test_unmatched_send():
    progs = [list(tbs) for tbs in pair_allgather(1).ranks]
    tb = progs[0][0]
    progs[0][0] = Threadblock((*tb.ops, op(K.SEND, (I, 0), (O, 0))), 1, 1, 0)
    with pytest.raises(
        ScheduleError, match=r"unmatched messages: rank 0 tb 0 sends 2 message\(s\) to rank 1 on channel 0"
    ):
        check(make_schedule("all_gather", 2, 1, progs))


def test_send_without_receiver_threadblock():
    progs = [list(tbs) for tbs in pair_allgather(1).ranks]
    progs[0].append(Threadblock((op(K.SEND, (I, 0), (O, 0)),), 1, -1, 3))
    with pytest.raises(ScheduleError, match="no threadblock receiving from rank 0 on channel 3"):
        check(make_schedule("all_gather", 2, 1, progs))


def test_receive_without_sender_threadblock():
    progs = [list(tbs) for tbs in pair_allgather(1).ranks]
    progs[1].append(Threadblock((op(K.RECV, None, (O, 0)),), -1, 0, 2))
    with pytest.raises(ScheduleError, match="rank 1 tb 1 receives from rank 0 on channel 2, but rank 0 has no"):
        check(make_schedule("all_gather", 2, 1, progs))
    # A threadblock that names a receive peer but never receives is harmless.
    progs[1][1] = Threadblock((op(K.NOP),), -1, 0, 2)
    check(make_schedule("all_gather", 2, 1, progs))


def test_count_mismatch():
    progs = [list(tbs) for tbs in pair_allgather(2).ranks]
    # Rank 0 sends both chunks as one message of 2; rank 1 expects two messages of 1.
    progs[0][0] = Threadblock(
        (
            op(K.SEND, (I, 0), (O, 0), count=2),
            op(K.NOP),
            op(K.COPY, (I, 0), (O, 0), count=2),
            op(K.RECV, None, (O, 2)),
            op(K.RECV, None, (O, 3)),
        ),
        1,
        1,
        0,
    )
    progs[1][0] = Threadblock(
        (op(K.SEND, (I, 0), (O, 2), count=2), op(K.COPY, (I, 0), (O, 2), count=2), op(K.RECV, None, (O, 0))),
        0,
        0,
        0,
    )
    s = make_schedule("all_gather", 2, 2, progs)
    with pytest.raises(
        ScheduleError,
        match=r"message 0 from rank 0 to rank 1 .* sends 2 chunk\(s\) but rank 1 tb 0 op 2 \(r\) receives 1",
    ):
        check(s)


def test_bad_period_congruence_transfer():
    # C=2: rank 0 sends chunk class 0 into a class-1 chunk of rank 1.
    s = pair_allgather(2)
    progs = [list(tbs) for tbs in s.ranks]
    tb = progs[1][0]
    ops = list(tb.ops)
    ops[-2] = op(K.RECV, None, (O, 1))
    progs[1][0] = Threadblock(tuple(ops), 0, 0, 0)
    with pytest.raises(ScheduleError, match="chunk class changes .*congruent mod period 2"):
        check(s.replace(ranks=tuple(map(tuple, progs))))


def test_bad_period_congruence_copy():
    t = Threadblock((op(K.COPY, (I, 0), (O, 1)), op(K.COPY, (I, 1), (O, 0))), -1, -1, 0)
    with pytest.raises(ScheduleError, match="src chunk 0 and dst chunk 1 are not congruent mod period 2"):
        check(make_schedule("all_gather", 1, 2, [[t]]))


# ---------------------------------------------------------------------- structure
@pytest.mark.parametrize(
    "tb, match",
    [
        (Threadblock((op(K.SEND, (I, 0)),), 5, -1, 0), "send peer 5 out of range"),
        (Threadblock((op(K.NOP),), 0, -1, 0), "send peer is the rank itself"),
        (Threadblock((op(K.SEND, (I, 0)),), -1, -1, 0), "sends but its threadblock has no send peer"),
        (Threadblock((op(K.RECV, None, (O, 0)),), -1, -1, 0), "receives but its threadblock has no receive peer"),
        (
            Threadblock((op(K.COPY, (I, 0), (O, 2)),), -1, -1, 0),
            r"dst chunks 2..2 exceed the output buffer \(2 chunks\)",
        ),
        (Threadblock((op(K.COPY, (S, 0), (O, 0)),), -1, -1, 0), "src chunks 0..0 exceed the scratch buffer"),
        (Threadblock((op(K.NOP, deps=[(7, 0)]),), -1, -1, 0), "depends on tb 7 op 0, which does not exist"),
        (Threadblock((op(K.NOP, deps=[(0, 5)]),), -1, -1, 0), "depends on tb 0 op 5, which does not exist"),
        (Threadblock((op(K.NOP), op(K.NOP, deps=[(1, 0)])), -1, -1, 0), "depends on its own threadblock"),
        (Threadblock((op(K.NOP),), -1, -1, -1), "channel must be a non-negative integer"),
        (Threadblock((op(K.COPY, (O, 0), (I, 0)),), -1, -1, 0), "writes the input buffer; inputs are read-only"),
    ],
)
def test_structural_errors(tb, match):
    s = pair_allgather(1)
    s = s.replace(ranks=((*s.ranks[0], tb), s.ranks[1]))
    with pytest.raises(ScheduleError, match=match):
        check(s)


def test_duplicate_connection_threadblock():
    s = pair_allgather(1)
    extra = Threadblock((op(K.NOP),), 1, -1, 0)
    with pytest.raises(ScheduleError, match="rank 0: tb 0 and tb 1 both send to rank 1 on channel 0"):
        check(s.replace(ranks=((*s.ranks[0], extra), s.ranks[1])))


def test_bad_arguments():
    with pytest.raises(ScheduleError, match="num_slots"):
        check(pair_allgather(1), num_slots=0)
    with pytest.raises(ScheduleError, match="expected a Schedule"):
        check("not a schedule")


# ------------------------------------------------------------------------- rounds
def test_rounds_of_a_ring():
    n = 4
    s = ring_allgather(n)
    plan = simulate_rounds(s)
    # s, cpy, then N-1 receives: one op per rank per round.
    assert [len(r) for r in plan.rounds] == [n] * (n + 1)
    assert plan.report.num_rounds == n + 1
    for ref, rnd in plan.round_of.items():
        op_ = s.ranks[ref.rank][ref.tb].ops[ref.op]
        if op_.kind.sends:
            recv = plan.receiver[ref]
            assert plan.sender[recv] == ref
            assert plan.round_of[recv] > rnd
    assert plan.receiver[OpRef(0, 0, 0)] == OpRef(1, 0, 2)
    assert sum(len(r) for r in plan.rounds) == s.num_ops


def test_rounds_respect_dependencies_and_slots():
    s = ordered_allreduce(4)
    plan = simulate_rounds(s)
    for ref, rnd in plan.round_of.items():
        o = s.ranks[ref.rank][ref.tb].ops[ref.op]
        for dt, di in o.deps:
            assert plan.round_of[OpRef(ref.rank, dt, di)] < rnd
        if ref.op:
            assert plan.round_of[OpRef(ref.rank, ref.tb, ref.op - 1)] < rnd
    # Rank 0 sends 3 messages ahead; rank 1 consumes them late. One slot throttles rank 0.
    r0 = Threadblock(
        (
            *(op(K.SEND, (I, k), (O, k)) for k in range(3)),
            op(K.COPY, (I, 0), (O, 0), 3),
            *(op(K.RECV, None, (O, 3 + k)) for k in range(3)),
        ),
        1,
        1,
        0,
    )
    r1 = Threadblock(
        (
            op(K.COPY, (I, 0), (O, 3), 3),
            op(K.NOP),
            *(op(K.RECV, None, (O, k)) for k in range(3)),
            *(op(K.SEND, (I, k), (O, 3 + k)) for k in range(3)),
        ),
        0,
        0,
        0,
    )
    s = make_schedule("all_gather", 2, 3, [[r0], [r1]])
    unbounded = simulate_rounds(s)
    one_slot = simulate_rounds(s, num_slots=1)
    assert unbounded.report.max_in_flight == 3 and one_slot.report.max_in_flight == 1
    assert one_slot.report.num_rounds > unbounded.report.num_rounds
    assert check(s, num_slots=1).num_rounds == one_slot.report.num_rounds
