"""The online tuner across the processes of a job: every process learns the same thing and switches together.

Every process runs an :class:`~jaxccl.tune.online.OnlineTuner` with the same selector configuration
(catalogue, policy, seed: :meth:`Selector.config <jaxccl.tune.Selector.config>`). Two things the tuner
does alone in one process become agreements across processes:

- **switching arms** is a hot-swap at a call every process agrees on
  (:func:`~jaxccl.distributed.transport.stage_agreed`): a process that switched at another call would run
  another schedule than its peers inside the same collective. Before staging, the processes compare the
  schedule they are about to stage; a difference is a :class:`~jaxccl.errors.TuneError`, never a swap.
- **rewards**: a collective ends when its slowest rank does, so a context's latency is the largest of the
  launch times the processes measured for their own ranks (:func:`jaxccl.runtime.native.last_launch_seconds`),
  gathered through the job's key-value store after each step, as the closed loop gathers link rates.
  Each process also publishes the arm it ran; a process that ran another is a :class:`TuneError`.

With the same observations in the same order, UCB1 (and every seeded policy) chooses the same arm in
every process (NCCL-BOT App. F), so nothing else is exchanged. Across processes a communicator has one
registry slot per collective (no size buckets), so a context is a collective: one message size per
collective and communicator.

Example (every process of a ``jax.distributed`` job, on a communicator attached to the transport):
    >>> tuner = ProcessTuner(comm, Selector.for_topology(topo))      # doctest: +SKIP
    >>> for step in range(100):                                      # doctest: +SKIP
    ...     arm = tuner.prepare("all_gather", nbytes)
    ...     out = train_step(...)                                    # calls jaxccl.all_gather inside
    ...     tuner.record("all_gather", nbytes, arm)
"""

from __future__ import annotations

import contextlib
from typing import Any

from jaxccl.distributed import kv
from jaxccl.distributed.transport import check_loop_backend, stage_agreed, swap_key
from jaxccl.errors import TuneError
from jaxccl.tune.arms import Context
from jaxccl.tune.online import OnlineTuner

__all__ = ["TUNE_KEY_PREFIX", "ProcessTuner"]

TUNE_KEY_PREFIX = "jaxccl/tune"


class _AgreedInstalls:
    """The communicator as the tuner sees it: :meth:`install` is a swap agreed by every process."""

    def __init__(self, owner: ProcessTuner):
        self._owner = owner

    def install(self, collective: str, schedule: Any, *, nbytes: int | None = None) -> None:
        self._owner.install(collective, schedule)  # one communicator across processes has no size buckets

    def __getattr__(self, name: str) -> Any:
        return getattr(self._owner.comm, name)


class ProcessTuner:
    """:class:`~jaxccl.tune.online.OnlineTuner` for a communicator whose ranks span processes.

    Args:
        comm: a ``cpu`` or ``cuda`` communicator attached to the job's transport.
        selector: this process's selector, built alike in every process; default: the tuner's own over
            jaxccl's catalogue on ``comm.topology`` (needed for :meth:`follow`).
        key_prefix: where the tuner's agreements live in the key-value store (one tuner per prefix).
        timeout_s: how long a process waits for the others at an agreement.
        tuner_options: the :class:`~jaxccl.tune.online.OnlineTuner` options (``policy``, ``model``, ``seed``...).

    Raises:
        ArgumentError: ``comm`` runs on a backend whose swaps cannot be agreed.
        ExecutorError: ``jax.distributed`` is not initialized.
        TuneError: a bad tuner option.
    """

    def __init__(
        self,
        comm: Any,
        selector: Any = None,
        *,
        key_prefix: str = TUNE_KEY_PREFIX,
        timeout_s: float = 60.0,
        **tuner_options: Any,
    ):
        check_loop_backend(comm, "ProcessTuner")
        self.comm = comm
        self.key_prefix, self.timeout_s = str(key_prefix), float(timeout_s)
        self._client, self.process_id, self.num_processes = kv.job_client("ProcessTuner")
        self.tuner = OnlineTuner(_AgreedInstalls(self), selector, **tuner_options)
        self._agreements = 0
        self._agreed = False  # whether this prepare's agreement happened (in install)
        self._records = 0
        self._spent: list[str] = []  # process 0: keys every process has read, deleted at the next record

    def follow(self, loop: Any) -> ProcessTuner:
        """Subscribes to a :class:`~jaxccl.control.process_loop.ProcessLoop`'s re-syntheses (call it in every
        process): after each agreed swap of a re-synthesized schedule, the next :meth:`prepare` makes it the
        collective's synthesized arm and restarts its contexts from the prior on the topology process 0 planned
        for, the same in every process (:meth:`OnlineTuner.on_resynthesis
        <jaxccl.tune.online.OnlineTuner.on_resynthesis>`). Returns the tuner.

        Raises:
            TuneError: the tuner was given a selector (its arms are not the tuner's to replace).
        """
        self.tuner.follow(loop)  # a ProcessLoop offers the controller's add_resynthesis_hook, in every process
        return self

    @property
    def selector(self) -> Any:
        return self.tuner.selector

    @property
    def history(self) -> list[tuple[str, str, float | None]]:
        """``(context key, arm, latency)`` of every record, the latency the slowest process's."""
        return self.tuner.history

    def prepare(self, collective: str, nbytes: int) -> str:
        """Chooses the arm for ``(collective, nbytes)`` and, if it is not the one running, swaps to it at an
        agreed call; returns the arm's name. Every process calls it at the same point of the step, and every
        call is one agreement: the processes compare the schedule they will run next (the new one, or the
        one running), so a process that would switch alone is refused, not left waiting for the others.

        Raises:
            TuneError: the processes chose different schedules.
            DeadlineError: a process did not reach the agreement within ``timeout_s``.
        """
        self._agreed = False
        arm = self.tuner.prepare(collective, nbytes)
        if not self._agreed:  # the tuner kept the running schedule: so must every other process
            self._agree(collective, self.comm.schedule(collective), stage=False)
        return arm

    def record(self, collective: str, nbytes: int, arm: str) -> bool:
        """Feeds back the slowest process's launch time of the collective that just ran (every process calls it
        once the step's results are ready); returns whether the selector used it.

        Raises:
            TuneError: a process ran another arm.
            DeadlineError: a process did not publish its time within ``timeout_s``.
        """
        ctx = Context(collective, self.comm.axis_size, int(nbytes))
        if not self.selector.wants_timing(ctx):
            return self.tuner.record(collective, nbytes, arm, latency_s=None)
        return self.tuner.record(collective, nbytes, arm, latency_s=self.slowest_launch(collective, arm))

    def slowest_launch(self, collective: str, label: str = "") -> float:
        """The largest of the processes' launch times of ``collective``'s last call, in seconds; every process
        calls it after the same call, with the same ``label`` (what ran: a difference is a :class:`TuneError`).

        Raises:
            TuneError: the processes' labels differ.
            DeadlineError: a process did not publish its time within ``timeout_s``.
        """
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

        own = native.last_launch_seconds(self.comm.slot(collective))
        key = f"{self.key_prefix}/latency/{self._records}"
        self._records += 1
        published = [entry.rsplit(" ", 1) for entry in self._gather(key, f"{label} {own!r}", "its launch time")]
        if len({lab for lab, _ in published}) != 1:
            raise TuneError(
                f"ProcessTuner: the processes ran different {collective} arms: {[lab for lab, _ in published]}"
            )
        self._forget_spent()
        self._spent.append(key)
        return max(float(t) for _, t in published)

    def install(self, collective: str, schedule: Any) -> None:
        """Swaps ``collective`` to ``schedule`` at a call every process agrees on (every process calls it with
        the same schedule). The tuner's own swaps go through here; a caller that swaps behind the tuner's back
        leaves it believing its arm still runs.

        Raises:
            TuneError: the processes staged different schedules.
            DeadlineError: a process did not reach the agreement within ``timeout_s``.
        """
        self._agree(collective, schedule, stage=True)

    def _agree(self, collective: str, schedule: Any, *, stage: bool) -> None:
        """Every process states the schedule it runs from now on; equal, it is staged at an agreed call."""
        self._agreed = True
        round_id = f"{self.key_prefix}/agreement/{self._agreements}"
        self._agreements += 1
        digests = self._gather(f"{round_id}/schedule", f"{stage} {schedule.digest}", "the schedule it runs next")
        if len(set(digests)) != 1:
            raise TuneError(
                f"ProcessTuner: the processes chose different {collective} schedules (swap? digest): {digests}"
            )
        self._spent.append(f"{round_id}/schedule")
        if stage:
            stage_agreed(self.comm, collective, schedule, round_id=round_id, margin=0, timeout_s=self.timeout_s)
            self._spent.append(swap_key(self.comm.slot(collective), round_id))

    def _gather(self, key: str, value: str, what: str) -> list[str]:
        return kv.gather(
            self._client,
            key,
            value,
            process_id=self.process_id,
            num_processes=self.num_processes,
            timeout_s=self.timeout_s,
            what=what,
        )

    def _forget_spent(self) -> None:
        """Process 0, once every process published this record: every key of earlier agreements was read."""
        if self.process_id != 0:
            return
        for key in self._spent:
            with contextlib.suppress(Exception):  # a key left behind costs memory, never tuning
                self._client.key_value_delete(key)
        self._spent.clear()
