"""The closed loop's slow path: Algorithm 1 of MCCL and the controller thread that re-optimizes schedules."""

from jaxccl.control.algorithm1 import CheckResult, ScheduleProfile, check, nominal_capacities, profile
from jaxccl.control.controller import REDUCTIONS, Controller, Event, managed_collectives, measured_topology
from jaxccl.synth.ordered_reduce_scatter import ordered_reduce_scatter, predicted_algbw

__all__ = [
    "REDUCTIONS",
    "CheckResult",
    "Controller",
    "Event",
    "ScheduleProfile",
    "check",
    "managed_collectives",
    "measured_topology",
    "nominal_capacities",
    "ordered_reduce_scatter",
    "predicted_algbw",
    "profile",
]
