"""Closed-form models the simulator is validated against, and the ring model used for huge rings.

A ring schedule keeps every hop of every ring busy for its whole run, so in
the large-message regime its time is the most loaded link's bytes over its
capacity (plus one route latency for the pipeline to drain). That is the
bound of any schedule moving the same bytes over the same routes, and the
flow simulator reproduces it for rings (``tests/sim/test_sim.py`` checks both
against each other); :func:`ring_time` evaluates it without building the
schedule, which for an 8-channel ring of 2048 GPUs would hold 33 million
messages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxccl.sim.routes import Router
from jaxccl.topology import Topology

__all__ = ["link_loads", "ring_allgather_time", "ring_time"]


def link_loads(topo: Topology, orders: Sequence[Sequence[int]], hop_bytes: float, *, router: Router | None = None):
    """Bytes per link when every hop ``order[i] -> order[i+1]`` of every ring carries ``hop_bytes``.

    Returns ``(loads, router)``: loads indexed like ``router.links``.
    """
    router = router or Router(topo)
    loads = np.zeros(len(router.links))
    for order in orders:
        n = len(order)
        for i in range(n):
            u, v = order[i], order[(i + 1) % n]
            if u != v:
                loads[list(router.route(u, v))] += hop_bytes
    return loads, router


def ring_time(
    topo: Topology,
    orders: Sequence[Sequence[int]],
    chunk_bytes: float,
    *,
    steps: int,
    router: Router | None = None,
) -> float:
    """Large-message time of rings that each move ``steps`` messages of ``chunk_bytes`` per hop.

    ``max_link(load / capacity)`` plus the largest route latency of a hop.
    For a ring AllGather or ReduceScatter over ``N`` ranks, ``steps = N - 1``;
    ``chunk_bytes`` is one channel's message (AllGather: shard / channels;
    ReduceScatter: input / N / channels).

    >>> from jaxccl.topology import ring
    >>> t = ring(4, link_gbps=8, latency=1e-6)     # 1 GB/s links
    >>> round(ring_time(t, [[0, 1, 2, 3]], 1e6, steps=3), 6)
    0.003001
    """
    loads, router = link_loads(topo, orders, chunk_bytes * steps, router=router)
    busy = float((loads / router.capacity).max()) if loads.size else 0.0
    lat = 0.0
    for order in orders:
        n = len(order)
        for i in range(n):
            u, v = order[i], order[(i + 1) % n]
            if u != v:
                lat = max(lat, router.route_latency(router.route(u, v)))
    return busy + lat


def ring_allgather_time(num_ranks: int, shard_bytes: float, bandwidth: float, hop_latency: float) -> float:
    """Store-and-forward ring AllGather on identical links: ``(N-1)/N * S/B + (N-1) * latency``.

    ``S = N * shard_bytes`` is one rank's output buffer.

    >>> ring_allgather_time(4, 1e6, 1e9, 1e-6)
    0.003003
    """
    n = num_ranks
    return (n - 1) / n * (n * shard_bytes) / bandwidth + (n - 1) * hop_latency
