"""The real-socket demo's layout: which process holds which ranks, and the Topology of those links.

The demo runs 8 ranks (2 emulated hosts x 4) in ``P`` processes of ``8 / P`` ranks each. Every
process sits in its own network namespace with one NIC (a shaped veth to the lab's bridge); the
ranks of one process reach each other through its memory. The Topology given to jaxccl
describes exactly that: each process's ranks meet at a memory switch ``mem:p`` (when it holds more
than one), and each process has one NIC link, in each direction, to the bridge ``net``. With
``P = 8`` every rank has its own NIC (the layout the issue asks for: a cut NIC can be routed
around); with ``P = 2`` a process is a whole host behind one NIC, which no schedule can avoid.

>>> topo = layout_topology(8, nic_rate_mbit=100)
>>> topo.num_gpus, uplink(topo, 8, 0), topo.capacity(*uplink(topo, 8, 0))
(8, (0, 'net'), 12500000.0)
>>> uplink(layout_topology(2, nic_rate_mbit=100), 2, 1)
('mem:1', 'net')

A NIC cut in one direction leaves the bridge forwarding less than it could receive, which
ForestColl's switch removal cannot split; :func:`pairwise_view` is the view the demo synthesizes
on then.
"""

from __future__ import annotations

import networkx as nx

from jaxccl.errors import JaxcclError
from jaxccl.topology import Topology

NUM_RANKS = 8
RANKS_PER_HOST = 4
PROCESS_CHOICES = (2, 8)  # one process per emulated host, or one per rank
BRIDGE = "net"
MEMORY_GBPS = 4.0  # ranks of one process: a copy in memory, 20x the default NIC (and within the
# synthesizer's 1e4 range of capacities, under which a link counts as dead)
NIC_LATENCY_S = 50e-6  # a veth hop through the bridge


class DemoNetworkError(JaxcclError, RuntimeError):
    """The real-socket demo cannot run here (what is missing) or one of its processes failed (which, and why)."""


def check_processes(processes: int) -> int:
    """The number of ranks each of ``processes`` processes holds.

    Raises:
        DemoNetworkError: ``processes`` is not one of :data:`PROCESS_CHOICES`.

    >>> check_processes(8)
    1
    """
    if processes not in PROCESS_CHOICES:
        raise DemoNetworkError(
            f"--processes {processes}: the demo runs 2 hosts x 4 ranks as 2 processes (one per host) or 8 "
            "(one per rank); a process never spans two hosts"
        )
    return NUM_RANKS // processes


def process_of_rank(processes: int) -> list[int]:
    """Which process holds each rank (consecutive ranks share a process).

    >>> process_of_rank(2)
    [0, 0, 0, 0, 1, 1, 1, 1]
    """
    per = check_processes(processes)
    return [r // per for r in range(NUM_RANKS)]


def layout_topology(processes: int, *, nic_rate_mbit: float) -> Topology:
    """The links of the demo's lab as a Topology: memory inside a process, one NIC per process."""
    per = check_processes(processes)
    nic = nic_rate_mbit * 1e6 / 8
    memory = MEMORY_GBPS * 1e9 / 8
    g = nx.DiGraph()
    g.add_node(BRIDGE, kind="switch", role="network")
    for rank, p in enumerate(process_of_rank(processes)):
        g.add_node(rank, kind="gpu", host=rank // RANKS_PER_HOST, rail=rank % RANKS_PER_HOST, segment=0)
        end = rank if per == 1 else f"mem:{p}"
        if per > 1:
            g.add_node(end, kind="switch", role="memory", process=p)
            _duplex(g, rank, end, memory, 0.0, "memory")
        _duplex(g, end, BRIDGE, nic, NIC_LATENCY_S, "nic")
    meta = {"preset": "demo_network", "processes": processes, "nic_rate_mbit": nic_rate_mbit}
    return Topology(g, name=f"{processes} processes x {per} ranks, one NIC each", meta=meta)


def uplink(topo: Topology, processes: int, process: int) -> tuple[int | str, str]:
    """The link that carries what ``process`` sends to other processes (its NIC's uplink)."""
    per = check_processes(processes)
    end: int | str = process if per == 1 else f"mem:{process}"
    topo.capacity(end, BRIDGE)  # raises for a process the layout does not have
    return end, BRIDGE


def pairwise_view(topo: Topology, processes: int) -> Topology:
    """The layout's links seen rank to rank: an inner approximation for synthesis on asymmetric NICs.

    Every ordered pair of ranks gets one direct link. Ranks of one process share its memory;
    ranks of different processes get an even share of both NICs the pair crosses: of the sender's
    uplink (shared by its process's ranks times their remote peers) and of the receiver's
    downlink (likewise). Any schedule that fits these links fits the real ones, and no switch is
    left, so a NIC slowed in one direction can be synthesized around (ForestColl's switch removal
    needs every switch to forward as much as it can receive).

    >>> view = pairwise_view(layout_topology(8, nic_rate_mbit=70), 8)
    >>> view.capacity(0, 5) * 7 == layout_topology(8, nic_rate_mbit=70).capacity(0, "net")
    True
    """
    per = check_processes(processes)
    owner = process_of_rank(processes)
    remote = NUM_RANKS - per  # peers of a rank outside its process
    g = nx.DiGraph()
    for rank in range(NUM_RANKS):
        g.add_node(rank, **topo.graph.nodes[rank])
    for a in range(NUM_RANKS):
        for b in range(NUM_RANKS):
            if a == b:
                continue
            if owner[a] == owner[b]:
                g.add_edge(a, b, capacity=topo.capacity(a, f"mem:{owner[a]}"), latency=0.0, kind="memory")
                continue
            up = topo.capacity(*uplink(topo, processes, owner[a])) / (per * remote)
            down = topo.capacity(BRIDGE, uplink(topo, processes, owner[b])[0]) / (per * remote)
            g.add_edge(a, b, capacity=min(up, down), latency=2 * NIC_LATENCY_S, kind="nic")
    return Topology(g, name=f"{topo.name}, rank to rank", meta={**topo.meta, "view": "pairwise"})


def _duplex(g: nx.DiGraph, a: int | str, b: int | str, capacity: float, latency: float, kind: str) -> None:
    g.add_edge(a, b, capacity=capacity, latency=latency, kind=kind)
    g.add_edge(b, a, capacity=capacity, latency=latency, kind=kind)
