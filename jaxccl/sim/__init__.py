"""A flow-level network simulator that runs any :class:`~jaxccl.schedule.Schedule` on any Topology.

Messages of a schedule become flows over the topology's routes; concurrent
flows share link capacity max-min fairly (progressive filling, recomputed
whenever a flow starts or ends); every route adds its latency; threadblocks run
their ops by readiness (an op whose data is ready never waits behind an unrelated
op of its threadblock), a rank forwards only data it has received, and forwarded
chunks are pipelined in pieces (see :mod:`jaxccl.sim.model` for the exact
model and :mod:`jaxccl.sim.engine` for the event loop).

Example:
    >>> import jaxccl.sim
    >>> from jaxccl.topology import rail
    >>> from jaxccl.synth.baselines import ring_allgather
    >>> topo = rail(hosts=2)
    >>> res = jaxccl.sim.run(topo, ring_allgather(topo), bytes_per_rank=16 << 20)
    >>> round(res.algbw / 1e9, 1)   # GB/s: one NIC (50 GB/s) paces the ring, x N/(N-1)
    53.3
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxccl.schedule.ir import Schedule
from jaxccl.sim.engine import EngineStats, simulate
from jaxccl.sim.fairness import max_min_rates
from jaxccl.sim.model import (
    DEFAULT_PIPELINE_BYTES,
    DEFAULT_SLOTS,
    EXECUTIONS,
    MAX_TILES,
    SHARINGS,
    Job,
    Program,
    auto_iterations,
    compile_jobs,
    tiles_of,
)
from jaxccl.sim.routes import ROUTING_METHODS, Router
from jaxccl.topology import Topology

__all__ = [
    "DEFAULT_PIPELINE_BYTES",
    "DEFAULT_SLOTS",
    "EXECUTIONS",
    "SHARINGS",
    "ROUTING_METHODS",
    "EngineStats",
    "Job",
    "JobResult",
    "Router",
    "SimResult",
    "auto_iterations",
    "tiles_of",
    "max_min_rates",
    "run",
    "run_jobs",
]


@dataclasses.dataclass
class JobResult:
    """Outcome of one job of :func:`run_jobs`.

    Attributes:
        name: the job's label.
        time_s: from the job's start to its last op's completion.
        algbw: one rank's output bytes / ``time_s`` (bytes/s; the nccl-tests
            convention: for AllGather ``N x`` the input shard).
        output_bytes: bytes of one rank's output buffer.
        rank_finish_s: completion time of each schedule rank (from the job start).
    """

    name: str
    time_s: float
    algbw: float
    output_bytes: float
    rank_finish_s: np.ndarray
    iterations: int = 1


@dataclasses.dataclass
class SimResult:
    """Outcome of :func:`run` / :func:`run_jobs`.

    Attributes:
        time_s: makespan (all jobs; for :func:`run`, the collective's time).
        algbw: for one job, its algbw; for several, the first job's.
        jobs: per-job results.
        link_bytes: bytes carried by every link ``(u, v)`` that carried any.
        link_utilization: ``link_bytes / (capacity x time_s)`` per link.
        num_flows: messages simulated.
        wall_s: simulator wall time (compile + run), seconds.
        compile_s: of which building the event DAG.
        stats: engine counters (event batches, rate updates, ...).
    """

    time_s: float
    algbw: float
    jobs: list[JobResult]
    link_bytes: dict[tuple[Any, Any], float]
    link_utilization: dict[tuple[Any, Any], float]
    num_flows: int
    wall_s: float
    compile_s: float
    stats: EngineStats

    @property
    def max_link_utilization(self) -> float:
        return max(self.link_utilization.values(), default=0.0)

    def summary(self) -> dict[str, Any]:
        """JSON-friendly digest (no per-link data)."""
        return {
            "time_s": self.time_s,
            "algbw": self.algbw,
            "num_flows": self.num_flows,
            "wall_s": self.wall_s,
            "compile_s": self.compile_s,
            "max_link_utilization": self.max_link_utilization,
            "jobs": [
                {"name": j.name, "time_s": j.time_s, "algbw": j.algbw, "iterations": j.iterations} for j in self.jobs
            ],
            **{k: v for k, v in self.stats.items() if k != "wall_s"},
        }


_ROUTERS: dict[tuple[int, str], tuple[Topology, Router]] = {}


def _router(topo: Topology, routing: str) -> Router:
    key = (id(topo), routing)
    hit = _ROUTERS.get(key)
    if hit is not None and hit[0] is topo:
        return hit[1]
    r = Router(topo, routing)
    if len(_ROUTERS) >= 32:
        _ROUTERS.pop(next(iter(_ROUTERS)))
    _ROUTERS[key] = (topo, r)
    return r


def run_jobs(
    topo: Topology,
    jobs: Sequence[Job],
    *,
    pipeline_bytes: float | None = DEFAULT_PIPELINE_BYTES,
    num_slots: int | None = DEFAULT_SLOTS,
    routing: str = "primary",
    execution: str = "dataflow",
    sharing: str = "tiles",
    max_tiles: int = MAX_TILES,
    progress: Callable[[float], None] | None = None,
    max_wall_s: float | None = None,
) -> SimResult:
    """Simulates several collectives at once on one topology (they share its links).

    Args:
        topo: the cluster.
        jobs: what to run, where (``Job.ranks``) and when (``Job.start``).
        pipeline_bytes: pipeline piece size for forwarded data (``None``:
            store-and-forward); see :mod:`jaxccl.sim.model`.
        num_slots: unconsumed messages a connection can hold (``None``: any).
        routing: ``"primary"`` (the topology's primary route, computed fast),
            ``"topology"`` (ask ``topo.paths``) or ``"ecmp"`` (one of the
            equal-cost routes per connection, by a stable hash).
        execution: ``"dataflow"`` (an op waits only for its dependencies,
            the earlier ops of its threadblock that its data needs, its data
            and its slot: jaxccl's executors) or ``"in_order"`` (MSCCL's
            runtime: also the previous op of its threadblock); see
            :mod:`jaxccl.sim.model`.
        sharing: ``"tiles"`` (links are shared max-min fairly, each flow
            weighted by its tile bytes: the executors' tile-by-tile service)
            or ``"messages"`` (every flow weighs the same); see
            :mod:`jaxccl.sim.model`.
        max_tiles: the executor's cap on tiles per launch (256), replaced
            for what-if studies (``sharing="tiles"``).
        progress: called with the fraction of messages done.
        max_wall_s: give up (:class:`~jaxccl.errors.SimulationError`, a ``RuntimeError``) after this much wall time.

    Raises:
        ScheduleError: a malformed or deadlocking schedule.
        TopologyError: a placement that does not fit ``topo``.
        OptionError: ``routing``, ``execution`` or ``sharing`` is not one of its choices.
        SimulationError: the run exceeded ``max_wall_s``.
    """
    t0 = time.perf_counter()
    router = _router(topo, routing)
    prog = compile_jobs(
        jobs,
        router,
        pipeline_bytes=pipeline_bytes,
        num_slots=num_slots,
        execution=execution,
        sharing=sharing,
        max_tiles=max_tiles,
    )
    t1 = time.perf_counter()
    tnode, stats = simulate(prog, progress=progress, max_wall_s=max_wall_s)
    return _result(prog, router, jobs, tnode, stats, t0, t1)


def run(
    topo: Topology,
    schedule: Schedule,
    bytes_per_rank: float,
    *,
    ranks: Sequence[int] | None = None,
    iterations: int | str = 1,
    **kwargs: Any,
) -> SimResult:
    """Simulates one collective: ``schedule`` with ``bytes_per_rank`` input bytes per rank on ``topo``.

    ``ranks`` places schedule rank ``i`` on GPU ``ranks[i]`` (default: the
    identity; the schedule may then have fewer ranks than ``topo`` has GPUs).
    ``iterations`` runs the schedule as MSCCL's loop over that many tiles of
    the buffer (see :class:`Job`); ``"auto"`` picks
    :func:`jaxccl.sim.model.auto_iterations`. Other keywords as for
    :func:`run_jobs`.

    Returns:
        :class:`SimResult` with ``time_s``, ``algbw`` (one rank's output bytes
        / time), per-link bytes and utilization, and the simulator wall time.
    """
    if iterations == "auto":
        pb = kwargs.get("pipeline_bytes", DEFAULT_PIPELINE_BYTES)
        iterations = auto_iterations(schedule, bytes_per_rank, pipeline_bytes=pb)
    job = Job(schedule, float(bytes_per_rank), ranks, 0.0, schedule.name, iterations)
    return run_jobs(topo, [job], **kwargs)


def _result(
    prog: Program,
    router: Router,
    jobs: Sequence[Job],
    tnode: np.ndarray,
    stats: EngineStats,
    t0: float,
    t1: float,
) -> SimResult:
    n_ops = prog.num_ops
    complete = tnode[n_ops : 2 * n_ops]
    job_results = []
    for j, job in enumerate(jobs):
        sel = prog.op_job == j
        start = float(prog.job_start[j])
        n = job.schedule.num_ranks
        finish = np.full(n, start)
        if sel.any():
            np.maximum.at(finish, prog.op_rank[sel], complete[sel])
        finish -= start
        t = float(finish.max()) if n else 0.0
        out = float(prog.job_out_bytes[j])
        job_results.append(JobResult(job.name, t, out / t if t > 0 else float("inf"), out, finish, job.iterations))
    makespan = float(complete.max() - prog.job_start.min()) if n_ops else 0.0
    lens = prog.msg_path_ptr[1:] - prog.msg_path_ptr[:-1]
    per_link = np.bincount(prog.msg_path_links, weights=np.repeat(prog.msg_bytes, lens), minlength=router.capacity.size)
    used = np.flatnonzero(per_link > 0)
    link_bytes = {router.links[i]: float(per_link[i]) for i in used}
    util = {
        router.links[i]: float(per_link[i] / (router.capacity[i] * makespan)) if makespan > 0 else 0.0 for i in used
    }
    wall = time.perf_counter() - t0
    return SimResult(
        time_s=makespan,
        algbw=job_results[0].algbw if job_results else 0.0,
        jobs=job_results,
        link_bytes=link_bytes,
        link_utilization=util,
        num_flows=prog.num_msgs,
        wall_s=wall,
        compile_s=t1 - t0,
        stats=stats,
    )
