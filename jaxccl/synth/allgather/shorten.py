"""Shallower trees after a warm start: the deepest GPUs lifted where links have room.

A warm start keeps the previous trees and re-grows what they lost below
what was kept, so its trees can end deeper than a cold packing of the same
logical topology (1x16x8 fail2: 10 hops against 6). :func:`shorten` lifts
them: for a GPU at a tree's deepest level it moves the shallowest of its
ancestors that can go under a parent at least two levels higher -- one
outside its own subtree whose logical link still has room for the tree's
chunks -- and the whole subtree rises with it; level by level, for as long
as every deepest GPU can be lifted. Link loads stay within the
capacities, so the rate (and its certificate) stays.
"""

from __future__ import annotations

import numpy as np

from jaxccl.synth.allgather.packing import Packing, _all_depths


def shorten(packing: Packing, links: dict[tuple[int, int], int]) -> Packing:
    """``packing`` with its deepest level re-hung onto shallower parents while that lowers the max depth.

    Returns ``packing`` itself when no level could be removed.
    """
    n = packing.n
    roots, weights, parent = packing.tree_arrays()
    if not len(roots):
        return packing
    depth = _all_depths(parent, roots)
    spare = np.zeros((n, n), dtype=np.int64)
    for (u, v), c in links.items():
        spare[u, v] += c
    t_idx, v_idx = np.nonzero(parent >= 0)
    np.subtract.at(spare, (parent[t_idx, v_idx], v_idx), weights[t_idx])
    best = int(depth.max())
    moved = 0
    while best > 1:
        stuck = False
        for t in np.flatnonzero(depth.max(axis=1) == best).tolist():
            while not stuck and depth[t].max() == best:
                x = int(np.argmax(depth[t]))
                if _lift(t, x, roots, weights, parent, depth, spare):
                    moved += 1
                else:
                    stuck = True
            if stuck:
                break
        if stuck:
            break
        best -= 1
    if not moved:
        return packing
    return Packing(n, packing.k, _pieces(n, roots, weights, parent, depth), packing.key, packing.method, packing.stats)


def _lift(t: int, x: int, roots, weights, parent, depth, spare) -> bool:
    """Moves one ancestor of GPU ``x`` in tree ``t`` (or ``x``) under a shallower parent with room; True if one moved.

    The shallowest ancestor that can move goes first: its whole subtree,
    ``x`` included, rises with it.
    """
    w = int(weights[t])
    chain = [x]
    while depth[t, chain[-1]] > 2:
        chain.append(int(parent[t, chain[-1]]))
    best = int(depth[t, x])
    for a in reversed(chain):
        cand = np.flatnonzero(depth[t] <= depth[t, a] - 2)
        cand = cand[~_inside(parent[t], roots[t], cand, a)]  # a parent in a's own subtree would close a cycle
        if not cand.size:
            continue
        p = int(parent[t, a])
        room = cand[spare[cand, a] >= w]
        if room.size:
            q = int(room[np.lexsort((-spare[room, a], depth[t, room]))[0]])
            _move(t, a, p, q, w, roots, parent, depth, spare)
            return True
        # Swap: a tree t2 that takes a from q gives that link up and takes a from p instead.
        for q in cand[np.argsort(depth[t, cand], kind="stable")].tolist():
            for t2 in np.flatnonzero(parent[:, a] == q).tolist():
                w2 = int(weights[t2])
                if t2 == t or spare[q, a] + w2 < w or spare[p, a] + w < w2:
                    continue
                if _inside(parent[t2], roots[t2], np.array([p]), a)[0]:
                    continue
                shift = depth[t2, p] - depth[t2, q]
                sub = _inside(parent[t2], roots[t2], np.arange(parent.shape[1]), a)
                if depth[t2, sub].max() + shift > best - 1:
                    continue
                _move(t2, a, q, p, w2, roots, parent, depth, spare)
                _move(t, a, p, q, w, roots, parent, depth, spare)
                return True
    return False


def _move(t: int, a: int, old: int, new: int, w: int, roots, parent, depth, spare) -> None:
    spare[old, a] += w
    spare[new, a] -= w
    parent[t, a] = new
    depth[t] = _all_depths(parent[t : t + 1], roots[t : t + 1])[0]


def _inside(parent_row: np.ndarray, root: int, nodes: np.ndarray, a: int) -> np.ndarray:
    """Which ``nodes`` lie in ``a``'s subtree of the tree ``parent_row``."""
    inside = np.zeros(nodes.size, dtype=bool)
    cur = nodes.copy()
    for _ in range(parent_row.size):
        inside |= cur == a
        at_root = cur == root
        if at_root.all():
            break
        cur = np.where(at_root, cur, parent_row[np.maximum(cur, 0)])
    return inside


def _pieces(n: int, roots: np.ndarray, weights: np.ndarray, parent: np.ndarray, depth: np.ndarray) -> list[np.ndarray]:
    """Per GPU, rows ``(root, parent, first, count, level)``; consecutive trees with one parent and level merged."""
    order = np.lexsort((np.arange(len(roots)), roots))
    first = np.zeros(len(roots), dtype=np.int64)
    r_sorted, w_sorted = roots[order], weights[order]
    starts = np.cumsum(w_sorted) - w_sorted
    root_start = starts[np.searchsorted(r_sorted, r_sorted)]
    first[order] = starts - root_start
    out = []
    for v in range(n):
        t = order[parent[order, v] >= 0]
        rows = np.column_stack([roots[t], parent[t, v], first[t], weights[t], depth[t, v]])
        if len(rows) > 1:
            same = (
                (rows[1:, 0] == rows[:-1, 0])
                & (rows[1:, 1] == rows[:-1, 1])
                & (rows[1:, 4] == rows[:-1, 4])
                & (rows[1:, 2] == rows[:-1, 2] + rows[:-1, 3])
            )
            head = np.flatnonzero(np.r_[True, ~same])
            counts = np.add.reduceat(rows[:, 3], head)
            rows = rows[head]
            rows[:, 3] = counts
        out.append(rows.astype(np.int64))
    return out
