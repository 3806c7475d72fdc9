"""Shallower trees after a warm start: the deepest GPUs lifted where links have room.

A warm start keeps the previous trees and re-grows what they lost below
what was kept, so its trees can end deeper than a cold packing of the same
logical topology (1x16x8 fail2: 10 hops against 6). :func:`shorten` lifts
them: for a GPU at a tree's deepest level it moves the shallowest of its
ancestors that can go under a parent at least two levels higher -- one
outside its own subtree whose logical link still has room for the tree's
chunks -- and the whole subtree rises with it; level by level, for as long
as every deepest GPU can be lifted.

Where the links into that ancestor are full (a GPU that needs every unit of
its in-capacity, e.g. the one whose NVLink degraded), it swaps instead: a
tree ``t2`` that takes the ancestor from the shallow parent ``q`` takes it
from the old parent ``p`` instead, if ``t2`` stays shallow enough, and the
lifted tree takes ``q``'s link. When the two trees carry different numbers
of chunks, the larger one is split (both parts keep the same route except
at the ancestor), so exactly as many chunks cross each link as before. Link
loads stay within the capacities, so the rate (and its certificate) stays.

A level is removed completely or not at all (its moves are undone when one
of its GPUs cannot be lifted), and splits may at most double the number of
trees (:data:`MAX_TREE_GROWTH`; a level that needs more stays): every tree
adds operations to the schedule.
"""

from __future__ import annotations

import numpy as np

from jaxccl.synth.allgather.packing import Packing, _all_depths

MAX_TREE_GROWTH = 2  # splits may at most double the trees (the schedule's size grows with them)


class _Trees:
    """Arborescences as growable arrays: ``root``, ``weight`` (chunks), ``parent`` and ``depth`` per tree."""

    def __init__(self, roots: np.ndarray, weights: np.ndarray, parent: np.ndarray):
        self.size = len(roots)
        self.root = roots.astype(np.int64)
        self.weight = weights.astype(np.int64)
        self.parent = parent.astype(np.int64)
        self.depth = _all_depths(self.parent, self.root)

    def split(self, t: int, m: int) -> int:
        """Moves ``m`` of tree ``t``'s chunks into a new tree with the same route; returns its index."""
        if self.size == len(self.root):
            self.root, self.weight = np.resize(self.root, 2 * self.size), np.resize(self.weight, 2 * self.size)
            self.parent = np.concatenate([self.parent, self.parent])
            self.depth = np.concatenate([self.depth, self.depth])
        h = self.size
        self.size += 1
        self.root[h], self.weight[h] = self.root[t], m
        self.weight[t] -= m
        self.parent[h], self.depth[h] = self.parent[t], self.depth[t]
        return h

    def snapshot(self) -> tuple:
        s = self.size
        return s, self.root[:s].copy(), self.weight[:s].copy(), self.parent[:s].copy(), self.depth[:s].copy()

    def restore(self, saved: tuple) -> None:
        s, root, weight, parent, depth = saved
        self.size = s
        self.root[:s], self.weight[:s], self.parent[:s], self.depth[:s] = root, weight, parent, depth

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        s = self.size
        return self.root[:s], self.weight[:s], self.parent[:s], self.depth[:s]


def shorten(packing: Packing, links: dict[tuple[int, int], int]) -> Packing:
    """``packing`` with its deepest level re-hung onto shallower parents while that lowers the max depth.

    Returns ``packing`` itself when no level could be removed.
    """
    n = packing.n
    roots, weights, parent = packing.tree_arrays()
    if not len(roots):
        return packing
    f = _Trees(roots, weights, parent)
    spare = np.zeros((n, n), dtype=np.int64)
    for (u, v), c in links.items():
        spare[u, v] += c
    t_idx, v_idx = np.nonzero(f.parent >= 0)
    np.subtract.at(spare, (f.parent[t_idx, v_idx], v_idx), f.weight[t_idx])
    best = int(f.depth.max())
    moved = 0
    max_trees = MAX_TREE_GROWTH * f.size
    while best > 1:
        saved, saved_spare, level_moves = f.snapshot(), spare.copy(), 0
        if int((f.depth[: f.size] == best).sum()) > max_trees - f.size + len(roots):
            break  # more GPUs to lift than splits left (most lifts on a tight level split a tree): keep this level
        stuck = False
        deep = np.flatnonzero(f.depth[: f.size].max(axis=1) == best)
        while len(deep) and not stuck:
            for t in deep.tolist():  # (a split may copy a tree that still has GPUs this deep: the next round)
                while not stuck and f.depth[t].max() == best:
                    x = int(np.argmax(f.depth[t]))
                    if _lift(f, t, x, spare) and f.size <= max_trees:
                        level_moves += 1
                    else:
                        stuck = True
                if stuck:
                    break
            deep = np.flatnonzero(f.depth[: f.size].max(axis=1) == best)
        if stuck:  # this level stays: undo its moves (and the splits they made)
            f.restore(saved)
            spare = saved_spare
            break
        moved += level_moves
        best -= 1
    if not moved:
        return packing
    stats = {**packing.stats, "shorten_moves": moved}
    return Packing(n, packing.k, _pieces(n, *f.arrays()), packing.key, packing.method, stats)


def _lift(f: _Trees, t: int, x: int, spare: np.ndarray) -> bool:
    """Moves one ancestor of GPU ``x`` in tree ``t`` (or ``x``) under a shallower parent with room; True if one moved.

    The shallowest ancestor that can move goes first: its whole subtree,
    ``x`` included, rises with it. Only part of tree ``t`` may move (a
    split); the rest stays for the next call. If no ancestor can move, one
    whose link from a GPU one level up has room goes under that GPU after
    lifting it first (two steps).
    """
    parent, depth = f.parent, f.depth
    w = int(f.weight[t])
    chain = [x]
    while depth[t, chain[-1]] > 2:
        chain.append(int(parent[t, chain[-1]]))
    best = int(depth[t, x])
    for a in reversed(chain):
        if _rehang(f, t, a, int(depth[t, a]) - 2, best, spare):
            return True
    for a in reversed(chain):
        level = int(f.depth[t, a])
        if level < 3:
            continue
        sub = _subtree(f.parent[t], f.depth[t], a)
        p = int(f.parent[t, a])
        for q in np.flatnonzero((f.depth[t] >= level - 1) & ~sub & (spare[:, a] >= w)).tolist():
            if _rehang(f, t, q, level - 3, best, spare, split=False):
                _move(f, t, a, p, q, w, spare, sub)
                return True
    return False


def _rehang(f: _Trees, t: int, a: int, limit: int, best: int, spare: np.ndarray, *, split: bool = True) -> bool:
    """Hangs ``a`` in tree ``t`` under a parent at most ``limit`` deep: over a link with room, else by a swap
    with another tree (that stays above depth ``best``); True if it moved. ``split=False``: all of ``t`` or nothing."""
    parent, depth = f.parent, f.depth
    w = int(f.weight[t])
    cand = np.flatnonzero(depth[t] <= limit)
    if not cand.size:
        return False
    sub = _subtree(parent[t], depth[t], a)
    cand = cand[~sub[cand]]  # a parent in a's own subtree would close a cycle
    if not cand.size:
        return False
    p = int(parent[t, a])
    room = cand[spare[cand, a] >= w]
    if room.size:
        q = int(room[np.lexsort((-spare[room, a], depth[t, room]))[0]])
        _move(f, t, a, p, q, w, spare, sub)
        return True
    # Swap: a tree t2 that takes a from q gives (part of) that link up and takes a from p instead.
    is_cand = np.zeros(parent.shape[1], dtype=bool)
    is_cand[cand] = True
    t2s = np.flatnonzero(is_cand[np.maximum(parent[: f.size, a], 0)] & (parent[: f.size, a] >= 0))
    t2s = t2s[t2s != t]
    qs = parent[t2s, a]
    shift = depth[t2s, p] - depth[t2s, qs]
    fits = depth[t2s, a] + shift <= best - 1  # a itself ends shallow enough (its subtree is checked below)
    t2s, qs, shift = t2s[fits], qs[fits], shift[fits]
    for i in np.lexsort((t2s, depth[t, qs])).tolist():  # shallowest q first
        t2, q = int(t2s[i]), int(qs[i])
        w2 = int(f.weight[t2])
        m = min(w, w2 + int(spare[q, a]))  # chunks of t that move to q
        if m < w and not split:
            continue
        sub2 = _subtree(parent[t2], depth[t2], a)
        if sub2[p] or depth[t2, sub2].max() + shift[i] > best - 1:
            continue
        m2 = max(0, m - int(spare[q, a]))  # chunks of t2 that make room for them, moving to p
        if m2:
            _move(f, t2 if m2 == w2 else f.split(t2, m2), a, q, p, m2, spare, sub2)
        _move(f, t if m == w else f.split(t, m), a, p, q, m, spare, sub)
        return True
    return False


def _move(f: _Trees, t: int, a: int, old: int, new: int, w: int, spare: np.ndarray, sub: np.ndarray) -> None:
    """Re-hangs ``a`` (its subtree ``sub``) from ``old`` to ``new`` in tree ``t`` (``w`` chunks)."""
    spare[old, a] += w
    spare[new, a] -= w
    f.parent[t, a] = new
    f.depth[t, sub] += f.depth[t, new] + 1 - f.depth[t, a]


def _subtree(parent_row: np.ndarray, depth_row: np.ndarray, a: int) -> np.ndarray:
    """The mask of ``a`` and its descendants in the tree ``parent_row`` (depths ``depth_row``)."""
    cur = np.arange(parent_row.size)
    level = depth_row[a]
    for _ in range(int(depth_row.max()) - level):  # climb every GPU up to a's level
        cur = np.where(depth_row[cur] > level, parent_row[cur], cur)
    return cur == a


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
