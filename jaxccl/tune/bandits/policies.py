"""Bandit policies of NCCL-BOT (App. C), one instance per context, over the arms that passed its filter.

Every policy sees rewards ``r = mu_min / t`` (Eq. 1) and keeps per-arm
statistics: ``means`` (the estimator's mean reward), ``counts`` (pulls plus
the warm-start pseudo-count) and ``pulls`` (real pulls). Warm start (App. C)
seeds ``means[a] = r(mu_hat(a))`` backed by ``counts[a] = pseudo_count`` for
every arm with a defined prediction; ``pseudo_count = 0`` or ``warm=False``
is the cold start.

* :class:`Auto` -- the cost model's argmin; never learns (App. C.1).
* :class:`UCB1` -- ``argmax means + alpha sqrt(2 ln N / n)`` (Eq. 6), the
  featured policy. It is deterministic: unpulled arms (cold start only) go
  first in arm order instead of at random, and ties go to the lowest arm
  index, so replicas with equal statistics pick equal arms (App. F).
* :class:`ETC` -- explore-then-commit: ``m`` pulls of every arm (uniformly
  among the arms still short of them), the first ``skip`` samples of each
  arm discarded, then commit to the best mean; always cold (App. C.8).
* :class:`EpsGreedy` -- explore uniformly with probability ``epsilon``
  (``epsilon / sqrt(t)`` with decay), else the best mean (App. C.7).
* :class:`Softmax` -- sample ``exp(mean / tau)`` (``tau / sqrt(N)`` with decay) (App. C.13).
* :class:`KLUCB` -- Bernoulli KL-UCB with exploration constant ``c``;
  means clamped to ``[0, 1]`` (App. C.6).

Random policies draw from a :class:`random.Random` seeded per context; its
state is part of :meth:`Policy.state`, so a replica that imports the state
draws the same arms.

Example:
    >>> p = make_policy({"policy": "ucb1", "alpha": 0.1, "pseudo_count": 2.0}, [1.0, 0.8])
    >>> p.select()
    0
    >>> p.update(0, 0.5); p.update(0, 0.5); p.select()
    1
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from jaxccl.tune.arms import TuneError
from jaxccl.tune.bandits.estimators import Estimator, SampleMean, make_estimator

__all__ = ["ETC", "KLUCB", "POLICIES", "UCB1", "Auto", "EpsGreedy", "Policy", "Softmax", "make_policy"]


def _number(value: Any, name: str, *, lo: float = 0.0, lo_open: bool = False, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TuneError(f"{name} must be a finite number, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        raise TuneError(
            f"{name} must be {'>' if lo_open else '>='} {lo}{f' and <= {hi}' if hi < math.inf else ''}, got {value!r}"
        )
    return float(value)


def _argmax(values: Sequence[float]) -> int:
    """Index of the largest value; ties go to the lowest index."""
    best, arg = -math.inf, 0
    for i, v in enumerate(values):
        if v > best:
            best, arg = v, i
    return arg


class Policy:
    """Base class: per-arm statistics, warm start, estimator, RNG, state round trip.

    Args:
        priors: per offered arm, ``r(mu_hat(a))`` or ``None`` when the model has no prediction.
        pseudo_count: warm-start weight ``nu`` of each prior (virtual pulls).
        warm: seed the statistics from the priors.
        estimator: the mean estimator (name, mapping or instance; default sample mean).
        seed: RNG seed (random policies only).
    """

    name = ""
    stochastic = False
    uses_prior = True

    def __init__(
        self,
        priors: Sequence[float | None],
        *,
        pseudo_count: float = 1.0,
        warm: bool = True,
        estimator: Any = None,
        seed: int = 0,
    ):
        if len(priors) == 0:
            raise TuneError(f"policy {self.name!r} needs at least one arm")
        self.k = len(priors)
        self.priors = [None if p is None else _number(p, "prior reward", lo=0.0, lo_open=True) for p in priors]
        self.pseudo_count = _number(pseudo_count, "pseudo_count")
        self.warm = bool(warm) and self.uses_prior
        self.estimator: Estimator = make_estimator(estimator)
        seeded = self.warm and self.pseudo_count > 0
        self.means = [p if seeded and p is not None else 0.0 for p in self.priors]
        self.counts = [self.pseudo_count if seeded and p is not None else 0.0 for p in self.priors]
        self.pulls = [0] * self.k
        self.t = 0
        self.seed = int(seed)
        self.rng = random.Random(self.seed) if self.stochastic else None

    # ------------------------------------------------------------------ API
    def select(self) -> int:
        """Index of the arm to play next."""
        raise NotImplementedError

    def update(self, arm: int, reward: float) -> None:
        """Feeds back the reward of one pull of ``arm``."""
        if not 0 <= arm < self.k:
            raise TuneError(f"arm index {arm} out of range 0..{self.k - 1}")
        self.pulls[arm] += 1
        self.counts[arm] += 1.0
        self.means[arm] = self.estimator.update(self.means[arm], self.counts[arm], float(reward))
        self.t += 1

    def hyper(self) -> dict[str, Any]:
        """The policy's configuration (what :func:`make_policy` takes)."""
        out: dict[str, Any] = {"policy": self.name}
        if self.uses_prior:
            out.update(pseudo_count=self.pseudo_count, warm=self.warm)
        out["estimator"] = self.estimator.to_dict()
        return out

    def state(self) -> dict[str, Any]:
        """The replicated statistics (JSON-ready)."""
        out: dict[str, Any] = {
            "means": list(self.means),
            "counts": list(self.counts),
            "pulls": list(self.pulls),
            "t": self.t,
        }
        if self.rng is not None:
            version, internal, gauss = self.rng.getstate()
            out["rng"] = [version, list(internal), gauss]
        return out

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state`."""
        try:
            means = [float(v) for v in state["means"]]
            counts = [float(v) for v in state["counts"]]
            pulls = [int(v) for v in state["pulls"]]
            t = int(state["t"])
        except (KeyError, TypeError, ValueError) as e:
            raise TuneError(f"malformed policy state: {e!r}") from None
        if not len(means) == len(counts) == len(pulls) == self.k:
            raise TuneError(f"policy state has {len(means)} arms, the policy {self.k}")
        self.means, self.counts, self.pulls, self.t = means, counts, pulls, t
        if self.rng is not None:
            try:
                version, internal, gauss = state["rng"]
                self.rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
            except (KeyError, TypeError, ValueError) as e:
                raise TuneError(f"malformed RNG state: {e!r}") from None

    # --------------------------------------------------------------- helpers
    def _unpulled(self) -> list[int]:
        return [a for a in range(self.k) if self.counts[a] <= 0.0]

    def _uniform(self, arms: Sequence[int]) -> int:
        assert self.rng is not None
        return arms[self.rng.randrange(len(arms))]


class Auto(Policy):
    """The cost model's argmin (largest prior reward); arms without a prediction are never chosen."""

    name = "auto"

    def select(self) -> int:
        defined = [(p, -i) for i, p in enumerate(self.priors) if p is not None]
        return -max(defined)[1] if defined else 0

    def update(self, arm: int, reward: float) -> None:
        if not 0 <= arm < self.k:
            raise TuneError(f"arm index {arm} out of range 0..{self.k - 1}")
        self.pulls[arm] += 1
        self.t += 1


class UCB1(Policy):
    """Deterministic UCB1 with a tuned exploration coefficient ``alpha`` (Eq. 6)."""

    name = "ucb1"

    def __init__(self, priors: Sequence[float | None], *, alpha: float = 0.093, **kwargs: Any):
        super().__init__(priors, **kwargs)
        self.alpha = _number(alpha, "ucb1 alpha")

    def select(self) -> int:
        for a in range(self.k):
            if self.counts[a] <= 0.0:
                return a
        log_n = math.log(max(sum(self.counts), 1.0))
        a_coef = self.alpha
        return _argmax([m + a_coef * math.sqrt(2.0 * log_n / c) for m, c in zip(self.means, self.counts)])

    def hyper(self) -> dict[str, Any]:
        return {**super().hyper(), "alpha": self.alpha}


class ETC(Policy):
    """Explore-then-commit: ``m`` kept samples per arm (after ``skip`` discarded ones), then the best mean."""

    name = "etc"
    stochastic = True
    uses_prior = False

    def __init__(self, priors: Sequence[float | None], *, m: int = 1, skip: int = 0, **kwargs: Any):
        kwargs.pop("pseudo_count", None)
        kwargs.pop("warm", None)
        super().__init__(priors, pseudo_count=0.0, warm=False, estimator=SampleMean(), **kwargs)
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise TuneError(f"etc m must be an integer >= 1, got {m!r}")
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise TuneError(f"etc skip must be an integer >= 0, got {skip!r}")
        self.m, self.skip = m, skip
        self.committed = -1

    def select(self) -> int:
        if self.committed >= 0:
            return self.committed
        short = [a for a in range(self.k) if self.pulls[a] < self.m + self.skip]
        if short:
            return self._uniform(short)
        self.committed = _argmax(self.means)
        return self.committed

    def update(self, arm: int, reward: float) -> None:
        if not 0 <= arm < self.k:
            raise TuneError(f"arm index {arm} out of range 0..{self.k - 1}")
        self.pulls[arm] += 1
        self.t += 1
        if self.pulls[arm] > self.skip:
            self.counts[arm] += 1.0
            self.means[arm] = self.estimator.update(self.means[arm], self.counts[arm], float(reward))

    def hyper(self) -> dict[str, Any]:
        return {"policy": self.name, "m": self.m, "skip": self.skip}

    def state(self) -> dict[str, Any]:
        return {**super().state(), "committed": self.committed}

    def load_state(self, state: Mapping[str, Any]) -> None:
        super().load_state(state)
        self.committed = int(state.get("committed", -1))


class EpsGreedy(Policy):
    """epsilon-greedy on the mean rewards (unpulled cold arms first, in arm order)."""

    name = "eps_greedy"
    stochastic = True

    def __init__(self, priors: Sequence[float | None], *, epsilon: float = 0.05, decay: bool = False, **kwargs: Any):
        super().__init__(priors, **kwargs)
        self.epsilon = _number(epsilon, "eps_greedy epsilon", hi=1.0)
        self.decay = bool(decay)

    def select(self) -> int:
        cold = self._unpulled()
        if cold:
            return cold[0]
        eps = self.epsilon / math.sqrt(self.t + 1) if self.decay else self.epsilon
        assert self.rng is not None
        if eps > 0 and self.rng.random() < eps:
            return self.rng.randrange(self.k)
        return _argmax(self.means)

    def hyper(self) -> dict[str, Any]:
        return {**super().hyper(), "epsilon": self.epsilon, "decay": self.decay}


class Softmax(Policy):
    """Boltzmann exploration with temperature ``tau`` (optionally decayed as ``tau / sqrt(N)``)."""

    name = "softmax"
    stochastic = True

    def __init__(self, priors: Sequence[float | None], *, tau: float = 0.1, decay: bool = False, **kwargs: Any):
        super().__init__(priors, **kwargs)
        self.tau = _number(tau, "softmax tau", lo_open=True)
        self.decay = bool(decay)
        self.selections = 0

    def select(self) -> int:
        cold = self._unpulled()
        if cold:
            return self._uniform(cold)
        self.selections += 1
        tau = self.tau / math.sqrt(self.selections) if self.decay else self.tau
        top = max(self.means)
        weights = [math.exp((m - top) / tau) for m in self.means]
        assert self.rng is not None
        u = self.rng.random() * sum(weights)
        acc = 0.0
        for a, w in enumerate(weights):
            acc += w
            if u < acc:
                return a
        return self.k - 1

    def hyper(self) -> dict[str, Any]:
        return {**super().hyper(), "tau": self.tau, "decay": self.decay}

    def state(self) -> dict[str, Any]:
        return {**super().state(), "selections": self.selections}

    def load_state(self, state: Mapping[str, Any]) -> None:
        super().load_state(state)
        self.selections = int(state.get("selections", 0))


_KL_EPS = 1e-12


def _kl(p: float, q: float) -> float:
    p = min(max(p, _KL_EPS), 1 - _KL_EPS)
    q = min(max(q, _KL_EPS), 1 - _KL_EPS)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def _kl_upper(mean: float, budget: float) -> float:
    """``max{q in [p, 1]: KL(p, q) <= budget}`` for ``p = clamp(mean, 0, 1)`` (to ~1e-9).

    ``KL(p, .)`` is convex and increasing on ``[p, 1]``, so Newton steps taken
    from the right of the root stay right of it; when a step would not halve
    the bracket ``[lo, hi]`` (Pinsker's bound ``p + sqrt(budget / 2)`` caps
    ``hi``), a bisection step is taken instead.
    """
    p = min(max(mean, 0.0), 1.0)
    if budget <= 0.0 or p >= 1.0:
        return p
    if _kl(p, 1.0 - _KL_EPS) <= budget:
        return 1.0
    lo, hi = p, min(1.0 - _KL_EPS, p + math.sqrt(budget / 2.0))
    pc = max(p, _KL_EPS)
    for _ in range(60):
        f = _kl(p, hi) - budget
        if f <= 1e-12 or hi - lo < 1e-9:
            break
        newton = hi - f * hi * (1.0 - hi) / (hi - pc)
        mid = 0.5 * (lo + hi)
        if newton > mid:
            hi = newton
        elif _kl(p, mid) > budget:
            hi = mid
        else:
            lo = mid
    return hi


class KLUCB(Policy):
    """Bernoulli KL-UCB: ``argmax max{q in [mean, 1]: n KL(mean, q) <= c ln N}`` (bisection)."""

    name = "kl_ucb"

    def __init__(self, priors: Sequence[float | None], *, c: float = 0.0373, **kwargs: Any):
        super().__init__(priors, **kwargs)
        self.c = _number(c, "kl_ucb c")

    def select(self) -> int:
        for a in range(self.k):
            if self.counts[a] <= 0.0:
                return a
        log_n = math.log(max(sum(self.counts), 1.0))
        return _argmax([_kl_upper(m, self.c * log_n / n) for m, n in zip(self.means, self.counts)])

    def hyper(self) -> dict[str, Any]:
        return {**super().hyper(), "c": self.c}


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Auto, UCB1, ETC, EpsGreedy, Softmax, KLUCB)}


def make_policy(config: str | Mapping[str, Any], priors: Sequence[float | None], *, seed: int = 0) -> Policy:
    """A policy from its configuration: ``"ucb1"`` or ``{"policy": "ucb1", "alpha": 0.1, ...}``.

    Raises:
        TuneError: an unknown policy or parameter, or no arms.
    """
    cfg = {"policy": config} if isinstance(config, str) else dict(config)
    name = cfg.pop("policy", None)
    cls = POLICIES.get(name)  # type: ignore[arg-type]
    if cls is None:
        raise TuneError(f"unknown policy {name!r}; expected one of {sorted(POLICIES)}")
    try:
        return cls(priors, seed=seed, **cfg)
    except TypeError as e:
        raise TuneError(f"bad parameters for policy {name!r}: {e}") from None
