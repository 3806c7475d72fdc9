"""Column generation for the AllToAll master problem (MCCL Sec. 4.2).

Alternates between the restricted master problem (:class:`.master.Master`)
and the pricing of every tensor on the time-expanded DAG
(:func:`.pricing.shortest_path_trees`), adding every tree that prices out
(one per source and iteration: many columns per iteration), until no tree
prices out.

Each iteration also yields the Lagrangian (Farley) upper bound: for any link
prices ``alpha_a >= 0``, every tensor's flow ``z`` costs at least ``z *
mincost_c(alpha)``, and the total cost is at most ``sum_a alpha_a c_a``, so
``z <= sum_a alpha_a c_a / sum_c mincost_c(alpha)``. With the RMP's optimal
duals the numerator is the RMP optimum, so the relative gap is
``1 / sum_c mincost_c - 1``; it reaches 0 exactly when no column prices out.
The time-bounded mode stops when the budget is spent and reports this bound.

The prices of the best bound are kept as a :class:`Certificate`: the
denominator depends only on the prices, the links and the step bound, so the
same prices bound the LP of *any* capacities on those links at the cost of
one dot product. A warm start uses it to prove the previous routes still
optimal after a change that did not touch the priced links (MCCL's fail1, a
degraded NVSwitch, when the bottleneck is the NICs) without pricing anything.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxccl.synth.alltoall.columns import ColumnPool
from jaxccl.synth.alltoall.master import Master
from jaxccl.synth.alltoall.network import Network
from jaxccl.synth.alltoall.pricing import shortest_path_trees

# A tree prices out when its reduced cost is below -RC_TOL * max(alpha_c); the
# loop also stops once the Lagrangian gap is below GAP_TOL (relative).
RC_TOL = 1e-9
GAP_TOL = 1e-9


@dataclasses.dataclass(frozen=True, eq=False)
class Certificate:
    """Link prices ``alpha >= 0`` and ``sum_c mincost_c(alpha)`` on the time-expanded DAG of ``max_steps`` steps.

    :meth:`bound` is the Lagrangian upper bound of :func:`lagrangian_bound`
    for any capacities of the same links (the min-cost sum does not depend
    on capacities).

    >>> import numpy as np
    >>> Certificate(np.array([1.0, 0.0]), 2.0, 3).bound(np.array([4.0, 9.0]))
    2.0
    """

    prices: np.ndarray
    mincost: float
    max_steps: int

    def bound(self, capacity: np.ndarray) -> float:
        """``sum_a alpha_a c_a / sum_c mincost_c``: an upper bound on the LP optimum with capacities ``capacity``."""
        return float(self.prices @ capacity) / self.mincost if self.mincost > 0 else np.inf


class BestBound:
    """The smallest Lagrangian bound offered so far and its :class:`Certificate`."""

    def __init__(self, net: Network, max_steps: int) -> None:
        self.net, self.max_steps = net, int(max_steps)
        self.upper = np.inf
        self.certificate: Certificate | None = None

    def offer(self, prices: np.ndarray, mincost: np.ndarray) -> float:
        """Bounds the LP with ``prices`` (``mincost``: per-tensor min costs at them); returns the best bound."""
        value = lagrangian_bound(self.net, prices, mincost)
        if value < self.upper:
            self.upper = value
            self.certificate = Certificate(np.array(prices, dtype=np.float64), float(mincost.sum()), self.max_steps)
        return self.upper

    def closes(self, z: float) -> bool:
        """Whether the best bound proves ``z`` optimal (relative gap at most ``GAP_TOL``)."""
        return _closed(z, self.upper)


@dataclasses.dataclass
class CGResult:
    """Outcome of :func:`column_generation`.

    Attributes:
        z: RMP optimum (per-commodity rate, capacity units).
        upper: best Lagrangian upper bound on the full LP (== ``z`` when converged).
        x: ``(columns,)`` tree weights at the optimum.
        pool: the column pool (trees and their paths).
        converged: no column priced out (or the gap closed).
        iterations: RMP solves.
        columns_generated: trees added by pricing (excludes the initial and reused ones).
        timings: seconds spent in ``master``, ``pricing``, ``columns``.
        history: per iteration ``(z, upper, new columns)``.
        certificate: the prices of the best Lagrangian bound (see :class:`Certificate`).
    """

    z: float
    upper: float
    x: np.ndarray
    alpha_a: np.ndarray
    pool: ColumnPool
    master: Master
    converged: bool
    iterations: int
    columns_generated: int
    max_steps: int
    timings: dict[str, float]
    history: list[tuple[float, float, int]]
    steps_used: int = 0
    certificate: Certificate | None = None


def initial_trees(net: Network, max_steps: int, *, pricing: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One tree per source: the shortest paths for costs ``1 / capacity``.

    Cheap-and-wide links are preferred and degraded ones avoided, which gives
    the first RMP a non-trivial throughput.
    """
    t = shortest_path_trees(net, 1.0 / net.capacity, max_steps=max_steps, method=pricing)
    return t.sources, t.paths


def column_generation(
    net: Network,
    *,
    max_steps: int,
    seed_trees: list[tuple[np.ndarray, np.ndarray]] = (),
    reused_trees: list[tuple[np.ndarray, np.ndarray]] = (),
    deadline: float | None = None,
    max_iterations: int = 100_000,
    diversify: bool = True,
    pricing: str | None = None,
) -> CGResult:
    """Runs column generation to LP optimality (or the deadline).

    Args:
        net: the flattened topology.
        max_steps: ``m_s`` of the time-expanded DAG.
        seed_trees: ``(sources, paths)`` blocks added before the first solve.
        reused_trees: like ``seed_trees`` but counted as reused (warm start).
        deadline: ``time.perf_counter()`` value after which the loop stops
            with the best solution so far.
        max_iterations: safety cap on RMP solves.
        diversify: also add the trees of the primal-guided prices (see
            :func:`utilization_prices`) that price out at the RMP duals.
        pricing: the shortest-path method of :func:`.pricing.shortest_path_trees`
            (``"dag"`` or ``"dijkstra"``; default: its own).
    """
    timings = {"master": 0.0, "pricing": 0.0, "columns": 0.0}
    pool = ColumnPool(net)
    master = Master(net)
    t0 = time.perf_counter()
    for origin, blocks in ((1, reused_trees), (0, seed_trees)):
        for src, paths in blocks:
            cols = pool.add(src, paths, origin=origin)
            _push(pool, master, cols)
    timings["columns"] += time.perf_counter() - t0
    best = BestBound(net, max_steps)
    upper = np.inf
    history: list[tuple[float, float, int]] = []
    generated = 0
    converged = False
    steps_used = 0
    it = 0
    while True:
        it += 1
        t0 = time.perf_counter()
        remaining = None if deadline is None else deadline - time.perf_counter()
        solved = master.solve(time_limit=None if remaining is None or it == 1 else max(remaining, 0.0))
        if solved is None:  # time budget spent inside the RMP: keep the last solution
            it -= 1
            break
        z, x, alpha_c, alpha_a = solved
        t1 = time.perf_counter()
        timings["master"] += t1 - t0
        tol = RC_TOL * max(float(alpha_c.max()), 1e-300)
        trees = shortest_path_trees(
            net, alpha_a, max_steps=max_steps, extract=True, extract_below=alpha_c - tol, method=pricing
        )
        steps_used = max(steps_used, trees.steps)
        upper = best.offer(alpha_a, trees.cost)
        extra = []
        if not _closed(z, upper):
            used = np.flatnonzero(x > 0)
            for cand in utilization_prices(net, pool.loads(used, x[used])):
                guided = shortest_path_trees(net, cand, max_steps=max_steps, extract=diversify, method=pricing)
                upper = best.offer(cand, guided.cost)
                if diversify:
                    # The trees these prices route also enter the RMP when they price out at its duals.
                    rmp_cost = np.append(alpha_a, 0.0)[guided.paths].sum(axis=(1, 2))
                    sel = np.flatnonzero(rmp_cost < alpha_c - tol)
                    if sel.size:
                        extra.append((guided.sources[sel], guided.paths[sel]))
        neg = trees.extracted
        gap_closed = _closed(z, upper)
        t2 = time.perf_counter()
        timings["pricing"] += t2 - t1
        if not neg.any() or gap_closed:
            converged = True
            if not neg.any():
                upper = min(upper, z)
            history.append((z, upper, 0))
            break
        if it >= max_iterations or (deadline is not None and time.perf_counter() >= deadline):
            history.append((z, upper, 0))
            break
        sel = np.flatnonzero(neg)
        cols = pool.add(trees.sources[sel], trees.paths[sel])
        for src, paths in extra:
            cols = np.concatenate([cols, pool.add(src, paths)])
        _push(pool, master, cols)
        timings["columns"] += time.perf_counter() - t2
        generated += cols.size
        history.append((z, upper, int(cols.size)))
        if cols.size == 0:  # every priced tree is already in the RMP: numerically converged
            converged = True
            break
    return CGResult(
        z=z,
        upper=max(upper, z),
        x=x,
        alpha_a=alpha_a,
        pool=pool,
        master=master,
        converged=converged,
        iterations=it,
        columns_generated=generated,
        max_steps=max_steps,
        timings=timings,
        history=history,
        steps_used=steps_used,
        certificate=best.certificate,
    )


def _closed(z: float, upper: float) -> bool:
    return bool(np.isfinite(upper) and upper - z <= GAP_TOL * upper)


def lagrangian_bound(net: Network, alpha_a: np.ndarray, mincost: np.ndarray) -> float:
    """``sum_a c_a alpha_a / sum_c mincost_c(alpha)``: an upper bound on the LP optimum for any ``alpha >= 0``."""
    denom = float(mincost.sum())
    return float(alpha_a @ net.capacity) / denom if denom > 0 else np.inf


def utilization_prices(net: Network, loads: np.ndarray) -> list[np.ndarray]:
    """Candidate link prices read off a primal solution's link loads.

    The simplex duals of the RMP are extreme points of a hugely degenerate
    optimal face (on a balanced rail every NIC link is saturated and a single
    one of them carries the whole dual), so their Lagrangian bound is useless
    and plain column generation needs about one iteration per saturated link
    to move them. Uniform prices on the most utilized links, and a soft-max
    of the utilizations, are cheap alternatives: when the primal is optimal
    they usually certify it at once (their bound equals its rate); otherwise
    they just give a weaker bound, and their trees diversify the RMP.
    Deviation from MCCL, which does not say how its CG copes with
    degeneracy; the master problem and the pricing are unchanged.
    """
    util = np.asarray(loads, dtype=np.float64) / net.capacity
    top = float(util.max()) if util.size else 0.0
    if not top > 0:
        return []
    rel = util / top
    return [(rel >= 1 - 1e-7).astype(np.float64), np.exp(_SOFTMAX_SHARPNESS * (rel - 1))]


_SOFTMAX_SHARPNESS = 100.0


def _push(pool: ColumnPool, master: Master, cols: np.ndarray) -> None:
    if cols.size == 0:
        return
    starts, arcs, counts = pool.beta(cols)
    master.add_columns(pool.col_src[cols], starts, arcs, counts)
