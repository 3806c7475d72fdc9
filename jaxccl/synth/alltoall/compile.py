"""Compiling rounded AllToAll paths into the schedule IR.

Layout (``docs/schedule-ir.md``): with ``C = chunks_per_period`` (the common
chunk count ``K`` of the rounding), input chunk ``d*C + c`` of rank ``s`` must
end up as output chunk ``s*C + c`` of rank ``d``. Commodity ``(s, d)`` sends
its ``C`` chunk classes over its paths: a path carrying ``n`` chunks takes
``n`` consecutive classes ``[c0, c0 + n)`` as one message of ``count = n``.

A physical path is reduced to the GPUs on it: switches are not ranks, so
``s -> nvswitch -> g`` or ``s -> ToR -> g`` is one logical transfer. A path
through intermediate GPUs forwards through their scratch buffer: each hop is a
``send``/``recv`` pair, the next hop's send waits for that receive, and the
scratch range keeps the chunk classes (its offset is ``c0`` modulo ``C``).
Messages are ordered by ``(src, dst, c0)`` and transfers are issued by hop
depth (every first hop, then every second hop, ...), so a connection's FIFO
never queues a forwarded message before a message that is ready at once.

The compilation is split into a :class:`Plan` (messages, class ranges,
scratch offsets) and its emission. Two emitters produce the same schedule:
``method="builder"`` goes through :class:`~jaxccl.schedule.ScheduleBuilder`
(the reference; the tests check that both agree) and ``method="direct"``
(default) computes the builder's layout with arrays -- one local
threadblock, one per send peer, one per receive peer, numbered in order of
first use; receives never wait on anything but their message -- because at
512 GPUs the builder's per-op overhead dominated the whole synthesis.

Incremental compilation (warm starts). :func:`plan_incremental` keeps the
class ranges and scratch offsets of every commodity whose routes did not
change (read back from the previous schedule's ``info["paths"]``) and gives
the changed ones fresh scratch above them. The emission is a deterministic
function of the plan, so the previous schedule's threadblocks are known
without reading its ops: every threadblock whose ops come out identical
(same position, peers and op hash) is taken over from the previous schedule
instead of being rebuilt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxccl.schedule import Buffer, Op, OpKind, Schedule, ScheduleBuilder, Threadblock
from jaxccl.schedule.ir import Collective
from jaxccl.synth.alltoall.columns import ColumnPool
from jaxccl.synth.alltoall.network import Network

METHODS = ("direct", "builder")
DEFAULT_METHOD = "direct"
LAYOUT = "jaxccl.alltoall.first-use/1"  # recorded in info["layout"]; incremental reuse needs the same


@dataclasses.dataclass(frozen=True)
class Plan:
    """The messages of a rounded solution (one per route), as arrays, ordered by ``(src, dst, start)``.

    Attributes:
        gpus: ``(M, W)`` the GPUs each message visits, source first, -1 padded.
        hops: ``(M,)`` transfers of each message (GPUs visited - 1).
        start: ``(M,)`` its first chunk class ``c0``.
        count: ``(M,)`` its chunks.
        src, dst: ``(M,)`` the commodity's endpoints.
        scratch: ``(M, max(W - 2, 1))`` scratch offset at the ``j+1``-th GPU it visits (-1 where none).
        scratch_chunks: scratch buffer size per rank.
        pid: ``(M,)`` path id of each message in the column pool (-1 if unknown).
        kept: ``(M,)`` the message was taken over from a previous plan.
    """

    gpus: np.ndarray
    hops: np.ndarray
    start: np.ndarray
    count: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    scratch: np.ndarray
    scratch_chunks: int
    pid: np.ndarray
    kept: np.ndarray


def gpu_sequences(net: Network, paths: np.ndarray) -> np.ndarray:
    """``(M, W)`` the GPUs along each path (rows of -1 padded arcs), source first, -1 padded."""
    if paths.shape[0] == 0:
        return np.zeros((0, 2), dtype=np.int64)
    valid = paths >= 0
    safe = np.where(valid, paths, 0)
    heads = np.where(valid & net.advances[safe], net.head[safe], -1)
    seq = np.concatenate([net.tail[safe[:, 0]][:, None], heads], axis=1)
    return _left_justify(seq, (seq >= 0) & (seq < net.num_gpus))


def _left_justify(seq: np.ndarray, keep: np.ndarray) -> np.ndarray:
    order = np.argsort(~keep, axis=1, kind="stable")
    out = np.take_along_axis(np.where(keep, seq, -1), order, axis=1)
    width = max(int(keep.sum(axis=1).max()) if keep.size else 0, 2)
    if out.shape[1] < width:
        out = np.pad(out, ((0, 0), (0, width - out.shape[1])), constant_values=-1)
    return out[:, :width]


def _cumcount(keys: np.ndarray) -> np.ndarray:
    """For each entry, how many earlier entries have the same key."""
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    first = np.r_[True, sk[1:] != sk[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(sk.size), 0))
    out = np.empty(keys.size, dtype=np.int64)
    out[order] = np.arange(sk.size) - group_start
    return out


def _starts(comm: np.ndarray, count: np.ndarray) -> np.ndarray:
    """First class of each row: the running chunk count within its commodity (rows grouped by commodity)."""
    if comm.size == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.r_[True, comm[1:] != comm[:-1]]
    csum = np.cumsum(count) - count
    return csum - np.maximum.accumulate(np.where(first, csum, 0))


def _intermediates(gpus: np.ndarray, hops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(message, position)`` of every intermediate GPU (position j: the ``j+1``-th GPU visited)."""
    width = gpus.shape[1]
    if width <= 2:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.nonzero(np.arange(1, width - 1)[None, :] < hops[:, None])


def _allocate(
    gpus: np.ndarray,
    hops: np.ndarray,
    start: np.ndarray,
    count: np.ndarray,
    scratch: np.ndarray,
    todo: np.ndarray,
    n: int,
    c: int,
) -> int:
    """Fills ``scratch`` for the messages in ``todo`` (in order); returns the scratch periods used.

    Per rank and chunk class, a message takes the first period ``q`` above
    everything already allocated (the given offsets of the other messages)
    whose classes ``[c0, c0 + n)`` are all free: offset ``q * C + c0``.
    """
    msg, pos = _intermediates(gpus, hops)
    next_period = np.zeros((n, c), dtype=np.int64)
    given = ~np.isin(msg, todo)
    if given.any():
        m, p = msg[given], pos[given]
        g, q = gpus[m, p + 1], scratch[m, p] // c
        for k in range(int(count[m].max())):  # every class each given message occupies
            sel = k < count[m]
            np.maximum.at(next_period, (g[sel], (start[m] + k)[sel]), q[sel] + 1)
    sel = ~given
    msg, pos = msg[sel], pos[sel]
    if msg.size:
        order = np.lexsort((pos, np.searchsorted(todo, msg)))
        msg, pos = msg[order], pos[order]
        g = gpus[msg, pos + 1]
        if (c == 1 or np.all(count[msg] == 1)) and not given.any():
            q = _cumcount(g * c + start[msg])
            scratch[msg, pos] = q * c + start[msg]
            np.maximum.at(next_period, (g, start[msg]), q + 1)
        else:
            # The greedy is sequential per rank but independent across ranks: one round per message index.
            turn = _cumcount(g)
            classes = np.arange(c)[None, :]
            for t in range(int(turn.max()) + 1):
                sel = np.flatnonzero(turn == t)
                gg, m_ = g[sel], msg[sel]
                lo = start[m_][:, None]
                mask = (classes >= lo) & (classes < lo + count[m_][:, None])
                q = np.where(mask, next_period[gg], -1).max(axis=1)
                next_period[gg] = np.where(mask, (q + 1)[:, None], next_period[gg])
                scratch[m_, pos[sel]] = q * c + start[m_]
    return int(next_period.max()) if next_period.size else 0


def _messages(net: Network, pool: ColumnPool, comm: np.ndarray, pid: np.ndarray, count: np.ndarray):
    """``(gpus, hops, start, count)`` of rounded rows sorted by commodity."""
    gpus = gpu_sequences(net, pool.paths[pid])
    hops = (gpus >= 0).sum(axis=1) - 1
    count = np.asarray(count, dtype=np.int64)
    return gpus, hops, _starts(comm, count), count


def plan(net: Network, pool: ColumnPool, comm: np.ndarray, pid: np.ndarray, count: np.ndarray, chunks: int) -> Plan:
    """Messages, class ranges and scratch offsets of rounded rows ``(commodity, path, chunks)`` sorted by commodity."""
    n, c = net.num_gpus, int(chunks)
    gpus, hops, start, count = _messages(net, pool, comm, pid, count)
    scratch = np.full((gpus.shape[0], max(gpus.shape[1] - 2, 1)), -1, dtype=np.int64)
    periods = _allocate(gpus, hops, start, count, scratch, np.arange(gpus.shape[0]), n, c)
    return Plan(
        gpus=gpus,
        hops=hops,
        start=start,
        count=count,
        src=comm // n,
        dst=comm % n,
        scratch=scratch,
        scratch_chunks=periods * c,
        pid=np.asarray(pid, dtype=np.int64),
        kept=np.zeros(gpus.shape[0], dtype=bool),
    )


def plan_columns(p: Plan) -> dict[str, list]:
    """The plan's class ranges and scratch offsets as JSON columns (added to ``info["paths"]``)."""
    valid = p.scratch >= 0
    return {"start": p.start.tolist(), "scratch": p.scratch[valid].tolist()}


def previous_plan(paths: Mapping[str, Any], n: int, c: int) -> Plan | None:
    """The plan a schedule of this module was emitted from, read back from its ``info["paths"]``.

    None if the table lacks the class ranges and scratch offsets (``start``,
    ``scratch``) or does not fit ``n`` ranks and ``c`` chunks.
    """
    from jaxccl.synth.alltoall.routes import _columns

    if "start" not in paths or "scratch" not in paths:
        return None
    try:
        src, dst, count, nodes, route, offset = _columns(paths)
        start = np.asarray(paths["start"], dtype=np.int64)
        flat_scratch = np.asarray(paths["scratch"], dtype=np.int64)
    except Exception:
        return None
    r = src.size
    if start.size != r or r == 0:
        return None
    is_gpu = np.array([isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n for v in nodes])
    gpu_of = np.array([v if g else -1 for v, g in zip(nodes, is_gpu)], dtype=np.int64)
    length = np.diff(offset)
    width = int(length.max())
    seq = np.full((r, width), -1, dtype=np.int64)
    row = np.repeat(np.arange(r), length)
    seq[row, np.arange(route.size) - offset[row]] = gpu_of[route]
    gpus = _left_justify(seq, seq >= 0)
    hops = (gpus >= 0).sum(axis=1) - 1
    if np.any(hops < 1) or np.any(gpus[:, 0] != src) or np.any(gpus[np.arange(r), hops] != dst):
        return None
    if np.any(start < 0) or np.any(start + count > c):
        return None
    scratch = np.full((r, max(gpus.shape[1] - 2, 1)), -1, dtype=np.int64)
    msg, pos = _intermediates(gpus, hops)
    if msg.size != flat_scratch.size:
        return None
    scratch[msg, pos] = flat_scratch
    top = int((scratch.max() // c) + 1) * c if msg.size else 0
    return Plan(
        gpus=gpus,
        hops=hops,
        start=start,
        count=count,
        src=src,
        dst=dst,
        scratch=scratch,
        scratch_chunks=top,
        pid=np.full(r, -1, dtype=np.int64),
        kept=np.ones(r, dtype=bool),
    )


def plan_incremental(
    net: Network, pool: ColumnPool, comm: np.ndarray, pid: np.ndarray, count: np.ndarray, chunks: int, prev: Plan
) -> Plan:
    """Like :func:`plan`, but commodities routed exactly as in ``prev`` keep its class ranges and scratch.

    A commodity is kept when its rows and ``prev``'s rows for it are the same
    multiset of (GPU sequence, chunks) with no repeats; the others get class
    ranges in row order and scratch above everything the kept ones occupy.
    """
    n, c = net.num_gpus, int(chunks)
    gpus, hops, start, count = _messages(net, pool, comm, pid, count)
    fresh = Plan(
        gpus=gpus,
        hops=hops,
        start=start,
        count=count,
        src=comm // n,
        dst=comm % n,
        scratch=np.zeros((gpus.shape[0], 0), dtype=np.int64),
        scratch_chunks=0,
        pid=np.asarray(pid, dtype=np.int64),
        kept=np.zeros(gpus.shape[0], dtype=bool),
    )
    width = max(fresh.gpus.shape[1], prev.gpus.shape[1])

    def keys(p: Plan) -> np.ndarray:
        g = np.pad(p.gpus, ((0, 0), (0, width - p.gpus.shape[1])), constant_values=-1)
        rng = np.random.default_rng(0xA11)
        mult = rng.integers(1, 2**62, size=width + 3, dtype=np.int64).astype(np.uint64) | np.uint64(1)
        with np.errstate(over="ignore"):
            cols = np.concatenate([(g + 1), p.src[:, None], p.dst[:, None], p.count[:, None]], axis=1)
            return (cols.astype(np.uint64) * mult).sum(axis=1, dtype=np.uint64)

    k_new, k_old = keys(fresh), keys(prev)
    comm_new, comm_old = fresh.src * n + fresh.dst, prev.src * n + prev.dst
    # Per commodity: an order-free digest of its rows, and whether some row repeats.
    with np.errstate(over="ignore"):
        dig_new = np.zeros(n * n, dtype=np.uint64)
        np.add.at(dig_new, comm_new, k_new * np.uint64(0x9E3779B97F4A7C15))
        dig_old = np.zeros(n * n, dtype=np.uint64)
        np.add.at(dig_old, comm_old, k_old * np.uint64(0x9E3779B97F4A7C15))
    rows_new = np.bincount(comm_new, minlength=n * n)
    rows_old = np.bincount(comm_old, minlength=n * n)
    unique_new = np.bincount(comm_new[np.unique(k_new, return_index=True)[1]], minlength=n * n) == rows_new
    same = (dig_new == dig_old) & (rows_new == rows_old) & (rows_new > 0) & unique_new
    keep = same[comm_new]
    # Kept rows take prev's row with the same key (unique within the commodity).
    order_old = np.argsort(k_old, kind="stable")
    match = order_old[np.searchsorted(k_old[order_old], k_new[keep])]
    if np.any(k_old[match] != k_new[keep]):  # pragma: no cover - guarded by the digests
        return fresh
    start = fresh.start.copy()
    start[keep] = prev.start[match]
    wide = max(fresh.gpus.shape[1] - 2, prev.scratch.shape[1], 1)
    scratch = np.full((fresh.gpus.shape[0], wide), -1, dtype=np.int64)
    scratch[np.flatnonzero(keep), : prev.scratch.shape[1]] = prev.scratch[match]
    gpus = np.pad(
        fresh.gpus, ((0, 0), (0, max(wide + 2, fresh.gpus.shape[1]) - fresh.gpus.shape[1])), constant_values=-1
    )
    periods = _allocate(gpus, fresh.hops, start, fresh.count, scratch, np.flatnonzero(~keep), n, c)
    order = np.lexsort((start, fresh.dst, fresh.src))
    return Plan(
        gpus=gpus[order],
        hops=fresh.hops[order],
        start=start[order],
        count=fresh.count[order],
        src=fresh.src[order],
        dst=fresh.dst[order],
        scratch=scratch[order],
        scratch_chunks=periods * c,
        pid=fresh.pid[order],
        kept=keep[order],
    )


@dataclasses.dataclass(frozen=True)
class _Transfers:
    """Every hop of every message, in issue order (hop depth, then message)."""

    msg: np.ndarray
    depth: np.ndarray
    frm: np.ndarray
    to: np.ndarray
    src_buf: np.ndarray
    src_off: np.ndarray
    dst_buf: np.ndarray
    dst_off: np.ndarray
    count: np.ndarray


def _transfers(p: Plan, c: int) -> _Transfers:
    width = p.gpus.shape[1]
    msg, depth = np.nonzero(np.arange(width - 1)[None, :] < p.hops[:, None])
    order = np.lexsort((msg, depth))
    msg, depth = msg[order], depth[order]
    last = depth == p.hops[msg] - 1
    inp, out, scr = int(Buffer.INPUT), int(Buffer.OUTPUT), int(Buffer.SCRATCH)
    c0 = p.start[msg]
    prev = p.scratch[msg, np.minimum(np.maximum(depth - 1, 0), p.scratch.shape[1] - 1)]
    here = p.scratch[msg, np.minimum(depth, p.scratch.shape[1] - 1)]
    return _Transfers(
        msg=msg,
        depth=depth,
        frm=p.gpus[msg, depth],
        to=p.gpus[msg, depth + 1],
        src_buf=np.where(depth == 0, inp, scr),
        src_off=np.where(depth == 0, p.dst[msg] * c + c0, prev),
        dst_buf=np.where(last, out, scr),
        dst_off=np.where(last, p.src[msg] * c + c0, here),
        count=p.count[msg],
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
    previous: Schedule | None = None,
    previous_plan: Plan | None = None,
    stats: dict | None = None,
    **build_kwargs,
) -> Schedule:
    """The schedule of a plan; with ``previous`` (emitted from ``previous_plan``), unchanged threadblocks are reused.

    ``stats`` (if given) receives ``reused`` and ``threadblocks`` counts.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "builder":
        return _with_builder(n, c, p, build_kwargs)
    lay = _layout(n, c, p)
    reuse = None
    if previous is not None and previous_plan is not None:
        reuse = _reusable(lay, _layout(n, c, previous_plan), previous)
    ranks = _emit(n, c, lay, reuse)
    if stats is not None:
        stats["reused"] = len(reuse or {})
        stats["threadblocks"] = int(lay.group_lo.size) + n
    return Schedule(
        collective=Collective.ALL_TO_ALL,
        num_ranks=n,
        chunks_per_period=c,
        ranks=ranks,
        scratch_chunks=p.scratch_chunks,
        **build_kwargs,
    )


def _with_builder(n: int, c: int, p: Plan, kwargs: dict) -> Schedule:
    b = ScheduleBuilder("all_to_all", n, c, scratch_chunks=p.scratch_chunks)
    for r in range(n):
        b.copy(r, (Buffer.INPUT, r * c), (Buffer.OUTPUT, r * c), c)
    t = _transfers(p, c)
    received: dict[int, object] = {}
    for i, j, a, bb, sb, so, db, do, m in zip(
        *(x.tolist() for x in (t.msg, t.depth, t.frm, t.to, t.src_buf, t.src_off, t.dst_buf, t.dst_off, t.count))
    ):
        after = () if j == 0 else (received[i],)
        received[i] = b.transfer(a, bb, (Buffer(sb), so), (Buffer(db), do), m, after=after)
    return b.build(**kwargs)


_OP_FIELDS = ("kind", "src", "src_off", "dst", "dst_off", "count", "deps")


def _fast_op_factory():
    """A constructor of already-normalized :class:`Op` values that skips ``__post_init__``.

    The emitter only creates well-formed ops (and ``Schedule.validate()``
    checks them all), so the per-op normalization is pure overhead (~10 us).
    Falls back to the regular constructor if ``Op``'s layout is not the
    expected plain frozen dataclass.
    """
    names = tuple(f.name for f in dataclasses.fields(Op))

    def slow(kind, src, src_off, dst, dst_off, count, deps):
        return Op(kind, src, src_off, dst, dst_off, count, deps)

    if names != _OP_FIELDS or hasattr(Op, "__slots__"):
        return slow
    new = object.__new__
    setattr_ = object.__setattr__

    def fast(kind, src, src_off, dst, dst_off, count, deps):
        op = new(Op)
        setattr_(
            op,
            "__dict__",
            {
                "kind": kind,
                "src": src,
                "src_off": src_off,
                "dst": dst,
                "dst_off": dst_off,
                "count": count,
                "deps": deps,
            },
        )
        return op

    probe = (OpKind.SEND, Buffer.INPUT, 3, Buffer.SCRATCH, 1, 2, ((1, 0),))
    try:
        ok = fast(*probe) == slow(*probe) and hash(fast(*probe)) == hash(slow(*probe))
    except Exception:  # pragma: no cover - defensive
        ok = False
    return fast if ok else slow


_make_op = _fast_op_factory()


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Every op of a plan with its place: events sorted by (rank, threadblock, op index).

    ``group_*`` describe the threadblocks other than the local one (index 0).
    """

    kind: np.ndarray  # 0 send, 1 recv
    src_buf: np.ndarray
    src_off: np.ndarray
    dst_buf: np.ndarray
    dst_off: np.ndarray
    count: np.ndarray
    dep_tb: np.ndarray
    dep_op: np.ndarray
    group_rank: np.ndarray
    group_tb: np.ndarray
    group_peer: np.ndarray
    group_kind: np.ndarray
    group_lo: np.ndarray
    group_hi: np.ndarray
    group_hash: np.ndarray


def _layout(n: int, c: int, p: Plan) -> _Layout:
    """The builder's layout with arrays (see the module docstring).

    Per rank: threadblock 0 is the local one (the copy); the others are
    numbered in order of first use over the issue sequence, in which a
    transfer touches its sender (send threadblock) before its receiver
    (receive threadblock). Ops of a threadblock keep the issue order; the
    send of hop ``j >= 1`` depends on the receive of hop ``j - 1``.
    """
    t = _transfers(p, c)
    k = t.msg.size
    # Events: 2i = send of transfer i on its sender, 2i + 1 = its receive on its receiver.
    rank = np.empty(2 * k, dtype=np.int64)
    peer = np.empty(2 * k, dtype=np.int64)
    rank[0::2], rank[1::2] = t.frm, t.to
    peer[0::2], peer[1::2] = t.to, t.frm
    kind = np.tile(np.array([0, 1]), k)
    conn = (rank * n + peer) * 2 + kind
    uniq, first_event, inverse = np.unique(conn, return_index=True, return_inverse=True)
    inverse = inverse.ravel()
    u_rank = uniq // (2 * n)
    order = np.lexsort((first_event, u_rank))
    ranks_sorted = u_rank[order]
    tb_of_conn = np.empty(uniq.size, dtype=np.int64)
    tb_of_conn[order] = 1 + (np.arange(order.size) - np.searchsorted(ranks_sorted, ranks_sorted, side="left"))
    tb = tb_of_conn[inverse]
    op_idx = _cumcount(inverse)  # events are in time order
    recv_event = 2 * np.arange(k) + 1
    hop_event = np.full((p.gpus.shape[0], max(p.gpus.shape[1] - 1, 1)), -1, dtype=np.int64)
    hop_event[t.msg, t.depth] = recv_event
    dep_event = np.where(t.depth > 0, hop_event[t.msg, np.maximum(t.depth - 1, 0)], -1)
    dep_tb = np.full(2 * k, -1, dtype=np.int64)
    dep_op = np.full(2 * k, -1, dtype=np.int64)
    dep_tb[0::2] = np.where(dep_event >= 0, tb[np.maximum(dep_event, 0)], -1)
    dep_op[0::2] = np.where(dep_event >= 0, op_idx[np.maximum(dep_event, 0)], -1)
    rep = np.repeat
    fields = {
        "src_buf": rep(t.src_buf, 2),
        "src_off": rep(t.src_off, 2),
        "dst_buf": rep(t.dst_buf, 2),
        "dst_off": rep(t.dst_off, 2),
        "count": rep(t.count, 2),
    }
    ev = np.lexsort((op_idx, tb, rank))
    r_s, tb_s = rank[ev], tb[ev]
    lo = np.flatnonzero(np.r_[True, (r_s[1:] != r_s[:-1]) | (tb_s[1:] != tb_s[:-1])]) if ev.size else ev
    hi = np.r_[lo[1:], ev.size]
    out = {name: v[ev] for name, v in fields.items()}
    kind_s, dtb_s, dop_s = kind[ev], dep_tb[ev], dep_op[ev]
    # One order-sensitive 64-bit hash per threadblock over everything that makes its ops.
    with np.errstate(over="ignore"):
        cols = [kind_s, out["src_buf"], out["src_off"], out["dst_buf"], out["dst_off"], out["count"], dtb_s, dop_s]
        mult = np.random.default_rng(0x7B).integers(1, 2**62, size=len(cols) + 1, dtype=np.int64).astype(np.uint64)
        h = np.zeros(ev.size, dtype=np.uint64)
        for col, m in zip(cols, mult):
            h = h * np.uint64(0x100000001B3) + (col.astype(np.int64) + 2).astype(np.uint64) * (m | np.uint64(1))
        pos = (np.arange(ev.size) - np.repeat(lo, hi - lo)).astype(np.uint64)
        h = h * (pos * np.uint64(0x9E3779B97F4A7C15) + np.uint64(1))
        group_hash = np.add.reduceat(h, lo) if lo.size else np.zeros(0, dtype=np.uint64)
    return _Layout(
        kind=kind_s,
        dep_tb=dtb_s,
        dep_op=dop_s,
        group_rank=r_s[lo],
        group_tb=tb_s[lo],
        group_peer=peer[ev][lo],
        group_kind=kind_s[lo],
        group_lo=lo,
        group_hi=hi,
        group_hash=group_hash,
        **out,
    )


def _reusable(new: _Layout, old: _Layout, previous: Schedule) -> dict[int, Threadblock]:
    """Threadblocks of ``previous`` that ``new`` would rebuild identically: group index -> Threadblock."""
    key_new = np.stack([new.group_rank, new.group_tb], axis=1)
    key_old = np.stack([old.group_rank, old.group_tb], axis=1)
    n_tb = max(int(new.group_tb.max(initial=0)), int(old.group_tb.max(initial=0))) + 1
    flat_new = key_new[:, 0] * n_tb + key_new[:, 1]
    flat_old = key_old[:, 0] * n_tb + key_old[:, 1]
    order = np.argsort(flat_old)
    pos = np.minimum(np.searchsorted(flat_old[order], flat_new), max(order.size - 1, 0))
    if order.size == 0:
        return {}
    j = order[pos]
    same = (flat_old[j] == flat_new) & (old.group_hash[j] == new.group_hash)
    same &= (old.group_peer[j] == new.group_peer) & (old.group_kind[j] == new.group_kind)
    same &= (old.group_hi[j] - old.group_lo[j]) == (new.group_hi - new.group_lo)
    out: dict[int, Threadblock] = {}
    for g in np.flatnonzero(same).tolist():
        r, t = int(new.group_rank[g]), int(new.group_tb[g])
        tbs = previous.ranks[r] if r < len(previous.ranks) else ()
        if t < len(tbs):
            prev_tb = tbs[t]
            length = int(new.group_hi[g] - new.group_lo[g])
            peer = int(new.group_peer[g])
            peers = (peer, -1) if new.group_kind[g] == 0 else (-1, peer)
            if len(prev_tb.ops) == length and (prev_tb.send_peer, prev_tb.recv_peer) == peers:
                out[g] = prev_tb
    return out


@contextlib.contextmanager
def _no_gc():
    """Pauses the cyclic garbage collector while a million acyclic ops are created.

    With a previous schedule alive, every generation-0 collection walked the
    young objects and full collections walked them all: over half of the
    emission time went to the collector, and ops never form cycles.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _emit(n: int, c: int, lay: _Layout, reuse: dict[int, Threadblock] | None) -> tuple:
    with _no_gc():
        return _emit_ops(n, c, lay, reuse)


def _emit_ops(n: int, c: int, lay: _Layout, reuse: dict[int, Threadblock] | None) -> tuple:
    make = _make_op
    bufs = (Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH)
    kinds = (OpKind.SEND, OpKind.RECV)
    reuse = reuse or {}
    # Ops only for the threadblocks that are not taken over.
    build = np.ones(lay.kind.size, dtype=bool)
    for g in reuse:
        build[lay.group_lo[g] : lay.group_hi[g]] = False
    idx = np.flatnonzero(build)
    ops: list = [None] * lay.kind.size
    vals = [
        x[idx].tolist()
        for x in (lay.kind, lay.src_buf, lay.src_off, lay.dst_buf, lay.dst_off, lay.count, lay.dep_tb, lay.dep_op)
    ]
    for i, kd, sb, so, db, do, cnt, dt, dop in zip(idx.tolist(), *vals):
        ops[i] = make(kinds[kd], bufs[sb], so, bufs[db], do, cnt, () if dt < 0 else ((dt, dop),))
    programs: list[list] = [[] for _ in range(n)]
    for r in range(n):
        copy = make(OpKind.COPY, Buffer.INPUT, r * c, Buffer.OUTPUT, r * c, c, ())
        programs[r].append(Threadblock((copy,), -1, -1, 0))
    for g, (r, peer, kd, lo, hi) in enumerate(
        zip(*(x.tolist() for x in (lay.group_rank, lay.group_peer, lay.group_kind, lay.group_lo, lay.group_hi)))
    ):
        tb = reuse.get(g)
        if tb is None:
            group = tuple(ops[lo:hi])
            tb = Threadblock(group, peer, -1, 0) if kd == 0 else Threadblock(group, -1, peer, 0)
        programs[r].append(tb)
    return tuple(tuple(tbs) for tbs in programs)
