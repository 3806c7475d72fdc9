"""REACT: congestion-driven rank swaps for reduction collectives (REACT paper, Sec. 5, App. A).

A collective *pattern* (ring AllReduce, NCCL's double binary tree AllReduce,
recursive-doubling AllGather) is a time-expanded network whose positions are
played by devices; REACT measures the completion time of every flow over a
batch of epochs, detects steady (Eq. 1) and erratic (Eq. 2) congestion, and
swaps devices between positions -- globally, inside one chunk graph, or at one
vertex (position-equivalent, App. A.3) -- when the swap keeps the collective's
semantics, does not raise any flow's degree (Sec. 5.3.2) and is predicted by
an analytic model to cut the critical paths by at least 5 % (Alg. 1, App.
A.5). Every transformed pattern compiles to a jaxccl
:class:`~jaxccl.schedule.Schedule` checked by the reference interpreter.

Modules: :mod:`~jaxccl.tune.react.pattern` (TENs), :mod:`~jaxccl.tune.react.semantics`
(bitvector check), :mod:`~jaxccl.tune.react.compile` (pattern -> Schedule),
:mod:`~jaxccl.tune.react.transforms`, :mod:`~jaxccl.tune.react.detect`,
:mod:`~jaxccl.tune.react.critical_path`, :mod:`~jaxccl.tune.react.model`,
:mod:`~jaxccl.tune.react.algorithm` (Alg. 1 and the loop over batches),
:mod:`~jaxccl.tune.react.measure` (runners: the simulator with external flows),
:mod:`~jaxccl.tune.react.executor` (the runner on the emulated CPU executor, from its message trace).

Example:
    >>> from jaxccl.topology import fat_tree
    >>> from jaxccl.tune import react
    >>> runner = react.SimulatorRunner(16 << 20, external=[react.ExternalFlows(8, 3, 2)])
    >>> result = react.run_react(react.double_binary_tree_pattern(8), react.pattern_measurer(runner, fat_tree(1, 9)))
    >>> result.pattern.to_schedule().validate().collective.value
    'all_reduce'
"""

from jaxccl.tune.react.algorithm import (
    Decision,
    ReactConfig,
    ReactResult,
    RoundLog,
    TransformOutcome,
    apply_transforms,
    problem_devices,
    run_react,
    steady_congested_devices,
)
from jaxccl.tune.react.compile import CompiledPattern, compile_pattern
from jaxccl.tune.react.critical_path import CriticalPath, critical_path, critical_paths, path_time
from jaxccl.tune.react.detect import DELTA1, DELTA2, Congestion, detect_congestion
from jaxccl.tune.react.executor import (
    ExecutorRunner,
    expected_sends,
    interleaved_runs,
    table_op_indices,
    trace_measurement,
)
from jaxccl.tune.react.measure import (
    ExternalFlows,
    Measurement,
    Runner,
    SimulatorRunner,
    degraded_topology,
    external_flows_schedule,
    flow_times,
    pattern_measurer,
)
from jaxccl.tune.react.model import EPSILON, FlowHistory, accepts, predicted_gain
from jaxccl.tune.react.pattern import (
    Flow,
    FlowKind,
    Pattern,
    double_binary_tree_pattern,
    pattern_for,
    recursive_doubling_pattern,
    ring_allreduce_pattern,
)
from jaxccl.tune.react.semantics import Semantics, check_chunk_graph, simulate
from jaxccl.tune.react.transforms import (
    Candidate,
    Transform,
    TransformKind,
    apply_all,
    degree_preserving,
    device_degree,
    is_valid,
    position_equivalent_swaps,
    viable_set,
)

__all__ = [
    "DELTA1",
    "DELTA2",
    "EPSILON",
    "Candidate",
    "CompiledPattern",
    "Congestion",
    "CriticalPath",
    "Decision",
    "ExecutorRunner",
    "ExternalFlows",
    "Flow",
    "FlowHistory",
    "FlowKind",
    "Measurement",
    "Pattern",
    "ReactConfig",
    "ReactResult",
    "RoundLog",
    "Runner",
    "Semantics",
    "SimulatorRunner",
    "Transform",
    "TransformKind",
    "TransformOutcome",
    "accepts",
    "apply_all",
    "apply_transforms",
    "check_chunk_graph",
    "compile_pattern",
    "critical_path",
    "critical_paths",
    "degraded_topology",
    "degree_preserving",
    "detect_congestion",
    "device_degree",
    "double_binary_tree_pattern",
    "expected_sends",
    "external_flows_schedule",
    "flow_times",
    "interleaved_runs",
    "is_valid",
    "path_time",
    "pattern_for",
    "pattern_measurer",
    "position_equivalent_swaps",
    "predicted_gain",
    "problem_devices",
    "recursive_doubling_pattern",
    "ring_allreduce_pattern",
    "run_react",
    "simulate",
    "steady_congested_devices",
    "table_op_indices",
    "trace_measurement",
    "viable_set",
]
