"""The per-context schedule selector of NCCL-BOT (Sec. 4, Algorithm 1, App. F).

A :class:`Selector` keeps one independent bandit per context, created on
the context's first visit (:class:`ContextBandit`, Algorithm 1):

1. ``mu_min`` is the best defined prediction of the context's arms;
2. the filter keeps the arms with ``mu_hat(a) <= rho_max * mu_min`` or no
   prediction (Eq. 2, ``rho_max = 2``);
3. the policy starts from the priors ``r(mu_hat(a)) = mu_min / mu_hat(a)``;
4. each measured latency ``t`` of the arm that ran feeds back ``r = mu_min / t`` (Eq. 1).

Contexts smaller than ``size_gate_bytes`` keep the model's choice and need
no timing (Sec. 7, "do not learn where the model is right").

A communicator calls :meth:`Selector.choose` before running a context's
collective and :meth:`Selector.observe` with the latency its executor
measured, between steps. With a deterministic policy (UCB1, AUTO) the choice
is a function of the replicated statistics, so ranks that apply the same
observations in the same order (or import the same
:meth:`Selector.export_state`) choose the same arm (App. F).

Example:
    >>> sel = Selector(["ring", "tree"], lambda ctx: {"ring": 2e-3, "tree": 1e-3},
    ...                policy={"policy": "ucb1", "alpha": 0.1, "pseudo_count": 1.0})
    >>> ctx = ("all_gather", 8, 1 << 20)
    >>> sel.choose(ctx)
    'tree'
    >>> sel.observe(ctx, "tree", 50e-3)   # far slower than the model said
    True
    >>> sel.choose(ctx)
    'ring'
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxccl.tune.arms import Context, TuneError, arm_catalog
from jaxccl.tune.bandits.policies import Policy, make_policy
from jaxccl.tune.cost_model import CostModel

__all__ = ["DEFAULT_POLICY", "RHO_MAX", "SCHEMA", "ContextBandit", "Selector", "context_seed", "filter_arms"]

SCHEMA = "jaxccl.tune.selector/1"
RHO_MAX = 2.0

#: NCCL-BOT's champion (App. E, Table 16): UCB1, alpha 0.0928, pseudo-count 2.89, clipped-SGD mean.
DEFAULT_POLICY: dict[str, Any] = {
    "policy": "ucb1",
    "alpha": 0.0928,
    "pseudo_count": 2.89,
    "estimator": {"estimator": "clipped_sgd", "lr": 0.468, "decay": 0.467, "clip": 0.389},
}


def _prediction(value: Any, arm: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TuneError(f"prediction for arm {arm!r} must be a number or None, got {value!r}")
    v = float(value)
    if math.isnan(v):
        return None
    if not v > 0 or math.isinf(v):
        raise TuneError(f"prediction for arm {arm!r} must be positive and finite (or None), got {value!r}")
    return v


def filter_arms(predictions: Sequence[float | None], rho_max: float = RHO_MAX) -> list[int]:
    """Indices kept by Eq. (2): ``mu_hat(a) <= rho_max * mu_min`` or undefined.

    >>> filter_arms([1.0, 2.0, 2.5, None])
    [0, 1, 3]
    """
    defined = [p for p in predictions if p is not None]
    if not defined:
        return list(range(len(predictions)))
    cut = rho_max * min(defined)
    return [i for i, p in enumerate(predictions) if p is None or p <= cut]


def context_seed(seed: int, key: str) -> int:
    """A per-context RNG seed every rank derives alike from the selector seed and the context key."""
    digest = hashlib.sha256(f"{int(seed)}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class ContextBandit:
    """Algorithm 1 for one context: filter, warm-started policy, reward ``mu_min / t``.

    Args:
        context: the context.
        arms: every arm name offered for it, in catalogue order (the tie-break order).
        predictions: the model's predicted seconds per arm (``None``: undefined).
        policy: a policy configuration (see :func:`~jaxccl.tune.bandits.policies.make_policy`).
        rho_max: the filter threshold.
        seed: the context's RNG seed (random policies).
    """

    def __init__(
        self,
        context: Context,
        arms: Sequence[str],
        predictions: Sequence[float | None],
        policy: str | Mapping[str, Any],
        *,
        rho_max: float = RHO_MAX,
        seed: int = 0,
    ):
        names = [str(a) for a in arms]
        if not names:
            raise TuneError(f"context {context.key}: no arms to choose from")
        if len(set(names)) != len(names):
            raise TuneError(f"context {context.key}: duplicate arm names {names}")
        if len(predictions) != len(names):
            raise TuneError(f"context {context.key}: {len(predictions)} predictions for {len(names)} arms")
        if not (isinstance(rho_max, (int, float)) and rho_max >= 1 and math.isfinite(rho_max)):
            raise TuneError(f"rho_max must be a finite number >= 1, got {rho_max!r}")
        self.context = context
        self.all_arms = names
        self.predictions = [_prediction(p, a) for a, p in zip(names, predictions)]
        self.rho_max = float(rho_max)
        self.kept = filter_arms(self.predictions, self.rho_max)
        self.arms = [names[i] for i in self.kept]
        kept_preds = [self.predictions[i] for i in self.kept]
        defined = [p for p in kept_preds if p is not None]
        self.mu_min: float | None = min(defined) if defined else None
        priors = [None if p is None or self.mu_min is None else self.mu_min / p for p in kept_preds]
        self.seed = int(seed)
        self.policy: Policy = make_policy(policy, priors, seed=self.seed)
        self._index = {a: i for i, a in enumerate(self.arms)}
        self.auto_arm = self.arms[_auto_index(kept_preds)]

    @property
    def scale(self) -> float | None:
        """The reward scale ``mu_min`` (``None`` until known when no arm has a prediction)."""
        return self.mu_min

    def choose(self) -> str:
        """The arm to run next."""
        return self.arms[self.policy.select()]

    def reward(self, latency_s: float) -> float:
        """``r = mu_min / t`` (Eq. 1)."""
        if self.mu_min is None:  # no prediction at all: the first measurement sets the scale
            self.mu_min = latency_s
        return self.mu_min / latency_s

    def observe(self, arm: str, latency_s: float) -> bool:
        """Feeds back one measured latency; ``False`` (ignored) for an arm the filter removed."""
        i = self._index.get(arm)
        if i is None:
            if arm in self.all_arms:
                return False
            raise TuneError(f"context {self.context.key}: unknown arm {arm!r}; its arms are {self.all_arms}")
        self.policy.update(i, self.reward(latency_s))
        return True

    def state(self) -> dict[str, Any]:
        return {
            "arms": list(self.all_arms),
            "predictions": list(self.predictions),
            "mu_min": self.mu_min,
            "seed": self.seed,
            "policy": self.policy.state(),
        }


def _auto_index(predictions: Sequence[float | None]) -> int:
    best, arg = math.inf, 0
    for i, p in enumerate(predictions):
        if p is not None and p < best:
            best, arg = p, i
    return arg


def _check_latency(latency_s: Any) -> float:
    if isinstance(latency_s, bool) or not isinstance(latency_s, (int, float)):
        raise TuneError(f"latency must be a number of seconds, got {latency_s!r}")
    v = float(latency_s)
    if not math.isfinite(v) or v <= 0:
        raise TuneError(f"latency must be a positive finite number of seconds, got {latency_s!r}")
    return v


ArmSource = Callable[[Context], Sequence[str]] | Mapping[str, Sequence[str]] | Sequence[str]
Predictor = Callable[[Context], Mapping[str, float | None]]


class Selector:
    """Chooses, per context, which installed schedule (arm) runs; learns from measured latencies.

    Args:
        arms: the arm names offered for a context: a callable ``context -> names``,
            a mapping ``collective -> names``, or one list for every context.
            Order matters: it breaks ties.
        predict: the cost model, ``context -> {arm name: predicted seconds or None}``;
            ``None``: no model (every arm is cold; no filter, no warm start).
        policy: a policy name or configuration (default :data:`DEFAULT_POLICY`,
            NCCL-BOT's UCB1 champion).
        rho_max: the arm filter threshold (Eq. 2).
        size_gate_bytes: contexts with fewer bytes keep the model's choice and are not timed.
        seed: seeds the random policies (per context, see :func:`context_seed`).
        catalog: optional ``context -> [Arm]`` behind the names (what :meth:`schedules` returns).
    """

    def __init__(
        self,
        arms: ArmSource,
        predict: Predictor | None = None,
        *,
        policy: str | Mapping[str, Any] | None = None,
        rho_max: float = RHO_MAX,
        size_gate_bytes: int = 0,
        seed: int = 0,
        catalog: Callable[[Context], Sequence[Any]] | None = None,
    ):
        self._arms = arms
        self._predict = predict
        self._catalog = catalog
        self.policy_config: dict[str, Any] = (
            dict(DEFAULT_POLICY)
            if policy is None
            else ({"policy": policy} if isinstance(policy, str) else dict(policy))
        )
        make_policy(self.policy_config, [1.0])  # validate now, not on the first context
        if not (isinstance(rho_max, (int, float)) and rho_max >= 1 and math.isfinite(rho_max)):
            raise TuneError(f"rho_max must be a finite number >= 1, got {rho_max!r}")
        if isinstance(size_gate_bytes, bool) or not isinstance(size_gate_bytes, int) or size_gate_bytes < 0:
            raise TuneError(f"size_gate_bytes must be an integer >= 0, got {size_gate_bytes!r}")
        self.rho_max = float(rho_max)
        self.size_gate_bytes = size_gate_bytes
        self.seed = int(seed)
        self._bandits: dict[str, ContextBandit] = {}

    # ------------------------------------------------------------------ API
    def choose(self, context: Context | Mapping[str, Any] | Sequence[Any]) -> str:
        """The arm to run for ``context`` now (creates its bandit on the first visit)."""
        b = self.bandit(context)
        if b.context.nbytes < self.size_gate_bytes:
            return b.auto_arm
        return b.choose()

    def wants_timing(self, context: Context | Mapping[str, Any] | Sequence[Any]) -> bool:
        """Whether the caller should time this context's collective (``False`` below the size gate)."""
        return Context.coerce(context).nbytes >= self.size_gate_bytes

    def observe(self, context: Context | Mapping[str, Any] | Sequence[Any], arm: str, latency_s: float) -> bool:
        """Feeds back the measured latency (seconds) of ``arm`` on ``context``.

        Returns whether the sample was used: ``False`` below the size gate and
        for arms the filter removed.

        Raises:
            TuneError: a non-positive or non-finite latency, or an arm the context does not offer.
        """
        t = _check_latency(latency_s)
        b = self.bandit(context)
        if b.context.nbytes < self.size_gate_bytes:
            return False
        return b.observe(str(arm), t)

    def bandit(self, context: Context | Mapping[str, Any] | Sequence[Any]) -> ContextBandit:
        """The context's bandit, created lazily."""
        ctx = Context.coerce(context)
        b = self._bandits.get(ctx.key)
        if b is None:
            names = list(self._arm_names(ctx))
            preds_map = dict(self._predict(ctx)) if self._predict is not None else {}
            unknown = sorted(set(preds_map) - set(names))
            if unknown:
                raise TuneError(f"context {ctx.key}: predictions for arms it does not offer: {unknown}")
            preds = [preds_map.get(a) for a in names]
            b = ContextBandit(
                ctx, names, preds, self.policy_config, rho_max=self.rho_max, seed=context_seed(self.seed, ctx.key)
            )
            self._bandits[ctx.key] = b
        return b

    def schedules(self, context: Context | Mapping[str, Any] | Sequence[Any], arm: str) -> tuple[Any, ...]:
        """The schedules (run back to back) of ``arm`` for ``context``, from the ``catalog``.

        Raises:
            TuneError: the selector has no catalogue, or ``arm`` is not in it.
        """
        if self._catalog is None:
            raise TuneError("this selector was built without an arm catalogue (see Selector.for_topology)")
        ctx = Context.coerce(context)
        for a in self._catalog(ctx):
            if a.name == arm:
                return tuple(a.parts)
        raise TuneError(f"context {ctx.key}: unknown arm {arm!r}")

    def reset(self, context: Context | Mapping[str, Any] | Sequence[Any]) -> bool:
        """Forgets ``context``'s bandit: its next visit builds a new one from the arms and predictions
        offered then (after a re-synthesis changed them, or the fabric the model predicts for). Returns
        whether there was one.

        >>> sel = Selector(["ring", "tree"], lambda ctx: {"ring": 2e-3, "tree": 1e-3})
        >>> sel.choose(("all_gather", 8, 1024)), sel.reset(("all_gather", 8, 1024)), sel.contexts
        ('tree', True, [])
        """
        return self._bandits.pop(Context.coerce(context).key, None) is not None

    @property
    def contexts(self) -> list[str]:
        """Keys of the contexts seen so far."""
        return list(self._bandits)

    # ---------------------------------------------------------------- state
    def config(self) -> dict[str, Any]:
        return {
            "policy": self.policy_config,
            "rho_max": self.rho_max,
            "size_gate_bytes": self.size_gate_bytes,
            "seed": self.seed,
        }

    def export_state(self) -> dict[str, Any]:
        """Every context's statistics and the configuration, JSON-ready (replicate with :meth:`import_state`)."""
        return {
            "schema": SCHEMA,
            "config": json.loads(json.dumps(self.config())),
            "contexts": {k: b.state() for k, b in self._bandits.items()},
        }

    def import_state(self, state: Mapping[str, Any]) -> None:
        """Replaces this selector's statistics by ``state`` (from :meth:`export_state` on a selector with
        the same configuration).

        Raises:
            TuneError: another schema or configuration, or malformed state.
        """
        if not isinstance(state, Mapping) or state.get("schema") != SCHEMA:
            raise TuneError(f"selector state must be an object with schema {SCHEMA!r}")
        mine = json.loads(json.dumps(self.config()))
        if state.get("config") != mine:
            raise TuneError(f"selector state was exported with config {state.get('config')}, this selector has {mine}")
        contexts = state.get("contexts")
        if not isinstance(contexts, Mapping):
            raise TuneError("selector state has no 'contexts' object")
        bandits = {}
        for key, cs in contexts.items():
            ctx = Context.from_key(key)
            try:
                b = ContextBandit(
                    ctx, cs["arms"], cs["predictions"], self.policy_config, rho_max=self.rho_max, seed=int(cs["seed"])
                )
                if cs["mu_min"] is not None:
                    b.mu_min = float(cs["mu_min"])
                b.policy.load_state(cs["policy"])
            except (KeyError, TypeError, ValueError) as e:
                if isinstance(e, TuneError):
                    raise
                raise TuneError(f"malformed state for context {key}: {e!r}") from None
            bandits[key] = b
        self._bandits = bandits

    def to_json(self) -> str:
        """:meth:`export_state` as JSON text (floats round-trip exactly)."""
        return json.dumps(self.export_state(), sort_keys=True)

    def load_json(self, text: str) -> None:
        """:meth:`import_state` from :meth:`to_json` text."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TuneError(f"malformed selector JSON: {e}") from None
        self.import_state(data)

    # -------------------------------------------------------------- helpers
    def _arm_names(self, ctx: Context) -> Sequence[str]:
        src = self._arms
        if callable(src):
            names = src(ctx)
        elif isinstance(src, Mapping):
            if ctx.collective not in src:
                raise TuneError(f"no arms for collective {ctx.collective!r}; the selector has {sorted(src)}")
            names = src[ctx.collective]
        else:
            names = src
        names = list(names)
        if not names:
            raise TuneError(f"context {ctx.key}: no arms to choose from")
        return names

    @classmethod
    def for_topology(
        cls,
        topo: Any,
        *,
        model: Any = None,
        policy: str | Mapping[str, Any] | None = None,
        rho_max: float = RHO_MAX,
        size_gate_bytes: int = 0,
        seed: int = 0,
    ) -> Selector:
        """A selector over jaxccl's arm catalogue on ``topo`` with the cost model's predictions.

        ``model`` is a :class:`~jaxccl.tune.cost_model.CostModel` (default: the
        physical constants). Contexts must have ``topo.num_gpus`` ranks.
        :meth:`schedules` returns the schedules to install for an arm.

        Example:
            >>> from jaxccl.topology import rail
            >>> sel = Selector.for_topology(rail(hosts=2, gpus_per_host=2))
            >>> ctx = ("all_gather", 4, 1 << 20)
            >>> arm = sel.choose(ctx)
            >>> [s.collective.value for s in sel.schedules(ctx, arm)]
            ['all_gather']
        """
        cm = model or CostModel()
        catalogs: dict[str, list] = {}

        def catalog(ctx: Context) -> list:
            if ctx.num_ranks != topo.num_gpus:
                raise TuneError(f"context {ctx.key} has {ctx.num_ranks} ranks; the topology has {topo.num_gpus} GPUs")
            if ctx.collective not in catalogs:
                catalogs[ctx.collective] = arm_catalog(ctx.collective, topo)
            return catalogs[ctx.collective]

        def names(ctx: Context) -> list[str]:
            return [a.name for a in catalog(ctx)]

        def predict(ctx: Context) -> dict[str, float]:
            return cm.predict_context(ctx, catalog(ctx), topo)

        return cls(
            names,
            predict,
            policy=policy,
            rho_max=rho_max,
            size_gate_bytes=size_gate_bytes,
            seed=seed,
            catalog=catalog,
        )
