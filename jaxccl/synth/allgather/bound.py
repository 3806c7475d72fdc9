"""Phase 1 of ForestColl: the optimal AllGather throughput by max-flow.

Every GPU broadcasts its shard at a per-root rate ``x``. ``x`` is achievable
iff every set ``X`` of nodes that misses some GPU sends at least ``x`` per GPU
it holds, ``B+(X) >= x * |X ∩ GPUs|`` (ForestColl; MCCL Sec. 4.3, phase 1).
Equivalently, with a super source ``S`` joined to every GPU by a link of
capacity ``x``, the max-flow from ``S`` to every GPU is at least ``N * x``.
So ``x* = min_X B+(X) / |X ∩ GPUs|``: a ratio with denominator at most
``N``, found exactly here by a Dinkelbach-style parametric search on
integer-scaled capacities (each violated min cut yields a smaller ratio;
the sweep stops when every GPU passes). ``algbw = N * x*``.

Trees then carry ``x* / k`` each, ``k`` per root: a link of ``c`` units carries
``floor(c * k / x*)`` trees, and :func:`tree_units` picks the smallest ``k``
that loses nothing to the floor.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np

from jaxccl.errors import ArgumentError, SynthesisError
from jaxccl.synth.allgather.flow import RootedCheck
from jaxccl.synth.allgather.network import Net, shape_cached

DEFAULT_MAX_CHUNKS = 512


@dataclasses.dataclass(frozen=True)
class Bound:
    """The optimal per-root rate and the cut that attains it.

    Attributes:
        rate: ``x*`` in capacity units per second per root (exact).
        cut: node mask of the critical set ``X`` (``B+(X) / |X ∩ GPUs| == rate``).
        flows: max-flow computations spent.
    """

    rate: Fraction
    cut: np.ndarray
    flows: int

    def algbw(self, net: Net) -> float:
        """The bound in the algbw convention: ``N * x*`` bytes/s."""
        return float(self.rate * net.num_gpus * net.unit)

    def cut_edges(self, net: Net) -> np.ndarray:
        """Indices of the physical links leaving the critical set."""
        return np.flatnonzero(self.cut[net.src] & ~self.cut[net.dst])


def cut_ratio(net: Net, side: np.ndarray) -> Fraction:
    """``B+(X) / |X ∩ GPUs|`` for the node mask ``side``."""
    gpus = int(side[: net.num_gpus].sum())
    if gpus == 0 or gpus == net.num_gpus:
        raise ArgumentError("the set must hold some GPUs but not all")
    out = int(net.units[side[net.src] & ~side[net.dst]].sum())
    return Fraction(out, gpus)


def optimal_rate(net: Net, *, hint: np.ndarray | None = None) -> Bound:
    """Computes ``x*`` exactly (see the module docstring).

    Args:
        net: the topology.
        hint: a node mask of a set to try first (warm start: the previous
            critical cut); only speeds the search up.

    >>> from jaxccl.topology import rail
    >>> from jaxccl.synth.allgather.network import build_net
    >>> net = build_net(rail(hosts=2))
    >>> b = optimal_rate(net)
    >>> b.rate, b.algbw(net) / 1e9
    (Fraction(41, 15), 437.3333333333333)
    """
    n_gpus = net.num_gpus
    order = np.argsort(net.in_units()[:n_gpus], kind="stable")
    start_bound = candidate_rate(net, hint)  # the smallest GPU in-cut (order[0]) or the hint
    rate, cut = start_bound.rate, start_bound.cut
    check = RootedCheck(net.num_nodes, n_gpus, net.src, net.dst)
    start = 0
    while True:
        p, q = rate.numerator, rate.denominator
        bad = check.violation(net.units * q, p, n_gpus * p, order[start:])
        if bad is None:
            break
        v, _, side = bad
        start = int(np.flatnonzero(order == v)[0])  # earlier GPUs pass at any smaller rate
        new = cut_ratio(net, side)
        if new >= rate:  # pragma: no cover - a violated cut always has a smaller ratio
            raise SynthesisError(f"max-flow search did not progress at rate {rate}")
        rate, cut = new, side
    return Bound(rate=rate, cut=cut, flows=check.count)


def switch_cuts(net: Net) -> list[np.ndarray]:
    """Node masks of the cuts around every switch: the switch with its GPUs, and everything else (read-only).

    A weakened link next to a switch most often makes one of them critical
    (e.g. a host's in-cut when one of its NICs degrades).
    """
    return shape_cached(net, _switch_cuts)


def _switch_cuts(net: Net) -> list[np.ndarray]:
    n = net.num_gpus
    out = []
    for w in range(n, net.num_nodes):
        near = np.union1d(net.src[(net.dst == w) & (net.src < n)], net.dst[(net.src == w) & (net.dst < n)])
        if 0 < len(near) < n:
            inner = np.zeros(net.num_nodes, dtype=bool)
            inner[near] = True
            inner[w] = True
            outer = ~inner
            inner.flags.writeable = outer.flags.writeable = False
            out.extend([inner, outer])
    return out


def candidate_rate(net: Net, hint: np.ndarray | None = None, *, cuts: list[np.ndarray] | None = None) -> Bound:
    """An upper bound on ``x*`` from a few cuts, without max-flow (warm start).

    The cuts are every GPU's in-cut (all nodes but that GPU), ``hint`` (the
    previous schedule's critical cut) and ``cuts`` (node masks, e.g.
    :func:`switch_cuts`). The result is ``x*`` whenever one of them is
    critical; a packing that reaches it proves that (trees give the lower
    bound, the cut the upper one), otherwise the caller must fall back to
    :func:`optimal_rate`.
    """
    n_gpus = net.num_gpus
    in_units = net.in_units()[:n_gpus]
    v0 = int(np.argmin(in_units))
    cut = np.ones(net.num_nodes, dtype=bool)
    cut[v0] = False
    rate = Fraction(int(in_units[v0]), n_gpus - 1)
    for x in ([] if hint is None else [hint]) + list(cuts or []):
        x = np.asarray(x, dtype=bool)
        if x.shape == cut.shape and 0 < int(x[:n_gpus].sum()) < n_gpus:
            r = cut_ratio(net, x)
            if r < rate:
                rate, cut = r, x.copy()
    if rate <= 0:
        raise SynthesisError(f"GPU {v0} receives nothing: the topology has no usable link into it")
    return Bound(rate=rate, cut=cut, flows=0)


@dataclasses.dataclass(frozen=True)
class TreeUnits:
    """Link capacities counted in trees.

    Attributes:
        k: trees (chunks) per root.
        caps: per physical link, how many trees it carries.
        tree_rate: per-tree rate in capacity units/s (``x* / k_ref``).
        exact: whether ``k`` trees of ``tree_rate`` reach ``x*`` (no rounding loss).
        flows: max-flow computations spent choosing ``k``.
    """

    k: int
    caps: np.ndarray
    tree_rate: Fraction
    exact: bool
    flows: int

    @property
    def rate(self) -> Fraction:
        """The per-root rate these trees deliver."""
        return self.tree_rate * self.k


def tree_units(
    net: Net, bound: Bound, *, max_chunks: int | None = DEFAULT_MAX_CHUNKS, verify: bool = True, search: bool = True
) -> TreeUnits:
    """Chooses ``k`` and the per-link tree capacities for rate ``x*``.

    ``k = numerator(x*)`` always works (every ``c * k / x*`` is an integer);
    a divisor of it works when the links of every tight cut stay integral,
    which :func:`tree_units` tests from the critical cut's gcd upwards. If the
    exact ``k`` exceeds ``max_chunks``, trees are sized ``x* / max_chunks``
    and the largest number ``k' <= max_chunks`` of them per root that fits is
    used: throughput ``x* * k' / max_chunks`` (reported as a gap). With
    ``search`` and ``max_chunks <= REFINED_MAX_CHUNKS``, the best rate any
    ``k <= max_chunks`` trees per root reach replaces it where higher.

    With ``verify=False`` the smallest candidate ``k`` is returned untested
    (a warm start tests it by packing the trees).
    """
    p, q = bound.rate.numerator, bound.rate.denominator
    n = net.num_gpus
    if max_chunks is not None and max_chunks < 1:
        raise ArgumentError(f"max_chunks must be >= 1, got {max_chunks}")
    if max_chunks is None or p <= max_chunks:
        cut_units = net.units[bound.cut_edges(net)]
        g = math.gcd(*[int(c) for c in cut_units]) if len(cut_units) else 1
        k0 = p // math.gcd(p, q * g)
        if not verify:
            return TreeUnits(k0, net.units * k0 * q // p, Fraction(p, q * k0), True, 0)
    check = RootedCheck(net.num_nodes, n, net.src, net.dst)
    if max_chunks is None or p <= max_chunks:
        for k in [d for d in range(k0, p, k0) if p % d == 0]:
            caps = net.units * k * q // p
            if check.violation(caps, k, n * k) is None:
                return TreeUnits(k, caps, Fraction(p, q * k), True, check.count)
        return TreeUnits(p, net.units * q, Fraction(1, q), True, check.count)
    # Approximate: trees of rate x*/K with K = max_chunks; fit as many per root as possible.
    big_k = max_chunks
    caps = net.units * big_k * q // p
    lo, hi = 0, big_k  # lo fits (0 trivially), find the largest
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if check.violation(caps, mid, n * mid) is None:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        raise SynthesisError(
            f"max_chunks={max_chunks} is too small to split the optimal rate {float(bound.rate):.4g} into trees"
        )
    best = TreeUnits(lo, caps, Fraction(p, q * big_k), lo == big_k, check.count)
    if search and big_k <= REFINED_MAX_CHUNKS:
        best = _best_coarse_units(net, bound, big_k, check, best)
    return best


REFINED_MAX_CHUNKS = 16  # up to this chunk limit, tree_units searches the best rate any k <= max_chunks trees reach


def _best_coarse_units(net: Net, bound: Bound, max_chunks: int, check: RootedCheck, found: TreeUnits) -> TreeUnits:
    """The highest per-root rate ``k * t`` of ``k <= max_chunks`` trees per root of rate ``t`` each.

    A link of ``c`` units carries ``floor(c / t)`` trees, so whether ``k`` trees per root fit changes only
    where ``t`` crosses some ``c / m`` (``m`` integer), and fitting is monotone in ``t``: for each ``k`` a
    binary search over those breakpoints in ``[found.rate / k, x* / k]`` finds the largest ``t`` (equal rates:
    the fewest chunks). Trees
    sized ``x* / max_chunks`` (``found``) can lose much more: on a rail whose cut NIC keeps 0.5 of its rate,
    at most 2 chunks per shard reach 1.33x the stale rate this way, and 1.0x sized ``x* / 2``.
    """
    n, x_star = net.num_gpus, bound.rate
    units = sorted({int(u) for u in np.asarray(net.units).tolist() if u > 0})
    for k in range(max_chunks, 0, -1):  # the largest k first: its rate bounds the search of the others
        lo_t, hi_t = found.rate / k, x_star / k  # at least found (a tie: fewer chunks): t >= lo_t; t <= hi_t
        breaks = set()
        for u in units:
            m_min = math.ceil(u / hi_t)  # u / m <= hi_t
            m_max = math.floor(u / lo_t)  # u / m >= lo_t
            breaks.update(Fraction(u, m) for m in range(max(m_min, 1), m_max + 1))
        candidates = sorted(breaks, reverse=True)
        lo, hi, fit = 0, len(candidates), None  # candidates[i] fits for every i >= the first fitting one
        while lo < hi:
            mid = (lo + hi) // 2
            t = candidates[mid]
            caps = np.asarray([u * t.denominator // t.numerator for u in np.asarray(net.units).tolist()])
            if check.violation(caps, k, n * k) is None:
                fit, hi = (t, caps), mid
            else:
                lo = mid + 1
        if fit is not None and (k * fit[0] > found.rate or (k * fit[0] == found.rate and k < found.k)):
            found = TreeUnits(k, fit[1].astype(np.asarray(net.units).dtype), fit[0], k * fit[0] == x_star, check.count)
    return dataclasses.replace(found, flows=check.count)
