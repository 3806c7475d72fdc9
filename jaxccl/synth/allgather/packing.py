"""Phase 3 of ForestColl: packing ``k`` spanning arborescences per root into the logical topology.

Chunks of a root travel in *groups* that share a route so far (a group
starts as all ``k`` chunks of its root). A GPU ``v`` takes a group from an
in-neighbour that already holds it, over a logical link with capacity
left; because a link ``u -> v`` is used only by ``v``'s choices, all GPUs
can choose independently once the holders are known -- one small bipartite
b-matching (groups -> in-links, by max-flow) per GPU, instead of one
max-flow per candidate tree edge as in ForestColl's BFS. A group that ``v``
can take only in part splits into the part ``v`` holds and the rest.
Parents always hold a group before their children, so every chunk's route
is an arborescence, and a finished packing is exact (``k`` trees per root
within the link capacities) whatever strategy produced it.

Strategies, cheapest first (:func:`pack`):

* :func:`order_pack` (warm start): each previous tree keeps its share of
  chunks and its order; a GPU takes its groups from its old parents if the
  links still carry them (no max-flow at all), else by one matching along
  the old order; groups that no longer fit split and move.
* :func:`match_pack` with ``check="local"``: level by level without any
  max-flow check (optionally keeping the slack of given likely-tight sets by
  bookkeeping). It can run into a dead end, then the next strategy runs; it
  is skipped when most GPUs are exactly tight (every unit of their
  in-capacity is needed), where it would.
* :func:`match_pack` with ``check="full"``: every visit is verified against
  Edmonds' condition on the sets that hold the GPU (one max-flow per visit);
  a violated set bans the wasteful (group, link) pairs and the visit is
  retried. This never commits to a dead end in practice.
* :func:`forestcoll_pack`: ForestColl's own tree growth, a max-flow test per
  candidate link (exact, slow): the last resort.

Deviation from ForestColl: the matchings replace ForestColl's per-edge
max-flow tests (one test per visit at most, none on the cheap paths); trees
come out level by level (shallow, BFS-like) rather than by one BFS per tree.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from jaxccl.errors import SynthesisError
from jaxccl.synth.allgather.flow import INF, FlowNetwork


@dataclasses.dataclass
class Packing:
    """``k`` arborescences per root in compact form.

    ``pieces[v]`` is an int array of rows ``(root, parent, first, count, level)``:
    chunks ``first .. first+count-1`` of ``root``'s shard reach GPU ``v``
    from ``parent``. Every (root, v != root) pair covers chunks ``0..k-1``
    exactly once, and the pieces that bring those chunks to ``parent`` have
    smaller ``level`` (so sorting by level is a valid issue order).

    Attributes:
        n: number of GPUs.
        k: chunks (trees) per root.
        pieces: per GPU, its incoming pieces.
        key: per root, the order keys the matchings used (warm starts reuse them).
        method: "matching" or "forestcoll-bfs".
        stats: counters (flows, repairs, ...).
    """

    n: int
    k: int
    pieces: list[np.ndarray]
    key: np.ndarray
    method: str
    stats: dict

    def all_pieces(self) -> np.ndarray:
        """Rows ``(root, parent, child, first, count, level)`` of every piece."""
        rows = [
            np.column_stack([p[:, 0], p[:, 1], np.full(len(p), v), p[:, 2], p[:, 3], p[:, 4]])
            for v, p in enumerate(self.pieces)
        ]
        return np.concatenate(rows) if rows else np.zeros((0, 6), dtype=np.int64)

    def link_load(self) -> dict[tuple[int, int], int]:
        """Chunks per period on every logical link."""
        a = self.all_pieces()
        load: dict[tuple[int, int], int] = collections.defaultdict(int)
        for u, v, c in zip(a[:, 1].tolist(), a[:, 2].tolist(), a[:, 4].tolist()):
            load[(u, v)] += c
        return dict(load)

    def max_depth(self) -> int:
        """The largest number of hops from a root to a GPU over all trees."""
        best = 0
        for r, trees in enumerate(self.trees()):
            for _, edges in trees:
                parent = np.full(self.n, -1, dtype=np.int64)
                for p, c in edges:
                    parent[c] = p
                best = max(best, _tree_depth(parent, r))
        return best

    def trees(self) -> list[list[tuple[int, list[tuple[int, int]]]]]:
        """Per root, its distinct arborescences: ``(chunks, [(parent, child), ...])``."""
        a = self.all_pieces()
        out = []
        order = np.lexsort((a[:, 3], a[:, 2], a[:, 0]))
        a = a[order]
        bounds = np.searchsorted(a[:, 0], np.arange(self.n + 1))
        for r in range(self.n):
            rows = a[bounds[r] : bounds[r + 1]]
            cuts = np.unique(np.concatenate([[0, self.k], rows[:, 3]]))
            trees = []
            for lo, hi in zip(cuts[:-1], cuts[1:]):
                sel = rows[(rows[:, 3] <= lo) & (rows[:, 3] + rows[:, 4] > lo)]
                trees.append((int(hi - lo), [(int(p), int(c)) for p, c in zip(sel[:, 1], sel[:, 2])]))
            out.append(trees)
        return out


def _tree_depth(parent: np.ndarray, root: int) -> int:
    """Depth of the arborescence given by parent pointers; raises if it is not one."""
    n = len(parent)
    others = np.arange(n) != root
    if (parent[others] < 0).any():
        raise SynthesisError(f"a tree of root {root} misses GPUs {np.flatnonzero(others & (parent < 0))[:8].tolist()}")
    cur = parent.copy()
    cur[root] = root
    depth = others.astype(np.int64)
    for _ in range(int(np.ceil(np.log2(max(n, 2)))) + 2):  # pointer jumping
        depth = depth + depth[cur]
        cur = cur[cur]
        if (cur == root).all():
            return int(depth.max())
    raise SynthesisError(f"a tree of root {root} has a cycle")


def match_pack(
    n: int,
    k: int,
    links: dict[tuple[int, int], int],
    *,
    prefer: dict[int, np.ndarray] | None = None,
    max_levels: int | None = None,
    check: str = "full",
    sets: list[np.ndarray] | None = None,
) -> Packing:
    """Packs ``k`` trees per root by per-GPU matchings (see the module docstring).

    Args:
        n: GPUs.
        k: trees per root.
        links: logical link -> capacity in trees.
        prefer: warm start: per GPU, rows ``(root, parent)`` of the previous
            schedule; offered before anything else.
        max_levels: give up after this many levels (default ``n``).
        check: ``"full"``: verify every visit against Edmonds' condition (one
            max-flow); ``"local"``: only keep the slack of ``sets`` (cheap
            bookkeeping). Without the full check a visit can commit to a dead
            end (then this raises), but whatever completes is a valid packing.
        sets: GPU sets likely to be tight (e.g. the GPUs around each switch):
            their slack is tracked so that a visit neither wastes it (entering
            a set with chunks it already holds) nor overdraws it.

    Raises:
        SynthesisError: if a level makes no progress.
    """
    if check not in ("full", "local"):
        raise ValueError(f"check must be 'full' or 'local', got {check!r}")
    return _Matcher(n, k, links, prefer, check, sets or []).run(n if max_levels is None else max_levels)


class _Matcher:
    """State of :func:`match_pack`: chunk groups, their holders, remaining link capacity."""

    def __init__(self, n: int, k: int, links: dict[tuple[int, int], int], prefer, check: str, sets: list):
        self.n, self.k = n, k
        self.verify = check == "full"
        self.src = np.array([u for u, _ in links], dtype=np.int64)
        self.dst = np.array([v for _, v in links], dtype=np.int64)
        self.cap = np.array(list(links.values()), dtype=np.int64)
        self.by_dst = [np.flatnonzero(self.dst == v) for v in range(n)]
        self.remaining = self.cap.copy()
        # capacity class of a link at its head: 0 within 4x of the head's largest in-link, 1 within 16x, ...
        self.cls = np.zeros(len(self.cap), dtype=np.int64)
        for v in range(n):
            e = self.by_dst[v]
            if len(e):
                self.cls[e] = np.floor(np.log(self.cap[e].max() / self.cap[e]) / np.log(4.0)).astype(np.int64)
        self.root = list(range(n))
        self.first = [0] * n
        self.count = [k] * n
        self.held = np.eye(n, dtype=bool)  # held[g, v]
        self.depth = np.zeros((n, n), dtype=np.int64)
        self.rows: list[list[tuple]] = [[] for _ in range(n)]
        self.missing = np.full(n, k * (n - 1), dtype=np.int64)
        self.pref = _preference_masks(n, self.src, self.by_dst, prefer) if prefer else None
        self.stats = {"node_matchings": 0, "checks": 0, "rejected": 0, "levels": 0, "groups": n, "preferred_units": 0}
        # tracked sets: members and the links entering them
        self.sets = [np.asarray(x, dtype=np.int64) for x in sets if 1 < len(x) < n]
        member = np.zeros((len(self.sets), n), dtype=bool)
        for i, x in enumerate(self.sets):
            member[i, x] = True
        self.member = member
        self.enter = [np.flatnonzero(member[i, self.dst] & ~member[i, self.src]) for i in range(len(self.sets))]
        self.sets_of = [np.flatnonzero(member[:, v]) for v in range(n)]
        self.inside = member[:, :n].copy() if len(self.sets) else np.zeros((0, n), dtype=bool)  # inside[S, g]
        self.level0 = 0
        self.max_checks: int | None = None

    def _set_state(self, v: int, groups: np.ndarray, holders: np.ndarray):
        """For the tracked sets holding ``v``: slacks, and per set which (group, link) pairs waste it."""
        slacks, waste = [], []
        sizes = np.asarray(self.count, dtype=np.int64)
        G = len(self.root)
        for i in self.sets_of[v].tolist():
            x = self.sets[i]
            inside = self.inside[i, :G]
            # entering capacity is usable only up to what its head still misses
            ent = self.enter[i]
            into = np.bincount(self.dst[ent], weights=self.remaining[ent], minlength=self.n)[x]
            usable = int(np.minimum(into, self.missing[x]).sum())
            slack = usable - int(sizes[:G][~inside].sum())
            slacks.append(slack)
            waste.append(inside[groups][:, None] & ~self.member[i, holders][None, :])
        return slacks, waste

    # ------------------------------------------------------------------ run
    def run(self, max_levels: int) -> Packing:
        level = self.level0
        while self.missing.any():
            level += 1
            if level > self.level0 + max_levels:
                raise SynthesisError(f"tree packing: incomplete after {max_levels} levels")
            self.ready = self.held.copy()  # holders at the start of the level forward at this level
            progress = False
            for v in np.flatnonzero(self.missing).tolist():
                progress |= self._visit(v, self.ready, level)
            if not progress:
                stuck = np.flatnonzero(self.missing)[:8].tolist()
                raise SynthesisError(f"tree packing: GPUs {stuck} cannot receive their remaining chunks")
        self.stats["levels"] = level
        self.stats["groups"] = len(self.root)
        pieces = [np.array(r, dtype=np.int64).reshape(-1, 5) for r in self.rows]
        key = np.zeros((self.n, self.n), dtype=np.int64)
        for g, r in enumerate(self.root):
            key[r] = np.maximum(key[r], self.depth[g])
        return Packing(n=self.n, k=self.k, pieces=pieces, key=key, method="matching", stats=self.stats)

    def _visit(self, v: int, ready: np.ndarray, level: int) -> bool:
        edges = self.by_dst[v]
        edges = edges[self.remaining[edges] > 0]
        if not len(edges):
            return False
        G = len(self.root)
        groups = np.flatnonzero(~self.held[:G, v])
        holders = self.src[edges]
        allowed = ready[groups][:, holders]
        if not allowed.any():
            return False
        banned = np.zeros_like(allowed)
        slacks, waste = self._set_state(v, groups, holders)
        need = int(np.asarray(self.count)[groups].sum())
        penalty = np.zeros(allowed.shape, dtype=np.int64)
        for sl, w in zip(slacks, waste):
            penalty += w * (2 if sl < need else 0)
        for _ in range(8):
            taken = self._propose(v, groups, edges, allowed & ~banned, penalty)
            if not taken.any():
                return False
            over = [w for sl, w in zip(slacks, waste) if int(taken[w].sum()) > sl]
            if over:  # a tracked set would be overdrawn: never waste it in this visit
                self.stats["rejected"] += 1
                for w in over:
                    banned |= w
                continue
            cut = self._check(v, groups, edges, taken) if self.verify else None
            if cut is None:
                self._apply(v, groups, edges, taken, level)
                return True
            # a set X holding v lost slack: forbid entering X from outside with groups already in X
            self.stats["rejected"] += 1
            inside = self.held[groups][:, cut].any(axis=1)
            from_out = ~cut[holders]
            banned |= inside[:, None] & from_out[None, :]
        return False

    def _propose(
        self, v: int, groups: np.ndarray, edges: np.ndarray, allowed: np.ndarray, penalty: np.ndarray
    ) -> np.ndarray:
        holders = self.src[edges]
        gsize = np.asarray(self.count)[groups]
        never = np.iinfo(np.int64).max
        score = np.where(allowed, self.depth[groups][:, holders] + self.cls[edges][None, :] + penalty, never)
        best = score.min(axis=1, keepdims=True)
        stages = []
        if self.pref is not None and v in self.pref:
            pm = self.pref[v][np.asarray(self.root)[groups]][:, edges] & allowed
            if pm.any():
                stages.append(pm)
        if allowed.any():
            spread = int((score - best)[allowed].max())
            stages += [allowed & (score <= best + j) for j in range(spread + 1)]
        taken = np.zeros((len(groups), len(edges)), dtype=np.int64)
        for si, mask in enumerate(stages):
            want = gsize - taken.sum(axis=1)
            todo = (want > 0) & mask.any(axis=1)
            if not todo.any():
                continue
            self.stats["node_matchings"] += 1
            flow = _bipartite(want[todo], mask[todo], self.remaining[edges] - taken.sum(axis=0))
            taken[np.flatnonzero(todo)] += flow
            if si == 0 and len(stages) and self.pref is not None and v in self.pref:
                self.stats["preferred_units"] += int(flow.sum())
        return taken

    def _check(self, v: int, groups: np.ndarray, edges: np.ndarray, taken: np.ndarray) -> np.ndarray | None:
        if self.max_checks is not None and self.stats["checks"] >= self.max_checks:
            raise SynthesisError(f"tree packing: more than {self.max_checks} checks; give up this attempt")
        return self._check_now(v, groups, edges, taken)

    def _check_now(self, v: int, groups: np.ndarray, edges: np.ndarray, taken: np.ndarray) -> np.ndarray | None:
        """Edmonds' condition on the sets holding ``v`` after the proposal; a violated set or None.

        Only sets holding ``v`` change (their in-links lost capacity, some
        groups now reach them), so one max-flow to ``v`` decides: a source per
        unfinished group (capacity: its size) joined to its holders, the
        remaining links, and ``v`` must receive every group it does not hold.
        """
        self.stats["checks"] += 1
        n = self.n
        G = len(self.root)
        held = self.held[:G].copy()
        remaining = self.remaining.copy()
        remaining[edges] -= taken.sum(axis=0)
        size = np.asarray(self.count, dtype=np.int64)
        got = taken.sum(axis=1)
        # groups v takes in part split: the taken part is held by v, the rest is not
        extra_rows = []
        for gi in np.flatnonzero(got).tolist():
            g = int(groups[gi])
            if got[gi] < size[g]:
                extra_rows.append((held[g].copy(), size[g] - int(got[gi])))
                size[g] = int(got[gi])
            held[g, v] = True
        if extra_rows:
            held = np.concatenate([held, np.array([h for h, _ in extra_rows])])
            size = np.concatenate([size, np.array([c for _, c in extra_rows], dtype=np.int64)])
        live = ~held.all(axis=1) & ~held[:, v]
        gi, hv = np.nonzero(held[live])
        gsz = size[live]
        m = int(live.sum())
        if m == 0:
            return None
        S = n + m
        keep = remaining > 0
        src = np.concatenate([self.src[keep], np.full(m, S), n + gi])
        dst = np.concatenate([self.dst[keep], n + np.arange(m), hv])
        cap = np.concatenate([remaining[keep], gsz, np.full(len(gi), INF)])
        need = int(gsz.sum())
        mat = _csr(n + m + 1, src, dst, cap)
        res = maximum_flow(mat, S, v)
        if res.flow_value >= need:
            return None
        residual = (mat - res.flow).tocsr()
        residual.data = (residual.data > 0).astype(np.int8)
        residual.eliminate_zeros()
        reach = breadth_first_order(residual, S, directed=True, return_predecessors=False)
        side = np.zeros(n + m + 1, dtype=bool)
        side[reach] = True
        return ~side[:n]  # the violated set: nodes on v's side

    def _apply(self, v: int, groups: np.ndarray, edges: np.ndarray, taken: np.ndarray, level: int) -> None:
        holders = self.src[edges]
        self.remaining[edges] -= taken.sum(axis=0)
        got = taken.sum(axis=1)
        self.missing[v] -= int(got.sum())
        for gi in np.flatnonzero(got).tolist():
            g = int(groups[gi])
            if got[gi] < self.count[g]:  # split: the rest becomes a new group with the same history
                self.root.append(self.root[g])
                self.first.append(self.first[g] + int(got[gi]))
                self.count.append(self.count[g] - int(got[gi]))
                self.count[g] = int(got[gi])
                G = len(self.root)
                if self.held.shape[0] < G:
                    self.held = np.concatenate([self.held, np.zeros_like(self.held)])
                    self.depth = np.concatenate([self.depth, np.zeros_like(self.depth)])
                self.held[G - 1] = self.held[g]
                self.depth[G - 1] = self.depth[g]
                if self.ready.shape[0] < G:
                    self.ready = np.concatenate([self.ready, np.zeros_like(self.ready)])
                self.ready[G - 1] = self.ready[g]
                if len(self.sets):
                    if self.inside.shape[1] < G:
                        self.inside = np.concatenate([self.inside, np.zeros_like(self.inside)], axis=1)
                    self.inside[:, G - 1] = self.inside[:, g]
            self.held[g, v] = True
            if len(self.sets):
                self.inside[self.sets_of[v], g] = True
            first = self.first[g]
            d = 0
            for e in np.flatnonzero(taken[gi]).tolist():
                c = int(taken[gi, e])
                u = int(holders[e])
                self.rows[v].append((self.root[g], u, first, c, level))
                first += c
                d = max(d, int(self.depth[g, u]) + 1)
            self.depth[g, v] = d


def _preference_masks(n: int, src: np.ndarray, by_dst: list[np.ndarray], prefer: dict[int, np.ndarray]) -> dict:
    """Per GPU, a (roots x links) mask of the (root, parent) pairs to try first."""
    out = {}
    for v, pairs in prefer.items():
        if not 0 <= v < n or pairs is None or not len(pairs):
            continue
        mask = np.zeros((n, len(src)), dtype=bool)
        pos = {int(src[e]): e for e in by_dst[v].tolist()}
        for r, u in np.asarray(pairs).reshape(-1, 2).tolist():
            e = pos.get(int(u))
            if e is not None and 0 <= r < n:
                mask[r, e] = True
        out[v] = mask
    return out


def _csr(n: int, src: np.ndarray, dst: np.ndarray, cap: np.ndarray) -> sp.csr_array:
    """A capacity matrix from edges without duplicates, built directly in CSR form."""
    order = np.argsort(src * n + dst, kind="stable")
    indptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.bincount(src, minlength=n), out=indptr[1:])
    data = np.asarray(cap, dtype=np.int64)[order]
    if data.size and data.max() > INF:
        raise SynthesisError("tree packing: capacities overflow int32")
    return sp.csr_array((data.astype(np.int32), dst[order].astype(np.int32), indptr), shape=(n, n))


def _edge_flows(flow: sp.csr_array, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Flow on the edges ``rows[i] -> cols[i]`` of a scipy max-flow result (edges must exist)."""
    f = flow.tocsr() if not isinstance(flow, sp.csr_array) else flow
    n = f.shape[0]
    r = np.repeat(np.arange(n), np.diff(f.indptr))
    keys = r.astype(np.int64) * n + f.indices
    order = np.argsort(keys, kind="stable")
    pos = np.searchsorted(keys[order], rows.astype(np.int64) * n + cols)
    return np.asarray(f.data)[order][pos].astype(np.int64)


def _bipartite(demand: np.ndarray, allowed: np.ndarray, icap: np.ndarray) -> np.ndarray:
    """Max-flow from groups (``demand``) to allowed in-links (capacity ``icap``); the flow per (group, link)."""
    m, d = allowed.shape
    ri, ei = np.nonzero(allowed)
    s, t = m + d, m + d + 1
    src = np.concatenate([np.full(m, s), ri, m + np.arange(d)])
    dst = np.concatenate([np.arange(m), m + ei, np.full(d, t)])
    demand = np.asarray(demand, dtype=np.int64)
    cap = np.concatenate([demand, demand[ri], np.asarray(icap, dtype=np.int64)])
    res = maximum_flow(_csr(m + d + 2, src, dst, cap), s, t)
    flow = np.zeros((m, d), dtype=np.int64)
    if len(ri) and res.flow_value:
        flow[ri, ei] = _edge_flows(res.flow, ri, m + ei)
    return flow


# ------------------------------------------------------------------ ForestColl
def forestcoll_pack(n: int, k: int, links: dict[tuple[int, int], int]) -> Packing:
    """ForestColl's tree generation: BFS growth, a max-flow test per candidate link.

    Each root starts with one tree of multiplicity ``k``; growing a tree ``i``
    by link ``(x, y)`` takes ``min(C_i, c(x,y), slack)`` of its copies, where
    ``slack`` is the ``x -> y`` max-flow in the network with a source per
    unfinished tree (joined to its vertices) fed from ``x`` minus what those
    trees need; the copies that do not fit become a new tree. Exact but one
    max-flow per candidate link: the fallback for small or unusual inputs.
    """
    cap = dict(links)
    succ = collections.defaultdict(list)
    for u, v in sorted(cap):
        succ[u].append(v)
    trees: list[list] = []  # [root, vertex set, edges, copies]
    queue = collections.deque([[r, {r}, [], k] for r in range(n)])
    tests = 0
    while queue:
        tree = queue.popleft()
        root, verts, edges, copies = tree
        bfs = collections.deque(sorted(verts))
        while bfs:
            x = bfs.popleft()
            for y in succ[x]:
                if y in verts or cap.get((x, y), 0) <= 0:
                    continue
                tests += 1
                slack = _tree_slack(n, cap, list(queue), x, y)
                take = min(tree[3], cap[(x, y)], slack)
                if take <= 0:
                    continue
                if take < tree[3]:
                    queue.append([root, set(verts), list(edges), tree[3] - take])
                    tree[3] = take
                edges.append((x, y))
                verts.add(y)
                cap[(x, y)] -= take
                bfs.append(y)
        if len(verts) != n:
            raise SynthesisError(f"tree packing: a tree of root {root} could not span all GPUs")
        trees.append(tree)
    key = np.zeros((n, n), dtype=np.int64)
    rows = [[] for _ in range(n)]
    offset = collections.defaultdict(int)
    for root, _verts, edges, copies in trees:
        first = offset[root]
        offset[root] += copies
        depth = {root: 0}
        for x, y in edges:
            depth[y] = depth[x] + 1
            rows[y].append((root, x, first, copies, depth[y]))
            key[root, y] = max(key[root, y], depth[y])
    pieces = [np.array(r, dtype=np.int64).reshape(-1, 5) for r in rows]
    return Packing(n=n, k=k, pieces=pieces, key=key, method="forestcoll-bfs", stats={"tests": tests})


def _tree_slack(n: int, cap: dict, others: list, x: int, y: int) -> int:
    src, dst, c = [], [], []
    for (a, b), units in cap.items():
        if units > 0:
            src.append(a)
            dst.append(b)
            c.append(units)
    need = 0
    for j, (_, verts, _, copies) in enumerate(others):
        s_j = n + j
        src.append(x)
        dst.append(s_j)
        c.append(copies)
        need += copies
        for v in verts:
            src.append(s_j)
            dst.append(v)
            c.append(INF)
    net = FlowNetwork(n + len(others), np.array(src), np.array(dst))
    return net.max_flow(np.array(c), x, y) - need


@dataclasses.dataclass(frozen=True)
class TreeGroups:
    """Chunk groups that follow given trees (warm start): group ``g`` holds chunks
    ``first[g] .. first[g]+count[g]-1`` of ``root[g]`` and orders the GPUs by ``depth[g]``;
    ``parent[g]`` is its previous parent of every GPU (-1 for the root)."""

    root: np.ndarray
    first: np.ndarray
    count: np.ndarray
    depth: np.ndarray
    parent: np.ndarray


def tree_groups(n: int, k: int, trees: list) -> TreeGroups:
    """Groups for ``k`` chunks per root from a previous schedule's ``info["trees"]``.

    Each previous tree keeps its share of its root's chunks (weights scaled
    from the old ``k`` to ``k``, largest remainders first; trees rounded to
    zero chunks are dropped).
    """
    roots, firsts, counts, depths, parents = [], [], [], [], []
    for r, per_root in enumerate(trees):
        weights = np.array([int(w) for w, _ in per_root], dtype=np.int64)
        exact = weights * k / max(int(weights.sum()), 1)
        share = np.floor(exact).astype(np.int64)
        for i in np.argsort(-(exact - share), kind="stable")[: k - int(share.sum())]:
            share[i] += 1
        first = 0
        for (_, edges), c in zip(per_root, share.tolist()):
            if c == 0:
                continue
            parent = np.full(n, -1, dtype=np.int64)
            for p, ch in edges:
                parent[int(ch)] = int(p)
            roots.append(r)
            firsts.append(first)
            counts.append(c)
            depths.append(_depths(parent, r))
            parents.append(parent)
            first += c
    return TreeGroups(
        np.array(roots, dtype=np.int64),
        np.array(firsts, dtype=np.int64),
        np.array(counts, dtype=np.int64),
        np.array(depths, dtype=np.int64).reshape(-1, n),
        np.array(parents, dtype=np.int64).reshape(-1, n),
    )


def _depths(parent: np.ndarray, root: int) -> np.ndarray:
    n = len(parent)
    if (np.delete(parent, root) < 0).any():
        raise SynthesisError(f"previous tree of root {root} does not span all GPUs")
    cur = parent.copy()
    cur[root] = root
    depth = (np.arange(n) != root).astype(np.int64)
    for _ in range(int(np.ceil(np.log2(max(n, 2)))) + 2):
        depth = depth + depth[cur]
        cur = cur[cur]
        if (cur == root).all():
            return depth
    raise SynthesisError(f"previous tree of root {root} has a cycle")


def order_pack(n: int, k: int, links: dict[tuple[int, int], int], groups: TreeGroups) -> Packing:
    """Packs ``k`` trees per root along given trees' orders (warm start).

    Group ``g`` reaches GPU ``v`` only from in-neighbours that come before
    ``v`` in its tree (``depth[g, u] < depth[g, v]``), its old parent first;
    so every chunk's route is an arborescence and the GPUs are independent:
    one max-flow (two with the old-parent stage) per GPU, no levels and no
    global checks. Where the topology changed so that a GPU receives only
    part of a group that way, the group splits: the GPU keeps the part it
    got, and for the rest it moves behind all its in-neighbours in that
    part's order; the GPUs that took that part from it are matched again.

    Raises:
        SynthesisError: if the repairs do not settle.
    """
    return _OrderPacker(n, k, links, groups).run()


class _OrderPacker:
    def __init__(self, n: int, k: int, links: dict[tuple[int, int], int], groups: TreeGroups):
        self.n, self.k = n, k
        self.src = np.array([u for u, _ in links], dtype=np.int64)
        dst = np.array([v for _, v in links], dtype=np.int64)
        self.cap = np.array(list(links.values()), dtype=np.int64)
        self.by_dst = [np.flatnonzero(dst == v) for v in range(n)]
        self.root = groups.root.tolist()
        self.first = groups.first.tolist()
        self.count = groups.count.tolist()
        self.depth = groups.depth.copy()
        self.parent = groups.parent.copy()
        self.sol: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(n)]  # v -> group -> [(parent, count)]
        self.users: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
        self.stats = {"node_matchings": 0, "preferred_units": 0, "levels": 0, "groups": len(self.root), "splits": 0}

    def run(self) -> Packing:
        n = self.n
        queue = collections.deque(range(n))
        queued = np.ones(n, dtype=bool)
        budget = n + max(n // 4, 32)  # repairs are local; a cascade means the old orders do not fit: give up
        visits = np.zeros(n, dtype=np.int64)
        while queue:
            budget -= 1
            if budget < 0:
                raise SynthesisError("tree packing: warm-start repairs did not settle")
            v = queue.popleft()
            queued[v] = False
            visits[v] += 1
            if visits[v] > 3:
                raise SynthesisError(f"tree packing: GPU {v} keeps moving in the previous trees' orders")
            for w in self._match(v):
                if not queued[w]:
                    queue.append(w)
                    queued[w] = True
        return self._packing()

    def _match(self, v: int) -> list[int]:
        """Matches GPU ``v``; returns the GPUs to match again."""
        edges = self.by_dst[v]
        holders = self.src[edges]
        gs = np.flatnonzero(np.asarray(self.root) != v)
        dep = self.depth[gs]
        allowed = dep[:, holders] < dep[:, v][:, None]
        old = (self.parent[gs, v][:, None] == holders[None, :]) & allowed
        need = np.asarray(self.count, dtype=np.int64)[gs]
        taken = np.zeros((len(gs), len(edges)), dtype=np.int64)
        preferred = 0
        # fast path: every group from its old parent, if those in-links still carry it all (no max-flow)
        has_old = old.any(axis=1)
        if has_old.all():
            col = old.argmax(axis=1)
            load = np.bincount(col, weights=need, minlength=len(edges))
            if (load <= self.cap[edges]).all():
                taken[np.arange(len(gs)), col] = need
                preferred = int(need.sum())
                self.stats["reused_nodes"] = self.stats.get("reused_nodes", 0) + 1
        for si, mask in enumerate((old, allowed)):
            if preferred == int(need.sum()):
                break
            want = need - taken.sum(axis=1)
            todo = (want > 0) & mask.any(axis=1)
            if not todo.any():
                continue
            self.stats["node_matchings"] += 1
            flow = _bipartite(want[todo], mask[todo], self.cap[edges] - taken.sum(axis=0))
            taken[np.flatnonzero(todo)] += flow
            if si == 0:
                preferred = int(flow.sum())
        self.stats["preferred_units"] += preferred
        for g, lst in self.sol[v].items():
            for u, _ in lst:
                self.users[(g, u)].discard(v)
        got = taken.sum(axis=1)
        short = got < need
        sol: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        gi, ei = np.nonzero(taken)
        for g, u, c in zip(gs[gi].tolist(), holders[ei].tolist(), taken[gi, ei].tolist()):
            sol[g].append((u, c))
            self.users[(g, u)].add(v)
        self.sol[v] = dict(sol)
        again: list[int] = [v] if short.any() else []
        for i in np.flatnonzero(short).tolist():
            g = int(gs[i])
            if got[i] == 0 and (self.depth[g, holders] < self.depth[g, v]).all():
                raise SynthesisError(f"tree packing: GPU {v} cannot take root {self.root[g]}'s chunks at all")
            again += self._split(g, int(got[i]), v, holders)
        return again

    def _split(self, g: int, keep: int, v: int, holders: np.ndarray) -> list[int]:
        """Splits group ``g`` after its first ``keep`` chunks; ``v`` goes behind its in-neighbours for the rest."""
        if keep == 0:
            h = g
        else:
            h = len(self.root)
            self.stats["splits"] += 1
            self.root.append(self.root[g])
            self.first.append(self.first[g] + keep)
            self.count.append(self.count[g] - keep)
            self.count[g] = keep
            if h >= self.depth.shape[0]:
                self.depth = np.concatenate([self.depth, np.zeros_like(self.depth)])
                self.parent = np.concatenate([self.parent, np.zeros_like(self.parent)])
            self.depth[h] = self.depth[g]
            self.parent[h] = self.parent[g]
            for w in range(self.n):  # every GPU's pieces of g split at the same chunk
                lst = self.sol[w].get(g)
                if not lst or w == v:
                    continue
                a, b, left = [], [], keep
                for u, c in lst:
                    if left >= c:
                        a.append((u, c))
                        left -= c
                    elif left > 0:
                        a.append((u, left))
                        b.append((u, c - left))
                        left = 0
                    else:
                        b.append((u, c))
                self.sol[w][g] = a
                self.sol[w][h] = b
                for u, _ in b:
                    self.users[(h, u)].add(w)
                for u in {u for u, _ in lst} - {u for u, _ in a}:
                    self.users[(g, u)].discard(w)
        self.depth[h, v] = int(self.depth[h, holders].max()) + 1
        self.stats["groups"] = len(self.root)
        return [w for w in self.users[(h, v)] if self.depth[h, w] <= self.depth[h, v]]

    def _packing(self) -> Packing:
        rows = []
        for v in range(self.n):
            out = []
            for g, lst in self.sol[v].items():
                off = self.first[g]
                for u, c in lst:
                    out.append((self.root[g], u, off, c, int(self.depth[g, v])))
                    off += c
            rows.append(np.array(out, dtype=np.int64).reshape(-1, 5))
        key = np.zeros((self.n, self.n), dtype=np.int64)
        G = len(self.root)
        np.maximum.at(key, np.asarray(self.root), self.depth[:G])
        return Packing(n=self.n, k=self.k, pieces=rows, key=key, method="warm-order", stats=self.stats)


def _globally_tight(n: int, k: int, links: dict[tuple[int, int], int]) -> bool:
    """Whether many GPUs receive exactly what they need (then only the checked matching gets through)."""
    incap = np.zeros(n, dtype=np.int64)
    for (_, v), c in links.items():
        incap[v] += c
    return int((incap <= k * (n - 1)).sum()) > max(1, n // 8)


def pack(
    n: int,
    k: int,
    links: dict[tuple[int, int], int],
    *,
    prefer: dict[int, np.ndarray] | None = None,
    previous_trees: list | None = None,
    exhaustive: bool = True,
) -> Packing:
    """Packs trees: along a previous schedule's trees if that works, else level by level, else by ForestColl's BFS.

    ``previous_trees`` given: only :func:`order_pack` is tried, and
    ``exhaustive=False`` stops there (raising ``SynthesisError``). Then the
    unchecked level-by-level matching (skipped when most GPUs are exactly
    tight, where it would run into a dead end), the checked matching, and
    ForestColl's BFS as the last resort.
    """
    if previous_trees is not None:
        groups = tree_groups(n, k, previous_trees)
        try:
            return order_pack(n, k, links, groups)
        except SynthesisError:
            pass
        if not exhaustive:
            raise SynthesisError("tree packing: the previous trees do not extend to this topology")
    if not _globally_tight(n, k, links):
        try:  # no per-visit max-flow: valid whenever it completes
            return match_pack(n, k, links, prefer=prefer, check="local")
        except SynthesisError:
            if not exhaustive:
                raise
    try:
        return match_pack(n, k, links, prefer=prefer)
    except SynthesisError:
        return forestcoll_pack(n, k, links)
