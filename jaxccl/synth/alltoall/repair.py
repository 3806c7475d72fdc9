"""Warm start by local repair: re-optimize only what a change touched, then prove it optimal.

MCCL's premise (Sec. 4.1) is that an anomaly disrupts a localized part of
the topology, so the previous optimum should constrain the new search. Here
that is taken literally, with a certificate that keeps it exact:

1. The previous chunk routes are split into the commodities whose routes
   still fit (all their chunks routed over existing links, none over a link
   the previous routes now overload, see :attr:`.driver._Warm.overloaded`)
   and the *affected* ones (the others, including pairs whose links are gone).
2. The kept commodities stay on their routes as fixed loads; the affected
   ones get a path-level concurrent-flow LP (``min chi`` with every affected
   commodity delivering one unit), solved by column generation on HiGHS:
   columns are paths, pricing is a shortest-path search from the affected
   sources with the capacity duals (the same pricing as :mod:`.cg`).
3. The combined solution (kept routes + repaired paths) is a feasible point
   of the full LP with rate ``z = 1 / chi``. It is accepted only when a
   Lagrangian bound over *all* commodities (priced with the repair's own
   capacity duals, or the utilization prices of :mod:`.cg`) meets ``z``;
   then ``z`` is the global LP optimum. Otherwise the caller falls back to
   the full column generation seeded with the previous trees.

Rates here are per commodity in capacity units, as in :mod:`.cg`.
"""

from __future__ import annotations

import dataclasses
import time

import highspy
import numpy as np
import scipy.sparse as sp

from jaxccl.errors import SynthesisError
from jaxccl.synth.alltoall.cg import GAP_TOL, RC_TOL, initial_trees, lagrangian_bound, utilization_prices
from jaxccl.synth.alltoall.columns import ColumnPool
from jaxccl.synth.alltoall.master import check_status, new_highs
from jaxccl.synth.alltoall.network import Network
from jaxccl.synth.alltoall.pricing import shortest_path_trees
from jaxccl.synth.alltoall.rounding import PathFlows

# Beyond this share of all commodities a change is not local: full column generation instead.
MAX_AFFECTED_SHARE = 0.25


@dataclasses.dataclass
class Repaired:
    """A certified LP optimum built from the previous routes.

    Attributes:
        z: LP optimum (per-commodity rate, capacity units).
        upper: the Lagrangian bound that certifies it (``z <= upper <= z (1 + GAP_TOL)``).
        pool: the paths (previous routes and repaired paths).
        flows: per-commodity path fractions of the solution.
        loads: ``(A,)`` link loads at rate ``z``.
        iterations: RMP solves of the repair LP.
        columns_generated: paths added by its pricing.
        affected: commodities re-optimized.
        kept_routes: previous routes kept as they were.
        simplex_iterations: of the repair LP.
        timings: seconds per phase.
    """

    z: float
    upper: float
    pool: ColumnPool
    flows: PathFlows
    loads: np.ndarray
    iterations: int
    columns_generated: int
    affected: int
    kept_routes: int
    simplex_iterations: int
    timings: dict[str, float]


def repair(
    net: Network,
    src: np.ndarray,
    dst: np.ndarray,
    count: np.ndarray,
    arcs: np.ndarray,
    chunks: int,
    overloaded: np.ndarray,
    *,
    max_steps: int,
    pricing: str | None = None,
    deadline: float | None = None,
    max_iterations: int = 200,
) -> Repaired | None:
    """Repairs the previous routes ``(src, dst, count, arcs)`` (``chunks`` per commodity); None if not certified.

    Args:
        net: the flattened topology.
        src, dst, count, arcs: the previous routes that still exist on ``net``
            (``arcs`` -1 padded); a commodity whose counts do not sum to
            ``chunks`` lost routes and is re-optimized.
        chunks: the previous chunk count ``K``.
        overloaded: ``(A,)`` links whose routes must be re-optimized.
        max_steps: ``m_s``.
        pricing: the shortest-path method.
        deadline: ``time.perf_counter()`` after which the repair gives up.
        max_iterations: cap on repair-LP solves.
    """
    timings = {"setup": 0.0, "master": 0.0, "pricing": 0.0, "certificate": 0.0}
    t0 = time.perf_counter()
    n = net.num_gpus
    safe = np.maximum(arcs, 0)
    crosses = np.any((arcs >= 0) & overloaded[safe], axis=1)
    crosses |= np.where(arcs >= 0, net.advances[safe], False).sum(axis=1) > max_steps - 1
    comm = src * n + dst
    # Kept: every chunk still routed (over existing links) and no route over an overloaded link.
    total = np.bincount(comm, weights=count, minlength=n * n)
    bad = np.zeros(n * n, dtype=bool)
    bad[comm[crosses]] = True
    pairs = np.flatnonzero(~np.eye(n, dtype=bool).ravel())
    affected = pairs[bad[pairs] | (total[pairs] != chunks)]
    if affected.size == 0 or affected.size > MAX_AFFECTED_SHARE * pairs.size:
        return None
    aff_row = np.isin(comm, affected)
    pool = ColumnPool(net)
    pid = pool.add_paths(src, dst, arcs)
    # Fixed loads of the kept commodities, in units of one commodity's demand.
    keep = ~aff_row
    valid = arcs[keep] >= 0
    weight = np.broadcast_to((count[keep] / chunks)[:, None], arcs[keep].shape)[valid]
    fixed = np.bincount(arcs[keep][valid], weights=weight, minlength=net.num_arcs)
    # First columns of the affected commodities: their previous routes and their 1/capacity paths.
    a_src, a_dst = affected // n, affected % n
    init_src, init_paths = initial_trees(net, max_steps, pricing=pricing)
    row_of = np.full(n, -1, dtype=np.int64)
    row_of[init_src] = np.arange(init_src.size)
    init_pid = pool.add_paths(a_src, a_dst, init_paths[row_of[a_src], a_dst])
    group_of = np.searchsorted(affected, comm[aff_row])
    lp = _RepairLP(net, affected.size, fixed)
    seen: set[tuple[int, int]] = set()
    cols_g, cols_p = [], []
    for g, p in zip(np.r_[group_of, np.arange(affected.size)].tolist(), np.r_[pid[aff_row], init_pid].tolist()):
        if (g, p) not in seen:
            seen.add((g, p))
            cols_g.append(g)
            cols_p.append(p)
    lp.add(np.array(cols_g), np.array(cols_p), pool)
    timings["setup"] = time.perf_counter() - t0
    sources = np.unique(a_src)
    generated = 0
    it = 0
    converged = False
    while it < max_iterations:
        it += 1
        t1 = time.perf_counter()
        chi, y, pi, alpha = lp.solve()
        t2 = time.perf_counter()
        timings["master"] += t2 - t1
        trees = shortest_path_trees(net, alpha, sources=sources, max_steps=max_steps, method=pricing)
        row = np.searchsorted(sources, a_src)
        dist = trees.dist[row, a_dst]
        tol = RC_TOL * max(float(np.max(np.abs(pi))), 1e-300)
        neg = np.flatnonzero(dist < pi - tol)
        timings["pricing"] += time.perf_counter() - t2
        if neg.size == 0:
            converged = True
            break
        new_pid = pool.add_paths(a_src[neg], a_dst[neg], trees.paths[row[neg], a_dst[neg]])
        fresh = [(g, p) for g, p in zip(neg.tolist(), new_pid.tolist()) if (g, p) not in seen]
        if not fresh:
            converged = True  # numerically converged: every priced path is already a column
            break
        seen.update(fresh)
        lp.add(np.array([g for g, _ in fresh]), np.array([p for _, p in fresh]), pool)
        generated += len(fresh)
        if deadline is not None and time.perf_counter() >= deadline:
            return None
    if not converged or not chi > 0:
        return None
    t3 = time.perf_counter()
    z = 1.0 / chi
    used = np.flatnonzero(y > 1e-12)
    loads = fixed + np.asarray(lp.incidence[:, used] @ y[used]).ravel()
    upper = np.inf
    for prices in [alpha, *utilization_prices(net, loads)]:
        cost = shortest_path_trees(net, prices, max_steps=max_steps, extract=False, method=pricing).cost
        upper = min(upper, lagrangian_bound(net, prices, cost))
        if np.isfinite(upper) and upper - z <= GAP_TOL * upper:
            break
    timings["certificate"] = time.perf_counter() - t3
    if not (np.isfinite(upper) and upper - z <= GAP_TOL * upper):
        return None
    # Solution flows: kept routes with their shares, repaired paths with their LP fractions.
    f_comm = np.r_[comm[keep], affected[lp.group[used]]]
    f_pid = np.r_[pid[keep], lp.pid[used]]
    f_frac = np.r_[count[keep] / chunks, y[used]]
    key = f_comm * (pool.num_paths + 1) + f_pid
    uniq, inverse = np.unique(key, return_inverse=True)
    frac = np.bincount(inverse.ravel(), weights=f_frac)
    flows = PathFlows(comm=uniq // (pool.num_paths + 1), pid=uniq % (pool.num_paths + 1), frac=frac)
    return Repaired(
        z=z,
        upper=max(upper, z),
        pool=pool,
        flows=flows,
        loads=loads * z,
        iterations=it,
        columns_generated=generated,
        affected=int(affected.size),
        kept_routes=int(keep.sum()),
        simplex_iterations=lp.simplex_iterations,
        timings=timings,
    )


class _RepairLP:
    """``min chi``: ``sum_p y_kp = 1`` per affected commodity, ``fixed_a + sum beta y <= c_a chi`` per link."""

    def __init__(self, net: Network, groups: int, fixed: np.ndarray):
        self.net = net
        a = net.num_arcs
        inf = highspy.kHighsInf
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = 1, groups + a
        lp.col_cost_ = np.array([1.0])
        lp.col_lower_ = np.zeros(1)
        lp.col_upper_ = np.array([inf])
        lp.row_lower_ = np.r_[np.ones(groups), np.full(a, -inf)]
        lp.row_upper_ = np.r_[np.ones(groups), -fixed]
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.array([0, a], dtype=np.int32)
        lp.a_matrix_.index_ = (groups + np.arange(a)).astype(np.int32)
        lp.a_matrix_.value_ = -net.capacity
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = 1, groups + a
        self.h = new_highs()
        self.h.setOptionValue("presolve", "off")
        self.h.setOptionValue("solver", "simplex")
        if self.h.passModel(lp) != highspy.HighsStatus.kOk:
            raise SynthesisError("HiGHS refused the repair LP")
        self.groups = groups
        self.group = np.zeros(0, dtype=np.int64)
        self.pid = np.zeros(0, dtype=np.int64)
        self.incidence = sp.csc_matrix((a, 0))
        self.simplex_iterations = 0

    def add(self, group: np.ndarray, pid: np.ndarray, pool: ColumnPool) -> None:
        if group.size == 0:
            return
        arcs = pool.paths[pid]
        ok = arcs >= 0
        cols = np.broadcast_to(np.arange(pid.size)[:, None], arcs.shape)[ok]
        inc = sp.csc_matrix((np.ones(int(ok.sum())), (arcs[ok], cols)), shape=(self.net.num_arcs, pid.size))
        full = sp.vstack(
            [sp.csc_matrix((np.ones(pid.size), (group, np.arange(pid.size))), shape=(self.groups, pid.size)), inc]
        ).tocsc()
        k = pid.size
        status = self.h.addCols(
            k,
            np.zeros(k),
            np.zeros(k),
            np.full(k, highspy.kHighsInf),
            full.nnz,
            full.indptr[:-1].astype(np.int32),
            full.indices.astype(np.int32),
            full.data,
        )
        if status != highspy.HighsStatus.kOk:
            raise SynthesisError("HiGHS refused columns of the repair LP")
        self.group = np.r_[self.group, group]
        self.pid = np.r_[self.pid, pid]
        self.incidence = sp.hstack([self.incidence, inc]).tocsc()

    def solve(self) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
        """``(chi, y per path column, commodity duals pi, link prices alpha >= 0)``."""
        self.h.run()
        check_status(self.h, "repair LP")
        self.simplex_iterations += int(self.h.getInfo().simplex_iteration_count)
        sol = self.h.getSolution()
        col = np.asarray(sol.col_value)
        dual = np.asarray(sol.row_dual)
        return float(col[0]), col[1:], dual[: self.groups], np.maximum(-dual[self.groups :], 0.0)
