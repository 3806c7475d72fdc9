"""Rules of the executor core that have a Python twin: the stable-source rules (core/stable_source.h).

The table compiler marks a send *direct* (its receiver reads the sender's buffer in place) when nothing
rewrites its source while the message is in flight (``jaxccl/schedule/table.py``, ``_direct_sends``,
over the schedule). The core defines the same rule over the per-rank program (``SourceStableInFlight``)
and a stronger one, *final at its dependency* (``SourceFinalAtDependency``), which shared transfers
across processes and the CPU's fold pushes need. Over synthesized and random valid schedules: the
compiler's direct flags are exactly the core's stable-in-flight sends, and every send final at its
dependency is stable in flight.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxccl
from jaxccl.runtime import native
from jaxccl.schedule import Buffer, OpKind, ScheduleBuilder, interpreter
from jaxccl.schedule.builder import Handle
from jaxccl.schedule.ir import Schedule
from jaxccl.schedule.table import OP_FLAG_DIRECT, compile_table, decode
from jaxccl.synth import baselines

I, O, S = Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH


def synthesized() -> list[Schedule]:
    topo = jaxccl.topology.rail(hosts=2, gpus_per_host=4)
    return [
        baselines.ring_allgather(4, channels=2),
        baselines.recursive_doubling_allgather(4),
        baselines.direct_alltoall(4),
        baselines.ring_reduce_scatter(4),
        baselines.direct_reduce_scatter(4),
        baselines.ring_allreduce(4, channels=2),
        baselines.ordered_allreduce(4),
        baselines.binary_tree_allreduce(5),
        baselines.double_binary_tree_allreduce(6),
        jaxccl.synth.all_gather(topo),
        jaxccl.synth.all_to_all(topo),
        jaxccl.synth.reduce_scatter(topo),
    ]


def random_schedule(seed: int) -> Schedule:
    """A direct all_gather plus random traffic through scratch, race-free by construction.

    Every op waits (``after=``) for the ops of its rank that touched its chunks before it, one of them
    writing, so the schedule is race-free; on top of that it waits for a few random earlier ops, and
    several waits become a chain of nops in the table. Sends read the input, written output chunks or
    written scratch, and later writes rewrite scratch that was sent, so sends of every kind occur:
    direct or not, final at their dependency or not.
    """
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 5))
    scratch = int(rng.integers(2, 6))
    b = ScheduleBuilder("all_gather", num_ranks=n, chunks_per_period=1, scratch_chunks=scratch)
    # Per rank: every op made so far, and per chunk of output/scratch its last writer and readers since.
    made: list[list] = [[] for _ in range(n)]
    writer: list[dict] = [{} for _ in range(n)]
    readers: list[dict] = [{} for _ in range(n)]

    def after(rank: int, reads: list, writes: list) -> list:
        deps = set()
        for cell in reads:
            if cell in writer[rank]:
                deps.add(writer[rank][cell])
        for cell in writes:
            if cell in writer[rank]:
                deps.add(writer[rank][cell])
            deps.update(readers[rank].get(cell, ()))
        if made[rank] and rng.random() < 0.3:
            deps.add(made[rank][int(rng.integers(len(made[rank])))])
        return sorted(deps)

    def record(rank: int, h, reads: list, writes: list) -> None:
        made[rank].append(h)
        for cell in reads:
            readers[rank].setdefault(cell, []).append(h)
        for cell in writes:
            writer[rank][cell] = h
            readers[rank][cell] = []

    def cells(buf: Buffer, off: int, count: int) -> list:
        return [] if buf is I else [(buf, c) for c in range(off, off + count)]

    def source(rank: int) -> tuple[Buffer, int, int]:
        written = sorted(cell for cell in writer[rank] if cell[0] is S)
        choice = rng.random()
        if choice < 0.5 and written:
            buf, off = written[int(rng.integers(len(written)))]
            return buf, off, 1
        if choice < 0.7:
            done = sorted(cell for cell in writer[rank] if cell[0] is O)
            if done:
                buf, off = done[int(rng.integers(len(done)))]
                return buf, off, 1
        return I, 0, 1

    def transfer(src_rank: int, dst_rank: int, src: tuple, dst: tuple) -> None:
        # What ScheduleBuilder.transfer does, keeping the handle of the send too.
        s_reads, d_writes = cells(src[0], src[1], 1), cells(dst[0], dst[1], 1)
        stb = b.threadblock(src_rank, send_peer=dst_rank)
        rtb = b.threadblock(dst_rank, recv_peer=src_rank)
        sh = b.op(src_rank, stb, OpKind.SEND, src, dst, after=after(src_rank, s_reads, []))
        record(src_rank, sh, s_reads, [])
        rh = b.op(dst_rank, rtb, OpKind.RECV, src, dst, after=after(dst_rank, [], d_writes))
        record(dst_rank, rh, [], d_writes)

    # The collective: every rank's input into every rank's output.
    for r in range(n):
        h = b.copy(r, (I, 0), (O, r))
        record(r, h, [], cells(O, r, 1))
    for r in range(n):
        for q in range(n):
            if q != r:
                transfer(r, q, (I, 0), (O, r))
    # Random traffic into scratch: copies, in-place reductions and transfers from any written source.
    for _ in range(int(rng.integers(4, 14))):
        r = int(rng.integers(n))
        kind = rng.random()
        dst = (S, int(rng.integers(scratch)))
        if kind < 0.25:
            src = source(r)
            reads, writes = cells(src[0], src[1], 1), cells(*dst, 1)
            h = b.copy(r, src[:2], dst, after=after(r, reads, writes))
            record(r, h, reads, writes)
        elif kind < 0.35 and dst in writer[r]:
            src = source(r)
            reads, writes = cells(src[0], src[1], 1) + cells(*dst, 1), cells(*dst, 1)
            h = b.reduce(r, src[:2], dst, after=after(r, reads, writes))
            record(r, h, reads, writes)
        else:
            q = int((r + 1 + rng.integers(n - 1)) % n)
            src = source(r)
            transfer(r, q, src[:2], (S, int(rng.integers(scratch))))
    return b.build(name=f"random-{seed}")


def _rules(schedule: Schedule) -> list[tuple[int, bool, bool, bool]]:
    """(op, direct flag, final at its dependency, stable in flight) of every send of a range."""
    table = compile_table(schedule)
    ops = decode(table)["ops"]
    return [
        (o, bool(ops[o]["flags"] & OP_FLAG_DIRECT), final, stable) for o, final, stable in native._stable_sources(table)
    ]


def _check(schedule: Schedule) -> list[tuple[int, bool, bool, bool]]:
    rules = _rules(schedule)
    assert rules, schedule.name
    for o, direct, final, stable in rules:
        assert direct == stable, f"{schedule.name}: op {o} direct={direct} but the core says stable={stable}"
        assert stable or not final, f"{schedule.name}: op {o} is final at its dependency but not stable in flight"
    return rules


@pytest.mark.parametrize("schedule", synthesized(), ids=lambda s: s.name)
def test_direct_flags_are_the_cores_stable_sources_on_synthesized_schedules(schedule):
    _check(schedule)


def test_direct_flags_are_the_cores_stable_sources_on_random_schedules():
    seen = {(False, False): 0, (False, True): 0, (True, True): 0}
    valid = 0
    for seed in range(60):
        s = random_schedule(seed)
        interpreter.check(s)  # race-free, deadlock-free, an all_gather: a schedule the compiler accepts
        valid += 1
        for _, _, final, stable in _check(s):
            seen[(final, stable)] += 1
    # Every combination the rules allow occurs, so each comparison above could have failed.
    assert valid == 60 and all(seen.values()), seen


def test_a_rewritten_source_is_neither_final_nor_stable():
    # Rank 0 sends scratch chunk 0 to rank 1, then overwrites it: the send must stage its message.
    b = ScheduleBuilder("all_gather", num_ranks=2, chunks_per_period=1, scratch_chunks=1)
    w = b.copy(0, (I, 0), (S, 0))
    b.transfer(0, 1, (S, 0), (S, 0), after=[w])
    b.copy(0, (I, 0), (S, 0), after=[Handle(0, b.threadblock(0, send_peer=1), 0)])
    for r in range(2):
        b.copy(r, (I, 0), (O, r))
        b.transfer(r, 1 - r, (I, 0), (O, r))
    s = b.build(name="rewrite")
    interpreter.check(s)
    rules = {o: (direct, final, stable) for o, direct, final, stable in _check(s)}
    ops = decode(compile_table(s))["ops"]
    scratch_sends = [o for o in rules if ops[o]["kind"] == OpKind.SEND.code and ops[o]["src_buf"] == int(S)]
    assert [rules[o] for o in scratch_sends] == [(False, False, False)]


def test_a_source_written_in_program_order_is_stable_but_not_final():
    # The write precedes the send only through program order in one threadblock: a direct message,
    # but the send has no dependency at which its bytes are final.
    b = ScheduleBuilder("all_gather", num_ranks=2, chunks_per_period=1, scratch_chunks=1)
    for r in range(2):
        tb = b.threadblock(r, send_peer=1 - r, recv_peer=1 - r)
        b.op(r, tb, OpKind.COPY, (I, 0), (O, r))
        b.op(r, tb, OpKind.SEND, (O, r), (O, r))
        b.op(r, tb, OpKind.RECV, None, (O, 1 - r))
    s = b.build(name="program-order")
    interpreter.check(s)
    rules = _check(s)
    assert [(direct, final, stable) for _, direct, final, stable in rules] == [(True, False, True)] * 2
