"""ForestColl-warm (MCCL Sec. 4.3): what a previous schedule tells a new synthesis.

MCCL guides tree generation by the previous arborescences so that links of
the old trees are tried first ("A*-style reordering of candidate links") and
unaffected structure survives. Here the previous trees become, for every
GPU ``v``, the ``(root, parent)`` pairs it used: the per-GPU matchings of
phase 3 offer those in-links first (see :func:`jaxccl.synth.allgather.packing.match_pack`),
and the previous critical cut seeds the max-flow search of phase 1.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from jaxccl.errors import SynthesisError
from jaxccl.schedule import Collective, Schedule
from jaxccl.synth.allgather.network import Net


def previous_hints(previous: Schedule | None, net: Net, collective: Collective) -> dict[str, Any]:
    """Extracts the warm-start hints of ``previous`` for ``net``: ``prefer``, ``cut`` and ``pairs``.

    Raises:
        SynthesisError: if ``previous`` is not a schedule of this synthesizer for the same ranks.
    """
    if previous is None:
        return {}
    if not isinstance(previous, Schedule):
        raise SynthesisError(f"previous= must be a Schedule, got {type(previous).__name__}")
    info = dict(previous.info)
    if previous.collective != collective or "trees" not in info:
        raise SynthesisError(
            f"previous= must be a {collective.value} schedule of jaxccl.synth.allgather (with info['trees']); "
            f"got {previous!r}"
        )
    if previous.num_ranks != net.num_gpus:
        raise SynthesisError(f"previous= has {previous.num_ranks} ranks, the topology {net.num_gpus} GPUs")
    pairs: dict[int, set[tuple[int, int]]] = collections.defaultdict(set)
    for root, trees in enumerate(info["trees"]):
        for _, edges in trees:
            for p, c in edges:
                pairs[int(c)].add((root, int(p)))
    prefer = {v: np.array(sorted(s), dtype=np.int64).reshape(-1, 2) for v, s in pairs.items()}
    cut = None
    names = info.get("critical_cut")
    if names:
        index = {str(name): i for i, name in enumerate(net.names)}
        cut = np.zeros(net.num_nodes, dtype=bool)
        for name in names:
            i = index.get(str(name))
            if i is not None:
                cut[i] = True
    return {"prefer": prefer, "cut": cut, "pairs": pairs, "trees": info["trees"]}


def reuse_fraction(pairs: dict[int, set[tuple[int, int]]], rows: np.ndarray) -> float:
    """Share of the new schedule's chunk hops (``rows``: root, parent, child, first, count) the old one also had."""
    total = int(rows[:, 4].sum()) if len(rows) else 0
    if not total:
        return 0.0
    kept = 0
    for r, u, v, c in zip(rows[:, 0].tolist(), rows[:, 1].tolist(), rows[:, 2].tolist(), rows[:, 4].tolist()):
        if (r, u) in pairs.get(v, ()):
            kept += c
    return kept / total
