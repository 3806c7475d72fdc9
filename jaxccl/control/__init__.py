"""The closed loop's slow path: Algorithm 1 of MCCL, a change-point detector, and the controller that re-optimizes."""

from jaxccl.control.algorithm1 import CheckResult, ScheduleProfile, check, nominal_capacities, profile
from jaxccl.control.controller import DETECTORS, REDUCTIONS, Controller, Event, managed_collectives, measured_topology
from jaxccl.control.detector import Change, ChangeDetector, cusum_threshold
from jaxccl.synth.ordered_reduce_scatter import ordered_reduce_scatter, predicted_algbw
from jaxccl.synth.tree_reduce_scatter import tree_reduce_scatter

__all__ = [
    "DETECTORS",
    "REDUCTIONS",
    "Change",
    "ChangeDetector",
    "CheckResult",
    "Controller",
    "Event",
    "ScheduleProfile",
    "check",
    "cusum_threshold",
    "managed_collectives",
    "measured_topology",
    "nominal_capacities",
    "ordered_reduce_scatter",
    "predicted_algbw",
    "profile",
    "tree_reduce_scatter",
]
