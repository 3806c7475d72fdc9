"""The closed loop's slow path: Algorithm 1 of MCCL and the controller thread that re-optimizes schedules."""

from jaxccl.control.algorithm1 import CheckResult, ScheduleProfile, check, nominal_capacities, profile
from jaxccl.control.controller import Controller, Event, measured_topology

__all__ = [
    "CheckResult",
    "Controller",
    "Event",
    "ScheduleProfile",
    "check",
    "measured_topology",
    "nominal_capacities",
    "profile",
]
