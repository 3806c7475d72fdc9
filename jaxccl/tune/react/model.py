"""REACT's analytic model (Sec. 5.4.1): estimated flow times of a transformed pattern, and the epsilon check.

:class:`FlowHistory` keeps the measured flows of the last ``H`` epochs (60 in
the paper), whatever pattern they ran in, as ``(sending device, receiving
device, size, degree, completion time)``. The estimate of a flow of a
(transformed) pattern is

- the mean observed time of the same device pair, scaled by size and degree
  (``fct * size' / size * k' / k``: a flow of degree ``k`` gets ``1/k`` of its
  links), when the pair was seen;
- otherwise the median time of all seen flows of the same degree, scaled by
  size (the paper: "the median completion time across all flows of same
  degree"; jaxccl adds the size scaling, which only matters for AllGather's
  growing messages); with no flow of that degree, the median over all flows
  scaled by size and degree.

``unknown="node"`` is a jaxccl variant (not the paper's): an unseen pair is
priced from what was seen of its two devices -- the slower of the sender's
median outgoing and the receiver's median incoming per-chunk, per-degree time
-- so that moving a flow onto a congested device is not predicted to be fast.

:meth:`FlowHistory.predicted_time` is ``E_D`` of Alg. 1: the mean, over the
given critical paths, of the sum of the estimated times of their flows. A
transform is accepted when it is at least ``1 + epsilon`` times faster
(:func:`accepts`, ``epsilon = 0.05``).

Example:
    >>> import numpy as np
    >>> from jaxccl.tune.react.pattern import ring_allreduce_pattern
    >>> p = ring_allreduce_pattern(4)
    >>> h = FlowHistory()
    >>> h.record(p, np.full(p.num_flows, 2e-3))
    >>> float(h.estimate(p)[0])
    0.002
    >>> accepts(1.0, 0.96), accepts(1.0, 0.95)
    (False, True)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxccl.errors import TuneError
from jaxccl.tune.react.critical_path import CriticalPath
from jaxccl.tune.react.pattern import Pattern
from jaxccl.util.options import choose

__all__ = ["EPSILON", "FlowHistory", "accepts", "predicted_gain"]

EPSILON = 0.05
HISTORY_EPOCHS = 60
UNKNOWN_METHODS = ("median", "node")


def predicted_gain(before: float, after: float) -> float:
    """``before / after - 1``: the predicted speed-up of a transform (0.05 = 5 %)."""
    return before / after - 1.0 if after > 0 else float("inf")


def accepts(before: float, after: float, epsilon: float = EPSILON) -> bool:
    """Alg. 1's check: the new pattern's predicted time is at least ``1 + epsilon`` times lower.

    The comparison is done as ``before >= (1 + epsilon) * after`` up to a
    relative rounding tolerance of 1e-9, so a gain of exactly ``epsilon`` passes.
    """
    return before >= (1.0 + epsilon) * after * (1.0 - 1e-9)


@dataclasses.dataclass(frozen=True)
class _Epoch:
    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray
    degree: np.ndarray
    fct: np.ndarray


class FlowHistory:
    """Observed flow times of the last ``horizon`` epochs (REACT's ``D``) and the estimates built on them.

    Args:
        horizon: epochs to keep (``H``; older data is dropped, job churn).
        unknown: how to price a device pair never seen: ``"median"`` (the paper)
            or ``"node"`` (see the module docstring).
    """

    def __init__(self, horizon: int = HISTORY_EPOCHS, *, unknown: str = "median"):
        if not isinstance(horizon, int) or horizon < 1:
            raise TuneError(f"horizon must be a positive integer, got {horizon!r}")
        choose("unknown", unknown, UNKNOWN_METHODS)
        self.horizon = horizon
        self.unknown = unknown
        self._epochs: collections.deque[_Epoch] = collections.deque(maxlen=horizon)
        self._tables: tuple | None = None

    def __len__(self) -> int:
        return len(self._epochs)

    def record(self, pattern: Pattern, fct: np.ndarray) -> None:
        """Adds one epoch of ``pattern``'s flow times (NaN entries are skipped)."""
        fct = np.asarray(fct, dtype=np.float64)
        if fct.shape != (pattern.num_flows,):
            raise TuneError(f"fct must have one entry per flow ({pattern.num_flows}), got shape {fct.shape}")
        ok = np.isfinite(fct) & (fct > 0) & (pattern.flow_size > 0)
        self._epochs.append(
            _Epoch(
                pattern.src_device[ok].copy(),
                pattern.dst_device[ok].copy(),
                pattern.flow_size[ok].astype(np.float64),
                pattern.flow_degree[ok].astype(np.float64),
                fct[ok].copy(),
            )
        )
        self._tables = None

    def record_batch(self, pattern: Pattern, batch: np.ndarray) -> None:
        """Adds every epoch (row) of ``batch[B, F]``."""
        for row in np.asarray(batch, dtype=np.float64):
            self.record(pattern, row)

    def _build(self, n: int) -> tuple:
        if self._tables is not None and self._tables[0] == n:
            return self._tables
        src = np.concatenate([e.src for e in self._epochs]) if self._epochs else np.zeros(0, np.int64)
        dst = np.concatenate([e.dst for e in self._epochs]) if self._epochs else np.zeros(0, np.int64)
        size = np.concatenate([e.size for e in self._epochs]) if self._epochs else np.zeros(0)
        deg = np.concatenate([e.degree for e in self._epochs]) if self._epochs else np.zeros(0)
        fct = np.concatenate([e.fct for e in self._epochs]) if self._epochs else np.zeros(0)
        if not fct.size:
            raise TuneError("FlowHistory is empty: record at least one epoch before estimating")
        unit = fct / (size * deg)  # seconds per chunk at degree 1
        pair = src * n + dst
        sums = np.bincount(pair, weights=unit, minlength=n * n)
        counts = np.bincount(pair, minlength=n * n)
        pair_unit = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        per_size = fct / size
        by_degree = {int(k): float(np.median(per_size[deg == k])) for k in np.unique(deg)}
        med_unit = float(np.median(unit))
        out_unit = np.full(n, med_unit)
        in_unit = np.full(n, med_unit)
        for d in range(n):
            if (src == d).any():
                out_unit[d] = float(np.median(unit[src == d]))
            if (dst == d).any():
                in_unit[d] = float(np.median(unit[dst == d]))
        self._tables = (n, pair_unit, by_degree, med_unit, out_unit, in_unit)
        return self._tables

    def estimate(self, pattern: Pattern) -> np.ndarray:
        """Estimated completion time of every flow of ``pattern`` (0 for flows that carry nothing)."""
        n = pattern.num_ranks
        _, pair_unit, by_degree, med_unit, out_unit, in_unit = self._build(n)
        src, dst = pattern.src_device, pattern.dst_device
        size = pattern.flow_size.astype(np.float64)
        deg = pattern.flow_degree.astype(np.float64)
        unit = pair_unit[src * n + dst]
        est = unit * size * deg
        unseen = ~np.isfinite(unit)
        if unseen.any():
            if self.unknown == "node":
                fallback = np.maximum(out_unit[src], in_unit[dst]) * size * deg
            else:
                fallback = np.array(
                    [
                        by_degree[int(k)] * s if int(k) in by_degree else med_unit * s * k
                        for k, s in zip(deg.tolist(), size.tolist())
                    ]
                )
            est = np.where(unseen, fallback, est)
        return np.where(size > 0, est, 0.0)

    def predicted_time(self, pattern: Pattern, paths: Sequence[CriticalPath]) -> float:
        """``E_D``: mean over ``paths`` of the summed estimated times of their flows in ``pattern``."""
        if not paths:
            raise TuneError("predicted_time needs at least one critical path")
        est = self.estimate(pattern)
        return float(np.mean([est[list(p.flows)].sum() if p.flows else 0.0 for p in paths]))
