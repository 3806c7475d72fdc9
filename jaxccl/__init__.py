"""jaxccl: topology-aware, self-adapting collectives for JAX.

Public surface (see ``../shared/DESIGN.md``, "API contract"). Subpackages hold
the real code: ``topology``, ``schedule``, ``synth``, ``runtime``,
``telemetry``, ``control``, ``tune``, ``sim``.
"""

from jaxccl import schedule, synth, topology
from jaxccl.emulation import emulate
from jaxccl.errors import ExecutorError, JaxcclError, ScheduleError, SynthesisError, TopologyError

__version__ = "0.1.0"

# The collectives and the Communicator import JAX; load them on first use so that
# ``import jaxccl`` stays cheap and ``jaxccl.emulate()`` can run before JAX starts.
_LAZY = {
    "Communicator": "jaxccl.runtime.communicator",
    "all_gather": "jaxccl.runtime.collectives",
    "all_to_all": "jaxccl.runtime.collectives",
    "psum": "jaxccl.runtime.collectives",
    "psum_scatter": "jaxccl.runtime.collectives",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxccl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Communicator",
    "ExecutorError",
    "JaxcclError",
    "ScheduleError",
    "SynthesisError",
    "TopologyError",
    "all_gather",
    "all_to_all",
    "emulate",
    "psum",
    "psum_scatter",
    "schedule",
    "synth",
    "topology",
]
