"""What an AllToAll schedule reports in ``info``: the gap, the bottleneck cut and the routes table."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxccl.synth.alltoall.network import Network
from jaxccl.synth.alltoall.planning import Plan, plan_columns
from jaxccl.synth.alltoall.routes import COLUMN_ENCODING, encode_column

SATURATION_TOL = 1e-6  # an LP link load within this fraction of capacity is "saturated" (the cut)


def gap_pct(value: float, bound: float) -> float:
    return max(0.0, 100.0 * (1.0 - value / bound)) if bound > 0 else 0.0


def cut_info(net: Network, lp_loads: np.ndarray, link_chunks: np.ndarray) -> dict[str, Any]:
    """Bottleneck cut (LP-saturated links), base slacks and chunks per link (MCCL Sec. 3.2, Alg. 1).

    ``base_slack_a = (c_a - n_a * x_min) / c_a`` with the per-chunk rate
    ``x_min = min_a c_a / n_a``: the bandwidth the rounded schedule leaves
    unused on a cut link.
    """
    cap = net.capacity
    used = link_chunks > 0
    x_min = float(np.min(cap[used] / link_chunks[used])) if used.any() else 0.0
    cut = np.flatnonzero(lp_loads >= cap * (1 - SATURATION_TOL))
    slacks = np.maximum((cap[cut] - link_chunks[cut] * x_min) / cap[cut], 0.0)
    nz = np.flatnonzero(used)
    names = np.empty(net.num_nodes, dtype=object)
    names[:] = net.nodes
    u, v = names[net.tail[nz]].tolist(), names[net.head[nz]].tolist()
    return {
        "cut": [[names[net.tail[a]], names[net.head[a]]] for a in cut.tolist()],
        "base_slacks": slacks.tolist(),
        "link_chunks": list(map(list, zip(u, v, np.rint(link_chunks[nz]).astype(np.int64).tolist()))),
    }


def paths_table(net: Network, p: Plan, route: np.ndarray, offset: np.ndarray) -> dict:
    """``info["paths"]``: the plan's rows (nodes ``route[offset[i]:offset[i+1]]``) with class ranges and scratch."""
    table = {
        "nodes": list(net.nodes),
        "encoding": COLUMN_ENCODING,
        "src": encode_column(p.src),
        "dst": encode_column(p.dst),
        "chunks": encode_column(p.count),
        "offset": encode_column(offset),
        "route": encode_column(route),
    }
    table.update(plan_columns(p))
    return table
