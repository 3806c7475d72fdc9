"""The measured link matrix of MCCL App. B (Fig. 13), EWMA-smoothed (MCCL Sec. 3).

``matrix[i, i]`` is GPU ``i``'s intra-node injection throughput, ``matrix[i, j]``
(``i != j``) the point-to-point throughput from GPU ``i`` to GPU ``j`` of
another host, in emulated bytes/s; NaN where nothing was measured yet. Every
drain gives one EWMA sample per entry (the mean over the windows of the
records drained): ``M <- alpha * sample + (1 - alpha) * M`` (the first sample
sets M). Draining once per training step makes the EWMA window a number of
steps (about ``1 / alpha``).

Beside the matrix, every snapshot carries the raw samples folded since the previous snapshot
(:attr:`Telemetry.windows`, one row per drained record: the mean rate of its windows), which a
change-point test (:mod:`jaxccl.control.detector`) reads without the EWMA's lag.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

import numpy as np

from jaxccl.errors import ArgumentError
from jaxccl.telemetry.export import write_heatmap
from jaxccl.telemetry.records import INTRA, decode

__all__ = ["WINDOW_DTYPE", "Telemetry", "TelemetryCollector", "entry_capacities", "route_links"]

WINDOW_DTYPE = np.dtype([("src", "<i4"), ("dst", "<i4"), ("rate", "<f8"), ("count", "<i4")])
"""One raw sample: entry ``(src, dst)`` of the matrix (``dst == src``: intra-node injection), its mean
rate (bytes/s, emulated) over ``count`` measurement windows."""

MAX_PENDING_WINDOWS = 1 << 16  # raw samples kept between two snapshots; older ones are dropped


@dataclasses.dataclass(frozen=True)
class Telemetry:
    """A snapshot of the measured matrix.

    Attributes:
        matrix: ``(N, N)`` EWMA-smoothed throughput, emulated bytes/s, NaN = not measured.
        samples: ``(N, N)`` how many EWMA samples (drains that measured it) went into each entry.
        last: ``(N, N)`` the most recent raw sample of each entry (NaN if none).
        alpha: the EWMA smoothing factor.
        dropped: records the executor dropped because a buffer region was full, since its counters' last
            reset (``cuda``: in the whole process; :meth:`jaxccl.Communicator.measurement` counts them per reading).
        time_s: ``time.time()`` of the snapshot.
        windows: the raw samples folded since the previous snapshot (``WINDOW_DTYPE``), in folding order.
    """

    matrix: np.ndarray
    samples: np.ndarray
    last: np.ndarray
    alpha: float
    dropped: int
    time_s: float
    windows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, WINDOW_DTYPE))

    @property
    def num_gpus(self) -> int:
        return int(self.matrix.shape[0])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN becomes null)."""

        def rows(a: np.ndarray) -> list[list[float | None]]:
            return [[None if np.isnan(x) else float(x) for x in row] for row in a]

        return {
            "num_gpus": self.num_gpus,
            "alpha": self.alpha,
            "dropped": self.dropped,
            "time_s": self.time_s,
            "units": "bytes/s (emulated)",
            "matrix": rows(self.matrix),
            "last": rows(self.last),
            "samples": self.samples.astype(int).tolist(),
        }

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def heatmap(self, path: str, *, title: str = "jaxccl measured throughput") -> None:
        """Writes the matrix as a PNG heatmap in Gbit/s (MCCL Fig. 13 style)."""
        write_heatmap(self.matrix, path, title=title)

    def link_capacities(
        self, topology: Any, *, pairs: set[tuple[int, int]] | None = None, intra_min_drop: float = 0.0
    ) -> dict[tuple, float]:
        """Per-link estimates ``M_a`` (emulated bytes/s) for the links the measurements cover.

        A GPU's intra-node injection throughput bounds its first link towards
        its host's switch. An inter-node pair's throughput is a fair share of
        its route's bottleneck: with ``pairs`` (the inter-node GPU pairs the
        measured schedule runs concurrently), a link crossed by ``k`` of them
        offers ``capacity / k`` per pair, the links with the smallest such share
        are the pair's bottleneck, and each is estimated at ``k`` times the
        largest pair rate that it bottlenecks (without ``pairs``, ``k = 1``).
        Estimates never exceed the link's nominal capacity; links nobody
        measured are left out (the caller keeps their nominal capacity). A
        GPU's injection throughput is also limited by its receivers (incast),
        so it counts against its uplink only when it is more than
        ``intra_min_drop`` below the uplink's capacity. This attribution is our reading: MCCL does not say
        how its GPU-pair matrix maps to links.
        """
        n = self.num_gpus
        est: dict[tuple, float] = {}
        sharers = _sharers(topology, pairs)
        for i in range(n):
            if not np.isnan(self.matrix[i, i]):
                first = _injection_link(topology, i)
                if first is not None and self.matrix[i, i] < topology.capacity(*first) * (1 - intra_min_drop):
                    est[first] = float(self.matrix[i, i])
            for j in range(n):
                if i == j or np.isnan(self.matrix[i, j]):
                    continue
                route = topology.path(i, j)
                per_flow = {e: topology.capacity(*e) / sharers.get(e, 1) for e in route}
                tight = min(per_flow.values())
                for e in route:  # only the route's bottleneck link(s) explain the pair's rate
                    if per_flow[e] <= tight * (1 + 1e-9):
                        value = min(float(self.matrix[i, j]) * sharers.get(e, 1), topology.capacity(*e))
                        est[e] = max(est.get(e, 0.0), value)
        return est


def entry_capacities(
    topology: Any, entries: Any, *, pairs: set[tuple[int, int]] | None = None
) -> dict[tuple[int, int], float]:
    """The rate each entry of the matrix reaches on healthy links, as :meth:`Telemetry.link_capacities` reads it:
    ``(i, i)`` its injection link's capacity, ``(i, j)`` its route's smallest fair share (``capacity / k`` for a
    link ``k`` of ``pairs`` cross). Entries without a route (or a GPU alone on its host) are left out.

    >>> from jaxccl.topology import rail
    >>> topo = rail(hosts=2, gpus_per_host=2)
    >>> {e: c / 1e9 for e, c in entry_capacities(topo, [(0, 0), (0, 2)], pairs={(0, 2), (1, 3)}).items()}
    {(0, 0): 360.0, (0, 2): 50.0}
    """
    sharers = _sharers(topology, pairs)
    out = {}
    for i, j in entries:
        if i == j:
            first = _injection_link(topology, i)
            if first is not None:
                out[(i, j)] = float(topology.capacity(*first))
        elif route := topology.path(i, j):
            out[(i, j)] = float(min(topology.capacity(*e) / sharers.get(e, 1) for e in route))
    return out


def route_links(topology: Any, entry: tuple[int, int]) -> tuple[frozenset, ...]:
    """The links an inter-node entry's route crosses, each as both its directions (``frozenset((u, v))``); none
    for an intra-node injection (``(i, i)``) or a pair without a route. The change detector tests the entries
    that share a link jointly: a link degrades both ways, and a NIC carries a pair's windows one way and the
    reverse pair's the other.

    >>> from jaxccl.topology import rail
    >>> topo = rail(hosts=2, gpus_per_host=1)
    >>> set(route_links(topo, (0, 1))) == set(route_links(topo, (1, 0)))
    True
    >>> route_links(topo, (0, 0))
    ()
    """
    i, j = entry
    if i == j:
        return ()
    return tuple(frozenset(link) for link in topology.path(i, j) or ())


def _sharers(topology: Any, pairs: set[tuple[int, int]] | None) -> dict[tuple, int]:
    """How many of the inter-node ``pairs`` cross each link (none given: every link counts once)."""
    sharers: dict[tuple, int] = {}
    for s, d in pairs or ():
        if topology.host_of(s) != topology.host_of(d):
            for e in topology.path(s, d):
                sharers[e] = sharers.get(e, 0) + 1
    return sharers


def _injection_link(topology: Any, gpu: int) -> tuple | None:
    """``gpu``'s first link towards the GPUs of its host (None: it is alone on its host)."""
    peers = [j for j in range(topology.num_gpus) if j != gpu and topology.host_of(j) == topology.host_of(gpu)]
    return topology.path(gpu, peers[0])[0] if peers else None


class TelemetryCollector:
    """Folds drained measurement records into the EWMA matrix, one sample per entry and drain (thread-safe).

    Args:
        num_gpus: ranks of the communicator.
        alpha: EWMA smoothing factor in (0, 1].
        scale: emulated bytes/s per real byte/s (``1 / time_scale`` under link emulation).
        noise: spread of log-normal noise multiplied into every record's rate (link emulation's
            ``window_noise``); 0: none.
        seed: the noise's seed; every entry draws its own sequence (the same whichever drain folds it).
    """

    def __init__(self, num_gpus: int, *, alpha: float = 0.5, scale: float = 1.0, noise: float = 0.0, seed: int = 0):
        if not (0 < alpha <= 1):
            raise ArgumentError(f"TelemetryCollector: alpha must be in (0, 1], got {alpha}")
        if not (0 <= noise < 10):
            raise ArgumentError(f"TelemetryCollector: noise must be in [0, 10), got {noise}")
        self.num_gpus = int(num_gpus)
        self.alpha = float(alpha)
        self.scale = float(scale)
        self.noise, self.seed = float(noise), int(seed)
        self._noise_streams: dict[tuple[int, int], np.random.Generator] = {}
        self._lock = threading.Lock()
        self._m = np.full((num_gpus, num_gpus), np.nan)
        self._last = np.full((num_gpus, num_gpus), np.nan)
        self._n = np.zeros((num_gpus, num_gpus), dtype=np.int64)
        self._pending: list[np.ndarray] = []
        self.dropped = 0

    def fold(self, raw: bytes, *, dropped: int = 0) -> int:
        """Decodes ``raw`` records and folds them in; returns how many records were folded."""
        recs = decode(raw, num_gpus=self.num_gpus)
        windows = self._windows_of(recs)
        if self.noise:
            recs = recs.copy()
            for k, (i, j) in enumerate(zip(windows["src"].tolist(), windows["dst"].tolist())):
                rng = self._noise_streams.setdefault((i, j), np.random.default_rng([self.seed, i, j]))
                factor = float(np.exp(self.noise * rng.standard_normal()))
                windows["rate"][k] *= factor
                recs["sum_bw"][k] *= factor
        with self._lock:
            self.dropped = max(self.dropped, int(dropped))
            if windows.size:
                self._pending.append(windows)
                while sum(a.size for a in self._pending) > MAX_PENDING_WINDOWS and len(self._pending) > 1:
                    self._pending.pop(0)
            sums: dict[tuple[int, int], list[float]] = {}
            for i, j, total, count in zip(
                windows["src"].tolist(), windows["dst"].tolist(), recs["sum_bw"].tolist(), recs["count"].tolist()
            ):
                acc = sums.setdefault((i, j), [0.0, 0.0])
                acc[0] += total
                acc[1] += count
            for (i, j), (total, count) in sums.items():
                sample = total / count * self.scale
                old = self._m[i, j]
                self._m[i, j] = sample if np.isnan(old) else self.alpha * sample + (1 - self.alpha) * old
                self._last[i, j] = sample
                self._n[i, j] += 1
        return int(recs.size)

    def _windows_of(self, recs: np.ndarray) -> np.ndarray:
        """The records as raw samples: their matrix entry (intra-node: ``(src, src)``) and mean rate, scaled."""
        w = np.zeros(recs.size, WINDOW_DTYPE)
        w["src"] = recs["src"]
        w["dst"] = np.where(recs["kind"] == INTRA, recs["src"], recs["dst"])
        w["rate"] = recs["sum_bw"] / recs["count"] * self.scale  # decode() checked count >= 1
        w["count"] = recs["count"]
        return w

    def snapshot(self) -> Telemetry:
        """The matrix now, with the raw samples folded since the previous snapshot (which it takes)."""
        with self._lock:
            windows = np.concatenate(self._pending) if self._pending else np.zeros(0, WINDOW_DTYPE)
            self._pending = []
            return Telemetry(
                matrix=self._m.copy(),
                samples=self._n.copy(),
                last=self._last.copy(),
                alpha=self.alpha,
                dropped=self.dropped,
                time_s=time.time(),
                windows=windows,
            )

    def reset(self) -> None:
        with self._lock:
            self._m[:] = np.nan
            self._last[:] = np.nan
            self._n[:] = 0
            self._pending = []
            self.dropped = 0
