"""Critical paths of a weighted TEN (REACT Sec. 5.4.1).

Each flow (edge ``(t, src) -> (t + 1, dst)``) is weighted by its completion
time; a device keeps its data from one time to the next (hold edges of weight
0). The critical path is the path of largest total weight, found per chunk
graph by dynamic programming over the times (``O(|V| + |E|)``) and maximized
over chunk graphs -- chunk graphs carry independent data, so a path never
jumps from one to another.

REACT computes one critical path per epoch of a batch (erratic congestion
shows in some epochs only) plus one on the mean completion times:
:func:`critical_paths`.

Example:
    >>> import numpy as np
    >>> from jaxccl.tune.react.pattern import double_binary_tree_pattern
    >>> p = double_binary_tree_pattern(8)
    >>> w = np.ones(p.num_flows)
    >>> w[(p.chunk_graphs == 1) & (p.dst_device == 3)] = 5.0
    >>> cp = critical_path(p, w)
    >>> cp.chunk_graph, cp.time, len(cp.flows)
    (1, 14.0, 6)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxccl.errors import TuneError
from jaxccl.tune.react.pattern import Pattern

__all__ = ["CriticalPath", "critical_path", "critical_paths", "path_time"]


@dataclasses.dataclass(frozen=True)
class CriticalPath:
    """A path of flows (in time order) and its total weight."""

    flows: tuple[int, ...]
    time: float
    chunk_graph: int


def critical_path(pattern: Pattern, weights: np.ndarray) -> CriticalPath:
    """The heaviest path of ``pattern`` with flow weights ``weights`` (NaN counts as 0).

    Ties go to the lowest chunk graph, then the lowest device.
    """
    w = np.nan_to_num(np.asarray(weights, dtype=np.float64), nan=0.0)
    if w.shape != (pattern.num_flows,):
        raise TuneError(f"weights must have one entry per flow ({pattern.num_flows}), got shape {w.shape}")
    n, t_max = pattern.num_ranks, pattern.num_steps
    best: CriticalPath | None = None
    src_dev, dst_dev, steps = pattern.src_device, pattern.dst_device, pattern.steps
    for g in range(pattern.num_chunk_graphs):
        idx = pattern.graph_flows(g)
        dist = np.zeros((t_max + 1, n))
        pred = np.full((t_max + 1, n), -1, dtype=np.int64)
        k = 0
        for t in range(t_max):
            dist[t + 1] = dist[t]
            while k < idx.size and steps[idx[k]] == t:
                f = int(idx[k])
                cand = dist[t, src_dev[f]] + w[f]
                d = dst_dev[f]
                if cand > dist[t + 1, d]:
                    dist[t + 1, d] = cand
                    pred[t + 1, d] = f
                k += 1
        d = int(np.argmax(dist[t_max]))
        total = float(dist[t_max, d])
        if best is not None and total <= best.time:
            continue
        path = []
        t = t_max
        while t > 0:
            f = int(pred[t, d])
            if f >= 0:
                path.append(f)
                d = int(src_dev[f])
            t -= 1
        best = CriticalPath(tuple(reversed(path)), total, g)
    assert best is not None
    return best


def critical_paths(pattern: Pattern, fct: np.ndarray) -> list[CriticalPath]:
    """REACT's ``B + 1`` critical paths: one per epoch of ``fct[B, F]`` and one on the mean times."""
    fct = np.asarray(fct, dtype=np.float64)
    if fct.ndim != 2:
        raise TuneError(f"fct must be [epochs, flows], got shape {fct.shape}")
    paths = [critical_path(pattern, row) for row in fct]
    ok = np.isfinite(fct)
    mean = np.where(ok, fct, 0.0).sum(axis=0) / np.maximum(ok.sum(axis=0), 1)
    paths.append(critical_path(pattern, mean))
    return paths


def path_time(path: CriticalPath, weights: np.ndarray) -> float:
    """Total weight of ``path``'s flows under other weights (e.g. a model's estimate for a transformed pattern)."""
    w = np.nan_to_num(np.asarray(weights, dtype=np.float64), nan=0.0)
    return float(w[list(path.flows)].sum()) if path.flows else 0.0
