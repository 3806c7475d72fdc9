"""The restricted master problem (1)-(4) of MCCL Sec. 4.2 on HiGHS.

::

    max z
    s.t.  sum_{T in T_c} x_T >= z            for every tensor c   (2)  dual alpha_c
          sum_c sum_T beta_aT x_T <= c_a     for every link a     (3)  dual alpha_a
          x_T >= 0                                                 (4)

HiGHS minimizes ``-z``; row ``c`` (``0 <= c < N``) is the throughput row of
the tensor of GPU ``c``, row ``N + a`` the capacity row of arc ``a``. The
model is passed once in bulk (:class:`highspy.HighsLp`) and grows with
``addCols``; every re-solve starts from the previous optimal basis (new
columns enter nonbasic at zero), so HiGHS' simplex only does the few pivots
the new columns allow.
"""

from __future__ import annotations

import contextlib
import os
import sys

import highspy
import numpy as np

from jaxccl.errors import SynthesisError
from jaxccl.synth.alltoall.network import Network

_BANNER_SILENCED = False


def new_highs(*, threads: int | None = None) -> highspy.Highs:
    """A silent HiGHS instance (its one-time banner is swallowed too)."""
    global _BANNER_SILENCED
    if _BANNER_SILENCED:
        h = highspy.Highs()
    else:
        with _quiet_fd(1):
            h = highspy.Highs()
        _BANNER_SILENCED = True
    h.setOptionValue("output_flag", False)
    h.setOptionValue("log_to_console", False)
    if threads is not None:
        h.setOptionValue("threads", int(threads))
    return h


@contextlib.contextmanager
def _quiet_fd(fd: int):
    """Redirects a C-level file descriptor to /dev/null (HiGHS prints a banner at first construction)."""
    try:
        sys.stdout.flush()
        saved = os.dup(fd)
    except (OSError, ValueError):  # pragma: no cover - no real stdout
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def check_status(h: highspy.Highs, what: str) -> None:
    """Raises :class:`SynthesisError` unless HiGHS found an optimum."""
    status = h.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        raise SynthesisError(f"{what}: HiGHS returned model status {h.modelStatusToString(status)!r}, not optimal")


class Master:
    """The RMP of one topology; columns are added in blocks (CSC arrays)."""

    def __init__(self, net: Network):
        self.net = net
        n, a = net.num_gpus, net.num_arcs
        self.num_rows = n + a
        inf = highspy.kHighsInf
        lp = highspy.HighsLp()
        lp.num_col_ = 1
        lp.num_row_ = n + a
        lp.col_cost_ = np.array([-1.0])
        lp.col_lower_ = np.zeros(1)
        lp.col_upper_ = np.array([inf])
        lp.row_lower_ = np.concatenate([np.zeros(n), np.full(a, -inf)])
        lp.row_upper_ = np.concatenate([np.full(n, inf), net.capacity])
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.array([0, n], dtype=np.int32)
        lp.a_matrix_.index_ = np.arange(n, dtype=np.int32)
        lp.a_matrix_.value_ = np.full(n, -1.0)
        lp.a_matrix_.num_col_ = 1
        lp.a_matrix_.num_row_ = n + a
        self.h = new_highs()
        # The RMP is re-solved after every block of columns: simplex keeps the basis.
        self.h.setOptionValue("presolve", "off")
        self.h.setOptionValue("solver", "simplex")
        if self.h.passModel(lp) != highspy.HighsStatus.kOk:
            raise SynthesisError("HiGHS refused the restricted master problem")
        self.num_columns = 0  # tree columns (HiGHS column j + 1)
        self.simplex_iterations = 0

    def add_columns(self, src: np.ndarray, starts: np.ndarray, arcs: np.ndarray, counts: np.ndarray) -> None:
        """Adds tree columns: tensor row ``src[j]`` (coefficient 1) and link rows ``beta``."""
        k = int(src.size)
        if k == 0:
            return
        n = self.net.num_gpus
        # Each column: its tensor row first, then its link rows.
        total = arcs.size + k
        index = np.empty(total, dtype=np.int32)
        value = np.empty(total, dtype=np.float64)
        col_start = (starts + np.arange(k)).astype(np.int32)
        head = col_start
        index[head] = src
        value[head] = 1.0
        body = np.ones(total, dtype=bool)
        body[head] = False
        index[body] = arcs + n
        value[body] = counts
        status = self.h.addCols(
            k, np.zeros(k), np.zeros(k), np.full(k, highspy.kHighsInf), total, col_start, index, value
        )
        if status != highspy.HighsStatus.kOk:
            raise SynthesisError("HiGHS refused new columns of the restricted master problem")
        self.num_columns += k

    def solve(self, *, time_limit: float | None = None) -> tuple[float, np.ndarray, np.ndarray, np.ndarray] | None:
        """Solves the RMP: ``(z, x, alpha_c, alpha_a)``; ``None`` if ``time_limit`` (s) ran out first."""
        if time_limit is not None:
            # HiGHS' clock runs over all solves of one instance.
            self.h.setOptionValue("time_limit", self.h.getRunTime() + max(float(time_limit), 1e-3))
        self.h.run()
        if time_limit is not None and self.h.getModelStatus() == highspy.HighsModelStatus.kTimeLimit:
            return None
        check_status(self.h, "restricted master problem")
        self.simplex_iterations += int(self.h.getInfo().simplex_iteration_count)
        sol = self.h.getSolution()
        col = np.asarray(sol.col_value)
        dual = np.asarray(sol.row_dual)
        n = self.net.num_gpus
        alpha_c = np.maximum(dual[:n], 0.0)
        alpha_a = np.maximum(-dual[n:], 0.0)
        return float(col[0]), col[1:], alpha_c, alpha_a
