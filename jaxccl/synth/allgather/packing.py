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

Strategies, cheapest first (:func:`pack`; warm starts keep and repair the
previous trees instead, :mod:`jaxccl.synth.allgather.repair`, and use
:func:`match_pack` from the partial trees):

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
from jaxccl.synth.allgather.flow import INF, FlowNetwork, small_bipartite_flow
from jaxccl.util.options import choose


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

    def _memo(self, name: str, make):
        """``make()``, computed once per packing (its pieces do not change) and returned read-only."""
        cached = self.__dict__.get(name)
        if cached is None:
            cached = make()
            for a in cached if isinstance(cached, tuple) else (cached,):
                a.flags.writeable = False
            self.__dict__[name] = cached
        return cached

    def all_pieces(self) -> np.ndarray:
        """Rows ``(root, parent, child, first, count, level)`` of every piece (read-only)."""
        return self._memo("_all_pieces", self._all_pieces)

    def _all_pieces(self) -> np.ndarray:
        counts = [len(p) for p in self.pieces]
        if not sum(counts):
            return np.zeros((0, 6), dtype=np.int64)
        rows = np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1, 5) for p in self.pieces])
        child = np.repeat(np.arange(len(self.pieces), dtype=np.int64), counts)
        return np.column_stack([rows[:, :2], child, rows[:, 2:]])

    def link_load(self) -> dict[tuple[int, int], int]:
        """Chunks per period on every logical link."""
        a = self.all_pieces()
        keys = a[:, 1] * self.n + a[:, 2]
        uniq, inverse = np.unique(keys, return_inverse=True)
        load = np.bincount(inverse.reshape(-1), weights=a[:, 4], minlength=len(uniq)).astype(np.int64)
        return dict(zip(zip((uniq // self.n).tolist(), (uniq % self.n).tolist()), load.tolist()))

    def tree_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The distinct arborescences as arrays ``(root, chunks, parent)``: tree ``t`` of root ``root[t]`` carries
        ``chunks[t]`` consecutive chunks (trees of a root in chunk order) and gives every GPU its parent
        ``parent[t]`` (``-1`` at the root). Read-only.

        Raises:
            SynthesisError: if the pieces do not form ``k`` spanning arborescences per root.
        """
        return self._memo("_tree_arrays", self._tree_arrays)

    def _tree_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n, k = self.n, self.k
        a = self.all_pieces()
        span = k + 1
        at = a[:, 0] * span + a[:, 3]
        bounds = np.unique(np.concatenate([at, np.arange(n) * span, np.arange(n) * span + k]))
        b_root, b_at = bounds // span, bounds % span
        lo = np.flatnonzero(b_root[:-1] == b_root[1:])  # a tree starts at every boundary but a root's last
        tree_of = np.full(len(bounds), -1, dtype=np.int64)
        tree_of[lo] = np.arange(len(lo))
        s = np.searchsorted(bounds, at)
        covers = np.searchsorted(bounds, at + a[:, 4]) - s  # trees a piece belongs to
        piece = np.repeat(np.arange(len(a)), covers)
        offset = np.arange(len(piece)) - np.repeat(np.cumsum(covers) - covers, covers)
        tree = tree_of[s[piece] + offset]
        if (tree < 0).any() or (np.bincount(tree, minlength=len(lo)) != n - 1).any():
            raise SynthesisError("tree packing: the pieces do not form spanning trees")
        parent = np.full((len(lo), n), -1, dtype=np.int64)
        parent[tree, a[piece, 2]] = a[piece, 1]
        return b_root[lo], b_at[lo + 1] - b_at[lo], parent

    def max_depth(self) -> int:
        """The largest number of hops from a root to a GPU over all trees."""
        if "_max_depth" not in self.__dict__:
            roots, _, parent = self.tree_arrays()
            self.__dict__["_max_depth"] = int(_all_depths(parent, roots).max()) if len(roots) else 0
        return self.__dict__["_max_depth"]

    def trees(self) -> list[list[tuple[int, list[tuple[int, int]]]]]:
        """Per root, its distinct arborescences: ``(chunks, [(parent, child), ...])``, children ascending."""
        return [[(w, [(p, c) for p, c in edges]) for w, edges in per_root] for per_root in tree_lists(self)]


def tree_lists(packing: Packing) -> list[list[list]]:
    """:meth:`Packing.trees` as plain lists, ``[[chunks, [[parent, child], ...]], ...]`` per root (JSON-ready)."""
    roots, weights, parent = packing.tree_arrays()
    n = packing.n
    out: list[list[list]] = [[] for _ in range(n)]
    if not len(roots):
        return out
    # every tree's (parent, child) pairs at once, the root's own entry dropped: one conversion to lists
    keep = np.arange(n)[None, :] != roots[:, None]
    children = np.broadcast_to(np.arange(n), parent.shape)[keep].reshape(len(roots), n - 1)
    pairs = np.stack([parent[keep].reshape(len(roots), n - 1), children], axis=2).tolist()
    for r, w, edges in zip(roots.tolist(), weights.tolist(), pairs):
        out[r].append([w, edges])
    return out


def match_pack(
    n: int,
    k: int,
    links: dict[tuple[int, int], int],
    *,
    prefer: dict[int, np.ndarray] | None = None,
    max_levels: int | None = None,
    check: str = "full",
    sets: list[np.ndarray] | None = None,
    start: PartialForest | None = None,
    verify: np.ndarray | None = None,
    max_checks: int | None = None,
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
        start: complete these partial groups instead of ``k`` chunks per
            root from scratch (warm-start repair); ``links`` are then the
            capacities left by what the groups already hold, and the result
            holds only the new pieces (levels above ``start.level0``).
        verify: with ``check="local"``, GPUs (a boolean mask) whose visits
            are verified all the same (where slack is scarce).
        max_checks: give up (raise) after this many checks.

    Raises:
        SynthesisError: if a level makes no progress.
    """
    choose("check", check, ("full", "local"))
    m = _Matcher(n, k, links, prefer, check, sets or [], start)
    if verify is not None and check == "local":
        m.verify_at = np.asarray(verify, dtype=bool)
    m.max_checks = max_checks
    return m.run(n if max_levels is None else max_levels)


@dataclasses.dataclass(frozen=True)
class PartialForest:
    """Chunk groups that some GPUs already hold: the starting point of a repair.

    Group ``g`` is chunks ``first[g] .. first[g]+count[g]-1`` of ``root[g]``;
    ``held[g, v]`` says whether GPU ``v`` already has them (always true for
    the root), ``depth[g, v]`` how many hops they took to get there. Every
    piece that brought them has a level ``<= level0``.
    """

    root: np.ndarray
    first: np.ndarray
    count: np.ndarray
    held: np.ndarray
    depth: np.ndarray
    level0: int


_NEVER = np.iinfo(np.int64).max  # the score of a (group, link) pair that is not allowed


class _Matcher:
    """State of :func:`match_pack`: chunk groups, their holders, remaining link capacity."""

    def __init__(self, n: int, k: int, links: dict[tuple[int, int], int], prefer, check: str, sets: list, start=None):
        self.n, self.k = n, k
        self.verify = check == "full"
        self.verify_at = np.full(n, self.verify)
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
        if start is None:
            self.root = list(range(n))
            self.first = [0] * n
            self.count = [k] * n
            self.held = np.eye(n, dtype=bool)  # held[g, v]
            self.depth = np.zeros((n, n), dtype=np.int64)
            self.missing = np.full(n, k * (n - 1), dtype=np.int64)
            self.level0 = 0
        else:
            self.root = [int(x) for x in start.root]
            self.first = [int(x) for x in start.first]
            self.count = [int(x) for x in start.count]
            self.held = np.array(start.held, dtype=bool).reshape(-1, n)
            self.depth = np.array(start.depth, dtype=np.int64).reshape(-1, n)
            self.missing = (~self.held * np.asarray(self.count, dtype=np.int64)[:, None]).sum(axis=0)
            self.level0 = int(start.level0)
        self.rows: list[list[tuple]] = [[] for _ in range(n)]
        self.pref = _preference_masks(n, self.src, self.by_dst, prefer) if prefer else None
        self.stats = {"node_matchings": 0, "checks": 0, "rejected": 0, "levels": 0, "preferred_units": 0}
        self.stats["groups"] = len(self.root)
        # tracked sets: members and the links entering them
        self.sets = [np.asarray(x, dtype=np.int64) for x in sets if 1 < len(x) < n]
        member = np.zeros((len(self.sets), n), dtype=bool)
        for i, x in enumerate(self.sets):
            member[i, x] = True
        self.member = member
        self.enter = [np.flatnonzero(member[i, self.dst] & ~member[i, self.src]) for i in range(len(self.sets))]
        self.sets_of = [np.flatnonzero(member[:, v]) for v in range(n)]
        # inside[S, g]: some member of S holds group g
        self.inside = (member.astype(np.int32) @ self.held.T.astype(np.int32)) > 0
        self.max_checks: int | None = None
        # repairs match few groups at a time: a greedy assignment that provably reaches the maximum saves scipy's
        # overhead; the cold path keeps the max-flow matchings it was tuned with
        self.greedy = start is not None

    def _set_state(self, v: int, groups: np.ndarray, holders: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For the tracked sets holding ``v``: slacks, and per set which (group, link) pairs waste it.

        Returns ``(slacks, waste)``: ``slacks[i]`` of set ``i`` and a boolean
        ``(sets, groups, links)`` array, all sets at once.
        """
        ids = self.sets_of[v]
        if not len(ids):
            return np.zeros(0, dtype=np.int64), np.zeros((0, len(groups), len(holders)), dtype=bool)
        G = len(self.root)
        sizes = np.asarray(self.count, dtype=np.int64)
        inside = self.inside[ids, :G]
        # entering capacity is usable only up to what its head still misses
        ent = [self.enter[i] for i in ids.tolist()]
        row = np.repeat(np.arange(len(ids)), [len(e) for e in ent])
        ent = np.concatenate(ent)
        into = np.bincount(row * self.n + self.dst[ent], weights=self.remaining[ent], minlength=len(ids) * self.n)
        usable = np.minimum(into.reshape(len(ids), self.n), self.missing[None, :]).sum(axis=1).astype(np.int64)
        slacks = usable - (~inside * sizes[None, :G]).sum(axis=1)
        waste = inside[:, groups][:, :, None] & ~self.member[ids][:, holders][:, None, :]
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
        need = sum(self.count[g] for g in groups.tolist())
        penalty = 2 * waste[slacks < need].sum(axis=0, dtype=np.int64)
        for _ in range(8):
            taken = self._propose(v, groups, edges, allowed & ~banned, penalty)
            if not taken.any():
                return False
            over = (waste * taken[None]).sum(axis=(1, 2)) > slacks
            if over.any():  # a tracked set would be overdrawn: never waste it in this visit
                self.stats["rejected"] += 1
                banned |= waste[over].any(axis=0)
                continue
            cut = self._check(v, groups, edges, taken) if self.verify_at[v] else None
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
        gsize = np.array([self.count[g] for g in groups.tolist()], dtype=np.int64)
        never = _NEVER
        score = np.where(allowed, self.depth[groups][:, holders] + self.cls[edges][None, :] + penalty, never)
        best = score.min(axis=1, keepdims=True)
        stages = []
        preferred = False
        if self.pref is not None and v in self.pref:
            local = np.searchsorted(self.by_dst[v], edges)  # edges are a sorted subset of by_dst[v]
            pm = self.pref[v][[self.root[g] for g in groups.tolist()]][:, local] & allowed
            if pm.any():
                stages.append(pm)
                preferred = True
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
            flow = _bipartite(want[todo], mask[todo], self.remaining[edges] - taken.sum(axis=0), greedy=self.greedy)
            taken[np.flatnonzero(todo)] += flow
            if si == 0 and preferred:
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
        holders = self.src[edges].tolist()
        self.remaining[edges] -= taken.sum(axis=0)
        got_a = taken.sum(axis=1)
        self.missing[v] -= int(got_a.sum())
        got, group_of, taken_l = got_a.tolist(), groups.tolist(), taken.tolist()
        for gi in np.flatnonzero(got_a).tolist():
            g = group_of[gi]
            if got[gi] < self.count[g]:  # split: the rest becomes a new group with the same history
                self.root.append(self.root[g])
                self.first.append(self.first[g] + got[gi])
                self.count.append(self.count[g] - got[gi])
                self.count[g] = got[gi]
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
            first, root, rows, depth = self.first[g], self.root[g], self.rows[v], self.depth[g]
            d = 0
            for e, c in enumerate(taken_l[gi]):
                if c:
                    u = holders[e]
                    rows.append((root, u, first, c, level))
                    first += c
                    d = max(d, int(depth[u]) + 1)
            depth[v] = d


def _preference_masks(n: int, src: np.ndarray, by_dst: list[np.ndarray], prefer: dict[int, np.ndarray]) -> dict:
    """Per GPU ``v``, a (roots x in-links of ``v``) mask of the (root, parent) pairs to try first."""
    out = {}
    for v, pairs in prefer.items():
        if not 0 <= v < n or pairs is None or not len(pairs):
            continue
        edges = by_dst[v]
        mask = np.zeros((n, len(edges)), dtype=bool)
        pos = {int(u): i for i, u in enumerate(src[edges].tolist())}
        for r, u in np.asarray(pairs).reshape(-1, 2).tolist():
            i = pos.get(int(u))
            if i is not None and 0 <= r < n:
                mask[r, i] = True
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


def _bipartite(demand: np.ndarray, allowed: np.ndarray, icap: np.ndarray, *, greedy: bool = False) -> np.ndarray:
    """Max-flow from groups (``demand``) to allowed in-links (capacity ``icap``); the flow per (group, link).

    ``greedy=True`` uses :func:`~jaxccl.synth.allgather.flow.small_bipartite_flow` (the same flow value, another
    assignment).
    """
    if greedy:
        return small_bipartite_flow(demand, allowed, icap)
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


@dataclasses.dataclass(frozen=True)
class PreviousTrees:
    """A previous schedule's arborescences as arrays: tree ``t`` of root ``root[t]`` carries ``weight[t]``
    chunks (out of that root's total) and gives every GPU its parent ``parent[t]`` (``-1`` at the root)."""

    root: np.ndarray
    weight: np.ndarray
    parent: np.ndarray

    def hop_keys(self) -> np.ndarray:
        """Sorted unique ``(root * n + parent) * n + child`` of every tree edge."""
        n = self.parent.shape[1]
        t, c = np.nonzero(self.parent >= 0)
        return np.unique((self.root[t] * n + self.parent[t, c]) * n + c)


def parse_trees(n: int, trees: list) -> PreviousTrees:
    """Reads ``info["trees"]`` (per root: ``[[chunks, [[parent, child], ...]], ...]``) into :class:`PreviousTrees`.

    Raises:
        SynthesisError: if the list does not describe spanning arborescences of ``n`` GPUs.
    """
    if len(trees) != n:
        raise SynthesisError(f"previous trees are given for {len(trees)} roots, expected {n}")
    roots, weights, parents = [], [], []
    for r, per_root in enumerate(trees):
        for w, edges in per_root:
            e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
            if len(e) != n - 1 or e.min(initial=0) < 0 or e.max(initial=0) >= n:
                raise SynthesisError(f"a previous tree of root {r} does not span GPUs 0..{n - 1}")
            parent = np.full(n, -1, dtype=np.int64)
            parent[e[:, 1]] = e[:, 0]
            roots.append(r)
            weights.append(int(w))
            parents.append(parent)
    prev = PreviousTrees(
        np.array(roots, dtype=np.int64),
        np.array(weights, dtype=np.int64),
        np.array(parents, dtype=np.int64).reshape(-1, n),
    )
    _all_depths(prev.parent, prev.root)  # raises on a tree that misses a GPU or has a cycle
    return prev


def tree_groups(n: int, k: int, trees: list | PreviousTrees) -> TreeGroups:
    """Groups for ``k`` chunks per root from a previous schedule's trees (``info["trees"]`` or parsed).

    Each previous tree keeps its share of its root's chunks (weights scaled
    from the old ``k`` to ``k``, largest remainders first; trees rounded to
    zero chunks are dropped).
    """
    prev = trees if isinstance(trees, PreviousTrees) else parse_trees(n, trees)
    share = np.zeros(len(prev.root), dtype=np.int64)
    bounds = np.searchsorted(prev.root, np.arange(n + 1))
    for r in range(n):
        lo, hi = bounds[r], bounds[r + 1]
        weights = prev.weight[lo:hi]
        exact = weights * k / max(int(weights.sum()), 1)
        sh = np.floor(exact).astype(np.int64)
        for i in np.argsort(-(exact - sh), kind="stable")[: k - int(sh.sum())]:
            sh[i] += 1
        share[lo:hi] = sh
    keep = share > 0
    root, count, parent = prev.root[keep], share[keep], prev.parent[keep]
    first = np.cumsum(count) - count
    first -= first[np.searchsorted(root, root)]  # restart at 0 for every root
    return TreeGroups(root, first, count, _all_depths(parent, root), parent)


def _all_depths(parent: np.ndarray, roots: np.ndarray) -> np.ndarray:
    """Depth of every GPU in every tree (rows of ``parent``); raises if a row is not an arborescence."""
    t, n = parent.shape
    rows = np.arange(t)
    cur = parent.copy()
    if ((cur < 0) & (np.arange(n)[None, :] != roots[:, None])).any():
        bad = int(roots[((cur < 0) & (np.arange(n)[None, :] != roots[:, None])).any(axis=1)][0])
        raise SynthesisError(f"previous tree of root {bad} does not span all GPUs")
    cur[rows, roots] = roots
    depth = (np.arange(n)[None, :] != roots[:, None]).astype(np.int64)
    for _ in range(int(np.ceil(np.log2(max(n, 2)))) + 2):
        depth = depth + np.take_along_axis(depth, cur, axis=1)
        cur = np.take_along_axis(cur, cur, axis=1)
        if (cur == roots[:, None]).all():
            return depth
    bad = int(roots[(cur != roots[:, None]).any(axis=1)][0])
    raise SynthesisError(f"previous tree of root {bad} has a cycle")


def globally_tight(n: int, k: int, links: dict[tuple[int, int], int]) -> bool:
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
) -> Packing:
    """Packs trees from scratch: level by level, else by ForestColl's BFS.

    The unchecked level-by-level matching first (skipped when most GPUs are
    exactly tight, where it would run into a dead end), then the checked
    matching, and ForestColl's BFS as the last resort. (Warm starts keep
    and repair previous trees instead: :func:`jaxccl.synth.allgather.repair.repair_pack`.)
    """
    if not globally_tight(n, k, links):
        try:  # no per-visit max-flow: valid whenever it completes
            return match_pack(n, k, links, prefer=prefer, check="local")
        except SynthesisError:
            pass
    try:
        return match_pack(n, k, links, prefer=prefer)
    except SynthesisError:
        return forestcoll_pack(n, k, links)
