"""The schedules ``jaxccl bench --schedule`` names: a synthesizer, a baseline, or a schedule file.

Names (each for every collective of the sweep):

- ``direct`` (default): the communicator's defaults (direct AllGather,
  AllToAll and ReduceScatter, rank-ordered direct AllReduce; with a topology,
  AllReduce runs as ReduceScatter + AllGather).
- ``ring``: ring AllGather, ring ReduceScatter, ring AllReduce (AllToAll has
  no ring: the direct one).
- ``nccl``: the NCCL-like baselines for the topology.
- ``synth``: jaxccl's synthesizers for the topology, degraded by
  ``--scenario`` if one is given (AllReduce: synthesized ReduceScatter +
  AllGather).

``psum``, ``pmax``, ``pmin`` and ``pmean`` share one AllReduce schedule (the
operator is the call's): the plan holds it once, under the first of them.
- ``static``: synthesized for the healthy topology (what runs before the
  closed loop reacts to ``--scenario``).

Anything else is a path to a schedule JSON (:meth:`Schedule.to_json`) or
MSCCL XML file; it serves the collective it implements.

Example:
    >>> from jaxccl.topology import single_node
    >>> plan = schedules("ring", ("all_gather", "all_to_all"), single_node(4), single_node(4))
    >>> {c: s.name for c, s in plan.items()}
    {'all_gather': 'ring_allgather', 'all_to_all': 'direct_alltoall'}
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from jaxccl import synth
from jaxccl.cli.args import UsageError, read_text
from jaxccl.cli.bench_sweep import ALL_REDUCES, SCHEDULE_COLLECTIVE
from jaxccl.errors import JaxcclError
from jaxccl.schedule import Schedule, from_msccl_xml
from jaxccl.synth import baselines
from jaxccl.synth.nccl import nccl_schedule

__all__ = ["NAMES", "load_file", "schedules"]

NAMES = ("direct", "ring", "nccl", "synth", "static")
# A schedule file's collective as the bench names it (an AllReduce: psum, the family's first).
_BY_SCHEDULE_COLLECTIVE = {v: k for k, v in reversed(SCHEDULE_COLLECTIVE.items())}


def load_file(path: str) -> tuple[str, Any]:
    """``(bench collective, Schedule)`` from a schedule JSON or MSCCL XML file (not validated here).

    Raises:
        UsageError: the file is missing, unreadable or not a schedule.
    """
    if not os.path.isfile(path):
        raise UsageError(f"--schedule {path!r}: neither one of {', '.join(NAMES)} nor an existing file")
    text = read_text(path, f"--schedule {path!r}")
    try:
        schedule = from_msccl_xml(text) if text.lstrip().startswith("<") else Schedule.from_json(text)
    except JaxcclError as e:
        raise UsageError(f"--schedule {path!r}: {e}") from None
    return _BY_SCHEDULE_COLLECTIVE[schedule.collective.value], schedule


def _synthesized(collective: str, topo: Any) -> list[Any]:
    if collective == "all_gather":
        return [synth.all_gather(topo)]
    if collective == "all_to_all":
        return [synth.all_to_all(topo)]
    if collective == "psum_scatter":
        return [synth.reduce_scatter(topo)]
    return [synth.reduce_scatter(topo), synth.all_gather(topo)]  # psum = ReduceScatter + AllGather


def _baseline(name: str, collective: str, topo: Any) -> list[Any]:
    if name == "nccl":
        return [nccl_schedule(SCHEDULE_COLLECTIVE[collective], topo)]
    fn = {
        "all_gather": baselines.ring_allgather,
        "all_to_all": baselines.direct_alltoall,
        "psum_scatter": baselines.ring_reduce_scatter,
        **dict.fromkeys(ALL_REDUCES, baselines.ring_allreduce),
    }[collective]
    return [fn(topo)]


def schedules(name: str, collectives: Sequence[str], topo: Any, healthy: Any) -> dict[str, Any]:
    """The schedules to install for ``collectives``, keyed by bench collective (psum may bring two).

    ``topo`` is the topology the schedules are for (degraded by a scenario),
    ``healthy`` the one without the scenario (``static``). ``direct`` returns
    nothing: the communicator's defaults run. A psum served by ReduceScatter +
    AllGather returns its two schedules under ``"psum"`` and ``"psum:all_gather"``.
    """
    if name not in NAMES:
        raise UsageError(f"--schedule {name!r}: expected one of {', '.join(NAMES)} or a schedule file")
    plan: dict[str, Any] = {}
    if name == "direct":
        return plan
    for collective in collectives:
        if collective in ALL_REDUCES and any(c in plan for c in ALL_REDUCES):
            continue  # the family's AllReduce schedule is already planned
        try:
            if name in ("synth", "static"):
                found = _synthesized(collective, topo if name == "synth" else healthy)
            else:
                found = _baseline(name, collective, topo)
        except JaxcclError as e:
            raise UsageError(f"--schedule {name} for {collective}: {e}") from None
        plan[collective] = found[0]
        if len(found) > 1:
            plan[f"{collective}:all_gather"] = found[1]
    return plan
