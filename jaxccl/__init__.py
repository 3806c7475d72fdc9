"""jaxccl: topology-aware, self-adapting collectives for JAX.

Public surface (see ``../shared/DESIGN.md``, "API contract"). Subpackages hold
the real code: ``topology``, ``schedule``, ``synth``, ``runtime``,
``telemetry``, ``control``, ``tune``, ``sim``.
"""

from jaxccl import schedule, synth, topology
from jaxccl.emulation import emulate
from jaxccl.errors import ExecutorError, JaxcclError, ScheduleError, SynthesisError, TopologyError

__version__ = "0.1.0"

__all__ = [
    "ExecutorError",
    "JaxcclError",
    "ScheduleError",
    "SynthesisError",
    "TopologyError",
    "emulate",
    "schedule",
    "synth",
    "topology",
]
