"""A change-point test on the raw measurement windows: decide on the samples, not on a settled EWMA.

Every entry of the link matrix (a GPU pair across hosts, or a GPU's intra-node injection) gets a
noise model learned from its first ``warmup`` samples: the median ``mu`` and a robust spread
``sigma`` of its log rates (the largest of the MAD-, IQR- and 5-95 %-range estimates, re-estimated
from the last 64 in-control residuals, moderated by the spread pooled over every entry of its kind
-- intra-node injections, or pairs across hosts, which share most of their noise, the hosts' load
-- and raised to a 99 % upper confidence bound for the degrees of freedom behind it, at least
``sigma_floor``: a spread from a few samples alone is often far too small). From then on every
sample ``x`` is standardized, ``z = (log x - mu) / sigma``, and fed to pairs of one-sided CUSUM
statistics (Page's test; a downward one for degradations, an upward one for recoveries)::

    S_down <- max(0, S_down - z - k)      S_up <- max(0, S_up + z - k)

Each pair of tests is a *chart* with the reference value ``k`` half the shift it is tuned to, in
units of ``sigma``: the smallest shift worth detecting (``min_shift``, as a fraction of the rate)
and the larger ``CHART_SHIFTS`` (a halved and a quartered rate), which decide a large fall in
fewer samples than the ``min_shift`` chart, which accumulates small ones (several CUSUMs in
parallel, after Lorden). A statistic above its ``h`` is a decided change. ``h`` follows from the
false-alarm parameter: :func:`cusum_threshold` solves Siegmund's approximation of the in-control
average run length for ``ARL0 = charts / false_alarm_rate`` samples, so ``false_alarm_rate`` is the
expected number of false decisions per sample and entry and direction, all charts together, under
the learned (Gaussian) noise.

On a decision the change point is where the statistic last left 0, and the entry's new level is
the median of the samples since then (a robust estimate of the degraded, or recovered, rate).
The entry then re-learns its centre from the next samples (its spread stays the learned one),
so a level measured on one sample is refined by the following ones. A large shift decides on one
sample: at ``sigma = 2 %`` and ``false_alarm_rate = 1e-6`` a single window 10 % below the learned
rate is enough, which is what lets the controller act at the step after the first degraded one.

Joint tests (``links_of``: an entry's links): entries whose routes cross one link (a NIC carries a
pair's windows one way and its reverse pair's the other; a link degrades both ways) are also tested
together. Each update, the members of a link's group that were tested give ``Z = sum(z) / sqrt(m)``, standardized by the
spread learned for ``Z`` (pooled over every group, at least 1: independent members), and fed to
the same charts with ``k`` half the shift's ``Z``. A shift of ``d`` spreads in ``m`` members is
``d sqrt(m)`` in ``Z``: across processes, where every pair gives one sample per step, a NIC cut to
half its rate is decided a step earlier from its two pairs than from either. A group's decision
decides every member with samples since the group's change point (their medians are the new
levels).

:meth:`ChangeDetector.suspects` lists entries whose statistic is past ``suspect`` x ``h`` but
not decided yet, with their provisional level: the controller synthesizes for them speculatively.

Example:
    >>> import numpy as np
    >>> det = ChangeDetector(warmup=4)
    >>> def windows(rate):
    ...     w = np.zeros(1, WINDOW_DTYPE); w["src"], w["dst"], w["rate"], w["count"] = 0, 4, rate, 1
    ...     return w
    >>> rates = [50e9, 50.2e9, 49.9e9, 50e9, 50.1e9]
    >>> [[c.kind for c in det.update(windows(r), now_ns=t)] for t, r in enumerate(rates)]
    [[], [], [], ['learned'], []]
    >>> [(c.entry, round(c.after / 1e9, 1), c.samples) for c in det.update(windows(25e9), now_ns=9)]
    [((0, 4), 25.0, 1)]
    >>> round(det.level((0, 4)) / 1e9, 1)
    25.0
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Iterable

import numpy as np
from scipy.optimize import brentq
from scipy.stats import chi2

from jaxccl.errors import ArgumentError
from jaxccl.telemetry.matrix import WINDOW_DTYPE

__all__ = ["Change", "ChangeDetector", "cusum_threshold"]

Entry = tuple[int, int]
NOISE_SAMPLES = 64  # the noise model's spread is re-estimated from an entry's last 64 in-control residuals
POOL_SAMPLES = 1024  # the pooled spread of a kind of entries: from the last 1024 in-control residuals of them all
POOL_WEIGHT = 20  # the pooled spread counts as this many degrees of freedom beside an entry's own residuals
CHART_SHIFTS = (0.5, 0.75)  # CUSUM charts beside min_shift's: tuned to halved and quartered rates
SPREAD_CONFIDENCE = 0.99  # the spread is raised to this upper bound (x3.7 at 5 samples alone, x1.5 with the pool)
LEARNING_LEVEL_SAMPLES = 3  # an entry's level while it learns its noise model: the median of its last 3 samples
GROUP_POOL = "groups"  # the pool of in-control joint statistics of every group
K_GRID = 100  # reference values k are taken on a grid of exp(1/100) steps (~1 %), each with its own threshold


@functools.cache
def _spread_bound(n: int) -> float:
    """The factor that raises a spread estimated from ``n`` samples to its ``SPREAD_CONFIDENCE`` upper bound.

    >>> [round(_spread_bound(n), 2) for n in (5, 16, 64)]
    [3.67, 1.69, 1.26]
    """
    dof = max(n - 1, 1)
    return math.sqrt(dof / chi2.ppf(1 - SPREAD_CONFIDENCE, dof))


def cusum_threshold(false_alarm_rate: float, k: float) -> float:
    """The CUSUM threshold ``h`` whose in-control average run length is ``1 / false_alarm_rate`` samples.

    Siegmund's approximation for a unit-variance Gaussian, reference value ``k > 0``:
    ``ARL0 = (exp(2 k b) - 2 k b - 1) / (2 k^2)`` with ``b = h + 1.166``.

    >>> round(cusum_threshold(1e-6, 0.5), 2)
    11.96
    >>> cusum_threshold(1e-6, 4.0) < 2
    True
    """
    if not 0 < false_alarm_rate < 1:
        raise ArgumentError(f"cusum_threshold: false_alarm_rate must be in (0, 1), got {false_alarm_rate}")
    if not (k > 0 and math.isfinite(k)):
        raise ArgumentError(f"cusum_threshold: k must be > 0 and finite, got {k}")
    arl0 = 1.0 / false_alarm_rate

    def excess(h: float) -> float:
        a = 2 * k * (h + 1.166)
        return (math.expm1(a) - a) / (2 * k * k) - arl0

    if excess(0.0) >= 0:
        return 0.0
    hi = 1.0
    while excess(hi) < 0:
        hi *= 2
    return float(brentq(excess, 0.0, hi, xtol=1e-6))


@dataclasses.dataclass(frozen=True)
class Change:
    """A decided change of one entry's rate.

    Attributes:
        entry: ``(src, dst)`` of the link matrix (``src == dst``: intra-node injection).
        before: the level before the change (bytes/s).
        after: the median of the samples since the change point (bytes/s).
        samples: how many samples that median is of.
        change_ns: ``now_ns`` of the update that brought the first sample after the change point.
        decided_ns: ``now_ns`` of the update that decided.
        kind: ``"shift"`` (a decided change) or ``"learned"`` (the entry finished learning its noise model,
            or re-learning its centre after a decided change: its level, ``before == after``, stands on
            ``samples`` samples).
    """

    entry: Entry
    before: float
    after: float
    samples: int
    change_ns: int
    decided_ns: int
    kind: str = "shift"

    @property
    def ratio(self) -> float:
        return self.after / self.before


@dataclasses.dataclass
class _EntryState:
    log_samples: list[float] = dataclasses.field(default_factory=list)  # learning: since start / last change
    mu: float = math.nan
    sigma: float = math.nan  # the spread of the entry's own residuals (not yet raised to its confidence bound)
    learning_since: int = 0
    held: list[float] = dataclasses.field(default_factory=list)  # residuals waiting while the downward test runs
    unmodelled: int = 0  # residuals added since the spread was last estimated
    residuals: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=NOISE_SAMPLES))
    stats: list[float] = dataclasses.field(default_factory=list)  # per chart: down, up (see ChangeDetector)
    runs: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)  # each statistic's since it left 0

    def restart(self, tests: int) -> None:
        self.stats = [0.0] * tests
        self.runs = [[] for _ in range(tests)]


@dataclasses.dataclass
class _GroupState:
    stats: list[float]  # per chart: down, up (as an entry's)
    runs: list[list[dict[Entry, tuple[float, int]]]]  # per statistic, since it left 0: each update's member samples
    thresholds: list[float] = dataclasses.field(default_factory=list)  # per chart, at the last test


class ChangeDetector:
    """Per-entry two-sided CUSUM on log window rates with a learned noise model; see the module.

    Args:
        false_alarm_rate: expected false decisions per sample, entry and direction (``1 / ARL0``).
        min_shift: the smallest relative change of a rate worth detecting fast (sets ``k``).
        warmup: samples an entry learns its noise model from before it is tested.
        sigma_floor: the smallest spread of log rates assumed (emulated links can be exact).
        suspect: fraction of ``h`` past which an undecided statistic makes the entry a suspect.
        links_of: an entry's links (any hashable names; none: the entry is tested alone); the entries that share
            a link are also tested jointly, see the module.

    Attributes:
        tested: per entry, samples tested against its learned noise model (each by the two one-sided tests).
        shifts: per entry, decided shifts (``shifts[e] / (2 * tested[e])``: the measured decision rate per test).

    Raises:
        ArgumentError: a parameter is out of range.
    """

    def __init__(
        self,
        *,
        false_alarm_rate: float = 1e-6,
        min_shift: float = 0.15,
        warmup: int = 5,
        sigma_floor: float = 0.02,
        suspect: float = 0.5,
        links_of: Callable[[Entry], Iterable[Hashable]] | None = None,
    ):
        if not 0 < false_alarm_rate < 1:
            raise ArgumentError(f"ChangeDetector: false_alarm_rate must be in (0, 1), got {false_alarm_rate}")
        if not 0 < min_shift < 1:
            raise ArgumentError(f"ChangeDetector: min_shift must be in (0, 1), got {min_shift}")
        if not isinstance(warmup, int) or warmup < 2:
            raise ArgumentError(f"ChangeDetector: warmup must be an integer >= 2, got {warmup!r}")
        if not sigma_floor > 0 or not 0 < suspect < 1:
            raise ArgumentError(
                f"ChangeDetector: need sigma_floor > 0 and 0 < suspect < 1, got {sigma_floor}, {suspect}"
            )
        self.false_alarm_rate = float(false_alarm_rate)
        self.min_shift = float(min_shift)
        self.warmup = warmup
        self.sigma_floor = float(sigma_floor)
        self.suspect = float(suspect)
        # the charts' shifts in log units: min_shift, and the larger CHART_SHIFTS (a large shift decides in fewer
        # samples on a chart tuned to it); each chart gets an equal share of the false-alarm rate
        shifts = sorted({self.min_shift, *(c for c in CHART_SHIFTS if c > self.min_shift)})
        self._shifts = [-math.log1p(-c) for c in shifts]
        self._chart_rate = self.false_alarm_rate / len(self._shifts)
        self._entries: dict[Entry, _EntryState] = {}
        # in-control residuals of every entry of a kind (intra-node?), and the groups' joint statistics (GROUP_POOL)
        self._pools: dict[bool | str, collections.deque] = {}
        self._pooled: dict[bool | str, tuple[float, int]] = {}  # each pool's spread and size, at the last update
        self._thresholds: dict[int, tuple[float, float]] = {}  # k's grid step -> (k, h)
        self.tested: collections.Counter[Entry] = collections.Counter()
        self.shifts: collections.Counter[Entry] = collections.Counter()
        self._links_of = links_of
        self._groups: dict[Hashable, set[Entry]] = {}  # per link: the entries seen whose routes cross it
        self._group_states: dict[frozenset[Entry], _GroupState] = {}  # by the members tested together
        self._batch: dict[Entry, tuple[float, float, float]] = {}  # this update's tested entries: z, y, sigma
        self.group_tests = 0
        self.group_shifts = 0

    # ------------------------------------------------------------------ the model
    def _k_h(self, sigma: float, chart: int = 0) -> tuple[float, float]:
        """Reference value and threshold of ``chart`` for an entry of spread ``sigma``."""
        return self._k_h_of(self._shifts[chart] / sigma / 2)

    def _k_h_of(self, k: float) -> tuple[float, float]:
        """A chart's reference value near ``k`` (on a grid of 1 % steps: the memo stays small, while spreads and
        joint statistics change at every update) and its threshold."""
        key = round(math.log(k) * K_GRID)
        if key not in self._thresholds:
            grid_k = math.exp(key / K_GRID)
            self._thresholds[key] = (grid_k, cusum_threshold(self._chart_rate, grid_k))
        return self._thresholds[key]

    def threshold(self, entry: Entry) -> float:
        """``h`` of ``entry``'s ``min_shift`` chart (NaN while it learns its noise model)."""
        st = self._entries.get(entry)
        return math.nan if st is None or math.isnan(st.sigma) else self._k_h(self._sigma(entry, st))[1]

    def sigma(self, entry: Entry) -> float:
        """The spread of ``entry``'s log rates its tests use (NaN while it learns): see :meth:`_sigma`."""
        st = self._entries.get(entry)
        return math.nan if st is None or math.isnan(st.sigma) else self._sigma(entry, st)

    def _sigma(self, entry: Entry, st: _EntryState) -> float:
        """The spread the entry's tests use: its own residuals' spread moderated by its kind's pooled one (every
        entry of its kind: intra-node injections, or pairs across hosts, which share most of their noise, the
        hosts' load), the pool weighing as ``POOL_WEIGHT`` degrees of freedom beside the entry's own, raised to
        the ``SPREAD_CONFIDENCE`` upper bound for the degrees of freedom behind it, at least ``sigma_floor``. A
        spread from an entry's few samples alone is often far too small (or large); its own residuals take over
        as they accumulate."""
        dof = max(len(st.residuals) - 1, 1)
        var = st.sigma**2 * dof
        pooled = self._pooled.get(entry[0] == entry[1])
        weight = 0 if pooled is None else min(POOL_WEIGHT, pooled[1] - len(st.residuals) - 1)  # others' residuals
        if weight > 0:
            var, dof = var + weight * pooled[0] ** 2, dof + weight
        return max(math.sqrt(var / dof) * _spread_bound(dof + 1), self.sigma_floor)

    def level(self, entry: Entry) -> float | None:
        """The entry's current rate estimate (bytes/s): its learned or re-learned centre; None if unseen."""
        st = self._entries.get(entry)
        if st is None:
            return None
        if math.isnan(st.sigma):  # still learning: the latest samples, so a change meanwhile shows at once
            return math.exp(float(np.median(st.log_samples[-LEARNING_LEVEL_SAMPLES:])))
        return math.exp(st.mu)

    def levels(self, *, learning: bool = True) -> dict[Entry, float]:
        """Every seen entry's current rate estimate (bytes/s); ``learning=False``: only the entries that learned
        their noise model (a learning entry's level is the median of its last few samples, not a decided one)."""
        out = {}
        for e, st in self._entries.items():
            v = self.level(e)
            if v is not None and (learning or not math.isnan(st.sigma)):
                out[e] = v
        return out

    def suspects(self) -> dict[Entry, float]:
        """Entries past ``suspect`` x ``h`` but undecided (alone, or in a link's joint test), with the median of
        their samples since the change point."""
        out = {}
        for e, st in self._entries.items():
            if math.isnan(st.sigma):
                continue
            sigma = self._sigma(e, st)
            for t, (stat, run) in enumerate(zip(st.stats, st.runs)):
                if run and stat > self.suspect * self._k_h(sigma, t // 2)[1]:
                    out[e] = math.exp(float(np.median([x for x, _ in run])))
        for gs in self._group_states.values():  # a link's group past suspect x h: each member's samples since
            for t, (stat, run) in enumerate(zip(gs.stats, gs.runs)):
                if run and gs.thresholds and stat > self.suspect * gs.thresholds[t // 2]:
                    for e in {e for batch in run for e in batch}:
                        out.setdefault(e, math.exp(float(np.median([b[e][0] for b in run if e in b]))))
        return out

    # ------------------------------------------------------------------ samples
    def update(self, windows: np.ndarray, *, now_ns: int) -> list[Change]:
        """Feeds raw samples (``WINDOW_DTYPE`` rows: :attr:`jaxccl.telemetry.Telemetry.windows`); returns decisions.

        Samples of one entry are taken in order; non-positive or non-finite rates are ignored. An entry that
        finishes learning its noise model, or re-learning its centre, reports a ``"learned"`` change (its level).
        """
        if windows.dtype != WINDOW_DTYPE:
            raise ArgumentError(f"ChangeDetector.update: need WINDOW_DTYPE rows, got dtype {windows.dtype}")
        changes = []
        for src, dst, rate in zip(windows["src"].tolist(), windows["dst"].tolist(), windows["rate"].tolist()):
            if not (rate > 0 and math.isfinite(rate)):
                continue
            change = self._sample((int(src), int(dst)), math.log(rate), int(now_ns))
            if change is not None:
                changes.append(change)
        changes += self._test_groups(int(now_ns))
        self._batch = {}
        for kind, pool in self._pools.items():  # the next samples' tests see this update's residuals
            if len(pool) >= self.warmup:
                self._pooled[kind] = (self._spread(pool), len(pool))
        return changes

    def _sample(self, entry: Entry, y: float, now_ns: int) -> Change | None:
        st = self._entries.get(entry)
        if st is None:
            st = self._entries[entry] = _EntryState()
            st.restart(2 * len(self._shifts))
            for link in self._links_of(entry) if self._links_of is not None else ():
                self._groups.setdefault(link, set()).add(entry)
        if math.isnan(st.sigma):  # learning the noise model
            st.log_samples.append(y)
            st.learning_since = st.learning_since or now_ns
            if len(st.log_samples) < self.warmup:
                return None
            st.mu = float(np.median(st.log_samples))
            st.residuals.extend(x - st.mu for x in st.log_samples)
            self._pool(entry).extend(st.residuals)
            st.sigma = self._spread(st.residuals)
            st.log_samples = []
            level = math.exp(st.mu)
            return Change(entry, level, level, self.warmup, st.learning_since, now_ns, kind="learned")
        relearned = None
        if 0 < len(st.log_samples) < self.warmup:
            st.log_samples.append(y)  # re-learning the centre after a decided change
            st.mu = float(np.median(st.log_samples))
            if len(st.log_samples) == self.warmup:  # the centre stands on warmup samples again: report it
                level = math.exp(st.mu)
                relearned = Change(entry, level, level, self.warmup, st.learning_since, now_ns, kind="learned")
        self.tested[entry] += 1
        sigma = self._sigma(entry, st)
        z = (y - st.mu) / sigma
        decided = None
        for chart in range(len(self._shifts)):
            k, h = self._k_h(sigma, chart)
            for i, step in ((2 * chart, -z), (2 * chart + 1, z)):  # the downward and the upward test
                st.stats[i] = max(0.0, st.stats[i] + step - k)
                st.runs[i] = [*st.runs[i], (y, now_ns)] if st.stats[i] > 0 else []
                if decided is None and st.stats[i] > h:
                    decided = i
        if decided is not None:
            self._batch.pop(entry, None)
            return self._decide(entry, st.runs[decided], decided % 2 == 1, now_ns)
        self._batch[entry] = (z, y, sigma)
        self._learn_noise(entry, st, y - st.mu)
        return relearned

    # ------------------------------------------------------------------ joint tests
    def _test_groups(self, now_ns: int) -> list[Change]:
        """Tests every group on this update's samples of its members (those tested and not decided alone)."""
        changes: list[Change] = []
        seen = set()
        for group in self._groups.values():
            members = frozenset(e for e in group if e in self._batch)
            if len(members) < 2 or members in seen:
                continue
            seen.add(members)
            changes += self._test_group(members, now_ns)
        return changes

    def _test_group(self, members: frozenset[Entry], now_ns: int) -> list[Change]:
        pooled = self._pooled.get(GROUP_POOL)
        zs = [self._batch[e][0] for e in members]
        joint = sum(zs) / math.sqrt(len(zs))
        if pooled is None:  # learning the joint statistic's spread first
            self._pools.setdefault(GROUP_POOL, collections.deque(maxlen=POOL_SAMPLES)).append(joint)
            return []
        spread = max(1.0, pooled[0] * _spread_bound(pooled[1]))
        gs = self._group_states.get(members)
        if gs is None:
            tests = 2 * len(self._shifts)
            gs = self._group_states[members] = _GroupState([0.0] * tests, [[] for _ in range(tests)])
        self.group_tests += 1
        samples = {e: (self._batch[e][1], now_ns) for e in members}
        decided = None
        gs.thresholds = []
        for chart, shift in enumerate(self._shifts):
            k, h = self._k_h_of(sum(shift / self._batch[e][2] for e in members) / math.sqrt(len(members)) / spread / 2)
            gs.thresholds.append(h)
            for i, step in ((2 * chart, -joint / spread), (2 * chart + 1, joint / spread)):
                gs.stats[i] = max(0.0, gs.stats[i] + step - k)
                gs.runs[i] = [*gs.runs[i], samples] if gs.stats[i] > 0 else []
                if decided is None and gs.stats[i] > h:
                    decided = i
        if decided is None:
            if not any(gs.stats[0::2]):
                self._pools[GROUP_POOL].append(joint)
            return []
        run = gs.runs[decided]
        self.group_shifts += 1
        for e in members:  # decided: no other link's group tests them again in this update
            del self._batch[e]
        up = decided % 2 == 1
        return [self._decide(e, [b[e] for b in run if e in b], up, now_ns) for e in sorted(members)]

    def _pool(self, entry: Entry) -> collections.deque:
        return self._pools.setdefault(entry[0] == entry[1], collections.deque(maxlen=POOL_SAMPLES))

    def _learn_noise(self, entry: Entry, st: _EntryState, residual: float) -> None:
        """Adds an in-control residual to the noise model. While the downward test runs, its samples wait: they are
        noise if the test returns to 0, the new level if it decides (a spread learned from them would widen with
        the fall it is to detect)."""
        if any(st.stats[0::2]):
            st.held.append(residual)
            return
        st.residuals.extend([*st.held, residual])
        self._pool(entry).extend([*st.held, residual])
        st.unmodelled += len(st.held) + 1
        st.held = []
        if st.unmodelled >= 8:
            st.unmodelled = 0
            st.sigma = self._spread(st.residuals)

    def _spread(self, residuals: Iterable[float]) -> float:
        """The spread of log rates: the largest of 1.4826 x MAD, IQR / 1.349 and the 5-95 % range / 3.29 (each is
        sigma for Gaussian noise; the last ones also see multimodal noise, e.g. a rate that depends on how many
        transfers happened to overlap); :meth:`_sigma` bounds it."""
        a = np.asarray(list(residuals))
        q5, q25, q50, q75, q95 = np.quantile(a, (0.05, 0.25, 0.5, 0.75, 0.95))
        mad = 1.4826 * float(np.median(np.abs(a - q50)))
        return max(mad, float(q75 - q25) / 1.349, float(q95 - q5) / 3.29)

    def _decide(self, entry: Entry, run: list[tuple[float, int]], up: bool, now_ns: int) -> Change:
        """A decided change of ``entry`` (by its own test, or its link's joint one): its new level is the median of
        ``run`` (its samples since the change point, with their times). The joint tests of its links start over:
        their statistics hold its samples from before the change."""
        st = self._entries[entry]
        st.held = []  # the downward run's samples belong to the new level, not to the noise
        if up:  # so do the upward run's, which went into the noise model as they came
            for _ in range(min(len(run), len(st.residuals))):
                st.residuals.pop()
        for members in [m for m in self._group_states if entry in m]:
            del self._group_states[members]
        before = math.exp(st.mu)
        after = [x for x, _ in run]
        st.log_samples = list(after)
        st.learning_since = run[0][1]
        st.mu = float(np.median(after))
        st.restart(2 * len(self._shifts))
        self.shifts[entry] += 1
        return Change(entry, before, math.exp(st.mu), len(after), run[0][1], now_ns)
