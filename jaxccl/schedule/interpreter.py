"""The reference interpreter: runs a :class:`Schedule` symbolically and checks it.

:func:`check` (what :meth:`Schedule.validate` calls) proves, for one schedule,
that it

1. is well formed: peers in range and not the rank itself, one threadblock
   per (send peer, channel) and per (receive peer, channel), op kinds that fit
   their threadblock's peers, chunk ranges inside their buffers, no op writing
   the (read-only, out-of-place) input buffer, chunk classes
   kept (``src_off == dst_off (mod period)`` for local ops and between a
   sender's sent range and its receiver's range), dependencies naming existing
   ops of other threadblocks of the same rank, no dependency cycle, and the
   k-th message of every connection received by an op of the same ``count``;
2. runs to completion with ``num_slots`` message slots per connection (eager
   sends, FIFO connections) -- otherwise it reports the deadlock: every blocked
   op and what it waits for;
3. is race-free: two ops of different threadblocks of one rank that touch the
   same chunk, one of them writing it, are ordered by program order and
   dependencies (per-rank vector clocks); nothing reads a chunk that nothing
   wrote (input chunks excepted);
4. computes its collective: every chunk holds a symbolic term -- a leaf
   ``(rank, input chunk)`` or a hash-consed commutative sum of two terms -- and
   every output chunk must equal the collective's definition (for reductions:
   exactly one leaf per rank; with ``ordered_reduction`` the term must be the
   ascending left fold ``((x0 + x1) + x2) + ...`` up to commutativity of each
   addition; with ``info["fold"] == "gloo_tree"`` it must be gloo's tree,
   :func:`jaxccl.schedule.reduction.gloo_tree`, what XLA:CPU's reductions across
   processes compute, e.g. ``((x0 + x1) + (x2 + x3)) + (x4 + x5)`` for 6
   ranks, again up to commutativity). The proof is the operator's too: a reduction is a property of
   the call (sum, max or min, :mod:`jaxccl.schedule.reduction`), so a schedule
   that folds in rank order computes ``jax.lax``'s max and min as well; the
   values of one step per dtype are :func:`jaxccl.schedule.reduction.step`'s,
   which every executor applies as ``step(local operand, other operand)``.
   Which side of a step the accumulator is on is *not* checked (the 2-rank
   rings fold ``x1 + x0`` on rank 1 and count as ordered); it decides only
   ties between ``-0`` and ``+0`` in max/min and which of two NaNs a sum
   keeps, and the default schedules keep the accumulator local.

Execution is synchronous in *rounds*: in each round every threadblock whose
next op is enabled at the start of the round runs it (its dependencies done in
earlier rounds, its message sent in an earlier round, a free slot at the start
of the round). Enabledness is persistent (only a connection's one receiver
consumes it and only its one sender fills it), so whether a schedule
deadlocks does not depend on this choice of interleaving. A fused
receive-and-send op needs its message and a free slot at the same time, as
MSCCL's primitives do; this can only find more deadlocks than a receive
followed by a separate wait for a slot.

:func:`simulate_rounds` returns the rounds themselves (for the ppermute
lowering); :func:`evaluate` runs them on numpy values with the reduction rule
of the call (sum, max or min), the executors' reference in Python.

Cost is linear in the number of chunk accesses plus vector-clock merges at
dependencies, so schedules with hundreds of ranks and a few hundred thousand
ops check in seconds.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import sys
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from jaxccl.errors import ArgumentError, ScheduleError
from jaxccl.schedule.ir import Buffer, Collective, OpKind, Schedule, chunk_bounds, period_elements
from jaxccl.schedule.reduction import ReduceOp, finish, gloo_tree, step

DEFAULT_NUM_SLOTS = 8
_MAX_REPORTED = 12
# Chunk cells (ranks x chunks of input, output and used scratch) the interpreter tracks at most:
# about 1.5 GB of bookkeeping; a 512-GPU AllGather with 128 chunks per period needs 34 million.
MAX_CHUNK_CELLS = 1 << 26

# Op kind codes (OpKind declaration order) for the hot loop.
_S, _R, _RCS, _RRC, _RRS, _RRCS, _CPY, _RE, _NOP = range(9)
_SENDS = {_S, _RCS, _RRS, _RRCS}
_RECVS = {_R, _RCS, _RRC, _RRS, _RRCS}
_KINDS = {k: (k.code, k.sends, k.receives, k.reads_src, k.writes_dst) for k in OpKind}
_SENDS_SRC = (OpKind.SEND, OpKind.RECV_REDUCE_SEND)  # sending ops whose message is their src range


class OpRef(NamedTuple):
    """One op: ``(rank, threadblock index, op index)``."""

    rank: int
    tb: int
    op: int

    def __str__(self) -> str:
        return f"rank {self.rank} tb {self.tb} op {self.op}"


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """What :func:`check` found about a valid schedule.

    Attributes:
        num_ops: ops executed (all of them).
        num_messages: messages sent over all connections.
        num_connections: distinct ``(sender, receiver, channel)`` connections.
        num_rounds: synchronous rounds until completion (see the module docstring).
        max_in_flight: the most unconsumed messages any connection held at once.
        num_slots: the slots per connection the schedule was run with.
        ordered_reduction: whether the ascending-rank-order sum was checked.
    """

    num_ops: int
    num_messages: int
    num_connections: int
    num_rounds: int
    max_in_flight: int
    num_slots: int
    ordered_reduction: bool


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """The round structure of a schedule (see :func:`simulate_rounds`).

    Attributes:
        rounds: ``rounds[t]`` holds the ops that run in round ``t``, sorted.
            An op's dependencies, its threadblock predecessor and the sender
            of its message all ran in earlier rounds.
        round_of: the round of every op.
        receiver: for every op that sends, the op that receives its message.
        sender: for every op that receives, the op that sent its message.
        report: the :class:`CheckReport` of the run.
    """

    rounds: tuple[tuple[OpRef, ...], ...]
    round_of: dict[OpRef, int]
    receiver: dict[OpRef, OpRef]
    sender: dict[OpRef, OpRef]
    report: CheckReport


def check(schedule: Schedule, *, num_slots: int | None = None, ordered_reduction: bool | None = None) -> CheckReport:
    """Checks ``schedule`` (see the module docstring); raises :class:`ScheduleError` on the first problem.

    Args:
        schedule: the schedule.
        num_slots: message slots per connection (default 8, as MSCCL).
        ordered_reduction: require reductions to sum in ascending rank order;
            ``None`` reads ``schedule.info["ordered_reduction"]``.

    Returns:
        A :class:`CheckReport`.

    Example:
        >>> from jaxccl.synth.baselines import ring_allgather
        >>> check(ring_allgather(4)).num_rounds
        5
    """
    with gc_paused():
        return _Interpreter(schedule, num_slots, ordered_reduction, record=False).run().report


def simulate_rounds(schedule: Schedule, *, num_slots: int | None = None) -> RoundPlan:
    """Runs ``schedule`` (with every check of :func:`check`) and returns its rounds.

    With ``num_slots=None`` connections have unbounded slots, so each op runs
    in the first round after everything it needs is there (its ASAP level in
    the graph of program order, dependencies and message edges). A message
    sent in round ``t`` is received in a round ``> t``: a ppermute lowering
    can issue round ``t``'s sends as one batch of ``ppermute`` calls and
    deliver them to the receiving ops of later rounds.

    Example:
        >>> from jaxccl.synth.baselines import ring_allgather
        >>> plan = simulate_rounds(ring_allgather(3))
        >>> [len(r) for r in plan.rounds]
        [3, 3, 3, 3]
        >>> plan.receiver[OpRef(0, 0, 0)]
        OpRef(rank=1, tb=0, op=2)
    """
    slots = sys.maxsize if num_slots is None else num_slots
    with gc_paused():
        return _Interpreter(schedule, slots, None, record=True).run()


def evaluate(schedule: Schedule, inputs: Sequence, op: ReduceOp = ReduceOp.SUM) -> list:
    """Runs ``schedule`` on values: every rank's flat output buffer for the flat ``inputs[r]`` (numpy).

    The schedule is checked first (:func:`simulate_rounds`); its ops then run
    in rounds, each reduce op one :func:`jaxccl.schedule.reduction.step` with
    ``op`` (the local operand as the accumulator, as every executor), and the
    result gets :func:`~jaxccl.schedule.reduction.finish`. With an ordered
    schedule (the defaults) and :func:`~jaxccl.schedule.reduction.wire_dtype`
    inputs the outputs are bitwise equal to ``jax.lax`` on CPU.

    Example:
        >>> import numpy as np
        >>> from jaxccl.runtime.default_schedules import direct_allreduce
        >>> xs = [np.array([1.0, -0.0], np.float32), np.array([np.nan, -0.0], np.float32)]
        >>> [y.tolist() for y in evaluate(direct_allreduce(2), xs, ReduceOp.MAX)]
        [[1.0, -0.0], [1.0, -0.0]]
    """
    import numpy as np

    n, c = schedule.num_ranks, schedule.chunks_per_period
    xs = [np.asarray(x).reshape(-1) for x in inputs]
    if len(xs) != n or len({(x.shape, x.dtype) for x in xs}) != 1:
        raise ArgumentError(f"evaluate: expected {n} flat inputs of one shape and dtype")
    period = period_elements(schedule.collective, n, xs[0].shape[0])
    plan = simulate_rounds(schedule, num_slots=None)

    def span(off: int, count: int) -> slice:
        return slice(chunk_bounds(off, c, period)[0], chunk_bounds(off + count - 1, c, period)[1])

    def alloc(buf: Buffer, like):
        return np.zeros(chunk_bounds(schedule.buffer_chunks(buf), c, period)[0], like.dtype)

    mem = [
        {Buffer.INPUT: x, Buffer.OUTPUT: alloc(Buffer.OUTPUT, x), Buffer.SCRATCH: alloc(Buffer.SCRATCH, x)} for x in xs
    ]
    inbox: dict[OpRef, object] = {}
    with np.errstate(all="ignore"):
        for ops in plan.rounds:
            for ref in ops:
                o = schedule.ranks[ref.rank][ref.tb].ops[ref.op]
                bufs = mem[ref.rank]
                src = bufs[o.src][span(o.src_off, o.count)] if o.kind.reads_src else None
                msg = inbox.pop(ref) if o.kind.receives else None
                if o.kind is OpKind.REDUCE:
                    val = step(op, bufs[o.dst][span(o.dst_off, o.count)], src)
                elif o.kind.reduces:
                    val = step(op, src, msg)
                else:
                    val = msg if o.kind.receives else src
                if o.kind.writes_dst:
                    bufs[o.dst][span(o.dst_off, o.count)] = val
                if o.kind.sends:
                    inbox[plan.receiver[ref]] = np.array(val, copy=True)
    outs = [m[Buffer.OUTPUT] for m in mem]
    return [finish(op, y) for y in outs] if schedule.collective.reduces else outs


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector (allocation-heavy code that makes no cycles).

    Full collections over heaps of 10^6 small objects cost more than the work
    itself; reference counting still frees everything.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ----------------------------------------------------------------------- internals
def _fail(msg: str) -> None:
    raise ScheduleError(msg)


class _Interpreter:
    def __init__(self, schedule: Schedule, num_slots: int | None, ordered: bool | None, record: bool):
        if not isinstance(schedule, Schedule):
            raise ScheduleError(f"expected a Schedule, got {type(schedule).__name__}")
        slots = DEFAULT_NUM_SLOTS if num_slots is None else num_slots
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ScheduleError(f"num_slots must be a positive integer, got {num_slots!r}")
        self.s = schedule
        self.slots = slots
        if ordered is None:
            ordered = bool(schedule.info.get("ordered_reduction", False))
        self.ordered = bool(ordered) and schedule.collective.reduces
        self.gloo_tree = schedule.info.get("fold") == "gloo_tree" and schedule.collective.reduces
        self.record = record
        self.n = schedule.num_ranks
        self.period = schedule.chunks_per_period
        self.sizes = (schedule.in_chunks, schedule.out_chunks, schedule.scratch_chunks)

    # ------------------------------------------------------------------ structure
    def _name(self, r: int, t: int, i: int | None = None) -> str:
        if i is None:
            return f"rank {r} tb {t}"
        kind = self.s.ranks[r][t].ops[i].kind.value
        return f"rank {r} tb {t} op {i} ({kind})"

    def _structure(self) -> None:
        s, n, p, sizes = self.s, self.n, self.period, self.sizes
        send_tb: dict[tuple[int, int, int], int] = {}
        recv_tb: dict[tuple[int, int, int], int] = {}
        send_ops: dict[tuple[int, int], list[int]] = {}
        recv_ops: dict[tuple[int, int], list[int]] = {}
        scratch_used = 0
        for r, tbs in enumerate(s.ranks):
            num_tbs = len(tbs)
            for t, tb in enumerate(tbs):
                sp, rp, chan = tb.send_peer, tb.recv_peer, tb.channel
                for label, peer in (("send", sp), ("recv", rp)):
                    if not isinstance(peer, int) or not -1 <= peer < n:
                        _fail(f"rank {r} tb {t}: {label} peer {peer!r} out of range (-1 or 0..{n - 1})")
                    if peer == r:
                        _fail(f"rank {r} tb {t}: {label} peer is the rank itself")
                if not isinstance(chan, int) or chan < 0:
                    _fail(f"rank {r} tb {t}: channel must be a non-negative integer, got {chan!r}")
                for peer, table, label in ((sp, send_tb, "send to"), (rp, recv_tb, "receive from")):
                    if peer >= 0:
                        key = (r, peer, chan)
                        if key in table:
                            _fail(
                                f"rank {r}: tb {table[key]} and tb {t} both {label} rank {peer} on channel "
                                f"{chan} (one threadblock per peer and channel)"
                            )
                        table[key] = t
                sends, recvs = [], []
                for i, op in enumerate(tb.ops):
                    _, snd, rcv, rs, wd = _KINDS[op.kind]
                    if snd:
                        if sp < 0:
                            _fail(f"{self._name(r, t, i)}: sends but its threadblock has no send peer")
                        sends.append(i)
                    if rcv:
                        if rp < 0:
                            _fail(f"{self._name(r, t, i)}: receives but its threadblock has no receive peer")
                        recvs.append(i)
                    count = op.count
                    if rs and op.src is Buffer.SCRATCH:
                        scratch_used = max(scratch_used, op.src_off + count)
                    if wd and op.dst is Buffer.SCRATCH:
                        scratch_used = max(scratch_used, op.dst_off + count)
                    if rs and op.src_off + count > sizes[op.src]:
                        self._range_error(r, t, i, "src", op.src, op.src_off, count)
                    if wd and op.dst_off + count > sizes[op.dst]:
                        self._range_error(r, t, i, "dst", op.dst, op.dst_off, count)
                    if wd and op.dst is Buffer.INPUT:
                        _fail(
                            f"{self._name(r, t, i)}: writes the input buffer; inputs are read-only "
                            "(jaxccl collectives are out-of-place: use the output or scratch buffer)"
                        )
                    if rs and wd and (op.src_off - op.dst_off) % p:
                        _fail(
                            f"{self._name(r, t, i)}: src chunk {op.src_off} and dst chunk {op.dst_off} are not "
                            f"congruent mod period {p}"
                        )
                    for dt, di in op.deps:
                        if dt == t:
                            _fail(
                                f"{self._name(r, t, i)}: depends on its own threadblock (tb {dt} op {di}); "
                                "program order already orders it"
                            )
                        if not 0 <= dt < num_tbs or not 0 <= di < len(tbs[dt].ops):
                            _fail(
                                f"{self._name(r, t, i)}: depends on tb {dt} op {di}, which does not exist on rank {r}"
                            )
                send_ops[(r, t)] = sends
                recv_ops[(r, t)] = recvs
        # Scratch no op touches is never allocated: a declared size costs nothing until it is used.
        self.alloc = (sizes[0], sizes[1], min(sizes[2], scratch_used))
        cells = n * sum(self.alloc)
        if cells > MAX_CHUNK_CELLS:
            _fail(
                f"schedule too large to check: {n} ranks x {sum(self.alloc)} chunks of input, output and used "
                f"scratch = {cells} chunk cells, above the interpreter's limit of {MAX_CHUNK_CELLS}"
            )
        # Match the k-th message of every connection.
        self.conns: list[tuple[int, int, int]] = sorted(set(send_tb) | {(a, r, c) for (r, a, c) in recv_tb})
        self.conn_id = {k: j for j, k in enumerate(self.conns)}
        self.matches: list[tuple[int, int, int, int, int, int]] = []
        for a, b, c in self.conns:
            st, rt = send_tb.get((a, b, c)), recv_tb.get((b, a, c))
            if st is None:
                if not recv_ops[(b, rt)]:
                    continue
                _fail(
                    f"rank {b} tb {rt} receives from rank {a} on channel {c}, "
                    f"but rank {a} has no threadblock sending to it"
                )
            sops = send_ops[(a, st)]
            if rt is None:
                if sops:
                    _fail(
                        f"rank {a} tb {st} sends {len(sops)} message(s) to rank {b} on channel {c}, "
                        f"but rank {b} has no threadblock receiving from rank {a} on channel {c}"
                    )
                continue
            rops = recv_ops[(b, rt)]
            if len(sops) != len(rops):
                _fail(
                    f"unmatched messages: rank {a} tb {st} sends {len(sops)} message(s) to rank {b} on channel {c}, "
                    f"rank {b} tb {rt} receives {len(rops)}"
                )
            sl, rl = s.ranks[a][st].ops, s.ranks[b][rt].ops
            for k, (i, j) in enumerate(zip(sops, rops)):
                so, ro = sl[i], rl[j]
                if so.count != ro.count:
                    _fail(
                        f"message {k} from rank {a} to rank {b} on channel {c}: {self._name(a, st, i)} sends "
                        f"{so.count} chunk(s) but {self._name(b, rt, j)} receives {ro.count}"
                    )
                s_off = so.src_off if so.kind in _SENDS_SRC else so.dst_off
                r_off = ro.src_off if ro.kind is OpKind.RECV_REDUCE_SEND else ro.dst_off
                if (s_off - r_off) % p:
                    _fail(
                        f"message {k} from rank {a} to rank {b} on channel {c}: chunk class changes "
                        f"({self._name(a, st, i)} sends chunk {s_off}, {self._name(b, rt, j)} uses chunk {r_off}; "
                        f"offsets must be congruent mod period {p})"
                    )
                if self.record:
                    self.matches.append((a, st, i, b, rt, j))
        self._check_cycles()

    def _range_error(self, r: int, t: int, i: int, label: str, buf: Buffer, off: int, count: int) -> None:
        _fail(
            f"{self._name(r, t, i)}: {label} chunks {off}..{off + count - 1} exceed the "
            f"{Buffer(buf).name.lower()} buffer ({self.sizes[buf]} chunks)"
        )

    def _check_cycles(self) -> None:
        for r, tbs in enumerate(self.s.ranks):
            if not any(op.deps for tb in tbs for op in tb.ops):
                continue
            preds: dict[tuple[int, int], list[tuple[int, int]]] = {}
            succs: dict[tuple[int, int], list[tuple[int, int]]] = collections.defaultdict(list)
            for t, tb in enumerate(tbs):
                for i, op in enumerate(tb.ops):
                    ps = [(t, i - 1)] if i else []
                    ps.extend(op.deps)
                    preds[(t, i)] = ps
                    for q in ps:
                        succs[q].append((t, i))
            indeg = {k: len(v) for k, v in preds.items()}
            ready = [k for k, d in indeg.items() if d == 0]
            done = 0
            while ready:
                k = ready.pop()
                done += 1
                for q in succs.get(k, ()):
                    indeg[q] -= 1
                    if indeg[q] == 0:
                        ready.append(q)
            if done == len(indeg):
                continue
            # Walk predecessors inside the unresolved part until one repeats.
            node = next(k for k, d in indeg.items() if d > 0)
            seen: dict[tuple[int, int], int] = {}
            path: list[tuple[int, int]] = []
            while node not in seen:
                seen[node] = len(path)
                path.append(node)
                node = next(q for q in preds[node] if indeg[q] > 0)
            cycle = path[seen[node] :][::-1]
            names = " -> ".join(self._name(r, t, i) for t, i in cycle[:_MAX_REPORTED])
            _fail(f"dependency cycle on rank {r}: {names} -> back to the first")

    # ------------------------------------------------------------------ execution
    def run(self) -> RoundPlan:
        self._structure()
        s, n = self.s, self.n
        in_chunks = self.sizes[0]

        # Global threadblocks.
        tb_rank: list[int] = []
        tb_local: list[int] = []
        tb_ops: list[list[tuple]] = []
        gid: list[list[int]] = []
        dep_targets: set[tuple[int, int]] = set()
        for r, tbs in enumerate(s.ranks):
            row = []
            for t in range(len(tbs)):
                row.append(len(tb_rank))
                tb_rank.append(r)
                tb_local.append(t)
            gid.append(row)
        conn_id = self.conn_id
        kinds = _KINDS
        for r, tbs in enumerate(s.ranks):
            for tb in tbs:
                sc = conn_id.get((r, tb.send_peer, tb.channel), -1) if tb.send_peer >= 0 else -1
                rc = conn_id.get((tb.recv_peer, r, tb.channel), -1) if tb.recv_peer >= 0 else -1
                ops = []
                grow = gid[r]
                for op in tb.ops:
                    if op.deps:
                        deps = tuple((grow[dt], di, dt) for dt, di in op.deps)
                        for g, di, _ in deps:
                            dep_targets.add((g, di))
                    else:
                        deps = ()
                    src, dst = op.src, op.dst
                    ops.append(
                        (
                            kinds[op.kind][0],
                            -1 if src is None else src,
                            op.src_off,
                            -1 if dst is None else dst,
                            op.dst_off,
                            op.count,
                            deps,
                            sc,
                            rc,
                        )
                    )
                tb_ops.append(ops)
        num_tbs = len(tb_ops)
        conn_recv_tb = [0] * len(self.conns)
        conn_send_tb = [0] * len(self.conns)
        for g in range(num_tbs):
            r, t = tb_rank[g], tb_local[g]
            tb = s.ranks[r][t]
            if tb.send_peer >= 0:
                j = conn_id.get((r, tb.send_peer, tb.channel))
                if j is not None:
                    conn_send_tb[j] = g
            if tb.recv_peer >= 0:
                conn_recv_tb[conn_id[(tb.recv_peer, r, tb.channel)]] = g

        # Memory: per rank and buffer, the term of every chunk (-1 = never written).
        mem = [
            [list(range(r * in_chunks, (r + 1) * in_chunks)), [-1] * self.alloc[1], [-1] * self.alloc[2]]
            for r in range(n)
        ]
        last_write = [[[-1] * size for size in self.alloc] for _ in range(n)]
        reads: list[list[list[list[int] | None]]] = [[[None] * size for size in self.alloc] for _ in range(n)]

        # Terms: ids < num_leaves are leaves; sums are interned pairs.
        self.num_leaves = n * in_chunks
        nl = self.num_leaves
        intern: dict[tuple[int, int], int] = {}
        left: list[int] = []
        right: list[int] = []
        cnt: list[int] = []
        self.intern, self.left, self.right, self.cnt = intern, left, right, cnt

        def add(a: int, b: int) -> int:
            key = (a, b) if a <= b else (b, a)
            v = intern.get(key)
            if v is None:
                v = nl + len(left)
                intern[key] = v
                left.append(key[0])
                right.append(key[1])
                cnt.append((1 if key[0] < nl else cnt[key[0] - nl]) + (1 if key[1] < nl else cnt[key[1] - nl]))
            return v

        self.add = add

        pcs = [0] * num_tbs
        cur_vc: list[dict[int, int]] = [{} for _ in range(num_tbs)]
        vc_at: dict[tuple[int, int], dict[int, int]] = {}
        queues = [collections.deque() for _ in self.conns]
        recv_waiting = [False] * len(self.conns)
        send_waiting = [False] * len(self.conns)
        dep_waiters: dict[tuple[int, int], list[int]] = {}
        slots = self.slots
        max_in_flight = 0
        num_messages = 0
        shift = 32
        mask = (1 << shift) - 1
        names = ("input", "output", "scratch")

        def race(r: int, buf: int, c: int, other: int, t: int, i: int, what: str) -> None:
            ot, oi = other >> shift, other & mask
            _fail(
                f"race on rank {r} {names[buf]} chunk {c}: {self._name(r, t, i)} {what} it, unordered with "
                f"{self._name(r, ot, oi)} (add a dependency)"
            )

        def read(r: int, buf: int, off: int, count: int, t: int, i: int, vc: dict[int, int]) -> list[int]:
            m = mem[r][buf]
            lw = last_write[r][buf]
            rd = reads[r][buf]
            me = (t << shift) | i
            out = m[off : off + count]
            for c in range(off, off + count):
                w = lw[c]
                if w >= 0:
                    wt = w >> shift
                    if wt != t and vc.get(wt, -1) < (w & mask):
                        race(r, buf, c, w, t, i, "reads")
                lst = rd[c]
                if lst is None:
                    rd[c] = [me]
                else:
                    lst.append(me)
            for k, v in enumerate(out):
                if v < 0:
                    _fail(
                        f"{self._name(r, t, i)} reads {names[buf]} chunk {off + k} of rank {r} before anything wrote it"
                    )
            return out

        def write(r: int, buf: int, off: int, vals: Sequence[int], t: int, i: int, vc: dict[int, int]) -> None:
            lw = last_write[r][buf]
            rd = reads[r][buf]
            me = (t << shift) | i
            for c in range(off, off + len(vals)):
                w = lw[c]
                if w >= 0:
                    wt = w >> shift
                    if wt != t and vc.get(wt, -1) < (w & mask):
                        race(r, buf, c, w, t, i, "writes")
                lst = rd[c]
                if lst is not None:
                    for x in lst:
                        xt = x >> shift
                        if xt != t and x != me and vc.get(xt, -1) < (x & mask):
                            race(r, buf, c, x, t, i, "writes")
                    rd[c] = None
                lw[c] = me
            mem[r][buf][off : off + len(vals)] = vals

        rounds: list[list[tuple[int, int]]] = []
        active = [g for g in range(num_tbs) if tb_ops[g]]
        remaining = sum(1 for g in active)
        rnd = 0
        while active:
            enabled: list[int] = []
            for g in active:
                pc = pcs[g]
                ops = tb_ops[g]
                if pc >= len(ops):
                    continue
                kind, _, _, _, _, _, deps, sc, rc = ops[pc]
                blocked = False
                for dg, di, _ in deps:
                    if pcs[dg] <= di:
                        dep_waiters.setdefault((dg, di), []).append(g)
                        blocked = True
                        break
                if blocked:
                    continue
                if kind in _RECVS and not queues[rc]:
                    recv_waiting[rc] = True
                    continue
                if kind in _SENDS and len(queues[sc]) >= slots:
                    send_waiting[sc] = True
                    continue
                enabled.append(g)
            if not enabled:
                break
            nxt: set[int] = set()
            if self.record:
                rounds.append([(g, pcs[g]) for g in enabled])
            for g in enabled:
                pc = pcs[g]
                kind, sb, so, db, do, count, deps, sc, rc = tb_ops[g][pc]
                r, t = tb_rank[g], tb_local[g]
                vc = cur_vc[g]
                if deps:
                    # Merge the dependencies' clocks: copy the largest at C speed, fold in the rest.
                    clocks = [vc] + [vc_at[(dg, di)] for dg, di, _ in deps]
                    base = max(clocks, key=len)
                    new = dict(base)
                    for other in clocks:
                        if other is not base:
                            for k, v in other.items():
                                if new.get(k, -1) < v:
                                    new[k] = v
                    for _, di, dt in deps:
                        if new.get(dt, -1) < di:
                            new[dt] = di
                    new.pop(t, None)
                    vc = new
                    cur_vc[g] = vc
                if (g, pc) in dep_targets:
                    vc_at[(g, pc)] = vc
                msg = None
                if kind in _RECVS:
                    q = queues[rc]
                    msg = q.popleft()
                    if send_waiting[rc]:
                        send_waiting[rc] = False
                        nxt.add(conn_send_tb[rc])
                if kind == _S:
                    out = read(r, sb, so, count, t, pc, vc)
                elif kind in (_R, _RCS):
                    write(r, db, do, msg, t, pc, vc)
                    out = msg
                elif kind in (_RRC, _RRS, _RRCS):
                    src = read(r, sb, so, count, t, pc, vc)
                    out = [add(a, b) for a, b in zip(src, msg)]
                    if kind != _RRS:
                        write(r, db, do, out, t, pc, vc)
                elif kind == _CPY:
                    write(r, db, do, read(r, sb, so, count, t, pc, vc), t, pc, vc)
                elif kind == _RE:
                    src = read(r, sb, so, count, t, pc, vc)
                    dst = read(r, db, do, count, t, pc, vc)
                    write(r, db, do, [add(a, b) for a, b in zip(dst, src)], t, pc, vc)
                if kind in _SENDS:
                    q = queues[sc]
                    q.append(out)
                    num_messages += 1
                    if len(q) > max_in_flight:
                        max_in_flight = len(q)
                    if recv_waiting[sc]:
                        recv_waiting[sc] = False
                        nxt.add(conn_recv_tb[sc])
                pcs[g] = pc + 1
                if pc + 1 < len(tb_ops[g]):
                    nxt.add(g)
                else:
                    remaining -= 1
                waiters = dep_waiters.pop((g, pc), None)
                if waiters:
                    nxt.update(waiters)
            active = sorted(nxt)
            rnd += 1

        if remaining:
            self._deadlock(tb_ops, pcs, tb_rank, tb_local, queues, (conn_send_tb, conn_recv_tb))
        for j, q in enumerate(queues):
            if q:
                a, b, c = self.conns[j]
                _fail(f"{len(q)} message(s) from rank {a} to rank {b} on channel {c} were never received")

        self._check_data(mem)
        report = CheckReport(
            num_ops=s.num_ops,
            num_messages=num_messages,
            num_connections=len(self.conns),
            num_rounds=rnd,
            max_in_flight=max_in_flight,
            num_slots=slots,
            ordered_reduction=self.ordered,
        )
        receiver = {OpRef(a, st, i): OpRef(b, rt, j) for a, st, i, b, rt, j in self.matches}
        sender = {v: k for k, v in receiver.items()}
        round_refs = tuple(tuple(sorted(OpRef(tb_rank[g], tb_local[g], i) for g, i in rd)) for rd in rounds)
        round_of = {ref: k for k, rd in enumerate(round_refs) for ref in rd}
        return RoundPlan(round_refs, round_of, receiver, sender, report)

    def _deadlock(self, tb_ops, pcs, tb_rank, tb_local, queues, conn_tbs) -> None:
        """Fails naming the cycle of threadblocks that wait for each other, then the others that are blocked."""
        conn_send_tb, conn_recv_tb = conn_tbs
        waits: dict[int, tuple[str, int]] = {}  # blocked global threadblock -> (why, the one it waits for)
        for g, ops in enumerate(tb_ops):
            pc = pcs[g]
            if pc >= len(ops):
                continue
            r, t = tb_rank[g], tb_local[g]
            kind, _, _, _, _, _, deps, sc, rc = ops[pc]
            tb = self.s.ranks[r][t]
            why = None
            for dg, di, dt in deps:
                if pcs[dg] <= di:
                    why = (f"waits for dependency tb {dt} op {di} (not done)", dg)
                    break
            if why is None and kind in _RECVS and not queues[rc]:
                why = (f"waits for a message from rank {tb.recv_peer} on channel {tb.channel}", conn_send_tb[rc])
            if why is None and kind in _SENDS and len(queues[sc]) >= self.slots:
                why = (
                    f"waits for a free slot towards rank {tb.send_peer} on channel {tb.channel} "
                    f"({len(queues[sc])} unconsumed messages, num_slots={self.slots})",
                    conn_recv_tb[sc],
                )
            waits[g] = why or ("is blocked", g)

        def line(g: int) -> str:
            return f"  {self._name(tb_rank[g], tb_local[g], pcs[g])} {waits[g][0]}"

        cycle: list[int] = []
        seen: dict[int, int] = {}
        g = min(waits)
        while g in waits and g not in seen:
            seen[g] = len(cycle)
            cycle.append(g)
            g = waits[g][1]
        cycle = cycle[seen[g] :] if g in seen else []
        lines = []
        if cycle:
            lines.append(f"  wait cycle of {len(cycle)} threadblock(s):")
            lines += ["  " + line(g) for g in cycle[:_MAX_REPORTED]]
            lines.append("    -> back to the first")
        others = [g for g in sorted(waits) if g not in set(cycle)]
        if others:
            lines.append("  also blocked:" if cycle else "  blocked:")
            lines += ["  " + line(g) for g in others[:_MAX_REPORTED]]
            if len(others) > _MAX_REPORTED:
                lines.append(f"    ... and {len(others) - _MAX_REPORTED} more")
        _fail(f"deadlock with num_slots={self.slots}: {len(waits)} threadblock(s) blocked:\n" + "\n".join(lines))

    # ----------------------------------------------------------------------- data
    def _describe(self, v: int) -> str:
        if v < 0:
            return "nothing (never written)"
        ic = self.sizes[0]
        if v < self.num_leaves:
            return f"input chunk {v % ic} of rank {v // ic}"
        leaves = self._leaves(v, limit=6)
        shown = ", ".join(f"r{x // ic}:c{x % ic}" for x in leaves[:5])
        k = self.cnt[v - self.num_leaves]
        return f"a sum of {k} terms ({shown}{', ...' if k > 5 else ''})"

    def _leaves(self, v: int, limit: int | None = None) -> list[int]:
        nl, left, right = self.num_leaves, self.left, self.right
        out: list[int] = []
        stack = [v]
        while stack:
            x = stack.pop()
            if x < nl:
                out.append(x)
                if limit is not None and len(out) >= limit:
                    break
            else:
                stack.append(right[x - nl])
                stack.append(left[x - nl])
        return out

    def _check_data(self, mem) -> None:
        s, n, c = self.s, self.n, self.period
        ic = self.sizes[0]
        coll = s.collective
        verified: set[tuple[int, int]] = set()
        folds: dict[int, int] = {}

        def fold(j: int) -> int:
            f = folds.get(j)
            if f is None:
                f = j
                for r in range(1, n):
                    f = self.add(f, r * ic + j)
                folds[j] = f
            return f

        shape = gloo_tree(n) if self.gloo_tree else None
        trees: dict[int, int] = {}

        def tree(j: int) -> int:
            """The term of gloo's tree over input chunk ``j`` of every rank."""

            def term(t) -> int:
                return t * ic + j if isinstance(t, int) else self.add(term(t[0]), term(t[1]))

            f = trees.get(j)
            if f is None:
                f = trees[j] = term(shape)
            return f

        for r in range(n):
            out = mem[r][Buffer.OUTPUT]
            for x in range(self.sizes[1]):
                v = out[x]
                where = f"rank {r} output chunk {x}"
                if coll is Collective.ALL_GATHER:
                    want = (x // c) * ic + x % c
                elif coll is Collective.ALL_TO_ALL:
                    want = (x // c) * ic + r * c + x % c
                else:
                    j = r * c + x if coll is Collective.REDUCE_SCATTER else x
                    self._check_sum(v, j, where, verified)
                    if self.ordered and v != fold(j):
                        _fail(
                            f"{where}: the reduction does not sum in ascending rank order "
                            f"((x0 + x1) + x2) + ... as ordered_reduction requires"
                        )
                    if self.gloo_tree and v != tree(j):
                        _fail(
                            f"{where}: the reduction does not sum in gloo's tree order {_tree_text(shape)} as "
                            f'info["fold"] == "gloo_tree" requires'
                        )
                    continue
                if v != want:
                    _fail(f"{where}: expected {self._describe(want)}, got {self._describe(v)}")

    def _check_sum(self, v: int, j: int, where: str, verified: set[tuple[int, int]]) -> None:
        if (v, j) in verified:
            return
        n, nl, ic = self.n, self.num_leaves, self.sizes[0]
        want = f"the sum over all {n} ranks of input chunk {j}"
        if v < 0:
            _fail(f"{where}: expected {want}, got nothing (never written)")
        k = 1 if v < nl else self.cnt[v - nl]
        if k != n:
            _fail(f"{where}: expected {want}, got {self._describe(v)}")
        seen = set()
        for x in self._leaves(v):
            rank, chunk = divmod(x, ic)
            if chunk != j or rank in seen:
                _fail(f"{where}: expected {want}, got {self._describe(v)} (input chunk {chunk} of rank {rank})")
            seen.add(rank)
        verified.add((v, j))


def _tree_text(tree, limit: int = 8) -> str:
    """``tree`` (:func:`~jaxccl.schedule.reduction.gloo_tree`) as a sum, e.g. ``(x0 + x1) + x2``; large ones cut."""
    if isinstance(tree, int):
        return f"x{tree}"

    def text(t) -> str:
        return f"x{t}" if isinstance(t, int) else f"({text(t[0])} + {text(t[1])})"

    out = f"{text(tree[0])} + {text(tree[1])}"
    return out if len(out) <= 12 * limit else out[: 12 * limit] + " ..."
