"""One AllReduce schedule from a ReduceScatter and an AllGather: ``psum`` in one launch.

MCCL runs AllReduce as ReduceScatter + AllGather (Sec. 3), and a
communicator with a topology keeps one schedule of each half (the closed loop
adapts them). :func:`fuse_all_reduce` writes the two halves as one
``ALL_REDUCE`` schedule, so that ``psum`` is one launch instead of two:

- **Layout.** With ``N`` ranks and ``M = lcm(C_rs, C_ag)`` the AllReduce has
  ``C = N * M`` chunks; chunk ``j`` of a half with ``C_h`` chunks per period is
  AllReduce chunks ``j*M/C_h .. (j+1)*M/C_h - 1``. On an input of a multiple of
  ``N`` elements (:func:`input_padding`) these are exactly the elements of the
  half's chunk, so every element is summed by the same ops in the same order
  as by the ReduceScatter: the results are bitwise those of the two launches,
  and ``jax.lax``'s where the ReduceScatter sums in ascending rank order
  (``info["ordered_reduction"]``, which the fused schedule keeps and the
  reference interpreter proves).
- **Where the data lives.** The ReduceScatter's input is the AllReduce's
  input; its result (rank ``r``'s output) is shard ``r`` of the AllReduce's
  output, which is where the AllGather reads its input and writes every other
  shard. Everything else (scratch, and an output chunk that holds another
  shard's data on the way) moves to the AllReduce's scratch, per rank, in
  periods of ``C`` chunks: a chunk holding (partial sums of) input chunk ``j``
  stays at class ``j`` there, as the IR's class rule wants. A data-flow pass
  over the halves' rounds (:func:`jaxccl.schedule.interpreter.simulate_rounds`)
  finds which shard every chunk of every op holds.
- **Threadblocks.** Each rank runs the ReduceScatter's threadblocks, then the
  AllGather's on channels shifted past the ReduceScatter's, so no connection
  is shared. The AllGather's copy of the rank's own shard into its output is
  gone (it is already there).
- **Per-shard dependencies, no barrier.** An AllGather op that reads (or
  writes) a chunk of the rank's own shard waits for the ReduceScatter op that
  last writes it (and for the ReduceScatter's reads of it after that): a shard
  leaves as soon as its fold is done, while other shards are still being
  reduced.

The predicted rate is honest: ``algbw`` is ``1 / (1/algbw_rs + 1/algbw_ag)``,
the two phases' times added (both halves count the whole buffer, the
nccl-tests convention), though the phases overlap in practice.

Example:
    >>> from jaxccl.runtime.default_schedules import direct_allgather
    >>> from jaxccl.synth.baselines import direct_reduce_scatter
    >>> s = fuse_all_reduce(direct_reduce_scatter(4), direct_allgather(4))
    >>> s.collective.value, s.chunks_per_period, s.info["ordered_reduction"], s.validated
    ('all_reduce', 4, True, True)
    >>> input_padding(s, 10), input_padding(s, 12)
    (2, 0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

from jaxccl.errors import ScheduleError, UnsupportedTypeError
from jaxccl.schedule.interpreter import OpRef, RoundPlan, simulate_rounds
from jaxccl.schedule.ir import Buffer, Collective, Op, OpKind, Schedule, Threadblock

__all__ = ["FUSED_ALGORITHM", "fuse_all_reduce", "input_padding"]

#: ``info["algorithm"]`` of a fused schedule.
FUSED_ALGORITHM = "fused_reduce_scatter_all_gather"

_INFORMATIONAL_SRC = (OpKind.RECV, OpKind.RECV_COPY_SEND)  # src only says where the message came from
_INFORMATIONAL_DST = (OpKind.SEND, OpKind.RECV_REDUCE_SEND)  # dst only says where the message lands
Loc = tuple[Buffer, int]


def fuse_all_reduce(reduce_scatter: Schedule, all_gather: Schedule) -> Schedule:
    """The AllReduce that runs ``reduce_scatter`` then ``all_gather`` in one launch (see the module docstring).

    Args:
        reduce_scatter: a ``REDUCE_SCATTER`` schedule.
        all_gather: an ``ALL_GATHER`` schedule over the same number of ranks.

    Returns:
        A validated ``ALL_REDUCE`` schedule with ``C = N * lcm(C_rs, C_ag)``;
        ``info`` has ``algorithm`` (:data:`FUSED_ALGORITHM`), the
        ReduceScatter's ``ordered_reduction`` (and ``fold``, if it names one),
        ``reduce_scatter`` and ``all_gather`` (each half's name, digest and
        algbw) and ``channel_offset`` (where the AllGather's channels start).
        Run it on inputs padded by :func:`input_padding`.

    Raises:
        UnsupportedTypeError: an argument is not a :class:`~jaxccl.schedule.Schedule`.
        ScheduleError: the halves implement other collectives or are for
            different rank counts, a half fails the reference interpreter, or
            an op moves the chunks of several shards in one range that the
            AllReduce's layout cannot keep contiguous.

    Example:
        >>> from jaxccl.synth.baselines import ring_allgather, ring_reduce_scatter
        >>> s = fuse_all_reduce(ring_reduce_scatter(4, channels=2), ring_allgather(4))
        >>> s.chunks_per_period, s.info["channel_offset"], s.info["ordered_reduction"]
        (8, 2, False)
    """
    rs, ag = reduce_scatter, all_gather
    for what, s, want in (("reduce_scatter", rs, Collective.REDUCE_SCATTER), ("all_gather", ag, Collective.ALL_GATHER)):
        if not isinstance(s, Schedule):
            raise UnsupportedTypeError(f"fuse_all_reduce: {what} must be a Schedule, got {type(s).__name__}")
        if s.collective is not want:
            raise ScheduleError(
                f"fuse_all_reduce: the {what} schedule {s.name or s.digest[:12]} implements "
                f"{s.collective.value}, not {want.value}"
            )
    n = rs.num_ranks
    if ag.num_ranks != n:
        raise ScheduleError(
            f"fuse_all_reduce: the reduce_scatter schedule is for N={n} ranks but the all_gather schedule for "
            f"N={ag.num_ranks}"
        )
    m = math.lcm(rs.chunks_per_period, ag.chunks_per_period)
    c_rs, c_ag = rs.chunks_per_period, ag.chunks_per_period
    phases = (
        _Phase(rs, 0, m // c_rs, _flow(rs), lambda r, buf, off, lab: _rs_home(r, buf, off, lab, c_rs)),
        _Phase(ag, 1, m // c_ag, _flow(ag), lambda r, buf, off, lab: _ag_home(buf, off, lab)),
    )
    layout = _Layout(n, n * m, phases)
    channel_offset = 1 + max((tb.channel for tbs in rs.ranks for tb in tbs), default=-1)
    ranks = tuple(_fuse_rank(r, layout, channel_offset) for r in range(n))
    info: dict = {
        "algorithm": FUSED_ALGORITHM,
        "ordered_reduction": bool(rs.info.get("ordered_reduction", False)),
        "reduce_scatter": {"name": rs.name, "digest": rs.digest, "algbw": rs.algbw},
        "all_gather": {"name": ag.name, "digest": ag.digest, "algbw": ag.algbw},
        "channel_offset": channel_offset,
    }
    if "fold" in rs.info:
        info["fold"] = rs.info["fold"]
    fused = Schedule(
        collective=Collective.ALL_REDUCE,
        num_ranks=n,
        chunks_per_period=n * m,
        ranks=ranks,
        scratch_chunks=layout.scratch_periods * n * m,
        name=f"{rs.name or 'reduce_scatter'}+{ag.name or 'all_gather'}",
        algbw=_in_series(rs.algbw, ag.algbw),
        bound=_in_series(rs.bound, ag.bound),
        info=info,
    )
    return fused.validate()


def input_padding(schedule: Schedule, elems: int) -> int:
    """Zeros to append to an AllReduce input of ``elems`` elements before ``schedule`` runs it.

    A fused schedule (:func:`fuse_all_reduce`) keeps its halves' chunks, and
    so their order of sums, on inputs of a multiple of ``N`` elements, as the
    two launches run them; other schedules need no padding. The caller drops
    the padding from the result.

    >>> from jaxccl.runtime.default_schedules import direct_allreduce
    >>> input_padding(direct_allreduce(4), 10)
    0
    """
    if schedule.info.get("algorithm") != FUSED_ALGORITHM:
        return 0
    return -int(elems) % schedule.num_ranks


# ----------------------------------------------------------------------- internals
def _in_series(a: float | None, b: float | None) -> float | None:
    """The rate of two phases run one after the other (their times add), or ``None`` if one is unknown."""
    return None if a is None or b is None else 1.0 / (1.0 / a + 1.0 / b)


def _rs_home(rank: int, buf: Buffer, off: int, label: int, c: int) -> Buffer | None:
    """Where a ReduceScatter chunk holding input chunk ``label`` lives in the AllReduce (None: scratch)."""
    if buf is Buffer.INPUT:
        return Buffer.INPUT
    if buf is Buffer.OUTPUT and label == rank * c + off:  # this rank's own shard: the AllReduce's output
        return Buffer.OUTPUT
    return None


def _ag_home(buf: Buffer, off: int, label: int) -> Buffer | None:
    """Where an AllGather chunk holding gathered block ``label`` lives in the AllReduce (None: scratch)."""
    if buf is Buffer.INPUT or (buf is Buffer.OUTPUT and label == off):  # the input is the reduced shard
        return Buffer.OUTPUT
    return None


@dataclasses.dataclass(frozen=True)
class _Flow:
    """A half's rounds, and per op the label of every chunk it reads (``src``) and writes (``dst``).

    A label names the data a chunk holds: the ReduceScatter's input chunk
    ``j`` (partial sums of it included), or the AllGather's block ``r*C + c``.
    """

    plan: RoundPlan
    src: dict[OpRef, list[int]]
    dst: dict[OpRef, list[int]]


def _flow(s: Schedule) -> _Flow:
    """The half's flow, memoized on the schedule object (immutable; a communicator fuses each half again and again)."""
    if "_fusion_flow" not in s.__dict__:
        s.__dict__["_fusion_flow"] = _trace(s)
    return s.__dict__["_fusion_flow"]


def _trace(s: Schedule) -> _Flow:
    plan = simulate_rounds(s)  # every check of the interpreter: the half is a valid schedule
    c = s.chunks_per_period
    gathered = s.collective is Collective.ALL_GATHER  # rank r's input chunk i is block r*C + i, else chunk i
    mem = [
        [[r * c + i if gathered else i for i in range(s.in_chunks)], [-1] * s.out_chunks, [-1] * s.scratch_chunks]
        for r in range(s.num_ranks)
    ]
    inbox: dict[OpRef, list[int]] = {}
    src: dict[OpRef, list[int]] = {}
    dst: dict[OpRef, list[int]] = {}
    for ops in plan.rounds:
        for ref in ops:
            op = s.ranks[ref.rank][ref.tb].ops[ref.op]
            bufs = mem[ref.rank]
            value = None
            if op.kind.reads_src:
                value = src[ref] = bufs[op.src][op.src_off : op.src_off + op.count]
            if op.kind.receives:
                msg = inbox.pop(ref)
                value = msg if value is None else value  # a reduction's terms hold the same chunk (validated)
            if op.kind.writes_dst:
                bufs[op.dst][op.dst_off : op.dst_off + op.count] = value
                dst[ref] = value
            if op.kind.sends:
                inbox[plan.receiver[ref]] = value
    return _Flow(plan, src, dst)


@dataclasses.dataclass(frozen=True)
class _Phase:
    """One half: its schedule, its index (0 ReduceScatter, 1 AllGather), AllReduce chunks per chunk, its flow."""

    schedule: Schedule
    index: int
    k: int
    flow: _Flow
    home: Callable[[int, Buffer, int, int], Buffer | None]


class _Layout:
    """Where every chunk of every op of both halves goes in the AllReduce's buffers, per rank.

    A chunk at ``off`` of ``buf`` holding label ``j`` goes to AllReduce chunks
    ``j*k .. j*k + k - 1`` of its home buffer, or of the scratch period given
    to its *group* ``(phase, buf, (off - j) // C)``: the chunks of one group
    are consecutive exactly when their labels are, so a range of one op maps
    to one range. Groups whose chunks do not collide share a period.
    """

    def __init__(self, n: int, c: int, phases: tuple[_Phase, _Phase]):
        self.n, self.c, self.phases = n, c, phases
        groups: list[dict[tuple[int, Buffer, int], set[int]]] = [{} for _ in range(n)]
        for ph in phases:
            for ref, buf, off, labels in _accesses(ph):
                for i, lab in enumerate(labels):
                    if ph.home(ref.rank, buf, off + i, lab) is None:
                        cells = groups[ref.rank].setdefault(self._group(ph, buf, off + i, lab), set())
                        cells.update(range(lab * ph.k, (lab + 1) * ph.k))
        self.period: list[dict[tuple[int, Buffer, int], int]] = []
        most = 0
        for per_rank in groups:
            taken: list[set[int]] = []
            where = {}
            for key, cells in per_rank.items():  # first fit, in order of first use
                p = next((p for p, used in enumerate(taken) if not used & cells), len(taken))
                if p == len(taken):
                    taken.append(set())
                taken[p] |= cells
                where[key] = p
            self.period.append(where)
            most = max(most, len(taken))
        self.scratch_periods = most

    @staticmethod
    def _group(ph: _Phase, buf: Buffer, off: int, label: int) -> tuple[int, Buffer, int]:
        return (ph.index, buf, (off - label) // ph.schedule.chunks_per_period)

    def locate(self, ph: _Phase, ref: OpRef, buf: Buffer, off: int, labels: list[int]) -> Loc:
        """The AllReduce location of an op's range (``count * k`` chunks from the returned offset)."""
        first: Loc | None = None
        for i, lab in enumerate(labels):
            home = ph.home(ref.rank, buf, off + i, lab)
            if home is None:
                where = (
                    Buffer.SCRATCH,
                    lab * ph.k + self.period[ref.rank][self._group(ph, buf, off + i, lab)] * self.c,
                )
            else:
                where = (home, lab * ph.k)
            if first is None:
                first = where
            elif where != (first[0], first[1] + i * ph.k):
                raise ScheduleError(
                    f"fuse_all_reduce: {ref} of {ph.schedule.name or ph.schedule.collective.value} moves chunks "
                    f"{off}..{off + len(labels) - 1} of its {buf.name.lower()} buffer, which hold non-consecutive "
                    f"blocks {labels}: no range of the AllReduce's layout holds them (split the op)"
                )
        assert first is not None
        return first


def _accesses(ph: _Phase) -> Iterator[tuple[OpRef, Buffer, int, list[int]]]:
    """Every range an op of ``ph`` reads or writes: ``(op, buffer, offset, labels)``."""
    s = ph.schedule
    for ref, labels in ph.flow.src.items():
        op = s.ranks[ref.rank][ref.tb].ops[ref.op]
        yield ref, op.src, op.src_off, labels
    for ref, labels in ph.flow.dst.items():
        op = s.ranks[ref.rank][ref.tb].ops[ref.op]
        yield ref, op.dst, op.dst_off, labels


def _fuse_rank(r: int, layout: _Layout, channel_offset: int) -> tuple[Threadblock, ...]:
    """Rank ``r``'s threadblocks: the ReduceScatter's, then the AllGather's on shifted channels."""
    rs_ph, ag_ph = layout.phases
    rs_tbs, ag_tbs = rs_ph.schedule.ranks[r], ag_ph.schedule.ranks[r]
    mapped = {ph.index: _mapped_ops(r, ph, layout) for ph in layout.phases}

    # The ReduceScatter's accesses of the AllReduce's output, in round order: last writer and readers since.
    writer: dict[int, OpRef] = {}
    readers: dict[int, list[OpRef]] = {}
    for ops in rs_ph.flow.plan.rounds:
        for ref in ops:
            if ref.rank != r:
                continue
            reads, writes = _output_cells(mapped[0][(ref.tb, ref.op)])
            for x in reads:
                readers.setdefault(x, []).append(ref)
            for x in writes:
                writer[x] = ref
                readers[x] = []

    # The AllGather's ops: which are kept (a copy onto itself is not), their new places, their cross waits.
    new_tb: dict[int, int] = {}
    new_index: dict[tuple[int, int], tuple[int, int]] = {}
    cross: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for t, tb in enumerate(ag_tbs):
        kept = 0
        for i in range(len(tb.ops)):
            op = mapped[1][(t, i)]
            reads, writes = _output_cells(op)
            waits = {writer[x] for x in reads | writes if x in writer}
            waits.update(ref for x in writes for ref in readers.get(x, ()))
            cross[(t, i)] = {(ref.tb, ref.op) for ref in waits}
            if not _copies_onto_itself(op, ag_ph, OpRef(r, t, i)):
                if t not in new_tb:
                    new_tb[t] = len(rs_tbs) + len(new_tb)
                new_index[(t, i)] = (new_tb[t], kept)
                kept += 1

    anchors: dict[tuple[int, int], frozenset[tuple[int, int]]] = {}

    def anchor(t: int, i: int) -> frozenset[tuple[int, int]]:
        """Fused ops whose completion stands for AllGather op ``(t, i)``'s (itself, or what a dropped op waited for)."""
        if (t, i) in new_index:
            return frozenset({new_index[(t, i)]})
        if (t, i) not in anchors:
            got = set(cross[(t, i)])
            for dt, di in ag_tbs[t].ops[i].deps:
                got |= anchor(dt, di)
            if i > 0:
                got |= anchor(t, i - 1)
            anchors[(t, i)] = frozenset(got)
        return anchors[(t, i)]

    out = [
        Threadblock(tuple(mapped[0][(t, i)] for i in range(len(tb.ops))), tb.send_peer, tb.recv_peer, tb.channel)
        for t, tb in enumerate(rs_tbs)
    ]
    for t, tb in enumerate(ag_tbs):
        if t not in new_tb:
            continue
        me = new_tb[t]
        ops = []
        for i in range(len(tb.ops)):
            if (t, i) not in new_index:
                continue
            deps = set(cross[(t, i)])
            for dt, di in tb.ops[i].deps:
                deps |= anchor(dt, di)
            deps = {d for d in deps if d[0] != me}  # program order covers its own threadblock
            ops.append(dataclasses.replace(mapped[1][(t, i)], deps=tuple(sorted(deps))))
        out.append(Threadblock(tuple(ops), tb.send_peer, tb.recv_peer, tb.channel + channel_offset))
    return tuple(out)


def _mapped_ops(r: int, ph: _Phase, layout: _Layout) -> dict[tuple[int, int], Op]:
    """Rank ``r``'s ops of phase ``ph`` in the AllReduce's layout (dependencies as in the half)."""
    s, flow = ph.schedule, ph.flow
    sent: dict[OpRef, Loc] = {}  # where each message of the phase is read from / lands, on either end

    def at(ref: OpRef, op: Op, side: str) -> Loc:
        if side == "src":
            return layout.locate(ph, ref, op.src, op.src_off, flow.src[ref])
        return layout.locate(ph, ref, op.dst, op.dst_off, flow.dst[ref])

    def peer_loc(ref: OpRef) -> Loc | None:
        """Where the other end of ``ref``'s message reads or writes it (for the informational fields)."""
        other = flow.plan.receiver.get(ref) or flow.plan.sender.get(ref)
        if other is None:
            return None
        if other not in sent:
            o = s.ranks[other.rank][other.tb].ops[other.op]
            uses_src = o.kind in (OpKind.SEND, OpKind.RECV_REDUCE_SEND)
            sent[other] = at(other, o, "src" if uses_src else "dst")
        return sent[other]

    out: dict[tuple[int, int], Op] = {}
    for t, tb in enumerate(s.ranks[r]):
        for i, op in enumerate(tb.ops):
            ref = OpRef(r, t, i)
            src = dst = None
            if op.kind.reads_src:
                src = at(ref, op, "src")
            elif op.kind in _INFORMATIONAL_SRC and op.src is not None:
                src = peer_loc(ref)
            if op.kind.writes_dst:
                dst = at(ref, op, "dst")
            elif op.kind in _INFORMATIONAL_DST and op.dst is not None:
                dst = peer_loc(ref)
            out[(t, i)] = Op(
                op.kind,
                None if src is None else src[0],
                0 if src is None else src[1],
                None if dst is None else dst[0],
                0 if dst is None else dst[1],
                op.count * ph.k,
                op.deps,
            )
    return out


def _output_cells(op: Op) -> tuple[set[int], set[int]]:
    """The AllReduce output chunks ``op`` reads and writes."""
    reads: set[int] = set()
    writes: set[int] = set()
    if op.kind.reads_src and op.src is Buffer.OUTPUT:
        reads.update(range(op.src_off, op.src_off + op.count))
    if op.kind.writes_dst and op.dst is Buffer.OUTPUT:
        writes.update(range(op.dst_off, op.dst_off + op.count))
        if op.kind is OpKind.REDUCE:
            reads.update(range(op.dst_off, op.dst_off + op.count))
    return reads, writes


def _copies_onto_itself(op: Op, ph: _Phase, ref: OpRef) -> bool:
    """Whether ``op`` is a copy whose source and destination are one range (the AllGather's own block)."""
    if op.kind is not OpKind.COPY or op.src is not op.dst:
        return False
    if op.src_off == op.dst_off:
        return True
    if abs(op.src_off - op.dst_off) < op.count:
        raise ScheduleError(
            f"fuse_all_reduce: {ref} of {ph.schedule.name or 'the all_gather schedule'} copies between "
            f"overlapping ranges of the AllReduce's {op.src.name.lower()} buffer"
        )
    return False
