"""The executor's dataflow order, in Python: which ops wait for which, and which unit a threadblock runs next.

A port of the rule the executors run (``xla_ffi/core/program_builder.h``,
``UnitOf`` / ``UnitReady`` / ``NextReadyUnit`` / ``kLookahead`` in
``xla_ffi/core/protocol.h``; ``docs/executor.md``, "No head-of-line blocking"),
so that the simulator executes what the executor executes.
``tests/sim/test_ordering_agreement.py`` compares it with the C++ builder's
programs and ``NextReadyUnit``, which the native module exports.

**Rows.** The executor runs the compiled table, whose threadblocks hold *rows*:
an op with ``k > 1`` dependencies on other threadblocks becomes ``k - 1``
dependency ``nop`` rows in front of it, one dependency each, and the op keeps
the last (``jaxccl/schedule/table.py``); dependencies on the op's own
threadblock are dropped (program order implies them). Row indices are
rank-local: the rows of a rank's threadblocks one after the other.

**Waits.** The table is run once in program order, every threadblock in turn
as far as it can go (its dependency done, its message posted, its slot free),
round-robin until nothing moves. Each row then waits for the rows of its rank
(any threadblock) that touched its chunks before it in that run: the last
writer of every ``OUTPUT`` / ``SCRATCH`` chunk it reads or writes, and the
readers since that write of every chunk it writes (``INPUT`` is never
written). A ``nop`` touches no chunk, so it waits for nothing but its
dependency and nothing waits for it: it is no barrier. If the run cannot
finish (the table deadlocks in program order), every row waits for the row
before it in its threadblock instead. A row is ready when its dependency and
waits are done, its message is posted and its slot is free.

**Units and the window.** Tile ``t`` of row ``i`` of a threadblock of ``n``
rows is unit ``t * n + i``. A threadblock runs the first ready unit among the
``LOOKAHEAD`` units from its first unfinished one (:func:`next_ready_unit`),
so a unit starts only once every unit at least ``LOOKAHEAD`` before it is
done.

>>> from jaxccl.schedule import Buffer, Op, OpKind, Schedule, Threadblock
>>> I, O = Buffer.INPUT, Buffer.OUTPUT
>>> tb0 = Threadblock((Op(OpKind.RECV, O, 2, O, 2), Op(OpKind.SEND, I, 0, O, 0), Op(OpKind.SEND, O, 2, O, 2)),
...                   send_peer=1, recv_peer=1)
>>> tb1 = Threadblock((Op(OpKind.COPY, O, 2, O, 3, deps=((0, 0),)), Op(OpKind.NOP, deps=((0, 1),)),
...                   Op(OpKind.COPY, I, 0, O, 1)))
>>> peer = Threadblock((Op(OpKind.SEND, I, 0, O, 2), Op(OpKind.RECV, O, 0, O, 0), Op(OpKind.RECV, O, 2, O, 2)),
...                    send_peer=0, recv_peer=0)
>>> order = dataflow_order(Schedule("all_gather", 2, 1, ((tb0, tb1), (peer,))))
>>> order.op_waits(0)  # the 2nd send waits for the receive of its chunk, not the 1st send; no op waits for the nop
[[(), (), ((0, 0),)], [((0, 0),), ((0, 1),), ()]]
"""

from __future__ import annotations

import dataclasses
import heapq
from array import array
from typing import Protocol

from jaxccl.errors import ScheduleError
from jaxccl.schedule.ir import Buffer, Op, OpKind, Schedule

__all__ = [
    "ALL_DONE",
    "LOOKAHEAD",
    "NONE_READY",
    "DataflowOrder",
    "Probe",
    "RankRows",
    "Unit",
    "dataflow_order",
    "next_ready_unit",
    "unit_of",
    "unit_ready",
]

# kLookahead of xla_ffi/core/protocol.h; the native module exports it as LOOKAHEAD and the agreement test checks it.
LOOKAHEAD = 256
ALL_DONE = -1  # kAllDone: every unit of the threadblock is done
NONE_READY = -2  # kNoneReady: no unit in the window is ready

_SENDS = frozenset(k for k in OpKind if k.sends)
_RECEIVES = frozenset(k for k in OpKind if k.receives)
_READS_SRC = frozenset(k for k in OpKind if k.reads_src)
_WRITES_DST = frozenset(k for k in OpKind if k.writes_dst)


@dataclasses.dataclass(frozen=True)
class RankRows:
    """One rank's rows (a table's rows of that rank, rank-local indices), as parallel lists.

    Attributes:
        ops: each row's schedule op; ``None`` for a dependency ``nop`` the table inserts.
        tb: each row's threadblock.
        op: each row's op index in its schedule threadblock; ``-1`` for a dependency ``nop`` the table inserts.
        dep: each row's dependency (a row), ``-1``: none.
        waits: the rows each row waits for besides its dependency, sorted.
        send_msg: each row's message on its threadblock's send connection (per tile), ``-1``: none.
        recv_msg: the same on its receive connection.
        tbs: per threadblock ``(first row, rows, send connection, receive connection)`` (``-1``: none).
    """

    ops: list[Op | None]
    tb: array[int]
    op: array[int]
    dep: array[int]
    waits: list[tuple[int, ...]]
    send_msg: array[int]
    recv_msg: array[int]
    tbs: list[tuple[int, int, int, int]]

    def kind(self, x: int) -> OpKind:
        """Row ``x``'s op kind."""
        op = self.ops[x]
        return OpKind.NOP if op is None else op.kind

    def row_of(self, tb: int, op: int) -> int:
        """The row of op ``op`` of threadblock ``tb`` (of the schedule)."""
        first, n = self.tbs[tb][0], self.tbs[tb][1]
        # the op's row comes after the dependency nops the table put in front of it: search forward
        x = first + op
        while self.op[x] != op:
            x += 1
            if x >= first + n:
                raise ScheduleError(f"threadblock {tb} has no op {op}")
        return x


@dataclasses.dataclass(frozen=True)
class DataflowOrder:
    """The dataflow order of a schedule: every rank's rows and their waits (see the module docstring).

    Attributes:
        ranks: per rank, its rows.
        in_order: the program-order run deadlocked: every row waits for its predecessor.
        conn_msgs: messages per connection (per tile); connections are numbered as the table numbers them
            (sorted by sending rank, receiving rank, channel).
        num_slots: slots per connection (``None``: unbounded).
    """

    ranks: tuple[RankRows, ...]
    in_order: bool
    conn_msgs: tuple[int, ...]
    num_slots: int | None

    def op_waits(self, rank: int) -> list[list[tuple[tuple[int, int], ...]]]:
        """Per threadblock, per op of ``rank``: the ``(threadblock, op)`` it waits for (dependency and waits).

        A dependency ``nop`` row the table inserted is replaced by what it waits for, so that only ops remain.
        """
        rows = self.ranks[rank]
        ops = self._resolver(rank)
        out: list[list[tuple[tuple[int, int], ...]]] = [[] for _ in rows.tbs]
        for x in range(len(rows.op)):
            if rows.op[x] < 0:
                continue
            got: set[tuple[int, int]] = set()
            for y in self._row_waits(rows, x):
                got.update(ops(y))
            out[rows.tb[x]].append(tuple(sorted(got)))
        return out

    def row_ops(self, rank: int) -> list[tuple[tuple[int, int], ...]]:
        """Per row of ``rank``: the ``(threadblock, op)`` whose completion makes the row done.

        An op's row: the op. A dependency ``nop`` row: the ops it waits for (it does nothing itself).
        """
        ops = self._resolver(rank)
        return [tuple(sorted(ops(x))) for x in range(len(self.ranks[rank].op))]

    @staticmethod
    def _row_waits(rows: RankRows, x: int) -> tuple[int, ...]:
        return rows.waits[x] + ((rows.dep[x],) if rows.dep[x] >= 0 else ())

    def _resolver(self, rank: int):  # noqa: ANN202 - a closure over the rank's rows
        rows = self.ranks[rank]
        memo: dict[int, frozenset[tuple[int, int]]] = {}

        def ops(x: int) -> frozenset[tuple[int, int]]:
            if rows.op[x] >= 0:
                return frozenset(((rows.tb[x], rows.op[x]),))
            got = memo.get(x)
            if got is None:
                # a nop row only ever waits for earlier rows of its rank's run, so this recursion ends
                got = frozenset().union(*(ops(y) for y in self._row_waits(rows, x)))
                memo[x] = got
            return got

        return ops


def dataflow_order(schedule: Schedule, num_slots: int | None = 8) -> DataflowOrder:
    """The executor's rows, dependencies and waits of ``schedule`` compiled with ``num_slots`` slots per connection.

    ``num_slots=None``: unbounded slots (no table has them; the simulator's ``num_slots=None``).

    Raises:
        ScheduleError: an op depends on an op that does not exist or on a later op of its own threadblock.
    """
    conn_keys = sorted((r, tb.send_peer, tb.channel) for r, tbs in enumerate(schedule.ranks) for tb in tbs
                       if tb.send_peer >= 0)  # fmt: skip
    conn_index = {k: c for c, k in enumerate(conn_keys)}
    conn_msgs = [0] * len(conn_keys)
    ranks = [_rows(schedule, r, conn_index, conn_msgs) for r in range(schedule.num_ranks)]
    in_order = not _in_order_hazards(ranks, len(conn_keys), num_slots)
    if in_order:
        for rows in ranks:
            rows.waits[:] = [(x - 1,) if x > rows.tbs[rows.tb[x]][0] else () for x in range(len(rows.op))]
    return DataflowOrder(tuple(ranks), in_order, tuple(conn_msgs), num_slots)


def _rows(schedule: Schedule, r: int, conn_index: dict[tuple[int, int, int], int], conn_msgs: list[int]) -> RankRows:
    """Rank ``r``'s rows as the table lays them out (dependency nops, message indices), waits still empty."""
    tbs = schedule.ranks[r]
    none: list[tuple[int, int]] = []
    cross = []  # per tb, per op: its dependencies on other threadblocks, sorted
    index = []  # per tb, per op: its row within the threadblock
    firsts = []  # per tb: its first row
    total = 0
    for t, tb in enumerate(tbs):
        per_op, idx, k = [], [], 0
        for i, op in enumerate(tb.ops):
            deps = op.deps
            if deps:
                for dt, di in deps:
                    if not (0 <= dt < len(tbs) and 0 <= di < len(tbs[dt].ops)) or (dt == t and di >= i):
                        raise ScheduleError(f"rank {r} threadblock {t} op {i} depends on missing op ({dt}, {di})")
                deps = sorted({(dt, di) for dt, di in deps if dt != t})
                if len(deps) > 1:
                    k += len(deps) - 1
            per_op.append(deps or none)
            idx.append(k)
            k += 1
        cross.append(per_op)
        index.append(idx)
        firsts.append(total)
        total += k
    ops: list[Op | None] = []
    row_tb, row_op, row_dep, row_send, row_recv = array("i"), array("i"), array("i"), array("i"), array("i")
    tb_rows = []
    for t, tb in enumerate(tbs):
        sc = conn_index.get((r, tb.send_peer, tb.channel), -1) if tb.send_peer >= 0 else -1
        rc = conn_index.get((tb.recv_peer, r, tb.channel), -1) if tb.recv_peer >= 0 else -1
        first = len(ops)
        sends = recvs = 0
        for i, op in enumerate(tb.ops):
            dep = -1
            deps = cross[t][i]
            if deps:
                mapped = [firsts[dt] + index[dt][di] for dt, di in deps]
                for d in mapped[:-1]:  # a dependency nop row per dependency but the last
                    ops.append(None)
                    row_tb.append(t)
                    row_op.append(-1)
                    row_dep.append(d)
                    row_send.append(-1)
                    row_recv.append(-1)
                dep = mapped[-1]
            kind = op.kind
            ops.append(op)
            row_tb.append(t)
            row_op.append(i)
            row_dep.append(dep)
            if kind in _SENDS:
                row_send.append(sends)
                sends += 1
            else:
                row_send.append(-1)
            if kind in _RECEIVES:
                row_recv.append(recvs)
                recvs += 1
            else:
                row_recv.append(-1)
        if sc >= 0:
            conn_msgs[sc] = sends
        tb_rows.append((first, len(ops) - first, sc, rc))
    return RankRows(ops, row_tb, row_op, row_dep, [()] * len(ops), row_send, row_recv, tb_rows)


class _Hazards:
    """One rank's chunks: the last writer of each and its readers since (``HazardTracker``)."""

    def __init__(self) -> None:
        self.writer: dict[int, int] = {}  # chunk key (_chunks) -> row
        self.readers: dict[int, list[int]] = {}

    def visit(self, x: int, op: Op) -> tuple[int, ...]:
        """Records row ``x`` running ``op``; returns the rows it must follow, sorted."""
        kind = op.kind
        reads_dst = kind is OpKind.REDUCE
        writes_dst = kind in _WRITES_DST
        src = _chunks(op.src, op.src_off, op.count) if kind in _READS_SRC else ()
        dst = _chunks(op.dst, op.dst_off, op.count) if writes_dst else ()  # re writes what it reads
        if not src and not dst:
            return ()
        writer, readers = self.writer, self.readers
        waits: list[int] = [writer[key] for key in src if key in writer]
        if reads_dst:
            waits.extend(writer[key] for key in dst if key in writer)
        if writes_dst:
            for key in dst:
                w = writer.get(key)
                if w is not None:
                    waits.append(w)
                rs = readers.get(key)
                if rs:
                    waits.extend(rs)
                writer[key] = x
                readers[key] = []
        for key in src:
            rs = readers.get(key)
            if rs is None:
                readers[key] = [x]
            else:
                rs.append(x)
        if reads_dst:
            for key in dst:
                readers[key].append(x)
        if not waits:
            return ()
        got = set(waits)
        got.discard(x)
        return tuple(sorted(got))


_TRACKED = {Buffer.OUTPUT: 1, Buffer.SCRATCH: 2}  # INPUT is never written


def _chunks(buf: Buffer | None, off: int, count: int) -> range | tuple[()]:
    """Keys of chunks ``off .. off + count - 1`` of ``buf`` (chunk * 4 + buffer), none for ``INPUT``."""
    b = _TRACKED.get(buf)  # type: ignore[arg-type]
    if b is None:
        return ()
    return range(off * 4 + b, (off + count) * 4 + b, 4)


def _in_order_hazards(ranks: list[RankRows], num_conns: int, num_slots: int | None) -> bool:
    """``InOrderHazards``: runs the rows in program order, filling every row's waits; False on a deadlock.

    The C++ run visits every threadblock in turn, round-robin, until a pass moves nothing; a threadblock
    whose blocking condition did not change since it last stopped stops again at once. This run visits,
    in each pass and in the same order, only the threadblocks whose condition may have changed (woken by
    the row, message or slot they stopped on), so it executes the same rows in the same order.
    """
    tbs = [(r, t) for r, rows in enumerate(ranks) for t in range(len(rows.tbs))]
    sender_tb = [-1] * num_conns
    receiver_tb = [-1] * num_conns
    for g, (r, t) in enumerate(tbs):
        _, _, sc, rc = ranks[r].tbs[t]
        if sc >= 0:
            sender_tb[sc] = g
        if rc >= 0:
            receiver_tb[rc] = g
    slots = num_slots if num_slots is not None else 1 << 62
    posted = [0] * num_conns
    consumed = [0] * num_conns
    done = [bytearray(len(rows.op)) for rows in ranks]
    nxt = [0] * len(tbs)
    hazards = [_Hazards() for _ in ranks]
    waiters: list[dict[int, list[int]]] = [{} for _ in ranks]  # per rank: row -> threadblocks stopped on it
    executed, total = 0, sum(len(rows.op) for rows in ranks)
    current = list(range(len(tbs)))
    while current:
        queued = set(current)  # in this pass, visited or still to visit
        heapq.heapify(current)
        later: set[int] = set()
        while current:
            g = heapq.heappop(current)
            r, t = tbs[g]
            rows, is_done, stopped, visit = ranks[r], done[r], waiters[r], hazards[r].visit
            row_ops, row_dep, row_waits = rows.ops, rows.dep, rows.waits
            send_msg, recv_msg = rows.send_msg, rows.recv_msg
            first, n, sc, rc = rows.tbs[t]
            woken: list[int] = []
            x, end = first + nxt[g], first + n
            while x < end:
                op, dep = row_ops[x], row_dep[x]
                if dep >= 0 and not is_done[dep]:
                    stopped.setdefault(dep, []).append(g)
                    break
                if op is not None:
                    kind = op.kind
                    receives = kind in _RECEIVES
                    if receives and (rc < 0 or posted[rc] <= recv_msg[x]):
                        break
                    sends = sc >= 0 and kind in _SENDS
                    if sends and send_msg[x] - consumed[sc] >= slots:
                        break
                    if receives:
                        consumed[rc] += 1
                        woken.append(sender_tb[rc])
                    if sends:
                        posted[sc] = send_msg[x] + 1
                        woken.append(receiver_tb[sc])
                    row_waits[x] = visit(x, op)
                is_done[x] = 1
                if stopped:
                    woken.extend(stopped.pop(x, ()))
                x += 1
            executed += x - first - nxt[g]
            nxt[g] = x - first
            for h in woken:
                if h < 0 or h == g:
                    continue
                if h > g and h not in queued:
                    queued.add(h)
                    heapq.heappush(current, h)
                elif h < g:
                    later.add(h)
        current = sorted(later)
    return executed == total


class Probe(Protocol):
    """A backend's view of the flags (``Probe`` of ``UnitReady`` / ``NextReadyUnit``)."""

    def done(self, tile: int, row: int) -> bool: ...

    def posted(self, conn: int, msg: int) -> bool: ...

    def slot_free(self, conn: int, msg: int) -> bool:
        """Whether message ``msg - num_slots`` of ``conn`` was consumed (asked for ``msg >= num_slots``)."""
        ...


@dataclasses.dataclass(frozen=True)
class Unit:
    """Tile ``tile`` of row ``row``, whose messages are ``send_msg`` and ``recv_msg`` (``-1``: none) (``Unit``)."""

    tile: int
    row: int
    send_msg: int
    recv_msg: int


def unit_of(order: DataflowOrder, rank: int, tb: int, v: int) -> Unit:
    """Unit ``v`` of threadblock ``tb`` of ``rank`` (``UnitOf``)."""
    rows = order.ranks[rank]
    first, n, sc, rc = rows.tbs[tb]
    tile, x = v // n, first + v % n
    s = tile * order.conn_msgs[sc] + rows.send_msg[x] if rows.send_msg[x] >= 0 else -1
    r = tile * order.conn_msgs[rc] + rows.recv_msg[x] if rows.recv_msg[x] >= 0 else -1
    return Unit(tile, x, s, r)


def unit_ready(order: DataflowOrder, rank: int, tb: int, u: Unit, probe: Probe) -> bool:
    """Whether unit ``u`` may run (``UnitReady``): its dependency and waits done in its tile, message, slot."""
    rows = order.ranks[rank]
    _, _, sc, rc = rows.tbs[tb]
    dep = rows.dep[u.row]
    if dep >= 0 and not probe.done(u.tile, dep):
        return False
    if any(not probe.done(u.tile, w) for w in rows.waits[u.row]):
        return False
    if u.recv_msg >= 0 and not probe.posted(rc, u.recv_msg):
        return False
    slots = order.num_slots
    return not (slots is not None and u.send_msg >= slots and not probe.slot_free(sc, u.send_msg))


def next_ready_unit(
    order: DataflowOrder, rank: int, tb: int, tiles: int, first: int, probe: Probe, lookahead: int = LOOKAHEAD
) -> tuple[int, int]:
    """The threadblock's next unit in dataflow order (``NextReadyUnit``) and its advanced first unfinished unit.

    ``first`` moves past done units; then the first ready unit among ``lookahead`` from it is picked
    (``lookahead=1``: program order). Returns ``(unit, first)``; ``unit`` is :data:`ALL_DONE` or
    :data:`NONE_READY` when there is none.

    Raises:
        ScheduleError: no such threadblock, ``tiles`` or ``lookahead`` below 1, ``first`` out of range.
    """
    if not 0 <= rank < len(order.ranks) or not 0 <= tb < len(order.ranks[rank].tbs):
        raise ScheduleError(f"no threadblock {tb} of rank {rank}")
    if tiles < 1 or lookahead < 1:
        raise ScheduleError(f"tiles and lookahead must be >= 1, got {tiles} and {lookahead}")
    rows = order.ranks[rank]
    t0, n = rows.tbs[tb][0], rows.tbs[tb][1]
    end = n * tiles
    if not 0 <= first <= end:
        raise ScheduleError(f"first unit {first} is outside 0..{end}")
    while first < end and probe.done(first // n, t0 + first % n):
        first += 1
    if first == end:
        return ALL_DONE, first
    for v in range(first, min(first + lookahead, end)):
        if v != first and probe.done(v // n, t0 + v % n):
            continue
        if unit_ready(order, rank, tb, unit_of(order, rank, tb, v), probe):
            return v, first
    return NONE_READY, first
