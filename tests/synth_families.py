"""Topology families for the synthesizer tests and benchmarks: tori, mixed host sizes, one-way links.

The presets of :mod:`jaxccl.topology` cover rails, fat trees and rings;
these builders add the shapes a new user tries next. All capacities are in
bytes/s, all latencies in seconds.

>>> torus(4, 4).num_gpus
16
"""

from __future__ import annotations

from jaxccl.topology import Topology

GB = 1e9


def torus(rows: int, cols: int, *, link_gb: float = 50.0, latency: float = 1e-6) -> Topology:
    """A ``rows x cols`` 2-D torus of GPUs, duplex links of ``link_gb`` GB/s to the four neighbours."""
    edges = []
    pairs = set()
    for r in range(rows):
        for c in range(cols):
            me = r * cols + c
            for nb in (r * cols + (c + 1) % cols, ((r + 1) % rows) * cols + c):
                if nb != me and (me, nb) not in pairs:
                    pairs.update({(me, nb), (nb, me)})
                    edges += [(me, nb, link_gb * GB, latency), (nb, me, link_gb * GB, latency)]
    return Topology.from_edges(rows * cols, edges, name=f"torus {rows}x{cols}")


def mixed_hosts(sizes: list[int], *, nvlink_gb: float = 360.0, nic_gb: float = 50.0) -> Topology:
    """Hosts of different sizes: one NVSwitch per host, every GPU's NIC on one shared network switch."""
    edges = []
    rank = 0
    for h, size in enumerate(sizes):
        for _ in range(size):
            edges += [(rank, f"nvs:{h}", nvlink_gb * GB, 25e-9), (f"nvs:{h}", rank, nvlink_gb * GB, 25e-9)]
            edges += [(rank, "net", nic_gb * GB, 5e-7), ("net", rank, nic_gb * GB, 5e-7)]
            rank += 1
    return Topology.from_edges(rank, edges, name=f"mixed hosts {sizes}")
