"""The master LP of the AllToAll synthesis: seeded column generation, and MCCL App. D's step search."""

from __future__ import annotations

import numpy as np

from jaxccl.errors import SynthesisError
from jaxccl.synth.alltoall.cg import CGResult, column_generation, initial_trees
from jaxccl.synth.alltoall.network import Network
from jaxccl.synth.alltoall.warm import PreviousRoutes


def solve_lp(
    net: Network, m_s: int, warm: PreviousRoutes | None, deadline: float | None, pricing: str | None
) -> CGResult:
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


def search_min_steps(net: Network, m_s: int, warm: PreviousRoutes | None, deadline: float | None, pricing: str | None):
    """MCCL App. D: binary search for the smallest step bound that still reaches the optimum at ``m_s``.

    Each trial re-runs column generation on the truncated DAG, seeded with
    the trees of earlier trials that fit in its steps (MCCL's warm start).
    Trials list ``[m_test, algbw]`` (0 when some pair has no route); the
    returned run is the one at the smallest optimal bound.
    """
    best = solve_lp(net, m_s, warm, deadline, pricing)
    target = best.z
    lo, hi, best_m = 2, m_s - 1, m_s
    trials: list[list[float]] = [[m_s, best.z * net.num_gpus * net.unit]]
    carried = best
    iterations, columns = best.iterations, best.columns_generated
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            method = pricing if mid >= net.num_gpus else "dag"
            seeds = step_feasible(carried, mid) or [initial_trees(net, mid, pricing=method)]
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


def step_feasible(res: CGResult, m_s: int) -> list[tuple[np.ndarray, np.ndarray]]:
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
