"""Choosing and reshaping schedules online: NCCL-BOT bandits seeded by a cost model, and REACT.

Thin re-exports; the code lives in the submodules (``arms``, ``cost_model``,
``bandits``, ``replay``, ``online`` for a live communicator: :class:`OnlineTuner`; ``process_tuner``
for one across processes: :class:`ProcessTuner`; ``measured`` for pools measured on this machine;
``react`` for REACT's pattern transforms).
"""

from jaxccl.tune import react
from jaxccl.tune.arms import (
    COLLECTIVES,
    Arm,
    Context,
    TuneError,
    arm_catalog,
    arm_names,
    direct_allgather,
    exact_arm,
)
from jaxccl.tune.bandits import DEFAULT_POLICY, ContextBandit, Selector, filter_arms, make_policy
from jaxccl.tune.cost_model import CostModel, CostParams, calibrate, margin
from jaxccl.tune.online import OnlineTuner
from jaxccl.tune.process_tuner import ProcessTuner
from jaxccl.tune.react import ReactConfig, run_react

__all__ = [
    "COLLECTIVES",
    "DEFAULT_POLICY",
    "Arm",
    "Context",
    "ContextBandit",
    "CostModel",
    "CostParams",
    "OnlineTuner",
    "ProcessTuner",
    "ReactConfig",
    "Selector",
    "TuneError",
    "arm_catalog",
    "arm_names",
    "calibrate",
    "direct_allgather",
    "exact_arm",
    "filter_arms",
    "make_policy",
    "margin",
    "react",
    "run_react",
]
