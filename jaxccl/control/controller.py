"""The controller: MCCL's slow path (Sec. 3) as a background thread beside training, or driven by the step.

Every ``interval_s`` (or at the end of every training step, see
:meth:`Controller.at_step_end` and :mod:`jaxccl.control.step_driven`) it
drains the communicator's telemetry and runs Algorithm 1
(:mod:`jaxccl.control.algorithm1`) for every active schedule it manages, on
link estimates from one of two detectors (``detector=``):

- ``"cusum"`` (default): a change-point test decides on the raw windows of each
  drain (:mod:`jaxccl.control.detector`); a schedule Algorithm 1 flags on the
  levels after a decided change is ``"detected"`` and ``"confirmed"`` at once,
  so the new schedule can be staged within the step that first measured the
  degradation. At most one swap per ``hold`` launches (a decision meanwhile is
  ``"held"``), and a link counts at its lowest estimate of the last ``hold``
  launches (hysteresis against flapping links). While a change is suspected but
  not yet decided, the schedule for the suspected levels is synthesized ahead
  (speculation); it is used if the decision agrees, else ``"discarded"``.
- ``"ewma"``: Algorithm 1 on the EWMA link matrix ``M``. A flagged schedule is
  ``"detected"`` at its first flagged measurement; once it stayed flagged over
  ``confirm`` fresh samples and the EWMA has settled (``"confirmed"``; a flag
  that goes away first is ``"cleared"``).

On a decision the controller re-synthesizes the schedule warm-started from
the running schedule (AllGather: tree packing, AllToAll: column generation;
ReduceScatter: a fold in the running schedule's order, so that sums stay bitwise equal to
``jax.lax``: the rank-ordered fold of :mod:`jaxccl.synth.ordered_reduce_scatter` in one process,
gloo's tree of :mod:`jaxccl.synth.tree_reduce_scatter` across processes; AllReduce: both of its halves) on
the topology as measured, validates the result with the reference
interpreter, drains once more and aborts if the degradation cleared
meanwhile, and otherwise stages it (the executor switches at the agreed
sequence number, MCCL Sec. 6.2.2). Each stage is an :class:`Event`.

An exception inside the controller never reaches the training step: the
active schedule keeps running, the error is logged (logger
``jaxccl.control``) and recorded as an ``"error"`` event.

Example:
    >>> ctl = Controller(comm, gamma=0.15)                # doctest: +SKIP
    >>> with ctl:                                          # doctest: +SKIP
    ...     train()                                        # the thread runs meanwhile
    >>> [e.kind for e in ctl.events]                       # doctest: +SKIP
    ['detected', 'confirmed', 'synthesized', 'staged', 'activated']

What the detectors decide on, and how fast, is measured by ``benchmarks/control/reaction.py``,
``benchmarks/control/false_alarms.py`` and ``benchmarks/control/flapping.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxccl import synth
from jaxccl.control.algorithm1 import CheckResult, ScheduleProfile, algbw_on, check, nominal_capacities, profile
from jaxccl.control.detector import ChangeDetector
from jaxccl.control.step_driven import StepTimes, at_step_end
from jaxccl.errors import ArgumentError
from jaxccl.schedule.table import compiled_table
from jaxccl.synth.ordered_reduce_scatter import ordered_reduce_scatter
from jaxccl.synth.tree_reduce_scatter import tree_reduce_scatter
from jaxccl.telemetry.matrix import entry_capacities, route_links

__all__ = ["DETECTORS", "REDUCTIONS", "Controller", "Event", "managed_collectives", "measured_topology"]

log = logging.getLogger("jaxccl.control")

Synthesizer = Callable[[Any, Any], Any]  # (measured topology, running schedule) -> new schedule


@dataclasses.dataclass(frozen=True)
class Event:
    """One step of the loop. ``time_ns`` is ``time.monotonic_ns()`` (the executor's clock)."""

    kind: str  # detected | cleared | confirmed | synthesized | aborted | rejected | staged | activated | error
    time_ns: int
    collective: str | None
    detail: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "time_ns": self.time_ns, "collective": self.collective, "detail": dict(self.detail)}


REDUCTIONS = ("reduce_scatter", "all_reduce")
DETECTORS = ("cusum", "ewma")
_ALIASES = {"psum_scatter": "reduce_scatter", "psum": "all_reduce"}


def _default_synthesizers(exact_reductions: bool) -> dict[str, Synthesizer]:
    if exact_reductions:  # the running schedule's fold order (jax.lax's): bitwise equal results
        reduce_scatter: Synthesizer = _same_fold_reduce_scatter
    else:  # the reversed AllGather tree packing, warm-started: faster, sums in tree order
        reduce_scatter = lambda topo, prev: synth.reduce_scatter(topo, previous=_tree_or_none(prev))  # noqa: E731
    return {
        "all_gather": lambda topo, prev: synth.all_gather(topo, previous=_tree_or_none(prev)),
        "all_to_all": lambda topo, prev: synth.all_to_all(topo, previous=prev),
        "reduce_scatter": reduce_scatter,
    }


def _same_fold_reduce_scatter(topo: Any, previous: Any) -> Any:
    """A ReduceScatter for ``topo`` that sums as ``previous`` does: gloo's tree (across processes) or rank order."""
    if _fold_of(previous) == "gloo_tree":
        return tree_reduce_scatter(topo, previous=previous)
    return ordered_reduce_scatter(topo, previous=previous)


def _fold_of(schedule: Any) -> str:
    """The order a reduction schedule sums in: ``"gloo_tree"``, ``"gloo_ring"``, ``"rank"`` or ``""`` (another).

    Across processes ``jax.lax`` sums in gloo's orders and a communicator's default schedules follow
    them (``info["fold"]``); in one process it sums in ascending rank order (``info["ordered_reduction"]``).
    """
    info = getattr(schedule, "info", None) or {}
    if info.get("fold"):
        return str(info["fold"])
    return "rank" if info.get("ordered_reduction") else ""


def _tree_or_none(previous: Any) -> Any:
    """``previous`` if it is a tree packing the synthesizer can warm-start from, else None (start cold)."""
    info = getattr(previous, "info", None) or {}
    return previous if "trees" in info else None


def managed_collectives(collectives: Sequence[str]) -> tuple[str, ...]:
    """The schedules the controller watches for ``collectives``, in order and without repeats.

    ``"all_reduce"`` (or ``"psum"``) stands for its two halves: a communicator
    with a topology and no ``all_reduce`` schedule runs ``psum`` as
    ReduceScatter + AllGather (MCCL Sec. 3), fused into one launch that follows
    every staged half (``Communicator.launched_schedule``), so adapting
    AllReduce is adapting both halves.

    >>> managed_collectives(["psum", "all_gather", "psum_scatter"])
    ('reduce_scatter', 'all_gather')
    """
    out: list[str] = []
    for c in collectives:
        c = _ALIASES.get(c, c)
        for part in ("reduce_scatter", "all_gather") if c == "all_reduce" else (c,):
            if part not in out:
                out.append(part)
    return tuple(out)


def measured_topology(base: Any, estimates: Mapping[tuple, float], *, tolerance: float = 0.05) -> Any:
    """``base`` with the links measured more than ``tolerance`` below nominal set to their estimates.

    Estimates are rounded to 1 % of nominal (so measurement noise does not make
    every topology new), and a degraded link's reverse direction gets the same
    factor when it has one: the tree-packing synthesizer needs every switch's
    ingress to equal its egress, and the gray failures of interest (a NIC, a
    cable) are symmetric. Both choices are ours; MCCL does not say how
    measurements become the optimizer's graph.
    """
    factors: dict[tuple, float] = {}
    for (u, v), m in estimates.items():
        nominal = base.capacity(u, v)
        if m < nominal * (1 - tolerance):
            f = max(round(m / nominal, 2), 0.01)
            for e in ((u, v), (v, u)):
                if base.has_edge(*e):
                    factors[e] = min(factors.get(e, 1.0), f)
    if not factors:
        return base
    return base.with_edges({e: {"capacity": f * base.capacity(*e)} for e, f in factors.items()})


def _close(a: Any, b: Any, base: Any, tolerance: float) -> bool:
    """Whether measured topologies ``a`` and ``b`` (both of :func:`measured_topology` on ``base``) give every link
    capacities within ``tolerance`` of its nominal one of each other: a schedule synthesized for one suits the other.
    """
    if a == b:
        return True
    caps_a, caps_b = nominal_capacities(a), nominal_capacities(b)
    return caps_a.keys() == caps_b.keys() and all(
        abs(caps_a[e] - caps_b[e]) <= tolerance * base.capacity(*e) for e in caps_a
    )


def _samples_of(samples: np.ndarray, pairs: frozenset[tuple[int, int]]) -> int:
    """Measurements of the schedule: the fewest samples of its inter-node pairs (all entries' if it has none)."""
    if not pairs:
        return int(samples.sum())
    return int(min(samples[i, j] for i, j in pairs))


def _degraded_links(caps: Mapping[tuple, float], belief: Any, tolerance: float) -> dict[str, float]:
    """``"u->v": measured / believed`` for the links measured more than ``tolerance`` below what was believed."""
    out = {}
    for (u, v), c in nominal_capacities(belief).items():
        m = caps.get((u, v), c)
        if m < c * (1 - tolerance):
            out[f"{u}->{v}"] = round(m / c, 4)
    return out


def _change_text(c: Any) -> str:
    """``"0->4 x0.50 (1 sample)"``: a decided change of one entry of the link matrix."""
    i, j = c.entry
    where = f"{i} (intra)" if i == j else f"{i}->{j}"
    return f"{where} x{c.ratio:.2f} ({c.samples} sample{'s' if c.samples != 1 else ''})"


@dataclasses.dataclass
class _Managed:
    collective: str
    belief: Any  # the topology the active schedule was synthesized for
    digest: str = ""
    profile: ScheduleProfile | None = None
    staged_version: int = 0
    staged_ns: int = 0
    flagged_in_a_row: int = 0
    detected_ns: int = 0
    samples_seen: int = -1
    last: CheckResult | None = None
    # the change-point path (detector="cusum")
    swapped_at: int | None = None  # launches issued when the last swap took effect
    history: dict[tuple, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)  # link -> (clock, M_a)
    held: bool = False
    change_ns: int = 0
    speculative: tuple[Any, Any, float] | None = None  # (target topology, schedule, synth ms)
    decided: list[Any] = dataclasses.field(default_factory=list)  # the detector's Changes since the last decision
    rejected: Any = None  # the measured topology whose re-synthesis was last rejected (None: none since a swap)


@dataclasses.dataclass(frozen=True)
class _Checked:
    """One Algorithm-1 check against the telemetry, and whether that telemetry can be acted on."""

    result: CheckResult
    caps: dict[tuple, float]  # M_a from the EWMA (nominal where unmeasured)
    settled: bool  # the EWMA agrees with the latest raw samples on every link of the schedule
    fresh: bool  # new samples arrived since the previous check


class Controller:
    """Watches a :class:`~jaxccl.Communicator` with link emulation and re-optimizes its schedules.

    Args:
        comm: the communicator (needs ``topology`` and telemetry, i.e. ``link_emulation=``).
        collectives: which collectives to manage (``"all_gather"``, ``"all_to_all"``,
            ``"reduce_scatter"``, ``"all_reduce"``).
        gamma: Algorithm 1's threshold Γ on the slack deviation.
        interval_s: period of the background loop.
        tolerance: estimates within this fraction of nominal count as healthy when
            building the measured topology.
        confirm: consecutive iterations with new measurements a schedule must be
            flagged before it is re-synthesized (1 = MCCL as written; 2 filters a
            single noisy sample, e.g. the first measurement after a swap; our
            addition against thrashing, which MCCL leaves to future work).
            Iterations that drained no new measurement neither confirm nor clear.
            A flagged schedule is re-synthesized only once the EWMA has settled:
            on every link of the schedule, the estimate from the EWMA and the one
            from the latest raw samples agree within ``tolerance`` of nominal.
            Acting on an EWMA still on its way down would synthesize for a
            capacity the link does not have, and the next samples would flag
            the new schedule again (one failure, several swaps).
        intra_min_drop: a GPU's intra-node injection throughput counts against its
            NVSwitch uplink only when it is this far below nominal (injection is
            also limited by the receivers; our choice, MCCL does not say).
        synthesizers: per collective, ``fn(measured_topology, running_schedule) -> Schedule``
            (default: the warm-started jaxccl synthesizers; for ReduceScatter
            a fold in the running schedule's order: the rank-ordered fold of
            :mod:`jaxccl.synth.ordered_reduce_scatter`, or gloo's tree of
            :mod:`jaxccl.synth.tree_reduce_scatter` when the running schedule
            sums as gloo does across processes).
        exact_reductions: keep every reduction bitwise equal to ``jax.lax``
            (default). A re-synthesized ``reduce_scatter`` is then staged only
            if it sums in the running schedule's order: gloo's tree
            (``info["fold"] == "gloo_tree"``) after a schedule that does, else
            ascending rank order (``info["ordered_reduction"]``); the reference
            interpreter proves either. Any other is ``"rejected"`` and the
            running schedule stays. ``False`` lets the
            faster tree packing (:func:`jaxccl.synth.reduce_scatter`, warm)
            sum in tree order: exact for integers, not for floats.
        min_gain: a re-synthesized schedule is staged only if its predicted algbw on the
            measured topology beats the running schedule's there by this fraction
            (default 5 %); a smaller gain is ``"rejected"``. MCCL stages any better
            schedule; a swap for a few percent that the next noisy samples may undo is
            churn (our addition).
        detector: how a measured change is decided (our addition; MCCL thresholds the EWMA matrix).
            ``"cusum"`` (default): a change-point test on the raw windows of every entry of the
            link matrix (:class:`~jaxccl.control.detector.ChangeDetector`: two one-sided CUSUM tests
            against a noise model learned from the entry's first ``warmup`` samples); the links are
            estimated from the entries' levels (the median of the samples since their last decided
            change), and a schedule is re-synthesized as soon as Algorithm 1 flags it on those
            estimates after a decided change, so one degraded step can be enough. ``confirm`` and the
            EWMA do not apply. ``"ewma"``: the behaviour before (Algorithm 1 on the EWMA matrix,
            ``confirm`` fresh flagged samples and a settled EWMA).
        false_alarm_rate: ``"cusum"``: expected false decisions per sample, entry and direction
            under the learned noise (the test's ``1 / ARL0``).
        hold: ``"cusum"``: launches of the collective after a swap before the next swap may take
            effect (a decision meanwhile is ``"held"``), and how long a link must keep a higher
            estimate before it is believed: each link counts at its lowest estimate of the last
            ``hold`` launches, so a link that flaps is planned for at its worse state until it is
            stable, and a healed one is swapped back after ``hold`` launches.
        warmup: ``"cusum"``: samples each entry learns its noise from before it is tested (a fault
            in the first ``warmup`` steps is only acted on once they are over).

    ``collectives`` may name ``"reduce_scatter"`` (``"psum_scatter"``) and
    ``"all_reduce"`` (``"psum"``), which manages both halves ``psum`` runs as
    (see :func:`managed_collectives`); the communicator must then have no
    ``all_reduce`` schedule installed.
    """

    def __init__(
        self,
        comm: Any,
        *,
        collectives: Sequence[str] = ("all_gather",),
        gamma: float = 0.15,
        interval_s: float = 0.02,
        tolerance: float = 0.05,
        confirm: int = 2,
        intra_min_drop: float = 0.3,
        synthesizers: Mapping[str, Synthesizer] | None = None,
        exact_reductions: bool = True,
        min_gain: float = 0.05,
        detector: str = "cusum",
        false_alarm_rate: float = 1e-6,
        hold: int = 10,
        warmup: int = 5,
    ):
        if comm.topology is None:
            raise ArgumentError("Controller: the communicator has no topology")
        if gamma < 0 or interval_s <= 0:
            raise ArgumentError(f"Controller: need gamma >= 0 and interval_s > 0, got {gamma}, {interval_s}")
        if not 0 <= min_gain < 10:
            raise ArgumentError(f"Controller: need 0 <= min_gain < 10, got {min_gain}")
        if detector not in DETECTORS:
            raise ArgumentError(f"Controller: detector must be one of {DETECTORS}, got {detector!r}")
        if not isinstance(hold, int) or isinstance(hold, bool) or hold < 0:
            raise ArgumentError(f"Controller: hold must be an integer >= 0, got {hold!r}")
        self.detector = detector
        self.hold = hold
        cusum = detector == "cusum"
        self._changes = (
            ChangeDetector(
                false_alarm_rate=false_alarm_rate, warmup=warmup, links_of=functools.partial(route_links, comm.topology)
            )
            if cusum
            else None
        )
        self._fed: Any = None  # the telemetry snapshot the change detector last read
        self._baseline: dict[tuple[int, int], float] = {}  # each entry's first learned level (bytes/s)
        self._calibration: dict[tuple[int, int], float] = {}  # each entry's meter calibration (see _level_caps)
        self.min_gain = float(min_gain)
        self.comm = comm
        self.gamma = float(gamma)
        self.interval_s = float(interval_s)
        self.tolerance = float(tolerance)
        self.intra_min_drop = float(intra_min_drop)
        self.confirm = max(1, int(confirm))
        self.exact_reductions = bool(exact_reductions)
        self.synthesizers = {**_default_synthesizers(self.exact_reductions), **(synthesizers or {})}
        wanted = [_ALIASES.get(c, c) for c in collectives]
        if "all_reduce" in wanted and comm.schedule("all_reduce") is not None:
            raise ArgumentError(
                f"Controller: {comm!r} runs psum with its installed all_reduce schedule "
                f"{comm.schedule('all_reduce').name!r}; the controller adapts psum as ReduceScatter + AllGather, "
                "which runs when no all_reduce schedule is installed (give the communicator a topology)"
            )
        collectives = managed_collectives(collectives)
        unknown = [c for c in collectives if c not in self.synthesizers]
        if unknown:
            raise ArgumentError(f"Controller: no synthesizer for {unknown}; known: {sorted(self.synthesizers)}")
        self._managed = {c: _Managed(c, comm.topology) for c in collectives}
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._iteration = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.resyntheses = 0
        self.step_times = StepTimes()
        self._resynthesis_hooks: list[Callable[[str, Any, Any], None]] = []

    def add_resynthesis_hook(self, hook: Callable[[str, Any, Any], None]) -> None:
        """Calls ``hook(collective, schedule, topology)`` after every re-synthesized schedule is staged, with
        the topology it was synthesized for (the measured, degraded one); on the controller's thread, so keep
        it short (:class:`jaxccl.tune.OnlineTuner` queues it). An exception in it is an ``error`` event."""
        if not callable(hook):
            raise ArgumentError(f"Controller.add_resynthesis_hook: expected a callable, got {hook!r}")
        self._resynthesis_hooks.append(hook)

    @property
    def change_detector(self) -> ChangeDetector | None:
        """The change-point test of ``detector="cusum"`` (its noise models, levels and counters); else None."""
        return self._changes

    # ------------------------------------------------------------------ events
    @property
    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    @property
    def errors(self) -> list[Event]:
        return [e for e in self.events if e.kind == "error"]

    def _emit(self, kind: str, collective: str | None, **detail: Any) -> Event:
        ev = Event(kind, time.monotonic_ns(), collective, detail)
        with self._lock:
            self._events.append(ev)
        log.info("%s %s %s", kind, collective or "", detail)
        return ev

    def to_json(self) -> str:
        return json.dumps([e.to_dict() for e in self.events], default=str)

    # ------------------------------------------------------------------ loop
    def start(self) -> Controller:
        """Starts the background thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="jaxccl-controller", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the thread; waits at most ``timeout`` seconds (a synthesis in progress finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("jaxccl controller did not stop within %.1f s", timeout)
            self._thread = None

    def __enter__(self) -> Controller:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.step()
            self._stop.wait(self.interval_s)

    def step(self) -> list[Event]:
        """One iteration of the slow path; returns the events it produced. Never raises.

        Iterations never overlap: the background thread and the step-end
        callback (:meth:`at_step_end`) may both drive one controller.
        """
        with self._iteration:
            before = len(self.events)
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - the controller must never break training
                log.exception("jaxccl controller step failed")
                self._emit("error", None, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            return self.events[before:]

    def record_error(self, exc: BaseException) -> None:
        """Records ``exc`` as an ``"error"`` event (what :meth:`step` does with its own exceptions)."""
        log.error("jaxccl controller failed: %s: %s", type(exc).__name__, exc)
        self._emit("error", None, error=f"{type(exc).__name__}: {exc}")

    def at_step_end(self, *after: Any, every: int = 1) -> None:
        """Drives the controller from a jitted training step: one :meth:`step` per step, at its end.

        Call inside ``jax.jit``, outside ``jax.shard_map``, with arrays the step
        computes last (its loss, its new parameters); the host time of every
        call is kept in :attr:`step_times` (``.ns``). A re-synthesized schedule
        is staged for the next step. ``every=k`` runs it on every k-th step only.
        See :mod:`jaxccl.control.step_driven`.
        """
        at_step_end(self, *after, times=self.step_times, every=every)

    # ------------------------------------------------------------------ one iteration
    def _estimates(self, tel: Any, m: _Managed) -> dict[tuple, float]:
        base = self.comm.topology
        caps = nominal_capacities(m.belief)
        pairs = set(m.profile.inter_pairs)
        for e, v in tel.link_capacities(base, pairs=pairs, intra_min_drop=self.intra_min_drop).items():
            caps[e] = v
        return caps

    def _settled(self, tel: Any, m: _Managed, caps: Mapping[tuple, float]) -> bool:
        latest = dataclasses.replace(tel, matrix=np.where(np.isnan(tel.last), tel.matrix, tel.last))
        raw = self._estimates(latest, m)
        base = self.comm.topology
        return all(abs(caps[a] - raw[a]) <= self.tolerance * base.capacity(*a) for a in m.profile.link_chunks)

    def _check(self, m: _Managed, tel: Any = None) -> _Checked | None:
        """Algorithm 1 for ``m`` against ``tel`` (the telemetry drained now when None)."""
        schedule = self.comm.schedule(m.collective)
        if schedule is None:
            return None
        if schedule.digest != m.digest:
            m.profile = profile(schedule, m.belief)
            m.digest = schedule.digest
        if tel is None:
            tel = self.comm.telemetry()
        caps = self._estimates(tel, m)
        result = check(m.profile, caps, gamma=self.gamma)
        m.last = result
        seen = _samples_of(tel.samples, m.profile.inter_pairs)
        fresh, m.samples_seen = seen != m.samples_seen, seen
        return _Checked(result, caps, self._settled(tel, m, caps) if result.flagged else True, fresh)

    def _step(self) -> None:
        if self._changes is not None:
            self._step_cusum()
            return
        tel = None  # one drain per iteration serves every managed collective
        for m in self._managed.values():
            self._note_activation(m)
            if m.staged_version:
                continue  # wait until the staged schedule runs before judging again
            if tel is None and self.comm.schedule(m.collective) is not None:
                tel = self.comm.telemetry()
            checked = self._check(m, tel)
            if checked is None or not checked.result.flagged:
                if m.flagged_in_a_row:
                    self._emit("cleared", m.collective, flagged_samples=m.flagged_in_a_row)
                m.flagged_in_a_row = 0
                continue
            if not checked.fresh:
                continue  # the same data again: neither confirms nor clears
            m.flagged_in_a_row += 1
            if m.flagged_in_a_row == 1:
                m.detected_ns = self._detected(m, checked).time_ns
            if m.flagged_in_a_row >= self.confirm and checked.settled:
                self._emit(
                    "confirmed",
                    m.collective,
                    flagged_samples=m.flagged_in_a_row,
                    confirm_ms=(time.monotonic_ns() - m.detected_ns) / 1e6,
                    degraded=_degraded_links(checked.caps, m.belief, self.tolerance),
                    detector="ewma",
                    change_ns=m.detected_ns,
                )
                m.flagged_in_a_row = 0
                self._resynthesize(m, checked.caps, lambda m=m: self._still_flagged(self._check(m)))

    # ------------------------------------------------------------------ the change-point path
    def _feed(self) -> Any:
        """Drains the telemetry and feeds its new raw samples to the change detector (once per snapshot)."""
        tel = self.comm.telemetry()
        if tel is not self._fed:
            self._fed = tel
            changes = self._changes.update(tel.windows, now_ns=time.monotonic_ns())
            for c in changes:
                if c.kind == "learned":
                    self._baseline.setdefault(c.entry, c.after)
            if changes:
                for m in self._managed.values():
                    m.decided = [*m.decided, *changes][-1024:]
        return tel

    def _level_caps(self, tel: Any, m: _Managed, levels: Mapping[tuple[int, int], float]) -> dict[tuple, float]:
        """``M_a`` from the detector's levels (its robust per-entry estimates) instead of the EWMA, calibrated:
        an entry first learned at or above the rate its links allow, or below it by no more than its noise
        (3 standard errors of the learned level), counts every level scaled by ``allowed / first level``: a meter
        that reads high (sends that complete in socket and qdisc buffers across processes) or a level learned a
        little low by chance then reads the links' capacity, and a fall the same fraction of it. An entry first
        learned further below what its links allow is taken as measured: a fault present from the start.
        The factor is fixed when the entry is first used after learning (with the schedule then running)."""
        new = [e for e in levels if e in self._baseline and e not in self._calibration]
        if new:
            allowed = entry_capacities(self.comm.topology, new, pairs=set(m.profile.inter_pairs))
            for e in new:
                first, cap = self._baseline[e], allowed.get(e)
                noise = 3 * self._changes.sigma(e) / math.sqrt(self._changes.warmup)
                self._calibration[e] = cap / first if cap and math.log(cap / first) <= noise else 1.0
        matrix = np.full(tel.matrix.shape, np.nan)
        for (i, j), v in levels.items():  # the entries of the communicator's own windows: always in range
            matrix[i, j] = v * self._calibration.get((i, j), 1.0)
        return self._estimates(dataclasses.replace(tel, matrix=matrix), m)

    def _pessimistic(self, m: _Managed, caps: dict[tuple, float], clock: int) -> dict[tuple, float]:
        """Each link at the lowest estimate of its last ``hold`` launches: a drop counts at once, a rise once it
        has held for ``hold`` launches (a flapping link is planned for at its worse state)."""
        out = dict(caps)
        for a, v in caps.items():
            past = m.history.setdefault(a, [])
            if not past or past[-1][1] != v:
                past.append((clock, v))
            keep = [i for i, (c, _) in enumerate(past) if c >= clock - self.hold]
            past[:] = past[max(0, (keep[0] if keep else len(past)) - 1) :]  # the value in force at the window's start
            out[a] = min(x for _, x in past)
        return out

    def _step_cusum(self) -> None:
        tel = None
        for m in self._managed.values():
            self._note_activation(m)
            if m.staged_version:
                continue
            schedule = self.comm.schedule(m.collective)
            if schedule is None:
                continue
            tel = tel if tel is not None else self._feed()
            if schedule.digest != m.digest:
                m.profile = profile(schedule, m.belief)
                m.digest = schedule.digest
            clock, measured, caps = self._cusum_caps(m, tel)
            result = check(m.profile, caps, gamma=self.gamma)
            m.last = result
            if not result.flagged:
                self._speculate(m, tel)
                if m.held or m.detected_ns:
                    self._emit("cleared", m.collective, flagged_samples=0)
                m.held, m.detected_ns = False, 0
                if caps == measured:  # else a rise is held back: its decision stands until it counts
                    m.decided.clear()
                continue
            if not m.decided and not m.held:
                continue  # no decided change behind the flag (e.g. an entry still learning its noise model)
            if m.rejected is not None and measured_topology(self.comm.topology, caps, tolerance=self.tolerance) == (
                m.rejected
            ):
                m.decided.clear()  # e.g. an entry re-learned the level already acted on: the same answer again
                continue
            if not m.detected_ns:
                m.detected_ns = self._detected(m, _Checked(result, caps, True, True)).time_ns
                shifts = [c for c in m.decided if c.kind == "shift"] or m.decided
                m.change_ns = min((c.change_ns for c in shifts), default=m.detected_ns)
            if m.swapped_at is not None and clock < m.swapped_at + self.hold:
                if not m.held:
                    self._emit("held", m.collective, until_launch=m.swapped_at + self.hold, launch=clock)
                m.held = True
                continue
            plan = self._with_suspects(m, tel, caps)
            self._emit(
                "confirmed",
                m.collective,
                flagged_samples=max((c.samples for c in m.decided), default=0),
                confirm_ms=(time.monotonic_ns() - m.detected_ns) / 1e6,
                degraded=_degraded_links(plan, m.belief, self.tolerance),
                detector="cusum",
                change_ns=m.change_ns,
                changes=[_change_text(c) for c in m.decided[-8:]],
            )
            m.held, m.detected_ns = False, 0
            m.decided.clear()
            self._resynthesize(m, plan, lambda m=m: self._still_flagged_cusum(m))

    def _cusum_caps(self, m: _Managed, tel: Any) -> tuple[int, dict[tuple, float], dict[tuple, float]]:
        """The collective's launch clock, ``M_a`` from the detector's levels, and the same held pessimistic."""
        clock = int(self.comm.swap_state(m.collective).get("issued", 0))
        measured = self._level_caps(tel, m, self._changes.levels(learning=False))
        return clock, measured, self._pessimistic(m, measured, clock)

    def _with_suspects(self, m: _Managed, tel: Any, caps: dict[tuple, float]) -> dict[tuple, float]:
        """``caps`` lowered to the provisional levels of the entries suspected to have fallen (past ``suspect`` x
        ``h``, not decided yet): at a decision, the schedule is planned for every fall under way. Two NICs cut
        together are rarely decided on the same sample; planned for the first alone, a schedule moves load onto
        the second. A suspect the detector clears leaves a link planned a little low, which the next decision
        corrects."""
        levels = self._changes.levels(learning=False)
        fallen = {e: v for e, v in self._changes.suspects().items() if e in levels and v < levels[e]}
        if not fallen:
            return caps
        lowered = self._level_caps(tel, m, {**levels, **fallen})
        return {a: min(v, lowered.get(a, v)) for a, v in caps.items()}

    def _still_flagged_cusum(self, m: _Managed) -> bool:
        _, _, caps = self._cusum_caps(m, self._feed())
        return check(m.profile, caps, gamma=self.gamma).flagged

    def _speculate(self, m: _Managed, tel: Any) -> None:
        """With suspects (changes not decided yet), synthesizes for their provisional levels ahead of the decision;
        a speculation the detector does not confirm is discarded."""
        suspects = self._changes.suspects()
        if not suspects:
            if m.speculative is not None:
                self._emit("discarded", m.collective, reason="the suspected change was not confirmed")
                m.speculative = None
            return
        caps = self._level_caps(tel, m, {**self._changes.levels(learning=False), **suspects})
        target = measured_topology(self.comm.topology, caps, tolerance=self.tolerance)
        if not check(m.profile, caps, gamma=self.gamma).flagged or (
            m.speculative is not None and m.speculative[0] == target
        ):
            return
        t0 = time.perf_counter()
        new = self.synthesizers[m.collective](target, self.comm.schedule(m.collective))
        m.speculative = (target, new, (time.perf_counter() - t0) * 1e3)

    def _detected(self, m: _Managed, checked: _Checked) -> Event:
        r = checked.result
        return self._emit(
            "detected",
            m.collective,
            max_delta=r.max_delta,
            worst_link=str(r.worst),
            x_min=r.x_min,
            degraded=_degraded_links(checked.caps, m.belief, self.tolerance),
        )

    def _note_activation(self, m: _Managed) -> None:
        if not m.staged_version or self.comm.backend not in ("cpu", "cuda"):
            m.staged_version = 0
            return
        st = self.comm.swap_state(m.collective)
        if st["current_version"] >= m.staged_version:
            self._emit(
                "activated",
                m.collective,
                version=st["current_version"],
                at_seq=st["last_swap_seq"],
                activated_ns=st["last_swap_ns"],
                wait_ms=(st["last_swap_ns"] - m.staged_ns) / 1e6,
            )
            m.staged_version = 0
            m.swapped_at = int(st.get("issued", 0))

    @staticmethod
    def _still_flagged(checked: _Checked | None) -> bool:
        return checked is not None and checked.result.flagged

    def _resynthesize(self, m: _Managed, caps: dict[tuple, float], still_flagged: Callable[[], bool]) -> None:
        """Synthesizes for the measured topology (or takes the speculation made for it), re-checks with
        ``still_flagged`` and stages the result if it gains enough."""
        coll = m.collective
        running = self.comm.schedule(coll)
        target = measured_topology(self.comm.topology, caps, tolerance=self.tolerance)
        speculative, m.speculative = m.speculative, None
        if speculative is not None and _close(speculative[0], target, self.comm.topology, self.tolerance):
            new = speculative[1]  # synthesized for the suspected levels; judged on the decided ones
            predicted = algbw_on(new, target)
            self._emit(
                "synthesized",
                coll,
                synth_ms=0.0,
                speculative_ms=speculative[2],
                predicted_algbw=predicted,
                name=new.name,
            )
        else:
            t0 = time.perf_counter()
            new = self.synthesizers[coll](target, running)
            predicted = new.algbw
            self._emit(
                "synthesized", coll, synth_ms=(time.perf_counter() - t0) * 1e3, predicted_algbw=predicted, name=new.name
            )
        self.resyntheses += 1
        if not still_flagged():
            self._emit("aborted", coll, reason="the degradation cleared during re-synthesis")
            return
        stale = algbw_on(running, target)
        if predicted is not None and predicted <= stale * (1 + self.min_gain) * (1 + 1e-6):
            reason = (
                "no better than the running schedule"
                if predicted <= stale * (1 + 1e-6)
                else (f"predicted gain below min_gain ({self.min_gain:.0%})")
            )
            self._emit("rejected", coll, reason=reason, stale_algbw=stale, predicted_algbw=predicted)
            m.belief, m.digest, m.rejected = target, "", target
            return
        wanted = _fold_of(running) if _fold_of(running) in ("gloo_tree", "gloo_ring") else "rank"
        if coll in REDUCTIONS and self.exact_reductions and _fold_of(new) != wanted:
            self._emit(
                "rejected",
                coll,
                reason=f"sums in another order ({_fold_of(new) or 'unordered'}) than the running schedule and "
                f"jax.lax ({wanted}); results would differ in the last bits",
                name=new.name,
            )
            m.belief, m.digest, m.rejected = target, "", target
            return
        t1 = time.perf_counter()
        new.validate()  # with info["ordered_reduction"] or info["fold"], also proves the fold
        table = compiled_table(new, num_slots=8)  # memoized: staging checks the table against it for free
        t2 = time.perf_counter()
        version = self.comm.stage_validated(coll, new, table=table, defer_psum=True)
        t3 = time.perf_counter()
        m.belief, m.digest, m.rejected = target, "", None
        m.staged_ns = time.monotonic_ns()
        m.staged_version = version
        self._emit(
            "staged",
            coll,
            version=m.staged_version,
            dispatch_ms=(t2 - t1) * 1e3,
            swap_ms=(t3 - t2) * 1e3,
            predicted_algbw=predicted,
            stale_algbw=stale,
        )
        self.comm.fuse_psum()  # psum follows the new half once it is swapped (until then it ran the earlier pair)
        for hook in self._resynthesis_hooks:
            try:
                hook(coll, new, target)
            except Exception as e:  # noqa: BLE001 - a listener must never break the loop
                self.record_error(e)
