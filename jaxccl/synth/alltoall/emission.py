"""Emitting the schedule IR of an AllToAll :class:`~.planning.Plan`.

Each hop of a message is a ``send``/``recv`` pair; the next hop's send waits
for that receive. Messages are ordered by ``(src, dst, c0)`` and transfers
are issued by hop depth (every first hop, then every second hop, ...), so a
connection's FIFO never queues a forwarded message before a message that is
ready at once.

Two emitters produce the same schedule: ``method="builder"`` goes through
:class:`~jaxccl.schedule.ScheduleBuilder` (the reference; the tests check
that both agree) and ``method="direct"`` (default) computes the builder's
layout with arrays (:mod:`.layout`) -- one local threadblock, one per send
peer, one per receive peer, numbered in order of first use; receives never
wait on anything but their message -- because at 512 GPUs the builder's
per-op overhead dominated the whole synthesis.

Incremental emission (warm starts). The emission is a deterministic
function of the plan (the same layout rule whatever the history), and
:func:`emit` with ``base`` (the previous emission, :class:`Emitted`) computes
it incrementally (:func:`.layout.layout_delta`): the events of the messages
taken over are carried over, only the connections that lose or gain a
message are re-sorted, and threadblocks are renumbered by first use; an op
whose message, hop and dependency are unchanged keeps its object, and a
threadblock whose ops all stay is taken over as it is. Only the changed ops
and threadblocks are built (the IR objects are immutable, so sharing them is
safe).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from jaxccl.schedule import Buffer, Op, OpKind, Schedule, ScheduleBuilder, Threadblock
from jaxccl.schedule.interpreter import gc_paused
from jaxccl.schedule.ir import Collective
from jaxccl.synth.alltoall.columns import ColumnPool
from jaxccl.synth.alltoall.layout import Layout, concat_ranges, hops, keeps_order, layout, layout_delta
from jaxccl.synth.alltoall.network import Network
from jaxccl.synth.alltoall.planning import Plan, plan
from jaxccl.util.options import choose

METHODS = ("direct", "builder")
DEFAULT_METHOD = "direct"
LAYOUT = "jaxccl.alltoall.first-use/1"  # recorded in info["layout"]; incremental reuse needs the same


def _hop_fields(p: Plan, c: int, msg: np.ndarray, depth: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(src_buf, src_off, dst_buf, dst_off, count)`` of the transfers at hop ``depth`` of messages ``msg``.

    The first hop reads the input chunks ``dst * C + c0``, the last writes the
    output chunks ``src * C + c0``; in between the scratch offset at each GPU.
    """
    last = depth == p.hops[msg] - 1
    inp, out, scr = int(Buffer.INPUT), int(Buffer.OUTPUT), int(Buffer.SCRATCH)
    c0 = p.start[msg]
    width = p.scratch.shape[1]
    prev = p.scratch[msg, np.minimum(np.maximum(depth - 1, 0), width - 1)]
    here = p.scratch[msg, np.minimum(depth, width - 1)]
    return (
        np.where(depth == 0, inp, scr),
        np.where(depth == 0, p.dst[msg] * c + c0, prev),
        np.where(last, out, scr),
        np.where(last, p.src[msg] * c + c0, here),
        p.count[msg],
    )


def compile_schedule(
    net: Network,
    pool: ColumnPool,
    comm: np.ndarray,
    pid: np.ndarray,
    count: np.ndarray,
    chunks: int,
    *,
    method: str = DEFAULT_METHOD,
    **build_kwargs,
) -> Schedule:
    """Builds the ALL_TO_ALL :class:`~jaxccl.schedule.Schedule` of a rounded solution.

    Args:
        net: the flattened topology.
        pool: the column pool the path ids refer to.
        comm, pid, count: rows ``(s*N + d, path id, chunks)``, sorted by commodity;
            the counts of a commodity sum to ``chunks``.
        chunks: ``C``, chunks per period.
        method: ``"direct"`` or ``"builder"`` (same result).
        build_kwargs: Schedule fields (name, algbw, bound, info).
    """
    return emit(net.num_gpus, int(chunks), plan(net, pool, comm, pid, count, chunks), method=method, **build_kwargs)


def emit(
    n: int,
    c: int,
    p: Plan,
    *,
    method: str = DEFAULT_METHOD,
    base: Emitted | None = None,
    stats: dict | None = None,
    record: list | None = None,
    **build_kwargs,
) -> Schedule:
    """The schedule of a plan; with ``base`` (an earlier emission), its identical ops and threadblocks are reused.

    With ``base``, the layout is computed incrementally (:func:`.layout.layout_delta`);
    an op is reused when it is the same hop of a message taken over with the
    same dependency (so the very same op), a threadblock when all its ops are
    an earlier threadblock's, in order, with the same peer (its index may
    differ). Everything else is built. The result does not depend on
    ``base``: it is the schedule :func:`.layout.layout` of ``p`` gives.

    Args:
        n, c: ranks and chunks per period.
        p: the plan.
        method: ``"direct"`` or ``"builder"`` (no reuse).
        base: an earlier :class:`Emitted` (see ``record``), of the plan ``p`` was
            planned incrementally from (``p.prev_row`` refers to its rows).
        stats: if given, receives ``reused`` (threadblocks taken over),
            ``reused_ops``, ``ops`` and ``threadblocks``.
        record: if given, the :class:`Emitted` of this schedule is appended.
        build_kwargs: Schedule fields (name, algbw, bound, info).
    """
    choose("method", method, METHODS)
    if method == "builder":
        return _with_builder(n, c, p, build_kwargs)
    src = reuse = None
    if base is not None and base.num_ranks == n and base.chunks == c and keeps_order(p, base.plan):
        lay, src, reuse = layout_delta(n, p, base.layout, base.plan)
    else:
        lay = layout(n, p)
    ranks, reused, group_tbs = _emit(n, c, p, lay, base, src, reuse)
    if stats is not None:
        stats["reused"] = reused
        stats["reused_ops"] = int((src >= 0).sum()) if src is not None else 0
        stats["ops"] = lay.num_events + n
        stats["threadblocks"] = int(lay.group_lo.size) + n
    sched = Schedule(
        collective=Collective.ALL_TO_ALL,
        num_ranks=n,
        chunks_per_period=c,
        ranks=ranks,
        scratch_chunks=p.scratch_chunks,
        **build_kwargs,
    )
    if record is not None:
        record.append(
            Emitted(
                num_ranks=n, chunks=c, ranks=sched.ranks, layout=lay, plan=p, local_checked=True, group_tbs=group_tbs
            )
        )
    return sched


@dataclasses.dataclass(frozen=True, eq=False)
class Emitted:
    """An emitted program with what an incremental emission needs from it.

    Attributes:
        num_ranks, chunks: ``N`` and ``C``.
        ranks: the programs (the schedule's ``ranks``).
        layout: the :class:`~.layout.Layout` they were emitted from: event
            ``e`` is op ``e - group_lo[g]`` of threadblock ``group_tb[g]`` of
            rank ``group_rank[g]`` for its group ``g``.
        plan: the plan of that layout.
        local_checked: every rank's threadblock 0 is known to be its local copy
            (true when :func:`emit` made the programs).
        group_tbs: the threadblock object of every layout group, in group order.
    """

    num_ranks: int
    chunks: int
    ranks: tuple
    layout: Layout
    plan: Plan
    local_checked: bool = False
    group_tbs: list = dataclasses.field(default_factory=list)


def emitted_from(previous: Schedule, p: Plan) -> Emitted | None:
    """The :class:`Emitted` of a schedule this module emitted from plan ``p`` (e.g. read back from JSON).

    Every op of ``previous`` is checked against the layout of ``p``: None if
    any differs (then nothing is reused).
    """
    n, c = previous.num_ranks, previous.chunks_per_period
    lay = layout(n, p)
    ops: list = []
    for r, t, size in zip(lay.group_rank.tolist(), lay.group_tb.tolist(), (lay.group_hi - lay.group_lo).tolist()):
        tbs = previous.ranks[r] if r < len(previous.ranks) else ()
        if t >= len(tbs) or len(tbs[t].ops) != size:
            return None
        ops.extend(tbs[t].ops)
    codes = {OpKind.SEND: 0, OpKind.RECV: 1}
    try:
        got = [
            np.array([codes[op.kind] for op in ops], dtype=np.int64),
            np.array([int(op.src) for op in ops], dtype=np.int64),
            np.array([op.src_off for op in ops], dtype=np.int64),
            np.array([int(op.dst) for op in ops], dtype=np.int64),
            np.array([op.dst_off for op in ops], dtype=np.int64),
            np.array([op.count for op in ops], dtype=np.int64),
            np.array([op.deps[0][0] if op.deps else -1 for op in ops], dtype=np.int64),
            np.array([op.deps[0][1] if op.deps else -1 for op in ops], dtype=np.int64),
        ]
    except (KeyError, TypeError):
        return None
    if any(len(op.deps) > 1 for op in ops):
        return None
    want = [lay.kind, *_hop_fields(p, c, lay.msg, lay.depth), lay.dep_tb, lay.dep_op]
    if not all(np.array_equal(a, b) for a, b in zip(got, want)):
        return None
    group_tbs = [previous.ranks[r][t] for r, t in zip(lay.group_rank.tolist(), lay.group_tb.tolist())]
    return Emitted(num_ranks=n, chunks=c, ranks=previous.ranks, layout=lay, plan=p, group_tbs=group_tbs)


def _with_builder(n: int, c: int, p: Plan, kwargs: dict) -> Schedule:
    b = ScheduleBuilder("all_to_all", n, c, scratch_chunks=p.scratch_chunks)
    for r in range(n):
        b.copy(r, (Buffer.INPUT, r * c), (Buffer.OUTPUT, r * c), c)
    t = hops(p)
    fields = _hop_fields(p, c, t.msg, t.depth)
    received: dict[int, object] = {}
    for i, j, a, bb, sb, so, db, do, m in zip(*(x.tolist() for x in (t.msg, t.depth, t.frm, t.to, *fields))):
        after = () if j == 0 else (received[i],)
        received[i] = b.transfer(a, bb, (Buffer(sb), so), (Buffer(db), do), m, after=after)
    return b.build(**kwargs)


def _emit(n: int, c: int, p: Plan, lay: Layout, base: Emitted | None, src, reuse) -> tuple[tuple, int, list]:
    # With a previous schedule alive, the collector's walks over a million young acyclic ops took over half of
    # the emission time.
    with gc_paused():
        return _emit_ops(n, c, p, lay, base, src, reuse)


def _emit_ops(
    n: int,
    c: int,
    p: Plan,
    lay: Layout,
    base: Emitted | None,
    src: np.ndarray | None,
    reuse: tuple[np.ndarray, np.ndarray] | None,
) -> tuple[tuple, int, list]:
    """The programs, how many threadblocks were taken over from ``base``, and every group's threadblock.

    ``reuse`` pairs new groups with the old groups taken over as they are;
    in the other groups, events whose ``src`` names an old event take its op
    object, the others get a new one.
    """
    make, make_tb = Op.unchecked, Threadblock.unchecked
    g_count = lay.group_lo.size
    reused_new, reused_old = reuse if reuse is not None else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    old_group_tbs = base.group_tbs if base is not None else []
    old_tbs = list(map(old_group_tbs.__getitem__, reused_old.tolist()))
    built = np.ones(g_count, dtype=bool)
    built[reused_new] = False
    g_built = np.flatnonzero(built)
    lo, hi = lay.group_lo[g_built], lay.group_hi[g_built]
    events = concat_ranges(lo, hi)
    have = src[events] >= 0 if src is not None else np.zeros(events.size, dtype=bool)
    # Op objects of the built events, in event order: indices into [ops of the old groups needed, new ops].
    pick = np.empty(events.size, dtype=np.int64)
    pool: list = []
    if have.any():
        old_ev = src[events[have]]
        group = base.layout.group_of(old_ev)
        needed, inverse = np.unique(group, return_inverse=True)
        sizes = base.layout.group_hi[needed] - base.layout.group_lo[needed]
        pool = list(itertools.chain.from_iterable(map(_ops_of, map(old_group_tbs.__getitem__, needed.tolist()))))
        pick[have] = (np.cumsum(sizes) - sizes)[inverse.ravel()] + (old_ev - base.layout.group_lo[group])
    fresh_ops, at = _new_ops(p, c, lay, events[~have])
    pick[~have] = len(pool) + at
    pool.extend(fresh_ops)
    ops = list(map(pool.__getitem__, pick.tolist()))
    ends = np.cumsum(hi - lo)
    begins = ends - (hi - lo)
    new_tbs = [
        make_tb(tuple(ops[a:b]), peer, -1) if kd == 0 else make_tb(tuple(ops[a:b]), -1, peer)
        for a, b, peer, kd in zip(
            begins.tolist(), ends.tolist(), lay.group_peer[g_built].tolist(), lay.group_kind[g_built].tolist()
        )
    ]
    # Every group's threadblock: the old ones taken over, then the new ones, picked in group order.
    which = np.empty(g_count, dtype=np.int64)
    which[reused_new] = np.arange(reused_new.size)
    which[g_built] = reused_new.size + np.arange(g_built.size)
    old_tbs.extend(new_tbs)
    tbs = list(map(old_tbs.__getitem__, which.tolist()))
    same_c = base is not None and base.chunks == c and base.num_ranks == n
    trusted = same_c and base.local_checked
    copies = 0
    rank_lo = np.searchsorted(lay.group_rank, np.arange(n + 1), side="left").tolist()
    programs = []
    for r in range(n):
        old_tb = base.ranks[r][0] if same_c and base.ranks[r] else None
        if old_tb is not None and (trusted or _is_copy(old_tb, r, c)):
            copies += 1
        else:
            old_tb = make_tb((make(OpKind.COPY, Buffer.INPUT, r * c, Buffer.OUTPUT, r * c, c, ()),), -1, -1)
        programs.append((old_tb, *tbs[rank_lo[r] : rank_lo[r + 1]]))
    return tuple(programs), copies + int(reused_new.size), tbs


_KIND_OBJECTS = np.array([OpKind.SEND, OpKind.RECV], dtype=object)
_BUFFER_OBJECTS = np.empty(len(Buffer), dtype=object)  # indexed by the buffers' integer values
_BUFFER_OBJECTS[[int(b) for b in Buffer]] = list(Buffer)


def _new_ops(p: Plan, c: int, lay: Layout, events: np.ndarray) -> tuple[list, np.ndarray]:
    """New op objects for layout events ``events`` and, per event, its op's index in that list.

    Fields are gathered as columns and each op is one constructor call; the
    ops without a dependency come first, then those with one (so neither
    needs a per-op branch).
    """
    src_buf, src_off, dst_buf, dst_off, count = _hop_fields(p, c, lay.msg[events], lay.depth[events])
    dep_tb, dep_op = lay.dep_tb[events], lay.dep_op[events]
    waits = dep_tb >= 0
    order = np.r_[np.flatnonzero(~waits), np.flatnonzero(waits)]
    free = int((~waits).sum())
    deps = itertools.chain(
        itertools.repeat((), free), zip(zip(dep_tb[order[free:]].tolist(), dep_op[order[free:]].tolist()))
    )
    ops = list(
        map(
            Op.unchecked,
            _KIND_OBJECTS[lay.kind[events[order]]].tolist(),
            _BUFFER_OBJECTS[src_buf[order]].tolist(),
            src_off[order].tolist(),
            _BUFFER_OBJECTS[dst_buf[order]].tolist(),
            dst_off[order].tolist(),
            count[order].tolist(),
            deps,
        )
    )
    at = np.empty(events.size, dtype=np.int64)
    at[order] = np.arange(events.size)
    return ops, at


def _is_copy(tb: Threadblock, r: int, c: int) -> bool:
    """Whether ``tb`` is rank ``r``'s local threadblock for ``c`` chunks per period (the copy of its own block)."""
    if tb.send_peer != -1 or tb.recv_peer != -1 or len(tb.ops) != 1:
        return False
    op = tb.ops[0]
    want = (OpKind.COPY, Buffer.INPUT, r * c, Buffer.OUTPUT, r * c, c, ())
    return (op.kind, op.src, op.src_off, op.dst, op.dst_off, op.count, op.deps) == want


def _ops_of(tb: Threadblock) -> tuple:
    return tb.ops
