"""The controller driven by the training step: one host callback at the end of each jitted step.

The background thread of :class:`~jaxccl.control.Controller` decides on its
own clock. :func:`at_step_end` ties the decisions to step boundaries instead:
called inside a jitted step (outside ``jax.shard_map``), it adds one unordered
host callback (``jax.experimental.io_callback(..., ordered=False)``) that runs
once per step, after the values it is given are computed. The callback runs
one :meth:`~jaxccl.control.Controller.step`: it drains the telemetry, runs
Algorithm 1 and, when it re-synthesizes, stages the new schedule, which the
executor activates at the next agreed sequence number -- the next step's
collectives. A re-synthesis (tens of milliseconds) therefore lengthens the
step that triggered it; other steps pay the callback and one check.

A failing controller never stops training: :meth:`Controller.step` already
records its exceptions as ``"error"`` events, and the callback wrapper records
anything that escapes it the same way instead of raising into the step.

Example:
    >>> import jax, jax.numpy as jnp
    >>> class Recorder:  # anything with the controller's step() / record_error()
    ...     calls = 0
    ...     def step(self):
    ...         Recorder.calls += 1
    ...     def record_error(self, exc):
    ...         raise AssertionError(exc)
    >>> @jax.jit
    ... def train_step(x):
    ...     y = x * 2
    ...     at_step_end(Recorder(), y)
    ...     return y
    >>> _ = train_step(jnp.ones(3)).block_until_ready(); Recorder.calls
    1
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

from jaxccl.errors import ArgumentError

__all__ = ["StepTimes", "at_step_end"]


class StepTimes:
    """Host time of each step-end callback (nanoseconds), for the cost per step."""

    def __init__(self) -> None:
        self.ns: list[int] = []

    def add(self, ns: int) -> None:
        self.ns.append(int(ns))


class _Cadence:
    """Counts the calls of one traced step; the controller runs on every ``every``-th."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.calls = 0

    def due(self) -> bool:
        self.calls += 1
        return (self.calls - 1) % self.every == 0


def _on_step_end(controller: Any, times: StepTimes | None, cadence: _Cadence, _token: Any) -> None:
    if not cadence.due():
        return
    t0 = time.perf_counter_ns()
    try:
        controller.step()
    except Exception as e:  # noqa: BLE001 - the step must never see a controller failure
        with contextlib.suppress(Exception):  # recording is best effort; the step goes on regardless
            controller.record_error(e)
    if times is not None:
        times.add(time.perf_counter_ns() - t0)


def at_step_end(controller: Any, *after: Any, times: StepTimes | None = None, every: int = 1) -> None:
    """Runs ``controller.step()`` once per call of the jitted function this is traced into.

    Args:
        controller: a :class:`~jaxccl.control.Controller` (anything with
            ``step()`` and ``record_error(exc)``).
        *after: arrays of the step (its loss, its updated parameters) the
            callback waits for, so it runs at the step's end; without them it
            may run as soon as the step starts.
        times: where to record the callback's host time per step, if anywhere.
        every: run the controller on every ``every``-th step only (the first
            one included); the callback itself still runs every step.

    Raises:
        ValueError: ``every`` is not a positive integer.

    Call it inside ``jax.jit`` but outside ``jax.shard_map`` (inside, every
    device would run the controller).
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ArgumentError(f"at_step_end: every must be a positive integer, got {every!r}")
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    token = jnp.zeros((), jnp.float32)
    for a in after:
        for leaf in jax.tree.leaves(a):
            flat = jnp.ravel(leaf)
            if flat.size:
                token = token + flat[0].astype(jnp.float32)
    io_callback(functools.partial(_on_step_end, controller, times, _Cadence(every)), None, token, ordered=False)
