"""The AllGather/ReduceScatter synthesis pipeline: bound, switch removal, packing, schedule; cold or warm.

:func:`allgather` and :func:`reduce_scatter` run the phases of
:mod:`jaxccl.synth.allgather` in order: the warm path (``_warm_solve``,
ForestColl-warm) first when ``previous`` gives hints, else or if it fails
the cold path (``_cold_solve``); then the report (``info``) and the
compilation into the Schedule IR.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import networkx as nx
import numpy as np

from jaxccl.errors import SynthesisError, TopologyError
from jaxccl.schedule import Collective, Schedule
from jaxccl.synth.allgather.balance import balance_switches
from jaxccl.synth.allgather.bound import DEFAULT_MAX_CHUNKS, candidate_rate, optimal_rate, switch_cuts, tree_units
from jaxccl.synth.allgather.compile import allgather_schedule, reduce_scatter_schedule
from jaxccl.synth.allgather.latency import remove_switches_latency
from jaxccl.synth.allgather.network import Net, build_net, shape_cached
from jaxccl.synth.allgather.packing import Packing, globally_tight, pack, tree_groups, tree_lists
from jaxccl.synth.allgather.repair import repair_pack
from jaxccl.synth.allgather.shorten import shorten
from jaxccl.synth.allgather.switch_removal import SplitStats, remove_switches
from jaxccl.synth.allgather.warm import previous_hints, reuse_fraction
from jaxccl.synth.group import RELAY_PREFIX, group_view, relay_topology
from jaxccl.synth.links import dead_links, usable_topology
from jaxccl.topology import Topology
from jaxccl.util.options import choose

METHODS = ("forestcoll", "latency")
DEFAULT_METHOD = "forestcoll"


def allgather(
    topo: Topology,
    previous: Schedule | None = None,
    *,
    method: str = DEFAULT_METHOD,
    max_chunks: int | None = DEFAULT_MAX_CHUNKS,
    group: Sequence[int] | None = None,
    chunk_search: bool = True,
) -> Schedule:
    """Synthesizes a throughput-optimal AllGather schedule for ``topo``.

    Args:
        topo: the topology (at least 2 GPUs).
        previous: a schedule this function made for an earlier state of the
            topology (same GPUs); its trees guide the new ones (warm start).
        method: ``"forestcoll"`` (fast switch removal) or ``"latency"``
            (MCCL App. C: an LP that keeps trees shallow; slower).
        max_chunks: largest ``k`` (chunks per shard) used for an exact
            optimum; above it the rate is rounded to ``max_chunks`` trees per
            root (``info["gap"]`` says what that costs). ``None``: always exact.
        chunk_search: below the exact ``k``, with ``max_chunks`` up to 16, search the
            best rate any ``k <= max_chunks`` trees per root reach
            (:func:`~jaxccl.synth.allgather.bound.tree_units`); ``False``: trees
            sized ``x* / max_chunks``, as many per root as fit.
        group: cluster GPUs of a group collective (their order gives the
            schedule's ranks); trees may then cross GPUs outside the group as
            relays, when that is faster than the group's own view
            (:mod:`jaxccl.synth.group`; ``info["group"]`` says which view won
            and which relays the trees use). ``None``: every GPU of ``topo``.

    Returns:
        A validated-ready ``ALL_GATHER`` schedule with ``chunks_per_period = k``;
        ``algbw == bound`` when ``info["gap"] == 0``. ``info`` holds the trees
        (per root: ``[chunks, [[parent, child], ...]]``), the critical cut, the
        bottleneck cut ``K_s`` with base slacks (MCCL Sec. 3.2), chunks per
        physical link, max tree depth, method, timings and warm-start reuse.

    Example:
        >>> from jaxccl.topology import rail
        >>> s = allgather(rail(hosts=2, gpus_per_host=4))
        >>> s.algbw == s.bound, s.chunks_per_period, s.info["max_depth"]
        (True, 1, 2)
    """
    return _synthesize_for(topo, group, previous, method, max_chunks, Collective.ALL_GATHER, chunk_search)


def reduce_scatter(
    topo: Topology,
    previous: Schedule | None = None,
    *,
    method: str = DEFAULT_METHOD,
    max_chunks: int | None = DEFAULT_MAX_CHUNKS,
    group: Sequence[int] | None = None,
    chunk_search: bool = True,
) -> Schedule:
    """A ReduceScatter schedule from the reversed AllGather trees.

    The trees are packed on ``topo`` with every link reversed (an
    aggregation tree sends child -> parent), so the throughput is the
    AllGather optimum of the reversed topology (the same as ``topo``'s for
    duplex links). Reductions follow the trees, not ascending rank order:
    ``info["ordered_reduction"]`` is False, so results can differ from
    ``jax.lax.psum_scatter`` in the last bits for floating-point data.
    ``previous``, ``method``, ``max_chunks``, ``group`` and ``chunk_search`` are as for :func:`allgather`.

    >>> from jaxccl.topology import rail
    >>> s = reduce_scatter(rail(hosts=2, gpus_per_host=4))
    >>> s.collective.value, s.algbw == s.bound, s.info["ordered_reduction"]
    ('reduce_scatter', True, False)
    """
    return _synthesize_for(topo, group, previous, method, max_chunks, Collective.REDUCE_SCATTER, chunk_search)


def switch_groups(net: Net) -> list[np.ndarray]:
    """The GPUs next to each switch, and their complements: the cuts a packing is most likely to exhaust.

    Computed once per fabric (read-only arrays).
    """
    return shape_cached(net, _switch_groups)


def _switch_groups(net: Net) -> list[np.ndarray]:
    n = net.num_gpus
    out = []
    for w in range(n, net.num_nodes):
        gpus = np.union1d(net.src[(net.dst == w) & (net.src < n)], net.dst[(net.src == w) & (net.dst < n)])
        if 1 < len(gpus) < n - 1:
            rest = np.setdiff1d(np.arange(n), gpus)
            gpus.flags.writeable = rest.flags.writeable = False
            out.extend([gpus, rest])
    return out


def reversed_topology(topo: Topology) -> Topology:
    """``topo`` with every link reversed (same nodes, capacities and latencies)."""
    g = nx.DiGraph(topo.graph).reverse(copy=True)
    return Topology(g, name=f"{topo.name} reversed", meta=topo.meta)


def _synthesize_for(topo, group, previous, method, max_chunks, collective: Collective, search: bool) -> Schedule:
    """The whole topology, or a group: the faster of its own view and the view with relays."""
    if group is None:
        return _synthesize(topo, previous, method, max_chunks, collective, search)
    if not isinstance(topo, Topology):
        raise TopologyError(f"expected a jaxccl.topology.Topology, got {type(topo).__name__}")
    choose("method", method, METHODS)
    relays = relay_topology(topo, group)
    best, algbw = None, {}
    try:
        views = [("own", group_view(topo, group))]
    except TopologyError:  # the group's GPUs and switches alone do not connect it
        views = []
    for label, view in [*views, ("relays", relays)]:
        s = _synthesize(view, previous, method, max_chunks, collective, search)
        algbw[label] = s.algbw
        if best is None or s.algbw > best[1].algbw * (1 + 1e-12):
            best = (label, s)
    label, schedule = best
    used = {str(name) for u, v, _ in schedule.info["link_chunks"] for name in (u, v)}
    schedule.info["group"] = {
        "gpus": [int(g) for g in group],
        "view": label,
        "relays": sorted(int(n[len(RELAY_PREFIX) :]) for n in used if n.startswith(RELAY_PREFIX)),
        "algbw": algbw,
    }
    return schedule


def _synthesize(topo, previous, method, max_chunks, collective: Collective, search: bool = True) -> Schedule:
    choose("method", method, METHODS)
    t_start = time.perf_counter()
    times: dict[str, float] = {}
    usable = usable_topology(topo)
    work = reversed_topology(usable) if collective is Collective.REDUCE_SCATTER else usable
    net, balanced = balance_switches(build_net(work))
    hints = previous_hints(previous, net, collective)
    result = _warm_solve(net, hints, method, max_chunks, times) if hints else None
    if result is None:
        result = _cold_solve(net, hints, method, max_chunks, times, search)
    bound, units, logical, packing, stats = result
    solve = time.perf_counter() - t_start
    t = time.perf_counter()
    info, algbw, bound_bw = _report(net, bound, units, logical, packing, stats, method, hints)
    times["report"] = time.perf_counter() - t
    info["solve_time_s"] = solve
    info["dead_links"] = [[u, v, cap] for u, v, cap in dead_links(topo)]
    info["balanced_switches"] = balanced
    build = allgather_schedule if collective is Collective.ALL_GATHER else reduce_scatter_schedule
    name = f"{method}-{'allgather' if collective is Collective.ALL_GATHER else 'reduce_scatter'}"
    t = time.perf_counter()
    schedule = build(packing, name=name, algbw=algbw, bound=bound_bw, info=info)
    times["compile"] = time.perf_counter() - t
    info["phase_times_s"] = times
    info["total_time_s"] = time.perf_counter() - t_start
    return schedule


def _split(net: Net, units, method: str, stats: SplitStats, *, verify: bool = True):
    if method == "latency":
        return remove_switches_latency(net, units.caps, units.k, stats=stats)
    return remove_switches(net, units.caps, units.k, stats=stats, verify=verify)


def _cold_solve(net: Net, hints: dict, method: str, max_chunks, times: dict, search: bool = True) -> tuple:
    """Phases 1-3 from scratch (hints only order the search)."""
    t = time.perf_counter()
    bound = optimal_rate(net, hint=hints.get("cut"))
    units = tree_units(net, bound, max_chunks=max_chunks, search=search)
    times["bound"] = time.perf_counter() - t
    t = time.perf_counter()
    stats = SplitStats()
    logical = _split(net, units, method, stats)
    times["switch_removal"] = time.perf_counter() - t
    t = time.perf_counter()
    # From scratch (also when a warm start failed): offering the old parents first only added matchings in
    # measurements, so the previous trees are not used here.
    links = logical.gpu_links()
    packing = pack(net.num_gpus, units.k, links)
    times["packing"] = time.perf_counter() - t
    # Lift the deepest GPUs where links have room (as after a warm start): the level-by-level matching can chain
    # trees through the few links that cross segments (4 x 4 x 8 rail: 18 hops, 8 after).
    t = time.perf_counter()
    packing = shorten(packing, links)
    times["shorten"] = time.perf_counter() - t
    if method == "latency":
        # Latency-aware: also pack the proportional split and keep the shallower trees (ties: the LP's).
        t = time.perf_counter()
        alt_stats = SplitStats()
        alt = remove_switches(net, units.caps, units.k, stats=alt_stats)
        alt_links = alt.gpu_links()
        alt_packing = shorten(pack(net.num_gpus, units.k, alt_links), alt_links)
        stats.choice = "lp"
        if alt_packing.max_depth() < packing.max_depth():
            logical, packing, stats.choice = alt, alt_packing, "proportional"
            stats.flows += alt_stats.flows
        times["latency_alternative"] = time.perf_counter() - t
    stats.certificate = "max-flow"
    return bound, units, logical, packing, stats


def _warm_solve(net: Net, hints: dict, method: str, max_chunks, times: dict) -> tuple | None:
    """ForestColl-warm: reuse the previous cut and trees; None if that does not reach an optimum.

    The rate is the smallest ratio among the GPUs' in-cuts, the previous
    critical cut and the cuts around every switch (an upper bound on ``x*``,
    :func:`~jaxccl.synth.allgather.bound.candidate_rate`: the previous
    optimum's certificate, re-checked on the new capacities, and the cuts a
    weakened link next to a switch typically makes critical); the previous trees are laid on
    the new logical topology at that rate, and only what they overload is
    cut off and re-grown (:func:`~jaxccl.synth.allgather.repair.repair_pack`).
    Trees that reach the rate prove it optimal (they achieve what a cut
    caps), so no max-flow is needed; if they do not (the critical cut moved,
    or the repair runs into a dead end), the cold path runs.
    """
    t = time.perf_counter()
    bound = candidate_rate(net, hint=hints.get("cut"), cuts=switch_cuts(net))
    if max_chunks is not None and bound.rate.numerator > max_chunks:
        return None
    units = tree_units(net, bound, max_chunks=max_chunks, verify=False)
    times["bound"] = time.perf_counter() - t
    sets = switch_groups(net)
    for attempt in range(2):
        t = time.perf_counter()
        stats = SplitStats()
        try:
            logical = _split(net, units, method, stats, verify=False)
        except SynthesisError:
            return None
        times["switch_removal"] = times.get("switch_removal", 0.0) + time.perf_counter() - t
        t = time.perf_counter()
        links = logical.gpu_links()
        packing = _repair(net.num_gpus, units.k, links, hints["trees"], sets)
        times["packing"] = times.get("packing", 0.0) + time.perf_counter() - t
        if packing is not None:
            t = time.perf_counter()
            packing = shorten(packing, links)
            times["shorten"] = time.perf_counter() - t
            stats.certificate = "trees"
            return bound, units, logical, packing, stats
        p = bound.rate.numerator
        if attempt or units.k == p:
            return None
        # the smallest k lost capacity to rounding somewhere: the exact k never does
        units = type(units)(p, net.units * bound.rate.denominator, Fraction(1, bound.rate.denominator), True, 0)
    return None


# (check, widen, verify the visits of GPUs with scarce slack), cheapest first
_REPAIRS = (("local", False, False), ("local", False, True), ("full", True, True))


def _repair(n: int, k: int, links: dict, trees, sets: list) -> Packing | None:
    """Keeps and repairs the previous trees: the cheap repair without any max-flow check, the same checked where
    slack is scarce, then checked everywhere after detaching whole touched trees; each with a budget of max-flow
    checks, so that a repair that does not work out costs less than the cold solve that follows it. (Whatever
    completes is exact; a check only avoids dead ends, and a small re-growth rarely runs into one.)

    On a topology where most GPUs need every unit of their in-capacity (a healthy rail: the way back after a
    degradation clears) re-growing takes as many checks as a cold packing (measured), so there only trees that
    fit as they are are kept, and anything else goes to the cold path at once.
    """
    groups = tree_groups(n, k, trees)
    tight = globally_tight(n, k, links)
    for check, widen, scarce in _REPAIRS[1:2] if tight else _REPAIRS:
        try:
            packing = repair_pack(
                n,
                k,
                links,
                groups,
                sets=sets,
                check=check,
                widen=widen,
                max_checks=2 * n,
                regrow=not tight,
                scarce=scarce,
            )
        except SynthesisError:
            continue
        packing.stats["repair_checked"] = int(check == "full")
        packing.stats["repair_widened"] = int(widen)
        packing.stats["repair_scarce_checked"] = int(scarce)
        return packing
    return None


def _report(net: Net, bound, units, logical, packing: Packing, stats: SplitStats, method, hints) -> tuple:
    n = net.num_gpus
    load = logical.physical_load(packing.link_load())
    used = np.flatnonzero(load > 0)
    cap_u, chunks = net.units[used].astype(np.int64), load[used]
    # per-chunk rate of the schedule: min over used links of capacity / chunks, exactly (cross-multiplied)
    best = int(np.argmin(cap_u / chunks))
    while True:
        lower = np.flatnonzero(cap_u * chunks[best] < cap_u[best] * chunks)
        if not len(lower):
            break
        best = int(lower[0])
    u_min, c_min = int(cap_u[best]), int(chunks[best])
    x_min = Fraction(u_min, c_min) * net.unit
    algbw = float(x_min * units.k * n)
    bound_bw = bound.algbw(net)
    if algbw > bound_bw * (1 + 1e-12):  # pragma: no cover - would contradict max-flow optimality
        raise SynthesisError(f"schedule claims {algbw:.6g} B/s above the max-flow bound {bound_bw:.6g} B/s")
    names = net.names
    # slack of a used link: 1 - chunks * x_min / capacity
    full = c_min * cap_u
    slack = (full - chunks * u_min) / full
    critical = np.zeros(len(load), dtype=bool)
    critical[bound.cut_edges(net)] = True
    in_ks = (slack <= 1e-12) | critical[used]
    k_s = [[names[net.src[i]], names[net.dst[i]]] for i in used[in_ks].tolist()]
    slacks = np.maximum(slack[in_ks], 0.0).tolist()
    trees = tree_lists(packing)
    info: dict[str, Any] = {
        "method": method,
        "packing": packing.method,
        "k": units.k,
        "exact": bool(units.exact and net.exact),
        "gap": max(0.0, 1 - algbw / bound_bw),
        "rate_units": str(bound.rate),
        "unit_bytes_per_s": float(net.unit),
        "trees": trees,
        "num_trees": sum(len(tr) for tr in trees),
        "max_depth": packing.max_depth(),
        "critical_cut": [names[i] for i in np.flatnonzero(bound.cut)],
        "bottleneck_cut": k_s,
        "base_slacks": slacks,
        "chunk_rate_bytes_per_s": float(x_min),
        "link_chunks": [
            [names[u], names[v], c] for u, v, c in zip(net.src[used].tolist(), net.dst[used].tolist(), chunks.tolist())
        ],
        "flows": {"bound": bound.flows, "tree_units": units.flows, "switch_removal": stats.flows},
        "switch_removal": {
            "greedy_switches": list(stats.greedy_switches),
            "dropped_units": int(stats.dropped),
            "lp_solves": stats.lp_solves,
            "cuts": stats.cuts,
            "choice": stats.choice,
            "split": stats.split,
        },
        "certificate": stats.certificate,
        "packing_stats": {k: int(v) for k, v in packing.stats.items()},
        "ordered_reduction": False,
        "warm": None,
    }
    if hints:
        info["warm"] = {
            "reused": reuse_fraction(hints["trees"], packing.all_pieces()),
            "preferred_units": int(packing.stats.get("preferred_units", 0)),
            "repaired": packing.method == "warm-repair",
        }
    return info, algbw, bound_bw
