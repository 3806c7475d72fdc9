"""Latency-aware switch removal (MCCL App. C): an LP per switch with a star-inducing penalty.

For switch ``w`` with predecessors ``u`` (ingress ``c_uw``) and successors
``v`` (egress ``c_wv``), the logical links ``a = (u, v)``, ``u != v``, get
capacities ``y_a`` solving (MCCL App. C, (5)-(10))::

    max   M * sum_a y_a - sum_a h_a                                        (5)
    s.t.  h_a >= k' y_a - w_u k' (k' - 1) / 2      a = (u, v), k' = 1..K     (6)
          sum_v y_uv <= c_uw                       every predecessor u     (7)
          sum_u y_uv <= c_wv                       every successor v       (8)
          sum_{a in cut X} y_a >= MT - OF_X        every cut X             (9)
          y, h >= 0                                                        (10)

with ``K = |succ(w)| - 1``, the width ``w_u = floor(c_uw / K)`` (the fair
per-successor share of ``u``'s ingress) and ``M = N^2 c_max`` so throughput
always dominates the penalty. (6) is the lower envelope of a convex
piecewise-linear penalty whose ``k'``-th piece has slope ``k'``: putting more on
one link costs more than spreading it, which biases each switch towards a
star and keeps trees shallow. The exponentially many cut constraints (9) --
``MT = N k`` (every GPU must still receive ``k`` trees from every root) and
``OF_X`` the capacity crossing the cut outside the switch -- are added by
cutting planes: after each solve, a max-flow per GPU finds a violated cut,
if any.

Capacities must be integers (trees per link), so each LP solution is
rounded (floor, then a max-flow completes the row and column totals) and
the *rounded* split is what the cut check sees; if rounding keeps
violating a cut the switch is solved as a MIP with integer ``y``. The LP is
built in bulk from numpy arrays and passed to HiGHS with ``passModel``;
output is silenced and every model status is checked.
"""

from __future__ import annotations

import contextlib
import os
import threading

import highspy
import numpy as np

from jaxccl.errors import SynthesisError
from jaxccl.synth.allgather.flow import RootedCheck
from jaxccl.synth.allgather.logical import Logical
from jaxccl.synth.allgather.network import Net
from jaxccl.synth.allgather.switch_removal import SplitStats, transport_plan

MAX_CUT_ROUNDS = 200
_LOCK = threading.Lock()
_HIGHS: highspy.Highs | None = None


@contextlib.contextmanager
def _quiet_stdout():
    """Silences C-level stdout (HiGHS prints a banner when an instance is created)."""
    try:
        fd = os.dup(1)
    except OSError:  # pragma: no cover - no stdout at all
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            try:
                yield
            finally:
                os.dup2(fd, 1)
    finally:
        os.close(fd)


def _solver() -> highspy.Highs:
    global _HIGHS
    if _HIGHS is None:
        with _quiet_stdout():
            _HIGHS = highspy.Highs()
    _HIGHS.setOptionValue("output_flag", False)
    return _HIGHS


def remove_switches_latency(net: Net, caps: np.ndarray, k: int, *, stats: SplitStats | None = None) -> Logical:
    """Removes every switch by MCCL App. C's LP; returns the logical GPU-to-GPU topology.

    Raises:
        SynthesisError: if HiGHS does not reach an optimum, or no admissible
            integral split is found for a switch.
    """
    stats = stats if stats is not None else SplitStats()
    logical = Logical(net, caps)
    with _LOCK:
        for w in range(net.num_gpus, net.num_nodes):
            _split_switch(logical, w, k, stats)
    return logical


def _split_switch(logical: Logical, w: int, k: int, stats: SplitStats) -> None:
    net = logical.net
    preds, succs = logical.neighbors(w)
    if not preds or not succs:
        stats.dropped += logical.remove(w)
        return
    pu = np.array([u for u, _ in preds], dtype=np.int64)
    a = np.array([c for _, c in preds], dtype=np.int64)
    sv = np.array([v for v, _ in succs], dtype=np.int64)
    b = np.array([c for _, c in succs], dtype=np.int64)
    ii, jj = np.nonzero(pu[:, None] != sv[None, :])
    if not len(ii):
        stats.dropped += logical.remove(w)
        return
    # the graph without w: fixed part of every cut (OF), plus the candidate links
    base = logical.copy()
    base.remove(w)
    fsrc, fdst, fcap = base.arrays()
    n_nodes = net.num_nodes
    check = RootedCheck(n_nodes, net.num_gpus, np.concatenate([fsrc, pu[ii]]), np.concatenate([fdst, sv[jj]]))
    need = net.num_gpus * k
    lp = _PenaltyLP(a, b, ii, jj, n_local=len(set(pu.tolist()) | set(sv.tolist())))
    integral = False
    seen: set[bytes] = set()
    for _ in range(MAX_CUT_ROUNDS):
        try:
            y_frac = lp.solve(integral)
        except SynthesisError as e:
            raise SynthesisError(
                f"switch {net.names[w]!r}: {e}; the latency-aware split found no admissible split of this switch, "
                "use method='forestcoll'"
            ) from None
        stats.lp_solves += 1
        y = _round(y_frac, a, b, ii, jj) if not integral else np.rint(y_frac).astype(np.int64)
        bad = check.violation(np.concatenate([fcap, y]), k, need)
        stats.flows += check.count
        check.count = 0
        if bad is None:
            for i, j, units in zip(ii.tolist(), jj.tolist(), y.tolist()):
                if units:
                    logical.split(int(pu[i]), w, int(sv[j]), int(units))
            stats.dropped += logical.remove(w)
            return
        _, _, side = bad
        # (9): sum of y over links leaving the source side >= N k - (fixed capacity leaving it)
        crossing = side[pu[ii]] & ~side[sv[jj]]
        fixed = int(fcap[side[fsrc] & ~side[fdst]].sum()) + k * int((~side[: net.num_gpus]).sum())
        key = np.packbits(side).tobytes()
        if key in seen:
            if integral:
                raise SynthesisError(f"switch {net.names[w]!r}: the cut LP keeps an infeasible integral split")
            integral = True  # rounding keeps breaking this cut: solve for integral y
        seen.add(key)
        lp.add_cut(np.flatnonzero(crossing), need - fixed)
        stats.cuts += 1
    raise SynthesisError(f"switch {net.names[w]!r}: no admissible split after {MAX_CUT_ROUNDS} cutting-plane rounds")


def _round(y: np.ndarray, a: np.ndarray, b: np.ndarray, ii: np.ndarray, jj: np.ndarray) -> np.ndarray:
    """Integer ``y`` with the same row/column totals (up to what the pattern allows), close to ``y``."""
    m, n = len(a), len(b)
    weight = np.zeros((m, n))
    weight[ii, jj] = np.maximum(y, 0)
    allowed = np.zeros((m, n), dtype=bool)
    allowed[ii, jj] = True
    # keep the LP's integer part, let the rounding fill the rest near the fractional entries
    base = np.floor(weight + 1e-7).astype(np.int64)
    base = np.minimum(base, np.where(allowed, np.iinfo(np.int64).max // 4, 0))
    rows_left = np.maximum(a - base.sum(axis=1), 0)
    cols_left = np.maximum(b - base.sum(axis=0), 0)
    frac = weight - base
    extra = transport_plan(rows_left, cols_left, allowed, weight=np.where(frac > 1e-7, 1.0 + frac, 1e-3))
    out = base + extra
    return out[ii, jj]


class _PenaltyLP:
    """The LP (5)-(10) for one switch, held in HiGHS between cutting-plane rounds."""

    def __init__(self, a: np.ndarray, b: np.ndarray, ii: np.ndarray, jj: np.ndarray, *, n_local: int):
        self.h = _solver()
        self.h.clearModel()
        ny = len(ii)
        self.ny = ny
        kk = max(len(b) - 1, 1)  # K = |succ(w)| - 1
        width = np.floor(a[ii] / kk).astype(np.float64)  # w_uv = floor(c_uw / K), depends on u only
        c_max = float(max(a.max(), b.max()))
        big_m = float(n_local) ** 2 * max(c_max, 1.0)  # M = N^2 c_max, N = |V_i| (App. C)
        inf = highspy.kHighsInf
        # columns: y_0..y_{ny-1}, h_0..h_{ny-1}
        cost = np.concatenate([np.full(ny, big_m), np.full(ny, -1.0)])
        lower = np.zeros(2 * ny)
        upper = np.concatenate([np.minimum(a[ii], b[jj]).astype(np.float64), np.full(ny, inf)])
        # rows (6): k' y_a - h_a <= w_a k'(k'-1)/2
        ks = np.arange(1, kk + 1, dtype=np.float64)
        rows6 = ny * kk
        r6 = np.arange(rows6)
        col_y = np.repeat(np.arange(ny), kk)
        val_y = np.tile(ks, ny)
        col_h = ny + col_y
        rhs6 = (np.repeat(width, kk) * np.tile(ks * (ks - 1) / 2, ny)).astype(np.float64)
        # rows (7) and (8)
        r7 = rows6 + ii
        r8 = rows6 + len(a) + jj
        num_rows = rows6 + len(a) + len(b)
        row_index = np.concatenate([r6, r6, r7, r8])
        col_index = np.concatenate([col_y, col_h, np.arange(ny), np.arange(ny)])
        values = np.concatenate([val_y, -np.ones(rows6), np.ones(ny), np.ones(ny)])
        row_lower = np.full(num_rows, -inf)
        row_upper = np.concatenate([rhs6, a.astype(np.float64), b.astype(np.float64)])
        order = np.lexsort((row_index, col_index))
        lp = highspy.HighsLp()
        lp.num_col_ = 2 * ny
        lp.num_row_ = num_rows
        lp.col_cost_ = cost
        lp.col_lower_ = lower
        lp.col_upper_ = upper
        lp.row_lower_ = row_lower
        lp.row_upper_ = row_upper
        lp.sense_ = highspy.ObjSense.kMaximize
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        starts = np.zeros(2 * ny + 1, dtype=np.int32)
        np.cumsum(np.bincount(col_index, minlength=2 * ny), out=starts[1:])
        lp.a_matrix_.start_ = starts
        lp.a_matrix_.index_ = row_index[order].astype(np.int32)
        lp.a_matrix_.value_ = values[order]
        status = self.h.passModel(lp)
        if status != highspy.HighsStatus.kOk:
            raise SynthesisError(f"HiGHS rejected the switch-removal LP: {status}")

    def add_cut(self, cols: np.ndarray, rhs: int) -> None:
        self.h.addRow(float(rhs), highspy.kHighsInf, len(cols), cols.astype(np.int32), np.ones(len(cols)))

    def solve(self, integral: bool) -> np.ndarray:
        if integral:
            self.h.changeColsIntegrality(
                self.ny, np.arange(self.ny, dtype=np.int32), np.array([highspy.HighsVarType.kInteger] * self.ny)
            )
        self.h.run()
        status = self.h.getModelStatus()
        if status != highspy.HighsModelStatus.kOptimal:
            raise SynthesisError(f"HiGHS: switch-removal LP ended with status {self.h.modelStatusToString(status)}")
        return np.asarray(self.h.getSolution().col_value[: self.ny])
