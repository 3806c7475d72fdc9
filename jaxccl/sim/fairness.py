"""Max-min fair rates by progressive filling, vectorized over a sparse flow x link incidence.

Every flow crosses a set of links; a link of capacity ``c`` can carry flows whose
rates sum to at most ``c``. The max-min fair allocation raises the rates of all
flows together ("water filling"); when a link saturates, the flows crossing it
freeze at the current level and the others keep rising. The result is the
unique allocation in which no flow can get more without taking from a flow that
has no more than it.

Flows may carry *weights*: a flow of weight ``w`` rises at ``w`` times the
common level (weighted max-min fairness). The simulator weighs a message by
the bytes of its tiles, the fluid limit of an executor that serves one tile of
every active message in turn (see :mod:`jaxccl.sim.model`).

A flow may also be *coupled* to another (``rate[down] / w[down] <= rate[up] /
w[up]``, ``rate[down] <= rate[up]`` unweighted): a forwarded message cannot get
ahead of the data it forwards (pipelining, see :mod:`jaxccl.sim.model`).
Coupling fits progressive filling naturally: when an upstream flow freezes, its
downstream flows freeze at the same level.

Each filling round costs a few numpy passes over the incidence entries of the
flows still rising, so the cost is ``O(levels x nnz)``.

Example (3 flows on 2 links; flow 1 crosses both):
    >>> import numpy as np
    >>> rates = max_min_rates(np.array([0, 1, 1, 2]), np.array([0, 0, 1, 1]), np.array([1.0, 2.0]), 3)
    >>> rates.tolist()
    [0.5, 0.5, 1.5]
"""

from __future__ import annotations

import numpy as np

__all__ = ["max_min_rates"]

_REL_TOL = 1e-9


def max_min_rates(
    flow_of: np.ndarray,
    link_of: np.ndarray,
    capacity: np.ndarray,
    num_flows: int,
    *,
    coupled: tuple[np.ndarray, np.ndarray] | None = None,
    weight: np.ndarray | None = None,
) -> np.ndarray:
    """Max-min fair rates of ``num_flows`` flows.

    Args:
        flow_of: for each incidence entry, the flow (``0..num_flows-1``).
        link_of: for each incidence entry, the link (``0..len(capacity)-1``).
            A flow crossing a link twice counts twice on it.
        capacity: capacity of each link (> 0).
        num_flows: number of flows.
        coupled: optional ``(down, up)`` arrays of flow indices meaning
            ``rate[down] <= rate[up]`` (no cycles).
        weight: optional positive weight per flow (default 1); a flow's
            rate is its weight times the level at which it freezes. Coupling
            then reads ``rate[down] / weight[down] <= rate[up] / weight[up]``.

    Returns:
        ``float64`` array of rates; a flow crossing no link gets ``inf``
        (or its upstream's rate when coupled).
    """
    flow_of = np.asarray(flow_of, dtype=np.int64)
    link_of = np.asarray(link_of, dtype=np.int64)
    capacity = np.asarray(capacity, dtype=np.float64)
    rate = np.full(num_flows, np.inf)
    frozen = np.zeros(num_flows, dtype=bool)
    down = up = None
    if coupled is not None:
        down, up = (np.asarray(a, dtype=np.int64) for a in coupled)
        keep = down != up
        down, up = down[keep], up[keep]
        if down.size == 0:
            down = up = None
    w = np.ones(num_flows) if weight is None else np.asarray(weight, dtype=np.float64)
    # Only the links some flow crosses take part; a link whose flows are all frozen gets rem = inf, so that
    # rem / n is inf for it (and for unused links) without masking every round.
    links, el = np.unique(link_of, return_inverse=True)
    cap = capacity[links]
    rem = cap.copy()
    tol = _REL_TOL * cap
    n = np.bincount(el, weights=w[flow_of], minlength=cap.size).astype(np.float64)
    residue = 1e-9 * float(w.min()) if num_flows else 0.0
    ef = flow_of
    level = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        while ef.size:
            share = rem / n
            delta = max(float(share.min()), 0.0)
            level += delta
            dn = delta * n
            rem -= dn
            sat = rem <= tol + _REL_TOL * dn
            newly = np.zeros(num_flows, dtype=bool)
            newly[ef[sat[el]]] = True
            if down is not None:
                # A flow whose upstream freezes cannot rise further either (chains freeze in one round).
                while True:
                    stuck = newly[up] & ~newly[down]
                    if not stuck.any():
                        break
                    newly[down[stuck]] = True
                newly &= ~frozen
                live = ~newly[down]  # pairs whose downstream froze never matter again
                if not live.all():
                    down, up = down[live], up[live]
                    if down.size == 0:
                        down = up = None
            rate[newly] = level * w[newly]
            frozen |= newly
            gone = newly[ef]
            n -= np.bincount(el[gone], weights=w[ef[gone]], minlength=cap.size)
            n[n < residue] = 0.0  # rounding left-overs of links whose flows all froze
            keep = ~gone
            ef, el = ef[keep], el[keep]
            rem[sat] = np.inf
    if coupled is not None and down is not None:
        # Flows without links but coupled: cap at the upstream's rate.
        free = np.ones(num_flows, dtype=bool)
        free[flow_of] = False
        if free.any():
            for _ in range(down.size + 1):
                c = np.minimum(rate[down], rate[up] * (w[down] / w[up]))
                changed = free[down] & (c < rate[down])
                if not changed.any():
                    break
                rate[down[changed]] = c[changed]
    return rate
