"""The exception types jaxccl raises: every class of them is defined here.

Every error is a :class:`JaxcclError`; each also derives from the built-in
type that says what went wrong (``ValueError`` for bad input, ``TypeError``
for input of the wrong type, ``RuntimeError`` for a failure while working,
``NotImplementedError`` for what jaxccl does not support), so ``except
ValueError`` keeps working for callers that do not know jaxccl's types.

Which one to raise: the error of the layer whose input is wrong
(:class:`TopologyError`, :class:`ScheduleError`, :class:`TuneError`, ...);
:class:`OptionError` for a keyword that picks a variant; else
:class:`ArgumentError` (or :class:`UnsupportedTypeError`) for an argument out of
range, of the wrong shape or type; :class:`ContextError` for a call made where
it cannot run; :class:`UnsupportedError` for a valid request jaxccl does not
implement. ``tests/runtime/test_errors.py`` scans ``jaxccl/`` for raises of
built-in types outside its short allowlist.

>>> issubclass(OptionError, JaxcclError) and issubclass(OptionError, ValueError)
True
>>> issubclass(UnsupportedTypeError, TypeError) and issubclass(UnsupportedError, NotImplementedError)
True
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Collection
from typing import TypeVar

_T = TypeVar("_T")


class JaxcclError(Exception):
    """Base class of every jaxccl error."""


class ArgumentError(JaxcclError, ValueError):
    """An argument's value cannot be used: out of range, of the wrong shape, inconsistent with another argument.

    Raised where no error of the layer fits better (a layer's own input errors are its own type:
    :class:`TopologyError`, :class:`ScheduleError`, :class:`TuneError`).
    """


class UnsupportedTypeError(ArgumentError, TypeError):
    """An argument of the wrong type, or an array of a dtype the operation does not take (also a ``TypeError``)."""


class UnboundAxisError(ArgumentError, NameError):
    """A collective names a mesh axis that is not in scope (a ``NameError``, as ``jax.lax`` raises)."""


class ContextError(JaxcclError, RuntimeError):
    """A call made where it cannot run: a collective outside ``jax.shard_map``, ``emulate()`` after JAX started."""


class UnsupportedError(JaxcclError, NotImplementedError):
    """A valid request that jaxccl does not implement (vmap axes, ``to="reduced"``, several platforms at once)."""


class TopologyError(JaxcclError, ValueError):
    """A topology is malformed, disconnected, or a node/link does not exist."""


class ScheduleError(JaxcclError, ValueError):
    """A schedule is malformed, does not implement its collective, or can deadlock."""


class SynthesisError(JaxcclError, RuntimeError):
    """A synthesizer failed (solver status, infeasible input, time budget)."""


class SimulationError(JaxcclError, RuntimeError):
    """The simulator gave up: a run exceeded its wall-time limit (``max_wall_s`` of :func:`jaxccl.sim.run`)."""


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


class TransportArgumentError(ArgumentError):
    """Bad input to the transport: a peer that is not another process, a tag too wide, an unknown option."""


class NetlabError(JaxcclError, RuntimeError):
    """Setting up, shaping or removing the network namespaces of a lab failed (the command and its message),
    or a job run in a lab failed (each process's exit status and output)."""


class DemoNetworkError(JaxcclError, RuntimeError):
    """The real-socket demo cannot run here (what is missing) or one of its processes failed (which, and why)."""


class UsageError(ArgumentError, argparse.ArgumentTypeError):
    """Bad command-line input: one line for the user, exit status 2."""


class TuneError(JaxcclError, ValueError):
    """Bad input to the tuner: a malformed context, an empty arm set, a negative latency, bad state JSON."""


class OptionError(ArgumentError):
    """An option that picks one of a few named variants got another value.

    One rule for every such keyword (``method=`` of the synthesizers and the
    NCCL baselines, ``routing=``/``execution=``/``sharing=`` of the
    simulator, ``backend=`` of a Communicator, REACT's ``unknown=`` and
    ``end=``, ...): each checks its value with
    :func:`jaxccl.util.options.choose`, so a value outside the choices raises
    this error, whose message names the keyword, the value and every valid
    choice. It is a ``ValueError`` (the caller passed a bad value; nothing
    failed while working), not the error type of the module the keyword
    belongs to.

    >>> from jaxccl.synth import all_gather
    >>> from jaxccl.topology import ring
    >>> all_gather(ring(4), method="magic")
    Traceback (most recent call last):
    ...
    jaxccl.errors.OptionError: method='magic' is not one of 'forestcoll', 'latency'
    """

    @classmethod
    def check(cls, option: str, value: _T, choices: Collection[str], *, allow_none: bool = False) -> _T:
        """Deprecated alias of :func:`jaxccl.util.options.choose` (removed in the next release)."""
        from jaxccl.util.options import choose  # here: jaxccl.util.options imports this module

        warnings.warn(
            "OptionError.check is deprecated: use jaxccl.util.options.choose; it is removed in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return choose(option, value, choices, allow_none=allow_none)
