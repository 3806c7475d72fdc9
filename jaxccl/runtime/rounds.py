"""Static SPMD round plans of a schedule (pure Python; the ppermute backend executes them).

A :class:`~jaxccl.schedule.Schedule` is a per-rank program of threadblocks
whose ops synchronize through FIFO messages and dependencies. The ppermute
backend needs the opposite view: one program that every rank runs, in which
the data moved by each message is a ``jax.lax.ppermute`` with static shapes.
:func:`plan` builds that view:

1. Every op gets a *depth*: the longest path to it through program order and
   ``deps`` (weight 0) and messages (weight 1, from the sending op to the
   matching receiving op). A message sent by an op of depth ``d`` travels in
   round ``d``; its receiver has depth ``> d``. A cycle is a deadlock and
   raises :class:`~jaxccl.ScheduleError`.
2. Within a round, each rank executes its ops of that depth in a topological
   order of the weight-0 edges (ties broken by threadblock and op index so that
   symmetric schedules line up across ranks). The ``p``-th op of every rank
   forms step ``p``; the ops of one step are grouped into :class:`Instr` by
   everything that fixes a static shape (kind, buffers, element count, which
   message box). Per-rank offsets and rows are small tables indexed by the
   rank; ranks without an op in an instruction are masked.
3. The messages of a round are grouped by element count and edge-coloured
   (bipartite: sender side, receiver side) so that each colour is a partial
   permutation, i.e. one ``ppermute``. König's theorem: ``max degree`` colours.

Each rank runs its ops in an order consistent with program order, ``deps``
and messages, so every read sees the value the schedule defines: the summation
order of reductions is exactly the schedule's (an ordered schedule stays
bitwise equal to ``jax.lax``). Slot limits only delay a real executor, so they
play no role here.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections import defaultdict

from jaxccl.errors import ScheduleError
from jaxccl.schedule.ir import Buffer, OpKind, Schedule, chunk_bounds

__all__ = ["Exchange", "Instr", "Plan", "Round", "plan"]


@dataclasses.dataclass(frozen=True)
class Instr:
    """One SPMD instruction: the same op kind and static shape on every active rank.

    Attributes:
        kind: the op kind.
        length: elements moved or reduced (static).
        src_buf / dst_buf: the local buffers read / written (``None`` if unused).
        active: per rank, whether it executes this instruction.
        src_off / dst_off: per rank, element offsets (0 where inactive or unused).
        msg: ``(round, length)`` of the message box a receiving op reads, else ``None``.
        msg_row: per rank, the colour (row) of its message in that box.
        out: ``(round, length)`` of the box a sending op writes its payload to, else ``None``.
        out_row: per rank, the colour (row) it writes.
    """

    kind: OpKind
    length: int
    src_buf: Buffer | None
    dst_buf: Buffer | None
    active: tuple[bool, ...]
    src_off: tuple[int, ...]
    dst_off: tuple[int, ...]
    msg: tuple[int, int] | None
    msg_row: tuple[int, ...]
    out: tuple[int, int] | None
    out_row: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Exchange:
    """The messages of one round with one element count: ``perms[c]`` is colour ``c``'s ppermute."""

    round: int
    length: int
    perms: tuple[tuple[tuple[int, int], ...], ...]


@dataclasses.dataclass(frozen=True)
class Round:
    """Instructions in execution order, then the exchanges that carry this round's messages."""

    instrs: tuple[Instr, ...]
    exchanges: tuple[Exchange, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A schedule as rounds of SPMD instructions for ``L`` elements per period."""

    num_ranks: int
    period_elems: int
    in_elems: int
    out_elems: int
    scratch_elems: int
    rounds: tuple[Round, ...]

    @property
    def num_ppermutes(self) -> int:
        return sum(len(e.perms) for r in self.rounds for e in r.exchanges)

    def buffer_elems(self, buf: Buffer) -> int:
        return (self.in_elems, self.out_elems, self.scratch_elems)[Buffer(buf)]


def _elems(chunks: int, period: int, period_elems: int) -> int:
    return chunk_bounds(chunks - 1, period, period_elems)[1] if chunks > 0 else 0


def plan(schedule: Schedule, period_elems: int) -> Plan:
    """Plans ``schedule`` for ``period_elems`` elements per period (``L`` of docs/schedule-ir.md).

    Cached per (schedule digest, ``L``). Raises :class:`~jaxccl.ScheduleError`
    for unmatched messages, size mismatches and dependency cycles.

    Example:
        >>> from jaxccl.synth.baselines import ring_allgather
        >>> p = plan(ring_allgather(4), 10)
        >>> len(p.rounds), p.num_ppermutes, p.out_elems
        (4, 3, 40)
    """
    return _plan(schedule.digest, _Key(schedule), int(period_elems))


class _Key:
    """Carries the schedule into the cache without making it part of the key."""

    __slots__ = ("schedule",)

    def __init__(self, schedule: Schedule):
        self.schedule = schedule

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key)


@functools.lru_cache(maxsize=256)
def _plan(digest: str, key: _Key, period_elems: int) -> Plan:
    del digest
    s = key.schedule
    n, c, lp = s.num_ranks, s.chunks_per_period, period_elems
    if lp < 0:
        raise ScheduleError(f"period of {lp} elements")

    def rng(off: int, count: int) -> tuple[int, int]:
        start = chunk_bounds(off, c, lp)[0]
        return start, chunk_bounds(off + count - 1, c, lp)[1] - start

    # ---- nodes: (rank, tb, op) -> id
    nodes: list[tuple[int, int, int]] = []
    ids: dict[tuple[int, int, int], int] = {}
    for r, tbs in enumerate(s.ranks):
        for t, tb in enumerate(tbs):
            for k in range(len(tb.ops)):
                ids[(r, t, k)] = len(nodes)
                nodes.append((r, t, k))

    def op_of(i: int):
        r, t, k = nodes[i]
        return s.ranks[r][t].ops[k]

    succ: list[list[tuple[int, int]]] = [[] for _ in nodes]
    indeg = [0] * len(nodes)

    def edge(a: int, b: int, w: int) -> None:
        succ[a].append((b, w))
        indeg[b] += 1

    sends: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for r, tbs in enumerate(s.ranks):
        for t, tb in enumerate(tbs):
            for k, op in enumerate(tb.ops):
                i = ids[(r, t, k)]
                if k:
                    edge(ids[(r, t, k - 1)], i, 0)
                for dt, dk in op.deps:
                    j = ids.get((r, dt, dk))
                    if j is None:
                        raise ScheduleError(f"rank {r} tb {t} op {k}: dependency ({dt}, {dk}) does not exist")
                    edge(j, i, 0)
                if op.kind.sends:
                    if not 0 <= tb.send_peer < n or tb.send_peer == r:
                        raise ScheduleError(f"rank {r} tb {t} op {k} sends but the send peer is {tb.send_peer}")
                    sends[(r, tb.send_peer, tb.channel)].append(i)
                if op.kind.receives:
                    if not 0 <= tb.recv_peer < n or tb.recv_peer == r:
                        raise ScheduleError(f"rank {r} tb {t} op {k} receives but the receive peer is {tb.recv_peer}")
                    recvs[(tb.recv_peer, r, tb.channel)].append(i)

    matched_send: dict[int, int] = {}
    for conn in set(sends) | set(recvs):
        a, b, ch = conn
        ss, rr = sends.get(conn, []), recvs.get(conn, [])
        if len(ss) != len(rr):
            raise ScheduleError(f"connection {a}->{b} channel {ch}: {len(ss)} sending ops but {len(rr)} receiving ops")
        for si, ri in zip(ss, rr):
            if op_of(si).count != op_of(ri).count:
                raise ScheduleError(
                    f"connection {a}->{b} channel {ch}: a message of {op_of(si).count} chunks is received "
                    f"as {op_of(ri).count} chunks"
                )
            edge(si, ri, 1)
            matched_send[ri] = si

    # ---- depths (longest path), Kahn's algorithm with a deterministic priority
    depth = [0] * len(nodes)
    order: list[int] = []
    heap = [(nodes[i][1], nodes[i][2], nodes[i][0], i) for i in range(len(nodes)) if indeg[i] == 0]
    heapq.heapify(heap)
    remaining = list(indeg)
    while heap:
        *_, i = heapq.heappop(heap)
        order.append(i)
        for j, w in succ[i]:
            depth[j] = max(depth[j], depth[i] + w)
            remaining[j] -= 1
            if remaining[j] == 0:
                heapq.heappush(heap, (nodes[j][1], nodes[j][2], nodes[j][0], j))
    if len(order) != len(nodes):
        stuck = sorted(nodes[i] for i in range(len(nodes)) if remaining[i] > 0)[:4]
        raise ScheduleError(
            f"schedule {s.name or s.digest[:12]} can deadlock: dependency/message cycle through "
            f"(rank, threadblock, op) {stuck}"
        )

    # ---- per (rank, depth) ops in a topological order of weight-0 edges
    num_rounds = 1 + max(depth, default=0)
    buckets: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(num_rounds)]
    for i in _local_order(nodes, succ, depth):
        buckets[depth[i]][nodes[i][0]].append(i)

    # ---- messages: (round, length) -> edges; colour them
    msg_len: dict[int, int] = {}
    boxes: dict[tuple[int, int], list[int]] = defaultdict(list)
    for ri, si in matched_send.items():
        so, ro = op_of(si), op_of(ri)
        sl = rng(so.src_off if so.kind is OpKind.SEND else _payload_off(so), so.count)[1]
        rl = rng(_recv_off(ro), ro.count)[1]
        if sl != rl:
            raise ScheduleError(
                f"message {nodes[si]} -> {nodes[ri]} carries {sl} elements but the receiver expects {rl} "
                "(source and destination chunks must have the same class)"
            )
        msg_len[si] = sl
        if sl:
            boxes[(depth[si], sl)].append(si)
    send_row: dict[int, int] = {}
    recv_row: dict[int, int] = {}
    exchanges: dict[int, list[Exchange]] = defaultdict(list)
    recv_of = {si: ri for ri, si in matched_send.items()}
    for (d, length), msgs in sorted(boxes.items()):
        msgs.sort(key=lambda si: nodes[si])
        edges = [(nodes[si][0], nodes[recv_of[si]][0]) for si in msgs]
        colours = _ordinal_colouring(edges) or _edge_colouring(edges)
        ncol = 1 + max(colours)
        perms: list[list[tuple[int, int]]] = [[] for _ in range(ncol)]
        for si, (a, b), col in zip(msgs, edges, colours):
            send_row[si] = col
            recv_row[recv_of[si]] = col
            perms[col].append((a, b))
        exchanges[d].append(Exchange(d, length, tuple(tuple(sorted(p)) for p in perms)))

    # ---- instructions
    rounds: list[Round] = []
    for d in range(num_rounds):
        instrs: list[Instr] = []
        steps = max(len(b) for b in buckets[d])
        for p in range(steps):
            groups: dict[tuple, dict[int, tuple[int, int, int, int]]] = {}
            for r in range(n):
                if p >= len(buckets[d][r]):
                    continue
                i = buckets[d][r][p]
                op = op_of(i)
                if op.kind is OpKind.NOP:
                    continue
                soff, length = rng(op.src_off, op.count) if op.kind.reads_src else (0, None)
                doff, dlen = rng(op.dst_off, op.count) if op.kind.writes_dst else (0, None)
                if op.kind.receives:
                    length = msg_len[matched_send[i]]
                elif op.kind is OpKind.SEND:
                    length = msg_len[i]
                if length is None:
                    length = dlen
                if op.kind.writes_dst and dlen != length:
                    raise ScheduleError(
                        f"op {op.kind.value} at (rank, tb, op) {nodes[i]} reads {length} elements but "
                        f"writes {dlen} (src and dst chunks must have the same class)"
                    )
                if op.kind.reads_src and op.kind.receives and rng(op.src_off, op.count)[1] != length:
                    raise ScheduleError(f"op {op.kind.value} at {nodes[i]}: src range and message differ in size")
                if not length:
                    continue
                msg = (depth[matched_send[i]], length) if op.kind.receives else None
                out = (d, length) if op.kind.sends else None
                key = (
                    op.kind,
                    length,
                    op.src if op.kind.reads_src else None,
                    op.dst if op.kind.writes_dst else None,
                    msg,
                    out,
                )
                mrow = recv_row[i] if op.kind.receives else 0
                orow = send_row[i] if op.kind.sends else 0
                groups.setdefault(key, {})[r] = (soff, doff, mrow, orow)
            for key, per_rank in groups.items():
                kind, length, sbuf, dbuf, msg, out = key
                vals = [per_rank.get(r) for r in range(n)]
                instrs.append(
                    Instr(
                        kind=kind,
                        length=length,
                        src_buf=sbuf,
                        dst_buf=dbuf,
                        active=tuple(v is not None for v in vals),
                        src_off=tuple(v[0] if v else 0 for v in vals),
                        dst_off=tuple(v[1] if v else 0 for v in vals),
                        msg=msg,
                        msg_row=tuple(v[2] if v else 0 for v in vals),
                        out=out,
                        out_row=tuple(v[3] if v else 0 for v in vals),
                    )
                )
        rounds.append(Round(tuple(instrs), tuple(exchanges.get(d, ()))))
    in_ch, out_ch = s.in_chunks, s.out_chunks
    return Plan(
        num_ranks=n,
        period_elems=lp,
        in_elems=_elems(in_ch, c, lp),
        out_elems=_elems(out_ch, c, lp),
        scratch_elems=_elems(s.scratch_chunks, c, lp),
        rounds=tuple(rounds),
    )


def _payload_off(op) -> int:
    """Chunk offset whose size class a sending op's message has."""
    if op.kind is OpKind.RECV_COPY_SEND:
        return op.dst_off
    return op.src_off


def _recv_off(op) -> int:
    if op.kind.writes_dst:
        return op.dst_off
    return op.src_off


def _local_order(nodes, succ, depth) -> list[int]:
    """A topological order of the weight-0 edges, preferring (depth, tb, op)."""
    indeg = [0] * len(nodes)
    for i in range(len(nodes)):
        for j, w in succ[i]:
            if w == 0:
                indeg[j] += 1
    heap = [(depth[i], nodes[i][1], nodes[i][2], i) for i in range(len(nodes)) if indeg[i] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        *_, i = heapq.heappop(heap)
        out.append(i)
        for j, w in succ[i]:
            if w == 0:
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(heap, (depth[j], nodes[j][1], nodes[j][2], j))
    return out


def _ordinal_colouring(edges: list[tuple[int, int]]) -> list[int] | None:
    """Colour = the edge's ordinal among its sender's edges, if that is proper on the receiver side.

    Symmetric schedules (rings, direct exchanges) then get the same colour on
    every rank, i.e. static rows instead of per-rank tables.

    >>> _ordinal_colouring([(0, 1), (0, 2), (1, 2), (1, 0)])
    [0, 1, 0, 1]
    >>> _ordinal_colouring([(0, 1), (1, 1)]) is None
    True
    """
    seen: dict[int, int] = defaultdict(int)
    used: set[tuple[int, int]] = set()
    out = []
    for u, v in edges:
        c = seen[u]
        seen[u] += 1
        if (v, c) in used:
            return None
        used.add((v, c))
        out.append(c)
    return out


def _edge_colouring(edges: list[tuple[int, int]]) -> list[int]:
    """Proper edge colouring of a bipartite multigraph (senders x receivers) with max-degree colours.

    Classic alternating-path recolouring (König): for edge ``(u, v)`` pick
    ``a`` free at ``u`` and ``b`` free at ``v``; if ``a`` is not free at ``v``,
    swap ``a``/``b`` along the path from ``v`` that alternates ``a, b, ...``
    (it cannot reach ``u``), then colour the edge ``a``.

    >>> _edge_colouring([(0, 1), (1, 2), (2, 0), (0, 2)])
    [0, 0, 0, 1]
    """
    deg: dict[tuple[str, int], int] = defaultdict(int)
    for u, v in edges:
        deg[("s", u)] += 1
        deg[("r", v)] += 1
    delta = max(deg.values(), default=0)
    # at[node][colour] = edge index
    at: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)
    colour = [-1] * len(edges)

    def free(node: tuple[str, int]) -> int:
        used = at[node]
        return next(c for c in range(delta) if c not in used)

    for e, (u, v) in enumerate(edges):
        su, rv = ("s", u), ("r", v)
        a, b = free(su), free(rv)
        if a not in at[rv]:
            pass
        else:
            # alternating path from rv: edges coloured a, b, a, ... ; swap their colours
            path = []
            node, cur = rv, a
            while cur in at[node]:
                f = at[node][cur]
                path.append(f)
                x, y = edges[f]
                node = ("s", x) if node[0] == "r" else ("r", y)
                cur = b if cur == a else a
            for f in path:
                x, y = edges[f]
                del at[("s", x)][colour[f]]
                del at[("r", y)][colour[f]]
            for f in path:
                x, y = edges[f]
                colour[f] = b if colour[f] == a else a
                at[("s", x)][colour[f]] = f
                at[("r", y)][colour[f]] = f
        colour[e] = a
        at[su][a] = e
        at[rv][a] = e
    return colour
