"""The exception types jaxccl raises.

Every error is a :class:`JaxcclError`; each also derives from the built-in
type that says what went wrong (``ValueError`` for bad input,
``RuntimeError`` for a failure while working), so ``except ValueError`` keeps
working for callers that do not know jaxccl's types.

>>> issubclass(OptionError, JaxcclError) and issubclass(OptionError, ValueError)
True
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TypeVar

_T = TypeVar("_T")


class JaxcclError(Exception):
    """Base class of every jaxccl error."""


class TopologyError(JaxcclError, ValueError):
    """A topology is malformed, disconnected, or a node/link does not exist."""


class ScheduleError(JaxcclError, ValueError):
    """A schedule is malformed, does not implement its collective, or can deadlock."""


class SynthesisError(JaxcclError, RuntimeError):
    """A synthesizer failed (solver status, infeasible input, time budget)."""


class ExecutorError(JaxcclError, RuntimeError):
    """The native executor reported a failure (deadline, bad table, missing schedule).

    Attributes:
        rank: the rank that reported it, when the executor said (else ``None``).
        threadblock: that rank's threadblock, when known.
        op: the op of that threadblock, when known.

    A failure inside a running collective reaches Python as XLA's runtime
    error; :func:`jaxccl.runtime.failures.executor_errors` (also applied when
    it propagates out of ``with comm:``) re-raises it as this type.
    """

    def __init__(
        self, message: str = "", *, rank: int | None = None, threadblock: int | None = None, op: int | None = None
    ):
        super().__init__(message)
        self.rank, self.threadblock, self.op = rank, threadblock, op


class DeadlineError(ExecutorError, TimeoutError):
    """A wait of the executor (rendezvous, message, slot) missed its deadline; the communicator stays usable."""


class CommunicatorClosedError(ExecutorError):
    """A :class:`~jaxccl.Communicator` was used after :meth:`~jaxccl.Communicator.close`.

    Every method of a closed communicator raises it, and so does a collective of a program traced with it
    that runs after (or races) the close: its registry slots are gone.
    """


class TuneError(JaxcclError, ValueError):
    """Bad input to the tuner: a malformed context, an empty arm set, a negative latency, bad state JSON."""


class OptionError(JaxcclError, ValueError):
    """An option that picks one of a few named variants got another value.

    One rule for every such keyword (``method=`` of the AllGather synthesis
    and of the AllToAll emission and pricing, ``pricing=`` of
    :func:`jaxccl.synth.alltoall`, ``routing=`` of the simulator, REACT's
    ``unknown=`` and ``end=``): a value
    outside the choices raises this error, whose message names the keyword,
    the value and every valid choice. It is a ``ValueError`` (the caller
    passed a bad value; nothing failed while working), not the error type of
    the module the keyword belongs to.

    >>> OptionError.check("method", "magic", ("forestcoll", "latency"))
    Traceback (most recent call last):
    ...
    jaxccl.errors.OptionError: method='magic' is not one of 'forestcoll', 'latency'
    >>> OptionError.check("pricing", None, ("dag", "dijkstra"), allow_none=True) is None
    True
    """

    @classmethod
    def check(cls, option: str, value: _T, choices: Collection[str], *, allow_none: bool = False) -> _T:
        """Returns ``value`` if it is one of ``choices`` (or None with ``allow_none``), else raises.

        Args:
            option: the keyword's name, for the message.
            value: what the caller passed.
            choices: the valid values.
            allow_none: None is valid too (it picks a documented default).

        Raises:
            OptionError: ``value`` is not a valid choice.
        """
        if (value is None and allow_none) or (isinstance(value, str) and value in choices):
            return value
        valid = ", ".join(repr(c) for c in choices) + (" or None" if allow_none else "")
        raise cls(f"{option}={value!r} is not one of {valid}")
