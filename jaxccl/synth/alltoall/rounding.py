"""Deep-dive rounding of the LP solution to at most ``max_chunks`` chunks per commodity.

MCCL Sec. 4.2 rounds the fractional CG optimum with the deep-dive heuristic
of Huin et al. [18] to "a schedule with at most ten chunks", and App. F
searches the chunk count between 1 and 10. The integer model is the compact
MILP of App. G.2 on the paths the column generation found: every commodity
``(s, d)`` sends ``K`` chunks, ``n_p`` of them on its path ``p``, and the
congestion ``chi = max_a n_a / c_a`` (``n_a`` = chunks crossing link ``a``)
is minimized; the per-commodity rate is ``K / chi``.

For each ``K = 1 .. max_chunks``:

1. The LP optimum scaled by ``K`` gives ``y_p = K * f_p`` chunks per path.
   Commodities routed on one path (most of them: the CG optimum is a vertex)
   are integral already; the others keep ``floor(y_p)`` chunks fixed.
2. Dive: solve the LP "min chi" over the residual chunks of the fractional
   commodities (their paths in the column pool; fixed chunks are constant
   loads), fix every variable that became integral (``floor(y)``), and when
   none did, round up the largest fractional value of the most decided
   commodities; repeat until every chunk is placed. Each LP is a vertex
   (simplex), so after the first one only a few commodities stay fractional.
3. Polish (the three best ``K`` after the dive): move single chunks off
   the bottleneck links to other pool paths of their commodity while that
   lowers ``chi`` (or the number of links at ``chi``).

The smallest ``K`` within 0.1 % of the best rate wins (fewer chunks are
fewer, larger messages; with a warm start the previous ``K`` is preferred
within the same tolerance, so that the previous threadblocks can be
reused); the search stops early at a ``K`` that reaches the LP rate.

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
from jaxccl.synth.alltoall.master import check_status, new_highs
from jaxccl.synth.alltoall.network import Network

_EPS = 1e-7
_ONE_AT_A_TIME = 16  # below this many undecided commodities the dive fixes one per LP
POLISHED_CHUNK_COUNTS = 3  # how many of the best chunk counts after the dive get the polish
CHUNK_TOLERANCE = 1e-3  # fewer chunks are worth up to 0.1 % of rate


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
    """``(len(pids), A)`` 0/1 matrix of the links on each path."""
    arcs = pool.paths[pids]
    rows = np.broadcast_to(np.arange(pids.size)[:, None], arcs.shape)
    ok = arcs >= 0
    return sp.csr_matrix((np.ones(int(ok.sum())), (rows[ok], arcs[ok])), shape=(pids.size, pool.net.num_arcs))


def round_flows(
    net: Network,
    pool: ColumnPool,
    flows: PathFlows,
    *,
    max_chunks: int,
    target: float | None = None,
    prefer: int | None = None,
    tolerance: float = CHUNK_TOLERANCE,
) -> Rounded:
    """Rounds ``flows`` for every ``K <= max_chunks`` and returns the best.

    Args:
        net: the flattened topology.
        pool: the column pool the path ids refer to.
        flows: the LP solution (:func:`path_flows`).
        max_chunks: the largest chunk count per commodity to try.
        target: the LP rate; the search stops early at a ``K`` that reaches it.
        prefer: a chunk count to pick when it is within ``tolerance`` of the
            best (a warm start's previous ``K``: its threadblocks can be reused).
        tolerance: relative rate given up for fewer chunks (or for ``prefer``):
            the result is the smallest ``K`` within it of the best rate found.
    """
    cap = net.capacity
    comm_ids, first = np.unique(flows.comm, return_index=True)
    counts = np.diff(np.append(first, flows.comm.size))
    single = counts == 1
    single_rows = first[single]
    inc_single = _incidence(pool, flows.pid[single_rows])
    base_load = np.asarray(inc_single.sum(axis=0)).ravel()
    frac_comm = comm_ids[~single]
    cand = _candidates(pool, flows, frac_comm)
    lp = _ResidualLP(net, cand) if cand.pid.size else None
    if lp is not None:
        # Purify: a vertex of the path-level LP splits at most one commodity per tight link, while
        # the tree LP's vertex may split a whole tree's worth per extra tree.
        y = lp.solve(base_load, np.ones(cand.num_groups, dtype=np.int64))
        cand = dataclasses.replace(cand, frac=y)
    dived: list[tuple[float, int, np.ndarray, np.ndarray]] = []
    for k in range(1, max_chunks + 1):
        _, fixed_count, loads = _dive(net, lp, cand, base_load * k, k)
        dived.append((_rate(k, loads, cap), k, fixed_count, loads))
        if target is not None and dived[-1][0] >= target * (1 - 1e-9):
            break
    # Polish the most promising chunk counts (the dive is within a few chunks of its best there).
    moves = _moves(cand)
    budget = 20 * cand.num_groups + 100
    per_k = {k: rate for rate, k, _, _ in dived}
    best_dived = max(r for r, *_ in dived)
    ranked = sorted(dived, key=lambda t: (-round(t[0] / best_dived, 10) if best_dived > 0 else 0.0, t[1]))
    chosen = ranked[:POLISHED_CHUNK_COUNTS] + [t for t in ranked[POLISHED_CHUNK_COUNTS:] if t[1] == prefer]
    polished: dict[int, tuple] = {}
    for rate, k, fixed_count, loads in chosen:
        if target is None or rate < target * (1 - 1e-9):
            fixed_count, loads = _polish(net, moves, fixed_count, loads, budget)
            rate = _rate(k, loads, cap)
            per_k[k] = rate
        polished[k] = (rate, (cand.pid, fixed_count, loads))
    best_rate = max(r for r, _ in polished.values())
    near = sorted(k for k, (r, _) in polished.items() if r >= best_rate * (1 - tolerance))
    k = prefer if prefer in near else near[0]
    rate, (fixed_pid, fixed_count, loads) = polished[k]
    comm = np.concatenate([comm_ids[single], cand.comm_of[fixed_count > 0]])
    pid = np.concatenate([flows.pid[single_rows], fixed_pid[fixed_count > 0]])
    count = np.concatenate([np.full(single_rows.size, k), fixed_count[fixed_count > 0]])
    order = np.lexsort((pid, comm))
    per_k = dict(sorted(per_k.items()))
    return Rounded(
        chunks=k,
        comm=comm[order],
        pid=pid[order],
        count=count[order].astype(np.int64),
        link_chunks=loads,
        rate=rate,
        per_k=per_k,
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
    fixed += np.floor(cand.frac * k + _EPS).astype(np.int64)
    residual = k - np.bincount(cand.group, weights=fixed, minlength=cand.num_groups).astype(np.int64)
    for _ in range(4 * k * cand.num_groups + 4):
        if not residual.any():
            break
        y = lp.solve(load + lp.inc_t @ fixed, residual)
        take = np.floor(y + _EPS).astype(np.int64)
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


def _argmax_per_group(values: np.ndarray, group: np.ndarray, num_groups: int) -> np.ndarray:
    """Index (into ``values``) of the largest value of each group (-1 for empty groups)."""
    order = np.lexsort((-values, group))
    g = group[order]
    first = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    out = np.full(num_groups, -1, dtype=np.int64)
    out[g[first]] = order[first]
    return out


class _ResidualLP:
    """``min chi`` over the residual chunks of the fractional commodities (a fresh HiGHS model per solve).

    Columns: ``chi``, then ``y`` per candidate row of a commodity with
    residual chunks (extra chunks on that path). Rows: ``sum_p y_p =
    residual_k`` per such commodity, and ``fixed load_a + sum beta y - c_a
    chi <= 0`` per link they cross; the other links only bound ``chi`` from
    below. (Keeping one model and changing bounds was slower: the warm
    dual simplex then pivots through every commodity already decided.)
    """

    def __init__(self, net: Network, cand: _Candidates):
        self.cap = net.capacity
        self.cand = cand
        self.inc_t = cand.inc.T.tocsr()

    def solve(self, loads: np.ndarray, residual: np.ndarray) -> np.ndarray:
        """``y`` per candidate row for these fixed loads and residual chunks per commodity."""
        cand, cap = self.cand, self.cap
        rows = np.flatnonzero(residual[cand.group] > 0)
        sub = cand.inc[rows].tocsc()
        touched = np.flatnonzero(np.diff(sub.indptr) > 0)
        sub = sub[:, touched].T.tocsr()  # (touched arcs, rows)
        untouched = np.ones(cap.size, dtype=bool)
        untouched[touched] = False
        chi_floor = float(np.max(loads[untouched] / cap[untouched])) if untouched.any() else 0.0
        groups, g_index = np.unique(cand.group[rows], return_inverse=True)
        nv = rows.size
        inf = highspy.kHighsInf
        eq = sp.csr_matrix((np.ones(nv), (g_index.ravel(), np.arange(nv))), shape=(groups.size, nv))
        capm = sp.hstack([sp.csr_matrix(-cap[touched][:, None]), sub])
        a = sp.vstack([sp.hstack([sp.csr_matrix((groups.size, 1)), eq]), capm]).tocsc()
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = nv + 1, a.shape[0]
        lp.col_cost_ = np.r_[1.0, np.zeros(nv)]
        lp.col_lower_ = np.r_[chi_floor, np.zeros(nv)]
        lp.col_upper_ = np.full(nv + 1, inf)
        res = residual[groups].astype(np.float64)
        lp.row_lower_ = np.r_[res, np.full(touched.size, -inf)]
        lp.row_upper_ = np.r_[res, -loads[touched]]
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = a.indptr.astype(np.int32)
        lp.a_matrix_.index_ = a.indices.astype(np.int32)
        lp.a_matrix_.value_ = a.data
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = a.shape[1], a.shape[0]
        h = new_highs()
        h.setOptionValue("solver", "simplex")
        if h.passModel(lp) != highspy.HighsStatus.kOk:
            raise SynthesisError("HiGHS refused the rounding LP")
        h.run()
        check_status(h, "rounding LP")
        y = np.zeros(cand.pid.size)
        y[rows] = np.asarray(h.getSolution().col_value)[1:]
        return y


@dataclasses.dataclass(frozen=True)
class _Moves:
    """Every move "one chunk from candidate row ``r`` to row ``a`` of the same commodity", with its link delta."""

    r_of: np.ndarray
    a_of: np.ndarray
    idx: np.ndarray  # CSR of the (a - r) link incidence difference
    val: np.ndarray
    ptr: np.ndarray
    row_of_nz: np.ndarray


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
    diff = (cand.inc[a_of] - cand.inc[r_of]).tocsr()
    diff.eliminate_zeros()
    nz = np.diff(diff.indptr) > 0
    r_of, a_of, diff = r_of[nz], a_of[nz], diff[nz]
    if r_of.size == 0:
        return None
    return _Moves(
        r_of=r_of,
        a_of=a_of,
        idx=diff.indices,
        val=diff.data,
        ptr=diff.indptr,
        row_of_nz=np.repeat(np.arange(r_of.size), np.diff(diff.indptr)),
    )


def _polish(net: Network, moves: _Moves | None, count: np.ndarray, loads: np.ndarray, max_moves: int):
    """Moves single chunks off the bottleneck links while that helps (best improvement first).

    A move takes one chunk of a candidate row to another row of the same
    commodity. It is allowed when no link rises above ``chi`` and fewer
    links stay at ``chi`` afterwards (once none does, ``chi`` dropped). All
    moves are scored at once on the sparse difference of the two paths.
    """
    count = count.copy()
    loads = loads.astype(np.float64).copy()
    if moves is None:
        return count, loads
    cap = net.capacity
    idx, val, ptr, row_of_nz = moves.idx, moves.val, moves.ptr, moves.row_of_nz
    r_of, a_of = moves.r_of, moves.a_of
    for _ in range(max_moves):
        ratio = loads / cap
        chi = float(ratio.max())
        level = chi * (1 - 1e-12)
        hot = ratio >= level
        new = (loads[idx] + val) / cap[idx]
        worst = np.maximum.reduceat(new, ptr[:-1])
        cooled = np.bincount(row_of_nz, weights=hot[idx] & (new < level), minlength=r_of.size)
        heated = np.bincount(row_of_nz, weights=~hot[idx] & (new >= level), minlength=r_of.size)
        score = cooled - heated
        ok = (worst <= chi * (1 + 1e-12)) & (count[r_of] > 0) & (score > 0)
        if not ok.any():
            break
        best = int(np.flatnonzero(ok)[np.argmax(score[ok])])
        count[r_of[best]] -= 1
        count[a_of[best]] += 1
        sl = slice(ptr[best], ptr[best + 1])
        loads[idx[sl]] += val[sl]
    return count, loads
