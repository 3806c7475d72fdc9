"""Congestion detection from per-flow completion times over a batch of epochs (REACT Sec. 5.2).

With ``b_f`` the throughputs of flow ``f`` over the ``B`` epochs of a batch
(its size divided by its completion time in each epoch):

- **steady** congestion (Eq. 1): ``p90(b_f) < mean(b_F(k_f)) * (1 - delta1)``,
  where ``b_F(k)`` are the throughputs (all epochs) of every flow of the same
  degree ``k_f`` (the larger of its sender's out-degree and receiver's
  in-degree, see :attr:`Pattern.flow_degree`): the flow is slower than its
  peers in (almost) every epoch; ``delta1 = 0.2``.
- **erratic** congestion (Eq. 2): ``std(b_f) / mean(b_f) > delta2``: the flow is
  slow in some epochs only (e.g. an ECMP collision); ``delta2 = 0.15``. The
  standard deviation is the population one (``ddof = 0``).

Example:
    >>> import numpy as np
    >>> fct = np.ones((6, 4))
    >>> fct[:, 1] = 2.0                 # flow 1 twice as slow in every epoch
    >>> fct[4:, 2] = 2.0                # flow 2 slow in two epochs of six
    >>> c = detect_congestion(fct, sizes=np.ones(4), degrees=np.ones(4, dtype=int))
    >>> sorted(c.steady), sorted(c.erratic)
    ([1], [2])
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxccl.errors import TuneError

__all__ = ["DELTA1", "DELTA2", "Congestion", "detect_congestion"]

DELTA1 = 0.2
DELTA2 = 0.15


@dataclasses.dataclass(frozen=True)
class Congestion:
    """Outcome of :func:`detect_congestion` (flow indices of the pattern).

    Attributes:
        steady: flows meeting Eq. 1.
        erratic: flows meeting Eq. 2.
        throughput: ``[B, F]`` size / completion time (NaN where not measured).
        p90: per flow, the 90th percentile of its throughput.
        peer_mean: per flow, ``mean(b_F(k_f))``.
        cv: per flow, ``std / mean`` of its throughput.
    """

    steady: frozenset[int]
    erratic: frozenset[int]
    throughput: np.ndarray
    p90: np.ndarray
    peer_mean: np.ndarray
    cv: np.ndarray

    @property
    def flows(self) -> frozenset[int]:
        """Every congested flow (steady or erratic)."""
        return self.steady | self.erratic

    def __bool__(self) -> bool:
        return bool(self.steady or self.erratic)


def detect_congestion(
    fct: np.ndarray,
    *,
    sizes: np.ndarray,
    degrees: np.ndarray,
    delta1: float = DELTA1,
    delta2: float = DELTA2,
) -> Congestion:
    """Flags steady (Eq. 1) and erratic (Eq. 2) congestion.

    Args:
        fct: ``[B, F]`` completion time of each flow in each epoch (NaN: flow not
            measured, e.g. it sent nothing; ignored).
        sizes: ``[F]`` bytes (or chunks) of each flow.
        degrees: ``[F]`` degree ``k_f`` of each flow.
        delta1: Eq. 1 threshold.
        delta2: Eq. 2 threshold.

    Raises:
        TuneError: shapes that do not fit, or non-positive times (a ``ValueError``).
    """
    fct = np.asarray(fct, dtype=np.float64)
    if fct.ndim != 2:
        raise TuneError(f"fct must be [epochs, flows], got shape {fct.shape}")
    sizes = np.asarray(sizes, dtype=np.float64)
    degrees = np.asarray(degrees)
    if sizes.shape != (fct.shape[1],) or degrees.shape != (fct.shape[1],):
        raise TuneError(f"sizes and degrees must have one entry per flow ({fct.shape[1]})")
    if (fct[np.isfinite(fct)] <= 0).any():
        raise TuneError("flow completion times must be positive")
    with np.errstate(divide="ignore", invalid="ignore"):
        b = sizes[None, :] / fct
    measured = np.isfinite(b).any(axis=0)
    f = fct.shape[1]
    p90 = np.full(f, np.nan)
    mean = np.full(f, np.nan)
    cv = np.full(f, np.nan)
    if measured.any():
        bm = b[:, measured]
        full = np.isfinite(bm).all()  # the nan* reductions are slow: only when needed
        p90[measured] = np.percentile(bm, 90, axis=0) if full else np.nanpercentile(bm, 90, axis=0)
        mean[measured] = bm.mean(axis=0) if full else np.nanmean(bm, axis=0)
        cv[measured] = (bm.std(axis=0) if full else np.nanstd(bm, axis=0)) / mean[measured]
    peer = np.full(f, np.nan)
    for k in np.unique(degrees[measured]):
        sel = measured & (degrees == k)
        peer[sel] = np.nanmean(b[:, sel])
    steady = np.flatnonzero(measured & (p90 < peer * (1.0 - delta1)))
    erratic = np.flatnonzero(measured & (cv > delta2))
    return Congestion(frozenset(steady.tolist()), frozenset(erratic.tolist()), b, p90, peer, cv)
