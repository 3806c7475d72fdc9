"""The logical topology left by switch removal, and how its links map back to physical links.

Switch removal (phase 2) replaces every switch ``w`` by direct links: ``y``
units of a pair ``(u, w), (w, t)`` become ``y`` units of a link ``u -> t``
(edge splitting). Switches are removed one at a time, so a pair may itself
be a logical link created at an earlier switch; :class:`Logical` records
for every link where its units came from, which :meth:`Logical.physical_load`
unrolls to physical links.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from jaxccl.errors import SynthesisError
from jaxccl.synth.allgather.network import Net


class Logical:
    """A graph under switch removal: integer capacities plus the provenance of every link.

    Starts as the physical graph (capacities in trees); :meth:`split` removes
    units at a switch.
    """

    def __init__(self, net: Net, caps: np.ndarray):
        self.net = net
        self.cap: dict[tuple[int, int], int] = defaultdict(int)
        # provenance: link -> {via: units}; via None = the physical link itself
        self.via: dict[tuple[int, int], dict[int | None, int]] = defaultdict(dict)
        for u, v, c in zip(net.src.tolist(), net.dst.tolist(), np.asarray(caps).tolist()):
            if c > 0:
                self.cap[(u, v)] += int(c)
                self.via[(u, v)][None] = self.via[(u, v)].get(None, 0) + int(c)
        self.removed: list[int] = []

    def copy(self) -> Logical:
        other = Logical.__new__(Logical)
        other.net = self.net
        other.cap = defaultdict(int, self.cap)
        other.via = defaultdict(dict, {e: dict(d) for e, d in self.via.items()})
        other.removed = list(self.removed)
        return other

    def neighbors(self, w: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """``(preds, succs)`` of node ``w``: lists of ``(node, units)`` with positive units."""
        preds = sorted((u, c) for (u, v), c in self.cap.items() if v == w and c > 0)
        succs = sorted((v, c) for (u, v), c in self.cap.items() if u == w and c > 0)
        return preds, succs

    def split(self, u: int, w: int, t: int, y: int) -> None:
        """Splits ``y`` units off ``(u, w), (w, t)`` into ``u -> t`` (dropped if ``u == t``)."""
        if y <= 0:
            return
        for e in ((u, w), (w, t)):
            if self.cap[e] < y:
                raise SynthesisError(f"cannot split {y} units off {e}: only {self.cap[e]} left")
            self.cap[e] -= y
        if u != t:
            self.cap[(u, t)] += y
            d = self.via[(u, t)]
            d[w] = d.get(w, 0) + y

    def remove(self, w: int) -> int:
        """Drops node ``w`` and whatever is left on its links; returns the units dropped."""
        left = 0
        for e in [e for e in self.cap if w in e]:
            left += self.cap.pop(e)
        self.removed.append(w)
        return left

    def arrays(self, nodes: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src, dst, cap)`` of the links with positive capacity (among the first ``nodes`` nodes)."""
        items = [(u, v, c) for (u, v), c in self.cap.items() if c > 0 and (nodes is None or (u < nodes and v < nodes))]
        if not items:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z
        a = np.array(items, dtype=np.int64)
        return a[:, 0], a[:, 1], a[:, 2]

    def gpu_links(self) -> dict[tuple[int, int], int]:
        """The GPU-to-GPU links with positive capacity."""
        n = self.net.num_gpus
        return {e: c for e, c in self.cap.items() if c > 0 and e[0] < n and e[1] < n}

    def physical_load(self, load: dict[tuple[int, int], int]) -> np.ndarray:
        """Units on every physical link (``Net`` edge order) when logical links carry ``load``.

        A logical link's units are taken from its sources in a fixed order
        (the physical link first, then the switches it was split at).
        """
        index = self.net.edge_index()
        out = [0] * len(self.net.src)
        # work on a copy of the provenance, in the order units are taken: units taken are no longer available
        avail: dict[tuple[int, int], list[list]] = {}
        stack = [(e, int(f)) for e, f in load.items() if f > 0]
        while stack:
            e, f = stack.pop()
            src = avail.get(e)
            if src is None:
                via = self.via.get(e, {})
                order = ([None] if None in via else []) + sorted(w for w in via if w is not None)
                src = avail[e] = [[w, via[w]] for w in order]
            for item in src:
                if f == 0:
                    break
                w, have = item
                take = min(f, have)
                if take <= 0:
                    continue
                item[1] = have - take
                f -= take
                if w is None:
                    out[index[e]] += take
                else:
                    stack.append(((e[0], w), take))
                    stack.append(((w, e[1]), take))
            if f:
                raise SynthesisError(f"logical link {e} carries more units than it was given")
        return np.array(out, dtype=np.int64)
