"""MCCL Algorithm 1: is the active schedule's bottleneck cut still saturated under the measurements?

For a schedule ``s`` with ``n_a`` chunks (per period) crossing link ``a``, its
bottleneck cut ``K_s`` (the links it saturates) and the base slacks
``base_slack_{s,a}`` (bandwidth left unused on ``a`` by the rounding into
chunks), given the measured link capacities ``M``:

1. ``x_min(s) = min_{a: n_a > 0} M_a / n_a`` (per-chunk rate the most
   congested link allows);
2. for ``a`` in ``K_s``: ``slack_a = (M_a - n_a x_min) / M_a`` and
   ``delta_a = slack_a - base_slack_a``;
3. flag ``s`` for re-optimization when ``max_a delta_a > gamma``.

A degradation off the cut that does not become the new bottleneck leaves every
``delta_a`` at 0, and so does a uniform scaling of the cut (MCCL Sec. 6.1).

Example:
    >>> from jaxccl.topology import rail
    >>> from jaxccl.synth import all_gather
    >>> topo = rail(hosts=2, gpus_per_host=4)
    >>> p = profile(all_gather(topo), topo)
    >>> check(p, nominal_capacities(topo), gamma=0.1).flagged
    False
    >>> bad = nominal_capacities(topo.degrade(0, "tor:s0r0", gbps=200))
    >>> check(p, bad, gamma=0.1).flagged
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxccl.errors import ArgumentError, ScheduleError, TopologyError

__all__ = ["CheckResult", "ScheduleProfile", "algbw_on", "check", "nominal_capacities", "profile"]

Edge = tuple[Any, Any]
_REL_TOL = 1e-9


@dataclasses.dataclass(frozen=True)
class ScheduleProfile:
    """What Algorithm 1 needs to know about one active schedule.

    Attributes:
        link_chunks: ``n_a`` per link (chunks per period crossing it).
        cut: the bottleneck cut ``K_s``.
        base_slacks: ``base_slack_{s,a}`` for every link of the cut.
        inter_pairs: the inter-node GPU pairs the schedule sends between (for
            attributing pair measurements to links).
    """

    link_chunks: Mapping[Edge, float]
    cut: tuple[Edge, ...]
    base_slacks: Mapping[Edge, float]
    inter_pairs: frozenset[tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """Outcome of Algorithm 1 for one schedule."""

    x_min: float
    slacks: Mapping[Edge, float]
    deltas: Mapping[Edge, float]
    flagged: bool
    worst: Edge | None

    @property
    def max_delta(self) -> float:
        return max(self.deltas.values(), default=0.0)


def nominal_capacities(topology: Any) -> dict[Edge, float]:
    """Every link's capacity (bytes/s) as the topology states it."""
    return {(u, v): float(c) for u, v, c, _ in topology.edges()}


def _edge(e: Any) -> Edge:
    u, v = e[0], e[1]
    return (u, v)


def _sent_pairs(schedule: Any) -> dict[tuple[int, int], int]:
    pairs: dict[tuple[int, int], int] = {}
    for r, tbs in enumerate(schedule.ranks):
        for tb in tbs:
            for op in tb.ops:
                if op.kind.sends:
                    key = (r, tb.send_peer)
                    pairs[key] = pairs.get(key, 0) + op.count
    return pairs


def profile(schedule: Any, topology: Any) -> ScheduleProfile:
    """The Algorithm-1 profile of ``schedule`` on ``topology``.

    Synthesized schedules carry ``info["link_chunks"]``, the cut
    (``bottleneck_cut`` or ``cut``) and ``base_slacks``; for any other schedule
    (ring, recursive doubling, ...) ``n_a`` is counted from its send ops along
    ``topology.path`` and the cut is the set of links that bind ``x_min`` at the
    nominal capacities (base slack 0 there).

    Raises:
        ScheduleError: the schedule's rank count differs from the topology's.
    """
    if schedule.num_ranks != topology.num_gpus:
        raise ScheduleError(
            f"profile: schedule has {schedule.num_ranks} ranks but the topology has {topology.num_gpus} GPUs"
        )
    pairs = _sent_pairs(schedule)
    inter = frozenset(p for p in pairs if topology.host_of(p[0]) != topology.host_of(p[1]))
    info = schedule.info or {}
    cut_key = "bottleneck_cut" if "bottleneck_cut" in info else "cut"
    if "link_chunks" in info and cut_key in info and "base_slacks" in info:
        loads = {_edge(e): float(e[2]) for e in info["link_chunks"] if float(e[2]) > 0}
        cut = tuple(_edge(e) for e in info[cut_key])
        slacks = {a: float(b) for a, b in zip(cut, info["base_slacks"])}
        return ScheduleProfile(loads, cut, slacks, inter)
    loads: dict[Edge, float] = {}
    for (u, v), chunks in pairs.items():
        for e in topology.path(u, v):
            loads[e] = loads.get(e, 0.0) + chunks
    caps = nominal_capacities(topology)
    x = min(caps[a] / n for a, n in loads.items())
    cut = tuple(a for a, n in loads.items() if caps[a] / n <= x * (1 + _REL_TOL))
    return ScheduleProfile(loads, cut, dict.fromkeys(cut, 0.0), inter)


def check(p: ScheduleProfile, capacities: Mapping[Edge, float], *, gamma: float) -> CheckResult:
    """Runs Algorithm 1's three phases for one schedule against measured ``capacities`` (bytes/s).

    Links missing from ``capacities`` are an error (pass nominal values for
    unmeasured links, e.g. ``{**nominal_capacities(topo), **measured}``).
    """
    if gamma < 0:
        raise ArgumentError(f"Algorithm 1: gamma must be >= 0, got {gamma}")
    missing = [a for a in p.link_chunks if a not in capacities]
    if missing:
        raise TopologyError(f"Algorithm 1: no capacity for link(s) {missing[:3]} of the schedule")
    x_min = min(capacities[a] / n for a, n in p.link_chunks.items())  # phase 1
    slacks: dict[Edge, float] = {}
    deltas: dict[Edge, float] = {}
    for a in p.cut:  # phase 2
        m = capacities[a]
        slacks[a] = (m - p.link_chunks.get(a, 0.0) * x_min) / m
        deltas[a] = slacks[a] - p.base_slacks.get(a, 0.0)
    worst = max(deltas, key=deltas.__getitem__, default=None)
    return CheckResult(x_min, slacks, deltas, bool(worst is not None and deltas[worst] > gamma), worst)  # phase 3


def algbw_on(schedule: Any, topology: Any) -> float:
    """``schedule``'s algbw on ``topology`` as the controller predicts it: ranks x chunks per period x ``x_min``
    (the large-message limit; :func:`jaxccl.synth.ordered_reduce_scatter.predicted_algbw` counts an AllReduce's
    buffer instead, for the schedules the controller splits into ReduceScatter + AllGather).

    >>> from jaxccl.topology import rail
    >>> from jaxccl.synth import all_gather
    >>> topo = rail(hosts=2, gpus_per_host=4)
    >>> s = all_gather(topo)
    >>> algbw_on(s, topo) == s.algbw, algbw_on(s, topo.degrade(0, "tor:s0r0", gbps=200)) < s.algbw
    (True, True)
    """
    x_min = check(profile(schedule, topology), nominal_capacities(topology), gamma=0.0).x_min
    return schedule.num_ranks * schedule.chunks_per_period * x_min
