"""Decoding the Measurements Buffer (layout: ``xla_ffi/core/measurement_format.h``, version 1).

Each record is 32 bytes: ``flag, src, dst, kind, count, tb`` (int32) and
``sum_bw`` (float64, bytes/s summed over ``count`` measurement windows).
``kind`` 0 is a GPU's intra-node injection throughput (``dst == -1``), 1 an
inter-node GPU pair.

Example:
    >>> import numpy as np
    >>> raw = np.array([(1, 0, -1, 0, 2, 3, 10.0)], dtype=RECORD_DTYPE).tobytes()
    >>> decode(raw)["sum_bw"].tolist()
    [10.0]
"""

from __future__ import annotations

import numpy as np

from jaxccl.errors import ExecutorError

__all__ = ["INTER", "INTRA", "MEASUREMENT_VERSION", "RECORD_DTYPE", "decode"]

MEASUREMENT_VERSION = 1
INTRA = 0
INTER = 1

RECORD_DTYPE = np.dtype(
    [
        ("flag", "<i4"),
        ("src", "<i4"),
        ("dst", "<i4"),
        ("kind", "<i4"),
        ("count", "<i4"),
        ("tb", "<i4"),
        ("sum_bw", "<f8"),
    ]
)
assert RECORD_DTYPE.itemsize == 32


def decode(raw: bytes, *, num_gpus: int | None = None) -> np.ndarray:
    """The records of a drained buffer as a structured array (``RECORD_DTYPE``).

    Raises:
        ExecutorError: the byte count is not a multiple of 32, a record is not
            flagged valid, or (with ``num_gpus``) names a GPU out of range or an
            unknown kind.
    """
    if len(raw) % RECORD_DTYPE.itemsize:
        raise ExecutorError(f"measurement buffer: {len(raw)} bytes is not a whole number of 32-byte records")
    recs = np.frombuffer(raw, dtype=RECORD_DTYPE)
    if recs.size == 0:
        return recs
    if np.any(recs["flag"] != 1):
        raise ExecutorError("measurement buffer: a drained record is not flagged valid")
    if np.any((recs["kind"] != INTRA) & (recs["kind"] != INTER)):
        raise ExecutorError(f"measurement buffer: unknown record kind(s) {sorted(set(recs['kind'].tolist()))}")
    if np.any(recs["count"] < 1) or np.any(~np.isfinite(recs["sum_bw"])):
        raise ExecutorError("measurement buffer: a record has no windows or a non-finite bandwidth")
    if num_gpus is not None:
        bad = (recs["src"] < 0) | (recs["src"] >= num_gpus)
        bad |= (recs["kind"] == INTER) & ((recs["dst"] < 0) | (recs["dst"] >= num_gpus))
        if np.any(bad):
            raise ExecutorError(f"measurement buffer: a record names a GPU outside 0..{num_gpus - 1}")
    return recs
