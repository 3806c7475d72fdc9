"""Online schedule selection on a live communicator (NCCL-BOT Sec. 4 in a training loop).

Between steps, :meth:`OnlineTuner.prepare` asks the :class:`~jaxccl.tune.Selector`
which arm to run for a context (collective, ranks, bytes) and stages that arm's
schedule in the communicator (a hot-swap: nothing recompiles on the native
backends); after the step, :meth:`OnlineTuner.record` feeds back the latency
the executor measured for that collective's launch
(:func:`jaxccl.runtime.native.last_launch_seconds`: start of the launch to its
last threadblock, so host-side dispatch does not count). Contexts below the
selector's size gate keep the model's choice and are not timed.

One slot serves each collective of a communicator, so a step should run one
context per collective (the usual case: one AllGather size per FSDP step);
arms made of several parts (e.g. AllReduce as ReduceScatter + AllGather) are
not supported online.

Example:
    >>> tuner = OnlineTuner(comm, Selector.for_topology(topo))     # doctest: +SKIP
    >>> for step in range(100):                                     # doctest: +SKIP
    ...     arm = tuner.prepare("all_gather", nbytes)
    ...     out = train_step(...)                                   # calls jaxccl.all_gather inside
    ...     tuner.record("all_gather", nbytes, arm)
"""

from __future__ import annotations

from typing import Any

from jaxccl.tune.arms import Context, TuneError

__all__ = ["OnlineTuner"]


class OnlineTuner:
    """Drives a :class:`~jaxccl.tune.Selector` from a native-backend :class:`~jaxccl.Communicator`.

    Args:
        comm: the communicator whose schedules are chosen (``cpu`` or ``cuda`` backend).
        selector: a selector with an arm catalogue (``Selector.for_topology``).
    """

    def __init__(self, comm: Any, selector: Any):
        if comm.backend not in ("cpu", "cuda"):
            raise TuneError(f"OnlineTuner needs a native backend (cpu, cuda), not {comm.backend!r}")
        self.comm = comm
        self.selector = selector
        self._installed: dict[str, str] = {}  # collective -> digest of the schedule staged for it
        self.history: list[tuple[str, str, float | None]] = []  # (context key, arm, latency)

    def _context(self, collective: str, nbytes: int) -> Context:
        return Context(collective, self.comm.axis_size, int(nbytes))

    def prepare(self, collective: str, nbytes: int) -> str:
        """Chooses the arm for ``(collective, nbytes)`` and stages its schedule; returns the arm's name."""
        ctx = self._context(collective, nbytes)
        arm = self.selector.choose(ctx)
        parts = self.selector.schedules(ctx, arm)
        if len(parts) != 1 or parts[0].collective.value != ctx.collective:
            raise TuneError(
                f"arm {arm!r} of {ctx.key} has parts {[p.collective.value for p in parts]}; online selection "
                "supports single-schedule arms only"
            )
        schedule = parts[0]
        if self._installed.get(ctx.collective) != schedule.digest:
            self.comm.install(ctx.collective, schedule)
            self._installed[ctx.collective] = schedule.digest
        return arm

    def record(self, collective: str, nbytes: int, arm: str, latency_s: float | None = None) -> bool:
        """Feeds back the latency of the collective that just ran (default: the executor's launch time).

        Returns whether the selector used it (contexts under the size gate are not learned).
        """
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

        ctx = self._context(collective, nbytes)
        if not self.selector.wants_timing(ctx):
            self.history.append((ctx.key, arm, None))
            return False
        if latency_s is None:
            latency_s = native.last_launch_seconds(self.comm.slot(ctx.collective))
        self.history.append((ctx.key, arm, float(latency_s)))
        return bool(self.selector.observe(ctx, arm, latency_s))
