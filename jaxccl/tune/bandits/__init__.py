"""NCCL-BOT's per-context bandits: estimators, policies and the :class:`Selector` a communicator calls."""

from jaxccl.tune.bandits.estimators import ESTIMATORS, ClippedSGD, ConstantGain, Estimator, SampleMean, make_estimator
from jaxccl.tune.bandits.policies import ETC, KLUCB, POLICIES, UCB1, Auto, EpsGreedy, Policy, Softmax, make_policy
from jaxccl.tune.bandits.selector import (
    DEFAULT_POLICY,
    RHO_MAX,
    ContextBandit,
    Selector,
    context_seed,
    filter_arms,
)

__all__ = [
    "DEFAULT_POLICY",
    "ESTIMATORS",
    "ETC",
    "KLUCB",
    "POLICIES",
    "RHO_MAX",
    "UCB1",
    "Auto",
    "ClippedSGD",
    "ConstantGain",
    "ContextBandit",
    "EpsGreedy",
    "Estimator",
    "Policy",
    "SampleMean",
    "Selector",
    "Softmax",
    "context_seed",
    "filter_arms",
    "make_estimator",
    "make_policy",
]
