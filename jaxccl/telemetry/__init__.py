"""Passive measurements: decoding executor records into the EWMA link matrix (MCCL Sec. 5, App. B).

``comm.telemetry()`` drains the executor's Measurements Buffer into a
:class:`TelemetryCollector` and returns a :class:`Telemetry` snapshot;
``comm.measurement()`` returns the measurement's counters as a :class:`MeasurementStats`
(the same fields on the CPU and the CUDA executor).
"""

from jaxccl.telemetry.matrix import WINDOW_DTYPE, Telemetry, TelemetryCollector, entry_capacities
from jaxccl.telemetry.records import RECORD_DTYPE, decode
from jaxccl.telemetry.stats import MeasurementStats, from_cpu_stats, from_cuda_stats

__all__ = [
    "RECORD_DTYPE",
    "WINDOW_DTYPE",
    "MeasurementStats",
    "Telemetry",
    "TelemetryCollector",
    "decode",
    "entry_capacities",
    "from_cpu_stats",
    "from_cuda_stats",
]
