"""ReduceScatter schedules that sum in ``jax.lax``'s order and route around slow links.

A float sum depends on its order. ``jax.lax.psum_scatter`` folds the ranks'
blocks in ascending rank order, ``((x0 + x1) + x2) + ...``, so a schedule is
bitwise equal to it only when every output is that very fold
(``info["ordered_reduction"]``). The tree packings of
:func:`jaxccl.synth.reduce_scatter` add partial sums along their trees, which
changes the last bits; the closed loop therefore re-synthesizes ReduceScatter
with this module instead.

The fold of each block is a *chain*: rank 0 sends its contribution to rank 1,
which adds its own and sends the partial sum on to rank 2, and so on; the
last rank sends the full sum to the block's owner. Where a hop of the chain
leaves a host, the partial sum may travel through any GPU of each host (a
relay copies it, it never adds), so every NIC of the host can carry a share.
The sub-chunks of every block pick their crossing pairs greedily: each takes
the relay pair whose most loaded link, relative to its capacity, stays the
least loaded. On a degraded fabric the degraded NIC gets fewer chunks in
proportion to its capacity, while the order of every sum stays the same.

What it costs: every block crosses each host boundary of the chain once
(plus once back to its owner), so on ``H`` hosts it moves about twice the
inter-host bytes of the reversed tree packing, and half those of the direct
(rank-ordered) ReduceScatter; the chain is ``N`` hops deep, which matters for
small messages only. Topologies without hosts (or with one) are not
re-routed: their hops follow :meth:`~jaxccl.topology.Topology.path`.

Example:
    >>> from jaxccl.topology import rail
    >>> topo = rail(hosts=2, gpus_per_host=4)
    >>> s = ordered_reduce_scatter(topo).validate(ordered_reduction=True)
    >>> s.info["ordered_reduction"], s.algbw > 0
    (True, True)
    >>> slow = topo.degrade(0, "tor:s0r0", gbps=200).degrade("tor:s0r0", 0, gbps=200)
    >>> ordered_reduce_scatter(slow, max_chunks=4).algbw > predicted_algbw(s, slow)
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping
from typing import Any

from jaxccl.errors import ScheduleError
from jaxccl.schedule.builder import ScheduleBuilder
from jaxccl.schedule.ir import Buffer, Collective, Schedule

__all__ = ["DEFAULT_MAX_CHUNKS", "ordered_reduce_scatter", "predicted_algbw"]

DEFAULT_MAX_CHUNKS = 4
Link = tuple[Any, Any]
Segment = tuple[int, int]  # one GPU-to-GPU send along topology.path


@dataclasses.dataclass(frozen=True)
class _Hop:
    """One hop of a block's chain: from ``src`` to ``dst`` through ``segments``; ``reduce``: ``dst`` adds its own."""

    segments: tuple[Segment, ...]
    reduce: bool


def _route_loads(topo: Any, segments: tuple[Segment, ...]) -> dict[Link, int]:
    loads: dict[Link, int] = {}
    for a, b in segments:
        for e in topo.path(a, b):
            loads[e] = loads.get(e, 0) + 1
    return loads


def _candidates(topo: Any, u: int, v: int) -> list[tuple[Segment, ...]]:
    """Ways to send from ``u`` to ``v``: direct on one host, else through any pair of GPUs of the two hosts."""
    hu, hv = topo.host_of(u), topo.host_of(v)
    if hu == hv:
        return [((u, v),)]
    hosts = topo.hosts
    out = []
    for g, h in itertools.product(hosts[hu], hosts[hv]):
        segs = [(u, g)] if u != g else []
        segs.append((g, h))
        if h != v:
            segs.append((h, v))
        out.append(tuple(segs))
    return out


def _chain(n: int, root: int) -> list[tuple[int, int, bool]]:
    """The hops of one block's fold: ``(src, dst, reduce)``; rank ``k`` adds its block after rank ``k - 1``."""
    hops = [(k - 1, k, True) for k in range(1, n)]
    if root != n - 1:
        hops.append((n - 1, root, False))
    return hops


def _plan(topo: Any, c: int) -> tuple[dict[int, list[_Hop]], dict[Link, int]]:
    """Routes of every sub-chunk's chain (keyed by input chunk ``root * c + i``) and the links' chunk loads."""
    n = topo.num_gpus
    caps = {(u, v): float(cap) for u, v, cap, _ in topo.edges()}
    loads: dict[Link, int] = {}
    routes: dict[int, list[_Hop | None]] = {}
    pending: list[tuple[int, int, int, int, bool]] = []  # (chunk, hop index, src, dst, reduce)
    for root, i in itertools.product(range(n), range(c)):
        chunk = root * c + i
        hops = _chain(n, root)
        routes[chunk] = [None] * len(hops)
        for h, (u, v, red) in enumerate(hops):
            options = _candidates(topo, u, v)
            if len(options) == 1:  # fixed route: its load is known before the choices are made
                routes[chunk][h] = _Hop(options[0], red)
                for e, k in _route_loads(topo, options[0]).items():
                    loads[e] = loads.get(e, 0) + k
            else:
                pending.append((chunk, h, u, v, red))
    for chunk, h, u, v, red in pending:
        best_key, best = None, None
        for segs in _candidates(topo, u, v):
            add = _route_loads(topo, segs)
            ratios = [(loads.get(e, 0) + k) / caps[e] for e, k in add.items()]
            key = (max(ratios), sum(ratios))
            if best_key is None or key < best_key:
                best_key, best = key, (segs, add)
        segs, add = best
        routes[chunk][h] = _Hop(segs, red)
        for e, k in add.items():
            loads[e] = loads.get(e, 0) + k
    return {chunk: [hop for hop in hops if hop is not None] for chunk, hops in routes.items()}, loads


def _x_min(topo: Any, loads: Mapping[Link, float]) -> float:
    return min(topo.capacity(*e) / k for e, k in loads.items() if k > 0)


def _emit(n: int, c: int, routes: dict[int, list[_Hop]]) -> ScheduleBuilder:
    """The schedule of ``routes``, ops in rounds of chain position: no threadblock waits on a later op."""
    # Every segment of every chunk, in chain order: (chunk, src, dst, reduce at dst, final into the output).
    flat: dict[int, list[tuple[int, int, bool, bool]]] = {}
    for chunk, hops in routes.items():
        steps = []
        for h, hop in enumerate(hops):
            last_hop = h == len(hops) - 1
            for s, (a, b) in enumerate(hop.segments):
                last_seg = s == len(hop.segments) - 1
                steps.append((a, b, hop.reduce and last_seg, last_hop and last_seg))
        flat[chunk] = steps
    visits: dict[tuple[int, int], int] = {}  # (rank, chunk) -> scratch copies of it so far
    scratch_of: list[tuple[int, int, int]] = []

    def fresh(rank: int, chunk: int) -> tuple[Buffer, int]:
        v = visits.get((rank, chunk), 0)
        visits[(rank, chunk)] = v + 1
        scratch_of.append((rank, chunk, v))
        return (Buffer.SCRATCH, v * n * c + chunk)

    depth = max(len(s) for s in flat.values())
    cursor = {chunk: ((Buffer.INPUT, chunk), None) for chunk in flat}  # where the running value is, its handle
    plan = []
    for t in range(depth):
        for chunk, steps in flat.items():
            if t < len(steps):
                plan.append((chunk, *steps[t]))
    # Scratch size is known only once every visit is counted: lay the rounds out first, build after.
    placed = []
    for chunk, a, b, red, final in plan:
        dst = (Buffer.OUTPUT, chunk % c) if final else fresh(b, chunk)
        placed.append((chunk, a, b, red, dst))
    per_chunk = max((v for _, _, v in scratch_of), default=-1) + 1
    builder = ScheduleBuilder(Collective.REDUCE_SCATTER, n, c, scratch_chunks=per_chunk * n * c)
    for chunk, a, b, red, dst in placed:
        src, handle = cursor[chunk]
        h = builder.transfer(
            a,
            b,
            src,
            dst,
            1,
            after=() if handle is None else (handle,),
            reduce=red,
            reduce_with=(Buffer.INPUT, chunk) if red else None,
        )
        cursor[chunk] = (dst, h)
    return builder


def predicted_algbw(schedule: Schedule, topo: Any) -> float:
    """Large-message algbw of ``schedule`` on ``topo`` (bytes/s): ``N * c`` times the per-chunk rate of its bottleneck.

    Counts every send op along :meth:`~jaxccl.topology.Topology.path`, as the
    controller's Algorithm 1 does for schedules without a synthesizer's profile.
    """
    loads: dict[Link, float] = {}
    for r, tbs in enumerate(schedule.ranks):
        for tb in tbs:
            for op in tb.ops:
                if op.kind.sends:
                    for e in topo.path(r, tb.send_peer):
                        loads[e] = loads.get(e, 0.0) + op.count
    return schedule.num_ranks * schedule.chunks_per_period * _x_min(topo, loads)


def ordered_reduce_scatter(
    topo: Any, previous: Schedule | None = None, *, max_chunks: int = DEFAULT_MAX_CHUNKS
) -> Schedule:
    """A rank-ordered ReduceScatter for ``topo``: bitwise equal to ``jax.lax.psum_scatter`` and balanced over NICs.

    Args:
        topo: the topology (as measured: degraded links have their measured capacity).
        previous: the running schedule; unused (the greedy routing takes
            milliseconds, so there is nothing to warm-start), accepted so the
            controller can call every synthesizer the same way.
        max_chunks: the most sub-chunks per block tried; the count with the
            highest predicted algbw wins (the smallest on ties).

    Returns:
        A validated ``REDUCE_SCATTER`` schedule with ``info["ordered_reduction"]``
        true, its predicted ``algbw`` on ``topo``, ``info["chunk_loads"]`` (the
        chunks per period on each link) and ``info["synth_ms"]``.

    Raises:
        ScheduleError: fewer than 2 GPUs, or ``max_chunks`` < 1.
    """
    del previous
    n = topo.num_gpus
    if n < 2:
        raise ScheduleError(f"ordered_reduce_scatter: needs at least 2 GPUs, the topology has {n}")
    if max_chunks < 1:
        raise ScheduleError(f"ordered_reduce_scatter: max_chunks must be >= 1, got {max_chunks}")
    t0 = time.perf_counter()
    best = None
    for c in range(1, max_chunks + 1):
        routes, loads = _plan(topo, c)
        algbw = n * c * _x_min(topo, loads)
        if best is None or algbw > best[0] * (1 + 1e-9):
            best = (algbw, c, routes, loads)
    algbw, c, routes, loads = best
    info = {
        "algorithm": "ordered_chain",
        "ordered_reduction": True,
        "chunk_loads": [(u, v, k) for (u, v), k in sorted(loads.items(), key=str)],
        "synth_ms": (time.perf_counter() - t0) * 1e3,
    }
    schedule = _emit(n, c, routes).build(name="ordered_chain_reduce_scatter", algbw=algbw, info=info)
    return schedule.validate(ordered_reduction=True)
