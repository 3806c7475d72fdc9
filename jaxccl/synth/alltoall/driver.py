"""``alltoall()``: column generation, rounding and compilation into one Schedule.

Rates. The LP's ``z`` is the rate every commodity ``(s, d)`` gets (bytes/s of
the ``D`` bytes rank ``s`` sends to rank ``d``). A rank's AllToAll output
buffer holds ``N * D`` bytes and the collective takes ``D / z`` seconds in the
large-message limit, so ``algbw = N * z`` (the nccl-tests convention:
one rank's output bytes over the time, its own block included).
``Schedule.bound`` is ``N * z_LP`` and ``Schedule.algbw`` is ``N * K / chi``
of the rounded solution (``chi = max_a n_a / c_a``, ``n_a`` chunks of size
``D / K`` on link ``a``).

Warm start. ``previous`` (a schedule this module made) carries its chunk
routes in ``info["paths"]``; chunk ``j`` of every commodity of source ``s``
defines a tree of ``s`` (one route per destination), so the previous integer
solution is ``K`` columns per source. Three outcomes, reported as
``info["warm_mode"]``:

* ``"kept"``: the previous routes, priced on the new capacities, meet a
  Lagrangian upper bound (from their own link utilizations, see :mod:`.cg`):
  they are still optimal and the previous program is returned as is (only
  ``bound``/``algbw``/``info`` change).
* ``"repair"``: only the pairs whose routes cross a link the old routes now
  overload (or a link that is gone) are re-optimized, the others keep their
  routes; accepted when a Lagrangian bound over all pairs proves the result
  LP-optimal (:mod:`.repair`, MCCL Sec. 4.1's locality of re-optimization).
  (When some link is overloaded the repair runs first and the previous
  routes are "kept" if its certified optimum is their rate.)
* ``"column_generation"``: otherwise, the full column generation seeded with
  the previous trees whose routes still fit (MCCL Sec. 4.2's warm start).

After a repair, the untouched pairs keep their routes and chunks, so only the
re-optimized pairs are rounded -- at the previous chunk count ``K``, with the
untouched routes as fixed link loads -- and that rounding is taken when it is
within ``reuse_tolerance`` (default 0.25 %) of the LP bound (or, with
``reuse_tolerance=0``, within the 0.1 % the full rounding allows for fewer
chunks). Then the plan, the routes table and the program are updated rather
than rebuilt (:func:`.compile.plan_delta`, incremental :func:`.compile.emit`):
the previous schedule's unchanged threadblocks and ops are reused. Otherwise
(another ``K`` is better by more than that) every pair is rounded over every
``K`` as in a cold start. Deviation: MCCL re-rounds the warm LP solution
like a cold one; keeping ``K`` trades at most ``reuse_tolerance`` of
bandwidth for a re-synthesis that touches only what the change touched. The
gap is reported as always (``gap_pct``, and every ``K`` tried in
``per_chunk_algbw``).

What the synthesizer needs from a schedule it returned (its plan, routes as
arrays, emission) is remembered in memory next to it (:mod:`.state`); a
schedule read back from JSON is parsed and checked instead, with the same result.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from jaxccl.errors import SynthesisError, TopologyError
from jaxccl.schedule import Collective, Schedule
from jaxccl.synth.alltoall.cg import (
    GAP_TOL,
    BestBound,
    Certificate,
    CGResult,
    column_generation,
    initial_trees,
    utilization_prices,
)
from jaxccl.synth.alltoall.columns import ColumnPool
from jaxccl.synth.alltoall.compile import (
    LAYOUT,
    Plan,
    emit,
    emitted_from,
    plan,
    plan_columns,
    plan_delta,
    plan_incremental,
    previous_plan,
)
from jaxccl.synth.alltoall.network import Network, build_network
from jaxccl.synth.alltoall.pricing import METHODS as PRICING_METHODS
from jaxccl.synth.alltoall.pricing import shortest_path_trees
from jaxccl.synth.alltoall.repair import Repaired, repair
from jaxccl.synth.alltoall.rounding import CHUNK_TOLERANCE, path_flows, round_at, round_flows
from jaxccl.synth.alltoall.routes import COLUMN_ENCODING, encode_column, route_arcs, route_nodes
from jaxccl.synth.alltoall.state import WarmState, recall, remember
from jaxccl.topology import Topology

NAME = "cg_alltoall"
SATURATION_TOL = 1e-6  # an LP link load within this fraction of capacity is "saturated" (the cut)
# A warm start keeps the previous chunk count when its rounding is within this fraction of the LP bound.
REUSE_TOLERANCE = 2.5e-3


def alltoall(
    topo: Topology,
    previous: Schedule | None = None,
    max_chunks: int = 10,
    time_budget: float | None = None,
    *,
    max_steps: int | None = None,
    minimize_steps: bool = False,
    pricing: str | None = None,
    reuse_tolerance: float = REUSE_TOLERANCE,
    name: str = NAME,
) -> Schedule:
    """Synthesizes an AllToAll schedule by column generation and deep-dive rounding (MCCL Sec. 4.2).

    Solves the master problem (1)-(4) of MCCL Sec. 4.2 by column generation on
    HiGHS, pricing source-rooted shortest-path trees on the time-expanded DAG
    for all sources at once; rounds the LP optimum to at most ``max_chunks``
    chunks per commodity (the best chunk count ``K <= max_chunks``, App. F/G);
    compiles the chunk routes into the schedule IR (paths through other GPUs
    forward through their scratch buffer).

    Args:
        topo: the cluster.
        previous: a schedule this function returned earlier (possibly for
            other link capacities or a link less): its program is kept when
            its routes are still optimal on ``topo``; else only the pairs a
            change touched are re-optimized when that is provably optimal;
            else its routes seed the column generation (see the module
            docstring; ``info["warm_mode"]`` says which).
        max_chunks: the largest number of chunks per commodity (``>= 1``).
        time_budget: seconds for the LP phase; when they run out the best LP
            solution so far is rounded and ``bound`` is the Lagrangian upper
            bound (``info["lp_converged"]`` is False). Rounding and compilation
            come on top.
        max_steps: ``m_s``, the step bound of the time-expanded DAG (paths use
            at most ``m_s - 1`` GPU-to-GPU hops). Default: MCCL's ``|V| - 1``.
        minimize_steps: binary-search the smallest ``m_s`` that keeps the LP
            optimum (MCCL App. D) and synthesize with it.
        pricing: shortest-path method of the pricing, ``"dag"`` (the step
            sweep over the time-expanded DAG) or ``"dijkstra"`` (compiled,
            exact when the step bound cannot bind); default: ``"dijkstra"``
            when ``m_s >= N``, else ``"dag"``.
        reuse_tolerance: with ``previous``: the previous chunk count is kept
            (and with it most of the previous program) when its rounding is
            within this fraction of the LP bound (see the module docstring);
            0 rounds every ``K`` as a cold start would.
        name: the schedule's name.

    Returns:
        An ``all_to_all`` :class:`~jaxccl.schedule.Schedule` with ``chunks_per_period = K``.
        ``bound`` is the LP optimum and ``algbw`` the rounded schedule's algbw,
        both in bytes of one rank's output buffer per second (``N * z``).
        ``info`` holds ``gap_pct``, ``chunks``, ``iterations``,
        ``columns_generated``, ``reused_columns`` (previous trees in the
        master problem, or previous routes kept by a repair), ``warm_mode``,
        ``solve_time_s``,
        ``timings``, ``threadblocks_reused`` and ``ops_reused`` (objects of
        ``previous``'s program in this one), ``paths`` (the chunk routes, see
        :func:`~jaxccl.synth.alltoall.decode_paths`), and for the
        re-optimization trigger of MCCL Sec. 3.2 the bottleneck ``cut`` (links
        the LP saturates), their ``base_slacks`` and ``link_chunks``.

    Raises:
        TopologyError: ``topo`` is not a Topology or has fewer than 2 GPUs.
        SynthesisError: bad ``max_chunks``/``time_budget``/``max_steps``/``reuse_tolerance``, a
            ``previous`` schedule of another collective or size, or a solver failure.

    Example:
        >>> from jaxccl.topology import rail, scenario
        >>> base = alltoall(rail(hosts=2, gpus_per_host=4))
        >>> base.validate().chunks_per_period, round(base.bound / 1e9, 3), base.info["gap_pct"] < 1e-9
        (1, 100.0, True)
        >>> warm = alltoall(scenario(rail(hosts=2, gpus_per_host=4), "fail2"), previous=base)
        >>> warm.info["reused_columns"] > 0, round(warm.bound / 1e9, 3), warm.info["gap_pct"] < 2
        (True, 78.125, True)
    """
    t_start = time.perf_counter()
    max_chunks = _check_args(topo, max_chunks, time_budget)
    if pricing not in (None, *PRICING_METHODS):
        raise SynthesisError(f"pricing must be one of {PRICING_METHODS} or None, got {pricing!r}")
    tol_ok = isinstance(reuse_tolerance, (int, float)) and not isinstance(reuse_tolerance, bool)
    if not (tol_ok and 0 <= reuse_tolerance < 1):
        raise SynthesisError(f"reuse_tolerance must be a fraction in [0, 1), got {reuse_tolerance!r}")
    n = topo.num_gpus
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    net = build_network(topo)
    m_s = net.default_steps if max_steps is None else int(max_steps)
    if m_s < 2:
        raise SynthesisError(f"max_steps must be >= 2 (a path needs at least one hop), got {max_steps!r}")
    timings["network"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = recall(previous) if previous is not None else None
    warm = _Warm.of(previous, net, state) if previous is not None else None
    timings["previous"] = time.perf_counter() - t0

    # Previous routes that overload no link keep their rate: check at once whether they are still optimal.
    # Otherwise the repair below decides (its certified optimum is compared with their rate).
    checked = False
    if warm is not None and not minimize_steps and warm.chunks <= max_chunks and not warm.overloaded.any():
        t0 = time.perf_counter()
        kept = warm.still_optimal(m_s, pricing)
        checked = True
        timings["check_previous"] = time.perf_counter() - t0
        if kept is not None:
            return _keep_previous(previous, warm, kept, name, m_s, timings, t_start, state)

    deadline = None if time_budget is None else t_start + float(time_budget)
    repaired = None
    if warm is not None and warm.src.size and warm.chunks >= 1 and not minimize_steps:
        t0 = time.perf_counter()
        repaired = repair(
            net,
            warm.src,
            warm.dst,
            warm.count,
            warm.arcs,
            warm.chunks,
            warm.overloaded,
            max_steps=m_s,
            pricing=pricing,
            deadline=deadline,
            link_chunks=warm.link_chunks,
            hops=warm.hops,
        )
        timings["repair"] = time.perf_counter() - t0
        if repaired is not None:
            timings.update({f"repair_{k}": v for k, v in repaired.timings.items()})
            if warm.complete and warm.chunks <= max_chunks and repaired.z <= warm.rate * (1 + GAP_TOL):
                # The previous routes already reach the certified optimum.
                upper = max(repaired.upper, warm.rate)
                kept = (upper, repaired.certificate)
                return _keep_previous(previous, warm, kept, name, m_s, timings, t_start, state, repaired)
    if repaired is None and not checked and warm is not None and not minimize_steps and warm.chunks <= max_chunks:
        t0 = time.perf_counter()
        kept = warm.still_optimal(m_s, pricing)
        timings["check_previous"] = time.perf_counter() - t0
        if kept is not None:
            return _keep_previous(previous, warm, kept, name, m_s, timings, t_start, state)
    step_search = None
    pool = flows = None
    if repaired is not None:
        certificate = repaired.certificate
        z_bound = repaired.z
        lp_loads = repaired.loads
        info: dict[str, Any] = {
            "warm_mode": "repair",
            "lp_converged": True,
            "lp_gap_pct": _gap_pct(repaired.z, repaired.upper),
            "lp_value": n * repaired.z * net.unit,
            "iterations": repaired.iterations,
            "columns_generated": repaired.columns_generated,
            "reused_columns": repaired.kept_routes,
            "affected_pairs": repaired.affected,
            "simplex_iterations": repaired.simplex_iterations,
        }
    else:
        t0 = time.perf_counter()
        if minimize_steps:
            m_s, step_search, res = _minimize_steps(net, m_s, warm, deadline, pricing)
        else:
            res = _solve_lp(net, m_s, warm, deadline, pricing)
        timings["lp"] = time.perf_counter() - t0
        timings.update({f"lp_{k}": v for k, v in res.timings.items()})
        pool, z_bound = res.pool, (res.z if res.converged else res.upper)
        certificate = res.certificate
        flows = path_flows(pool, res.x)
        lp_loads = pool.loads(np.flatnonzero(res.x > 0), res.x[res.x > 0])
        info = {
            "warm_mode": "cold" if warm is None else "column_generation",
            "lp_converged": bool(res.converged),
            "lp_gap_pct": _gap_pct(res.z, res.upper),
            "lp_value": n * res.z * net.unit,
            "iterations": res.iterations,
            "columns_generated": res.columns_generated,
            "columns_total": pool.num_columns,
            "reused_columns": int((pool.col_origin == 1).sum()),
            "simplex_iterations": res.master.simplex_iterations,
        }

    t0 = time.perf_counter()
    prefer = warm.chunks if warm is not None and 1 <= warm.chunks <= max_chunks else None
    # The previous plan (the rows of its routes table) and, on the same network, its routes' arcs.
    prev_plan = base = prev_arcs = None
    if state is not None:
        prev_plan, base = state.plan, state.emitted
        prev_arcs = warm.same_network_arcs
    elif warm is not None and previous.info.get("layout") == LAYOUT and warm.chunks >= 1:
        prev_plan = previous_plan(previous.info.get("paths") or {}, n, previous.chunks_per_period)
        if prev_plan is not None and warm.all_routes and prev_plan.src.size == warm.src.size:
            prev_arcs = warm.arcs
    rounded = None
    same_k = previous is not None and prefer == previous.chunks_per_period
    if repaired is not None and prev_plan is not None and prev_arcs is not None and same_k:
        # The untouched commodities stay as they are: round the affected ones at the previous K only.
        trial = round_at(
            net, repaired.pool, repaired.flows, prefer, fixed_load=repaired.fixed_chunks, target=z_bound, purify=False
        )
        if trial.rate >= z_bound * (1 - max(reuse_tolerance, CHUNK_TOLERANCE)):
            rounded = trial
    delta = rounded is not None
    if not delta:
        if repaired is not None:
            pool, flows = repaired.complete()
        rounded = round_flows(
            net, pool, flows, max_chunks=max_chunks, target=z_bound, prefer=prefer, keep_within=reuse_tolerance
        )
    else:
        pool = repaired.pool
    info.setdefault("columns_total", pool.num_paths)
    timings["rounding"] = time.perf_counter() - t0
    if rounded.rate > z_bound * (1 + 1e-9):  # pragma: no cover - an integer solution is an LP solution
        raise SynthesisError(f"rounded rate {rounded.rate} exceeds the LP bound {z_bound}")
    rate = min(rounded.rate, z_bound)  # float noise only
    t0 = time.perf_counter()
    if previous is None or previous.chunks_per_period != rounded.chunks:
        prev_plan = base = None  # other chunk classes: nothing of the previous program carries over
    if delta:
        msgs = plan_delta(
            net, pool, prev_plan, repaired.kept_rows, rounded.comm, rounded.pid, rounded.count, rounded.chunks
        )
        kept_prefix = _kept_prefix(msgs)
        arcs = _merged_arcs(msgs, kept_prefix, prev_arcs, pool)
    elif prev_plan is not None:
        msgs = plan_incremental(
            net, pool, rounded.comm, rounded.pid, rounded.count, rounded.chunks, prev_plan, prev_arcs
        )
        arcs = pool.paths[msgs.pid]
    else:
        msgs = plan(net, pool, rounded.comm, rounded.pid, rounded.count, rounded.chunks)
        arcs = pool.paths[msgs.pid]
    timings["plan"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if delta and state is not None and state.route is not None:
        route, offset = _routes_from(state, msgs, kept_prefix, net, arcs)
    else:
        route, length = route_nodes(net, arcs)
        offset = np.r_[0, np.cumsum(length)]
    paths = _paths_table(net, msgs, route, offset)
    info = {
        "algorithm": "column_generation",
        "paper": "MCCL Sec. 4.2, App. D/F/G",
        "chunks": rounded.chunks,
        "lp_bound": n * z_bound * net.unit,
        "gap_pct": _gap_pct(rate, z_bound),
        **info,
        "reused_schedule": False,
        "max_steps": m_s,
        "steps_used": int(msgs.hops.max()) if msgs.hops.size else 0,
        "step_search": step_search,
        "per_chunk_algbw": {str(k): n * v * net.unit for k, v in rounded.per_k.items()},
        "topology": topo.fingerprint,
        "rate_convention": "algbw = N * per-pair rate (bytes of one rank's output buffer / time)",
        "layout": LAYOUT,
        "paths": paths,
    }
    info.update(_cut_info(net, lp_loads, rounded.link_chunks))
    timings["info"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    if base is None and prev_plan is not None:
        base = emitted_from(previous, prev_plan)
    stats: dict[str, int] = {}
    record: list = []
    sched = emit(
        n,
        rounded.chunks,
        msgs,
        base=base,
        stats=stats,
        record=record,
        name=name,
        algbw=n * rate * net.unit,
        bound=n * z_bound * net.unit,
        info=info,
    )
    state_new = WarmState(
        paths=paths,
        plan=msgs,
        emitted=record[0],
        nodes=net.nodes,
        tail=net.tail,
        head=net.head,
        arcs=arcs,
        link_chunks=np.asarray(rounded.link_chunks, dtype=np.float64),
        certificate=certificate,
        route=route,
        route_offset=offset,
    )
    remember(sched, state_new)
    timings["compile"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_start
    # The schedule holds this very dict: what its own compilation took goes in last.
    info["threadblocks_reused"] = stats.get("reused", 0)
    info["ops_reused"] = stats.get("reused_ops", 0)
    info["timings"] = timings
    info["solve_time_s"] = timings["total"]
    return sched


def _kept_prefix(p: Plan) -> int:
    """How many rows a :func:`plan_delta` plan took over: they come first, in their previous order (checked)."""
    k = int(np.count_nonzero(p.prev_row >= 0))
    kept = p.prev_row[:k]
    if not (np.all(kept >= 0) and np.all(np.diff(kept) > 0)):  # pragma: no cover - plan_delta's order
        raise SynthesisError("internal: a delta plan must list its kept rows first, in order")
    return k


def _merged_arcs(p: Plan, k: int, prev_arcs: np.ndarray, pool: ColumnPool) -> np.ndarray:
    """``(M, L)`` the arcs of every row of a :func:`plan_delta` plan: kept rows' previous, new rows' pool paths.

    ``k``: its kept rows, the first ones (:func:`_kept_prefix`).
    """
    fresh = pool.paths[p.pid[k:]]
    out = np.full((p.src.size, max(prev_arcs.shape[1], fresh.shape[1])), -1, dtype=np.int32)
    out[:k, : prev_arcs.shape[1]] = np.take(prev_arcs, p.prev_row[:k], axis=0)
    out[k:, : fresh.shape[1]] = fresh
    return out


def _paths_table(net: Network, p: Plan, route: np.ndarray, offset: np.ndarray) -> dict:
    """``info["paths"]``: the plan's rows (nodes ``route[offset[i]:offset[i+1]]``) with class ranges and scratch."""
    table = {
        "nodes": list(net.nodes),
        "encoding": COLUMN_ENCODING,
        "src": encode_column(p.src),
        "dst": encode_column(p.dst),
        "chunks": encode_column(p.count),
        "offset": encode_column(offset),
        "route": encode_column(route),
    }
    table.update(plan_columns(p))
    return table


def _routes_from(state: WarmState, p: Plan, k: int, net: Network, arcs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(route, offset)`` of a :func:`plan_delta` plan built from ``state``'s: kept rows keep their nodes.

    The ``k`` kept rows come first, in their previous order (:func:`_kept_prefix`),
    so their nodes are the previous table's minus the dropped rows'.
    """
    kept = p.prev_row[:k]
    old_len = np.diff(state.route_offset)
    keep = np.zeros(old_len.size, dtype=bool)
    keep[kept] = True
    fresh, fresh_len = route_nodes(net, arcs[k:])
    route = np.concatenate([state.route[np.repeat(keep, old_len)], fresh])
    offset = np.r_[0, np.cumsum(np.concatenate([old_len[kept], fresh_len]))]
    return route, offset


def _gap_pct(value: float, bound: float) -> float:
    return max(0.0, 100.0 * (1.0 - value / bound)) if bound > 0 else 0.0


def _check_args(topo: Any, max_chunks: Any, time_budget: Any) -> int:
    if not isinstance(topo, Topology):
        raise TopologyError(f"alltoall() needs a jaxccl.topology.Topology, got {type(topo).__name__}")
    if topo.num_gpus < 2:
        raise TopologyError(f"alltoall() needs at least 2 GPUs; {topo.name or 'the topology'} has {topo.num_gpus}")
    if isinstance(max_chunks, bool) or not isinstance(max_chunks, (int, np.integer)) or max_chunks < 1:
        raise SynthesisError(f"max_chunks must be an integer >= 1, got {max_chunks!r}")
    if time_budget is not None and (isinstance(time_budget, bool) or not isinstance(time_budget, (int, float))):
        raise SynthesisError(f"time_budget must be a positive number of seconds or None, got {time_budget!r}")
    if time_budget is not None and not time_budget > 0:
        raise SynthesisError(f"time_budget must be a positive number of seconds or None, got {time_budget!r}")
    return int(max_chunks)


def _solve_lp(net: Network, m_s: int, warm: _Warm | None, deadline: float | None, pricing: str | None) -> CGResult:
    init = initial_trees(net, m_s, pricing=pricing)
    reused = warm.trees(m_s, init) if warm is not None else []
    # A warm start seeds the RMP with the repaired previous trees alone: adding the cold initial
    # trees next to them made the RMP's optimum a degenerate mix that took more iterations.
    covered = np.zeros(net.num_gpus, dtype=bool)
    for src, _ in reused:
        covered[src] = True
    missing = np.flatnonzero(~covered)
    seeds = [(init[0][missing], init[1][missing])] if missing.size else []
    return column_generation(
        net, max_steps=m_s, seed_trees=seeds, reused_trees=reused, deadline=deadline, pricing=pricing
    )


def _minimize_steps(net: Network, m_s: int, warm: _Warm | None, deadline: float | None, pricing: str | None):
    """MCCL App. D: binary search for the smallest step bound that still reaches the optimum at ``m_s``.

    Each trial re-runs column generation on the truncated DAG, seeded with
    the trees of earlier trials that fit in its steps (MCCL's warm start).
    Trials list ``[m_test, algbw]`` (0 when some pair has no route); the
    returned run is the one at the smallest optimal bound.
    """
    best = _solve_lp(net, m_s, warm, deadline, pricing)
    target = best.z
    lo, hi, best_m = 2, m_s - 1, m_s
    trials: list[list[float]] = [[m_s, best.z * net.num_gpus * net.unit]]
    carried = best
    iterations, columns = best.iterations, best.columns_generated
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            method = pricing if mid >= net.num_gpus else "dag"
            seeds = _step_feasible(carried, mid) or [initial_trees(net, mid, pricing=method)]
            res = column_generation(net, max_steps=mid, seed_trees=seeds, deadline=deadline, pricing=method)
        except SynthesisError:  # some pair has no route within mid steps: infeasible
            trials.append([mid, 0.0])
            lo = mid + 1
            continue
        trials.append([mid, res.z * net.num_gpus * net.unit])
        iterations += res.iterations
        columns += res.columns_generated
        if res.converged and res.z >= target * (1 - 1e-9):
            best, best_m, hi, carried = res, mid, mid - 1, res
        else:
            lo = mid + 1
    search = {
        "trials": trials,
        "target_algbw": target * net.num_gpus * net.unit,
        "iterations_total": iterations,
        "columns_generated_total": columns,
    }
    return best_m, search, best


def _step_feasible(res: CGResult, m_s: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The trees of an earlier run whose paths all fit in ``m_s`` steps (one per source at least)."""
    pool, net = res.pool, res.pool.net
    arcs = pool.paths
    adv = np.where(arcs >= 0, net.advances[np.maximum(arcs, 0)], False).sum(axis=1)
    col_adv = np.where(pool.col_paths >= 0, adv[np.maximum(pool.col_paths, 0)], 0).max(axis=1)
    keep = np.flatnonzero(col_adv <= m_s - 1)
    if keep.size == 0 or np.unique(pool.col_src[keep]).size < net.num_gpus:
        return []
    pid = pool.col_paths[keep]
    paths = np.where(pid[..., None] >= 0, arcs[np.maximum(pid, 0)], -1)
    return [(pool.col_src[keep], paths.astype(np.int32))]


def _cut_info(net: Network, lp_loads: np.ndarray, link_chunks: np.ndarray) -> dict[str, Any]:
    """Bottleneck cut (LP-saturated links), base slacks and chunks per link (MCCL Sec. 3.2, Alg. 1).

    ``base_slack_a = (c_a - n_a * x_min) / c_a`` with the per-chunk rate
    ``x_min = min_a c_a / n_a``: the bandwidth the rounded schedule leaves
    unused on a cut link.
    """
    cap = net.capacity
    used = link_chunks > 0
    x_min = float(np.min(cap[used] / link_chunks[used])) if used.any() else 0.0
    cut = np.flatnonzero(lp_loads >= cap * (1 - SATURATION_TOL))
    slacks = np.maximum((cap[cut] - link_chunks[cut] * x_min) / cap[cut], 0.0)
    nz = np.flatnonzero(used)
    names = np.empty(net.num_nodes, dtype=object)
    names[:] = net.nodes
    u, v = names[net.tail[nz]].tolist(), names[net.head[nz]].tolist()
    return {
        "cut": [[names[net.tail[a]], names[net.head[a]]] for a in cut.tolist()],
        "base_slacks": slacks.tolist(),
        "link_chunks": list(map(list, zip(u, v, np.rint(link_chunks[nz]).astype(np.int64).tolist()))),
    }


def _keep_previous(
    previous: Schedule,
    warm: _Warm,
    kept: tuple[float, Certificate | None],
    name: str,
    m_s: int,
    timings: dict,
    t_start: float,
    state: WarmState | None,
    repaired: Repaired | None = None,
) -> Schedule:
    """The previous program with this topology's bound, rate and trigger data.

    ``kept`` is the certified bound and the certificate behind it.
    """
    upper, certificate = kept
    net, n = warm.net, warm.net.num_gpus
    rate = warm.rate
    info = dict(previous.info)
    info.update(
        {
            "lp_bound": n * upper * net.unit,
            "gap_pct": _gap_pct(rate, upper),
            "lp_converged": True,
            "lp_gap_pct": _gap_pct(rate, upper),
            "lp_value": n * rate * net.unit,
            "iterations": 0 if repaired is None else repaired.iterations,
            "columns_generated": 0 if repaired is None else repaired.columns_generated,
            "columns_total": warm.num_trees,
            "reused_columns": warm.num_trees,
            "reused_schedule": True,
            "warm_mode": "kept",
            "max_steps": m_s,
            "step_search": None,
            "per_chunk_algbw": {str(warm.chunks): n * rate * net.unit},
            "simplex_iterations": 0 if repaired is None else repaired.simplex_iterations,
            "topology": net.topo.fingerprint,
            "threadblocks_reused": previous.num_threadblocks,
            "ops_reused": previous.num_ops,
        }
    )
    info.update(_cut_info(net, warm.link_chunks * rate / warm.chunks, warm.link_chunks))
    timings["total"] = time.perf_counter() - t_start
    info["timings"] = timings
    info["solve_time_s"] = timings["total"]
    sched = previous.replace(name=name, algbw=n * rate * net.unit, bound=n * upper * net.unit, info=info)
    if state is not None:
        if certificate is not state.certificate:
            state = dataclasses.replace(state, certificate=certificate)
        remember(sched, state)
    return sched


class _Warm:
    """What a previous schedule offers on a new topology: its chunk routes and their rate.

    Attributes:
        chunks: the previous ``K``.
        src, dst, count, arcs: its routes whose links all still exist (arcs -1 padded).
        all_routes: every route of the previous table is among them (in its order).
        hops: their GPU-to-GPU hops, when known without counting.
        complete: every commodity keeps all ``K`` chunks on existing links.
        overloaded: ``(A,)`` links the previous routes overload on the new capacities.
        rate: the previous integer solution's per-commodity rate on the new
            capacities (capacity units), when complete.
        link_chunks: its chunks per link, when complete.
        certificate: the previous schedule's :class:`~.cg.Certificate`, when
            its prices refer to this network's arcs.
        same_network_arcs: the remembered routes' arcs when the network is the
            one they were found on (same nodes and links), else None.
    """

    def __init__(self, net: Network) -> None:
        self.net = net
        self.chunks = 0
        self.src = self.dst = self.count = np.zeros(0, dtype=np.int64)
        self.arcs = np.zeros((0, 1), dtype=np.int32)
        self.complete = False
        self.rate = 0.0
        self.link_chunks = np.zeros(net.num_arcs)
        self.overloaded = np.zeros(net.num_arcs, dtype=bool)
        self.num_trees = 0
        self.all_routes = False
        self.hops: np.ndarray | None = None
        self.certificate: Certificate | None = None
        self.same_network_arcs: np.ndarray | None = None

    @classmethod
    def of(cls, previous: Schedule, net: Network, state: WarmState | None = None) -> _Warm:
        if not isinstance(previous, Schedule):
            raise SynthesisError(f"previous must be a jaxccl Schedule, got {type(previous).__name__}")
        if previous.collective is not Collective.ALL_TO_ALL:
            raise SynthesisError(f"previous is a {previous.collective.value} schedule, not all_to_all")
        if previous.num_ranks != net.num_gpus:
            raise SynthesisError(
                f"previous schedule has {previous.num_ranks} ranks but the topology has {net.num_gpus} GPUs"
            )
        w = cls(net)
        table = previous.info.get("paths")
        if not table:
            return w  # e.g. a baseline schedule: nothing to reuse
        n = net.num_gpus
        w.chunks = int(previous.info.get("chunks", previous.chunks_per_period))
        same = state.arcs_on(net.nodes, net.tail, net.head) if state is not None else None
        w.same_network_arcs = same
        if same is not None:  # the same network: the routes' arcs are those it was synthesized with
            src, dst, count = state.plan.src, state.plan.dst, state.plan.count
            arcs, ok = same, np.ones(src.size, dtype=bool)
        else:
            src, dst, count, arcs, ok = route_arcs(net, table)
        w.all_routes = bool(ok.all())
        if w.all_routes:  # read-only use: no copies
            w.src, w.dst, w.count, w.arcs = src, dst, count, arcs
        else:
            w.src, w.dst, w.count, w.arcs = src[ok], dst[ok], count[ok], arcs[ok]
        per_comm = np.bincount(w.src * n + w.dst, weights=w.count, minlength=n * n)
        off_diag = ~np.eye(n, dtype=bool).ravel()
        w.complete = bool(ok.all() and w.chunks >= 1 and np.all(per_comm[off_diag] == w.chunks))
        if same is not None:
            w.link_chunks, w.hops = state.link_chunks, state.plan.hops
            w.certificate = state.certificate
        else:
            valid = w.arcs >= 0
            weights = np.broadcast_to(w.count[:, None], w.arcs.shape)[valid]
            w.link_chunks = np.bincount(w.arcs[valid], weights=weights, minlength=net.num_arcs)
        if w.complete:
            w.rate = w.chunks / float(np.max(w.link_chunks / net.capacity))
            w.num_trees = n * w.chunks
        # Links the old routes now overload: more chunks per capacity than the old bottleneck had.
        old_rate = (previous.algbw or 0.0) / n / net.unit  # per-commodity rate, capacity units
        if old_rate > 0 and w.chunks >= 1:
            w.overloaded = w.link_chunks / net.capacity > (w.chunks / old_rate) * (1 + 1e-9)
        return w

    def still_optimal(self, m_s: int, pricing: str | None = None) -> tuple[float, Certificate | None] | None:
        """A Lagrangian bound proving the previous routes optimal on the new capacities, else None.

        Returns the bound and its certificate. The previous schedule's
        certificate is tried first (one dot product: a change away from the
        links it prices leaves its bound unchanged); then the utilization
        prices of the routes, each priced once.
        """
        if not self.complete:
            return None
        net = self.net
        hops = self.hops
        if hops is None:
            hops = np.where(self.arcs >= 0, net.advances[np.maximum(self.arcs, 0)], False).sum(axis=1)
        if hops.max() > m_s - 1:
            return None
        cert = self.certificate
        if cert is not None and cert.max_steps == m_s:
            upper = cert.bound(net.capacity)
            if np.isfinite(upper) and upper - self.rate <= GAP_TOL * upper:
                return max(upper, self.rate), cert
        best = BestBound(net, m_s)
        for prices in utilization_prices(net, self.link_chunks):
            best.offer(prices, shortest_path_trees(net, prices, max_steps=m_s, extract=False, method=pricing).cost)
            if best.closes(self.rate):
                return max(best.upper, self.rate), best.certificate
        return None

    def trees(self, m_s: int, fallback: tuple[np.ndarray, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The previous chunk routes as trees: tree ``j`` of source ``s`` takes chunk ``j``'s route to every GPU.

        Routes longer than ``m_s - 1`` hops, and routes over links they now
        overload (the previous routes put more chunks per capacity on them
        than on the previous bottleneck), are dropped; a destination left
        without a route in some chunk takes another chunk's route, else its
        path in the ``fallback`` trees (one per source). So the trees keep
        the previous structure wherever it still fits.
        """
        net, n, k = self.net, self.net.num_gpus, self.chunks
        if self.src.size == 0 or k < 1:
            return []
        safe = np.maximum(self.arcs, 0)
        hops = np.where(self.arcs >= 0, net.advances[safe], False).sum(axis=1)
        keep = (hops <= m_s - 1) & ~np.any((self.arcs >= 0) & self.overloaded[safe], axis=1)
        src, dst, cnt, arcs = self.src[keep], self.dst[keep], self.count[keep], self.arcs[keep]
        order = np.lexsort((dst, src))
        src, dst, cnt, arcs = src[order], dst[order], cnt[order], arcs[order]
        comm = src * n + dst
        c0 = np.cumsum(cnt) - cnt
        first = np.flatnonzero(np.r_[True, comm[1:] != comm[:-1]]) if comm.size else np.zeros(0, dtype=np.int64)
        c0 -= np.repeat(c0[first], np.diff(np.r_[first, comm.size]))
        f_src, f_paths = fallback
        width = max(arcs.shape[1], f_paths.shape[2])
        paths = np.full((n, k, n, width), -1, dtype=np.int32)
        filled = np.zeros((n, k, n), dtype=bool)
        rep = np.repeat(np.arange(src.size), cnt)
        cls = c0[rep] + (np.arange(rep.size) - np.repeat(np.cumsum(cnt) - cnt, cnt))
        inside = cls < k
        rep, cls = rep[inside], cls[inside]
        paths[src[rep], cls, dst[rep], : arcs.shape[1]] = arcs[rep]
        filled[src[rep], cls, dst[rep]] = True
        # A chunk without a route takes another chunk's route of its commodity, else the fallback's.
        any_filled = filled.any(axis=1)
        first_cls = filled.argmax(axis=1)
        s_i, j_i, d_i = np.nonzero(~filled)
        own = any_filled[s_i, d_i]
        paths[s_i[own], j_i[own], d_i[own]] = paths[s_i[own], first_cls[s_i[own], d_i[own]], d_i[own]]
        filled[s_i[own], j_i[own], d_i[own]] = True
        diag = np.arange(n)
        filled[diag, :, diag] = True
        s_i, j_i, d_i = np.nonzero(~filled)
        row = np.searchsorted(f_src, s_i)
        paths[s_i, j_i, d_i, : f_paths.shape[2]] = f_paths[row, d_i]
        has_route = np.zeros((n, k), dtype=bool)
        has_route[src[rep], cls] = True
        s_sel, j_sel = np.nonzero(has_route)
        return [(s_sel, paths[s_sel, j_sel])]
