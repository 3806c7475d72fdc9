"""Pricing: shortest-path trees on MCCL's time-expanded DAG, all sources in one sweep.

MCCL Sec. 4.2 prices each tensor ``c`` (all data of one source GPU) by a
shortest-path tree search on the time-expanded graph ``G~``: node ``v_i`` is
node ``v`` at step ``i`` (``0 <= i < m_s``); a link ``(u, v)`` into a switch
is instantaneous (``u_i -> v_i``), every other link advances one step
(``u_i -> v_{i+1}``); arc costs are the link duals ``alpha_a``. ``G~`` is
processed in topological order, i.e. step by step; a tree prices out when its
cost ``sum_a beta_a alpha_a`` (the sum of its source-to-destination path
costs) is below the tensor dual ``alpha_c``.

Here the steps are swept for every source at once: ``D[t][s, v]`` is the
cheapest cost of reaching ``v`` from source ``s`` within ``t`` advancing arcs.
Step ``t`` relaxes every advancing arc from step ``t-1`` (one vectorized
min-plus product per group of heads with the same in-degree) and then closes
the instantaneous arcs into switches inside step ``t``. Two equivalences with
the paper's graph, both exact, make this cheaper than materializing ``G~``:

* ``D[t]`` keeps the best value over steps ``<= t`` ("hold" entries). The
  paper's destinations exit to their super-sink at any step ``< m_s``, so the
  cheapest exit is the same; a held node is reconstructed at its earliest
  step, so paths keep the fewest steps among equal-cost ones (improvements
  must be strictly better than a tolerance).
* The sweep stops at the first step that improves nothing: every later step
  would be identical. With ``m_s = |V| - 1`` (the paper's setting) the
  step bound never binds for a simple path, so this is usually a handful of
  steps.

Deviation: the paper says ``G~`` is acyclic by construction; links between
two switches (ToR <-> aggregation) are instantaneous in both directions and
form cycles inside one step. The closure handles them (non-negative costs,
strict improvement), so nothing changes for topologies without such links.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxccl.errors import SynthesisError
from jaxccl.synth.alltoall.network import HeadGroup, Network
from jaxccl.util.options import choose

# Sources per sweep block: bounds the per-step predecessor arrays (steps x block x nodes).
_BLOCK_ENTRIES = 1 << 22
METHODS = ("dijkstra", "dag")
DEFAULT_METHOD = "dijkstra"


@dataclasses.dataclass(frozen=True)
class Trees:
    """Shortest-path trees of some sources.

    Attributes:
        sources: ``(S,)`` source GPUs.
        dist: ``(S, N)`` path cost from each source to each GPU (0 on the source).
        cost: ``(S,)`` tree cost, ``dist.sum(axis=1)``.
        paths: ``(S, N, L)`` arc indices of the path to each GPU, padded with -1
            (all -1 for the source itself), or ``None`` if not extracted.
        steps: number of sweep steps used (0 for ``method="dijkstra"``).
    """

    sources: np.ndarray
    dist: np.ndarray
    cost: np.ndarray
    paths: np.ndarray | None
    steps: int
    extracted: np.ndarray


def shortest_path_trees(
    net: Network,
    weights: np.ndarray,
    *,
    sources: np.ndarray | None = None,
    max_steps: int | None = None,
    extract: bool | np.ndarray = True,
    extract_below: np.ndarray | None = None,
    method: str | None = None,
) -> Trees:
    """Shortest-path trees from ``sources`` on the time-expanded DAG.

    Args:
        net: the flattened topology.
        weights: ``(A,)`` non-negative arc costs (the duals ``alpha_a``).
        sources: source GPUs (default: all).
        max_steps: ``m_s``; paths use at most ``m_s - 1`` advancing arcs.
            Default :attr:`Network.default_steps` (MCCL's ``|V| - 1``).
        extract: whether to reconstruct the paths; a boolean array selects the
            sources (rows of ``sources``) whose paths are wanted.
        extract_below: if given, ``(S,)`` thresholds: paths are reconstructed
            only for the sources whose tree cost is below theirs (the trees
            that price out), in the same sweep.
        method: ``"dag"`` (the step sweep above) or ``"dijkstra"``
            (:func:`scipy.sparse.csgraph.dijkstra`, see :func:`_dijkstra`).
            Default: ``"dijkstra"`` when the step bound cannot bind
            (``m_s >= N``), else ``"dag"``.

    Raises:
        SynthesisError: if some GPU is unreachable from a source within ``m_s`` steps.

    >>> from jaxccl.topology import ring
    >>> from jaxccl.synth.alltoall.network import build_network
    >>> net = build_network(ring(4))
    >>> t = shortest_path_trees(net, np.ones(net.num_arcs), sources=np.array([0]), method="dag")
    >>> t.dist[0].tolist(), t.steps
    ([0.0, 1.0, 2.0, 1.0], 2)
    """
    n = net.num_gpus
    src = np.arange(n) if sources is None else np.asarray(sources, dtype=np.int64)
    m_s = net.default_steps if max_steps is None else int(max_steps)
    if m_s < 1:
        raise SynthesisError(f"the step bound m_s must be >= 1, got {m_s}")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (net.num_arcs,) or not np.all(w >= 0):
        raise SynthesisError("pricing needs one non-negative weight per link")
    if extract is True or extract is False:
        want = np.full(src.size, bool(extract))
    else:
        want = np.asarray(extract, dtype=bool).copy()
    if method is None:
        method = DEFAULT_METHOD if m_s >= n else "dag"
    choose("method", method, METHODS)
    if method == "dijkstra":
        if m_s < n:
            raise SynthesisError(f"method='dijkstra' ignores the step bound; it needs m_s >= N = {n}, got {m_s}")
        return _dijkstra(net, w, src, want, extract_below)
    w_ext = np.append(w, 0.0)
    tol = 1e-9 * float(w.max()) if w.size and w.max() > 0 else 0.0
    block = max(1, min(src.size, _BLOCK_ENTRIES // max(1, net.num_nodes * 8)))
    dists, paths, steps = [], [], 0
    for lo in range(0, src.size, block):
        sl = slice(lo, lo + block)
        dist, preds = _sweep(net, w_ext, src[sl], m_s - 1, tol)
        steps = max(steps, preds.shape[0] - 1)
        bad = ~np.isfinite(dist[:, :n])
        if bad.any():
            s, d = np.argwhere(bad)[0]
            raise SynthesisError(
                f"no route from GPU {int(src[sl][s])} to GPU {int(d)} within m_s = {m_s} steps "
                "(the step bound is too small for this topology)"
            )
        dists.append(dist[:, :n])
        if extract_below is not None:
            want[sl] &= dist[:, :n].sum(axis=1) < extract_below[sl]
        if want[sl].any():
            paths.append(_extract(net, preds, src[sl], want[sl]))
        else:
            paths.append(None)
    dist = np.concatenate(dists)
    out_paths = None
    if want.any():
        width = max(p.shape[2] for p in paths if p is not None)
        out_paths = np.full((src.size, n, width), -1, dtype=np.int32)
        for lo, p in zip(range(0, src.size, block), paths):
            if p is not None:
                out_paths[lo : lo + p.shape[0], :, : p.shape[2]] = p
    return Trees(sources=src, dist=dist, cost=dist.sum(axis=1), paths=out_paths, steps=steps, extracted=want)


def _relax(d: np.ndarray, g: HeadGroup, tail: np.ndarray, w: np.ndarray, tol: float):
    """Best candidate per head of ``g`` from values ``d``: ``(best, arc, improved)``."""
    cand = d[:, tail[g.arcs]] + w[g.arcs]
    if g.arcs.shape[1] == 1:
        best = cand[:, :, 0]
        arc = np.broadcast_to(g.arcs[:, 0], best.shape)
    else:
        j = cand.argmin(axis=2)
        best = np.take_along_axis(cand, j[..., None], axis=2)[..., 0]
        arc = g.arcs[np.arange(g.heads.size)[None, :], j]
    improved = best < d[:, g.heads] - tol
    return best, arc, improved


def _closure(d: np.ndarray, pred: np.ndarray, net: Network, w: np.ndarray, tol: float) -> None:
    """Relaxes the instantaneous arcs (into switches) inside one step until nothing improves."""
    tail = net.tail_ext
    for _ in range(net.num_nodes + 1):
        changed = False
        for g in net.switch_groups:
            best, arc, imp = _relax(d, g, tail, w, tol)
            if imp.any():
                changed = True
                cols = g.heads
                d[:, cols] = np.where(imp, best, d[:, cols])
                pred[:, cols] = np.where(imp, arc, pred[:, cols])
        if not changed:
            return
    raise SynthesisError("pricing: switch closure did not converge (negative costs?)")  # pragma: no cover


def _sweep(net: Network, w: np.ndarray, src: np.ndarray, max_adv: int, tol: float):
    """Step-by-step DP; returns the final values ``(S, V+1)`` and predecessors ``(T, S, V)``.

    ``pred[t][s, v]`` is the arc that last improved ``v`` in step ``t``, or -1
    when ``v`` holds its step ``t-1`` value.
    """
    s_count, v_count = src.size, net.num_nodes
    pdtype = np.int16 if net.num_arcs < np.iinfo(np.int16).max else np.int32
    d = np.full((s_count, v_count + 1), np.inf)
    d[np.arange(s_count), src] = 0.0
    pred = np.full((s_count, v_count), -1, dtype=pdtype)
    _closure(d, pred, net, w, tol)
    preds = [pred]
    tail = net.tail_ext
    for _ in range(max_adv):
        nd = d.copy()
        pred = np.full((s_count, v_count), -1, dtype=pdtype)
        changed = False
        for g in net.gpu_groups:
            best, arc, imp = _relax(d, g, tail, w, tol)
            if imp.any():
                changed = True
                nd[:, g.heads] = np.where(imp, best, d[:, g.heads])
                pred[:, g.heads] = np.where(imp, arc, -1)
        if not changed:
            break
        _closure(nd, pred, net, w, tol)
        d = nd
        preds.append(pred)
    return d, np.stack(preds)


def _extract(net: Network, preds: np.ndarray, src: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Walks the predecessors back from every GPU; ``(S, N, L)`` arcs, -1 padded.

    Rows of unwanted sources stay -1.
    """
    n = net.num_gpus
    steps, s_count, _ = preds.shape
    rows = np.flatnonzero(want)
    s_idx = np.repeat(rows, n)
    dest = np.tile(np.arange(n), rows.size)
    node = dest.copy()
    layer = np.full(s_idx.size, steps - 1, dtype=np.int64)
    active = node != src[s_idx]
    length = np.zeros(s_idx.size, dtype=np.int64)
    rec_pair, rec_pos, rec_arc = [], [], []
    tail, adv = net.tail, net.advances
    for _ in range(steps * (net.num_nodes + 1) + 1):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        p = preds[layer[idx], s_idx[idx], node[idx]].astype(np.int64)
        hold = p < 0
        if hold.any():
            h = idx[hold]
            layer[h] -= 1
            if (layer[h] < 0).any():  # pragma: no cover - excluded by the reachability check
                raise SynthesisError("pricing: broken predecessor chain")
        a_idx, arcs = idx[~hold], p[~hold]
        rec_pair.append(a_idx)
        rec_pos.append(length[a_idx].copy())
        rec_arc.append(arcs)
        length[a_idx] += 1
        node[a_idx] = tail[arcs]
        layer[a_idx] -= adv[arcs]
        active[a_idx] = node[a_idx] != src[s_idx[a_idx]]
    width = int(length.max()) if length.size else 0
    out = np.full((s_count * n, max(width, 1)), -1, dtype=np.int32)
    if rec_pair:
        pair = np.concatenate(rec_pair)
        pos = np.concatenate(rec_pos)
        arc = np.concatenate(rec_arc)
        # Recorded from the destination backwards: position pos counts from the end.
        row = s_idx[pair] * n + dest[pair]
        out[row, length[pair] - 1 - pos] = arc
    return out.reshape(s_count, n, -1)


def _dijkstra(net: Network, w: np.ndarray, src: np.ndarray, want: np.ndarray, extract_below: np.ndarray | None):
    """The same trees with :func:`scipy.sparse.csgraph.dijkstra` (compiled), when ``m_s`` cannot bind.

    With ``m_s >= N`` every simple path fits in the time-expanded DAG (a path
    has at most ``N - 1`` advancing arcs), so the cheapest exit of ``G~`` is
    the plain shortest-path distance. Distances come from a run on the exact
    costs. The trees come from a second run on costs plus ``eps`` per
    advancing arc (``eps`` = 1e-12 of the largest cost over ``N``), which
    makes Dijkstra prefer the fewest steps among equal-cost paths, as the
    step sweep does; their cost exceeds the exact minimum by at most
    ``1e-12`` of the largest cost.
    """
    from scipy.sparse.csgraph import dijkstra

    n = net.num_gpus
    top = float(w.max()) if w.size else 0.0
    eps = 1e-12 * top / n if top > 0 else 1.0
    # csgraph drops nothing here, but keep every arc strictly positive so that no zero can be read as "no edge".
    tiny = np.finfo(np.float64).tiny
    exact = net.csr(w + tiny)
    dist = dijkstra(exact, indices=src)[:, :n]
    if not np.all(np.isfinite(dist)):
        s, d = np.argwhere(~np.isfinite(dist))[0]
        raise SynthesisError(f"no route from GPU {int(src[s])} to GPU {int(d)}")
    dist[np.arange(src.size), src] = 0.0
    cost = dist.sum(axis=1)
    if extract_below is not None:
        want = want & (cost < extract_below)
    paths = None
    if want.any():
        rows = np.flatnonzero(want)
        tilted = net.csr(w + eps * net.advances + tiny)
        _, pred = dijkstra(tilted, indices=src[rows], return_predecessors=True)
        paths = _walk(net, pred, src[rows], rows, src.size)
    return Trees(sources=src, dist=dist, cost=cost, paths=paths, steps=0, extracted=want)


def _walk(net: Network, pred: np.ndarray, roots: np.ndarray, rows: np.ndarray, total: int) -> np.ndarray:
    """Paths from Dijkstra predecessors: ``(total, N, L)`` arcs, rows ``rows`` filled, -1 padded."""
    n, k = net.num_gpus, rows.size
    arcs = _walk_pairs(net, pred, roots, np.repeat(np.arange(k), n), np.tile(np.arange(n), k), forward=True)
    out = np.full((total, n, arcs.shape[1]), -1, dtype=np.int32)
    out[rows] = arcs.reshape(k, n, -1)
    return out


def pair_paths(
    net: Network,
    weights: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    *,
    max_steps: int | None = None,
    extract: bool | np.ndarray = True,
    method: str | None = None,
    exact: bool = True,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Cheapest paths of the pairs ``(src[i], dst[i])`` only: ``(dist (P,), paths (P, L) or None)``.

    The pairs a warm start re-optimizes are few and share endpoints (every
    pair through one degraded link has that link's GPU at one end), so instead
    of a tree from every source this runs Dijkstra from a small set of
    endpoints covering all pairs: forward from chosen sources, on the
    reversed graph from chosen destinations (a greedy vertex cover of the
    pairs). Same distances and tie-breaking rule (fewest steps among equal
    costs) as :func:`shortest_path_trees`, which it falls back to for the
    ``"dag"`` method (the step bound can bind).

    Args:
        net: the flattened topology.
        weights: ``(A,)`` non-negative arc costs.
        src, dst: ``(P,)`` the pairs (``src != dst``).
        max_steps: ``m_s``; default :attr:`Network.default_steps`.
        extract: whether to return paths; a boolean array selects the pairs.
        method: as in :func:`shortest_path_trees`.
        exact: whether ``dist`` must be exact; if not (only the paths are
            wanted), it comes from the tie-breaking run and may exceed the
            exact distance by ``1e-12`` of the largest cost.

    >>> from jaxccl.topology import ring
    >>> from jaxccl.synth.alltoall.network import build_network
    >>> net = build_network(ring(5))
    >>> dist, paths = pair_paths(net, np.ones(net.num_arcs), np.array([0, 1]), np.array([2, 0]))
    >>> dist.tolist(), [net.node_path(p[p >= 0]) for p in paths]
    ([2.0, 1.0], [[0, 1, 2], [1, 0]])
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    n = net.num_gpus
    m_s = net.default_steps if max_steps is None else int(max_steps)
    want = np.full(src.size, bool(extract)) if extract is True or extract is False else np.asarray(extract, bool)
    if method is None:
        method = DEFAULT_METHOD if m_s >= n else "dag"
    if method != "dijkstra" or src.size == 0:
        sources, row = np.unique(src, return_inverse=True)
        trees = shortest_path_trees(
            net, weights, sources=sources, max_steps=m_s, extract=bool(want.any()), method=method
        )
        dist = trees.dist[row.ravel(), dst]
        paths = trees.paths[row.ravel(), dst] if want.any() else None
        return dist, paths
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (net.num_arcs,) or not np.all(w >= 0):
        raise SynthesisError("pricing needs one non-negative weight per link")
    by_src = _cover(src, dst)
    dist = np.empty(src.size)
    paths = None
    width, parts = 1, []
    for forward in (True, False):
        sel = np.flatnonzero(by_src == forward)
        if sel.size == 0:
            continue
        ends = src[sel] if forward else dst[sel]
        others = dst[sel] if forward else src[sel]
        roots, row = np.unique(ends, return_inverse=True)
        row = row.ravel()
        d, pred = _dijkstra_from(net, w, roots, forward, want[sel], exact)
        dist[sel] = d[row, others]
        if pred is not None:
            pick = np.flatnonzero(want[sel])
            arcs = _walk_pairs(net, pred, roots, row[pick], others[pick], forward)
            width = max(width, arcs.shape[1])
            parts.append((sel[pick], arcs))
    if want.any():
        paths = np.full((src.size, width), -1, dtype=np.int32)
        for rows, arcs in parts:
            paths[rows, : arcs.shape[1]] = arcs
    return dist, paths


def _cover(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """A greedy vertex cover of the pairs: True where pair ``i`` is served from its source, else its destination."""
    by_src = np.zeros(src.size, dtype=bool)
    rest = np.arange(src.size)
    while rest.size:
        cs, cd = np.bincount(src[rest]), np.bincount(dst[rest])
        if cs.max() >= cd.max():
            hit = src[rest] == int(cs.argmax())
            by_src[rest[hit]] = True
        else:
            hit = dst[rest] == int(cd.argmax())
        rest = rest[~hit]
    return by_src


def _dijkstra_from(net: Network, w: np.ndarray, roots: np.ndarray, forward: bool, want: np.ndarray, exact: bool = True):
    """Distances ``(R, N)`` from (forward) or to (reversed) ``roots``, and tilted predecessors if wanted."""
    from scipy.sparse.csgraph import dijkstra

    n = net.num_gpus
    top = float(w.max()) if w.size else 0.0
    eps = 1e-12 * top / n if top > 0 else 1.0
    tiny = np.finfo(np.float64).tiny
    pred = None
    if exact or not want.any():
        dist = dijkstra(net.csr(w + tiny, reverse=not forward), indices=roots)[:, :n]
    if want.any():
        tilted = net.csr(w + eps * net.advances + tiny, reverse=not forward)
        tilted_dist, pred = dijkstra(tilted, indices=roots, return_predecessors=True)
        if not (exact or not want.any()):
            dist = tilted_dist[:, :n]
    if not np.all(np.isfinite(dist)):
        r, d = np.argwhere(~np.isfinite(dist))[0]
        s, t = (roots[r], d) if forward else (d, roots[r])
        raise SynthesisError(f"no route from GPU {int(s)} to GPU {int(t)}")
    dist[np.arange(roots.size), roots] = 0.0
    return dist, pred


def _walk_pairs(
    net: Network, pred: np.ndarray, roots: np.ndarray, row: np.ndarray, others: np.ndarray, forward: bool
) -> np.ndarray:
    """``(P, L)`` arcs of the path between ``roots[row[i]]`` and ``others[i]`` from Dijkstra predecessors.

    Forward: the predecessor tree of the root (the source) is walked back from
    the destination. Reversed: the tree of the destination on the reversed
    graph gives every node its successor towards it, walked from the source.
    """
    v = net.num_nodes
    arcmat = net.arc_matrix
    p = row.size
    node = others.copy()
    target = roots[row]
    active = node != target
    rec_pair, rec_arc = [], []
    for _ in range(v + 1):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        nxt = pred[row[idx], node[idx]]
        if np.any(nxt < 0):  # pragma: no cover - excluded by the reachability check
            raise SynthesisError("pricing: broken predecessor chain")
        rec_pair.append(idx)
        rec_arc.append(arcmat[nxt, node[idx]] if forward else arcmat[node[idx], nxt])
        node[idx] = nxt
        active[idx] = nxt != target[idx]
    pair = np.concatenate(rec_pair) if rec_pair else np.zeros(0, dtype=np.int64)
    arc = np.concatenate(rec_arc) if rec_arc else np.zeros(0, dtype=np.int64)
    length = np.bincount(pair, minlength=p)
    order = np.argsort(pair, kind="stable")
    pair, arc = pair[order], arc[order]
    start = np.r_[0, np.cumsum(length)[:-1]]
    pos = np.arange(pair.size) - start[pair]
    width = max(int(length.max()) if length.size else 0, 1)
    out = np.full((p, width), -1, dtype=np.int32)
    # Forward walks go from the destination back to the source; reversed walks from the source onwards.
    out[pair, (length[pair] - 1 - pos) if forward else pos] = arc
    return out
