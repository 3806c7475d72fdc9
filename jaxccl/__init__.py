"""jaxccl: topology-aware, self-adapting collectives for JAX.

The public surface: ``emulate``, the collectives (``all_gather``,
``all_to_all``, ``psum_scatter``, ``psum``, ``pmax``, ``pmin``, ``pmean``),
``Communicator``, the error
types and the subpackages that hold the real code: ``topology``,
``schedule``, ``synth``, ``runtime``, ``telemetry``, ``control``, ``tune``,
``sim``. How they fit together: ``docs/architecture.md``.
"""

from jaxccl import schedule, synth, topology
from jaxccl.devices import emulate
from jaxccl.errors import (
    ArgumentError,
    CommunicatorClosedError,
    ContextError,
    DeadlineError,
    ExecutorError,
    JaxcclError,
    OptionError,
    ScheduleError,
    SimulationError,
    SynthesisError,
    TopologyError,
    TuneError,
    UnboundAxisError,
    UnsupportedError,
    UnsupportedTypeError,
)
from jaxccl.offload import offload  # imports JAX only when called

__version__ = "0.1.0"


def has_cuda_support() -> bool:
    """Whether the CUDA executor was built and a CUDA device is visible.

    >>> isinstance(has_cuda_support(), bool)
    True
    """
    try:
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)
    except ImportError:
        return False
    return native.has_cuda_support()


# The collectives and the Communicator import JAX; load them on first use so that
# ``import jaxccl`` stays cheap and ``jaxccl.emulate()`` can run before JAX starts.
_LAZY = {
    "Communicator": "jaxccl.runtime.communicator",
    "all_gather": "jaxccl.runtime.collectives",
    "all_to_all": "jaxccl.runtime.collectives",
    "pmax": "jaxccl.runtime.collectives",
    "pmean": "jaxccl.runtime.collectives",
    "pmin": "jaxccl.runtime.collectives",
    "psum": "jaxccl.runtime.collectives",
    "psum_scatter": "jaxccl.runtime.collectives",
}


def __getattr__(name: str):
    if name == "sim":
        import importlib

        return importlib.import_module("jaxccl.sim")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxccl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ArgumentError",
    "Communicator",
    "CommunicatorClosedError",
    "ContextError",
    "DeadlineError",
    "ExecutorError",
    "JaxcclError",
    "OptionError",
    "ScheduleError",
    "SimulationError",
    "SynthesisError",
    "TopologyError",
    "TuneError",
    "UnboundAxisError",
    "UnsupportedError",
    "UnsupportedTypeError",
    "all_gather",
    "all_to_all",
    "emulate",
    "has_cuda_support",
    "offload",
    "pmax",
    "pmean",
    "pmin",
    "psum",
    "psum_scatter",
    "schedule",
    "synth",
    "topology",
]
