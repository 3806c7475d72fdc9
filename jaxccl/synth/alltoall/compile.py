"""Compiling rounded AllToAll paths into the schedule IR.

Layout (``docs/schedule-ir.md``): with ``C = chunks_per_period`` (the common
chunk count ``K`` of the rounding), input chunk ``d*C + c`` of rank ``s`` must
end up as output chunk ``s*C + c`` of rank ``d``. Commodity ``(s, d)`` sends
its ``C`` chunk classes over its paths: a path carrying ``n`` chunks takes the
next ``n`` classes ``[c0, c0 + n)`` as one message of ``count = n``.

A physical path is reduced to the GPUs on it: switches are not ranks, so
``s -> nvswitch -> g`` or ``s -> ToR -> g`` is one logical transfer. A path
through intermediate GPUs forwards through their scratch buffer: each hop is a
``send``/``recv`` pair, the next hop's send waits for that receive, and the
scratch range keeps the chunk classes (its offset is ``c0`` modulo ``C``).
Transfers are issued by hop depth (every first hop, then every second hop,
...), so a connection's FIFO never queues a forwarded message before a message
that is ready at once.

Two emitters produce the same schedule: ``method="builder"`` goes through
:class:`~jaxccl.schedule.ScheduleBuilder` (the reference; the tests check
that both agree), ``method="direct"`` (default) writes the threadblocks
itself in the builder's layout -- one local threadblock, one per send peer,
one per receive peer, created in order of first use; receives never wait on
anything but their message -- because at 512 GPUs the builder's per-op
overhead dominated the whole synthesis.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxccl.schedule import Buffer, Op, OpKind, Schedule, ScheduleBuilder, Threadblock
from jaxccl.schedule.ir import Collective
from jaxccl.synth.alltoall.columns import ColumnPool
from jaxccl.synth.alltoall.network import Network

METHODS = ("direct", "builder")
DEFAULT_METHOD = "direct"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The messages of a rounded solution (one per route), as arrays.

    Attributes:
        gpus: ``(M, W)`` the GPUs each message visits, source first, -1 padded.
        hops: ``(M,)`` transfers of each message (GPUs visited - 1).
        start: ``(M,)`` its first chunk class ``c0``.
        count: ``(M,)`` its chunks.
        src, dst: ``(M,)`` the commodity's endpoints.
        scratch: ``(M, W - 2)`` scratch offset at the ``j+1``-th GPU it visits (-1 where none).
        scratch_chunks: scratch buffer size per rank.
    """

    gpus: np.ndarray
    hops: np.ndarray
    start: np.ndarray
    count: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    scratch: np.ndarray
    scratch_chunks: int


def gpu_sequences(net: Network, paths: np.ndarray) -> np.ndarray:
    """``(M, W)`` the GPUs along each path (rows of -1 padded arcs), source first, -1 padded."""
    n = net.num_gpus
    if paths.shape[0] == 0:
        return np.zeros((0, 2), dtype=np.int64)
    valid = paths >= 0
    safe = np.where(valid, paths, 0)
    heads = np.where(valid & net.advances[safe], net.head[safe], -1)
    seq = np.concatenate([net.tail[safe[:, 0]][:, None], heads], axis=1)
    is_gpu = (seq >= 0) & (seq < n)
    order = np.argsort(~is_gpu, axis=1, kind="stable")  # GPUs first, in path order
    seq = np.take_along_axis(np.where(is_gpu, seq, -1), order, axis=1)
    width = max(int(is_gpu.sum(axis=1).max()), 2)
    return seq[:, :width]


def _cumcount(keys: np.ndarray) -> np.ndarray:
    """For each entry, how many earlier entries have the same key."""
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    first = np.r_[True, sk[1:] != sk[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(sk.size), 0))
    out = np.empty(keys.size, dtype=np.int64)
    out[order] = np.arange(sk.size) - group_start
    return out


def plan(net: Network, pool: ColumnPool, comm: np.ndarray, pid: np.ndarray, count: np.ndarray, chunks: int) -> Plan:
    """Messages, class ranges and scratch offsets of rounded rows ``(commodity, path, chunks)`` sorted by commodity.

    Scratch is packed per rank and chunk class: a message forwarded by ``g``
    takes the first period ``q`` whose classes ``[c0, c0 + n)`` are all free
    at ``g`` (in message order), at offset ``q * C + c0``.
    """
    n, c = net.num_gpus, int(chunks)
    gpus = gpu_sequences(net, pool.paths[pid])
    m_count, width = gpus.shape
    hops = (gpus >= 0).sum(axis=1) - 1
    count = np.asarray(count, dtype=np.int64)
    first = np.r_[True, comm[1:] != comm[:-1]] if comm.size else np.zeros(0, dtype=bool)
    csum = np.cumsum(count) - count
    start = csum - np.maximum.accumulate(np.where(first, csum, 0)) if comm.size else csum
    scratch = np.full((m_count, max(width - 2, 1)), -1, dtype=np.int64)
    msg, pos = np.nonzero(
        (np.arange(1, width - 1)[None, :] < hops[:, None]) if width > 2 else np.zeros((m_count, 1), bool)
    )
    top = 0
    if msg.size:
        g = gpus[msg, pos + 1]
        if c == 1 or np.all(count[msg] == 1):
            q = _cumcount(g * c + start[msg])
            scratch[msg, pos] = q * c + start[msg]
            top = int(q.max()) + 1
        else:
            next_period = np.zeros((n, c), dtype=np.int64)
            for i, j, gg in zip(msg.tolist(), pos.tolist(), g.tolist()):
                lo, hi = int(start[i]), int(start[i] + count[i])
                q = int(next_period[gg, lo:hi].max())
                next_period[gg, lo:hi] = q + 1
                scratch[i, j] = q * c + lo
            top = int(next_period.max())
    return Plan(
        gpus=gpus,
        hops=hops,
        start=start,
        count=count,
        src=comm // n,
        dst=comm % n,
        scratch=scratch,
        scratch_chunks=top * c,
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
    prev = p.scratch[msg, np.maximum(depth - 1, 0)]
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
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    p = plan(net, pool, comm, pid, count, chunks)
    if method == "builder":
        return _with_builder(net.num_gpus, int(chunks), p, build_kwargs)
    return _direct(net.num_gpus, int(chunks), p, build_kwargs)


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


def _direct(n: int, c: int, p: Plan, kwargs: dict) -> Schedule:
    """The builder's layout, computed with arrays (see the module docstring).

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
    kind = np.tile(np.array([0, 1]), k)  # 0 send, 1 recv
    conn = (rank * n + peer) * 2 + kind  # (rank, peer, kind)
    uniq, first_event, inverse = np.unique(conn, return_index=True, return_inverse=True)
    inverse = inverse.ravel()
    u_rank = uniq // (2 * n)
    # threadblock index within the rank: 1 + order of first use
    order = np.lexsort((first_event, u_rank))
    tb_of_conn = np.empty(uniq.size, dtype=np.int64)
    ranks_sorted = u_rank[order]
    tb_of_conn[order] = 1 + (np.arange(order.size) - np.searchsorted(ranks_sorted, ranks_sorted, side="left"))
    tb = tb_of_conn[inverse]
    op_idx = _cumcount(inverse)  # events are already in time order
    # dependency of a forwarded send: the receive of the previous hop (same message, same rank)
    recv_event = 2 * np.arange(k) + 1
    hop_event = np.full((p.gpus.shape[0], max(p.gpus.shape[1] - 1, 1)), -1, dtype=np.int64)
    hop_event[t.msg, t.depth] = recv_event
    dep_event = np.where(t.depth > 0, hop_event[t.msg, np.maximum(t.depth - 1, 0)], -1)
    dep_tb = np.where(dep_event >= 0, tb[np.maximum(dep_event, 0)], -1)
    dep_op = np.where(dep_event >= 0, op_idx[np.maximum(dep_event, 0)], -1)

    make = _make_op
    bufs = (Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH)
    send_k, recv_k = OpKind.SEND, OpKind.RECV
    sb = [bufs[x] for x in t.src_buf.tolist()]
    db = [bufs[x] for x in t.dst_buf.tolist()]
    so, do, cnt = t.src_off.tolist(), t.dst_off.tolist(), t.count.tolist()
    deps = [() if d < 0 else ((d, o),) for d, o in zip(dep_tb.tolist(), dep_op.tolist())]
    ops: list = [None] * (2 * k)
    ops[0::2] = [make(send_k, a, b, e, f, g, h) for a, b, e, f, g, h in zip(sb, so, db, do, cnt, deps)]
    ops[1::2] = [make(recv_k, a, b, e, f, g, ()) for a, b, e, f, g in zip(sb, so, db, do, cnt)]
    # group the ops by (rank, threadblock) in op order
    ev_order = np.lexsort((op_idx, tb, rank))
    r_sorted, tb_sorted = rank[ev_order], tb[ev_order]
    bounds = np.flatnonzero(np.r_[True, (r_sorted[1:] != r_sorted[:-1]) | (tb_sorted[1:] != tb_sorted[:-1])])
    ends = np.r_[bounds[1:], ev_order.size]
    ev_list = ev_order.tolist()
    programs: list[list] = [[] for _ in range(n)]
    for r in range(n):
        copy = make(OpKind.COPY, Buffer.INPUT, r * c, Buffer.OUTPUT, r * c, c, ())
        programs[r].append(Threadblock((copy,), -1, -1, 0))
    for lo, hi in zip(bounds.tolist(), ends.tolist()):
        e0 = ev_list[lo]
        r, pr = int(rank[e0]), int(peer[e0])
        group = tuple(ops[e] for e in ev_list[lo:hi])
        if kind[e0] == 0:
            programs[r].append(Threadblock(group, pr, -1, 0))
        else:
            programs[r].append(Threadblock(group, -1, pr, 0))
    return Schedule(
        collective=Collective.ALL_TO_ALL,
        num_ranks=n,
        chunks_per_period=c,
        ranks=tuple(tuple(tbs) for tbs in programs),
        scratch_chunks=p.scratch_chunks,
        **kwargs,
    )
