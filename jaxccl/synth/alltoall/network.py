"""The topology as flat numpy arrays, the form every AllToAll solver stage works on.

Nodes are numbered GPUs first (node ``r`` is rank ``r``), then the switches and
NICs in name order; arcs are the directed links, sorted by (tail, head).
Capacities are divided by ``unit`` (the largest capacity) so that the LPs see
numbers of order one; every rate the solvers return is in those units until
:mod:`jaxccl.synth.alltoall` multiplies it back.

The time-expanded DAG of MCCL Sec. 4.2 never exists as a graph here: an arc
``(u, v)`` into a switch is "instantaneous" (it stays in the step of ``u``)
and every other arc "advances" one step (:attr:`Network.advances`). The
pricing sweeps the steps with these arrays (:mod:`.pricing`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxccl.errors import TopologyError
from jaxccl.topology import Topology


@dataclasses.dataclass(frozen=True)
class HeadGroup:
    """Heads of the same kind and padded in-degree, for vectorized relaxation.

    Attributes:
        heads: ``(h,)`` node indices.
        arcs: ``(h, deg)`` incoming arc indices; padding is ``num_arcs``, a
            virtual arc from the virtual node ``num_nodes`` (distance ``inf``).
    """

    heads: np.ndarray
    arcs: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Network:
    """Flat arrays of a :class:`~jaxccl.topology.Topology`.

    Attributes:
        topo: the topology.
        nodes: node names in index order (ints for GPUs, strings otherwise).
        num_gpus: ``N``; nodes ``0..N-1`` are the GPUs.
        tail, head: ``(A,)`` arc endpoints (node indices).
        capacity: ``(A,)`` capacities in units of :attr:`unit`.
        unit: bytes/s of one capacity unit (the largest link capacity).
        advances: ``(A,)`` bool, the arc enters a GPU (advances one step).
        gpu_groups, switch_groups: incoming arcs of GPU / switch heads, by degree.
    """

    topo: Topology
    nodes: tuple
    num_gpus: int
    tail: np.ndarray
    head: np.ndarray
    capacity: np.ndarray
    unit: float
    advances: np.ndarray
    gpu_groups: tuple[HeadGroup, ...]
    switch_groups: tuple[HeadGroup, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def num_arcs(self) -> int:
        return int(self.tail.shape[0])

    @property
    def default_steps(self) -> int:
        """MCCL's step bound ``m_s = |V| - 1``, raised to ``N`` on switchless topologies.

        Deviation: ``G~`` has ``m_s`` copies of each node, so a path has at most
        ``m_s - 1`` advancing arcs, each entering a different GPU. ``|V| - 1``
        admits every simple path as soon as there is one switch (then
        ``N <= |V| - 1``); on a topology of GPUs only (e.g. a unidirectional
        ring) it would cut off the ``N - 1``-hop paths, so the bound is ``N``.
        """
        return max(self.num_nodes - 1, self.num_gpus)

    @functools.cached_property
    def index(self) -> dict:
        """Node name -> index."""
        return {n: i for i, n in enumerate(self.nodes)}

    @functools.cached_property
    def arc_index(self) -> dict[tuple[int, int], int]:
        """``(tail index, head index)`` -> arc index."""
        return {(int(u), int(v)): a for a, (u, v) in enumerate(zip(self.tail, self.head))}

    @functools.cached_property
    def tail_ext(self) -> np.ndarray:
        """``tail`` with the virtual padding arc appended (tail = virtual node)."""
        return np.append(self.tail, self.num_nodes).astype(np.int64)

    @functools.cached_property
    def arc_matrix(self) -> np.ndarray:
        """``(V, V)`` arc index of each node pair (-1: no link)."""
        mat = np.full((self.num_nodes, self.num_nodes), -1, dtype=np.int64)
        mat[self.tail, self.head] = np.arange(self.num_arcs)
        return mat

    @functools.cached_property
    def _csr_patterns(self) -> tuple:
        """CSR ``(indptr, indices, arc order)`` of the graph and of the reversed graph."""
        v = self.num_nodes
        fwd = (np.searchsorted(self.tail, np.arange(v + 1)), self.head.astype(np.int32), None)
        order = np.lexsort((self.tail, self.head))
        rev = (np.searchsorted(self.head[order], np.arange(v + 1)), self.tail[order].astype(np.int32), order)
        return fwd, rev

    def csr(self, weights: np.ndarray, *, reverse: bool = False):
        """The graph (or the reversed graph) with arc weights ``weights`` as a ``scipy.sparse.csr_matrix``.

        Built from a cached pattern (arcs are sorted by tail, so no conversion).
        """
        import scipy.sparse as sp

        indptr, indices, order = self._csr_patterns[1 if reverse else 0]
        data = np.asarray(weights, dtype=np.float64)
        return sp.csr_matrix((data if order is None else data[order], indices, indptr), shape=(self.num_nodes,) * 2)

    def arc_names(self, arcs: np.ndarray) -> list[tuple]:
        """Names ``(u, v)`` of arcs."""
        return [(self.nodes[self.tail[a]], self.nodes[self.head[a]]) for a in arcs]

    def node_path(self, arcs) -> list:
        """The node names along a path given by its arcs (``[]`` for no arcs)."""
        arcs = [int(a) for a in arcs]
        if not arcs:
            return []
        return [self.nodes[self.tail[arcs[0]]]] + [self.nodes[self.head[a]] for a in arcs]

    def arcs_of_node_path(self, names) -> list[int] | None:
        """Arc indices of a path given by node names; ``None`` if a node or link is missing."""
        idx = self.index
        out = []
        for u, v in zip(names[:-1], names[1:]):
            iu, iv = idx.get(_node_key(u)), idx.get(_node_key(v))
            if iu is None or iv is None:
                return None
            a = self.arc_index.get((iu, iv))
            if a is None:
                return None
            out.append(a)
        return out


def _node_key(n):
    # JSON turns nothing into floats here, but be lenient with numpy ints.
    if isinstance(n, (np.integer,)):
        return int(n)
    return n


def build_network(topo: Topology) -> Network:
    """Flattens a topology (see :class:`Network`).

    Raises:
        TopologyError: if ``topo`` is not a :class:`~jaxccl.topology.Topology`.

    >>> from jaxccl.topology import ring
    >>> net = build_network(ring(4))
    >>> net.num_gpus, net.num_arcs, bool(net.advances.all())
    (4, 8, True)
    """
    if not isinstance(topo, Topology):
        raise TopologyError(f"expected a jaxccl.topology.Topology, got {type(topo).__name__}")
    n = topo.num_gpus
    others = sorted((x for x in topo.graph.nodes if not isinstance(x, int) or isinstance(x, bool)), key=str)
    nodes = tuple(range(n)) + tuple(others)
    index = {x: i for i, x in enumerate(nodes)}
    edges = tuple(topo.graph.edges(data="capacity"))
    us, vs, cs = zip(*edges) if edges else ((), (), ())
    tail = np.fromiter(map(index.__getitem__, us), np.int64, len(us))
    head = np.fromiter(map(index.__getitem__, vs), np.int64, len(vs))
    order = np.lexsort((head, tail))  # arcs sorted by (tail, head)
    tail, head = tail[order], head[order]
    cap = np.array(cs, dtype=np.float64)[order]
    unit = float(cap.max()) if cap.size else 1.0
    advances = head < n
    num_arcs = tail.shape[0]
    return Network(
        topo=topo,
        nodes=nodes,
        num_gpus=n,
        tail=tail,
        head=head,
        capacity=cap / unit,
        unit=unit,
        advances=advances,
        gpu_groups=_groups(head, advances, num_arcs),
        switch_groups=_groups(head, ~advances, num_arcs),
    )


def _groups(head: np.ndarray, mask: np.ndarray, num_arcs: int) -> tuple[HeadGroup, ...]:
    """Buckets the heads of the masked arcs by in-degree rounded up to a power of two."""
    arcs = np.flatnonzero(mask)
    if arcs.size == 0:
        return ()
    order = np.argsort(head[arcs], kind="stable")
    arcs = arcs[order]
    heads, starts, counts = np.unique(head[arcs], return_index=True, return_counts=True)
    padded = 1 << np.ceil(np.log2(counts)).astype(np.int64)
    groups = []
    for deg in np.unique(padded):
        sel = np.flatnonzero(padded == deg)
        mat = np.full((sel.size, int(deg)), num_arcs, dtype=np.int64)
        row = np.repeat(np.arange(sel.size), counts[sel])
        col = np.arange(row.size) - np.repeat(np.cumsum(counts[sel]) - counts[sel], counts[sel])
        mat[row, col] = arcs[np.repeat(starts[sel], counts[sel]) + col]
        groups.append(HeadGroup(heads=heads[sel], arcs=mat))
    return tuple(groups)
