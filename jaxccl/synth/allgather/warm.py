"""ForestColl-warm (MCCL Sec. 4.3): what a previous schedule tells a new synthesis.

MCCL guides tree generation by the previous arborescences so that links of
the old trees are tried first ("A*-style reordering of candidate links") and
unaffected structure survives. :func:`previous_hints` reads the previous
trees (into arrays, :class:`~jaxccl.synth.allgather.packing.PreviousTrees`)
and the previous critical cut, which seeds the rate of phase 1; the trees
are then kept and repaired by :func:`jaxccl.synth.allgather.repair.repair_pack`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxccl.errors import SynthesisError
from jaxccl.schedule import Collective, Schedule
from jaxccl.synth.allgather.network import Net
from jaxccl.synth.allgather.packing import PreviousTrees, parse_trees


def previous_hints(previous: Schedule | None, net: Net, collective: Collective) -> dict[str, Any]:
    """Extracts the warm-start hints of ``previous`` for ``net``: ``trees`` (parsed) and ``cut``.

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
            f"previous= must be a {collective.value} schedule of jaxccl.synth.all_gather (with info['trees']); "
            f"got {previous!r}"
        )
    if previous.num_ranks != net.num_gpus:
        raise SynthesisError(f"previous= has {previous.num_ranks} ranks, the topology {net.num_gpus} GPUs")
    trees = parse_trees(net.num_gpus, info["trees"])
    cut = None
    names = info.get("critical_cut")
    if names:
        index = {str(name): i for i, name in enumerate(net.names)}
        cut = np.zeros(net.num_nodes, dtype=bool)
        for name in names:
            i = index.get(str(name))
            if i is not None:
                cut[i] = True
    return {"cut": cut, "trees": trees}


def reuse_fraction(previous: PreviousTrees, rows: np.ndarray) -> float:
    """Share of the new schedule's chunk hops (``rows``: root, parent, child, first, count) the old one also had.

    A hop counts as reused when the previous schedule also sent that root's chunks from the same parent to the
    same child (whatever the chunk numbers).
    """
    total = int(rows[:, 4].sum()) if len(rows) else 0
    if not total:
        return 0.0
    n = previous.parent.shape[1]
    keys = (rows[:, 0] * n + rows[:, 1]) * n + rows[:, 2]
    old = previous.hop_keys()
    if not len(old):
        return 0.0
    pos = np.minimum(np.searchsorted(old, keys), len(old) - 1)
    hit = old[pos] == keys
    return float(rows[hit, 4].sum() / total)
