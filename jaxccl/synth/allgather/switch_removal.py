"""Phase 2 of ForestColl: switch removal by throughput-preserving edge splitting.

Each switch ``w`` is replaced by logical links between its neighbours:
``y_ut`` units of ``(u, w), (w, t)`` become ``u -> t``. A splitting is
admissible when it keeps the throughput condition of phase 1 -- every GPU
still receives ``N * k`` from the super source, ``k`` trees per root -- and
for a switch with equal ingress and egress capacity a complete admissible
splitting always exists (Bang-Jensen, Frank and Jackson; ForestColl relies
on it).

Two ways are implemented:

* :func:`remove_switches` (``method="forestcoll"``): every switch is split
  *proportionally*, ``y_ut ~ a_u * b_t`` with ``y_uu = 0`` (a
  Sinkhorn-balanced transportation plan rounded to integers by max-flow),
  and the whole result is verified with one max-flow per GPU. Deviation
  from ForestColl, which fills the pairs greedily in sorted order: the
  greedy order yields ring-like logical topologies (MCCL App. C) whose deep
  trees cost time both here and in phase 3; the proportional split is
  computed in bulk and spreads every switch's capacity, so it usually
  passes verification at once. On fabrics with a switch whose removal
  disconnects them (the aggregation layer of a multi-segment rail) the
  splitting is first done across that switch's sides, and elsewhere with the
  switch's own GPUs first (``_BULK_ATTEMPTS``; see :func:`switch_sides`):
  one check of ``N`` max-flows instead of the greedy's tens of thousands.
  If no bulk splitting passes, the switches are redone one
  at a time, each verified, falling back to :func:`greedy_split` --
  ForestColl's greedy with the maximum admissible amount per pair computed
  by max-flow -- for a switch whose proportional split breaks the condition.
* :mod:`jaxccl.synth.allgather.latency` (``method="latency"``): MCCL App. C's
  LP per switch with a star-inducing penalty.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components, maximum_flow, shortest_path

from jaxccl.errors import SynthesisError
from jaxccl.synth.allgather.flow import INF, FlowNetwork, RootedCheck, small_bipartite_flow
from jaxccl.synth.allgather.logical import Logical
from jaxccl.synth.allgather.network import Net, shape_cached


@dataclasses.dataclass
class SplitStats:
    """What switch removal did: max-flows, switches that needed the exact greedy, units dropped."""

    flows: int = 0
    greedy_switches: list = dataclasses.field(default_factory=list)
    dropped: int = 0
    lp_solves: int = 0
    cuts: int = 0
    choice: str = "proportional"  # which split the trees use (the latency method compares two)
    split: str = ""  # which proportional splitting passed: a bulk attempt (_BULK_ATTEMPTS) or "per-switch"
    certificate: str = "max-flow"  # what proves the rate optimal: the max-flow bound, or trees meeting a cut


def remove_switches(
    net: Net, caps: np.ndarray, k: int, *, stats: SplitStats | None = None, verify: bool = True
) -> Logical:
    """Removes every switch (forestcoll method); returns the logical GPU-to-GPU topology.

    Args:
        net: the topology.
        caps: per physical link, how many trees it carries (phase 1).
        k: trees per root.
        stats: filled with counters if given.
        verify: check the result with one max-flow per GPU (and repair it);
            without, the caller must prove it otherwise (a complete packing does).

    Raises:
        SynthesisError: if no admissible complete splitting is found (a switch
            with unequal ingress and egress capacity can cause this).
    """
    stats = stats if stats is not None else SplitStats()
    base = Logical(net, caps)
    order = list(range(net.num_gpus, net.num_nodes))
    plans: dict = {}  # switches with the same neighbourhood (symmetric topologies) share one transportation plan
    disconnecting = any(side is not None for side in switch_sides(net))
    for attempt in _BULK_ATTEMPTS if disconnecting else ("sorted",):
        logical = base.copy()
        stats.dropped = 0
        sides = switch_sides(net) if attempt != "sorted" else [None] * len(order)
        aligned = attempt == "aligned"
        for w in near_first_order(net) if attempt == "near-first" else order:
            stats.dropped += _split_proportional(logical, w, plans, sides[w - net.num_gpus], aligned=aligned)
        if not verify:
            return logical
        if _violation(logical, net, k, stats, nodes=net.num_gpus) is None:
            stats.split = attempt
            return logical
    # Redo one switch at a time, verifying each.
    stats.split = "per-switch"
    logical = base.copy()
    stats.dropped = 0
    for w in order:
        trial = logical.copy()
        dropped = _split_proportional(trial, w, plans)
        if _violation(trial, net, k, stats, nodes=None) is None:
            logical = trial
            stats.dropped += dropped
            continue
        stats.greedy_switches.append(net.names[w])
        greedy_split(logical, w, k, stats)
    bad = _violation(logical, net, k, stats, nodes=net.num_gpus)
    if bad is not None:  # pragma: no cover - guarded by the per-switch checks
        raise SynthesisError(f"switch removal lost throughput at GPU {bad[0]}")
    return logical


# Bulk splittings tried in turn, each verified once (the first that passes is kept; without verification, the
# first is used):
# - "aligned": switches in index order (on rails the aggregation switch first, its neighbours the ToRs); at a
#   switch whose removal disconnects the fabric, aligned neighbours across the sides (a ToR with the same rail's
#   ToRs in the other segments) first, then any across, then within the sides; at other switches pairs with one
#   of the switch's own GPUs first (a ToR does not relay between other segments) (:func:`_split_proportional`);
# - "near-first": the switches next to GPUs first, then the outer ones, whose neighbours are then GPUs; across
#   the sides of a disconnecting switch first (densely), then within;
# - "sorted": index order, the plain proportional plan everywhere (ForestColl's pairs, MCCL's proportions).
# Without a disconnecting switch (single-segment rails, fat trees with several spines) only "sorted" runs.
# Deviation from ForestColl: see :func:`switch_sides`.
_BULK_ATTEMPTS = ("aligned", "near-first", "sorted")


def near_first_order(net: Net) -> list[int]:
    """The switches by their hop distance from the nearest GPU (ties: index order).

    Splitting the switches next to GPUs first leaves the outer switches (aggregation, spines) with GPUs as
    neighbours, so their split makes direct GPU-to-GPU links across the fabric. Computed once per fabric.
    """
    return shape_cached(net, _near_first_order)


def _near_first_order(net: Net) -> list[int]:
    n = net.num_nodes
    adj = sp.csr_array((np.ones(len(net.src)), (net.src, net.dst)), shape=(n, n))
    adj = ((adj + adj.T) > 0).astype(np.float64)
    hops = shortest_path(adj, unweighted=True, indices=np.arange(net.num_gpus)).min(axis=0)
    switches = np.arange(net.num_gpus, n)
    return [int(w) for w in switches[np.lexsort((switches, hops[switches]))]]


def switch_sides(net: Net) -> list[np.ndarray | None]:
    """Per switch ``w``: the connected component of every node once ``w`` is gone; None unless two hold neighbours.

    Deviation from ForestColl (which splits any admissible pair): at a switch that disconnects the fabric, a
    pair ``(u, w), (w, t)`` with ``u`` and ``t`` on the same side only duplicates capacity that side already
    has, and spends the only way across (measured: it breaks the throughput condition on 2-segment rails);
    pairs across sides keep the crossing capacity. Physical links decide the sides; splitting switches keeps
    which nodes are connected, so they also hold for the logical graph. Computed once per fabric.
    """
    return shape_cached(net, _switch_sides)


def _switch_sides(net: Net) -> list[np.ndarray | None]:
    n = net.num_nodes
    out: list[np.ndarray | None] = []
    for w in range(net.num_gpus, n):
        keep = (net.src != w) & (net.dst != w)
        adj = sp.csr_array((np.ones(int(keep.sum())), (net.src[keep], net.dst[keep])), shape=(n, n))
        _, labels = connected_components(adj, directed=True, connection="weak")
        near = np.union1d(net.src[net.dst == w], net.dst[net.src == w])
        # w separates sides when at least two of them hold several of its neighbours (a GPU hanging on its
        # fat-tree leaf alone is a side too, but every pair with it crosses anyway: no preference to give)
        if (np.bincount(labels[near]) >= 2).sum() >= 2:
            labels.flags.writeable = False
            out.append(labels)
        else:
            out.append(None)
    return out


def _violation(logical: Logical, net: Net, k: int, stats: SplitStats, *, nodes: int | None):
    """The throughput condition on the current graph: first failing GPU or None."""
    src, dst, cap = logical.arrays(nodes)
    n = nodes if nodes is not None else net.num_nodes
    check = RootedCheck(n, net.num_gpus, src, dst)
    res = check.violation(cap, k, net.num_gpus * k)
    stats.flows += check.count
    return res


# ---------------------------------------------------------------- proportional
def _split_proportional(
    logical: Logical, w: int, plans: dict | None = None, sides: np.ndarray | None = None, *, aligned: bool = False
) -> int:
    """Splits switch ``w`` completely and proportionally; returns the units that had to be dropped.

    ``plans`` memoizes :func:`transport_plan` (a pure function) by its inputs. ``sides`` (from
    :func:`switch_sides`): pair neighbours on different sides first (``aligned``: those at the same position
    within their sides before any other, :func:`_aligned`), then split what is left within the sides; without
    ``sides``, ``aligned`` first pairs neighbours of which one is a GPU physically linked to ``w``.
    """
    preds, succs = logical.neighbors(w)
    if not preds or not succs:
        return logical.remove(w)
    pu = np.array([u for u, _ in preds])
    a = np.array([c for _, c in preds], dtype=np.int64)
    st = np.array([t for t, _ in succs])
    b = np.array([c for _, c in succs], dtype=np.int64)
    allowed = pu[:, None] != st[None, :]
    if sides is None and not aligned:
        y = _cached_plan(a, b, allowed, plans)
    elif sides is None:  # pairs with one of w's own GPUs first: w does not relay between the other neighbours
        net = logical.net
        own = np.union1d(
            net.src[(net.dst == w) & (net.src < net.num_gpus)], net.dst[(net.src == w) & (net.dst < net.num_gpus)]
        )
        mine = np.isin(pu, own)[:, None] | np.isin(st, own)[None, :]
        y = _staged_plan(a, b, (allowed & mine, allowed), plans)
    else:  # as much as possible between aligned neighbours across the sides, then across, then within them
        across = allowed & (sides[pu][:, None] != sides[st][None, :])
        stages = (across & _aligned(sides[pu], sides[st]), across, allowed) if aligned else (across, allowed)
        y = _staged_plan(a, b, stages, plans)
    for i, j in zip(*np.nonzero(y)):
        logical.split(int(pu[i]), w, int(st[j]), int(y[i, j]))
    return logical.remove(w)


def _staged_plan(a: np.ndarray, b: np.ndarray, stages: tuple, plans: dict | None) -> np.ndarray:
    """Transportation plans on growing patterns: each stage ships what the earlier ones left."""
    y = np.zeros(stages[-1].shape, dtype=np.int64)
    for stage in stages:
        rest_a, rest_b = a - y.sum(axis=1), b - y.sum(axis=0)
        if not (rest_a.any() and rest_b.any()):
            break
        y += _cached_plan(rest_a, rest_b, stage, plans)
    return y


def _aligned(row_sides: np.ndarray, col_sides: np.ndarray) -> np.ndarray:
    """Pairs at the same relative position within their sides (neighbours in node order).

    Node order follows the fabric's structure (switch names by segment and rail), so on rails this pairs a ToR
    with the same rail's ToRs in the other segments: a sparse crossing, each rail crossing on its own instead of
    every ToR to every ToR of the other sides, which keeps the trees few and shallow.
    """

    def spans(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = np.zeros(len(labels)), np.zeros(len(labels))
        for side in np.unique(labels):
            idx = np.flatnonzero(labels == side)
            lo[idx] = np.arange(len(idx)) / len(idx)
            hi[idx] = (np.arange(len(idx)) + 1) / len(idx)
        return lo, hi

    r_lo, r_hi = spans(row_sides)
    c_lo, c_hi = spans(col_sides)
    return (r_lo[:, None] < c_hi[None, :] - 1e-12) & (c_lo[None, :] < r_hi[:, None] - 1e-12)


_PLANS: collections.OrderedDict = collections.OrderedDict()
_PLANS_LOCK = threading.Lock()
PLAN_CACHE_SIZE = 4096  # transportation plans kept across calls (the last ones used)


def _cached_plan(a: np.ndarray, b: np.ndarray, allowed: np.ndarray, plans: dict | None) -> np.ndarray:
    """:func:`transport_plan` (read-only), memoized in ``plans`` by its inputs and across calls.

    A re-synthesis after one link changes meets the same plans at every switch the change does not reach,
    so they are kept process-wide (the last :data:`PLAN_CACHE_SIZE`; synthesizers may run in several threads).
    """
    key = (a.tobytes(), b.tobytes(), np.packbits(allowed).tobytes(), allowed.shape)
    y = None if plans is None else plans.get(key)
    if y is None:
        with _PLANS_LOCK:
            y = _PLANS.get(key)
            if y is not None:
                _PLANS.move_to_end(key)
    if y is None:
        y = transport_plan(a, b, allowed)
        y.flags.writeable = False
        with _PLANS_LOCK:
            _PLANS[key] = y
            while len(_PLANS) > PLAN_CACHE_SIZE:
                _PLANS.popitem(last=False)
    if plans is not None:
        plans[key] = y
    return y


def transport_plan(a: np.ndarray, b: np.ndarray, allowed: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
    """An integer matrix ``y >= 0`` on ``allowed`` entries with row sums ``<= a`` and column sums ``<= b``.

    Shipping as much as possible (``min(sum a, sum b)`` when the allowed
    pattern permits), proportionally to ``a_i * b_j`` (times ``weight``):
    Sinkhorn scaling gives the fractional plan, max-flow rounds it keeping
    the totals.

    >>> import numpy as np
    >>> transport_plan(np.array([3, 3, 3]), np.array([3, 3, 3]), ~np.eye(3, dtype=bool)).tolist()
    [[0, 2, 1], [1, 0, 2], [2, 1, 0]]
    """
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    kern = allowed.astype(np.float64) * (1.0 if weight is None else weight)
    total = min(int(a.sum()), int(b.sum()))
    af = a * (total / a.sum()) if a.sum() else a.astype(float)
    bf = b * (total / b.sum()) if b.sum() else b.astype(float)
    # what each row / column can ship at all through allowed entries
    for _ in range(2):
        af = np.minimum(af, kern.astype(bool) @ bf)
        bf = np.minimum(bf, kern.astype(bool).T @ af)
    alpha = np.ones(len(a))
    beta = np.ones(len(b))
    with np.errstate(all="ignore"):
        for _ in range(500):
            kb = kern @ beta
            alpha = np.where(kb > 0, af / np.where(kb > 0, kb, 1), 0.0)
            ka = kern.T @ alpha
            beta = np.where(ka > 0, bf / np.where(ka > 0, ka, 1), 0.0)
            if not (np.isfinite(alpha).all() and np.isfinite(beta).all()):
                alpha, beta = np.ones(len(a)), np.ones(len(b))
                break
            rows = alpha * (kern @ beta)
            if np.abs(rows - af).max() <= 1e-9 * max(total, 1):
                break
    frac = alpha[:, None] * kern * beta[None, :]
    y = np.floor(frac + 1e-9).astype(np.int64)
    # never exceed the marginals (Sinkhorn may not have converged)
    y = _clip_to_marginals(y, a, b)
    need_r = a - y.sum(axis=1)
    need_c = b - y.sum(axis=0)
    # round up fractional entries first, then anything allowed
    for stage in (0, 1):
        if need_r.sum() == 0 or need_c.sum() == 0:
            break
        cand = allowed & (frac - y > 1e-9) if stage == 0 else allowed
        add = _bipartite_flow(need_r, need_c, cand, 1 if stage == 0 else None)
        y += add
        need_r = a - y.sum(axis=1)
        need_c = b - y.sum(axis=0)
    return y


def _clip_to_marginals(y: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    y = y.copy()
    for _ in range(2):
        over = y.sum(axis=1) - a
        for i in np.flatnonzero(over > 0):
            _shave(y[i, :], int(over[i]))
        over = y.sum(axis=0) - b
        for j in np.flatnonzero(over > 0):
            _shave(y[:, j], int(over[j]))
    return y


def _shave(vec: np.ndarray, amount: int) -> None:
    for idx in np.argsort(-vec):
        if amount <= 0:
            break
        take = min(int(vec[idx]), amount)
        vec[idx] -= take
        amount -= take


SMALL_PLAN = 256  # entries up to which a plan is rounded in plain Python (scipy's per-call overhead dominates)


def _bipartite_flow(rows: np.ndarray, cols: np.ndarray, allowed: np.ndarray, unit: int | None) -> np.ndarray:
    """Max-flow from row supplies to column demands through ``allowed`` entries, each at most ``unit`` (or any)."""
    m, n = allowed.shape
    if m * n <= SMALL_PLAN:
        return small_bipartite_flow(rows, allowed, cols, None if unit is None else np.where(allowed, unit, 0))
    ii, jj = np.nonzero(allowed)
    s, t = m + n, m + n + 1
    src = np.concatenate([np.full(m, s), ii, m + np.arange(n)])
    dst = np.concatenate([np.arange(m), m + jj, np.full(n, t)])
    cap = np.concatenate([rows, np.full(len(ii), INF if unit is None else unit), cols])
    net = FlowNetwork(m + n + 2, src, dst)
    _, flow = net.flows(cap, s, t)
    out = np.zeros((m, n), dtype=np.int64)
    out[ii, jj] = flow[m : m + len(ii)]
    return out


# --------------------------------------------------------------- exact greedy
def greedy_split(logical: Logical, w: int, k: int, stats: SplitStats) -> None:
    """ForestColl's switch removal at ``w``: pairs in sorted order, each split by its maximum admissible amount.

    The admissible amount of ``(u, w), (w, t)`` is limited by the sets the
    split weakens -- those separating ``w`` from both ``u`` and ``t`` -- so it is
    the smaller slack of (F2) sets holding ``w`` but not ``u, t`` (one max-flow)
    and (F1) sets holding ``u, t`` but not ``w`` nor some GPU (one max-flow
    with ``w`` as the only forced sink; if its min cut holds every GPU, one
    max-flow per GPU).
    """
    net = logical.net
    n_gpus = net.num_gpus
    need = n_gpus * k
    preds, _ = logical.neighbors(w)
    for u, _ in preds:
        _, succs = logical.neighbors(w)
        for t, _ in succs:
            left = logical.cap.get((u, w), 0)
            if left <= 0:
                break
            bt = logical.cap.get((w, t), 0)
            if bt <= 0:
                continue
            amount = min(left, bt)
            amount = min(amount, _constrained_slack(logical, k, [w], [u, t], stats) - need)
            if amount > 0:
                amount = min(amount, _constrained_slack(logical, k, [u, t], [w], stats) - need)
            if amount > 0:
                logical.split(u, w, t, int(amount))
    left = logical.remove(w)
    stats.dropped += left
    if left:
        raise SynthesisError(
            f"switch {net.names[w]!r} cannot be split completely ({left} tree units left): "
            "its ingress and egress capacities probably differ"
        )


def _aux(logical: Logical, k: int, sources: list[int], sinks: list[int]):
    net = logical.net
    n = net.num_nodes
    s_node, t_node = n, n + 1
    sources, sinks = sorted(set(sources)), sorted(set(sinks))
    src, dst, cap = logical.arrays()
    n_gpus = net.num_gpus
    src = np.concatenate([src, np.full(n_gpus, s_node), np.full(len(sources), s_node), np.asarray(sinks)])
    dst = np.concatenate([dst, np.arange(n_gpus), np.asarray(sources), np.full(len(sinks), t_node)])
    cap = np.concatenate([cap, np.full(n_gpus, k), np.full(len(sources) + len(sinks), INF)])
    return FlowNetwork(n + 2, src, dst), cap, s_node, t_node


def _slack(logical: Logical, k: int, sources: list[int], sinks: list[int], stats: SplitStats) -> int:
    fnet, cap, s, t = _aux(logical, k, sources, sinks)
    stats.flows += 1
    return int(maximum_flow(fnet.matrix(cap), s, t).flow_value)


def _constrained_slack(logical: Logical, k: int, sources: list[int], sinks: list[int], stats: SplitStats) -> int:
    """``N k`` plus the smallest slack of a constrained set holding ``sources`` and none of ``sinks``.

    Only sets that miss some GPU constrain a splitting (phase 1's condition);
    a set holding every GPU does not. One max-flow, and if its min cut holds
    every GPU, one max-flow per GPU outside ``sources`` with that GPU as an
    extra sink.
    """
    n_gpus = logical.net.num_gpus
    fnet, cap, s, t = _aux(logical, k, sources, sinks)
    stats.flows += 1
    value, side = fnet.min_cut(cap, s, t)
    if not side[:n_gpus].all():
        return value  # the min cut already misses a GPU: it is the constrained minimum
    best = INF
    for v in range(n_gpus):
        if v in sources:
            continue
        best = min(best, _slack(logical, k, sources, [*sinks, v], stats))
    return best
