"""Switches whose ingress and egress differ: lowered to what trees without multicast can use.

A tree passes a switch ``w`` as ``(u, w), (w, t)``: every unit that leaves
``w`` entered it, because switches forward but do not copy (no multicast).
So at most ``min(ingress, egress)`` of either side is ever used, and the
max-flow bound of phase 1 -- which lets a switch send out more than it
receives -- can be out of reach when the two differ (four GPUs sending 10
GB/s into a switch that sends 30 GB/s back to each: the bound is 40 GB/s,
trees reach 13.3). Phase 2's complete splitting needs equal totals
(Bang-Jensen, Frank and Jackson).

:func:`balance_switches` therefore lowers the larger side of every such
switch to the smaller total by water-filling (the fastest links are capped
first, at one common level), in integer capacity units, and repeats until
every switch is balanced (capping a switch's egress lowers its neighbour
switches' ingress). The AllGather bound is then the max-flow bound of the
balanced fabric, which trees reach exactly; it is a bound a multicast-free
schedule can reach, not necessarily the best such bound (another choice of
capped links can be better on a contrived fabric).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxccl.synth.allgather.network import Net


def water_fill(caps: np.ndarray, total: int) -> np.ndarray:
    """Integer capacities ``<= caps`` summing to ``total`` (``<= caps.sum()``), the largest lowered first.

    >>> water_fill(np.array([30, 30, 5, 12]), 40).tolist()
    [11, 12, 5, 12]
    """
    caps = np.asarray(caps, dtype=np.int64)
    if total >= int(caps.sum()):
        return caps.copy()
    lo, hi = 0, int(caps.max())  # the smallest level whose capped sum reaches total
    while lo < hi:
        mid = (lo + hi) // 2
        if int(np.minimum(caps, mid).sum()) >= total:
            hi = mid
        else:
            lo = mid + 1
    out = np.minimum(caps, lo)
    excess = int(out.sum()) - total
    at_level = np.flatnonzero(out == lo)
    out[at_level[:excess]] -= 1  # excess < len(at_level): level lo - 1 does not reach total
    return out


def balance_switches(net: Net) -> tuple[Net, list[list]]:
    """``net`` with every switch's ingress and egress made equal, and ``[name, ingress, egress]`` (bytes/s, before)
    of every switch changed; ``net`` itself when all are balanced already."""
    units = net.units.copy()
    changed: dict[int, list] = {}
    for _ in range(4 * (net.num_nodes - net.num_gpus) + 4):
        moved = False
        for w in range(net.num_gpus, net.num_nodes):
            into, out = np.flatnonzero(net.dst == w), np.flatnonzero(net.src == w)
            a, b = int(units[into].sum()), int(units[out].sum())
            if a == b:
                continue
            changed.setdefault(w, [net.names[w], float(a * net.unit), float(b * net.unit)])
            side = out if b > a else into
            units[side] = water_fill(units[side], min(a, b))
            moved = True
        if not moved:
            break
    if not changed:
        return net, []
    return dataclasses.replace(net, units=units), list(changed.values())
