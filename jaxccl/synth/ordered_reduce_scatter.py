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
from collections.abc import Iterator
from typing import Any

from jaxccl.schedule.ir import Schedule
from jaxccl.synth.fold_routing import (
    DEFAULT_MAX_CHUNKS,
    EXHAUSTIVE,
    Action,
    ScratchCopies,
    predicted_algbw,
    relay,
    routes_from,
    synthesize,
)

__all__ = ["DEFAULT_MAX_CHUNKS", "ordered_reduce_scatter", "predicted_algbw"]


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


def _fold(runs: list[tuple[int, list[int]]], folders: tuple[int, ...], final: tuple[int, ...]):
    """The actions of one chunk: each run's blocks sent to its folder, folded there in rank order, passed on.

    ``final`` is the route of the sum from the last folder to the chunk's owner
    (its GPUs after the folder, ending at the owner; empty when the folder is the owner).
    """
    acts: list[Action] = []
    scratch = ScratchCopies()

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
                acts.append(Action(first, g, "in", slot))
                where, at, idx = slot, g, len(acts) - 1
        elif g != at:  # the running sum travels to this run's folder
            first = terms[0]
            red = "in" if first == g else None
            if red:
                terms.pop(0)
            acts.append(Action(at, g, where, slot, red, () if idx is None else (idx,)))
            where, at, idx = slot, g, len(acts) - 1
        for k in terms:
            if k == g:
                acts.append(Action(g, g, "in", slot, slot, (idx,)))
            else:
                acts.append(Action(k, g, "in", slot, where, () if idx is None else (idx,)))
            where, idx = slot, len(acts) - 1
    hops = (at, *final)
    if len(hops) == 1:  # the last folder owns the chunk
        last = acts[-1]
        if last.a != last.b:
            acts[-1] = dataclasses.replace(last, dst="out")
        else:
            acts.append(Action(at, at, where, "out", None, (idx,)))
        return acts
    relay(acts, hops, where, idx, scratch)
    return acts


def _options(
    topo: Any, runs: list[tuple[int, list[int]]], root: int, exhaustive: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Candidate (folders, final route) pairs for a chunk of ``root``; every combination while few enough.

    A run's folder is a GPU of its host, or (after the first run) the
    previous run's folder, which then receives this run's blocks across the
    host boundary instead of sending the running sum: fewer bytes one way,
    more the other, which balances the two directions of the NICs.
    """
    hosts = topo.hosts
    per_run = [list(hosts[h]) + ([-1] if i else []) for i, (h, _) in enumerate(runs)]

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
            for route in routes_from(topo, folders[-1], root):
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
        for route in routes_from(topo, folders[-1], root):
            yield folders, route


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
    runs = _runs(topo)

    def folds_of(root: int) -> list[list[Action]]:
        return [_fold(runs, folders, route) for folders, route in _options(topo, runs, root, EXHAUSTIVE)]

    info = {"algorithm": "ordered_fold", "ordered_reduction": True}
    schedule = synthesize(topo, "ordered_reduce_scatter", folds_of, info, max_chunks)
    return schedule.validate(ordered_reduction=True)
