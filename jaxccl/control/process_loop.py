"""The closed loop across the processes of a job: one controller, every process's measurements, agreed swaps.

Every process of a multi-process job calls :meth:`ProcessLoop.step` at the end of each training
step (its collectives finished). A step of the loop:

1. **Measure.** Each process drains what it measured since its last step: the transport's
   completion times of its sends to ranks in other processes (:class:`TransportMeter`, MCCL
   Sec. 5's "active while a message is in flight"; the proxy records them on both backends) and,
   where the executor measures (:attr:`jaxccl.Communicator.measuring`: the CUDA kernel's
   per-threadblock accumulators, or CPU link emulation), its meter for pairs inside the process
   (:meth:`jaxccl.Communicator.telemetry`). It publishes its rows of the link matrix
   (:func:`published_rows`) in the job's key-value store.
2. **Gather.** Process 0 reads every process's rows (one deadline) and folds them into one EWMA
   matrix (:class:`~jaxccl.telemetry.TelemetryCollector`): the whole communicator's telemetry.
3. **Decide.** Process 0 runs one step of the :class:`~jaxccl.control.Controller` on it (MCCL's
   Algorithm 1, confirmation, warm re-synthesis, reference-interpreter check) and publishes its
   decision: nothing, or the new schedule (its JSON).
4. **Agree and swap.** Every process reads the decision; with a schedule, every process stages
   that same schedule to become current at one agreed sequence number
   (:func:`~jaxccl.distributed.transport.stage_agreed`, MCCL Sec. 6.2.2 across processes).

Decisions fall on step boundaries, so every process reaches the agreement point at the same
step. A failure anywhere in the loop (a synthesis that raises, a process that does not publish
in time) never reaches the training step: it is logged (logger ``jaxccl.control``), recorded as an
``"error"`` event, and the running schedule keeps running.

Example (in every process, after :func:`~jaxccl.distributed.transport.attach`)::

    loop = ProcessLoop(comm)               # comm: backend "cpu" or "cuda", a topology of the job's links
    for batch in data:
        loss = train_step(params, batch)   # runs jaxccl collectives over comm's axis
        loss.block_until_ready()
        loop.step()                        # measure, gather, decide (process 0), agree, swap
    loop.events                            # detected, confirmed, synthesized, staged, activated

A step may stage several schedules (the controller manages every collective it was given): process 0
publishes them as the step's decisions 0, 1, ..., each agreed in turn, and ends the list with an empty
decision, so every process takes part in the same swaps in the same order.

>>> decision_key("jaxccl/loop/1", 7), decision_key("jaxccl/loop/1", 7, 1)
('jaxccl/loop/1/7/decision/0', 'jaxccl/loop/1/7/decision/1')
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxccl.control.controller import Controller, Event, managed_collectives
from jaxccl.distributed import kv
from jaxccl.distributed.transport import (
    DEFAULT_SWAP_MARGIN,
    MIN_MEASURED_BYTES,
    TransportMeter,
    check_loop_backend,
    plausible_ceiling,
    stage_agreed,
    swap_key,
)
from jaxccl.errors import ArgumentError
from jaxccl.runtime import process_layouts
from jaxccl.schedule import Schedule
from jaxccl.telemetry import RECORD_DTYPE, TelemetryCollector
from jaxccl.telemetry.records import INTER, INTRA
from jaxccl.topology import Topology

__all__ = ["LOOP_KEY_PREFIX", "ProcessLoop", "decision_key", "published_rows", "rates_key", "topology_key"]

log = logging.getLogger("jaxccl.control")

LOOP_KEY_PREFIX = "jaxccl/loop"
DEFAULT_LOOP_TIMEOUT_S = 30.0


def rates_key(prefix: str, step: int, process: int) -> str:
    """Where ``process`` publishes its measured rows of step ``step``."""
    return f"{prefix}/{step}/rates/{process}"


def round_key(prefix: str, step: int) -> str:
    """The key directory of step ``step``'s rates and decision."""
    return f"{prefix}/{step}"


def decision_key(prefix: str, step: int, index: int = 0) -> str:
    """Where process 0 publishes decision ``index`` of step ``step`` (an empty decision ends the step's list)."""
    return f"{prefix}/{step}/decision/{index}"


def topology_key(prefix: str, step: int, index: int = 0) -> str:
    """Where process 0 publishes the topology re-synthesis ``index`` of step ``step`` planned for (for the hooks)."""
    return f"{prefix}/{step}/topology/{index}"


def records_of(matrix: np.ndarray) -> bytes:
    """The measured entries of ``matrix`` as measurement records, one window each (what the collector folds).

    >>> m = np.full((2, 2), np.nan); m[0, 1] = 5.0
    >>> np.frombuffer(records_of(m), RECORD_DTYPE)[["src", "dst", "sum_bw"]].tolist()
    [(0, 1, 5.0)]
    """
    src, dst = np.nonzero(np.isfinite(matrix))
    recs = np.zeros(src.size, RECORD_DTYPE)
    recs["flag"], recs["src"], recs["count"] = 1, src, 1
    recs["dst"] = np.where(src == dst, -1, dst)
    recs["kind"] = np.where(src == dst, INTRA, INTER)
    recs["sum_bw"] = matrix[src, dst]
    return recs.tobytes()


def published_rows(
    transport: np.ndarray,
    executor: np.ndarray | None,
    *,
    process_of_rank: Sequence[int],
    host_of_rank: Sequence[int],
    process: int,
) -> list[list[float]]:
    """The entries of the link matrix that ``process`` publishes: ``[src, dst, bytes/s]``, ``src`` its own rank.

    Each entry has one source: a pair whose receiver runs in another process, the transport's
    completion times (``transport``, :meth:`TransportMeter.rates`); a pair inside the process and a
    rank's intra-host injection (the diagonal), the executor's meter (``executor``: the latest samples
    of :meth:`jaxccl.Communicator.telemetry`; ``None`` where it does not measure). Pairs of two ranks
    of one host are no entries of the matrix; NaN is "not measured".

    >>> nan = np.nan
    >>> transport = np.array([[nan, nan, 5.0], [nan, nan, nan], [nan, nan, nan]])
    >>> executor = np.array([[1.0, 2.0, 9.0], [nan, 3.0, nan], [4.0, nan, 6.0]])
    >>> published_rows(transport, executor, process_of_rank=[0, 0, 1], host_of_rank=[0, 1, 2], process=0)
    [[0, 0, 1.0], [0, 1, 2.0], [0, 2, 5.0], [1, 1, 3.0]]
    """
    proc, host = np.asarray(process_of_rank), np.asarray(host_of_rank)
    n = len(proc)
    inside = proc[:, None] == proc[None, :]
    m = np.where(inside, np.nan if executor is None else executor, transport)
    keep = (proc == process)[:, None] & np.isfinite(m)
    keep &= (host[:, None] != host[None, :]) | np.eye(n, dtype=bool)
    src, dst = np.nonzero(keep)
    return [[int(i), int(j), float(m[i, j])] for i, j in zip(src, dst)]


class _GatheredView:
    """What the controller of process 0 sees as its communicator: the gathered telemetry, agreed staging."""

    def __init__(self, loop: ProcessLoop):
        self._loop = loop
        comm = loop.comm
        self.topology, self.backend = comm.topology, comm.backend

    def telemetry(self) -> Any:
        return self._loop._snapshot

    def schedule(self, collective: str) -> Any:
        return self._loop.comm.schedule(collective)

    def swap_state(self, collective: str) -> dict[str, int]:
        return self._loop.comm.swap_state(collective)

    def stage_validated(self, collective: str, schedule: Any, *, table: Any = None, defer_psum: bool = False) -> int:
        return self._loop._publish_and_stage(collective, schedule)

    def fuse_psum(self) -> bool:
        return False  # across processes psum does not fuse the halves (gloo's ring)


@dataclasses.dataclass
class _StepTimes:
    """Host time of the loop's phases in the last step, milliseconds."""

    measure_ms: float = 0.0
    gather_ms: float = 0.0
    decide_ms: float = 0.0
    agree_ms: float = 0.0


class ProcessLoop:
    """The closed loop of one communicator across the processes of a job; call :meth:`step` in every process.

    Args:
        comm: the communicator (a native backend, ``cpu`` or ``cuda``, over a mesh axis attached
            across processes with :func:`~jaxccl.distributed.transport.attach`, and a ``topology``
            describing the job's links). Build it the same way in every process. Where the executor
            measures inside the process (:attr:`jaxccl.Communicator.measuring`: ``cuda`` with a
            topology, or link emulation), its meter gives the pairs inside the process; the
            transport's completion times give those across processes (:attr:`sources`).
        collectives: what the controller manages (see :class:`~jaxccl.control.Controller`).
        every: run the loop on every ``every``-th call of :meth:`step` only (the first included).
        timeout_s: deadline of every wait on another process (gathering, the decision, agreement).
        alpha: EWMA smoothing factor of the gathered matrix.
        margin: calls a process may issue past the others before a swap takes effect
            (:func:`~jaxccl.distributed.transport.stage_agreed`); 0 is safe when every process
            calls :meth:`step` only after its collectives finished.
        key_prefix: where in the key-value store the loop keeps its messages (one per loop of a job).
        min_measured_bytes: the transport's sends smaller than this are not measured (:class:`TransportMeter`'s
            ``min_bytes``): raise it above what a job's smaller collectives send, whose messages finish in the
            sockets' buffers and report rates far above the link's, hiding a degradation in the pair's mean.
        max_over_capacity: or leave out every window faster than this many times what ``comm.topology`` says
            its pair's path carries (:func:`~jaxccl.distributed.transport.plausible_ceiling`; e.g. 4). Off by
            default: a topology that understates its links by more than that would lose real measurements.
        **controller_options: passed to the :class:`~jaxccl.control.Controller` of process 0
            (``gamma``, ``confirm``, ``tolerance``, ``synthesizers``, ...).

    Attributes:
        sources: where this process's measurements come from: ``"transport"`` (always) and
            ``"executor"`` where the executor measures inside the process.
        published: the rows this process published at its last step (:func:`published_rows`).
        measurement: the executor's counters as of the last step
            (:meth:`jaxccl.Communicator.measurement`; ``None`` without an executor source). Records
            it dropped are logged as a warning.

    Raises:
        ArgumentError: the communicator runs on another backend than ``cpu`` or ``cuda``
            (:func:`~jaxccl.distributed.transport.check_loop_backend` says why), has no topology, or
            ``every`` is not a positive integer.
        ExecutorError: ``jax.distributed`` is not initialized.
    """

    def __init__(
        self,
        comm: Any,
        *,
        collectives: Sequence[str] = ("all_gather",),
        every: int = 1,
        timeout_s: float = DEFAULT_LOOP_TIMEOUT_S,
        alpha: float = 0.5,
        margin: int = DEFAULT_SWAP_MARGIN,
        key_prefix: str = LOOP_KEY_PREFIX,
        min_measured_bytes: int = MIN_MEASURED_BYTES,
        max_over_capacity: float | None = None,
        **controller_options: Any,
    ):
        check_loop_backend(comm, "ProcessLoop")
        self._client, process_id, num_processes = kv.job_client("ProcessLoop")
        if comm.topology is None:
            raise ArgumentError(
                "ProcessLoop: the communicator has no topology (the links the controller reasons about)"
            )
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ArgumentError(f"ProcessLoop: every must be a positive integer, got {every!r}")
        if not isinstance(min_measured_bytes, int) or isinstance(min_measured_bytes, bool) or min_measured_bytes < 0:
            raise ArgumentError(f"ProcessLoop: min_measured_bytes must be an integer >= 0, got {min_measured_bytes!r}")
        if max_over_capacity is not None and not (
            isinstance(max_over_capacity, (int, float))
            and not isinstance(max_over_capacity, bool)
            and max_over_capacity >= 1
        ):
            raise ArgumentError(
                f"ProcessLoop: max_over_capacity must be a number >= 1 or None, got {max_over_capacity!r}"
            )
        self.comm = comm
        self.process_id, self.num_processes = int(process_id), int(num_processes)
        self.every, self.timeout_s, self.margin = every, float(timeout_s), int(margin)
        self.key_prefix = key_prefix
        n = comm.axis_size
        devices = np.asarray(comm.group_devices()).reshape(-1, n)[0]
        self._process_of_rank = [int(d.process_index) for d in devices]
        self._host = [comm.topology.host_of(r) for r in range(n)]
        self.sources = ("executor", "transport") if comm.measuring else ("transport",)
        self.measurement = None
        self.published: list[list[float]] = []
        attached = process_layouts.find(comm.mesh, comm.axis_name) if comm.mesh is not None else None
        layout = attached.number if attached is not None else 0
        ceiling = None if max_over_capacity is None else plausible_ceiling(comm.topology, n, max_over_capacity)
        self.meter = TransportMeter(n, layout=layout, min_bytes=min_measured_bytes, ceiling=ceiling)
        self.meter.drain()  # what was sent before the loop began is not its to judge
        self._collector = TelemetryCollector(n, alpha=alpha)
        self._snapshot = self._collector.snapshot()
        self._executor_samples = None
        if comm.measuring:  # likewise what the executor measured before
            self._executor_samples = comm.telemetry().samples
            comm.measurement()
        self._calls = 0
        self._round = 0
        self._decisions = 0  # process 0: decisions published in the current step
        self._collectives = managed_collectives(collectives)
        self._spent: list[str] = []  # process 0: key directories of earlier rounds, deleted once all read them
        self._events: list[Event] = []
        self.times = _StepTimes()
        self.controller = (
            Controller(_GatheredView(self), collectives=collectives, **controller_options)
            if self.process_id == 0
            else None
        )
        self._hooks: list[Callable[[str, Schedule, Topology], None]] = []
        if self.controller is not None:
            self.controller.add_resynthesis_hook(self._announce)

    def add_resynthesis_hook(self, hook: Callable[[str, Schedule, Topology], None]) -> None:
        """Calls ``hook(collective, schedule, topology)`` in every process once it took part in the agreed swap
        of a re-synthesized schedule, with the topology process 0's controller planned it for (the measured,
        degraded one: the same data in every process, so that what every process derives from it agrees, as
        :meth:`jaxccl.tune.process_tuner.ProcessTuner.follow` needs). Register it in every process. An
        exception in it is an ``error`` event.

        Raises:
            ArgumentError: ``hook`` is not callable.
        """
        if not callable(hook):
            raise ArgumentError(f"ProcessLoop.add_resynthesis_hook: expected a callable, got {hook!r}")
        self._hooks.append(hook)

    def _announce(self, collective: str, schedule: Schedule, topology: Topology) -> None:
        """Process 0, after the controller's agreed swap: publishes the planned topology and runs the hooks."""
        text = topology.to_json()
        self._client.key_value_set(topology_key(self.key_prefix, self._decision_step, self._decisions - 1), text)
        self._run_hooks(collective, schedule, Topology.from_json(text))

    def _run_hooks(self, collective: str, schedule: Schedule, topology: Topology) -> None:
        for hook in self._hooks:
            try:
                hook(collective, schedule, topology)
            except Exception as e:  # noqa: BLE001 - a listener must never break the loop
                self._record_error("resynthesis hook", e)

    # ------------------------------------------------------------------ events
    @property
    def events(self) -> list[Event]:
        """Everything the loop did in this process, in order (process 0: the controller's events too)."""
        mine = list(self._events)
        if self.controller is not None:
            mine += self.controller.events
        return sorted(mine, key=lambda e: e.time_ns)

    @property
    def errors(self) -> list[Event]:
        """The ``"error"`` events: failures the loop recorded instead of raising."""
        return [e for e in self.events if e.kind == "error"]

    def telemetry(self) -> Any:
        """The gathered EWMA link matrix as of the last step (process 0; other processes: never gathered)."""
        return self._snapshot

    def _emit(self, kind: str, collective: str | None, **detail: Any) -> Event:
        ev = Event(kind, time.monotonic_ns(), collective, detail)
        self._events.append(ev)
        log.info("%s %s %s", kind, collective or "", detail)
        return ev

    def _record_error(self, where: str, exc: BaseException) -> None:
        log.error("jaxccl loop (process %d) %s failed: %s: %s", self.process_id, where, type(exc).__name__, exc)
        self._emit("error", None, where=where, error=f"{type(exc).__name__}: {exc}", process=self.process_id)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Event]:
        """One step of the loop in this process; returns the events it produced. Never raises.

        Call it in every process at the same point of every training step, after the step's
        collectives finished (e.g. after ``loss.block_until_ready()``).
        """
        self._calls += 1
        before = len(self.events)
        if (self._calls - 1) % self.every == 0:
            self._round += 1
            try:
                self._step(self._round)
            except Exception as e:  # noqa: BLE001 - the loop must never break training
                self._record_error("step", e)
        return self.events[before:]

    def _step(self, k: int) -> None:
        t0 = time.perf_counter()
        rows = self.published = self._measure()
        t1 = time.perf_counter()
        self.times.measure_ms = (t1 - t0) * 1e3
        if self.controller is None:
            self._client.key_value_set(rates_key(self.key_prefix, k, self.process_id), json.dumps(rows))
            self._follow(k)
            return
        try:
            self._gather(k, rows)
        except Exception as e:  # noqa: BLE001 - no decision this step; every process keeps its schedule
            self._record_error("gather", e)
            self._client.key_value_set(decision_key(self.key_prefix, k), json.dumps({"error": str(e)}))
            self._spent.append(round_key(self.key_prefix, k))
            return
        self._forget_spent_rounds()
        self._spent.append(round_key(self.key_prefix, k))
        t2 = time.perf_counter()
        self.times.gather_ms = (t2 - t1) * 1e3
        self._decisions = 0
        self._decision_step = k
        self.controller.step()  # stages through _publish_and_stage when it re-synthesizes; never raises
        self._client.key_value_set(decision_key(self.key_prefix, k, self._decisions), json.dumps({}))
        self.times.decide_ms = (time.perf_counter() - t2) * 1e3

    def _measure(self) -> list[list[float]]:
        """This process's measured entries since its last step: ``[src, dst, bytes/s]`` each."""
        return published_rows(
            self.meter.rates(),
            self._executor(),
            process_of_rank=self._process_of_rank,
            host_of_rank=self._host,
            process=self.process_id,
        )

    def _executor(self) -> np.ndarray | None:
        """The executor meter's latest samples, new since the last step (else NaN); None where it does not measure."""
        if "executor" not in self.sources:
            return None
        tel = self.comm.telemetry()
        self.measurement = self.comm.measurement()
        if self.measurement.dropped:
            log.warning(
                "jaxccl loop (process %d): the executor dropped %d measurement records since the last step (its "
                "buffer was full); drain more often or raise slots_per_tb",
                self.process_id,
                self.measurement.dropped,
            )
        fresh = tel.samples != (self._executor_samples if self._executor_samples is not None else 0)
        self._executor_samples = tel.samples
        return np.where(fresh, tel.last, np.nan)

    def _gather(self, k: int, own: list[list[float]]) -> None:
        n = self.comm.axis_size
        matrix = np.full((n, n), np.nan)
        rows = {0: own}
        for p in range(1, self.num_processes):
            rows[p] = json.loads(self._get(rates_key(self.key_prefix, k, p), f"process {p}'s measurements"))
        for entries in rows.values():
            for i, j, rate in entries:
                matrix[int(i), int(j)] = float(rate)
        self._collector.fold(records_of(matrix))
        self._snapshot = self._collector.snapshot()

    def _forget_spent_rounds(self) -> None:
        """Process 0, once every process published this round's rates: deletes the earlier rounds' keys.

        A process publishes round k's rates only after it read round k - 1's decision and took part in
        its swap, so nobody reads those keys any more; without this the coordinator's key-value store
        would grow by a round's keys at every step of a long run.
        """
        for key in self._spent:
            try:
                self._client.key_value_delete(key)
            except Exception as e:  # noqa: BLE001 - a key left behind costs memory, never training
                self._record_error("forget", e)
        self._spent.clear()

    def _get(self, key: str, what: str) -> str:
        return kv.get(self._client, key, self.timeout_s, f"{what} did not arrive")

    # ------------------------------------------------------------------ decisions and agreement
    def _publish_and_stage(self, collective: str, schedule: Any) -> int:
        """Process 0: publishes the new schedule as this step's decision and stages it with every process."""
        k = self._decision_step
        t0 = time.perf_counter()
        self._client.key_value_set(
            decision_key(self.key_prefix, k, self._decisions),
            json.dumps({"collective": collective, "schedule": schedule.to_json()}),
        )
        self._decisions += 1
        t1 = time.perf_counter()
        version = self._agree(k, collective, schedule)
        self._emit(
            "agreed",
            collective,
            version=version,
            publish_ms=(t1 - t0) * 1e3,
            agree_ms=self.times.agree_ms,
            processes=self.num_processes,
        )
        return version

    def _agree(self, k: int, collective: str, schedule: Any) -> int:
        t0 = time.perf_counter()
        version, transition = stage_agreed(
            self.comm,
            collective,
            schedule,
            round_id=f"{self.key_prefix}/{k}",
            margin=self.margin,
            timeout_s=self.timeout_s,
        )
        self.times.agree_ms = (time.perf_counter() - t0) * 1e3
        self._last_transition = transition
        if self.process_id == 0:
            self._spent.append(swap_key(self.comm.slot(collective), f"{self.key_prefix}/{k}"))
        return version

    def _follow(self, k: int) -> None:
        """A process other than 0: waits for this step's decisions and takes part in their swaps, in order."""
        t0 = time.perf_counter()
        for index in range(len(self._collectives) + 1):
            decision = json.loads(self._get(decision_key(self.key_prefix, k, index), "process 0's decision"))
            if index == 0:
                self.times.decide_ms = (time.perf_counter() - t0) * 1e3
            if "error" in decision:
                self._emit("skipped", None, reason=decision["error"])
                return
            if "schedule" not in decision:
                return
            collective = decision["collective"]
            schedule = Schedule.from_json(decision["schedule"])
            version = self._agree(k, collective, schedule)
            self._emit("agreed", collective, version=version, agree_ms=self.times.agree_ms)
            if self._hooks:
                planned = self._get(topology_key(self.key_prefix, k, index), "the topology of process 0's re-synthesis")
                self._run_hooks(collective, schedule, Topology.from_json(planned))
