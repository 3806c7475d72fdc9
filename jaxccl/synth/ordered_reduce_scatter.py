"""ReduceScatter schedules that sum in ``jax.lax``'s order and route around slow links.

A float sum depends on its order. ``jax.lax.psum_scatter`` folds the ranks'
blocks in ascending rank order, ``((x0 + x1) + x2) + ...``, so a schedule is
bitwise equal to it only when every output is that very fold
(``info["ordered_reduction"]``). The tree packings of
:func:`jaxccl.synth.reduce_scatter` add partial sums along their trees, which
changes the last bits; the closed loop therefore re-synthesizes ReduceScatter
with this module instead.

The rank order splits into *runs*, maximal sequences of consecutive ranks on
one host. For each block, every run sends its contributions to one GPU, its
*folder*, which adds them in rank order to the running sum it received from
the previous run's folder and passes the result on; the last folder sends the
full sum to the block's owner, directly or through one GPU of the owner's
host. A folder is a GPU of its run's host, or the previous run's folder going
on (the run's blocks then cross the host boundary instead of the running sum:
more bytes one way, fewer the other). Relays copy, they never add, so every
candidate computes the same fold. The sub-chunks of every block choose among
the candidates greedily: each takes the one whose most loaded link, relative
to its capacity, stays the least loaded. On a degraded fabric the degraded
NIC gets fewer chunks in proportion to its capacity.

What it costs: every block crosses each host boundary of the rank order about
once (plus once to its owner), so it moves about twice the inter-host bytes of
the reversed tree packing and half those of the direct (rank-ordered)
ReduceScatter; a fold is a few hops deep (one per host boundary, plus the
gather into each folder). Every transfer follows
:meth:`~jaxccl.topology.Topology.path`; on a single host only the folder is
chosen.

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

import numpy as np

from jaxccl.errors import SynthesisError, TopologyError
from jaxccl.schedule.builder import ScheduleBuilder
from jaxccl.schedule.ir import Buffer, Collective, Schedule

__all__ = ["DEFAULT_MAX_CHUNKS", "ordered_reduce_scatter", "predicted_algbw"]

DEFAULT_MAX_CHUNKS = 4
Link = tuple[Any, Any]


@dataclasses.dataclass(frozen=True)
class _Action:
    """One op pair of a chunk's fold: a transfer ``a -> b`` (``a == b``: a local op on ``a``).

    Locations are ``"in"`` (the chunk of the input), ``"out"`` (its place in
    the output) or ``("s", rank, visit)`` (a scratch copy). ``reduce_with``
    set: the receiver (or the local op) stores ``reduce_with + value``.
    ``after`` are indices of earlier actions of the chunk this one waits for.
    """

    a: int
    b: int
    src: Any
    dst: Any
    reduce_with: Any = None
    after: tuple[int, ...] = ()


def _runs(topo: Any) -> list[tuple[int, list[int]]]:
    """The chain split into maximal runs of consecutive ranks on one host: ``[(host, ranks), ...]``."""
    out: list[tuple[int, list[int]]] = []
    for k in range(topo.num_gpus):
        h = topo.host_of(k)
        if out and out[-1][0] == h:
            out[-1][1].append(k)
        else:
            out.append((h, [k]))
    return out


def _fold(runs: list[tuple[int, list[int]]], folders: tuple[int, ...], final: tuple[int, ...], root: int):
    """The actions of one chunk: each run's blocks sent to its folder, folded there in rank order, passed on.

    ``final`` is the route of the sum from the last folder to ``root``
    (its GPUs after the folder; empty when the folder is the root).
    """
    acts: list[_Action] = []
    visits: dict[int, int] = {}

    def scratch(rank: int) -> tuple[str, int, int]:
        v = visits.get(rank, 0)
        visits[rank] = v + 1
        return ("s", rank, v)

    where, at, idx = None, None, None  # the running sum: its location, rank and producing action
    for (_, ranks), g in zip(runs, folders):
        terms = list(ranks)
        # the previous folder going on (this run's blocks travel to it) keeps folding into its slot
        slot = where if g == at and where != "in" else scratch(g)
        if where is None:  # the first run: the fold starts from x0
            first = terms.pop(0)
            if first == g:
                where, at = "in", g
            else:
                acts.append(_Action(first, g, "in", slot))
                where, at, idx = slot, g, len(acts) - 1
        elif g != at:  # the running sum travels to this run's folder
            first = terms[0]
            red = "in" if first == g else None
            if red:
                terms.pop(0)
            acts.append(_Action(at, g, where, slot, red, () if idx is None else (idx,)))
            where, at, idx = slot, g, len(acts) - 1
        for k in terms:
            if k == g:
                acts.append(_Action(g, g, "in", slot, slot, (idx,)))
            else:
                acts.append(_Action(k, g, "in", slot, where, () if idx is None else (idx,)))
            where, idx = slot, len(acts) - 1
    hops = (at, *final)
    if len(hops) == 1:  # the last folder owns the chunk
        last = acts[-1]
        if last.a != last.b:
            acts[-1] = dataclasses.replace(last, dst="out")
        else:
            acts.append(_Action(at, at, where, "out", None, (idx,)))
        return acts
    for x, y in zip(hops[:-1], hops[1:]):
        dst = "out" if y == root and y == hops[-1] else scratch(y)
        acts.append(_Action(x, y, where, dst, None, (idx,)))
        where, idx = dst, len(acts) - 1
    return acts


def _loads_of(topo: Any, acts: list[_Action], paths: dict[tuple[int, int], tuple[Link, ...]]) -> dict[Link, int]:
    """Chunks each link carries for ``acts`` (one per action along :meth:`~jaxccl.topology.Topology.path`)."""
    loads: dict[Link, int] = {}
    for act in acts:
        if act.a != act.b:
            route = paths.get((act.a, act.b))
            if route is None:
                route = paths[(act.a, act.b)] = topo.path(act.a, act.b)
            for e in route:
                loads[e] = loads.get(e, 0) + 1
    return loads


def _options(topo: Any, runs: list[tuple[int, list[int]]], root: int, exhaustive: int):
    """Candidate (folders, final route) pairs for a chunk of ``root``; every combination while few enough.

    A run's folder is a GPU of its host, or (after the first run) the
    previous run's folder, which then receives this run's blocks across the
    host boundary instead of sending the running sum: fewer bytes one way,
    more the other, which balances the two directions of the NICs.
    """
    hosts = topo.hosts
    per_run = [list(hosts[h]) + ([-1] if i else []) for i, (h, _) in enumerate(runs)]

    def routes_from(g: int) -> list[tuple[int, ...]]:
        if g == root:
            return [()]
        if topo.host_of(g) == topo.host_of(root):
            return [(root,)]
        return [(root,)] + [(h, root) for h in hosts[topo.host_of(root)] if h != root]

    def resolved(choice: tuple[int, ...]) -> tuple[int, ...]:
        out: list[int] = []
        for g in choice:
            out.append(out[-1] if g < 0 else g)
        return tuple(out)

    count = 1
    for choices in per_run:
        count *= len(choices)
    if count * len(hosts[topo.host_of(root)]) <= exhaustive:
        for choice in itertools.product(*per_run):
            folders = resolved(choice)
            for route in routes_from(folders[-1]):
                yield folders, route
        return
    # too many: the folders at the root's position on each host (rail aligned), and every choice that
    # changes one run's folder only
    aligned = tuple(hosts[h][root % len(hosts[h])] for h, _ in runs)
    choices = {aligned}
    for i, options in enumerate(per_run):
        choices.update(aligned[:i] + (g,) + aligned[i + 1 :] for g in options)
    for choice in sorted(choices):
        folders = resolved(choice)
        for route in routes_from(folders[-1]):
            yield folders, route


@dataclasses.dataclass(frozen=True)
class _Candidates:
    """The candidate folds of one root's chunks and the chunks each puts on every link (a row per fold)."""

    folds: list[list[_Action]]
    loads: np.ndarray  # [folds, links]
    size: np.ndarray  # actions per fold


def _candidates(topo: Any, links: dict[Link, int], exhaustive: int = 1024) -> dict[int, _Candidates]:
    """Per root, every candidate fold of one of its chunks (``links``: the column of each link)."""
    runs = _runs(topo)
    paths: dict[tuple[int, int], tuple[Link, ...]] = {}
    out: dict[int, _Candidates] = {}
    for root in range(topo.num_gpus):
        folds = [_fold(runs, folders, route, root) for folders, route in _options(topo, runs, root, exhaustive)]
        loads = np.zeros((len(folds), len(links)))
        for row, acts in enumerate(folds):
            for e, k in _loads_of(topo, acts, paths).items():
                loads[row, links[e]] = k
        out[root] = _Candidates(folds, loads, np.array([len(a) for a in folds]))
    return out


def _plan(topo: Any, c: int, candidates: dict[int, _Candidates], caps: np.ndarray) -> tuple[dict, np.ndarray]:
    """The fold of every sub-chunk (keyed by input chunk ``root * c + i``) and the links' chunk loads.

    Sub-chunks are placed one after the other; each takes the candidate
    whose most loaded link, relative to its capacity, stays the least loaded
    (then the smallest sum of those ratios, then the fewest actions).
    """
    loads = np.zeros(len(caps))
    plans: dict[int, list[_Action]] = {}
    for i, root in itertools.product(range(c), range(topo.num_gpus)):
        cand = candidates[root]
        ratios = np.where(cand.loads > 0, (loads + cand.loads) / caps, 0.0)
        best = np.lexsort((cand.size, ratios.sum(axis=1), ratios.max(axis=1)))[0]
        plans[root * c + i] = cand.folds[best]
        loads += cand.loads[best]
    return plans, loads


def _x_min(topo: Any, loads: Mapping[Link, float]) -> float:
    return min(topo.capacity(*e) / k for e, k in loads.items() if k > 0)


def _emit(n: int, c: int, plans: dict[int, list[_Action]]) -> ScheduleBuilder:
    """The schedule of ``plans``, ops in rounds of dependency depth: no threadblock waits on a later op."""
    rounds: list[tuple[int, int, int]] = []  # (round, chunk, action index)
    for chunk, acts in plans.items():
        depth: list[int] = []
        for j, act in enumerate(acts):
            depth.append(1 + max((depth[d] for d in act.after), default=0))
            rounds.append((depth[j], chunk, j))
    rounds.sort()
    copies = 1 + max((a.dst[2] for acts in plans.values() for a in acts if isinstance(a.dst, tuple)), default=0)
    builder = ScheduleBuilder(Collective.REDUCE_SCATTER, n, c, scratch_chunks=copies * n * c)

    def loc(spec: Any, chunk: int) -> tuple[Buffer, int]:
        if spec == "in":
            return (Buffer.INPUT, chunk)
        if spec == "out":
            return (Buffer.OUTPUT, chunk % c)
        return (Buffer.SCRATCH, spec[2] * n * c + chunk)

    handles: dict[tuple[int, int], Any] = {}
    for _, chunk, j in rounds:
        act = plans[chunk][j]
        deps = tuple(handles[(chunk, d)] for d in act.after)
        src, dst = loc(act.src, chunk), loc(act.dst, chunk)
        if act.a == act.b:
            if act.reduce_with is None:
                handles[(chunk, j)] = builder.copy(act.a, src, dst, 1, after=deps)
            else:  # dst already holds the running sum: dst = dst + src
                handles[(chunk, j)] = builder.reduce(act.a, src, dst, 1, after=deps)
            continue
        on_a = tuple(h for d, h in zip(act.after, deps) if _rank_of(plans[chunk][d]) == act.a)
        on_b = tuple(h for d, h in zip(act.after, deps) if _rank_of(plans[chunk][d]) == act.b)
        red = act.reduce_with is not None
        handles[(chunk, j)] = builder.transfer(
            act.a,
            act.b,
            src,
            dst,
            1,
            after=on_a,
            reduce=red,
            reduce_with=loc(act.reduce_with, chunk) if red else None,
            recv_after=on_b,
        )
    return builder


def _rank_of(act: _Action) -> int:
    """Where an action's result lives: the receiver (or the rank of a local op)."""
    return act.b


def predicted_algbw(schedule: Schedule, topo: Any) -> float:
    """Large-message algbw of ``schedule`` on ``topo`` (bytes/s), from the chunks its sends put on each link.

    The bytes of a rank's larger buffer over the time of one period at the
    bottleneck link's rate: ``N * C`` chunks (AllGather, AllToAll,
    ReduceScatter: the nccl-tests convention) or ``C`` (AllReduce) times the
    per-chunk rate ``min_a capacity_a / n_a``. Counts every send op along
    :meth:`~jaxccl.topology.Topology.path`, as the controller's Algorithm 1
    does for schedules without a synthesizer's profile.

    >>> from jaxccl.topology import rail
    >>> from jaxccl.runtime.default_schedules import direct_allreduce
    >>> topo = rail(hosts=2, gpus_per_host=4)
    >>> predicted_algbw(direct_allreduce(8), topo) / 1e9  # 8 blocks of M/8 out of each NIC and 8 back in
    50.0
    """
    loads: dict[Link, float] = {}
    for r, tbs in enumerate(schedule.ranks):
        for tb in tbs:
            for op in tb.ops:
                if op.kind.sends:
                    for e in topo.path(r, tb.send_peer):
                        loads[e] = loads.get(e, 0.0) + op.count
    buffer = schedule.chunks_per_period * (1 if schedule.collective is Collective.ALL_REDUCE else schedule.num_ranks)
    return buffer * _x_min(topo, loads)


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
        TopologyError: fewer than 2 GPUs.
        SynthesisError: ``max_chunks`` is not an integer >= 1.
    """
    del previous
    n = topo.num_gpus
    if n < 2:
        raise TopologyError(f"ordered_reduce_scatter() needs at least 2 GPUs; {topo.name or 'the topology'} has {n}")
    if not isinstance(max_chunks, int) or isinstance(max_chunks, bool) or max_chunks < 1:
        raise SynthesisError(f"max_chunks must be an integer >= 1, got {max_chunks!r}")
    t0 = time.perf_counter()
    best = None
    edges = [(u, v) for u, v, _, _ in topo.edges()]
    caps = np.array([topo.capacity(*e) for e in edges])
    candidates = _candidates(topo, {e: j for j, e in enumerate(edges)})
    for c in range(1, max_chunks + 1):
        routes, load = _plan(topo, c, candidates, caps)
        algbw = n * c * float(np.min(caps[load > 0] / load[load > 0]))
        if best is None or algbw > best[0] * (1 + 1e-9):
            best = (algbw, c, routes, load)
    algbw, c, routes, load = best
    loads = {e: int(k) for e, k in zip(edges, load) if k > 0}
    info = {
        "algorithm": "ordered_fold",
        "ordered_reduction": True,
        "chunk_loads": [(u, v, k) for (u, v), k in sorted(loads.items(), key=str)],
        "synth_ms": (time.perf_counter() - t0) * 1e3,
    }
    schedule = _emit(n, c, routes).build(name="ordered_reduce_scatter", algbw=algbw, info=info)
    return schedule.validate(ordered_reduction=True)
