"""From measured GPU pairs to a :class:`~jaxccl.topology.Topology` (``jaxccl topology probe``'s model).

The probe measures, for every ordered pair of ranks ``(i, j)`` alone on the fabric, the rate of a
large transfer and the latency of a small one. :func:`infer` turns that table into a topology the
synthesizers accept, with this model:

- **Hosts.** Ranks of one process form a host when the job has several processes (the process
  holds them; the probe passes them as ``hosts``). In one process, ranks are grouped by rate:
  ranks joined by pairs that are fast both ways (at least ``FAST_FACTOR`` times the slowest pair
  and at least the geometric mean of the slowest and the fastest) form a host; when every pair
  runs at about the same rate (the fastest below ``FAST_FACTOR`` times the slowest) all ranks
  are one host.
- **Inside a host** (two or more ranks): a host switch ``host:hH``; rank ``r``'s duplex link to
  it has the best rate of ``r``'s intra-host pairs (either direction). Latency: the host's
  median intra-host pair latency, split evenly on the two hops.
- **Between hosts**: one switch ``net``; host ``h``'s NIC (a duplex link ``host:hH <-> net``, or
  the rank's own for a one-rank host) has the best rate of the cross-host pairs it sends or
  receives in (a single flow runs at the slower end's rate, so the best pair of a host shows
  its own NIC when some other host is at least as fast). Latency: the median cross-host
  latency less the intra-host hops on the way, split evenly on the two NIC hops.

Links are duplex with one capacity (the best of both directions): the AllGather synthesizer
splits switches into logical links, which needs every switch's ingress equal to its egress.

Limits: an asymmetric NIC reads as its faster direction; one flow at a time cannot tell a NIC
per rank from one shared by the host (the model shares it, as processes share a namespace's
NIC), nor see a NIC faster than every other host's (the fastest host's NIC reads as the second
fastest), nor oversubscribed switches (one switch, non-blocking). Latencies include what the
executor adds to a message; they are clamped at 0.

Example:
    >>> rates = [[0, 10.0, 1.0, 1.0], [10.0, 0, 1.0, 1.0], [1.0, 1.0, 0, 10.0], [1.0, 1.0, 10.0, 0]]
    >>> lat = [[0, 1e-6, 3e-6, 3e-6], [1e-6, 0, 3e-6, 3e-6], [3e-6, 3e-6, 0, 1e-6], [3e-6, 3e-6, 1e-6, 0]]
    >>> t = infer(PairTable(rates, lat))
    >>> t.hosts, t.path_capacity(0, 1), t.path_capacity(0, 2)
    (((0, 1), (2, 3)), 10.0, 1.0)
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

import networkx as nx

from jaxccl.errors import TopologyError
from jaxccl.topology import Topology

__all__ = ["FAST_FACTOR", "NET", "PairTable", "group_by_rate", "host_switch", "infer"]

FAST_FACTOR = 2.0  # intra-host pairs are at least this much faster than the slowest pair
NET = "net"


def host_switch(host: int) -> str:
    """The name of host ``host``'s switch in a probed topology.

    >>> host_switch(3)
    'host:h3'
    """
    return f"host:h{host}"


@dataclasses.dataclass(frozen=True)
class PairTable:
    """What the probe measured: ``rates[i][j]`` (bytes/s) and ``latencies[i][j]`` (s) of pair ``i -> j``.

    Attributes:
        rates: N x N; the diagonal is ignored.
        latencies: N x N; the diagonal is ignored.
        hosts: the host of every rank when known (the process holding it), else ``None``.
    """

    rates: Sequence[Sequence[float]]
    latencies: Sequence[Sequence[float]]
    hosts: Sequence[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.rates)
        if n < 2:
            raise TopologyError(f"a probe needs at least 2 ranks, got {n}")
        for name, table in (("rates", self.rates), ("latencies", self.latencies)):
            if len(table) != n or any(len(row) != n for row in table):
                raise TopologyError(f"PairTable.{name} must be {n} x {n}")
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                r, lat = self.rates[i][j], self.latencies[i][j]
                if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
                    raise TopologyError(f"pair {i} -> {j}: rate must be a positive finite number, got {r!r}")
                if not (isinstance(lat, (int, float)) and math.isfinite(lat)):
                    raise TopologyError(f"pair {i} -> {j}: latency must be a finite number, got {lat!r}")
        if self.hosts is not None and len(self.hosts) != n:
            raise TopologyError(f"PairTable.hosts must name the host of each of the {n} ranks")

    @property
    def num_ranks(self) -> int:
        return len(self.rates)

    def pairs(self) -> list[tuple[int, int]]:
        """Every ordered pair ``(i, j)``, ``i != j``."""
        n = self.num_ranks
        return [(i, j) for i in range(n) for j in range(n) if i != j]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for the probe's JSON report)."""
        return {
            "rates_bytes_per_s": [list(map(float, row)) for row in self.rates],
            "latencies_s": [list(map(float, row)) for row in self.latencies],
            "hosts": list(self.hosts) if self.hosts is not None else None,
        }


def group_by_rate(table: PairTable) -> list[int]:
    """The host of every rank, from rates alone (see the module docstring); hosts numbered by first rank.

    >>> group_by_rate(PairTable([[0, 5.0, 1.0], [5.0, 0, 1.0], [1.0, 1.0, 0]], [[0.0] * 3] * 3))
    [0, 0, 1]
    """
    rates = [table.rates[i][j] for i, j in table.pairs()]
    slow, fast = min(rates), max(rates)
    n = table.num_ranks
    if fast < FAST_FACTOR * slow:
        return [0] * n  # all alike: one host
    cut = max(FAST_FACTOR * slow, math.sqrt(slow * fast))
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from((i, j) for i, j in table.pairs() if i < j and min(table.rates[i][j], table.rates[j][i]) >= cut)
    host_of = [0] * n
    for h, members in enumerate(sorted((sorted(c) for c in nx.connected_components(graph)), key=min)):
        for r in members:
            host_of[r] = h
    return host_of


def _hosts(table: PairTable) -> list[int]:
    if table.hosts is None:
        return group_by_rate(table)
    order: dict[int, int] = {}
    return [order.setdefault(h, len(order)) for h in table.hosts]  # renumbered by first rank


def _duplex(g: nx.DiGraph, a: Any, b: Any, capacity: float, latency: float, kind: str) -> None:
    g.add_edge(a, b, capacity=float(capacity), latency=latency, kind=kind)
    g.add_edge(b, a, capacity=float(capacity), latency=latency, kind=kind)


def infer(table: PairTable, *, name: str = "probed") -> Topology:
    """The topology of the module docstring's model for the measured ``table``.

    Raises:
        TopologyError: the table is malformed (see :class:`PairTable`).
    """
    host_of = _hosts(table)
    n = table.num_ranks
    members: dict[int, list[int]] = {}
    for r in range(n):
        members.setdefault(host_of[r], []).append(r)
    g = nx.DiGraph()
    for r in range(n):
        g.add_node(r, kind="gpu", host=host_of[r])
    hop: dict[int, float] = {}  # latency of one rank <-> host switch hop, per host
    for h, ranks in members.items():
        if len(ranks) < 2:
            continue
        g.add_node(host_switch(h), kind="switch", role="host", host=h)
        inner = [(i, j) for i in ranks for j in ranks if i != j]
        hop[h] = max(0.0, statistics.median(table.latencies[i][j] for i, j in inner) / 2)
        for r in ranks:
            best = max(max(table.rates[r][j], table.rates[j][r]) for j in ranks if j != r)
            _duplex(g, r, host_switch(h), best, hop[h], "host")
    cross = [(i, j) for i, j in table.pairs() if host_of[i] != host_of[j]]
    if cross:
        g.add_node(NET, kind="switch", role="network")
        rest = [table.latencies[i][j] - hop.get(host_of[i], 0.0) - hop.get(host_of[j], 0.0) for i, j in cross]
        nic_latency = max(0.0, statistics.median(rest) / 2)
        for h, ranks in members.items():
            best = max(table.rates[i][j] for i, j in cross if h in (host_of[i], host_of[j]))
            _duplex(g, host_switch(h) if len(ranks) > 1 else ranks[0], NET, best, nic_latency, "nic")
    meta = {"preset": "probed", "hosts": len(members), "model": "jaxccl.cli.topology_infer"}
    return Topology(g, name=name, meta=meta)
