"""The executor's measurement counters, the same fields on both native backends (:class:`MeasurementStats`).

The CPU executor counts per emulated network (``jaxccl._native.measure_stats(network)``), the
CUDA executor per process (``jaxccl._native_cuda.measure_stats()``, every CUDA collective of the
process), with other keys besides the common ones. :func:`from_cpu_stats` and
:func:`from_cuda_stats` map each onto one :class:`MeasurementStats`;
:meth:`jaxccl.Communicator.measurement` returns it on either backend. Both count since the
counters' last reset, except ``dropped``: the records dropped since the previous reading (the
caller says how many it had seen, ``dropped_before``), on both backends.

Example:
    >>> raw = {"windows": 5, "records": 4, "dropped": 3, "regions": 2, "slots": 16, "used": 4,
    ...        "accumulator_bytes": 128, "cache_entry_bytes": 24, "cache_entries_per_tb": 16, "buffer_bytes": 512}
    >>> first = from_cpu_stats(raw)
    >>> first.dropped, first.dropped_total, first.pending, first.backend
    (3, 3, 0, 'cpu')
    >>> from_cpu_stats(dict(raw, dropped=5), dropped_before=first.dropped_total).dropped
    2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxccl.errors import ExecutorError

__all__ = ["CPU_STATS_KEYS", "CUDA_STATS_KEYS", "MeasurementStats", "from_cpu_stats", "from_cuda_stats"]

# What both backends count under the same name and meaning (MeasurementStats takes them as they are).
_COMMON = (
    "windows",
    "records",
    "regions",
    "slots",
    "used",
    "accumulator_bytes",
    "cache_entry_bytes",
    "cache_entries_per_tb",
    "buffer_bytes",
)
# The keys of jaxccl._native.measure_stats(network) (xla_ffi/bindings/native_module.cc).
CPU_STATS_KEYS = frozenset({*_COMMON, "dropped"})
# The keys of jaxccl._native_cuda.measure_stats() (kernels/cuda_module.cc): the settings in force, then the
# counters and footprint of kernels/measure.h's MeasureStatsResult.
CUDA_STATS_KEYS = CPU_STATS_KEYS | {
    "enabled",
    "host_of_rank",
    "intra_threshold",
    "inter_threshold",
    "slots_per_tb",
    "min_window_bytes",
    "drained",
    "pending",
    "buffers",
    "cache_bytes",
    "counter_bytes",
}


@dataclasses.dataclass(frozen=True)
class MeasurementStats:
    """The passive measurement's counters (since their last reset) and memory footprint, on either backend.

    Attributes:
        backend: ``"cpu"`` or ``"cuda"``.
        scope: what is counted: ``"network"`` (CPU: the collectives of the communicator's emulated
            network) or ``"process"`` (CUDA: every CUDA collective of this process).
        windows: measurement windows closed with a bandwidth (also those whose record was dropped).
        records: records written into the Measurements Buffer.
        dropped: records dropped (a full buffer region or cache) since the previous reading by the
            same reader (:meth:`jaxccl.Communicator.measurement`: its previous call); after a reset
            of the counters in between, those since the reset.
        dropped_total: records dropped since the counters' reset.
        pending: records held on the host outside the buffer until the next drain (CUDA: from
            buffers that were reallocated; the CPU executor never holds any: 0).
        regions: threadblock regions of the buffer(s).
        slots: buffer slots in all regions.
        used: slots holding a record that was not drained yet.
        accumulator_bytes: memory of the accumulators (MCCL Table 2).
        cache_entry_bytes: bytes of one entry of a threadblock's measurement cache.
        cache_entries_per_tb: entries of one threadblock's cache.
        buffer_bytes: memory of the buffer slots (``slots`` records of 32 bytes).
    """

    backend: str
    scope: str
    windows: int
    records: int
    dropped: int
    dropped_total: int
    pending: int
    regions: int
    slots: int
    used: int
    accumulator_bytes: int
    cache_entry_bytes: int
    cache_entries_per_tb: int
    buffer_bytes: int

    @property
    def undrained(self) -> int:
        """Records the next drain (:meth:`jaxccl.Communicator.telemetry`) returns: ``used + pending``."""
        return self.used + self.pending


def dropped_since(total: int, before: int) -> int:
    """Records dropped since a reading that had seen ``before`` of a running ``total``.

    A total below ``before`` means the counters were reset in between: then all of it is new.

    >>> dropped_since(7, 4), dropped_since(2, 4)
    (3, 2)
    """
    return int(total) - int(before) if int(total) >= int(before) else int(total)


def _checked(raw: Mapping[str, Any], keys: frozenset[str], source: str) -> Mapping[str, Any]:
    missing = sorted(keys - set(raw))
    if missing:
        raise ExecutorError(
            f"{source} returned no {', '.join(missing)}: the native module and jaxccl's Python side are from "
            "different builds (reinstall jaxccl)"
        )
    return raw


def _stats(backend: str, scope: str, raw: Mapping[str, Any], pending: int, dropped_before: int) -> MeasurementStats:
    total = int(raw["dropped"])
    return MeasurementStats(
        backend=backend,
        scope=scope,
        dropped=dropped_since(total, dropped_before),
        dropped_total=total,
        pending=int(pending),
        **{k: int(raw[k]) for k in _COMMON},
    )


def from_cpu_stats(raw: Mapping[str, Any], *, dropped_before: int = 0) -> MeasurementStats:
    """:class:`MeasurementStats` of the dict ``jaxccl._native.measure_stats(network)`` returns (one network).

    ``dropped_before``: the ``dropped_total`` of the previous reading (0: none).

    Raises:
        ExecutorError: ``raw`` lacks a key of :data:`CPU_STATS_KEYS`.
    """
    raw = _checked(raw, CPU_STATS_KEYS, "jaxccl._native.measure_stats")
    return _stats("cpu", "network", raw, 0, dropped_before)


def from_cuda_stats(raw: Mapping[str, Any], *, dropped_before: int = 0) -> MeasurementStats:
    """:class:`MeasurementStats` of the dict ``jaxccl._native_cuda.measure_stats()`` returns (the whole process).

    ``dropped_before``: the ``dropped_total`` of the previous reading (0: none).

    Raises:
        ExecutorError: ``raw`` lacks a key of :data:`CUDA_STATS_KEYS`.
    """
    raw = _checked(raw, CUDA_STATS_KEYS, "jaxccl._native_cuda.measure_stats")
    return _stats("cuda", "process", raw, int(raw["pending"]), dropped_before)
