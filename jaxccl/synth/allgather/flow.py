"""Compiled max-flow on integer arrays (``scipy.sparse.csgraph.maximum_flow``).

A :class:`FlowNetwork` fixes a set of directed edges once (the sparse
structure is sorted and merged a single time) and answers max-flow and
min-cut queries for any capacity vector on those edges, so repeated queries
pay only for the solve.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from jaxccl.errors import ArgumentError, SynthesisError

INF = 1 << 30  # an "infinite" capacity; every finite cut in a query stays below it
_INT32_MAX = (1 << 31) - 1


class FlowNetwork:
    """Directed edges ``src[i] -> dst[i]`` on ``n`` nodes; capacities are given per query.

    Parallel edges are merged (capacities add up).

    >>> import numpy as np
    >>> f = FlowNetwork(3, np.array([0, 0, 1]), np.array([1, 2, 2]))
    >>> f.max_flow(np.array([2, 1, 5]), 0, 2)
    3
    >>> value, side = f.min_cut(np.array([2, 1, 1]), 0, 2)
    >>> value, side.tolist()
    (2, [True, True, False])
    """

    def __init__(self, n: int, src: np.ndarray, dst: np.ndarray):
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        self.n = int(n)
        self.num_edges = len(src)
        keys = src * self.n + dst
        self._order = np.argsort(keys, kind="stable")
        sorted_keys = keys[self._order]
        if len(sorted_keys):
            first = np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]])
        else:
            first = np.zeros(0, dtype=bool)
        self._starts = np.flatnonzero(first)
        uniq = sorted_keys[self._starts]
        self._indices = (uniq % self.n).astype(np.int32)
        counts = np.bincount(uniq // self.n, minlength=self.n)
        self._indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        # position of every original edge among the merged entries
        self._slot = np.empty(self.num_edges, dtype=np.int64)
        self._slot[self._order] = np.cumsum(first) - 1

    def matrix(self, cap: np.ndarray) -> sp.csr_array:
        """The capacity matrix for per-edge capacities ``cap``."""
        cap = np.asarray(cap, dtype=np.int64)
        if len(cap) != self.num_edges:
            raise ArgumentError(f"expected {self.num_edges} capacities, got {len(cap)}")
        data = np.add.reduceat(cap[self._order], self._starts) if self.num_edges else np.zeros(0, dtype=np.int64)
        if data.size and (data.min() < 0 or data.max() > _INT32_MAX):
            raise SynthesisError("max-flow capacities overflow int32; the topology's capacities span too wide a range")
        return sp.csr_array((data.astype(np.int32), self._indices, self._indptr), shape=(self.n, self.n))

    def max_flow(self, cap: np.ndarray, s: int, t: int) -> int:
        """The maximum ``s -> t`` flow value."""
        return int(maximum_flow(self.matrix(cap), s, t).flow_value)

    def min_cut(self, cap: np.ndarray, s: int, t: int) -> tuple[int, np.ndarray]:
        """``(value, source_side)``: a minimum ``s``-``t`` cut; ``source_side[v]`` is True on ``s``'s side."""
        mat = self.matrix(cap)
        res = maximum_flow(mat, s, t)
        residual = (mat - res.flow).tocsr()
        residual.data = (residual.data > 0).astype(np.int8)
        residual.eliminate_zeros()
        reach = breadth_first_order(residual, s, directed=True, return_predecessors=False)
        side = np.zeros(self.n, dtype=bool)
        side[reach] = True
        return int(res.flow_value), side

    def flows(self, cap: np.ndarray, s: int, t: int) -> tuple[int, np.ndarray]:
        """``(value, flow)``: a maximum flow with the flow on every original edge.

        Parallel edges share their merged flow in edge order.
        """
        mat = self.matrix(cap)
        res = maximum_flow(mat, s, t)
        merged = res.flow.tocsr()
        merged.sort_indices()
        # look up the flow of every merged (row, col) entry
        rows = np.repeat(np.arange(self.n), np.diff(self._indptr))
        cols = self._indices
        per_entry = np.asarray(merged[rows, cols]).ravel() if len(rows) else np.zeros(0)
        per_entry = np.maximum(per_entry, 0).astype(np.int64)
        capc = np.asarray(cap, dtype=np.int64)
        if len(self._starts) == self.num_edges:  # no parallel edges: one merged entry per edge
            out = per_entry[self._slot]
        else:  # parallel edges share their merged flow in edge order
            out = np.zeros(self.num_edges, dtype=np.int64)
            remaining = per_entry.copy()
            for i in self._order.tolist():
                slot = self._slot[i]
                take = min(int(remaining[slot]), int(capc[i]))
                out[i] = take
                remaining[slot] -= take
        return int(res.flow_value), out


class RootedCheck:
    """Checks ``lambda(S, v) >= demand`` for every GPU ``v`` (the throughput condition).

    The network is the given edges plus a super source ``S`` (node ``n``)
    with an edge of capacity ``root_cap`` to every GPU ``0..num_gpus-1``.
    """

    def __init__(self, n: int, num_gpus: int, src: np.ndarray, dst: np.ndarray):
        self.n = n
        self.num_gpus = num_gpus
        self.S = n
        self._m = len(src)
        src_all = np.concatenate([np.asarray(src, dtype=np.int64), np.full(num_gpus, n)])
        dst_all = np.concatenate([np.asarray(dst, dtype=np.int64), np.arange(num_gpus)])
        self.net = FlowNetwork(n + 1, src_all, dst_all)
        self.count = 0

    def capacities(self, cap: np.ndarray, root_cap: int) -> np.ndarray:
        return np.concatenate([np.asarray(cap, dtype=np.int64), np.full(self.num_gpus, int(root_cap))])

    def violation(
        self, cap: np.ndarray, root_cap: int, demand: int, order: np.ndarray | None = None
    ) -> tuple[int, int, np.ndarray] | None:
        """The first GPU ``v`` (in ``order``) with ``lambda(S, v) < demand``: ``(v, value, source_side)``.

        ``source_side`` covers the ``n`` original nodes (``S`` dropped). Returns None if every GPU passes.
        """
        full = self.capacities(cap, root_cap)
        mat = self.net.matrix(full)
        for v in order if order is not None else range(self.num_gpus):
            self.count += 1
            value = int(maximum_flow(mat, self.S, int(v)).flow_value)
            if value < demand:
                value, side = self.net.min_cut(full, self.S, int(v))
                return int(v), value, side[: self.n]
        return None


def small_bipartite_flow(
    demand: np.ndarray, allowed: np.ndarray, icap: np.ndarray, entry_cap: np.ndarray | None = None
) -> np.ndarray:
    """A maximum flow from rows (supplies ``demand``) to columns (capacities ``icap``) through ``allowed`` entries
    (each at most ``entry_cap``, unbounded if None); the flow per entry.

    For small matrices, in plain Python (numpy's and scipy's per-call overhead would dominate): a greedy
    assignment in row order, then augmenting paths (a row takes a column's capacity that another row gives up by
    moving to a column with capacity left) until none is left.

    >>> small_bipartite_flow(np.array([2, 2]), np.array([[True, True], [True, False]]), np.array([2, 2])).tolist()
    [[0, 2], [2, 0]]
    """
    left = [int(x) for x in np.asarray(icap).tolist()]
    rows = np.asarray(allowed, dtype=bool).tolist()
    m, d = len(rows), len(left)
    need = [int(x) for x in np.asarray(demand).tolist()]
    room = None if entry_cap is None else [[int(c) for c in r] for r in np.asarray(entry_cap).tolist()]
    flow = [[0] * d for _ in range(m)]
    for i in range(m):
        row, out = rows[i], flow[i]
        for j in range(d):
            if need[i] <= 0:
                break
            if row[j] and left[j] > 0:
                take = min(need[i], left[j]) if room is None else min(need[i], left[j], room[i][j])
                out[j] += take
                left[j] -= take
                need[i] -= take
    users = [[g for g in range(m) if flow[g][j] > 0] for j in range(d)]
    for i in range(m):
        while need[i] > 0:
            via_edge: dict[int, int] = {}  # column -> the row that takes more of it
            via_group: dict[int, int] = {i: -1}  # row -> the column it gives up
            queue, head, end = [i], 0, -1
            while head < len(queue) and end < 0:
                g = queue[head]
                head += 1
                for j in range(d):
                    if rows[g][j] and j not in via_edge and (room is None or flow[g][j] < room[g][j]):
                        via_edge[j] = g
                        if left[j] > 0:
                            end = j
                            break
                        for g2 in users[j]:
                            if g2 not in via_group and flow[g2][j] > 0:
                                via_group[g2] = j
                                queue.append(g2)
            if end < 0:
                break
            amount, j = min(need[i], left[end]), end
            path = []
            while True:
                g = via_edge[j]
                back = via_group[g]
                path.append((g, j, back))
                if room is not None:
                    amount = min(amount, room[g][j] - flow[g][j])
                if back < 0:
                    break
                amount = min(amount, flow[g][back])
                j = back
            for g, j, back in path:
                if flow[g][j] == 0:
                    users[j].append(g)
                flow[g][j] += amount
                if back >= 0:
                    flow[g][back] -= amount
            left[end] -= amount
            need[i] -= amount
    return np.array(flow, dtype=np.int64).reshape(np.shape(allowed))
