"""ForestColl-warm (MCCL Sec. 4.3): keep the previous trees where they still fit, re-grow only what they lost.

MCCL guides the new tree generation by the previous arborescences so that
their links are tried first and "links from prior optimal trees remain
valid". Here that is done in two steps:

1. **Keep.** The previous trees are rescaled to the new ``k`` (each keeps
   its share of its root's chunks, :func:`~jaxccl.synth.allgather.packing.tree_groups`)
   and laid on the new logical topology all at once (one ``bincount`` of
   their chunks per logical link). Only the links they now overload need
   work: on such a link ``u -> v`` the fewest, smallest pieces are cut, each
   cut detaching ``v``'s subtree of that tree for the chunks that do not fit
   (a tree splits in two chunk ranges when only part of it has to go).
   Everything else -- typically all trees that do not cross a changed link
   -- is kept as it was, and the capacity it uses is booked. A kept tree
   that enters a tracked set of GPUs (those around a switch) twice wastes
   that set's in-capacity; where the set then lacks what the detached
   parts need (Edmonds' condition, :func:`set_slacks`), the repeated
   entries are cut too.
2. **Re-grow.** The detached subtrees are re-attached by the level-by-level
   matching of :func:`~jaxccl.synth.allgather.packing.match_pack`, started
   from the partial trees on the capacity left over, with every GPU's
   previous parents offered first (the A*-style ordering of candidate
   links). It tracks the slack of the sets above and verifies the visits
   of GPUs where slack is scarce by max-flow (Edmonds' condition), the
   others not at all. Its pieces come after every kept piece, so the
   result is again a set of arborescences in a valid issue order.

A complete result is exact whatever was kept (``k`` trees per root within
the link capacities), so it certifies the rate like any other packing. The
re-grown part can run into a dead end when what was kept blocks it; the
caller then widens the repair (:func:`repair_pack` with ``widen=True``
detaches every touched tree below its root) or solves cold.

Deviation from MCCL: MCCL re-runs ForestColl's BFS over all trees with the
previous links first; this keeps untouched trees without visiting them at
all, and only the detached parts are searched (by matchings instead of
ForestColl's per-edge max-flow tests, as in the cold path).
"""

from __future__ import annotations

import numpy as np

from jaxccl.errors import SynthesisError
from jaxccl.synth.allgather.packing import Packing, PartialForest, TreeGroups, match_pack


class _Forest:
    """Growable arrays of chunk groups following the previous trees, with what each GPU still holds."""

    def __init__(self, groups: TreeGroups, n: int):
        self.n = n
        self.size = len(groups.root)
        cap = max(2 * self.size, 8)
        self.root = _grow(groups.root, cap)
        self.first = _grow(groups.first, cap)
        self.count = _grow(groups.count, cap)
        self.parent = _grow(groups.parent.reshape(-1, n), cap)
        self.depth = _grow(groups.depth.reshape(-1, n), cap)
        self.held = _grow(np.ones((self.size, n), dtype=bool), cap)

    def split(self, g: int, c: int) -> int:
        """Splits the last ``c`` chunks of group ``g`` off into a new group; returns its index."""
        if self.size == len(self.root):
            cap = 2 * self.size
            for name in ("root", "first", "count", "parent", "depth", "held"):
                setattr(self, name, _grow(getattr(self, name), cap))
        h = self.size
        self.size += 1
        self.count[g] -= c
        self.root[h] = self.root[g]
        self.first[h] = self.first[g] + self.count[g]
        self.count[h] = c
        self.parent[h] = self.parent[g]
        self.depth[h] = self.depth[g]
        self.held[h] = self.held[g]
        return h


def _grow(a: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows,) + a.shape[1:], dtype=a.dtype)
    out[: len(a)] = a
    return out


def below(parent: np.ndarray, roots: np.ndarray, v: int) -> np.ndarray:
    """Per tree (row of ``parent``, ``-1`` at its root), the mask of ``v`` and its descendants.

    >>> below(np.array([[-1, 0, 1, 0]]), np.array([0]), 1).tolist()
    [[False, True, True, False]]
    """
    rows = np.arange(len(parent))
    anc = parent.copy()
    anc[rows, roots] = roots
    hit = np.zeros(parent.shape, dtype=bool)
    hit[:, v] = True
    for _ in range(parent.shape[1]):  # pointer jumping: about log2(depth) rounds
        if (anc == roots[:, None]).all():
            break
        hit |= np.take_along_axis(hit, anc, axis=1)
        anc = np.take_along_axis(anc, anc, axis=1)
    hit |= np.take_along_axis(hit, anc, axis=1)
    return hit


def repair_pack(
    n: int,
    k: int,
    links: dict[tuple[int, int], int],
    groups: TreeGroups,
    *,
    sets: list[np.ndarray] | None = None,
    check: str = "local",
    widen: bool = False,
    max_checks: int | None = None,
    regrow: bool = True,
    scarce: bool = True,
) -> Packing:
    """Packs ``k`` trees per root by keeping ``groups`` (previous trees) where they fit and re-growing the rest.

    Args:
        n: GPUs.
        k: trees per root.
        links: logical link -> capacity in trees.
        groups: the previous trees at ``k`` (:func:`~jaxccl.synth.allgather.packing.tree_groups`).
        sets: GPU sets likely to be tight (tracked by the re-growing matching).
        check: the matching's check, ``"local"`` or ``"full"`` (see
            :func:`~jaxccl.synth.allgather.packing.match_pack`).
        widen: detach every tree touched by an overloaded link below its
            root (keeps less, re-grows more; for when the tight repair fails).
        max_checks: give up after this many max-flow checks of the re-growing matching.
        regrow: with False, raise instead of re-growing (keep-only: the previous trees fit as they are).
        scarce: with ``check="local"``, verify the visits of GPUs whose tracked sets have little slack left
            (False: no max-flow check at all; faster, but more likely to run into a dead end).

    Raises:
        SynthesisError: if the detached parts cannot be re-grown.
    """
    f = _Forest(groups, n)
    cap = np.zeros(n * n, dtype=np.int64)
    if links:
        keys = np.fromiter((u * n + v for u, v in links), dtype=np.int64, count=len(links))
        cap[keys] = np.fromiter(links.values(), dtype=np.int64, count=len(links))
    G = f.size
    child = f.parent[:G] >= 0
    gi, vi = np.nonzero(child)
    load = np.bincount(f.parent[gi, vi] * n + vi, weights=f.count[gi], minlength=n * n).astype(np.int64)
    over = np.flatnonzero(load > cap)
    stats = {"overloaded_links": len(over), "cut_pieces": 0, "cut_units": 0, "splits": 0}
    for e in over[np.argsort(cap[over] - load[over], kind="stable")].tolist():  # largest excess first
        excess = int(load[e] - cap[e])
        if excess <= 0:
            continue
        u, v = divmod(e, n)
        G = f.size
        users = np.flatnonzero(f.held[:G, v] & (f.parent[:G, v] == u))
        if widen:
            sub = np.ones((len(users), n), dtype=bool)
            sub[np.arange(len(users)), f.root[users]] = False
        else:
            sub = below(f.parent[users], f.root[users], v)
        sub &= f.held[users]
        partial = ~f.held[users].all(axis=1)
        # cheapest cuts first: small detached subtrees, trees already cut, whole groups (no split)
        order = np.lexsort((-f.count[users], ~partial, sub.sum(axis=1)))
        for i in order.tolist():
            if excess <= 0:
                break
            g = int(users[i])
            if not f.held[g, v]:  # detached by an earlier cut of this loop (widen)
                continue
            c = min(int(f.count[g]), excess)
            _detach(f, g, c, sub[i], load, stats)
            excess -= c
        if excess > 0:  # pragma: no cover - the users carry all of the link's load
            raise SynthesisError(f"tree repair: link {u}->{v} stays overloaded by {excess} chunks")
    if sets:
        _free_tight_sets(f, n, cap, load, sets, stats)
    G = f.size
    kept = f.held[:G] & (f.parent[:G] >= 0)
    gi, vi = np.nonzero(kept)
    kept_rows = np.column_stack([f.root[gi], f.parent[gi, vi], f.first[gi], f.count[gi], f.depth[gi, vi]])
    kept_child = vi
    stats["kept_units"] = int(f.count[gi].sum())
    stats["preferred_units"] = stats["kept_units"]
    part = np.flatnonzero(~f.held[:G].all(axis=1))
    new_rows = np.zeros((0, 5), dtype=np.int64)
    new_child = np.zeros(0, dtype=np.int64)
    stats["repaired_groups"] = len(part)
    stats["groups"] = G
    if len(part) and not regrow:
        raise SynthesisError(f"tree repair: {len(part)} groups would have to be re-grown")
    if len(part):
        left = cap - load
        pos = np.flatnonzero(left > 0)
        residual = dict(zip(zip((pos // n).tolist(), (pos % n).tolist()), left[pos].tolist()))
        level0 = int(f.depth[gi, vi].max()) if len(gi) else 0
        start = PartialForest(f.root[part], f.first[part], f.count[part], f.held[part], f.depth[part], level0)
        # previous parents first (MCCL's history-guided ordering of candidate links)
        pg, pv = np.nonzero(~f.held[part] & (f.parent[part] >= 0))
        prefer: dict[int, np.ndarray] = {}
        if len(pv):
            rows = np.column_stack([f.root[part][pg], f.parent[part][pg, pv]])
            order = np.argsort(pv, kind="stable")
            cuts = np.flatnonzero(np.diff(pv[order])) + 1
            for idx in np.split(order, cuts):
                prefer[int(pv[idx[0]])] = rows[idx]
        verify = None
        if sets:
            # only sets some partial group has yet to enter can run short (the others hold every group already)
            sets = [x for x, need in zip(sets, _outside_need(f, _members(sets, n)).tolist()) if need > 0]
        if check == "local" and sets and scarce:
            verify = _scarce(f, n, sets, left)
            stats["verified_gpus"] = int(verify.sum())
        grown = match_pack(
            n, k, residual, prefer=prefer, check=check, sets=sets, start=start, verify=verify, max_checks=max_checks
        )
        for key in ("node_matchings", "checks", "rejected"):
            stats[key] = grown.stats.get(key, 0)
        stats["levels"] = grown.stats.get("levels", 0)
        stats["preferred_units"] += grown.stats.get("preferred_units", 0)
        new_child = np.concatenate([np.full(len(p), v, dtype=np.int64) for v, p in enumerate(grown.pieces)])
        new_rows = np.concatenate(grown.pieces).reshape(-1, 5)
    rows = np.concatenate([kept_rows.reshape(-1, 5), new_rows]).astype(np.int64)
    child_of = np.concatenate([kept_child, new_child]).astype(np.int64)
    order = np.argsort(child_of, kind="stable")
    bounds = np.searchsorted(child_of[order], np.arange(n + 1))
    pieces = [rows[order[bounds[v] : bounds[v + 1]]] for v in range(n)]
    key = np.zeros((n, n), dtype=np.int64)
    np.maximum.at(key, (rows[:, 0], child_of), rows[:, 4])
    return Packing(n=n, k=k, pieces=pieces, key=key, method="warm-repair", stats=stats)


def _detach(f: _Forest, g: int, c: int, sub: np.ndarray, load: np.ndarray, stats: dict) -> int:
    """Detaches the GPUs ``sub`` from ``c`` chunks of group ``g`` (splitting it if ``c`` is less); returns the group."""
    n = f.n
    h = g
    if c < f.count[g]:
        h = f.split(g, c)
        stats["splits"] += 1
    det = np.flatnonzero(sub & f.held[h])
    load[f.parent[h, det] * n + det] -= c
    f.held[h, det] = False
    stats["cut_pieces"] += 1
    stats["cut_units"] += c * len(det)
    return h


def set_slacks(f: _Forest, member: np.ndarray, left: np.ndarray, *, clip: bool = True) -> np.ndarray:
    """Per tracked set ``S`` (rows of ``member``): capacity left into ``S`` that its GPUs can still use, minus
    the chunks of the groups nobody in ``S`` holds (Edmonds' condition for completing the partial trees).

    ``clip=False`` counts all the capacity left into ``S``, usable or not (a measure of how tight ``S`` is).
    """
    n = f.n
    G = f.size
    held = f.held[:G]
    missing = (~held * f.count[:G, None]).sum(axis=0)
    m = member.astype(np.float64)  # float matrix products are exact here (integers far below 2**53) and fast
    into = np.rint((1 - m) @ left.reshape(n, n).astype(np.float64)).astype(np.int64)  # from outside S into w
    usable = (member * (np.minimum(into, missing[None, :]) if clip else into)).sum(axis=1)
    return usable - _outside_need(f, member)


def _outside_need(f: _Forest, member: np.ndarray) -> np.ndarray:
    """Per set: the chunks of the groups no member holds."""
    G = f.size
    inside = (member.astype(np.float64) @ f.held[:G].T.astype(np.float64)) > 0.5
    return np.rint((~inside).astype(np.float64) @ f.count[:G].astype(np.float64)).astype(np.int64)


def _free_tight_sets(f: _Forest, n: int, cap: np.ndarray, load: np.ndarray, sets: list, stats: dict) -> None:
    """Detaches kept pieces that enter a tracked set a second time when that set lacks the capacity to finish.

    A tree may enter a set of GPUs more than once (a chunk crosses the cut twice); the previous topology could
    afford that, a degraded one may not (e.g. the host whose NIC weakened: its in-cut becomes critical). Such
    repeated entries are cut (their subtrees then re-grow from inside the set) until every tracked set's slack
    is non-negative.
    """
    member = _members(sets, n)
    for _ in range(len(sets) + 1):
        slack = set_slacks(f, member, cap - load)
        bad = np.flatnonzero(slack < 0)
        if not len(bad):
            return
        stats["tight_sets"] = stats.get("tight_sets", 0) + len(bad)
        progress = False
        for i in bad[np.argsort(slack[bad], kind="stable")].tolist():
            deficit = -int(set_slacks(f, member[i : i + 1], cap - load)[0])
            inside = member[i]
            G = f.size
            par = f.parent[:G]
            held = f.held[:G]
            entry = held & (par >= 0) & inside[None, :] & ~inside[np.maximum(par, 0)]
            # entries beyond the first (all of them if the root is inside) waste the set's in-capacity
            order = np.cumsum(entry, axis=1) - entry + inside[f.root[:G]][:, None]
            gi, wi = np.nonzero(entry & (order >= 1))
            for g, w in zip(gi.tolist(), wi.tolist()):
                if deficit <= 0:
                    break
                if not f.held[g, w]:
                    continue
                c = min(int(f.count[g]), deficit)
                sub = below(f.parent[g : g + 1], f.root[g : g + 1], w)[0]
                _detach(f, g, c, sub, load, stats)
                deficit -= c
                progress = True
        if not progress:
            raise SynthesisError("tree repair: a tracked set of GPUs lacks the capacity to finish the trees")


SCARCE = 1 / 8  # a set whose slack is below this share of what it still needs gets checked visits


def _scarce(f: _Forest, n: int, sets: list, left: np.ndarray) -> np.ndarray:
    """GPUs in a tracked set, or alone, with little slack for the chunks still missing: their visits are checked."""
    member = np.zeros((len(sets) + n, n), dtype=bool)
    for i, x in enumerate(sets):
        member[i, np.asarray(x, dtype=np.int64)] = True
    member[len(sets) + np.arange(n), np.arange(n)] = True
    need = _outside_need(f, member)
    slack = set_slacks(f, member, left, clip=False)
    tight = (need > 0) & (slack < SCARCE * need)
    return member[tight].any(axis=0)


def _members(sets: list, n: int) -> np.ndarray:
    member = np.zeros((len(sets), n), dtype=bool)
    for i, x in enumerate(sets):
        member[i, np.asarray(x, dtype=np.int64)] = True
    return member
