"""Warm start by local repair: re-optimize only what a change touched, then prove it optimal.

MCCL's premise (Sec. 4.1) is that an anomaly disrupts a localized part of
the topology, so the previous optimum should constrain the new search. Here
that is taken literally, with a certificate that keeps it exact:

1. The previous chunk routes are split into the commodities whose routes
   still fit (all their chunks routed over existing links, none over a link
   the previous routes now overload, see :attr:`.warm.PreviousRoutes.overloaded`)
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

from jaxccl.errors import SynthesisError
from jaxccl.synth.alltoall.cg import RC_TOL, BestBound, Certificate, utilization_prices
from jaxccl.synth.alltoall.columns import ColumnPool
from jaxccl.synth.alltoall.master import check_status, new_highs
from jaxccl.synth.alltoall.network import Network
from jaxccl.synth.alltoall.pricing import pair_paths, shortest_path_trees
from jaxccl.synth.alltoall.rounding import PathFlows

# Beyond this share of all commodities a change is not local: full column generation instead.
MAX_AFFECTED_SHARE = 0.25


@dataclasses.dataclass
class Repaired:
    """A certified LP optimum built from the previous routes.

    Attributes:
        z: LP optimum (per-commodity rate, capacity units).
        upper: the Lagrangian bound that certifies it (``z <= upper <= z (1 + GAP_TOL)``).
        pool: the paths of the affected commodities (previous routes and repaired paths).
        flows: their path fractions (the kept commodities stay on their routes, see :meth:`complete`).
        loads: ``(A,)`` link loads at rate ``z``.
        iterations: RMP solves of the repair LP.
        columns_generated: paths added by its pricing.
        affected: commodities re-optimized.
        kept_routes: previous routes kept as they were.
        kept_rows: their rows in the given routes.
        fixed_chunks: ``(A,)`` chunks per link of the kept routes.
        chunks: the previous ``K``.
        routes: the given ``(src, dst, count, arcs)``.
        simplex_iterations: of the repair LP.
        timings: seconds per phase.
        certificate: the prices of ``upper`` (see :class:`.cg.Certificate`).
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
    kept_rows: np.ndarray
    fixed_chunks: np.ndarray
    chunks: int
    routes: tuple
    certificate: Certificate | None = None

    def complete(self) -> tuple[ColumnPool, PathFlows]:
        """The pool and flows of the whole solution: the kept routes (with their shares) added."""
        if self._complete is None:
            src, dst, count, arcs = self.routes
            k = self.kept_rows
            pid = self.pool.add_paths(src[k], dst[k], arcs[k])
            n = self.pool.net.num_gpus
            comm = np.r_[src[k] * n + dst[k], self.flows.comm]
            pids = np.r_[pid, self.flows.pid]
            frac = np.r_[count[k] / self.chunks, self.flows.frac]
            self._complete = (self.pool, _flows(comm, pids, frac, self.pool.num_paths))
        return self._complete

    _complete: tuple | None = dataclasses.field(default=None, repr=False, compare=False)


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
    link_chunks: np.ndarray | None = None,
    hops: np.ndarray | None = None,
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
        link_chunks: ``(A,)`` the routes' chunks per link, if already at hand.
        hops: ``(R,)`` the routes' GPU-to-GPU hops, if already at hand.
    """
    timings = {"setup": 0.0, "master": 0.0, "pricing": 0.0, "certificate": 0.0}
    t0 = time.perf_counter()
    n = net.num_gpus
    # -1 pads index the appended False: no mask needed. (Few entries are hits: rows from their flat positions.)
    crosses = np.zeros(arcs.shape[0], dtype=bool)
    crosses[np.flatnonzero(np.take(np.append(overloaded, False), arcs).ravel()) // max(arcs.shape[1], 1)] = True
    if hops is None:
        hops = np.take(np.append(net.advances, False), arcs).sum(axis=1)
    crosses |= hops > max_steps - 1
    comm = src * n + dst
    # Kept: every chunk still routed (over existing links) and no route over an overloaded link.
    total = np.bincount(comm, weights=count, minlength=n * n)
    bad = np.zeros(n * n, dtype=bool)
    bad[comm[crosses]] = True
    pairs = np.flatnonzero(~np.eye(n, dtype=bool).ravel())
    affected = pairs[bad[pairs] | (total[pairs] != chunks)]
    if affected.size == 0 or affected.size > MAX_AFFECTED_SHARE * pairs.size:
        return None
    is_affected = np.zeros(n * n, dtype=bool)
    is_affected[affected] = True
    aff_row = is_affected[comm]
    aff_idx = np.flatnonzero(aff_row)
    # The pool holds the affected commodities' paths only; the kept routes are fixed loads.
    pool = ColumnPool(net)
    pid_aff = pool.add_paths(src[aff_idx], dst[aff_idx], arcs[aff_idx])
    # Fixed loads of the kept commodities, in chunks and in units of one commodity's demand.
    a_arcs = arcs[aff_idx]
    valid = a_arcs >= 0
    a_load = np.bincount(
        a_arcs[valid], weights=np.broadcast_to(count[aff_idx][:, None], a_arcs.shape)[valid], minlength=net.num_arcs
    )
    if link_chunks is None:
        valid = arcs >= 0
        weights = np.broadcast_to(count[:, None], arcs.shape)[valid]
        link_chunks = np.bincount(arcs[valid], weights=weights, minlength=net.num_arcs)
    fixed_chunks = np.maximum(np.asarray(link_chunks, dtype=np.float64) - a_load, 0.0)
    fixed = fixed_chunks / chunks
    # First columns of the affected commodities: their previous routes and their 1/capacity paths.
    a_src, a_dst = affected // n, affected % n
    # The shortest paths for costs 1 / capacity (the cold start's initial trees), of these pairs only.
    _, init_paths = pair_paths(net, 1.0 / net.capacity, a_src, a_dst, max_steps=max_steps, method=pricing, exact=False)
    init_pid = pool.add_paths(a_src, a_dst, init_paths)
    group_of = np.searchsorted(affected, comm[aff_idx])
    lp = _RepairLP(net, affected.size, fixed)
    # Distinct (commodity, path) columns, in first-seen order.
    all_g, all_p = np.r_[group_of, np.arange(affected.size)], np.r_[pid_aff, init_pid]
    _, first = np.unique(all_g * (pool.num_paths + 1) + all_p, return_index=True)
    first.sort()
    cols_g, cols_p = all_g[first], all_p[first]
    seen = set(zip(cols_g.tolist(), cols_p.tolist()))
    lp.add(cols_g, cols_p, pool)
    # The LP starts from every commodity on its 1 / capacity path (its column: the first with that path).
    col_keys = cols_g * (pool.num_paths + 1) + cols_p
    by_key = np.argsort(col_keys)
    init_keys = np.arange(affected.size) * (pool.num_paths + 1) + init_pid
    lp.start_from(by_key[np.searchsorted(col_keys[by_key], init_keys)], pool)
    timings["setup"] = time.perf_counter() - t0
    generated = 0
    it = 0
    converged = False
    while it < max_iterations:
        it += 1
        t1 = time.perf_counter()
        chi, y, pi, alpha = lp.solve()
        t2 = time.perf_counter()
        timings["master"] += t2 - t1
        # Every source's tree at the duals: the affected pairs' prices, and (once nothing prices out) the
        # Lagrangian certificate at the same prices, without a second run.
        at_duals = shortest_path_trees(net, alpha, max_steps=max_steps, extract=False, method=pricing)
        dist = at_duals.dist[np.searchsorted(at_duals.sources, a_src), a_dst]
        tol = RC_TOL * max(float(np.max(np.abs(pi))), 1e-300)
        neg = np.flatnonzero(dist < pi - tol)
        if neg.size == 0:
            timings["pricing"] += time.perf_counter() - t2
            converged = True
            break
        # The paths of the pairs that price out (the tie-breaking run, for them only).
        _, priced = pair_paths(net, alpha, a_src[neg], a_dst[neg], max_steps=max_steps, method=pricing, exact=False)
        timings["pricing"] += time.perf_counter() - t2
        new_pid = pool.add_paths(a_src[neg], a_dst[neg], priced)
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
    loads = fixed + lp.loads(used, y[used], pool)
    best = BestBound(net, max_steps)
    best.offer(alpha, at_duals.cost)
    for prices in [] if best.closes(z) else utilization_prices(net, loads):
        best.offer(prices, shortest_path_trees(net, prices, max_steps=max_steps, extract=False, method=pricing).cost)
        if best.closes(z):
            break
    timings["certificate"] = time.perf_counter() - t3
    if not best.closes(z):
        return None
    # Solution flows of the affected commodities: the repaired paths with their LP fractions.
    flows = _flows(affected[lp.group[used]], lp.pid[used], y[used], pool.num_paths)
    return Repaired(
        z=z,
        upper=max(best.upper, z),
        certificate=best.certificate,
        pool=pool,
        flows=flows,
        loads=loads * z,
        iterations=it,
        columns_generated=generated,
        affected=int(affected.size),
        kept_routes=int(aff_row.size - aff_idx.size),
        simplex_iterations=lp.simplex_iterations,
        timings=timings,
        kept_rows=np.flatnonzero(~aff_row),
        fixed_chunks=fixed_chunks,
        chunks=int(chunks),
        routes=(src, dst, count, arcs),
    )


def _flows(comm: np.ndarray, pid: np.ndarray, frac: np.ndarray, num_paths: int) -> PathFlows:
    """Path fractions per commodity (duplicates summed), rows sorted by commodity."""
    key = comm * (num_paths + 1) + pid
    uniq, inverse = np.unique(key, return_inverse=True)
    total = np.bincount(inverse.ravel(), weights=frac)
    return PathFlows(comm=uniq // (num_paths + 1), pid=uniq % (num_paths + 1), frac=total)


class _RepairLP:
    """``min chi``: ``sum_p y_kp = 1`` per affected commodity, ``fixed_a + sum beta y <= c_a chi`` per link.

    Only the links some column crosses get a row (added with the columns);
    every other link only bounds ``chi`` from below by ``fixed_a / c_a``,
    which is ``chi``'s lower bound. The link prices are those of the full LP:
    the rows' duals, plus the lower bound's reduced cost on the link that sets it.
    """

    def __init__(self, net: Network, groups: int, fixed: np.ndarray):
        self.net = net
        self.fixed = np.asarray(fixed, dtype=np.float64)
        inf = highspy.kHighsInf
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = 1, groups
        lp.col_cost_ = np.array([1.0])
        lp.col_lower_ = np.zeros(1)
        lp.col_upper_ = np.array([inf])
        lp.row_lower_ = np.ones(groups)
        lp.row_upper_ = np.ones(groups)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.array([0, 0], dtype=np.int32)
        lp.a_matrix_.index_ = np.zeros(0, dtype=np.int32)
        lp.a_matrix_.value_ = np.zeros(0)
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = 1, groups
        self.h = new_highs()
        self.h.setOptionValue("presolve", "off")
        self.h.setOptionValue("solver", "simplex")
        # Primal simplex: the first solve starts from a feasible basis (start_from), and added columns keep it
        # feasible. (From HiGHS's own start the dual simplex needed ~7x the pivots, 2.4x the time, at 128 GPUs.)
        self.h.setOptionValue("simplex_strategy", 4)
        if self.h.passModel(lp) != highspy.HighsStatus.kOk:
            raise SynthesisError("HiGHS refused the repair LP")
        self.groups = groups
        self.row_of = np.full(net.num_arcs, -1, dtype=np.int64)  # LP row of each link (-1: none)
        self.rows: list[int] = []
        self._floor()
        self.group = np.zeros(0, dtype=np.int64)
        self.pid = np.zeros(0, dtype=np.int64)
        self.simplex_iterations = 0

    def _floor(self) -> None:
        """``chi >= max fixed_a / c_a`` over the links without a row."""
        free = self.row_of < 0
        ratio = np.where(free, self.fixed / self.net.capacity, -np.inf)
        self.floor_arc = int(np.argmax(ratio)) if free.any() else -1
        floor = max(float(ratio[self.floor_arc]), 0.0) if free.any() else 0.0
        self.h.changeColBounds(0, floor, highspy.kHighsInf)

    def add(self, group: np.ndarray, pid: np.ndarray, pool: ColumnPool) -> None:
        if group.size == 0:
            return
        arcs = pool.paths[pid]
        ok = arcs >= 0
        k = pid.size
        used = np.unique(arcs[ok])
        new = used[self.row_of[used] < 0]
        if new.size:
            # Rows of the links these columns open: -c_a chi (+ the new columns) <= -fixed_a.
            first = self.groups + len(self.rows)
            self.row_of[new] = first + np.arange(new.size)
            self.rows.extend(new.tolist())
            status = self.h.addRows(
                new.size,
                np.full(new.size, -highspy.kHighsInf),
                -self.fixed[new],
                new.size,
                np.arange(new.size, dtype=np.int32),
                np.zeros(new.size, dtype=np.int32),
                -self.net.capacity[new],
            )
            if status != highspy.HighsStatus.kOk:
                raise SynthesisError("HiGHS refused rows of the repair LP")
            self._floor()
        length = ok.sum(axis=1)
        # Column j: its commodity row, then the rows of its links (a path crosses a link at most once).
        start = np.r_[0, np.cumsum(length + 1)]
        index = np.empty(int(start[-1]), dtype=np.int32)
        head = start[:-1]
        index[head] = group
        body = np.ones(index.size, dtype=bool)
        body[head] = False
        index[body] = self.row_of[arcs[ok]]
        status = self.h.addCols(
            k,
            np.zeros(k),
            np.zeros(k),
            np.full(k, highspy.kHighsInf),
            index.size,
            head.astype(np.int32),
            index,
            np.ones(index.size),
        )
        if status != highspy.HighsStatus.kOk:
            raise SynthesisError("HiGHS refused columns of the repair LP")
        self.group = np.r_[self.group, group]
        self.pid = np.r_[self.pid, pid]

    def start_from(self, cols: np.ndarray, pool: ColumnPool) -> bool:
        """Starts the simplex from the basis "commodity ``k`` entirely on path column ``cols[k]``".

        Basic: those columns, ``chi`` (unless it sits at its lower bound) and
        the slack of every link row but the one that sets ``chi``; nonsingular
        (the commodity rows are an identity block, ``chi`` pivots on its row)
        and primal feasible. Returns whether HiGHS took it.
        """
        status = highspy.HighsBasisStatus
        num_rows = self.groups + len(self.rows)
        load = self.fixed + self.loads(cols, np.ones(cols.size), pool)
        rows = np.asarray(self.rows, dtype=np.int64)
        ratio = load[rows] / self.net.capacity[rows]
        a = self.floor_arc
        floor = max(float(self.fixed[a] / self.net.capacity[a]), 0.0) if a >= 0 else 0.0
        col = [status.kLower] * (1 + self.pid.size)
        row = [status.kLower] * self.groups + [status.kBasic] * len(self.rows)
        for j in (cols + 1).tolist():
            col[j] = status.kBasic
        if ratio.size and ratio.max() > floor:
            col[0] = status.kBasic
            row[self.groups + int(np.argmax(ratio))] = status.kUpper
        basis = highspy.HighsBasis()
        basis.col_status, basis.row_status = col, row
        basis.valid = True
        return len(row) == num_rows and self.h.setBasis(basis) == highspy.HighsStatus.kOk

    def loads(self, cols: np.ndarray, y: np.ndarray, pool: ColumnPool) -> np.ndarray:
        """``(A,)`` link loads of path columns ``cols`` carrying ``y`` each."""
        arcs = pool.paths[self.pid[cols]]
        ok = arcs >= 0
        return np.bincount(arcs[ok], weights=np.broadcast_to(y[:, None], arcs.shape)[ok], minlength=self.net.num_arcs)

    def solve(self) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
        """``(chi, y per path column, commodity duals pi, link prices alpha >= 0)``."""
        self.h.run()
        check_status(self.h, "repair LP")
        self.simplex_iterations += int(self.h.getInfo().simplex_iteration_count)
        sol = self.h.getSolution()
        col = np.asarray(sol.col_value)
        dual = np.asarray(sol.row_dual)
        alpha = np.zeros(self.net.num_arcs)
        rows = np.asarray(self.rows, dtype=np.int64)
        alpha[rows] = np.maximum(-dual[self.groups :], 0.0)
        if self.floor_arc >= 0:
            # chi at its lower bound: that link's row would carry the bound's reduced cost.
            reduced = float(np.asarray(sol.col_dual)[0])
            if reduced > 0:
                alpha[self.floor_arc] += reduced / self.net.capacity[self.floor_arc]
        return float(col[0]), col[1:], dual[: self.groups], alpha
