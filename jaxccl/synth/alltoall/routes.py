"""The chunk routes of a synthesized AllToAll, as stored in ``Schedule.info["paths"]``.

Columnar and JSON-serializable, so that a 512-GPU schedule (a quarter
million routes) encodes and decodes in milliseconds::

    {"nodes": [...],          # node names (GPU ranks are ints, switches strings)
     "encoding": "int32-le-base64",
     "src": ..., "dst": ..., "chunks": ...,   # one entry per route
     "offset": ...,           # route i visits route[offset[i]:offset[i+1]]
     "route": ...}            # indices into "nodes"

Each integer column is one string: the base64 of its little-endian int32
values (:func:`encode_column`). A list of a million Python ints costs the
garbage collector a walk over every element at each collection that sees it
young (1.5 ms for the 128-GPU table, as much as a whole warm-start repair
step); a string costs nothing. Readers also take plain integer lists
(:func:`decode_column`), e.g. for hand-written tables.

:func:`decode_paths` turns it into ``(src, dst, chunks, [node, ...])`` rows.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxccl.errors import ScheduleError
from jaxccl.synth.alltoall.network import Network

KEYS = ("nodes", "src", "dst", "chunks", "offset", "route")
COLUMN_ENCODING = "int32-le-base64"
_INT32 = np.iinfo(np.int32)


def encode_column(values: np.ndarray) -> str:
    """An integer column as the base64 of its little-endian int32 values.

    >>> encode_column(np.array([1, 2, 3]))
    'AQAAAAIAAAADAAAA'
    """
    arr = np.asarray(values)
    if arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise ScheduleError("info['paths'] column values exceed the int32 range")
    return base64.b64encode(arr.astype("<i4").tobytes()).decode("ascii")


def decode_column(value: Any) -> np.ndarray:
    """An ``info["paths"]`` integer column (an :func:`encode_column` string, or a list of ints) as int64.

    Raises:
        ScheduleError: if it is neither.

    >>> decode_column("AQAAAAIAAAADAAAA").tolist(), decode_column([4, 5]).tolist()
    ([1, 2, 3], [4, 5])
    """
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value.encode("ascii"), validate=True)
        except (binascii.Error, ValueError, UnicodeEncodeError) as e:
            raise ScheduleError(f"malformed info['paths'] column: {e}") from e
        if len(raw) % 4:
            raise ScheduleError("malformed info['paths'] column: not a whole number of int32 values")
        return np.frombuffer(raw, dtype="<i4").astype(np.int64)
    try:
        arr = np.asarray(value, dtype=np.int64)
    except (TypeError, ValueError) as e:
        raise ScheduleError(f"malformed info['paths'] column: {e}") from e
    if arr.ndim != 1:
        raise ScheduleError("malformed info['paths'] column: not a flat list of integers")
    return arr


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
    src, dst, chunks = (decode_column(paths[k]) for k in ("src", "dst", "chunks"))
    offset, route = decode_column(paths["offset"]), decode_column(paths["route"])
    try:
        nodes = list(paths["nodes"])
    except TypeError as e:
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
