"""The real-socket demo's detector: each process's measured NIC uplink, one decider, one agreed swap.

Every step, each process turns the transport's completion times of its sends to other processes
into one rate (:func:`uplink_rate`: the bytes over the time at least one send was in flight) and
publishes it in the job's key-value store; process 0's :class:`UplinkWatch` compares each
process's rate with that process's own healthy baseline, flags a drop that is that NIC's own,
confirms it after a few samples, re-synthesizes the AllGather on the Topology with that NIC's
measured capacity (as the demo's ``view`` shows it to the synthesizer), and keeps the result when
the simulator predicts it faster on the degraded links. Every process then stages the same
schedule at one agreed sequence number
(:func:`jaxccl.runtime.multiprocess.stage_agreed`). :func:`control_round` is that exchange.

This is the demo's own loop, built from the pieces that exist (``TransportMeter`` records, the
key-value store, ``stage_agreed``); a communicator-level closed loop across processes replaces
:class:`UplinkWatch` and :func:`control_round` without changing the demo's steps.

>>> round(uplink_rate([(0, 4, 1 << 20, 0, 1_000_000), (1, 5, 1 << 20, 500_000, 2_000_000)]) / 2**20)
1000
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxccl.errors import DeadlineError
from jaxccl.runtime.multiprocess import MIN_MEASURED_BYTES, TransportMeter

KEY_PREFIX = "jaxccl/demo_network"
KV_TIMEOUT_S = 120.0


@dataclasses.dataclass
class Event:
    """One thing the detector did: ``kind`` (detected, confirmed, synthesized, kept, staged, activated) and detail."""

    kind: str
    time_ns: int
    detail: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form.

        >>> Event("detected", 5, {"process": 0}).to_dict()
        {'kind': 'detected', 'time_ns': 5, 'process': 0}
        """
        return {"kind": self.kind, "time_ns": self.time_ns, **self.detail}


def uplink_rate(records: Sequence[tuple[int, int, int, int, int]], *, min_bytes: int = MIN_MEASURED_BYTES) -> float:
    """Bytes/s of one process's sends to other processes: their bytes over the union of their in-flight times.

    ``records`` are ``TransportMeter.drain()``'s (src rank, dst rank, bytes, post ns, done ns); sends
    smaller than ``min_bytes`` complete in buffers and are left out. NaN when nothing was measured.
    """
    kept = [(0, 1, int(b), int(post), int(done)) for _, _, b, post, done in records if b >= min_bytes]
    return float(TransportMeter.pair_rates(kept, 2)[0, 1])


class UplinkWatch:
    """Process 0's decider: per-process baselines, flagged drops, confirmation, re-synthesis.

    Args:
        topo: the layout's Topology (healthy).
        uplinks: the Topology link of each process's NIC uplink, by process.
        schedule: the AllGather running now.
        bytes_per_rank: one rank's AllGather input (for the simulator's comparison).
        calibration: samples per process that form its healthy baseline (median).
        window: each decision looks at the median of a process's last ``window`` samples (one slow
            step on a loaded host is not a failure).
        drop: a rate below ``drop`` x the process's baseline may be flagged (see :meth:`observe`).
        relative: ... and below ``relative`` x the median ratio over all processes.
        confirm: consecutive flagged steps before re-synthesis.
        gain: keep a re-synthesized schedule only if simulated ``gain`` x faster on the degraded links.
        view: the Topology the synthesizer sees for a degraded one (default: itself).
        max_chunks: the synthesizer's limit on chunks per shard (small messages cost on sockets).
    """

    def __init__(
        self,
        topo: Any,
        uplinks: Sequence[tuple[Any, Any]],
        schedule: Any,
        bytes_per_rank: float,
        *,
        calibration: int = 3,
        window: int = 1,
        drop: float = 0.5,
        relative: float = 0.8,
        confirm: int = 2,
        gain: float = 1.1,
        view: Callable[[Any], Any] | None = None,
        max_chunks: int = 8,
    ):
        self.view = view if view is not None else (lambda t: t)
        self.max_chunks = max_chunks
        self.topo, self.uplinks, self.schedule = topo, list(uplinks), schedule
        self.bytes_per_rank = float(bytes_per_rank)
        self.calibration, self.window, self.drop = calibration, window, drop
        self.confirm, self.gain, self.relative = confirm, gain, relative
        self.samples: list[list[float]] = [[] for _ in self.uplinks]
        self.flagged = [0] * len(self.uplinks)
        self.acted: set[int] = set()
        self.events: list[Event] = []

    def baseline(self, process: int) -> float:
        """The median of the process's first ``calibration`` measured samples (NaN until there are enough)."""
        finite = [v for v in self.samples[process] if math.isfinite(v)][: self.calibration]
        return sorted(finite)[len(finite) // 2] if len(finite) == self.calibration else math.nan

    def observe(self, step: int, rates: Sequence[float]) -> Any:
        """Takes one step's rates (bytes/s per process); returns a schedule to stage, or ``None``.

        A process's NIC is flagged when its rate (the median of its last ``window`` samples) is
        below ``drop`` x its baseline and below ``relative`` x the median of every process's
        ratio: when all NICs slow down together the cause is shared (a slow peer, a busy host),
        not one link.
        """
        if len(rates) != len(self.uplinks):
            raise ValueError(f"UplinkWatch: {len(rates)} rates for {len(self.uplinks)} processes")
        ratios = []
        for p, sample in enumerate(rates):
            base = self.baseline(p)
            self.samples[p].append(float(sample))
            recent = [v for v in self.samples[p][-self.window :] if math.isfinite(v)]
            rate = sorted(recent)[len(recent) // 2] if recent else math.nan
            ratios.append((rate / base, rate, base) if math.isfinite(base) and math.isfinite(rate) else None)
        measured = sorted(r[0] for r in ratios if r is not None)
        if not measured:
            return None
        typical = measured[len(measured) // 2]
        decision = None
        for p, got in enumerate(ratios):
            if got is None or len(self.samples[p]) <= self.calibration:
                continue
            ratio, rate, base = got
            if ratio >= self.drop or ratio >= self.relative * typical:
                self.flagged[p] = 0
                continue
            self.flagged[p] += 1
            u, v = self.uplinks[p]
            detail = {"step": step, "process": p, "degraded": {f"{u}->{v}": ratio}, "rate": rate, "base": base}
            if self.flagged[p] == 1 and p not in self.acted:
                self._log("detected", {**detail, "typical_ratio": typical})
            if self.flagged[p] == self.confirm and p not in self.acted and decision is None:
                self._log("confirmed", {**detail, "flagged_samples": self.confirm})
                decision = self._resynthesize(p, ratio, step)
        return decision

    def _resynthesize(self, process: int, fraction: float, step: int) -> Any:
        from jaxccl import sim, synth

        self.acted.add(process)
        u, v = self.uplinks[process]
        degraded = self.topo.degrade(u, v, capacity=self.topo.capacity(u, v) * fraction, both=False)
        t0 = time.perf_counter()
        candidate = synth.allgather(self.view(degraded), max_chunks=self.max_chunks)
        synth_ms = (time.perf_counter() - t0) * 1e3
        stale = sim.run(degraded, self.schedule, self.bytes_per_rank).algbw
        new = sim.run(degraded, candidate, self.bytes_per_rank).algbw
        detail = {
            "step": step,
            "process": process,
            "synth_ms": synth_ms,
            "predicted_algbw": float(candidate.algbw),
            "simulated_stale": float(stale),
            "simulated_new": float(new),
        }
        if new < self.gain * stale:
            self._log("kept", detail)  # no schedule routes around this link: keep the one running
            return None
        self._log("synthesized", detail)
        self.schedule, self.topo = candidate, degraded
        return candidate

    def _log(self, kind: str, detail: dict[str, Any]) -> None:
        self.events.append(Event(kind, time.monotonic_ns(), detail))


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise DeadlineError("the demo's control round needs jax.distributed.initialize(...) first")
    return client


def kv_get(key: str, timeout_s: float = KV_TIMEOUT_S) -> str:
    """Reads ``key`` from the job's key-value store, waiting up to ``timeout_s``.

    Raises:
        DeadlineError: no process set it in time.
    """
    try:
        return _client().blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:  # XLA raises its own error type for a missed deadline
        raise DeadlineError(f"{key} was not published within {timeout_s} s: {e}") from e


def kv_set(key: str, value: str) -> None:
    """Publishes ``value`` under ``key`` in the job's key-value store."""
    _client().key_value_set(key, value)


def control_round(step: int, rate: float, process_id: int, num_processes: int, watch: UplinkWatch | None) -> Any:
    """One step's exchange: every process publishes its uplink rate; process 0 decides; all read the decision.

    Returns the schedule every process must stage now (the same in each), or ``None``.
    """
    from jaxccl.schedule import Schedule

    kv_set(f"{KEY_PREFIX}/rate/{step}/{process_id}", json.dumps(rate))
    if process_id == 0:
        if watch is None:
            raise ValueError("control_round: process 0 needs the UplinkWatch")
        rates = [float(json.loads(kv_get(f"{KEY_PREFIX}/rate/{step}/{p}"))) for p in range(num_processes)]
        chosen = watch.observe(step, rates)
        kv_set(f"{KEY_PREFIX}/decision/{step}", chosen.to_json() if chosen is not None else "")
        return chosen
    text = kv_get(f"{KEY_PREFIX}/decision/{step}")
    return Schedule.from_json(text) if text else None
