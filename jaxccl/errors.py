"""The exception types jaxccl raises."""


class JaxcclError(Exception):
    """Base class of every jaxccl error."""


class TopologyError(JaxcclError, ValueError):
    """A topology is malformed, disconnected, or a node/link does not exist."""


class ScheduleError(JaxcclError, ValueError):
    """A schedule is malformed, does not implement its collective, or can deadlock."""


class SynthesisError(JaxcclError, RuntimeError):
    """A synthesizer failed (solver status, infeasible input, time budget)."""


class ExecutorError(JaxcclError, RuntimeError):
    """The native executor reported a failure (deadline, bad table, missing schedule)."""
