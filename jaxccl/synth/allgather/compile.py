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

from jaxccl.schedule import Buffer, Collective, ScheduleBuilder
from jaxccl.synth.allgather.packing import Packing


def allgather_schedule(packing: Packing, **build_kwargs) -> object:
    """Compiles ``packing`` to an ``ALL_GATHER`` schedule with ``chunks_per_period = k``."""
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
