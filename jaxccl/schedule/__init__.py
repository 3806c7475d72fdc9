"""The schedule IR, its reference interpreter, MSCCL XML and the compiled table."""

from jaxccl.schedule.builder import Handle, ScheduleBuilder
from jaxccl.schedule.ir import (
    SCHEMA_VERSION,
    Buffer,
    Collective,
    Op,
    OpKind,
    Schedule,
    Threadblock,
    chunk_bounds,
    make_schedule,
    period_elements,
)
from jaxccl.schedule.msccl_xml import from_msccl_xml as _from_msccl_xml


def from_msccl_xml(text: str) -> Schedule:
    """Imports an MSCCL XML algorithm; see :mod:`jaxccl.schedule.msccl_xml`."""
    return _from_msccl_xml(text)


__all__ = [
    "SCHEMA_VERSION",
    "Buffer",
    "Collective",
    "Handle",
    "Op",
    "OpKind",
    "Schedule",
    "ScheduleBuilder",
    "Threadblock",
    "chunk_bounds",
    "from_msccl_xml",
    "make_schedule",
    "period_elements",
]
