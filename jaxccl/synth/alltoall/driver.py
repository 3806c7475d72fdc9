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
than rebuilt (:func:`.planning.plan_delta`, incremental :func:`.emission.emit`):
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

import time
from typing import Any

import numpy as np

from jaxccl.errors import SynthesisError, TopologyError
from jaxccl.schedule import Schedule
from jaxccl.synth.alltoall.cg import (
    GAP_TOL,
)
from jaxccl.synth.alltoall.emission import LAYOUT, emit, emitted_from
from jaxccl.synth.alltoall.lp import search_min_steps, solve_lp
from jaxccl.synth.alltoall.network import build_network
from jaxccl.synth.alltoall.planning import plan, plan_delta, plan_incremental, previous_plan
from jaxccl.synth.alltoall.pricing import METHODS as PRICING_METHODS
from jaxccl.synth.alltoall.repair import repair
from jaxccl.synth.alltoall.report import cut_info, gap_pct, paths_table
from jaxccl.synth.alltoall.rounding import CHUNK_TOLERANCE, path_flows, round_at, round_flows
from jaxccl.synth.alltoall.routes import route_nodes
from jaxccl.synth.alltoall.state import WarmState, recall, remember
from jaxccl.synth.alltoall.warm import PreviousRoutes, keep_previous, kept_prefix, merged_arcs, routes_from
from jaxccl.synth.links import dead_links, usable_topology
from jaxccl.topology import Topology
from jaxccl.util.options import choose, renamed

NAME = "cg_alltoall"
# A warm start keeps the previous chunk count when its rounding is within this fraction of the LP bound.
REUSE_TOLERANCE = 2.5e-3
# A warm repair whose rounding is further than this from the LP bound is rounded again from the full column
# generation's optimum (the better of the two is kept).
REPAIR_ROUNDING_GAP = 5e-3


def alltoall(
    topo: Topology,
    previous: Schedule | None = None,
    *,
    max_chunks: int = 10,
    time_budget: float | None = None,
    max_steps: int | None = None,
    minimize_steps: bool = False,
    method: str | None = None,
    reuse_tolerance: float = REUSE_TOLERANCE,
    name: str = NAME,
    pricing: str | None = None,
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
        method: shortest-path method of the pricing, ``"dag"`` (the step
            sweep over the time-expanded DAG) or ``"dijkstra"`` (compiled,
            exact when the step bound cannot bind); default: ``"dijkstra"``
            when ``m_s >= N``, else ``"dag"``.
        reuse_tolerance: with ``previous``: the previous chunk count is kept
            (and with it most of the previous program) when its rounding is
            within this fraction of the LP bound (see the module docstring);
            0 rounds every ``K`` as a cold start would.
        name: the schedule's name.
        pricing: deprecated old name of ``method`` (removed in the next release).

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
        OptionError: ``method`` is not one of its choices.
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
    method = renamed("alltoall", "pricing", pricing, "method", method, None)
    pricing = choose("method", method, PRICING_METHODS, allow_none=True)
    tol_ok = isinstance(reuse_tolerance, (int, float)) and not isinstance(reuse_tolerance, bool)
    if not (tol_ok and 0 <= reuse_tolerance < 1):
        raise SynthesisError(f"reuse_tolerance must be a fraction in [0, 1), got {reuse_tolerance!r}")
    n = topo.num_gpus
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    net = build_network(usable_topology(topo))
    m_s = net.default_steps if max_steps is None else int(max_steps)
    if m_s < 2:
        raise SynthesisError(f"max_steps must be >= 2 (a path needs at least one hop), got {max_steps!r}")
    timings["network"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = recall(previous) if previous is not None else None
    warm = PreviousRoutes.of(previous, net, state) if previous is not None else None
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
            return keep_previous(previous, warm, kept, name, m_s, timings, t_start, state)

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
                return keep_previous(previous, warm, kept, name, m_s, timings, t_start, state, repaired)
    if repaired is None and not checked and warm is not None and not minimize_steps and warm.chunks <= max_chunks:
        t0 = time.perf_counter()
        kept = warm.still_optimal(m_s, pricing)
        timings["check_previous"] = time.perf_counter() - t0
        if kept is not None:
            return keep_previous(previous, warm, kept, name, m_s, timings, t_start, state)
    step_search = None
    pool = flows = None
    if repaired is not None:
        certificate = repaired.certificate
        z_bound = repaired.z
        lp_loads = repaired.loads
        info: dict[str, Any] = {
            "warm_mode": "repair",
            "lp_converged": True,
            "lp_gap_pct": gap_pct(repaired.z, repaired.upper),
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
            m_s, step_search, res = search_min_steps(net, m_s, warm, deadline, pricing)
        else:
            res = solve_lp(net, m_s, warm, deadline, pricing)
        timings["lp"] = time.perf_counter() - t0
        timings.update({f"lp_{k}": v for k, v in res.timings.items()})
        pool, z_bound = res.pool, (res.z if res.converged else res.upper)
        certificate = res.certificate
        flows = path_flows(pool, res.x)
        lp_loads = pool.loads(np.flatnonzero(res.x > 0), res.x[res.x > 0])
        info = {
            "warm_mode": "cold" if warm is None else "column_generation",
            "lp_converged": bool(res.converged),
            "lp_gap_pct": gap_pct(res.z, res.upper),
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
        if repaired is not None and rounded.rate < z_bound * (1 - REPAIR_ROUNDING_GAP):
            # The repair's optimum is another vertex of the LP; when it rounds badly, round the full column
            # generation's optimum too (seeded with the previous routes) and keep the better rounding.
            t1 = time.perf_counter()
            res = solve_lp(net, m_s, warm, deadline, pricing)
            timings["lp_after_repair"] = time.perf_counter() - t1
            if res.converged:
                other = round_flows(
                    net, res.pool, path_flows(res.pool, res.x), max_chunks=max_chunks, target=z_bound, prefer=prefer
                )
                if other.rate > rounded.rate:
                    pool, rounded = res.pool, other
                    info["warm_mode"] = "column_generation"
                    info["columns_total"] = pool.num_paths
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
        n_kept = kept_prefix(msgs)
        arcs = merged_arcs(msgs, n_kept, prev_arcs, pool)
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
        route, offset = routes_from(state, msgs, n_kept, net, arcs)
    else:
        route, length = route_nodes(net, arcs)
        offset = np.r_[0, np.cumsum(length)]
    paths = paths_table(net, msgs, route, offset)
    info = {
        "algorithm": "column_generation",
        "paper": "MCCL Sec. 4.2, App. D/F/G",
        "chunks": rounded.chunks,
        "lp_bound": n * z_bound * net.unit,
        "gap_pct": gap_pct(rate, z_bound),
        **info,
        "reused_schedule": False,
        "max_steps": m_s,
        "steps_used": int(msgs.hops.max()) if msgs.hops.size else 0,
        "step_search": step_search,
        "per_chunk_algbw": {str(k): n * v * net.unit for k, v in rounded.per_k.items()},
        "topology": topo.fingerprint,
        "dead_links": [[u, v, cap] for u, v, cap in dead_links(topo)],
        "rate_convention": "algbw = N * per-pair rate (bytes of one rank's output buffer / time)",
        "layout": LAYOUT,
        "paths": paths,
    }
    info.update(cut_info(net, lp_loads, rounded.link_chunks))
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
