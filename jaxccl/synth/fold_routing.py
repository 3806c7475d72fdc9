"""What the fold synthesizers of ReduceScatter share: folds as actions, their greedy routing, the schedule.

Internal to :mod:`jaxccl.synth.ordered_reduce_scatter` and
:mod:`jaxccl.synth.tree_reduce_scatter`. A synthesizer of this kind fixes the
order of the additions (a rank-ordered fold, gloo's tree) and varies only
*where* each addition happens and which GPUs relay the result, so every
candidate computes the same sum. It describes each candidate for one chunk of
a block as a list of :class:`Action`; :func:`synthesize` counts the chunks
each candidate puts on every link (:meth:`~jaxccl.topology.Topology.path`),
places the sub-chunks of every block greedily (:func:`plan`) for 1 to
``max_chunks`` sub-chunks per block, keeps the count with the highest
predicted algbw and emits the schedule (:func:`emit`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from jaxccl.errors import SynthesisError, TopologyError
from jaxccl.schedule.builder import ScheduleBuilder
from jaxccl.schedule.ir import Buffer, Collective, Schedule

__all__ = [
    "DEFAULT_MAX_CHUNKS",
    "EXHAUSTIVE",
    "Action",
    "check_arguments",
    "emit",
    "plan",
    "predicted_algbw",
    "relay",
    "routes_from",
    "synthesize",
]

DEFAULT_MAX_CHUNKS = 4
EXHAUSTIVE = 1024  # candidates per root (times the GPUs of its host) enumerated in full; more are restricted
Link = tuple[Any, Any]


@dataclasses.dataclass(frozen=True)
class Action:
    """One op pair of a chunk's fold: a transfer ``a -> b`` (``a == b``: a local op on ``a``).

    Locations are ``"in"`` (the chunk of the input), ``"out"`` (its place in
    the output) or ``("s", rank, visit)`` (a scratch copy). ``reduce_with``
    set: the receiver (or the local op) stores ``reduce_with + value``; a
    local op with ``reduce_with == dst`` is ``dst = dst + src``.
    ``after`` are indices of earlier actions of the chunk this one waits for.
    """

    a: int
    b: int
    src: Any
    dst: Any
    reduce_with: Any = None
    after: tuple[int, ...] = ()


class ScratchCopies:
    """Hands out one chunk's scratch locations: ``scratch(rank)`` is a fresh ``("s", rank, visit)``."""

    def __init__(self) -> None:
        self._visits: dict[int, int] = {}

    def __call__(self, rank: int) -> tuple[str, int, int]:
        v = self._visits.get(rank, 0)
        self._visits[rank] = v + 1
        return ("s", rank, v)


def relay(acts: list[Action], hops: tuple[int, ...], src: Any, idx: int | None, scratch: ScratchCopies) -> None:
    """Appends the transfers of a finished sum at ``src`` on ``hops[0]`` (made by action ``idx``) along ``hops``.

    Every hop but the last receives into a scratch copy; the last, the owner, into its output.
    """
    for x, y in zip(hops[:-1], hops[1:]):
        dst = "out" if y == hops[-1] else scratch(y)
        acts.append(Action(x, y, src, dst, None, (idx,)))
        src, idx = dst, len(acts) - 1


def routes_from(topo: Any, g: int, root: int) -> list[tuple[int, ...]]:
    """The routes of a finished sum from ``g`` to ``root``: direct, or through one GPU of the root's host.

    Each route lists the GPUs after ``g``; ``[()]`` when ``g`` is the root.
    """
    if g == root:
        return [()]
    if topo.host_of(g) == topo.host_of(root):
        return [(root,)]
    return [(root,)] + [(h, root) for h in topo.hosts[topo.host_of(root)] if h != root]


def loads_of(topo: Any, acts: list[Action], paths: dict[tuple[int, int], tuple[Link, ...]]) -> dict[Link, int]:
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


@dataclasses.dataclass(frozen=True)
class Candidates:
    """The candidate folds of one root's chunks and the chunks each puts on every link (a row per fold)."""

    folds: list[list[Action]]
    loads: np.ndarray  # [folds, links]
    size: np.ndarray  # actions per fold


def candidates(
    topo: Any, links: dict[Link, int], folds_of: Callable[[int], Iterable[list[Action]]]
) -> dict[int, Candidates]:
    """Per root, every candidate fold of one of its chunks (``links``: the column of each link)."""
    paths: dict[tuple[int, int], tuple[Link, ...]] = {}
    out: dict[int, Candidates] = {}
    for root in range(topo.num_gpus):
        folds = list(folds_of(root))
        loads = np.zeros((len(folds), len(links)))
        for row, acts in enumerate(folds):
            for e, k in loads_of(topo, acts, paths).items():
                loads[row, links[e]] = k
        out[root] = Candidates(folds, loads, np.array([len(a) for a in folds]))
    return out


def plan(topo: Any, c: int, cands: dict[int, Candidates], caps: np.ndarray) -> tuple[dict, np.ndarray]:
    """The fold of every sub-chunk (keyed by input chunk ``root * c + i``) and the links' chunk loads.

    Sub-chunks are placed one after the other; each takes the candidate
    whose most loaded link, relative to its capacity, stays the least loaded
    (then the smallest sum of those ratios, then the fewest actions).
    """
    loads = np.zeros(len(caps))
    plans: dict[int, list[Action]] = {}
    for i, root in itertools.product(range(c), range(topo.num_gpus)):
        cand = cands[root]
        ratios = np.where(cand.loads > 0, (loads + cand.loads) / caps, 0.0)
        best = np.lexsort((cand.size, ratios.sum(axis=1), ratios.max(axis=1)))[0]
        plans[root * c + i] = cand.folds[best]
        loads += cand.loads[best]
    return plans, loads


def x_min(topo: Any, loads: Mapping[Link, float]) -> float:
    """The per-chunk rate of the bottleneck link: ``min_a capacity_a / n_a`` over the loaded links."""
    return min(topo.capacity(*e) / k for e, k in loads.items() if k > 0)


def emit(n: int, c: int, plans: dict[int, list[Action]]) -> ScheduleBuilder:
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


def _rank_of(act: Action) -> int:
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
    return buffer * x_min(topo, loads)


def check_arguments(name: str, topo: Any, max_chunks: Any) -> None:
    """Raises :class:`TopologyError` for fewer than 2 GPUs, :class:`SynthesisError` for a bad ``max_chunks``."""
    n = topo.num_gpus
    if n < 2:
        raise TopologyError(f"{name}() needs at least 2 GPUs; {topo.name or 'the topology'} has {n}")
    if not isinstance(max_chunks, int) or isinstance(max_chunks, bool) or max_chunks < 1:
        raise SynthesisError(f"max_chunks must be an integer >= 1, got {max_chunks!r}")


def synthesize(
    topo: Any,
    name: str,
    folds_of: Callable[[int], Iterable[list[Action]]],
    info: dict[str, Any],
    max_chunks: int,
) -> Schedule:
    """The schedule of the best greedy placement of ``folds_of(root)``'s candidates, 1 to ``max_chunks`` sub-chunks.

    The count of sub-chunks per block with the highest predicted algbw wins
    (the smallest on ties). The schedule (not yet validated) is named
    ``name`` and carries its predicted ``algbw`` and ``info`` followed by
    ``chunk_loads`` (the chunks per period on each link) and ``synth_ms``.
    """
    check_arguments(name, topo, max_chunks)
    n = topo.num_gpus
    t0 = time.perf_counter()
    best = None
    edges = [(u, v) for u, v, _, _ in topo.edges()]
    caps = np.array([topo.capacity(*e) for e in edges])
    cands = candidates(topo, {e: j for j, e in enumerate(edges)}, folds_of)
    for c in range(1, max_chunks + 1):
        routes, load = plan(topo, c, cands, caps)
        algbw = n * c * float(np.min(caps[load > 0] / load[load > 0]))
        if best is None or algbw > best[0] * (1 + 1e-9):
            best = (algbw, c, routes, load)
    algbw, c, routes, load = best
    loads = {e: int(k) for e, k in zip(edges, load) if k > 0}
    info = {
        **info,
        "chunk_loads": [(u, v, k) for (u, v), k in sorted(loads.items(), key=str)],
        "synth_ms": (time.perf_counter() - t0) * 1e3,
    }
    return emit(n, c, routes).build(name=name, algbw=algbw, info=info)
