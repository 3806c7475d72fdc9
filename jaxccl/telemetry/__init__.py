"""Passive measurements: decoding executor records into the EWMA link matrix (MCCL Sec. 5, App. B).

``comm.telemetry()`` drains the executor's Measurements Buffer into a
:class:`TelemetryCollector` and returns a :class:`Telemetry` snapshot.
"""

from jaxccl.telemetry.matrix import Telemetry, TelemetryCollector
from jaxccl.telemetry.records import RECORD_DTYPE, decode

__all__ = ["RECORD_DTYPE", "Telemetry", "TelemetryCollector", "decode"]
