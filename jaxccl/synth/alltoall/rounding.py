"""Deep-dive rounding of the LP solution to at most ``max_chunks`` chunks per commodity.

MCCL Sec. 4.2 rounds the fractional CG optimum with the deep-dive heuristic
of Huin et al. [18] to "a schedule with at most ten chunks", and App. F
searches the chunk count between 1 and 10. The integer model is the compact
MILP of App. G.2 on the paths the column generation found: every commodity
``(s, d)`` sends ``K`` chunks, ``n_p`` of them on its path ``p``, and the
congestion ``chi = max_a n_a / c_a`` (``n_a`` = chunks crossing link ``a``)
is minimized; the per-commodity rate is ``K / chi``.

For each ``K = 1 .. max_chunks``:

0. Purify (once): the column generation's optimum mixes trees, so a
   vertex of it may split many commodities; the path-level LP "min chi"
   restricted to the paths it uses has the same optimum, and a vertex of
   it splits at most one commodity per tight link (an 8x8 torus: 184
   split commodities instead of 3070, and a 370-column LP instead of one
   over all 52,000 pool paths of those commodities).
1. The LP optimum scaled by ``K`` gives ``y_p = K * f_p`` chunks per path.
   Commodities routed on one path (most of them: the CG optimum is a vertex)
   are integral already; the others keep ``floor(y_p)`` chunks fixed.
2. Dive: solve the LP "min chi" over the residual chunks of the fractional
   commodities (their paths in the column pool; fixed chunks are constant
   loads), fix every variable that became integral (``floor(y)``), and when
   none did, round up the largest fractional value of the most decided
   commodities; repeat until every chunk is placed. Each LP is a vertex
   (simplex), so after the first one only a few commodities stay fractional.
   When the fractional commodities have more than ``FULL_DIVE_ROWS`` pool
   paths, the dive's LPs take their LP support only (an 8x8 torus: 369
   paths instead of 3,902, and LPs ten times cheaper at the same rate for
   every ``K``); the polish below still moves chunks to every pool path.
3. Polish (the three best ``K`` after the dive): move single chunks off
   the bottleneck links to other pool paths of their commodity while that
   lowers ``chi`` (or the number of links at ``chi``).

The smallest ``K`` within 0.1 % of the best rate wins (fewer chunks are
fewer, larger messages; with a warm start the previous ``K`` is preferred
within the same tolerance, so that the previous threadblocks can be
reused); the search stops early at a ``K`` within that tolerance of the LP
rate (no larger ``K`` could be picked). A warm start may also round at one
``K`` only, with the untouched commodities as fixed link loads
(:func:`round_at`), or take the previous ``K`` at once when it is within a
tolerance of the LP rate (``keep_within``).

Deviation: the paper fixes one column per dive step and re-runs column
generation between fixes; here the dive fixes batches and stays on the
paths already in the pool (the LP support plus every other path the pricing
produced for that commodity), which keeps each step a small LP.
"""

from __future__ import annotations

import dataclasses

import highspy
import numpy as np
import scipy.sparse as sp

from jaxccl.errors import SynthesisError
from jaxccl.synth.alltoall.columns import ColumnPool
from jaxccl.synth.alltoall.layout import concat_ranges
from jaxccl.synth.alltoall.master import check_status, new_highs
from jaxccl.synth.alltoall.network import Network

_EPS = 1e-7
_ONE_AT_A_TIME = 16  # below this many undecided commodities the dive fixes one per LP
POLISHED_CHUNK_COUNTS = 3  # how many of the best chunk counts after the dive get the polish
CHUNK_TOLERANCE = 1e-3  # fewer chunks are worth up to 0.1 % of rate
FULL_DIVE_ROWS = 2000  # the most candidate rows the dive's LPs take all of (else the LP support only)


@dataclasses.dataclass(frozen=True)
class PathFlows:
    """Per-commodity path fractions of an LP solution (rows sorted by commodity).

    Attributes:
        comm: ``(R,)`` commodity ``s * N + d`` of each row.
        pid: ``(R,)`` path id (in the column pool).
        frac: ``(R,)`` fraction of the commodity on that path (sums to 1 per commodity).
    """

    comm: np.ndarray
    pid: np.ndarray
    frac: np.ndarray


@dataclasses.dataclass(frozen=True)
class Rounded:
    """An integer solution: ``count`` chunks of commodity ``comm`` on path ``pid``.

    Attributes:
        chunks: ``K``, chunks per commodity.
        comm, pid, count: one row per used (commodity, path).
        link_chunks: ``(A,)`` chunks crossing each link.
        rate: per-commodity rate ``K / chi`` in capacity units.
        per_k: ``{K: rate}`` of every chunk count tried.
    """

    chunks: int
    comm: np.ndarray
    pid: np.ndarray
    count: np.ndarray
    link_chunks: np.ndarray
    rate: float
    per_k: dict[int, float]


def path_flows(pool: ColumnPool, x: np.ndarray) -> PathFlows:
    """Splits the tree weights ``x`` into per-commodity path fractions."""
    n = pool.net.num_gpus
    used = np.flatnonzero(x > 0)
    src = pool.col_src[used]
    total = np.bincount(src, weights=x[used], minlength=n)
    if np.any(total[np.unique(pool.col_src)] <= 0):
        raise SynthesisError("LP solution routes nothing for some source")
    pid = pool.col_paths[used]
    weight = np.broadcast_to((x[used] / total[src])[:, None], pid.shape)
    comm = np.broadcast_to((src * n)[:, None] + np.arange(n)[None, :], pid.shape)
    valid = pid >= 0
    key = comm[valid].astype(np.int64) * (pool.num_paths + 1) + pid[valid]
    uniq, inverse = np.unique(key, return_inverse=True)
    frac = np.bincount(inverse.ravel(), weights=weight[valid])
    ucomm = uniq // (pool.num_paths + 1)
    upid = uniq % (pool.num_paths + 1)
    keep = frac > 1e-12
    ucomm, upid, frac = ucomm[keep], upid[keep], frac[keep]
    sums = np.bincount(np.unique(ucomm, return_inverse=True)[1].ravel(), weights=frac)
    frac = frac / np.repeat(sums, np.bincount(np.unique(ucomm, return_inverse=True)[1].ravel()))
    return PathFlows(comm=ucomm, pid=upid, frac=frac)


def _incidence(pool: ColumnPool, pids: np.ndarray) -> sp.csr_matrix:
    """``(len(pids), A)`` 0/1 matrix of the links on each path (built as CSR directly: a path has no repeated link)."""
    pad = np.iinfo(np.int32).max
    arcs = np.sort(np.where(pool.paths[pids] >= 0, pool.paths[pids], pad), axis=1)
    ok = arcs != pad
    indptr = np.r_[0, np.cumsum(ok.sum(axis=1))]
    indices = arcs[ok]
    return sp.csr_matrix((np.ones(indices.size), indices, indptr), shape=(pids.size, pool.net.num_arcs))


def round_flows(
    net: Network,
    pool: ColumnPool,
    flows: PathFlows,
    *,
    max_chunks: int,
    target: float | None = None,
    prefer: int | None = None,
    tolerance: float = CHUNK_TOLERANCE,
    keep_within: float = 0.0,
) -> Rounded:
    """Rounds ``flows`` for every ``K <= max_chunks`` and returns the best.

    Args:
        net: the flattened topology.
        pool: the column pool the path ids refer to.
        flows: the LP solution (:func:`path_flows`).
        max_chunks: the largest chunk count per commodity to try.
        target: the LP rate; the search stops early at a ``K`` within ``tolerance`` of it
            (and not below ``prefer``).
        prefer: a chunk count to pick when it is within ``tolerance`` of the
            best (a warm start's previous ``K``: its threadblocks can be reused).
        tolerance: relative rate given up for fewer chunks (or for ``prefer``):
            the result is the smallest ``K`` within it of the best rate found.
        keep_within: with ``prefer`` and ``target``: ``prefer`` is rounded
            first and taken at once if it is within this fraction of
            ``target`` (no other ``K`` is tried).
    """
    r = _Rounding(net, pool, flows, target=target)
    if prefer is not None and target is not None and keep_within > 0 and 1 <= prefer <= max_chunks:
        rate, fixed_count, loads = r.polish(prefer, *r.dive(prefer))
        if rate >= target * (1 - keep_within):
            return r.finish(prefer, rate, fixed_count, loads, {prefer: rate})
    dived: list[tuple[float, int, np.ndarray, np.ndarray]] = []
    for k in range(1, max_chunks + 1):
        rate, fixed_count, loads = r.dive(k)
        dived.append((rate, k, fixed_count, loads))
        # A K within the tolerance of the LP rate is within it of the best too: no larger K can be
        # picked (the smallest one within the tolerance wins), unless it is the preferred one.
        reached = target is not None and dived[-1][0] >= target * (1 - max(tolerance, 1e-9))
        if reached and (prefer is None or k >= prefer):
            break
    # Polish the most promising chunk counts (the dive is within a few chunks of its best there).
    per_k = {k: rate for rate, k, _, _ in dived}
    best_dived = max(rate for rate, *_ in dived)
    ranked = sorted(dived, key=lambda t: (-round(t[0] / best_dived, 10) if best_dived > 0 else 0.0, t[1]))
    chosen = ranked[:POLISHED_CHUNK_COUNTS] + [t for t in ranked[POLISHED_CHUNK_COUNTS:] if t[1] == prefer]
    polished: dict[int, tuple] = {}
    for rate, k, fixed_count, loads in chosen:
        polished[k] = r.polish(k, rate, fixed_count, loads)
        per_k[k] = polished[k][0]
    best_rate = max(rate for rate, *_ in polished.values())
    near = sorted(k for k, (rate, *_) in polished.items() if rate >= best_rate * (1 - tolerance))
    k = prefer if prefer in near else near[0]
    return r.finish(k, *polished[k], per_k)


def round_at(
    net: Network,
    pool: ColumnPool,
    flows: PathFlows,
    chunks: int,
    *,
    fixed_load: np.ndarray | None = None,
    target: float | None = None,
    purify: bool = True,
) -> Rounded:
    """Rounds ``flows`` to exactly ``chunks`` chunks per commodity (dive and polish).

    ``fixed_load`` are chunks per link of commodities outside ``flows``
    that stay as they are (a warm start's untouched routes): they load the
    links and count in the rate, but only the rows of ``flows`` are returned.
    ``purify=False`` skips the purification LP, for flows that already are a
    vertex of a path-level LP (the repair LP's solution).
    """
    r = _Rounding(net, pool, flows, target=target, fixed_load=fixed_load, k_fixed=chunks, purify=purify)
    rate, fixed_count, loads = r.polish(chunks, *r.dive(chunks))
    return r.finish(chunks, rate, fixed_count, loads, {chunks: rate})


class _Rounding:
    """One LP solution being rounded: its integral commodities, the candidates of the others, the dive LP."""

    def __init__(
        self,
        net: Network,
        pool: ColumnPool,
        flows: PathFlows,
        *,
        target: float | None,
        fixed_load: np.ndarray | None = None,
        k_fixed: int | None = None,
        purify: bool = True,
    ):
        self.fixed_load = None if fixed_load is None else np.asarray(fixed_load, dtype=np.float64)
        self.k_fixed = k_fixed
        if purify:
            scale = 1.0 / k_fixed if k_fixed else 1.0
            flows = _purified(net, pool, flows, None if fixed_load is None else self.fixed_load * scale)
        self.net, self.flows, self.target = net, flows, target
        comm_ids, first = np.unique(flows.comm, return_index=True)
        counts = np.diff(np.append(first, flows.comm.size))
        single = counts == 1
        self.single_comm = comm_ids[single]
        self.single_rows = first[single]
        single_arcs = pool.paths[flows.pid[self.single_rows]]
        self.base_load = np.bincount(single_arcs[single_arcs >= 0], minlength=net.num_arcs).astype(np.float64)
        cand = _candidates(pool, flows, comm_ids[~single])
        # Above FULL_DIVE_ROWS candidate rows the dive's LPs see the LP support only (see the module docstring).
        columns = cand.frac > 0 if cand.pid.size > FULL_DIVE_ROWS else None
        self.lp = _ResidualLP(net, cand, columns=columns) if cand.pid.size else None
        self.cand = cand
        self._moves: _Moves | None | bool = False  # built on the first polish
        self.budget = 20 * cand.num_groups + 100

    def _load(self, k: int) -> np.ndarray:
        """Link loads (chunks) of the integral commodities at ``k`` chunks, fixed loads included."""
        load = self.base_load * k
        if self.fixed_load is not None:
            # The fixed loads are given in chunks at k_fixed; at another k they scale.
            load = load + self.fixed_load * (k / self.k_fixed if self.k_fixed else 1.0)
        return load

    def dive(self, k: int) -> tuple[float, np.ndarray, np.ndarray]:
        """``(rate, chunks per candidate row, loads)`` of the dive at ``k`` chunks."""
        _, fixed_count, loads = _dive(self.net, self.lp, self.cand, self._load(k), k)
        return _rate(k, loads, self.net.capacity), fixed_count, loads

    def polish(self, k: int, rate: float, fixed_count: np.ndarray, loads: np.ndarray):
        """The polished ``(rate, chunks per candidate row, loads)`` (unchanged once at the target)."""
        if self.target is None or rate < self.target * (1 - 1e-9):
            if self._moves is False:
                self._moves = _moves(self.cand)
            fixed_count, loads = _polish(self.net, self._moves, fixed_count, loads, self.budget)
            rate = _rate(k, loads, self.net.capacity)
        return rate, fixed_count, loads

    def finish(self, k: int, rate: float, fixed_count: np.ndarray, loads: np.ndarray, per_k: dict) -> Rounded:
        cand, rows = self.cand, self.single_rows
        comm = np.concatenate([self.single_comm, cand.comm_of[fixed_count > 0]])
        pid = np.concatenate([self.flows.pid[rows], cand.pid[fixed_count > 0]])
        count = np.concatenate([np.full(rows.size, k), fixed_count[fixed_count > 0]])
        order = np.lexsort((pid, comm))
        return Rounded(
            chunks=k,
            comm=comm[order],
            pid=pid[order],
            count=count[order].astype(np.int64),
            link_chunks=loads,
            rate=rate,
            per_k=dict(sorted(per_k.items())),
        )


@dataclasses.dataclass
class _Candidates:
    """Candidate paths of the fractional commodities (rows grouped by commodity)."""

    comm_of: np.ndarray  # (M,) commodity of each candidate row
    group: np.ndarray  # (M,) index of the commodity in the fractional list
    pid: np.ndarray  # (M,) path id
    frac: np.ndarray  # (M,) LP fraction (0 for pool paths outside the LP support)
    inc: sp.csr_matrix  # (M, A) link incidence
    num_groups: int


def _candidates(pool: ColumnPool, flows: PathFlows, frac_comm: np.ndarray) -> _Candidates:
    n = pool.net.num_gpus
    if frac_comm.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return _Candidates(empty, empty, empty, np.zeros(0), _incidence(pool, empty), 0)
    in_lp = np.isin(flows.comm, frac_comm)
    lp_comm, lp_pid, lp_frac = flows.comm[in_lp], flows.pid[in_lp], flows.frac[in_lp]
    # Every other path of these commodities that the pricing produced.
    src, dst = pool.path_src, pool.path_dst
    all_comm = src * n + dst
    extra = np.flatnonzero(np.isin(all_comm, frac_comm))
    comm = np.concatenate([lp_comm, all_comm[extra]])
    pid = np.concatenate([lp_pid, extra])
    frac = np.concatenate([lp_frac, np.zeros(extra.size)])
    key = comm * (pool.num_paths + 1) + pid
    _, keep = np.unique(key, return_index=True)  # the LP rows come first: their fraction is kept
    comm, pid, frac = comm[keep], pid[keep], frac[keep]
    order = np.lexsort((pid, comm))
    comm, pid, frac = comm[order], pid[order], frac[order]
    group = np.searchsorted(frac_comm, comm)
    return _Candidates(comm, group, pid, frac, _incidence(pool, pid), int(frac_comm.size))


def _rate(k: int, loads: np.ndarray, cap: np.ndarray) -> float:
    chi = float(np.max(loads / cap))
    return k / chi if chi > 0 else np.inf


def _dive(net: Network, lp: _ResidualLP | None, cand: _Candidates, load: np.ndarray, k: int):
    """The dive for chunk count ``k``: ``(path ids, chunks per candidate row, loads)``."""
    m = cand.pid.size
    fixed = np.zeros(m, dtype=np.int64)
    if m == 0 or lp is None:
        return cand.pid, fixed, load.astype(np.float64)
    fixed += _whole_chunks(cand.frac * k, cand.group, np.full(cand.num_groups, k))
    residual = k - np.bincount(cand.group, weights=fixed, minlength=cand.num_groups).astype(np.int64)
    for _ in range(4 * k * cand.num_groups + 4):
        if not residual.any():
            break
        y = lp.solve(load + lp.inc_t @ fixed, residual)
        take = _whole_chunks(y, cand.group, residual)
        if not take.any():
            # Round up the most decided commodities: the largest fractional value each.
            active = np.flatnonzero(residual > 0)
            rows = np.flatnonzero(residual[cand.group] > 0)
            best_row = rows[_argmax_per_group(y[rows], cand.group[rows], cand.num_groups)[active]]
            vals = y[best_row]
            order = np.argsort(-vals, kind="stable")
            # Fix one at a time (the dive proper) while few remain, else the most decided eighth.
            batch = 1 if active.size <= _ONE_AT_A_TIME else int(np.ceil(active.size / 8))
            take = np.zeros(m, dtype=np.int64)
            take[best_row[order[:batch]]] = 1
        fixed += take
        residual = k - np.bincount(cand.group, weights=fixed, minlength=cand.num_groups).astype(np.int64)
        if (residual < 0).any():  # pragma: no cover - guarded by the LP's equality rows
            raise SynthesisError("rounding placed too many chunks")
    if residual.any():  # pragma: no cover
        raise SynthesisError("rounding did not converge")
    return cand.pid, fixed, load + lp.inc_t @ fixed


def _purified(net: Network, pool: ColumnPool, flows: PathFlows, fixed_load: np.ndarray | None) -> PathFlows:
    """A vertex of the path-level LP on the paths ``flows`` uses, with the same optimum.

    The tree LP's vertex may split a whole tree's worth of commodities per
    extra tree; a vertex of the path-level LP ("min chi", every commodity
    on its support paths) splits at most one commodity per tight link, so
    that few commodities are left to round. Restricted to the support, the
    LP is as small as the solution and keeps its optimum.
    """
    comm_ids, first = np.unique(flows.comm, return_index=True)
    counts = np.diff(np.append(first, flows.comm.size))
    if (counts == 1).all():
        return flows
    rows = np.repeat(counts > 1, counts)
    group = np.searchsorted(comm_ids[counts > 1], flows.comm[rows])
    inc = _incidence(pool, flows.pid[rows])
    cand = _Candidates(flows.comm[rows], group, flows.pid[rows], flows.frac[rows], inc, int((counts > 1).sum()))
    single_rows = first[counts == 1]
    arcs = pool.paths[flows.pid[single_rows]]
    load = np.bincount(arcs[arcs >= 0], minlength=net.num_arcs).astype(np.float64)
    if fixed_load is not None:
        load = load + fixed_load
    y = _ResidualLP(net, cand).solve(load, np.ones(cand.num_groups, dtype=np.int64))
    frac = flows.frac.copy()
    frac[rows] = np.clip(y, 0.0, 1.0)
    keep = frac > _EPS
    comm, pid, frac = flows.comm[keep], flows.pid[keep], frac[keep]
    frac = frac / np.bincount(np.searchsorted(comm_ids, comm), weights=frac)[np.searchsorted(comm_ids, comm)]
    return PathFlows(comm=comm, pid=pid, frac=frac)


def _whole_chunks(y: np.ndarray, group: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """The whole chunks of the LP values ``y``: never negative, at most ``limit[g]`` per group ``g``.

    An LP solution is exact only up to the solver's tolerances (a fraction
    ``1.0000001`` beside ``-1e-7``); rounded naively, such noise places a
    chunk too many on one path and a negative one on another.

    >>> import numpy as np
    >>> _whole_chunks(np.array([7.0000006, -6e-7, 2.5]), np.array([0, 0, 1]), np.array([7, 3])).tolist()
    [7, 0, 2]
    """
    take = np.maximum(np.floor(y + _EPS), 0).astype(np.int64)
    excess = np.bincount(group, weights=take, minlength=limit.size).astype(np.int64) - limit
    for g in np.flatnonzero(excess > 0):
        rows = np.flatnonzero(group == g)
        for row in rows[np.argsort(-take[rows], kind="stable")]:
            cut = min(int(take[row]), int(excess[g]))
            take[row] -= cut
            excess[g] -= cut
            if not excess[g]:
                break
    return take


def _argmax_per_group(values: np.ndarray, group: np.ndarray, num_groups: int) -> np.ndarray:
    """Index (into ``values``) of the largest value of each group (-1 for empty groups)."""
    order = np.lexsort((-values, group))
    g = group[order]
    first = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    out = np.full(num_groups, -1, dtype=np.int64)
    out[g[first]] = order[first]
    return out


class _ResidualLP:
    """``min chi`` over the residual chunks of the fractional commodities (a fresh model per solve).

    Columns: ``chi``, then ``y`` per candidate row of a commodity with
    residual chunks (extra chunks on that path), among ``columns`` (default: all). Rows: ``sum_p y_p =
    residual_k`` per such commodity, and ``fixed load_a + sum beta y - c_a
    chi <= 0`` per link they cross; the other links only bound ``chi`` from
    below. (Keeping one model and changing bounds was slower: the warm
    dual simplex then pivots through every commodity already decided.) The
    model is assembled column-wise with numpy and passed to one HiGHS
    instance (presolve off: the models are small and presolve dominated).
    """

    def __init__(self, net: Network, cand: _Candidates, *, columns: np.ndarray | None = None):
        self.cap = net.capacity
        self.cand = cand
        self.columns = np.ones(cand.pid.size, dtype=bool) if columns is None else np.asarray(columns, dtype=bool)
        self.inc_t = cand.inc.T.tocsr()
        inc = cand.inc.tocsr()
        self._ptr, self._idx, self._val = inc.indptr.astype(np.int64), inc.indices.astype(np.int64), inc.data
        self.solves = 0
        self._h = new_highs()
        self._h.setOptionValue("solver", "simplex")
        self._h.setOptionValue("presolve", "off")

    def solve(self, loads: np.ndarray, residual: np.ndarray) -> np.ndarray:
        """``y`` per candidate row for these fixed loads and residual chunks per commodity."""
        cand, cap = self.cand, self.cap
        rows = np.flatnonzero((residual[cand.group] > 0) & self.columns)
        nv = rows.size
        lo, length = self._ptr[rows], self._ptr[rows + 1] - self._ptr[rows]
        total = int(length.sum())
        pos = np.repeat(lo - (np.cumsum(length) - length), length) + np.arange(total)
        arcs, vals = self._idx[pos], self._val[pos]
        touched, arc_row = np.unique(arcs, return_inverse=True)
        untouched = np.ones(cap.size, dtype=bool)
        untouched[touched] = False
        chi_floor = float(np.max(loads[untouched] / cap[untouched])) if untouched.any() else 0.0
        groups, g_row = np.unique(cand.group[rows], return_inverse=True)
        ng, nt = groups.size, touched.size
        # Column-wise: chi (-c_a on every touched link row), then per y its commodity row and its link rows.
        start = np.empty(nv + 2, dtype=np.int64)
        start[0], start[1] = 0, nt
        start[2:] = nt + np.cumsum(length + 1)
        index = np.empty(nt + nv + total, dtype=np.int32)
        value = np.empty(nt + nv + total, dtype=np.float64)
        index[:nt] = ng + np.arange(nt)
        value[:nt] = -cap[touched]
        head = start[1:-1]
        index[head] = g_row.ravel()
        value[head] = 1.0
        body = np.ones(index.size, dtype=bool)
        body[:nt] = False
        body[head] = False
        index[body] = ng + arc_row.ravel()
        value[body] = vals
        inf = highspy.kHighsInf
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = nv + 1, ng + nt
        lp.col_cost_ = np.r_[1.0, np.zeros(nv)]
        lp.col_lower_ = np.r_[chi_floor, np.zeros(nv)]
        lp.col_upper_ = np.full(nv + 1, inf)
        res = residual[groups].astype(np.float64)
        lp.row_lower_ = np.r_[res, np.full(nt, -inf)]
        lp.row_upper_ = np.r_[res, -loads[touched]]
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = start.astype(np.int32)
        lp.a_matrix_.index_ = index
        lp.a_matrix_.value_ = value
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = nv + 1, ng + nt
        h = self._h
        if h.passModel(lp) != highspy.HighsStatus.kOk:
            raise SynthesisError("HiGHS refused the rounding LP")
        h.run()
        check_status(h, "rounding LP")
        self.solves += 1
        y = np.zeros(cand.pid.size)
        y[rows] = np.asarray(h.getSolution().col_value)[1:]
        return y


@dataclasses.dataclass(frozen=True)
class _Moves:
    """Every move "one chunk from candidate row ``r`` to row ``a`` of the same commodity", with its link delta."""

    r_of: np.ndarray  # sorted
    a_of: np.ndarray
    idx: np.ndarray  # CSR of the (a - r) link incidence difference
    val: np.ndarray
    ptr: np.ndarray
    first: np.ndarray  # (M + 1,) the moves of candidate row r are first[r]:first[r + 1]
    inc: sp.csr_matrix  # (M, A) link incidence of the candidate rows


def _moves(cand: _Candidates) -> _Moves | None:
    g = cand.group
    if g.size < 2:
        return None
    first = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    size = np.diff(np.r_[first, g.size])
    of_row = np.repeat(np.arange(first.size), size)
    reps = size[of_row]
    r_of = np.repeat(np.arange(g.size), reps)
    k = np.arange(r_of.size) - np.repeat(np.cumsum(reps) - reps, reps)
    a_of = first[of_row[r_of]] + k
    keep = a_of != r_of
    r_of, a_of = r_of[keep], a_of[keep]
    if r_of.size == 0:
        return None
    # The link difference (a - r) of every move: +1 on a's links, -1 on r's, shared links cancel.
    ptr, idx = cand.inc.indptr, cand.inc.indices
    la, lr = ptr[a_of + 1] - ptr[a_of], ptr[r_of + 1] - ptr[r_of]
    move = np.r_[np.repeat(np.arange(a_of.size), la), np.repeat(np.arange(r_of.size), lr)]
    link = np.r_[idx[concat_ranges(ptr[a_of], ptr[a_of + 1])], idx[concat_ranges(ptr[r_of], ptr[r_of + 1])]]
    sign = np.r_[np.ones(int(la.sum())), -np.ones(int(lr.sum()))]
    keys, inverse = np.unique(move * cand.inc.shape[1] + link, return_inverse=True)
    val = np.bincount(inverse.ravel(), weights=sign)
    keep = val != 0
    keys, val = keys[keep], val[keep]
    m_of = keys // cand.inc.shape[1]
    alive, counts = np.unique(m_of, return_counts=True)
    if alive.size == 0:
        return None
    return _Moves(
        r_of=r_of[alive],
        a_of=a_of[alive],
        idx=keys % cand.inc.shape[1],
        val=val,
        ptr=np.r_[0, np.cumsum(counts)],
        first=np.searchsorted(r_of[alive], np.arange(g.size + 1)),
        inc=cand.inc.tocsr(),
    )


def _polish(net: Network, moves: _Moves | None, count: np.ndarray, loads: np.ndarray, max_moves: int):
    """Moves single chunks off the bottleneck links while that helps (best improvement first).

    A move takes one chunk of a candidate row to another row of the same
    commodity. It is allowed when no link rises above ``chi`` and fewer
    links stay at ``chi`` afterwards (once none does, ``chi`` dropped). Only
    a move from a row with chunks on a link at ``chi`` can cool one, so
    those moves are scored, all at once, on the sparse difference of the
    two paths.
    """
    count = count.copy()
    loads = loads.astype(np.float64).copy()
    if moves is None:
        return count, loads
    cap = net.capacity
    idx, val, ptr, first = moves.idx, moves.val, moves.ptr, moves.first
    for _ in range(max_moves):
        ratio = loads / cap
        chi = float(ratio.max())
        level = chi * (1 - 1e-12)
        hot = ratio >= level
        rows = np.flatnonzero((moves.inc @ hot.astype(np.float64) > 0) & (count > 0))
        mv = concat_ranges(first[rows], first[rows + 1])
        if mv.size == 0:
            break
        length = ptr[mv + 1] - ptr[mv]
        nz = concat_ranges(ptr[mv], ptr[mv + 1])
        at, new = idx[nz], (loads[idx[nz]] + val[nz]) / cap[idx[nz]]
        worst = np.maximum.reduceat(new, np.r_[0, np.cumsum(length)[:-1]])
        move_of_nz = np.repeat(np.arange(mv.size), length)
        cooled = np.bincount(move_of_nz, weights=hot[at] & (new < level), minlength=mv.size)
        heated = np.bincount(move_of_nz, weights=~hot[at] & (new >= level), minlength=mv.size)
        score = cooled - heated
        ok = (worst <= chi * (1 + 1e-12)) & (score > 0)
        if not ok.any():
            break
        best = int(mv[np.flatnonzero(ok)[np.argmax(score[ok])]])
        count[moves.r_of[best]] -= 1
        count[moves.a_of[best]] += 1
        sl = slice(ptr[best], ptr[best + 1])
        loads[idx[sl]] += val[sl]
    return count, loads
