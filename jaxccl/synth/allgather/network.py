"""A topology as integer arrays: the input of every AllGather synthesis phase.

GPUs keep their ranks ``0 .. N-1`` as node indices; switches follow in sorted
order. Capacities become integers in a common unit so that max-flow runs on
exact integers (``scipy.sparse.csgraph.maximum_flow`` takes int32): when every
capacity is an integer multiple of one unit small enough to fit, the unit is
their exact greatest common divisor (presets: 10 GB/s, 1.25 GB/s with failures) and every
result is exact; otherwise (e.g. measured capacities) capacities are rounded
down to a grid fine enough for int32 arithmetic and :attr:`Net.exact` is False.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

from jaxccl.errors import SynthesisError, TopologyError
from jaxccl.topology import Topology

# Max-flow values and scaled capacities must stay below 2**31 (scipy's int32).
# Capacities get scaled by up to N (the denominator of the optimal rate) and
# flow values reach about N times a GPU's in-capacity, so a link and a GPU's
# in-capacity may use at most INT_BUDGET / N units.
INT_BUDGET = 1 << 29


@dataclasses.dataclass(frozen=True)
class Net:
    """A topology as arrays.

    Attributes:
        topo: the topology it was built from.
        num_gpus: ``N``; nodes ``0..N-1`` are the GPUs (ranks).
        names: node index -> topology node name.
        src, dst: endpoints of every directed physical link (node indices).
        units: integer capacity of every link, in units of :attr:`unit`.
        latency: latency of every link (s).
        unit: bytes/s per capacity unit.
        exact: whether ``units * unit`` equals every capacity exactly.
    """

    topo: Topology
    num_gpus: int
    names: tuple
    src: np.ndarray
    dst: np.ndarray
    units: np.ndarray
    latency: np.ndarray
    unit: Fraction
    exact: bool

    @property
    def num_nodes(self) -> int:
        return len(self.names)

    def in_units(self) -> np.ndarray:
        """Total incoming capacity of every node, in units."""
        return np.bincount(self.dst, weights=self.units, minlength=self.num_nodes).astype(np.int64)

    def shape_key(self) -> tuple:
        """What identifies the links (not their capacities): equal keys, equal :func:`shape_cached` values."""
        return (self.num_gpus, self.num_nodes, self.src.tobytes(), self.dst.tobytes())

    def edge_index(self) -> dict[tuple[int, int], int]:
        """``(u, v) -> position`` of every link in :attr:`src`/:attr:`dst`."""
        return {(int(u), int(v)): i for i, (u, v) in enumerate(zip(self.src.tolist(), self.dst.tolist()))}


_SHAPE_CACHE: collections.OrderedDict = collections.OrderedDict()
_SHAPE_LOCK = threading.Lock()
SHAPE_CACHE_SIZE = 64


def shape_cached(net: Net, make: Callable[[Net], Any]) -> Any:
    """``make(net)`` for a function of the links alone (not their capacities), computed once per fabric.

    The closed loop re-synthesizes on the same fabric with new capacities, so what depends only on which
    links exist (the sets of GPUs around each switch, ...) is kept (the last :data:`SHAPE_CACHE_SIZE`).
    ``make``'s result must not be modified by its users.
    """
    key = (make.__module__, make.__qualname__, net.shape_key())
    with _SHAPE_LOCK:  # synthesizers may run in several threads (a controller per communicator)
        value = _SHAPE_CACHE.get(key)
        if value is not None:
            _SHAPE_CACHE.move_to_end(key)
            return value
    value = make(net)
    with _SHAPE_LOCK:
        _SHAPE_CACHE[key] = value
        while len(_SHAPE_CACHE) > SHAPE_CACHE_SIZE:
            _SHAPE_CACHE.popitem(last=False)
    return value


def build_net(topo: Topology) -> Net:
    """Builds the :class:`Net` of ``topo``; raises ``TopologyError`` for a topology with one GPU.

    >>> from jaxccl.topology import rail
    >>> net = build_net(rail(hosts=2))
    >>> net.num_gpus, net.num_nodes, float(net.unit), sorted(set(net.units.tolist()))
    (16, 26, 10000000000.0, [5, 36])
    """
    if not isinstance(topo, Topology):
        raise TopologyError(f"expected a jaxccl.topology.Topology, got {type(topo).__name__}")
    n_gpus = topo.num_gpus
    if n_gpus < 2:
        raise TopologyError(f"AllGather synthesis needs at least 2 GPUs, topology {topo.name!r} has {n_gpus}")
    names = tuple(range(n_gpus)) + tuple(sorted(topo.switches))
    index = {v: i for i, v in enumerate(names)}
    src, dst, caps, lats = [], [], [], []
    for u, v, cap, lat in topo.edges():
        src.append(index[u])
        dst.append(index[v])
        caps.append(float(cap))
        lats.append(float(lat))
    src_a = np.asarray(src, dtype=np.int64)
    dst_a = np.asarray(dst, dtype=np.int64)
    units, unit, exact = _integer_capacities(caps, src_a, dst_a, len(names), n_gpus)
    return Net(
        topo=topo,
        num_gpus=n_gpus,
        names=names,
        src=src_a,
        dst=dst_a,
        units=units,
        latency=np.asarray(lats, dtype=np.float64),
        unit=unit,
        exact=exact,
    )


def _integer_capacities(
    caps: list[float], src: np.ndarray, dst: np.ndarray, n_nodes: int, n_gpus: int
) -> tuple[np.ndarray, Fraction, bool]:
    budget = INT_BUDGET // n_gpus
    if all(float(c).is_integer() for c in caps):  # whole bytes/s (every preset): integer arithmetic
        ints = [int(c) for c in caps]
        g = Fraction(math.gcd(*ints))
        exact_units = np.array([c // g.numerator for c in ints], dtype=object)
    else:
        fracs = [Fraction(c) for c in caps]
        g = fracs[0]
        for f in fracs[1:]:
            g = Fraction(math.gcd(g.numerator, f.numerator), math.lcm(g.denominator, f.denominator))
        exact_units = np.array([int(f / g) for f in fracs], dtype=object)
    biggest = int(exact_units.max())
    if biggest <= budget:
        gpu_in = np.bincount(dst, weights=exact_units.astype(np.float64), minlength=n_nodes)[:n_gpus]
        if int(gpu_in.max()) <= budget:  # float sums of integers below 2**53: exact
            return exact_units.astype(np.int64), g, True
    # No common unit fits: round down to a grid with `budget` steps for the largest link / GPU in-capacity.
    cap_f = np.asarray(caps, dtype=np.float64)
    in_f = np.bincount(dst, weights=cap_f, minlength=n_nodes)[:n_gpus]
    unit = Fraction(max(float(cap_f.max()), float(in_f.max())) / budget)
    units = np.floor(cap_f / float(unit)).astype(np.int64)
    if (units <= 0).any():
        worst = int(np.argmin(cap_f))
        raise SynthesisError(
            f"link capacities span too wide a range to synthesize exactly: {cap_f[worst]:.4g} B/s is below the "
            f"integer grid of {float(unit):.4g} B/s needed for {n_gpus} GPUs"
        )
    return units, unit, False
