"""ReduceScatter schedules that sum in gloo's tree order and route around slow links.

Across processes XLA:CPU reduces with gloo: ``psum_scatter`` sums every
element along one binary tree over the ranks, that of gloo's halving-doubling
(:func:`jaxccl.schedule.reduction.gloo_tree`: ``((x0 + x1) + (x2 + x3)) +
((x4 + x5) + (x6 + x7))`` for 8 ranks, ``((x0 + x1) + (x2 + x3)) + (x4 + x5)``
for 6). A float sum depends on its order, so a communicator's default
ReduceScatter in a job of several processes,
:func:`jaxccl.runtime.default_schedules.gloo_tree_reduce_scatter`, adds in that
tree; it moves the data directly (every rank sends block ``r`` to rank ``r``),
which puts half of every rank's buffer on its NIC. This module keeps the tree
and moves the bytes: every output is gloo's very sum, bit for bit (the
schedules declare ``info["fold"] == "gloo_tree"`` and the reference
interpreter proves the tree term of every output chunk), and the closed loop
can re-synthesize it when a link degrades.

For every block (its root: the rank that owns it) and each of its sub-chunks,
a candidate *places* the tree: every addition of the tree runs on the GPU that
holds one of its two operands, and the other operand travels there (a
transfer whose receiver adds it). Leaves are the ranks' input chunks, so an
addition's GPU is always one of the ranks under it. The tree's root value then
travels to the block's owner, directly or through one GPU of the owner's host.
Only the places change, never the additions, so every candidate computes the
same sum. Every placement is a candidate while few enough (at most 1024 per
root, times the GPUs of its host); beyond that (12 ranks or more on hosts of 4
GPUs) the candidates are a canonical placement, each addition on the operand's
GPU closest to the owner (the owner, its host, the owner's rail position on
other hosts, then the index sharing the most low bits with the owner's, as
gloo's butterfly), and every placement that moves one addition to its other
operand. The sub-chunks of every block choose among the candidates greedily:
each takes the one whose most loaded link, relative to its capacity, stays the
least loaded (:mod:`jaxccl.synth.fold_routing`, shared with
:mod:`jaxccl.synth.ordered_reduce_scatter`). On a degraded fabric the degraded
NIC gets fewer chunks in proportion to its capacity.

What it costs: a partial sum crosses a host boundary where the tree adds
terms of two hosts, plus once to the owner where the whole sum is not
computed there. With hosts of consecutive ranks that line up with gloo's
blocks, every block crosses about once per host boundary: on the healthy
``rail(2, 4)`` every NIC carries one chunk each way per period, a quarter of
the direct ``gloo_tree_reduce_scatter``'s four. A tree whose blocks straddle
hosts crosses more often (6 ranks on hosts of 3 gain nothing over the direct
schedule on a healthy fabric). A sum is as many transfers deep as the tree is
high (plus at most two to the owner); each transfer follows
:meth:`~jaxccl.topology.Topology.path`. Synthesis takes tens of milliseconds
at 8 ranks and a few hundred at 32.

Example:
    >>> from jaxccl.topology import rail
    >>> topo = rail(hosts=2, gpus_per_host=4)
    >>> s = tree_reduce_scatter(topo)  # validated: the interpreter proves gloo's tree for every output
    >>> s.info["fold"], s.info["ordered_reduction"], s.algbw > 0
    ('gloo_tree', False, True)
    >>> slow = topo.degrade(0, "tor:s0r0", gbps=120)  # GPU 0's NIC at 0.3x, both directions
    >>> tree_reduce_scatter(slow).algbw > predicted_algbw(s, slow)
    True
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from jaxccl.schedule.ir import Schedule
from jaxccl.schedule.reduction import gloo_tree
from jaxccl.synth.fold_routing import (
    DEFAULT_MAX_CHUNKS,
    EXHAUSTIVE,
    Action,
    ScratchCopies,
    check_arguments,
    predicted_algbw,
    relay,
    routes_from,
    synthesize,
)

__all__ = ["DEFAULT_MAX_CHUNKS", "predicted_algbw", "tree_reduce_scatter"]


def _additions(n: int) -> list[tuple[int, int]]:
    """gloo's tree as its additions, children first: addition ``k`` is term ``n + k``, the sum of two terms.

    A term below ``n`` is a rank's input (a leaf); the last addition is the whole sum.
    """
    adds: list[tuple[int, int]] = []

    def walk(tree: Any) -> int:
        if isinstance(tree, int):
            return tree
        left, right = walk(tree[0]), walk(tree[1])
        adds.append((left, right))
        return n + len(adds) - 1

    walk(gloo_tree(n))
    return adds


def _places(n: int, adds: list[tuple[int, int]], sides: tuple[int, ...]) -> list[int]:
    """The GPU of every term: a leaf's rank; an addition's, that of its operand ``sides[k]`` (0 left, 1 right)."""
    at = list(range(n)) + [0] * len(adds)
    for k, (pair, side) in enumerate(zip(adds, sides)):
        at[n + k] = at[pair[side]]
    return at


def _fold(n: int, adds: list[tuple[int, int]], at: list[int], final: tuple[int, ...]) -> list[Action]:
    """The actions of one chunk: each addition a transfer of one operand to the other's GPU, then the route.

    ``final`` is the route of the whole sum from its GPU to the owner (the
    GPUs after it; empty when the sum is computed at the owner).
    """
    acts: list[Action] = []
    scratch = ScratchCopies()

    where: list[tuple[Any, int | None]] = [("in", None)] * n  # every term: its location and producing action
    for k, (left, right) in enumerate(adds):
        g = at[n + k]
        home, other = (left, right) if at[left] == g else (right, left)
        held, held_by = where[home]
        moved, moved_by = where[other]
        if k == len(adds) - 1 and not final:  # the whole sum, computed at its owner
            dst = "out"
        elif held == "in":  # the first addition on g: a scratch slot (the input is read-only)
            dst = scratch(g)
        else:  # g goes on adding into its slot
            dst = held
        after = tuple(i for i in (moved_by, held_by) if i is not None)
        acts.append(Action(at[other], g, moved, dst, held, after))
        where.append((dst, len(acts) - 1))
    relay(acts, (at[-1], *final), *where[-1], scratch)
    return acts


def _options(topo: Any, adds: list[tuple[int, int]], root: int, exhaustive: int) -> Iterator[tuple[list[int], tuple]]:
    """Candidate (placement, final route) pairs for a chunk of ``root``; every placement while few enough."""
    n, hosts = topo.num_gpus, topo.hosts
    host = topo.host_of(root)
    if 2 ** len(adds) * len(hosts[host]) <= exhaustive:
        choices = list(itertools.product((0, 1), repeat=len(adds)))
    else:
        # too many: the canonical placement (each addition on its operand's GPU closest to the owner: the owner,
        # then its host, then the owner's rail position on another host, then the GPU whose index shares the most
        # low bits with the owner's, as gloo's butterfly does) and every placement that moves one of its additions
        # to the other operand's GPU
        canonical = _canonical(topo, adds, root)
        choices = {canonical}
        choices.update(canonical[:k] + (1 - canonical[k],) + canonical[k + 1 :] for k in range(len(adds)))
        choices = sorted(choices)
    for sides in choices:
        at = _places(n, adds, sides)
        for route in routes_from(topo, at[-1], root):
            yield at, route


def _canonical(topo: Any, adds: list[tuple[int, int]], root: int) -> tuple[int, ...]:
    """The sides of the placement that puts each addition on its operand's GPU closest to ``root``."""
    n, hosts, host = topo.num_gpus, topo.hosts, topo.host_of(root)

    def rank(g: int) -> tuple:
        h = hosts[topo.host_of(g)]
        return (g != root, topo.host_of(g) != host, g != h[root % len(h)], g ^ root)

    at = list(range(n)) + [0] * len(adds)
    sides = []
    for k, (left, right) in enumerate(adds):
        side = int(rank(at[right]) < rank(at[left]))
        sides.append(side)
        at[n + k] = (at[left], at[right])[side]
    return tuple(sides)


def tree_reduce_scatter(
    topo: Any, previous: Schedule | None = None, *, max_chunks: int = DEFAULT_MAX_CHUNKS
) -> Schedule:
    """A ReduceScatter for ``topo`` in gloo's tree order (XLA:CPU's across processes), balanced over NICs.

    Takes the arguments of :func:`~jaxccl.synth.ordered_reduce_scatter.ordered_reduce_scatter` (the
    measured topology, the running schedule, which is unused, and ``max_chunks``) and raises its
    errors. Returns a validated ``REDUCE_SCATTER`` schedule with ``info["fold"] == "gloo_tree"``
    (every output proven to be :func:`~jaxccl.schedule.reduction.gloo_tree`'s sum), its predicted
    ``algbw`` on ``topo`` (bytes/s, the nccl-tests convention), ``info["chunk_loads"]`` (the chunks
    per period on each link) and ``info["synth_ms"]``.
    """
    del previous
    check_arguments("tree_reduce_scatter", topo, max_chunks)
    n = topo.num_gpus
    adds = _additions(n)

    def folds_of(root: int) -> list[list[Action]]:
        return [_fold(n, adds, at, route) for at, route in _options(topo, adds, root, EXHAUSTIVE)]

    info = {"algorithm": "tree_fold", "fold": "gloo_tree", "ordered_reduction": False}
    return synthesize(topo, "tree_reduce_scatter", folds_of, info, max_chunks).validate()
