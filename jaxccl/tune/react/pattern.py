"""Collective patterns as time-expanded networks (REACT Sec. 5.1, App. A.1).

A *pattern* is REACT's TEN graph: vertex ``(t, r)`` is position ``r`` at logical
step ``t`` and every flow is an edge ``(t, src) -> (t + 1, dst)``. The flows of
one *chunk graph* carry one independent piece of the data (one tree of the
double binary tree, one chunk of the ring, the single graph of recursive
doubling). Every flow has a kind that says what its receiver does with it:

- ``REDUCE``: adds the message to what it holds (reduction phase);
- ``COPY``: replaces what it holds by the message (broadcast / all-gather phase
  of an AllReduce);
- ``GATHER``: adds the message's blocks to the blocks it holds (AllGather).

The flows are fixed; which *device* plays each position is the
``placement[g, t, r]`` array (chunk graph ``g``, vertex time ``t``, position
``r``), the identity for an untransformed pattern. REACT's three transforms
(:mod:`jaxccl.tune.react.transforms`) only change the placement: a global
permutation relabels devices everywhere, a chunk-local one inside one chunk
graph, a position-equivalent swap at one vertex time of one chunk graph. A
flow at step ``t`` goes from device ``placement[g, t, src]`` to device
``placement[g, t + 1, dst]``.

Every device keeps its data between steps (the TEN's implicit hold edges): a
flow of step ``t`` carries what its sender holds at time ``t`` (after the
flows of step ``t - 1`` arrived, before those of step ``t`` do). That is the
semantics :mod:`jaxccl.tune.react.semantics` checks with bitvectors (App. A.3)
and :mod:`jaxccl.tune.react.compile` turns into a :class:`~jaxccl.schedule.Schedule`.

The constructors read the trees and ring orders of jaxccl's own baselines
(:mod:`jaxccl.synth.baselines`), so an untransformed pattern has exactly the
messages of the corresponding baseline schedule.

Example:
    >>> p = double_binary_tree_pattern(16)
    >>> p.num_chunk_graphs, p.num_flows, p.num_steps
    (2, 60, 8)
    >>> sorted(g.src for g in p.flows if g.chunk_graph == 1 and g.dst == 3 and g.kind is FlowKind.REDUCE)
    [1, 5]
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxccl.errors import ScheduleError
from jaxccl.schedule.ir import Collective
from jaxccl.synth import baselines

__all__ = [
    "Flow",
    "FlowKind",
    "Pattern",
    "double_binary_tree_pattern",
    "pattern_for",
    "recursive_doubling_pattern",
    "ring_allreduce_pattern",
]


class FlowKind(str, enum.Enum):
    """What the receiver of a flow does with the message (see the module docstring)."""

    REDUCE = "reduce"
    COPY = "copy"
    GATHER = "gather"


@dataclasses.dataclass(frozen=True)
class Flow:
    """One edge of the TEN: at step ``step`` position ``src`` sends to position ``dst`` in ``chunk_graph``."""

    index: int
    chunk_graph: int
    step: int
    src: int
    dst: int
    kind: FlowKind


_DERIVED = frozenset({"placement", "src_device", "dst_device", "out_degree", "in_degree", "flow_degree", "semantics"})


class Pattern:
    """A collective pattern (TEN) with a placement of devices on its positions.

    Attributes:
        collective: ``ALL_REDUCE`` or ``ALL_GATHER``.
        num_ranks: ``N``, positions and devices ``0..N-1``.
        flows: the TEN's edges, sorted by step (their ``index`` is their position).
        num_chunk_graphs: ``G``; for an AllReduce chunk graph ``g`` reduces data
            chunk ``g`` (``G`` chunks per period), for an AllGather ``G = 1``.
        channels: the schedule channel of each chunk graph's transfers.
        placement: int array ``[G, T + 1, N]``: the device at each position.
        name: the pattern's name (``"double_binary_tree"``, ``"ring"``, ...).
        info: what the constructor knew (trees, ring order); JSON-friendly.
    """

    def __init__(
        self,
        collective: Collective | str,
        num_ranks: int,
        flows: Sequence[Flow],
        *,
        num_chunk_graphs: int,
        channels: Sequence[int] | None = None,
        placement: np.ndarray | None = None,
        name: str = "",
        info: Mapping[str, Any] | None = None,
    ):
        self.collective = Collective(collective)
        if self.collective not in (Collective.ALL_REDUCE, Collective.ALL_GATHER):
            raise ScheduleError(f"REACT patterns are AllReduce or AllGather, not {self.collective.value}")
        self.num_ranks = int(num_ranks)
        if self.num_ranks < 2:
            raise ScheduleError(f"a pattern needs at least 2 ranks, got {num_ranks}")
        order = sorted(flows, key=lambda f: (f.step, f.chunk_graph, f.index))
        self.flows = tuple(dataclasses.replace(f, index=i) for i, f in enumerate(order))
        self.num_chunk_graphs = int(num_chunk_graphs)
        self.num_steps = 1 + max(f.step for f in self.flows)
        self.channels = tuple(int(c) for c in (channels if channels is not None else [0] * self.num_chunk_graphs))
        if len(self.channels) != self.num_chunk_graphs:
            raise ScheduleError(f"{len(self.channels)} channels for {self.num_chunk_graphs} chunk graphs")
        n, g, t = self.num_ranks, self.num_chunk_graphs, self.num_steps
        for f in self.flows:
            if not (0 <= f.chunk_graph < g and 0 <= f.src < n and 0 <= f.dst < n and f.src != f.dst and f.step >= 0):
                raise ScheduleError(f"malformed flow {f}")
            want = FlowKind.GATHER if self.collective is Collective.ALL_GATHER else None
            if (want is None) == (f.kind is FlowKind.GATHER):
                raise ScheduleError(f"flow kind {f.kind.value} does not fit a {self.collective.value} pattern")
        if placement is None:
            placement = np.broadcast_to(np.arange(n, dtype=np.int32), (g, t + 1, n)).copy()
        placement = np.asarray(placement, dtype=np.int32)
        if placement.shape != (g, t + 1, n):
            raise ScheduleError(f"placement has shape {placement.shape}, expected {(g, t + 1, n)}")
        if not (np.sort(placement, axis=-1) == np.arange(n)).all():
            raise ScheduleError("placement must be a permutation of the devices at every (chunk graph, time)")
        placement.setflags(write=False)
        self.placement = placement
        self.name = name
        self.info = dict(info or {})
        self._graph = np.fromiter((f.chunk_graph for f in self.flows), np.int64, len(self.flows))
        self._step = np.fromiter((f.step for f in self.flows), np.int64, len(self.flows))
        self._src = np.fromiter((f.src for f in self.flows), np.int64, len(self.flows))
        self._dst = np.fromiter((f.dst for f in self.flows), np.int64, len(self.flows))
        self._graph_index = [np.flatnonzero(self._graph == c) for c in range(g)]

    # ------------------------------------------------------------------ basics
    @property
    def num_flows(self) -> int:
        return len(self.flows)

    @property
    def chunks_per_period(self) -> int:
        """``C`` of the compiled schedule: one chunk per chunk graph (AllReduce), 1 (AllGather)."""
        return self.num_chunk_graphs if self.collective is Collective.ALL_REDUCE else 1

    def with_placement(self, placement: np.ndarray) -> Pattern:
        """The same TEN with another placement (what every transform returns); the flows are shared."""
        placement = np.asarray(placement, dtype=np.int32)
        if placement.shape != self.placement.shape:
            raise ScheduleError(f"placement has shape {placement.shape}, expected {self.placement.shape}")
        if not (np.sort(placement, axis=-1) == np.arange(self.num_ranks)).all():
            raise ScheduleError("placement must be a permutation of the devices at every (chunk graph, time)")
        placement.setflags(write=False)
        new = object.__new__(Pattern)
        new.__dict__.update(
            {k: v for k, v in self.__dict__.items() if k not in _DERIVED}
        )  # flows and their index arrays are immutable: share them
        new.placement = placement
        return new

    def is_identity(self) -> bool:
        return bool((self.placement == np.arange(self.num_ranks)).all())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pattern):
            return NotImplemented
        return (
            self.collective == other.collective
            and self.flows == other.flows
            and self.channels == other.channels
            and np.array_equal(self.placement, other.placement)
        )

    def __hash__(self) -> int:
        return hash((self.collective, self.flows, self.placement.tobytes()))

    def __repr__(self) -> str:
        moved = "identity" if self.is_identity() else "transformed"
        return (
            f"Pattern({self.name or self.collective.value}, N={self.num_ranks}, {self.num_chunk_graphs} chunk graphs, "
            f"{self.num_flows} flows, {self.num_steps} steps, {moved})"
        )

    # ---------------------------------------------------------------- devices
    @functools.cached_property
    def src_device(self) -> np.ndarray:
        """Device sending each flow (``placement[g, t, src]``)."""
        return self.placement[self._graph, self._step, self._src]

    @functools.cached_property
    def dst_device(self) -> np.ndarray:
        """Device receiving each flow (``placement[g, t + 1, dst]``)."""
        return self.placement[self._graph, self._step + 1, self._dst]

    @property
    def steps(self) -> np.ndarray:
        return self._step

    @property
    def chunk_graphs(self) -> np.ndarray:
        return self._graph

    @property
    def src_position(self) -> np.ndarray:
        return self._src

    @property
    def dst_position(self) -> np.ndarray:
        return self._dst

    def graph_flows(self, graph: int) -> np.ndarray:
        """Indices of the flows of chunk graph ``graph``, by step."""
        return self._graph_index[graph]

    def flow_devices(self, index: int) -> tuple[int, int]:
        """``(sending device, receiving device)`` of flow ``index``."""
        return int(self.src_device[index]), int(self.dst_device[index])

    # ---------------------------------------------------------------- degrees
    @functools.cached_property
    def out_degree(self) -> np.ndarray:
        """``[T + 1, N]``: flows each device sends at each step, over the complete pattern."""
        t1, n = self.num_steps + 1, self.num_ranks
        return np.bincount(self._step * n + self.src_device, minlength=t1 * n).reshape(t1, n)

    @functools.cached_property
    def in_degree(self) -> np.ndarray:
        """``[T + 1, N]``: flows arriving at each device at each vertex time, over the complete pattern."""
        t1, n = self.num_steps + 1, self.num_ranks
        return np.bincount((self._step + 1) * n + self.dst_device, minlength=t1 * n).reshape(t1, n)

    @functools.cached_property
    def flow_degree(self) -> np.ndarray:
        """``k_f`` of REACT Eq. 1: the larger of the sender's out-degree and the receiver's in-degree."""
        out = self.out_degree[self._step, self.src_device]
        inn = self.in_degree[self._step + 1, self.dst_device]
        return np.maximum(out, inn)

    def incident_flows(self, device: int, direction: str = "both") -> np.ndarray:
        """Indices of the flows ``device`` receives (``"in"``), sends (``"out"``) or either (``"both"``)."""
        mask = np.zeros(self.num_flows, dtype=bool)
        if direction in ("in", "both"):
            mask |= self.dst_device == device
        if direction in ("out", "both"):
            mask |= self.src_device == device
        return np.flatnonzero(mask)

    # -------------------------------------------------------------- semantics
    @functools.cached_property
    def semantics(self) -> Any:
        """The bitvector run of App. A.3 (:class:`jaxccl.tune.react.semantics.Semantics`)."""
        from jaxccl.tune.react.semantics import simulate  # cycle: semantics imports pattern

        return simulate(self)

    @property
    def flow_size(self) -> np.ndarray:
        """Chunks each flow carries (AllReduce: 1; AllGather: the blocks new to its receiver)."""
        return self.semantics.size

    def to_schedule(self) -> Any:
        """The pattern as a :class:`~jaxccl.schedule.Schedule` (see :mod:`jaxccl.tune.react.compile`)."""
        from jaxccl.tune.react.compile import compile_pattern  # cycle: compile imports pattern

        return compile_pattern(self).schedule

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly description (flows and placement)."""
        return {
            "name": self.name,
            "collective": self.collective.value,
            "num_ranks": self.num_ranks,
            "num_chunk_graphs": self.num_chunk_graphs,
            "channels": list(self.channels),
            "flows": [[f.chunk_graph, f.step, f.src, f.dst, f.kind.value] for f in self.flows],
            "placement": self.placement.tolist(),
            "info": self.info,
        }


# --------------------------------------------------------------------------- constructors
def _num_ranks(n_or_topo: Any) -> int:
    n = n_or_topo if isinstance(n_or_topo, int) and not isinstance(n_or_topo, bool) else None
    if n is None:
        n = getattr(n_or_topo, "num_gpus", None)
    if not isinstance(n, int) or n < 2:
        raise ScheduleError(f"a REACT pattern needs a rank count >= 2 or a Topology, got {n_or_topo!r}")
    return n


def _tree_flows(tree: Mapping[int, tuple[int, list[int]]], graph: int) -> list[Flow]:
    """Reduce up ``tree`` ASAP (a node sends at its height), then broadcast down level by level."""
    height: dict[int, int] = {}

    def h(r: int) -> int:
        if r not in height:
            kids = tree[r][1]
            height[r] = 0 if not kids else 1 + max(h(c) for c in kids)
        return height[r]

    root = next(r for r, (parent, _) in tree.items() if parent < 0)
    top = h(root)
    flows = [Flow(0, graph, h(r), r, parent, FlowKind.REDUCE) for r, (parent, _) in tree.items() if parent >= 0]
    stack = [(root, top)]
    while stack:
        r, t = stack.pop()
        for c in tree[r][1]:
            flows.append(Flow(0, graph, t, r, c, FlowKind.COPY))
            stack.append((c, t + 1))
    return flows


def _tree_from_info(info: Mapping[str, Any]) -> dict[int, tuple[int, list[int]]]:
    return {int(r): (int(p), [int(c) for c in ch]) for r, (p, ch) in info.items()}


def double_binary_tree_pattern(n_or_topo: Any, *, order: Sequence[int] | None = None) -> Pattern:
    """NCCL's double binary tree AllReduce (Fig. 2 of REACT) as a TEN: two chunk graphs, one per tree.

    The trees are those of :func:`jaxccl.synth.baselines.double_binary_tree_allreduce`
    (same ``order`` argument); chunk ``t`` goes over tree ``t`` on channel ``t``.
    A node sends its partial sum up at the step equal to its height (as soon
    as its children's partials can be there), the root broadcasts at the
    tree's height, and each level forwards one step later.

    >>> double_binary_tree_pattern(8).num_steps
    6
    """
    n = _num_ranks(n_or_topo)
    base = baselines.double_binary_tree_allreduce(n_or_topo, order=order)
    trees = [_tree_from_info(t) for t in base.info["trees"]]
    flows = [f for g, tree in enumerate(trees) for f in _tree_flows(tree, g)]
    info = {"algorithm": "double_tree", "trees": base.info["trees"], "order": base.info["order"]}
    return Pattern(
        Collective.ALL_REDUCE, n, flows, num_chunk_graphs=2, channels=[0, 1], name="double_binary_tree", info=info
    )


def ring_allreduce_pattern(n_or_topo: Any, *, order: Sequence[int] | None = None) -> Pattern:
    """Ring AllReduce (App. A.1, Fig. 9a) as a TEN: ``N`` chunk graphs, one per chunk.

    The chunk owned by ring position ``q`` (data chunk ``ring[q]``, as in
    :func:`jaxccl.synth.baselines.ring_allreduce`) is reduced from position
    ``q + 1`` around the ring in ``N - 1`` steps, then copied on around the
    ring in ``N - 1`` more. All chunk graphs share channel 0 (one ring).

    >>> p = ring_allreduce_pattern(4)
    >>> p.num_chunk_graphs, p.num_flows, p.num_steps
    (4, 24, 6)
    """
    n = _num_ranks(n_or_topo)
    base = baselines.ring_allreduce(n_or_topo, order=order)
    ring = [int(r) for r in base.info["order"]]
    flows = []
    for q in range(n):
        g = ring[q]
        for s in range(n - 1):
            flows.append(Flow(0, g, s, ring[(q + 1 + s) % n], ring[(q + 2 + s) % n], FlowKind.REDUCE))
        for s in range(n - 1):
            flows.append(Flow(0, g, n - 1 + s, ring[(q + s) % n], ring[(q + s + 1) % n], FlowKind.COPY))
    info = {"algorithm": "ring", "order": ring}
    return Pattern(Collective.ALL_REDUCE, n, flows, num_chunk_graphs=n, channels=[0] * n, name="ring", info=info)


def recursive_doubling_pattern(n_or_topo: Any) -> Pattern:
    """Recursive-doubling AllGather (App. A.1, Fig. 9b): at step ``j`` rank ``r`` sends all it holds to ``r ^ 2**j``.

    One chunk graph; ``N`` must be a power of two (as for
    :func:`jaxccl.synth.baselines.recursive_doubling_allgather`).

    >>> recursive_doubling_pattern(8).flow_size.tolist()[::8]
    [1, 2, 4]
    """
    n = _num_ranks(n_or_topo)
    if n & (n - 1):
        raise ScheduleError(f"recursive doubling needs a power-of-two number of ranks, got N={n}")
    flows = [Flow(0, 0, j, r, r ^ (1 << j), FlowKind.GATHER) for j in range(n.bit_length() - 1) for r in range(n)]
    info = {"algorithm": "recursive_doubling"}
    return Pattern(
        Collective.ALL_GATHER, n, flows, num_chunk_graphs=1, channels=[0], name="recursive_doubling", info=info
    )


_BY_NAME = {
    "double_binary_tree": double_binary_tree_pattern,
    "tree": double_binary_tree_pattern,
    "ring": ring_allreduce_pattern,
    "recursive_doubling": recursive_doubling_pattern,
}


def pattern_for(name: str, n_or_topo: Any, **kwargs: Any) -> Pattern:
    """The pattern called ``name`` (``"double_binary_tree"``/``"tree"``, ``"ring"``, ``"recursive_doubling"``)."""
    try:
        fn = _BY_NAME[name]
    except KeyError:
        raise ScheduleError(f"unknown REACT pattern {name!r}; expected one of {sorted(_BY_NAME)}") from None
    return fn(n_or_topo, **kwargs)
