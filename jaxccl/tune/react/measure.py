"""Measuring a pattern: per-flow completion times from a *runner* (the simulator here).

REACT's loop (Sec. 5.4) needs, after every epoch, the completion time of every
flow of the pattern. A *runner* is any callable ``runner(schedule, topology)
-> Measurement`` that runs a :class:`~jaxccl.schedule.Schedule` once on a
(possibly congested) topology and reports the collective's time and, for every
sending op ``(rank, threadblock, op)``, when its message started and when its
last byte arrived. :func:`flow_times` maps those back to the pattern's flows
(through :class:`~jaxccl.tune.react.compile.CompiledPattern`). The emulated
CPU executor is such a runner too (:class:`jaxccl.tune.react.executor.ExecutorRunner`).

:class:`SimulatorRunner` is the runner on :mod:`jaxccl.sim`: the collective's
ranks sit on GPUs ``0..N-1`` of the topology and, as in REACT Sec. 7.1, the
congestion is *external flows*: :class:`ExternalFlows` sends ``count``
long-lived flows from a GPU outside the collective into a GPU of it, as a
second job sharing the links (max-min fair, like the collective's own flows).

Example:
    >>> from jaxccl.topology import fat_tree
    >>> from jaxccl.tune.react.compile import compile_pattern
    >>> from jaxccl.tune.react.pattern import double_binary_tree_pattern
    >>> topo = fat_tree(1, 10)                      # a star: 8 ranks + 2 outside GPUs
    >>> c = compile_pattern(double_binary_tree_pattern(8))
    >>> healthy = SimulatorRunner(16 << 20)(c.schedule, topo)
    >>> congested = SimulatorRunner(16 << 20, external=[ExternalFlows(8, 3, 2)])(c.schedule, topo)
    >>> congested.time_s > 1.2 * healthy.time_s
    True
    >>> fct = flow_times(c, congested)
    >>> bool(fct[c.pattern.dst_device == 3].mean() > 1.5 * fct[c.pattern.dst_device != 3].mean())
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxccl.errors import TopologyError, TuneError
from jaxccl.schedule.builder import ScheduleBuilder
from jaxccl.schedule.ir import Buffer, Schedule
from jaxccl.sim.engine import simulate
from jaxccl.sim.model import DEFAULT_PIPELINE_BYTES, DEFAULT_SLOTS, Job, compile_jobs
from jaxccl.sim.routes import Router
from jaxccl.tune.react.compile import CompiledPattern, compile_pattern

__all__ = [
    "ExternalFlows",
    "degraded_topology",
    "Measurement",
    "Runner",
    "SimulatorRunner",
    "external_flows_schedule",
    "flow_times",
    "pattern_measurer",
]

OpKey = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One run of a schedule.

    Attributes:
        time_s: the collective's completion time (seconds).
        output_bytes: bytes of one rank's output buffer (``algbw = output_bytes / time_s``).
        op_times: per sending op ``(rank, threadblock, op)``: ``(start, last byte arrived)``
            of its message, seconds from the collective's start.
        wall_s: real seconds the run took, where the runner knows it (the executor: the whole call,
            JAX dispatch included; NaN for the simulator).
    """

    time_s: float
    output_bytes: float
    op_times: Mapping[OpKey, tuple[float, float]]
    wall_s: float = float("nan")

    @property
    def algbw(self) -> float:
        return self.output_bytes / self.time_s if self.time_s > 0 else float("inf")


Runner = Callable[[Schedule, Any], Measurement]


def flow_times(compiled: CompiledPattern, measurement: Measurement) -> np.ndarray:
    """Completion time of every flow of ``compiled.pattern`` (NaN for flows that sent nothing).

    A flow's time runs from the start of its first message to the arrival of
    the last byte of its last (an AllGather flow may be several messages).

    Raises:
        ValueError: the measurement lacks a sending op of the compiled schedule.
    """
    out = np.full(compiled.pattern.num_flows, np.nan)
    for f, keys in enumerate(compiled.flow_ops):
        if not keys:
            continue
        try:
            spans = [measurement.op_times[k] for k in keys]
        except KeyError as e:
            raise TuneError(f"measurement has no time for sending op {e.args[0]} of flow {f}") from None
        out[f] = max(b for _, b in spans) - min(a for a, _ in spans)
    return out


def pattern_measurer(runner: Runner, topology: Any) -> Callable[[Any], tuple[float, np.ndarray]]:
    """Turns a :data:`Runner` into what :func:`jaxccl.tune.react.algorithm.run_react` calls once per epoch.

    The returned function compiles a pattern (cached), runs its schedule with
    ``runner(schedule, topology)`` and returns ``(time_s, completion time of every flow)``.
    """
    compiled: dict[Any, CompiledPattern] = {}

    def measure(pattern: Any) -> tuple[float, np.ndarray]:
        c = compiled.get(pattern)
        if c is None:
            c = compiled[pattern] = compile_pattern(pattern)
        m = runner(c.schedule, topology)
        return m.time_s, flow_times(c, m)

    return measure


def degraded_topology(topology: Any, targets: Sequence[int], p: int) -> Any:
    """Node congestion as reduced capacity: every link into each target GPU keeps ``1 / (1 + p)`` of its capacity.

    For runners that can change capacities but not add traffic (the emulated
    executor, through ``comm.inject``): a single collective flow into a target
    then gets the share it would get next to ``p`` long-lived external flows
    (REACT's congestion degree). Unlike max-min fair external flows, several
    collective flows arriving at once share the reduced capacity among
    themselves (``1 / (k (1 + p))`` each instead of ``1 / (k + p)``).

    Raises:
        TopologyError: a target that is not a GPU of ``topology`` or has no incoming link.
        ValueError: ``p`` is not a non-negative integer.

    Example:
        >>> from jaxccl.topology import fat_tree
        >>> star = fat_tree(1, 4)
        >>> degraded_topology(star, [2], 3).capacity("leaf:0", 2) / star.capacity("leaf:0", 2)
        0.25
    """
    if not isinstance(p, int) or isinstance(p, bool) or p < 0:
        raise TuneError(f"degraded_topology: p must be a non-negative integer, got {p!r}")
    out = topology
    for t in targets:
        if t not in topology.gpus:
            raise TopologyError(f"degraded_topology: {t!r} is not a GPU of {topology.name!r}")
        edges = [(u, v) for u, v, _, _ in topology.edges() if v == t]
        if not edges:
            raise TopologyError(f"degraded_topology: GPU {t} has no incoming link")
        for e in edges:
            out = out.degrade(*e, capacity=topology.capacity(*e) / (1 + p), both=False)
    return out


@dataclasses.dataclass(frozen=True)
class ExternalFlows:
    """``count`` concurrent long-lived flows from GPU ``source`` (outside the collective) to GPU ``target``.

    ``target`` is a GPU of the collective (congestion on its links, REACT
    Sec. 7.1) or another outside GPU (congestion on the links in between, e.g.
    a spine). REACT's congestion degree ``p`` is ``count`` (external flows per
    affected source-destination pair).
    """

    source: int
    target: int
    count: int = 1


def external_flows_schedule(count: int) -> Schedule:
    """A 2-rank background job: rank 0 sends ``count`` messages to rank 1, one channel each (all concurrent).

    It is traffic for the simulator, not a collective (it is never validated).
    """
    if not isinstance(count, int) or count < 1:
        raise TuneError(f"external flows: count must be a positive integer, got {count!r}")
    b = ScheduleBuilder("all_to_all", 2, count)
    for k in range(count):
        b.transfer(0, 1, (Buffer.INPUT, k), (Buffer.OUTPUT, k), channel=k)
    return b.build(name=f"external_flows_x{count}")


class SimulatorRunner:
    """A :data:`Runner` on the flow-level simulator, with optional external flows.

    Args:
        bytes_per_rank: input bytes of one rank (AllReduce: the vector; AllGather: the shard).
        external: background flows (:class:`ExternalFlows`); they start with the
            collective and carry ``external_factor`` times ``bytes_per_rank`` each,
            so they outlast it.
        gpus: the topology GPU of each schedule rank (default ``0..N-1``).
        pipeline_bytes, num_slots, routing: as for :func:`jaxccl.sim.run_jobs`.
        cache: remember results per (schedule digest, topology): the simulator is
            deterministic, so the ``B`` epochs of a batch cost one run.

    Example:
        >>> from jaxccl.topology import fat_tree
        >>> from jaxccl.tune.react.pattern import ring_allreduce_pattern
        >>> m = SimulatorRunner(8 << 20)(ring_allreduce_pattern(4).to_schedule(), fat_tree(1, 4))
        >>> round(m.algbw / 1e9, 1)  # 50 GB/s links, ring AllReduce: N / (2 (N - 1)) x 50 GB/s
        33.2
    """

    def __init__(
        self,
        bytes_per_rank: float,
        *,
        external: Sequence[ExternalFlows] = (),
        external_factor: float = 1000.0,
        gpus: Sequence[int] | None = None,
        pipeline_bytes: float | None = DEFAULT_PIPELINE_BYTES,
        num_slots: int | None = DEFAULT_SLOTS,
        routing: str = "primary",
        cache: bool = True,
    ):
        if not bytes_per_rank > 0:
            raise TuneError(f"bytes_per_rank must be positive, got {bytes_per_rank!r}")
        self.bytes_per_rank = float(bytes_per_rank)
        self.external = tuple(external)
        self.external_factor = float(external_factor)
        self.gpus = None if gpus is None else tuple(int(g) for g in gpus)
        self.pipeline_bytes = pipeline_bytes
        self.num_slots = num_slots
        self.routing = routing
        self._cache: dict[tuple[str, str], Measurement] | None = {} if cache else None
        self.runs = 0

    def _jobs(self, schedule: Schedule, topology: Any) -> list[Job]:
        gpus = self.gpus if self.gpus is not None else tuple(range(schedule.num_ranks))
        jobs = [Job(schedule, self.bytes_per_rank, gpus, 0.0, schedule.name)]
        inside = set(gpus)
        for e in self.external:
            if e.source in inside:
                raise TopologyError(f"external flow source GPU {e.source} runs a rank of the collective")
            if e.target == e.source:
                raise TopologyError(f"external flow from GPU {e.source} to itself")
            nbytes = 2 * e.count * self.bytes_per_rank * self.external_factor  # each message: factor x bytes_per_rank
            jobs.append(Job(external_flows_schedule(e.count), nbytes, (e.source, e.target), 0.0, "external"))
        return jobs

    def __call__(self, schedule: Schedule, topology: Any) -> Measurement:
        key = (schedule.digest, topology.fingerprint)
        if self._cache is not None and key in self._cache:
            return self._cache[key]
        jobs = self._jobs(schedule, topology)
        prog = compile_jobs(
            jobs,
            Router(topology, self.routing),
            pipeline_bytes=self.pipeline_bytes,
            num_slots=self.num_slots,
            sharing="messages",  # fixed pieces of pipeline_bytes, equal shares per message
        )
        tnode, _ = simulate(prog)
        self.runs += 1
        n_ops, n_msgs = prog.num_ops, prog.num_msgs
        mine = np.flatnonzero(prog.op_job[prog.msg_sender] == 0)
        start = tnode[2 * n_ops + 0 * n_msgs + mine]  # LAUNCH
        arrive = tnode[2 * n_ops + 2 * n_msgs + mine]  # ARR
        ops = prog.msg_sender[mine]
        op_times = {
            (int(prog.op_rank[o]), int(prog.op_tb[o]), int(prog.op_pos[o])): (float(a), float(b))
            for o, a, b in zip(ops.tolist(), start.tolist(), arrive.tolist())
        }
        sel = prog.op_job == 0
        t = float(tnode[n_ops : 2 * n_ops][sel].max()) if sel.any() else 0.0
        m = Measurement(t, float(prog.job_out_bytes[0]), op_times)
        if self._cache is not None:
            self._cache[key] = m
        return m
