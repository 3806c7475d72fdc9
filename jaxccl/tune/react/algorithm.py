"""REACT's feedback loop: Algorithm 1 of App. A.5 (one batch) and the loop over batches of Sec. 5.4.2.

:func:`apply_transforms` is ``ApplyTransforms()`` of Algorithm 1: after a
batch of ``B`` epochs it computes the ``B + 1`` critical paths, detects the
congested flows (Eq. 1, 2), takes the devices of congested flows on critical
paths, sorted by how many congested flows touch them, and for each tries
viable transforms (:func:`~jaxccl.tune.react.transforms.viable_set`, degree
pruned, best tier first, random within a tier) until one is predicted by the
analytic model to be at least ``1 + epsilon`` times faster on the (updated)
critical paths; at most ``Kt`` trials in all. After an accepted transform the
problem devices are recomputed on the new pattern's critical paths (model
weights) among the congested device pairs. A steady-congested device that was
moved is no longer a swap partner for others.

:func:`run_react` is the loop over batches (Sec. 5.4.2): run a batch with the
current pattern, transform, run a batch with the new pattern, keep it only if
its measured time is at least ``1 + tau_r`` times lower (else revert and do not
propose the same transforms again), for at most ``E_max`` exploratory rounds;
``Kt`` grows every batch. A round that accepts no transform runs the next
batch with the same pattern; the loop stops early when a batch shows no
congestion.

Example:
    >>> import numpy as np
    >>> from jaxccl.topology import fat_tree
    >>> from jaxccl.tune.react.measure import ExternalFlows, SimulatorRunner, pattern_measurer
    >>> from jaxccl.tune.react.pattern import double_binary_tree_pattern
    >>> runner = SimulatorRunner(16 << 20, external=[ExternalFlows(8, 3, 2)])
    >>> res = run_react(double_binary_tree_pattern(8), pattern_measurer(runner, fat_tree(1, 9)), seed=0)
    >>> res.improvement > 0.13, res.pattern.to_schedule().validate() is not None
    (True, True)
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from jaxccl.tune.react.critical_path import CriticalPath, critical_paths
from jaxccl.tune.react.detect import DELTA1, DELTA2, Congestion, detect_congestion
from jaxccl.tune.react.model import EPSILON, HISTORY_EPOCHS, FlowHistory, accepts, predicted_gain
from jaxccl.tune.react.pattern import Pattern
from jaxccl.tune.react.transforms import Candidate, Transform, viable_set

__all__ = [
    "Decision",
    "ReactConfig",
    "ReactResult",
    "RoundLog",
    "TransformOutcome",
    "apply_transforms",
    "problem_devices",
    "run_react",
    "steady_congested_devices",
]


@dataclasses.dataclass(frozen=True)
class ReactConfig:
    """REACT's parameters (Table 3); defaults are the paper's.

    Attributes:
        batch_epochs: ``B``, epochs per batch (6).
        delta1: steady-congestion threshold of Eq. 1 (0.2).
        delta2: erratic-congestion threshold of Eq. 2 (0.15).
        trials: ``Kt``, transform trials per batch (15).
        trials_growth: added to ``Kt`` after every batch (the paper grows it
            without saying by how much).
        max_accepted: ``Kmax`` of Alg. 1, accepted transforms per batch (``None``: only ``Kt`` bounds them).
        epsilon: minimum predicted gain of a transform (5 %).
        horizon: ``H``, epochs of flow history kept (60).
        explore_rounds: ``E_max``, exploratory rounds (5).
        tau_r: minimum measured gain to keep a new pattern (5 %).
        unknown: how the model prices unseen device pairs (``"median"``: the paper).
    """

    batch_epochs: int = 6
    delta1: float = DELTA1
    delta2: float = DELTA2
    trials: int = 15
    trials_growth: int = 5
    max_accepted: int | None = None
    epsilon: float = EPSILON
    horizon: int = HISTORY_EPOCHS
    explore_rounds: int = 5
    tau_r: float = 0.05
    unknown: str = "median"


@dataclasses.dataclass(frozen=True)
class Decision:
    """One trial of Alg. 1: a transform for a congested device, its predicted times and whether it was taken."""

    device: int
    transform: Transform
    tier: int
    reduces_degree: bool
    predicted_before: float
    predicted_after: float
    accepted: bool

    @property
    def predicted_gain(self) -> float:
        return predicted_gain(self.predicted_before, self.predicted_after)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "transform": self.transform.to_dict(),
            "tier": self.tier,
            "reduces_degree": self.reduces_degree,
            "predicted_gain": self.predicted_gain,
            "accepted": self.accepted,
        }


@dataclasses.dataclass(frozen=True)
class TransformOutcome:
    """What :func:`apply_transforms` did.

    Attributes:
        pattern: the new pattern (the input one if nothing was accepted).
        decisions: every trial, in order.
        congestion: the detection result on the batch.
        paths: the ``B + 1`` critical paths of the input pattern.
        problem_devices: the sorted congested devices on critical paths.
        predicted_before / predicted_after: ``E_D`` of the input and the output pattern.
    """

    pattern: Pattern
    decisions: tuple[Decision, ...]
    congestion: Congestion
    paths: tuple[CriticalPath, ...]
    problem_devices: tuple[int, ...]
    predicted_before: float
    predicted_after: float

    @property
    def accepted(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.accepted)


def problem_devices(pattern: Pattern, flows: Iterable[int], congested: Iterable[int]) -> list[int]:
    """Endpoints of ``flows`` sorted by the number of ``congested`` flows touching them (most first).

    Ties are broken by device id.
    """
    flows = list(flows)
    congested = np.asarray(sorted(set(congested)), dtype=np.int64)
    nodes = set(pattern.src_device[flows].tolist()) | set(pattern.dst_device[flows].tolist()) if flows else set()
    count = np.zeros(pattern.num_ranks, dtype=np.int64)
    if congested.size:
        np.add.at(count, pattern.src_device[congested], 1)
        np.add.at(count, pattern.dst_device[congested], 1)
    return sorted(nodes, key=lambda d: (-int(count[d]), d))


def steady_congested_devices(pattern: Pattern, steady: Iterable[int]) -> set[int]:
    """Devices all of whose incoming, or all of whose outgoing, flows are steady congested (Sec. 5.4.1)."""
    steady = set(steady)
    out = set()
    for d in range(pattern.num_ranks):
        for direction in ("in", "out"):
            flows = pattern.incident_flows(d, direction)
            if flows.size and all(int(f) in steady for f in flows):
                out.add(d)
    return out


def _pick(cands: list[Candidate], rng: random.Random) -> Candidate | None:
    if not cands:
        return None
    top = min(c.tier for c in cands)
    return rng.choice([c for c in cands if c.tier == top])


def apply_transforms(
    pattern: Pattern,
    batch: np.ndarray,
    history: FlowHistory,
    *,
    config: ReactConfig = ReactConfig(),
    rng: random.Random | None = None,
    trials: int | None = None,
    exclude: Iterable[int] = (),
    blocked: Iterable[tuple] = (),
) -> TransformOutcome:
    """Algorithm 1 (``ApplyTransforms``) on one batch.

    Args:
        pattern: ``G``, the pattern the batch ran with.
        batch: ``[B, F]`` completion time of each flow in each epoch.
        history: ``D``, the flow history (the batch should already be recorded in it).
        config: the parameters.
        rng: randomness for the choice within a tier (seeded for reproducibility).
        trials: ``Kt`` for this batch (default ``config.trials``).
        exclude: devices never to use as swap partners.
        blocked: transform keys not to try (e.g. reverted in an earlier round).

    Returns:
        A :class:`TransformOutcome`; its ``pattern`` passes the bitvector check
        and has no flow of higher degree than ``pattern``.
    """
    rng = rng or random.Random(0)
    kt = config.trials if trials is None else trials
    kmax = config.max_accepted if config.max_accepted is not None else kt
    batch = np.asarray(batch, dtype=np.float64)
    paths = critical_paths(pattern, batch)
    cong = detect_congestion(
        batch, sizes=pattern.flow_size, degrees=pattern.flow_degree, delta1=config.delta1, delta2=config.delta2
    )
    on_paths = {f for p in paths for f in p.flows}
    hot = sorted(cong.flows & on_paths)
    queue = problem_devices(pattern, hot, cong.flows)
    first_queue = tuple(queue)
    congested_pairs = {pattern.flow_devices(f) for f in cong.flows}
    steady_devices = steady_congested_devices(pattern, cong.steady)
    excluded = set(exclude)
    blocked = set(blocked)
    current = pattern
    t_cur = t_start = history.predicted_time(pattern, paths) if paths else 0.0
    decisions: list[Decision] = []
    u = accepted = 0
    while queue and u < kt and accepted < kmax:
        x = queue.pop(0)
        u += 1
        cong_now = [
            f for f in range(current.num_flows) if current.flow_devices(f) in congested_pairs
        ]  # flows of the current pattern on congested device pairs
        if not cong_now:
            continue
        cands = viable_set(current, x, congested_flows=cong_now, exclude=excluded, blocked=blocked)
        while u < kt:
            c = _pick(cands, rng)
            if c is None:
                break
            u += 1
            cands.remove(c)
            t_new = history.predicted_time(c.pattern, paths)
            ok = accepts(t_cur, t_new, config.epsilon)
            decisions.append(Decision(x, c.transform, c.tier, c.reduces_degree, t_cur, t_new, ok))
            if not ok:
                continue
            current, t_cur = c.pattern, t_new
            accepted += 1
            blocked.add(c.transform.key)
            if x in steady_devices:
                excluded.add(x)
            new_paths = critical_paths(current, history.estimate(current)[None, :])
            flows = [f for p in new_paths for f in p.flows if current.flow_devices(f) in congested_pairs]
            cong_cur = [f for f in range(current.num_flows) if current.flow_devices(f) in congested_pairs]
            queue = [d for d in problem_devices(current, flows, cong_cur) if d != x or x not in excluded]
            break
    return TransformOutcome(current, tuple(decisions), cong, tuple(paths), first_queue, t_start, t_cur)


# ----------------------------------------------------------------------------- loop
PatternMeasure = Callable[[Pattern], tuple[float, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class RoundLog:
    """One exploratory round of :func:`run_react`."""

    round: int
    outcome: TransformOutcome
    time_before: float
    time_after: float | None
    kept: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "problem_devices": list(self.outcome.problem_devices),
            "steady": len(self.outcome.congestion.steady),
            "erratic": len(self.outcome.congestion.erratic),
            "decisions": [d.to_dict() for d in self.outcome.decisions],
            "predicted_before": self.outcome.predicted_before,
            "predicted_after": self.outcome.predicted_after,
            "time_before": self.time_before,
            "time_after": self.time_after,
            "kept": self.kept,
        }


@dataclasses.dataclass(frozen=True)
class ReactResult:
    """Outcome of :func:`run_react`.

    Attributes:
        initial: the input pattern; ``pattern``: the one REACT settled on.
        time_initial / time_final: mean measured epoch time of each (seconds).
        rounds: the exploratory rounds.
        epochs: epochs measured in all.
    """

    initial: Pattern
    pattern: Pattern
    time_initial: float
    time_final: float
    rounds: tuple[RoundLog, ...]
    epochs: int

    @property
    def improvement(self) -> float:
        """Algorithm-bandwidth gain ``time_initial / time_final - 1``."""
        return self.time_initial / self.time_final - 1.0

    @property
    def transforms(self) -> list[Transform]:
        """The accepted transforms of the kept rounds, in order."""
        return [d.transform for r in self.rounds if r.kept for d in r.outcome.accepted]

    def to_dict(self) -> dict[str, Any]:
        return {
            "time_initial": self.time_initial,
            "time_final": self.time_final,
            "improvement": self.improvement,
            "epochs": self.epochs,
            "transforms": [t.to_dict() for t in self.transforms],
            "rounds": [r.to_dict() for r in self.rounds],
        }


def _batch(measure: PatternMeasure, pattern: Pattern, epochs: int) -> tuple[float, np.ndarray]:
    times, rows = [], []
    for _ in range(epochs):
        t, fct = measure(pattern)
        times.append(float(t))
        rows.append(np.asarray(fct, dtype=np.float64))
    return float(np.mean(times)), np.stack(rows)


def run_react(
    pattern: Pattern,
    measure: PatternMeasure,
    *,
    config: ReactConfig = ReactConfig(),
    seed: int = 0,
) -> ReactResult:
    """REACT's loop over batches (Sec. 5.4.2) from ``pattern``.

    Args:
        pattern: ``G0``.
        measure: runs one epoch of a pattern; returns ``(collective time, fct[F])``
            (see :func:`jaxccl.tune.react.measure.pattern_measurer`).
        config: REACT's parameters.
        seed: seeds the random choices among equally ranked transforms.
    """
    rng = random.Random(seed)
    history = FlowHistory(config.horizon, unknown=config.unknown)
    b = config.batch_epochs
    cur = pattern
    t_cur, batch = _batch(measure, cur, b)
    history.record_batch(cur, batch)
    t0 = t_cur
    epochs = b
    rounds: list[RoundLog] = []
    blocked: set[tuple] = set()
    excluded: set[int] = set()
    for r in range(config.explore_rounds):
        out = apply_transforms(
            cur,
            batch,
            history,
            config=config,
            rng=rng,
            trials=config.trials + r * config.trials_growth,
            exclude=excluded,
            blocked=blocked,
        )
        if not out.accepted:
            rounds.append(RoundLog(r, out, t_cur, None, False))
            if not out.congestion:
                break  # nothing to fix
            t_cur, batch = _batch(measure, cur, b)  # the next batch runs the same pattern; Kt grows
            history.record_batch(cur, batch)
            epochs += b
            continue
        t_new, new_batch = _batch(measure, out.pattern, b)
        history.record_batch(out.pattern, new_batch)
        epochs += b
        kept = accepts(t_cur, t_new, config.tau_r)
        rounds.append(RoundLog(r, out, t_cur, t_new, kept))
        if kept:
            steady = steady_congested_devices(cur, out.congestion.steady)
            excluded |= {d.device for d in out.accepted if d.device in steady}
            cur, t_cur, batch = out.pattern, t_new, new_batch
        else:
            blocked |= {d.transform.key for d in out.accepted}
    return ReactResult(pattern, cur, t0, t_cur, tuple(rounds), epochs)
