"""REACT's swap transforms (Sec. 5.3), the position-equivalence check (App. A.3) and degree pruning (Sec. 5.3.2).

All three transforms swap two devices ``x`` and ``y`` in the placement of a
:class:`~jaxccl.tune.react.pattern.Pattern`, at three scopes:

1. ``GLOBAL`` (transform 1, *global permutation swap*): every instance of ``x``
   and ``y`` in the whole TEN -- a permutation of the rank-to-device mapping;
   always semantics-preserving for AllReduce and AllGather.
2. ``CHUNK`` (transform 2, *chunk-local permutation swap*): only inside one
   chunk graph (one tree of the double binary tree, one chunk of the ring);
   semantics-preserving because chunk graphs carry independent data.
3. ``POSITION`` (transform 3, *position-equivalent swap*): only the two vertices
   ``(t, x)`` and ``(t, y)`` of one chunk graph -- the flows into and out of
   them are exchanged. Not always correct: :func:`position_equivalent_swaps`
   finds the pairs that are, by the bitvector check of App. A.3 on every pair.

Only pairs of vertices at the same logical time are considered for transform
3 (the paper says "all pairwise vertices"): exchanging vertices of different
times would not keep one device per position and time.

Degree pruning (Sec. 5.3.2): a transform is viable only if no flow ends up with
a higher degree than before, where a flow's degree is REACT's ``k_f`` (Eq. 1:
the larger of its sender's out-degree and its receiver's in-degree at that
step, over the complete pattern). This is the reading that reproduces the
paper's Fig. 1 example: swapping congested node 3 with node 2 in the even-leaf
tree is viable, with nodes 4 or 12 it is not (their in-degree would double).

Example:
    >>> from jaxccl.tune.react.pattern import double_binary_tree_pattern
    >>> p = double_binary_tree_pattern(16)
    >>> degree_preserving(p, Transform(TransformKind.CHUNK, 3, 2, chunk_graph=1).apply(p))
    True
    >>> degree_preserving(p, Transform(TransformKind.CHUNK, 3, 4, chunk_graph=1).apply(p))
    False
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence

import numpy as np

from jaxccl.errors import ScheduleError
from jaxccl.tune.react.pattern import Pattern
from jaxccl.tune.react.semantics import check_chunk_graph

__all__ = [
    "Candidate",
    "Transform",
    "TransformKind",
    "apply_all",
    "degree_preserving",
    "device_degree",
    "is_valid",
    "position_equivalent_swaps",
    "viable_set",
]


class TransformKind(str, enum.Enum):
    """The three transforms of REACT Sec. 5.3.1, by scope."""

    GLOBAL = "global"
    CHUNK = "chunk"
    POSITION = "position"

    @property
    def priority(self) -> int:
        """REACT prefers transform 3 over 2 over 1 (finer changes first): lower is preferred."""
        return {TransformKind.POSITION: 0, TransformKind.CHUNK: 1, TransformKind.GLOBAL: 2}[self]


@dataclasses.dataclass(frozen=True)
class Transform:
    """Swap devices ``x`` and ``y``: everywhere, in ``chunk_graph``, or at vertex time ``time`` of ``chunk_graph``."""

    kind: TransformKind
    x: int
    y: int
    chunk_graph: int = -1
    time: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", TransformKind(self.kind))
        if self.x == self.y:
            raise ScheduleError(f"a swap needs two different devices, got {self.x} twice")
        if self.kind is not TransformKind.GLOBAL and self.chunk_graph < 0:
            raise ScheduleError(f"a {self.kind.value} swap needs a chunk graph")
        if self.kind is TransformKind.POSITION and self.time < 0:
            raise ScheduleError("a position swap needs a vertex time")

    @property
    def key(self) -> tuple:
        """Identity independent of the order of ``x`` and ``y``."""
        return (self.kind.value, self.chunk_graph, self.time, min(self.x, self.y), max(self.x, self.y))

    def apply(self, pattern: Pattern) -> Pattern:
        """The pattern with the swap applied to its placement (the flows are unchanged)."""
        n = pattern.num_ranks
        if not (0 <= self.x < n and 0 <= self.y < n):
            raise ScheduleError(f"swap {self}: devices must be in 0..{n - 1}")
        if self.chunk_graph >= pattern.num_chunk_graphs:
            raise ScheduleError(f"swap {self}: the pattern has {pattern.num_chunk_graphs} chunk graphs")
        if self.time > pattern.num_steps:
            raise ScheduleError(f"swap {self}: vertex times are 0..{pattern.num_steps}")
        new = pattern.placement.copy()
        if self.kind is TransformKind.GLOBAL:
            view = new
        elif self.kind is TransformKind.CHUNK:
            view = new[self.chunk_graph]
        else:
            view = new[self.chunk_graph, self.time]
        ax, ay = view == self.x, view == self.y
        view[ax] = self.y
        view[ay] = self.x
        return pattern.with_placement(new)

    def __str__(self) -> str:
        where = {
            TransformKind.GLOBAL: "everywhere",
            TransformKind.CHUNK: f"in chunk graph {self.chunk_graph}",
            TransformKind.POSITION: f"at time {self.time} of chunk graph {self.chunk_graph}",
        }[self.kind]
        return f"swap {self.x}<->{self.y} {where}"

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "x": self.x, "y": self.y, "chunk_graph": self.chunk_graph, "time": self.time}


def apply_all(pattern: Pattern, transforms: Iterable[Transform]) -> Pattern:
    """Applies ``transforms`` in order."""
    for t in transforms:
        pattern = t.apply(pattern)
    return pattern


# ----------------------------------------------------------------------------- checks
def is_valid(pattern: Pattern, graphs: Iterable[int] | None = None) -> bool:
    """The bitvector check (App. A.3) of ``graphs`` (default: every chunk graph)."""
    gs = range(pattern.num_chunk_graphs) if graphs is None else graphs
    return all(not check_chunk_graph(pattern, g) for g in gs)


def degree_preserving(before: Pattern, after: Pattern) -> bool:
    """Degree pruning of Sec. 5.3.2: no flow's degree ``k_f`` grows from ``before`` to ``after``."""
    return bool((after.flow_degree <= before.flow_degree).all())


def device_degree(pattern: Pattern, device: int, directions: str = "both") -> int:
    """Number of flows ``device`` receives (``"in"``), sends (``"out"``) or both, over the whole pattern."""
    return int(pattern.incident_flows(device, directions).size)


def _vertex_devices(pattern: Pattern, graph: int, time: int) -> set[int]:
    """Devices with a flow into or out of vertex time ``time`` of chunk graph ``graph``."""
    idx = pattern.graph_flows(graph)
    steps = pattern.steps[idx]
    out = set(pattern.src_device[idx[steps == time]].tolist())
    out.update(pattern.dst_device[idx[steps == time - 1]].tolist())
    return out


def position_equivalent_swaps(
    pattern: Pattern, *, chunk_graph: int | None = None, time: int | None = None, device: int | None = None
) -> list[Transform]:
    """All position-equivalent swaps of App. A.3: same-time vertex pairs whose exchange passes the bitvector check.

    Every pair of vertices ``(t, x)``, ``(t, y)`` of a chunk graph, at least one
    of which has a flow, is exchanged and the chunk graph re-run on one-hot
    bitvectors: ``O(|V|^2 (|V| + |E|))`` in all, as in the paper. ``chunk_graph``,
    ``time`` and ``device`` (one of the pair) narrow the search.

    >>> from jaxccl.tune.react.pattern import double_binary_tree_pattern
    >>> p = double_binary_tree_pattern(8)
    >>> sorted((s.x, s.y) for s in position_equivalent_swaps(p, chunk_graph=0, time=0))[:3]
    [(1, 3), (1, 5), (1, 7)]
    """
    n = pattern.num_ranks
    graphs = range(pattern.num_chunk_graphs) if chunk_graph is None else [chunk_graph]
    out = []
    for g in graphs:
        times = range(pattern.num_steps + 1) if time is None else [time]
        for t in times:
            active = _vertex_devices(pattern, g, t)
            if not active:
                continue
            xs = [device] if device is not None else range(n)
            for x in xs:
                for y in range(n):
                    if y == x or (device is None and y < x) or (x not in active and y not in active):
                        continue
                    tr = Transform(TransformKind.POSITION, x, y, chunk_graph=g, time=t)
                    row = pattern.placement[g].copy()
                    ax, ay = row[t] == x, row[t] == y
                    row[t][ax], row[t][ay] = y, x
                    if not check_chunk_graph(pattern, g, row):
                        out.append(tr)
    return out


# ------------------------------------------------------------------------- viable set
@dataclasses.dataclass(frozen=True)
class Candidate:
    """A viable transform for a congested device and its priority tier (0 = tried first).

    ``reduces_degree``: the congested device ends with fewer flows in its
    congested direction(s) (the paper's green nodes, Fig. 1).
    """

    transform: Transform
    pattern: Pattern
    reduces_degree: bool
    tier: int


def viable_set(
    pattern: Pattern,
    x: int,
    *,
    congested_flows: Sequence[int] | np.ndarray,
    exclude: Iterable[int] = (),
    blocked: Iterable[tuple] = (),
    kinds: Iterable[TransformKind] = tuple(TransformKind),
) -> list[Candidate]:
    """Alg. 1's ``ViableSet(x, G)``: the safe, degree-pruned transforms that move congested device ``x``.

    Candidates: position swaps of ``x`` at the vertices of its congested flows
    (checked with the bitvectors), chunk-local swaps in the chunk graphs of its
    congested flows, and global swaps; partners ``y`` are all other devices
    but ``exclude`` (REACT removes steady-congested devices it already moved).
    Each candidate must pass the degree pruning. Tiers (Sec. 5.3.2 and
    5.3.1): degree-reducing candidates first, then the others; within each,
    transform 3 before 2 before 1.

    Args:
        pattern: the current pattern.
        x: the congested device.
        congested_flows: indices of the flows detected congested.
        exclude: devices not to swap ``x`` with.
        blocked: :attr:`Transform.key` values not to propose again.
        kinds: the transform kinds to consider.

    Returns:
        Candidates sorted by tier (then by transform, for determinism).
    """
    n = pattern.num_ranks
    kinds = set(TransformKind(k) for k in kinds)
    blocked = set(blocked)
    exclude = set(exclude) | {x}
    cong = np.asarray(list(congested_flows), dtype=np.int64)
    mine_in = cong[pattern.dst_device[cong] == x] if cong.size else cong
    mine_out = cong[pattern.src_device[cong] == x] if cong.size else cong
    directions = "both" if mine_in.size and mine_out.size else ("in" if mine_in.size else "out")
    vertices = {(int(pattern.chunk_graphs[f]), int(pattern.steps[f]) + 1) for f in mine_in.tolist()}
    vertices |= {(int(pattern.chunk_graphs[f]), int(pattern.steps[f])) for f in mine_out.tolist()}
    graphs = sorted({g for g, _ in vertices})
    proposals: list[Transform] = []
    partners = [y for y in range(n) if y not in exclude]
    if TransformKind.POSITION in kinds:
        for g, t in sorted(vertices):
            proposals += [Transform(TransformKind.POSITION, x, y, chunk_graph=g, time=t) for y in partners]
    if TransformKind.CHUNK in kinds and pattern.num_chunk_graphs > 1:
        for g in graphs:
            proposals += [Transform(TransformKind.CHUNK, x, y, chunk_graph=g) for y in partners]
    if TransformKind.GLOBAL in kinds:
        proposals += [Transform(TransformKind.GLOBAL, x, y) for y in partners]
    before = device_degree(pattern, x, directions)
    out = []
    for tr in proposals:
        if tr.key in blocked:
            continue
        new = tr.apply(pattern)
        graphs_touched = range(pattern.num_chunk_graphs) if tr.kind is TransformKind.GLOBAL else [tr.chunk_graph]
        if not is_valid(new, graphs_touched) or not degree_preserving(pattern, new):
            continue
        green = device_degree(new, x, directions) < before
        tier = (0 if green else 3) + tr.kind.priority
        out.append(Candidate(tr, new, green, tier))
    out.sort(key=lambda c: (c.tier, c.transform.key))
    return out
