"""Per-arm mean-reward estimators of NCCL-BOT (Sec. 4, Sec. 7, App. E).

* :class:`SampleMean` -- the running average ``r <- r + (x - r) / n``.
* :class:`ClippedSGD` -- NCCL-BOT's robust mean for its featured UCB1: a
  stochastic-gradient step ``r <- r + lr * n**-decay * clip(x - r, -clip, clip)``
  whose clipping blunts the heavy first-use samples of an arm and whose slowly
  decaying step keeps tracking a moving target (App. E, Table 16: lr 0.468,
  decay 0.467, clip 0.389).
* :class:`ConstantGain` -- ``r <- (1 - eta) r + eta x``, the estimator NCCL-BOT
  recommends for a long-lived tuner (Sec. 7, eta = 0.1).

``n`` counts pulls including the warm-start pseudo-count. An arm without a
prior (cold, ``n == 0`` before the update) takes its first sample as its mean
under every estimator -- jaxccl's reading: a gradient step from an undefined
mean is not specified by the paper.

Example:
    >>> est = ConstantGain(eta=0.5)
    >>> est.update(mean=1.0, n=3.0, x=0.0)
    0.5
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jaxccl.tune.arms import TuneError

__all__ = ["ESTIMATORS", "ClippedSGD", "ConstantGain", "Estimator", "SampleMean", "make_estimator"]


def _check(value: Any, name: str, *, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TuneError(f"{name} must be a finite number, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise TuneError(f"{name} must lie in {bound}, got {value!r}")
    return float(value)


class Estimator:
    """Maps ``(mean before, count after the pull, new sample)`` to the new mean."""

    name = ""

    def update(self, mean: float, n: float, x: float) -> float:
        raise NotImplementedError

    def params(self) -> dict[str, float]:
        return {}

    def to_dict(self) -> dict[str, Any]:
        return {"estimator": self.name, **self.params()}


class SampleMean(Estimator):
    """The running sample average (pseudo-counts weigh the prior)."""

    name = "mean"

    def update(self, mean: float, n: float, x: float) -> float:
        if n <= 1.0:
            return x
        return mean + (x - mean) / n


class ClippedSGD(Estimator):
    """Clipped stochastic-gradient mean (NCCL-BOT's robust estimator)."""

    name = "clipped_sgd"

    def __init__(self, lr: float = 0.468, decay: float = 0.467, clip: float = 0.389):
        self.lr = _check(lr, "clipped_sgd lr", lo=0.0, hi=1.0, lo_open=True)
        self.decay = _check(decay, "clipped_sgd decay", lo=0.0, hi=2.0)
        self.clip = _check(clip, "clipped_sgd clip", lo=0.0, lo_open=True)

    def update(self, mean: float, n: float, x: float) -> float:
        if n <= 1.0:
            return x
        step = self.lr * n**-self.decay
        g = x - mean
        g = self.clip if g > self.clip else (-self.clip if g < -self.clip else g)
        return mean + step * g

    def params(self) -> dict[str, float]:
        return {"lr": self.lr, "decay": self.decay, "clip": self.clip}


class ConstantGain(Estimator):
    """Exponentially weighted mean with a constant gain ``eta`` (forgets; for drift)."""

    name = "constant_gain"

    def __init__(self, eta: float = 0.1):
        self.eta = _check(eta, "constant_gain eta", lo=0.0, hi=1.0, lo_open=True)

    def update(self, mean: float, n: float, x: float) -> float:
        if n <= 1.0:
            return x
        return (1.0 - self.eta) * mean + self.eta * x

    def params(self) -> dict[str, float]:
        return {"eta": self.eta}


ESTIMATORS: dict[str, type[Estimator]] = {
    SampleMean.name: SampleMean,
    ClippedSGD.name: ClippedSGD,
    ConstantGain.name: ConstantGain,
}


def make_estimator(spec: str | Mapping[str, Any] | Estimator | None) -> Estimator:
    """An estimator from its name, a ``{"estimator": name, **params}`` mapping, or an instance."""
    if spec is None:
        return SampleMean()
    if isinstance(spec, Estimator):
        return spec
    if isinstance(spec, str):
        spec = {"estimator": spec}
    if not isinstance(spec, Mapping):
        raise TuneError(f"expected an estimator name or mapping, got {spec!r}")
    params = dict(spec)
    name = params.pop("estimator", "mean")
    cls = ESTIMATORS.get(name)
    if cls is None:
        raise TuneError(f"unknown estimator {name!r}; expected one of {sorted(ESTIMATORS)}")
    try:
        return cls(**params)
    except TypeError as e:
        raise TuneError(f"bad parameters for estimator {name!r}: {e}") from None
