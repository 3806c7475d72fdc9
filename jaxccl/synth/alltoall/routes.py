"""The chunk routes of a synthesized AllToAll, as stored in ``Schedule.info["paths"]``.

Columnar and JSON-serializable, so that a 512-GPU schedule (a quarter
million routes) encodes and decodes in milliseconds::

    {"nodes": [...],          # node names (GPU ranks are ints, switches strings)
     "src": [...], "dst": [...], "chunks": [...],   # one entry per route
     "offset": [...],         # route i visits route[offset[i]:offset[i+1]]
     "route": [...]}          # indices into "nodes"

:func:`decode_paths` turns it into ``(src, dst, chunks, [node, ...])`` rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxccl.errors import ScheduleError
from jaxccl.synth.alltoall.columns import ColumnPool
from jaxccl.synth.alltoall.network import Network

KEYS = ("nodes", "src", "dst", "chunks", "offset", "route")


def encode_paths(net: Network, pool: ColumnPool, comm: np.ndarray, pid: np.ndarray, count: np.ndarray) -> dict:
    """The columnar form of rounded rows ``(s*N + d, path id, chunks)``."""
    n = net.num_gpus
    route, length = route_nodes(net, pool.paths[pid])
    return {
        "nodes": list(net.nodes),
        "src": (comm // n).tolist(),
        "dst": (comm % n).tolist(),
        "chunks": np.asarray(count).tolist(),
        "offset": np.r_[0, np.cumsum(length)].tolist(),
        "route": route.tolist(),
    }


def route_nodes(net: Network, arcs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Node indices along each route (rows of -1 padded arcs): ``(flat nodes, nodes per route)``."""
    if arcs.shape[0] == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    valid = arcs >= 0
    first = net.tail[arcs[:, 0]]
    heads = net.head[np.where(valid, arcs, 0)]
    seq = np.concatenate([first[:, None], heads], axis=1)
    keep = np.concatenate([np.ones((arcs.shape[0], 1), bool), valid], axis=1)
    return seq[keep].astype(np.int64), valid.sum(axis=1) + 1


def decode_paths(paths: Mapping[str, Any]) -> list[tuple[int, int, int, list]]:
    """``(src, dst, chunks, [node, ...])`` per route of an ``info["paths"]`` table.

    Raises:
        ScheduleError: if the table is malformed.

    >>> decode_paths({"nodes": [0, 1, "sw"], "src": [0], "dst": [1], "chunks": [2],
    ...               "offset": [0, 3], "route": [0, 2, 1]})
    [(0, 1, 2, [0, 'sw', 1])]
    """
    src, dst, chunks, nodes, route, offset = _columns(paths)
    return [
        (s, d, c, [nodes[v] for v in route[a:b]])
        for s, d, c, a, b in zip(src.tolist(), dst.tolist(), chunks.tolist(), offset[:-1].tolist(), offset[1:].tolist())
    ]


def _columns(paths: Mapping[str, Any]):
    if not isinstance(paths, Mapping) or any(k not in paths for k in KEYS):
        raise ScheduleError(f"info['paths'] must be a mapping with keys {KEYS}")
    try:
        src = np.asarray(paths["src"], dtype=np.int64)
        dst = np.asarray(paths["dst"], dtype=np.int64)
        chunks = np.asarray(paths["chunks"], dtype=np.int64)
        offset = np.asarray(paths["offset"], dtype=np.int64)
        route = np.asarray(paths["route"], dtype=np.int64)
        nodes = list(paths["nodes"])
    except (TypeError, ValueError) as e:
        raise ScheduleError(f"malformed info['paths']: {e}") from e
    r = src.size
    if (
        dst.size != r
        or chunks.size != r
        or offset.size != r + 1
        or (r and (offset[0] != 0 or offset[-1] != route.size))
    ):
        raise ScheduleError("malformed info['paths']: column lengths disagree")
    if np.any(np.diff(offset) < 0) or (route.size and (route.min() < 0 or route.max() >= len(nodes))):
        raise ScheduleError("malformed info['paths']: bad offsets or node indices")
    return src, dst, chunks, nodes, route, offset


def route_arcs(net: Network, paths: Mapping[str, Any]):
    """The routes mapped onto ``net``: ``(src, dst, chunks, arcs, ok)``.

    ``arcs`` is ``(R, L)`` arc indices (-1 padded); ``ok`` marks the routes
    whose nodes and links all exist in ``net`` and that go from ``src`` to ``dst``.
    """
    src, dst, chunks, nodes, route, offset = _columns(paths)
    index = net.index
    remap = np.array([index.get(v, -1) for v in nodes], dtype=np.int64)
    seq = remap[route] if route.size else route
    length = np.diff(offset)
    r = src.size
    width = max(int(length.max()) - 1, 1) if r else 1
    grid = np.full((r, width + 1), -2, dtype=np.int64)
    row = np.repeat(np.arange(r), length)
    grid[row, np.arange(route.size) - offset[row]] = seq
    arcmat = np.full((net.num_nodes + 1, net.num_nodes + 1), -1, dtype=np.int64)
    arcmat[net.tail, net.head] = np.arange(net.num_arcs)
    step = np.arange(width)[None, :] < (length - 1)[:, None]
    arcs = np.where(step, arcmat[np.maximum(grid[:, :-1], -1), np.maximum(grid[:, 1:], -1)], -1)
    n = net.num_gpus
    ok = (length >= 2) & (src >= 0) & (src < n) & (dst >= 0) & (dst < n) & (src != dst) & (chunks >= 1)
    ok &= ~np.any((grid == -1), axis=1)  # a node that no longer exists
    last = grid[np.arange(r), np.maximum(length - 1, 0)]
    ok &= (grid[:, 0] == src) & (last == dst)
    ok &= ~np.any(step & (arcs < 0), axis=1)
    return src, dst, chunks, arcs.astype(np.int32), ok
