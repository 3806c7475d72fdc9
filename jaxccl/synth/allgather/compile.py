"""Trees -> Schedule IR: AllGather down the trees, ReduceScatter up the reversed trees.

Chunk layout (``C = k`` chunks per period): root ``r``'s shard is chunks
``0..k-1`` of its input; chunk ``j`` of root ``r`` lands at output chunk
``r * k + j`` on every rank. Each tree of root ``r`` carries a consecutive
range of those chunks (its weight), so a tree edge is one transfer of
``weight`` chunks, and every tree edge is a logical GPU-to-GPU link (a
switch-only physical route, see :class:`~jaxccl.synth.allgather.logical.Logical`).

Transfers are issued in an order where a GPU's forward of a chunk range
comes after the receive that brought it, which keeps the schedule
deadlock-free for any number of slots (:class:`jaxccl.schedule.ScheduleBuilder`).
"""

from __future__ import annotations

import collections

import numpy as np

from jaxccl.schedule import Buffer, Collective, Op, OpKind, Schedule, ScheduleBuilder, Threadblock
from jaxccl.synth.allgather.packing import Packing


def allgather_schedule(packing: Packing, **build_kwargs) -> Schedule:
    """Compiles ``packing`` to an ``ALL_GATHER`` schedule with ``chunks_per_period = k``.

    The program is exactly what :func:`allgather_schedule_reference` builds
    through :class:`~jaxccl.schedule.ScheduleBuilder` (same threadblocks,
    op order and dependencies, so the same digest), computed with array
    operations: threadblock and op indices by sorting, the receives a
    forward waits for by binary search, and one :class:`~jaxccl.schedule.Op`
    object per distinct op (ops are immutable; a schedule of a regular
    topology repeats few distinct ones many times).
    """
    n, k = packing.n, packing.k
    a = packing.all_pieces()  # root, parent, child, first, count, level
    rows = a[np.lexsort((a[:, 3], a[:, 2], a[:, 0], a[:, 5]))]
    root, u, v, first, count = (rows[:, i] for i in range(5))
    m = len(rows)
    # events in builder order: row i is a send at u (event 2i), then a receive at v (event 2i+1)
    ev_rank = np.empty(2 * m, dtype=np.int64)
    ev_rank[0::2], ev_rank[1::2] = u, v
    ev_peer = np.empty(2 * m, dtype=np.int64)
    ev_peer[0::2], ev_peer[1::2] = v, u
    ev_recv = np.tile(np.array([0, 1], dtype=np.int64), m)
    keys, first_use, ev_tb = np.unique((ev_rank * 2 + ev_recv) * n + ev_peer, return_index=True, return_inverse=True)
    tb_rank = keys // (2 * n)
    # threadblocks of a rank in order of first use, after its local one (index 0, the input copy)
    order = np.lexsort((first_use, tb_rank))
    rank_start = np.searchsorted(tb_rank[order], np.arange(n + 1))
    tb_index = np.empty(len(keys), dtype=np.int64)
    tb_index[order] = np.arange(len(keys)) - rank_start[tb_rank[order]] + 1
    by_tb = np.argsort(ev_tb, kind="stable")
    tb_size = np.bincount(ev_tb, minlength=len(keys))
    tb_lo = np.cumsum(tb_size) - tb_size
    ev_op = np.empty(2 * m, dtype=np.int64)
    ev_op[by_tb] = np.arange(2 * m) - tb_lo[ev_tb[by_tb]]
    recv_tb, recv_op = tb_index[ev_tb[1::2]], ev_op[1::2]

    # a forward waits for the receives that brought its chunks: pieces of (root, u) overlapping its range
    fwd = np.flatnonzero(u != root)
    held = np.lexsort((first, root * n + v))
    span = k + 1
    key_lo = (root * n + v)[held] * span + first[held]
    key_hi = key_lo + count[held]
    qry = (root * n + u)[fwd] * span
    lo = np.searchsorted(key_hi, qry + first[fwd], side="right")
    hi = np.searchsorted(key_lo, qry + first[fwd] + count[fwd], side="left")
    ndep = hi - lo
    width = int(ndep.max()) if len(fwd) else 0
    dep = np.full((m, 2 * max(width, 1)), -1, dtype=np.int64)
    for j in range(width):
        has = ndep > j
        src_row = held[lo[has] + j]
        got = np.minimum(first[src_row] + count[src_row], (first + count)[fwd[has]])
        got -= np.maximum(first[src_row], first[fwd[has]])
        if j == 0:
            covered = np.zeros(len(fwd), dtype=np.int64)
        covered[has] += got
        if (src_row >= fwd[has]).any():  # pragma: no cover - guarded by the packing's level order
            raise AssertionError("a GPU forwards chunks before the receive that brings them")
        dep[fwd[has], 2 * j] = recv_tb[src_row]
        dep[fwd[has], 2 * j + 1] = recv_op[src_row]
    if len(fwd) and (covered != count[fwd]).any():  # pragma: no cover - guarded by the packing's level order
        bad = fwd[np.flatnonzero(covered != count[fwd])[0]]
        raise AssertionError(f"GPU {u[bad]} forwards chunks {first[bad]}+{count[bad]} of root {root[bad]} it lacks")
    if width > 1:  # deps are sorted (threadblock, op) pairs
        pairs = dep[:, : 2 * width].reshape(m, width, 2)
        rank_key = np.where(pairs[:, :, 0] < 0, np.iinfo(np.int64).max, pairs[:, :, 0] * (2 * m + 1) + pairs[:, :, 1])
        dep[:, : 2 * width] = np.take_along_axis(pairs, np.argsort(rank_key, axis=1)[:, :, None], axis=1).reshape(m, -1)

    from_input = u == root
    src_buf = np.where(from_input, int(Buffer.INPUT), int(Buffer.OUTPUT))
    src_off = np.where(from_input, first, root * k + first)
    dst_off = root * k + first
    sends = _ops(OpKind.SEND, np.column_stack([src_buf, src_off, dst_off, count, dep]))
    recvs = _ops(OpKind.RECV, np.column_stack([src_buf, src_off, dst_off, count]))
    ev_obj = np.empty(2 * m, dtype=object)
    ev_obj[0::2], ev_obj[1::2] = sends, recvs
    ordered = ev_obj[by_tb].tolist()
    tbs: list[list] = [[] for _ in range(n)]
    lo_of, end_of = tb_lo.tolist(), (tb_lo + tb_size).tolist()
    peer_of, rank_of, recv_of = (keys % n).tolist(), tb_rank.tolist(), ((keys // n) % 2 == 1).tolist()
    for t in order.tolist():
        ops = tuple(ordered[lo_of[t] : end_of[t]])
        peer = peer_of[t]
        tbs[rank_of[t]].append(Threadblock(ops, -1, peer, 0) if recv_of[t] else Threadblock(ops, peer, -1, 0))
    ranks = tuple(
        (Threadblock((Op(OpKind.COPY, Buffer.INPUT, 0, Buffer.OUTPUT, r * k, k),), -1, -1, 0), *tbs[r])
        for r in range(n)
    )
    return Schedule(collective=Collective.ALL_GATHER, num_ranks=n, chunks_per_period=k, ranks=ranks, **build_kwargs)


def _ops(kind: OpKind, cols: np.ndarray) -> np.ndarray:
    """One :class:`Op` per distinct row ``(src buffer, src offset, dst offset, count, dep tb, dep op, ...)``."""
    _, index, inverse = np.unique(_row_keys(cols), return_index=True, return_inverse=True)
    uniq = cols[index]
    objs = np.empty(len(uniq), dtype=object)
    for i, row in enumerate(uniq.tolist()):
        deps = tuple((row[j], row[j + 1]) for j in range(4, len(row), 2) if row[j] >= 0)
        objs[i] = Op(kind, Buffer(row[0]), row[1], Buffer.OUTPUT, row[2], row[3], deps)
    return objs[inverse.reshape(-1)]


def _row_keys(cols: np.ndarray) -> np.ndarray:
    """Integer keys equal exactly for equal rows (mixed radix, renumbered when it would overflow)."""
    key = np.zeros(len(cols), dtype=np.int64)
    size = 1
    for c in cols.T:
        c = c - c.min(initial=0)
        radix = int(c.max(initial=0)) + 1
        if size * radix >= 1 << 62:
            uniq, key = np.unique(key, return_inverse=True)
            key = key.reshape(-1)
            size = len(uniq)
        key = key * radix + c
        size *= radix
    return key


def allgather_schedule_reference(packing: Packing, **build_kwargs) -> Schedule:
    """:func:`allgather_schedule` through :class:`~jaxccl.schedule.ScheduleBuilder`, one transfer at a time.

    The plain statement of the compilation; :func:`allgather_schedule` must build the same program (tests check it).
    """
    n, k = packing.n, packing.k
    b = ScheduleBuilder(Collective.ALL_GATHER, n, k)
    for r in range(n):
        b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r * k), k)
    rows = packing.all_pieces()  # root, parent, child, first, count, level
    order = np.lexsort((rows[:, 3], rows[:, 2], rows[:, 0], rows[:, 5]))
    got: dict[tuple[int, int], list[tuple[int, int, object]]] = collections.defaultdict(list)
    for r, u, v, first, count, _ in rows[order].tolist():
        if u == r:
            src = (Buffer.INPUT, first)
            after = ()
        else:
            src = (Buffer.OUTPUT, r * k + first)
            after = _covering(got[(u, r)], first, count, u, r)
        h = b.transfer(u, v, src, (Buffer.OUTPUT, r * k + first), count, after=after)
        got[(v, r)].append((first, count, h))
    return b.build(**build_kwargs)


def _covering(pieces: list[tuple[int, int, object]], first: int, count: int, node: int, root: int) -> list:
    """The receive handles that brought chunks ``first .. first+count-1`` of ``root`` to ``node``."""
    out = [h for f, c, h in pieces if f < first + count and first < f + c]
    covered = sum(
        min(f + c, first + count) - max(f, first) for f, c, _ in pieces if f < first + count and f + c > first
    )
    if covered != count:  # pragma: no cover - guarded by the packing's level order
        raise AssertionError(f"GPU {node} forwards chunks {first}+{count} of root {root} before receiving them")
    return out


def reduce_scatter_schedule(packing: Packing, **build_kwargs) -> object:
    """Compiles ``packing`` (trees of the *reversed* topology) to a ``REDUCE_SCATTER`` schedule.

    A tree edge ``u -> v`` of root ``r`` becomes ``v`` sending its partial
    sum of root ``r``'s chunk range to ``u`` over the physical link ``v -> u``;
    a GPU adds its children's partial sums to its own input (in scratch,
    offset ``r * k + j``) before sending, and the root adds them into its
    output. Sums follow the tree, not rank order, so the schedule declares
    ``info["ordered_reduction"] = False``.
    """
    n, k = packing.n, packing.k
    b = ScheduleBuilder(Collective.REDUCE_SCATTER, n, k, scratch_chunks=n * k)
    jobs = []  # (-depth, root, lo, count, child, parent, children)
    for r, trees in enumerate(packing.trees()):
        lo = 0
        for weight, edges in trees:
            parent = {c: p for p, c in edges}
            kids: dict[int, list[int]] = collections.defaultdict(list)
            for p, c in edges:
                kids[p].append(c)
            depth = {r: 0}
            stack = [r]
            while stack:
                x = stack.pop()
                for c in kids[x]:
                    depth[c] = depth[x] + 1
                    stack.append(c)
            for c, p in parent.items():
                jobs.append((-depth[c], r, lo, weight, c, p, sorted(kids[c])))
            jobs.append((1, r, lo, weight, r, -1, sorted(kids[r])))
            lo += weight
    jobs.sort(key=lambda j: (j[0], j[1], j[2], j[4]))
    # handles of the last reduction into (node, root, lo) accumulators
    last: dict[tuple[int, int, int], object] = {}
    for _, r, lo, weight, c, p, _children in jobs:
        acc = last.get((c, r, lo))
        if p < 0:  # the root: its output already holds the sum (or, with no children, copy the input)
            if acc is None:
                b.copy(r, (Buffer.INPUT, r * k + lo), (Buffer.OUTPUT, lo), weight)
            continue
        src = (Buffer.SCRATCH, r * k + lo) if acc is not None else (Buffer.INPUT, r * k + lo)
        into_root = p == r
        dst = (Buffer.OUTPUT, lo) if into_root else (Buffer.SCRATCH, r * k + lo)
        prev = last.get((p, r, lo))
        reduce_with = dst if prev is not None else (Buffer.INPUT, r * k + lo)
        h = b.transfer(
            c,
            p,
            src,
            dst,
            weight,
            after=() if acc is None else (acc,),
            reduce=True,
            reduce_with=reduce_with,
            recv_after=() if prev is None else (prev,),
        )
        last[(p, r, lo)] = h
    return b.build(**build_kwargs)
