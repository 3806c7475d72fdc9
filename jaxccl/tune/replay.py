"""NCCL-BOT's replay evaluation (Sec. 5) on forced-arm latency pools from jaxccl's simulator.

**Pools.** For every context -- collective x hosts x scenario x message size
on a rail topology (:func:`jaxccl.topology.rail`, ``gpus_per_host`` GPUs per
host) -- every arm of the collective's catalogue (:func:`arm_catalog`, built
for the *healthy* topology, as a communicator installs them) is simulated on
the scenario's topology (healthy, or MCCL's fail1/fail2/fail3 on GPU 0) with
:func:`jaxccl.sim.run`. Its pool is ``depth`` samples: the simulated time x
multiplicative lognormal noise ``exp(sigma z)`` (a fixed seed per context
and arm), the first ``transient_steps`` samples further x ``transient_factor``
(NCCL-BOT's lazy-initialization transient, App. B.2: 1.13x for about the
first eight pulls).

**Split.** Train: the 4- and 8-host contexts; test: the 16- and 32-host
contexts, every scenario. The cost model is calibrated on the *healthy*
train contexts only; hyperparameters are tuned on train only.

**Replay** (Algorithm 4). Each context runs one fresh bandit for ``T =
depth`` steps; the k-th pull of an arm is served the k-th sample of its pool
(pull-count replay, transient included). With ``mu_bar(a)`` the mean of an
arm's samples after the first 10 (the paper's steady window, iterations
11-99) and ``a*`` its argmin over all arms (the filter applies to policies,
not to the oracle), the selection-priced TRLT (Eq. 3) is
``sum_t mu_bar(A_t) / (T mu_bar(a*)) - 1`` and the realized TRLT
``sum_t X_t / sum_{t<T} X*_t - 1`` with ``X*`` the oracle arm's own pool.

Example (a tiny pool, seconds):
    >>> cfg = PoolConfig(hosts=(2, 4), train_hosts=(2,), sizes=(1 << 12, 1 << 24), scenarios=("healthy",),
    ...                  collectives=("all_gather",))
    >>> pools = simulate_pools(cfg, show_progress=False)
    >>> pools.num_contexts, pools.samples.shape[-1]
    (4, 100)
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

import jaxccl.sim as sim
from jaxccl.topology import rail, scenario
from jaxccl.tune.arms import COLLECTIVES, Arm, Context, TuneError, arm_catalog, arm_names
from jaxccl.tune.bandits.policies import POLICIES
from jaxccl.tune.bandits.selector import RHO_MAX, ContextBandit, filter_arms
from jaxccl.tune.cost_model import CostModel, calibrate, margin
from jaxccl.util.report import progress

__all__ = [
    "FAMILIES",
    "HEADLINE_VIEW",
    "PAPER",
    "SCENARIOS",
    "PoolConfig",
    "Pools",
    "build_catalogs",
    "ReplayResult",
    "calibrate_model",
    "evaluate",
    "filter_keeps_best",
    "load_pools",
    "margins",
    "predict_pools",
    "random_search",
    "replay_context",
    "simulate_pools",
    "summarize",
    "tune_size_gate",
]

SCENARIOS = ("healthy", "fail1", "fail2", "fail3")
#: The model view of the headline table: the model is told the scenario's topology, its constants stay the
#: healthy 4/8-host calibration. ``"nominal"`` (the model only knows the healthy fabric) is the stress test.
HEADLINE_VIEW = "actual"
STEADY_FROM = 10  # the paper's steady window starts at iteration 11
POOL_SCHEMA = "jaxccl.tune.pools/1"

#: NCCL-BOT Table 1 (H100, scale-out-of-distribution split, 154 held-out contexts): realized TRLT.
PAPER: dict[str, dict[str, float]] = {
    "auto": {"mean": 6.08, "p99": 103.3, "over_10": 19, "sel_mean": 5.99},
    "ucb1": {"mean": 1.61, "p99": 9.9, "over_10": 1, "sel_mean": 1.00},
    "etc": {"mean": 4.74, "p99": 63.0, "over_10": 11, "sel_mean": 2.70},
    "softmax": {"mean": 1.75, "p99": 11.9, "over_10": 5, "sel_mean": 0.93},
    "kl_ucb": {"mean": 2.11, "p99": 22.7, "over_10": 4, "sel_mean": 1.18},
}


def _default_sizes() -> tuple[int, ...]:
    return tuple(1 << k for k in range(9, 35))  # 512 B .. 16 GiB, 26 sizes (NCCL-BOT's grid)


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """What to simulate (see the module docstring)."""

    collectives: tuple[str, ...] = COLLECTIVES
    hosts: tuple[int, ...] = (4, 8, 16, 32)
    train_hosts: tuple[int, ...] = (4, 8)
    gpus_per_host: int = 2
    scenarios: tuple[str, ...] = SCENARIOS
    sizes: tuple[int, ...] = dataclasses.field(default_factory=_default_sizes)
    depth: int = 100
    noise_sigma: float = 0.05
    transient_steps: int = 8
    transient_factor: float = 1.13
    seed: int = 2026

    def __post_init__(self) -> None:
        for name in ("collectives", "hosts", "train_hosts", "scenarios", "sizes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        bad = [c for c in self.collectives if c not in COLLECTIVES]
        if bad:
            raise TuneError(f"unknown collective(s) {bad}; expected some of {list(COLLECTIVES)}")
        bad = [s for s in self.scenarios if s not in SCENARIOS]
        if bad:
            raise TuneError(f"unknown scenario(s) {bad}; expected some of {list(SCENARIOS)}")
        if not set(self.train_hosts) <= set(self.hosts):
            raise TuneError(f"train_hosts {self.train_hosts} must be among hosts {self.hosts}")
        if self.depth <= STEADY_FROM:
            raise TuneError(f"pool depth must exceed the {STEADY_FROM}-sample transient window, got {self.depth}")
        if not self.noise_sigma >= 0 or not self.transient_factor >= 1:
            raise TuneError("noise_sigma must be >= 0 and transient_factor >= 1")

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PoolConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise TuneError(f"unknown pool config field(s) {unknown}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


@dataclasses.dataclass
class Pools:
    """Forced-arm latency pools and everything the replay needs without re-simulating.

    Attributes:
        config: how they were made.
        contexts: per context ``{collective, hosts, scenario, nbytes, num_ranks, split}``.
        arms: per collective, its catalogue's arm names (the arm axis of the arrays).
        sim_s: ``[contexts, arms]`` simulated seconds (NaN: the arm does not apply).
        samples: ``[contexts, arms, depth]`` latency samples (NaN where ``sim_s`` is).
        predictions: per model view (``"nominal"``: the model sees the healthy
            topology; ``"actual"``: it sees the scenario's), ``[contexts, arms]`` seconds.
        model: the cost model's calibration report.
    """

    config: PoolConfig
    contexts: list[dict[str, Any]]
    arms: dict[str, list[str]]
    sim_s: np.ndarray
    samples: np.ndarray
    predictions: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    sim_wall_s: float = 0.0

    @property
    def num_contexts(self) -> int:
        return len(self.contexts)

    def indices(self, split: str | None = None, **where: Any) -> list[int]:
        """Context indices in ``split`` (``"train"``/``"test"``/None) matching ``where`` (field == value)."""
        out = []
        for i, c in enumerate(self.contexts):
            if split is not None and c["split"] != split:
                continue
            if all(c[k] == v for k, v in where.items()):
                out.append(i)
        return out

    def arm_names(self, i: int) -> list[str]:
        """The arms that apply to context ``i``, in catalogue order."""
        names = self.arms[self.contexts[i]["collective"]]
        return [n for j, n in enumerate(names) if np.isfinite(self.sim_s[i, j])]

    def steady(self) -> np.ndarray:
        """``[contexts, arms]`` steady-state means (samples after the first 10)."""
        return self.samples[:, :, STEADY_FROM:].astype(np.float64).mean(axis=2)

    def save(self, path: str | os.PathLike[str], extra: Mapping[str, Any] | None = None) -> None:
        """Writes one compressed ``.npz`` (arrays + JSON metadata, with ``extra``'s keys added to it)."""
        meta = {
            "schema": POOL_SCHEMA,
            "config": self.config.to_dict(),
            "contexts": self.contexts,
            "arms": self.arms,
            "model": self.model,
            "views": sorted(self.predictions),
            "sim_wall_s": self.sim_wall_s,
            **(extra or {}),
        }
        arrays = {"sim_s": self.sim_s, "samples": self.samples.astype(np.float32)}
        for view, pred in self.predictions.items():
            arrays[f"pred_{view}"] = pred
        path = os.fspath(path)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        buf = io.BytesIO()
        np.savez_compressed(buf, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        with open(path, "wb") as f:
            f.write(buf.getvalue())

    def split_dict(self) -> dict[str, Any]:
        """The train/test split as JSON (what ``split.json`` holds)."""
        return {
            "schema": "jaxccl.tune.split/1",
            "config": self.config.to_dict(),
            "train": [_context_label(c) for c in self.contexts if c["split"] == "train"],
            "test": [_context_label(c) for c in self.contexts if c["split"] == "test"],
            "calibrated_on": self.model.get("calibrated_on", []),
            "cost_model": self.model.get("params"),
        }


def _context_label(c: Mapping[str, Any]) -> str:
    return f"{c['collective']}/{c['hosts']}h/{c['scenario']}/{c['nbytes']}"


def load_pools(path: str | os.PathLike[str]) -> Pools:
    """Reads :meth:`Pools.save` output.

    Raises:
        TuneError: not a pools file, or another schema.
    """
    try:
        with np.load(os.fspath(path)) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            arrays = {k: z[k] for k in z.files if k != "meta"}
    except (OSError, ValueError, KeyError) as e:
        raise TuneError(f"cannot read pools from {os.fspath(path)!r}: {e}") from None
    if meta.get("schema") != POOL_SCHEMA:
        raise TuneError(f"{os.fspath(path)!r} is not a {POOL_SCHEMA} file")
    preds = {v: arrays[f"pred_{v}"] for v in meta.get("views", [])}
    return Pools(
        PoolConfig.from_dict(meta["config"]),
        meta["contexts"],
        meta["arms"],
        arrays["sim_s"],
        arrays["samples"].astype(np.float64),
        preds,
        meta.get("model", {}),
        float(meta.get("sim_wall_s", 0.0)),
    )


# ---------------------------------------------------------------------------- simulation
def _stable_seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


def _topologies(config: PoolConfig, hosts: int) -> dict[str, Any]:
    """``{"healthy": rail, scenario: degraded rail}`` for every scenario (the healthy one always)."""
    nominal = rail(hosts=hosts, gpus_per_host=config.gpus_per_host)
    out = {"healthy": nominal}
    for s in SCENARIOS:
        if s != "healthy":
            out[s] = scenario(nominal, s)
    return out


def _pool(config: PoolConfig, sim_s: float, *key: Any) -> np.ndarray:
    rng = np.random.default_rng(_stable_seed(config.seed, *key))
    x = sim_s * np.exp(config.noise_sigma * rng.standard_normal(config.depth))
    x[: config.transient_steps] *= config.transient_factor
    return x


def arm_sim_seconds(arm: Arm, ctx: Context, topo: Any, cache: dict[tuple[str, str, float], float]) -> float:
    """The simulator's time of ``arm`` (its parts back to back) for ``ctx`` on ``topo``; ``cache`` keeps each
    part's time by (schedule, topology, bytes per rank)."""
    total = 0.0
    for part in arm.parts:
        b = ctx.part_bytes(part.collective)
        key = (part.digest, topo.fingerprint, b)
        if key not in cache:
            cache[key] = float(sim.run(topo, part, bytes_per_rank=b).time_s)
        total += cache[key]
    return total


def simulate_pools(
    config: PoolConfig | None = None,
    *,
    show_progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> Pools:
    """Simulates every (context, arm) of ``config`` and draws its pool (see the module docstring)."""
    cfg = config or PoolConfig()
    t0 = time.perf_counter()
    arms_by_coll: dict[str, list[str]] = {}
    rows: list[tuple[dict[str, Any], dict[str, float]]] = []
    cache: dict[tuple[str, str, float], float] = {}
    groups = [(h, c) for h in cfg.hosts for c in cfg.collectives]
    items = progress(groups, label="simulate pools") if show_progress else groups
    for hosts, coll in items:
        topos = _topologies(cfg, hosts)
        catalog = arm_catalog(coll, topos["healthy"])
        arms_by_coll[coll] = arm_names(coll)
        for scen in cfg.scenarios:
            topo = topos[scen]
            for n in cfg.sizes:
                ctx = Context(coll, topo.num_gpus, int(n))
                times = {}
                for arm in catalog:
                    times[arm.name] = arm_sim_seconds(arm, ctx, topo, cache)
                split = "train" if hosts in cfg.train_hosts else "test"
                meta = {
                    "collective": coll,
                    "hosts": hosts,
                    "scenario": scen,
                    "nbytes": int(n),
                    "num_ranks": topo.num_gpus,
                    "split": split,
                }
                rows.append((meta, times))
        if log:
            log(f"{coll} x {hosts} hosts done ({time.perf_counter() - t0:.0f} s)")
    width = max(len(v) for v in arms_by_coll.values())
    nc = len(rows)
    sim_s = np.full((nc, width), np.nan)
    samples = np.full((nc, width, cfg.depth), np.nan)
    for i, (meta, times) in enumerate(rows):
        names = arms_by_coll[meta["collective"]]
        for name, t in times.items():
            j = names.index(name)
            sim_s[i, j] = t
            samples[i, j] = _pool(cfg, t, _context_label(meta), name)
    samples = samples.astype(np.float32).astype(np.float64)  # what a saved pool holds: re-runs from file agree
    return Pools(cfg, [m for m, _ in rows], arms_by_coll, sim_s, samples, sim_wall_s=time.perf_counter() - t0)


# ---------------------------------------------------------------------------- cost model
def build_catalogs(pools: Pools) -> dict[tuple[str, int], tuple[list[Arm], dict[str, Any]]]:
    """Per ``(collective, hosts)``: the arm catalogue built on the healthy rail and every scenario's topology."""
    out = {}
    for hosts in pools.config.hosts:
        topos = _topologies(pools.config, hosts)
        for coll in pools.config.collectives:
            out[(coll, hosts)] = (arm_catalog(coll, topos["healthy"]), topos)
    return out


def calibrate_model(pools: Pools, *, catalogs: Mapping | None = None) -> tuple[CostModel, dict[str, Any]]:
    """Calibrates the cost model on the healthy *train* contexts' steady means (never on test pools)."""
    cats = catalogs if catalogs is not None else build_catalogs(pools)
    steady = pools.steady()
    samples = []
    used = []
    for hosts in pools.config.train_hosts:
        for coll in pools.config.collectives:
            idx = pools.indices("train", collective=coll, hosts=hosts, scenario="healthy")
            if not idx:
                continue
            arms, topos = cats[(coll, hosts)]
            sizes = [pools.contexts[i]["nbytes"] for i in idx]
            names = pools.arms[coll]
            for arm in arms:
                j = names.index(arm.name)
                samples.append((arm, topos["healthy"], sizes, steady[idx, j]))
            used.append(f"{coll}/{hosts}h/healthy")
    if not samples:
        raise TuneError("no healthy train contexts to calibrate the cost model on")
    model, report = calibrate(samples)
    report["calibrated_on"] = used
    return model, report


def predict_pools(
    pools: Pools,
    model: CostModel,
    *,
    views: Sequence[str] = ("nominal", "actual"),
    catalogs: Mapping | None = None,
) -> dict[str, np.ndarray]:
    """The model's predictions for every context: ``"nominal"`` on the healthy topology, ``"actual"`` on the
    scenario's topology (the arms stay those built for the healthy one)."""
    cats = catalogs if catalogs is not None else build_catalogs(pools)
    out = {v: np.full(pools.sim_s.shape, np.nan) for v in views}
    bad = [v for v in views if v not in ("nominal", "actual")]
    if bad:
        raise TuneError(f"unknown model view(s) {bad}; expected 'nominal' or 'actual'")
    for (coll, hosts), (arms, topos) in cats.items():
        names = pools.arms.get(coll, [])
        for scen in pools.config.scenarios:
            idx = pools.indices(collective=coll, hosts=hosts, scenario=scen)
            if not idx:
                continue
            sizes = np.asarray([pools.contexts[i]["nbytes"] for i in idx], dtype=np.float64)
            for view in views:
                topo = topos["healthy"] if view == "nominal" else topos[scen]
                for arm in arms:
                    out[view][idx, names.index(arm.name)] = model.predict(arm, topo, sizes)
    return out


# ---------------------------------------------------------------------------- replay
@dataclasses.dataclass
class ReplayResult:
    """Per-context outcome of one policy (averaged over seeds for random policies)."""

    realized: np.ndarray
    selection: np.ndarray
    auto_share: np.ndarray  # fraction of steps on the model's argmin
    indices: list[int]


def replay_context(
    config: Mapping[str, Any] | str,
    names: Sequence[str],
    predictions: Sequence[float | None],
    pool: np.ndarray,
    *,
    rho_max: float = RHO_MAX,
    seed: int = 0,
    horizon: int | None = None,
    context: Context | None = None,
) -> tuple[list[int], np.ndarray]:
    """Runs one bandit (Algorithm 4) on one context's pools.

    Args:
        config: the policy configuration.
        names: the context's arms (catalogue order).
        predictions: the model's predicted seconds per arm.
        pool: ``[arms, depth]`` latency samples (the k-th pull of an arm is served its k-th sample).
        rho_max: the arm filter.
        seed: seeds a random policy.
        horizon: steps (default: the pool depth).
        context: the context (labels the bandit; default a placeholder).

    Returns:
        ``(arm index per step, latency served per step)``; indices refer to ``names``.
    """
    t_max = pool.shape[1] if horizon is None else int(horizon)
    if t_max > pool.shape[1]:
        raise TuneError(f"horizon {t_max} exceeds the pool depth {pool.shape[1]}")
    ctx = context if context is not None else Context("all_gather", max(1, len(names)), 0)
    bandit = ContextBandit(ctx, names, list(predictions), config, rho_max=rho_max, seed=seed)
    policy = bandit.policy
    kept = bandit.kept
    pulls = [0] * len(names)
    chosen: list[int] = []
    served = np.empty(t_max)
    for t in range(t_max):
        i = policy.select()
        a = kept[i]
        x = float(pool[a, pulls[a]])
        pulls[a] += 1
        policy.update(i, bandit.reward(x))
        chosen.append(a)
        served[t] = x
    return chosen, served


def _pred_list(row: np.ndarray, valid: np.ndarray) -> list[float | None]:
    return [float(p) if np.isfinite(p) else None for p in row[valid]]


def evaluate(
    pools: Pools,
    config: Mapping[str, Any] | str,
    indices: Sequence[int],
    *,
    view: str = "nominal",
    seeds: int = 1,
    rho_max: float = RHO_MAX,
    size_gate_bytes: int = 0,
) -> ReplayResult:
    """Replays ``config`` on the contexts ``indices``; per-context realized and selection-priced TRLT.

    Contexts below ``size_gate_bytes`` play the model's argmin (AUTO) on every step.
    Random policies run ``seeds`` seeds per context and report the mean.
    """
    cfg = {"policy": config} if isinstance(config, str) else dict(config)
    cls = POLICIES.get(cfg.get("policy"))
    if cls is None:
        raise TuneError(f"unknown policy {cfg.get('policy')!r}")
    n_seeds = seeds if cls.stochastic else 1
    if view not in pools.predictions:
        raise TuneError(f"pools have no {view!r} predictions; run predict_pools first")
    preds = pools.predictions[view]
    steady = pools.steady()
    depth = pools.samples.shape[2]
    realized = np.zeros(len(indices))
    selection = np.zeros(len(indices))
    auto_share = np.zeros(len(indices))
    for out_i, ci in enumerate(indices):
        valid = np.isfinite(pools.sim_s[ci])
        cols = np.flatnonzero(valid)
        names = [pools.arms[pools.contexts[ci]["collective"]][j] for j in cols]
        pool = pools.samples[ci, cols]
        st = steady[ci, cols]
        star = int(np.argmin(st))
        oracle_total = float(pool[star, :depth].sum())
        pl = _pred_list(preds[ci], valid)
        auto_i = min((i for i, p in enumerate(pl) if p is not None), key=lambda i: pl[i], default=0)
        ctx_cfg = "auto" if pools.contexts[ci]["nbytes"] < size_gate_bytes else cfg
        c = pools.contexts[ci]
        ctx = Context(c["collective"], c["num_ranks"], c["nbytes"])
        label = _context_label(c)
        for s in range(n_seeds):
            chosen, served = replay_context(
                ctx_cfg, names, pl, pool, rho_max=rho_max, seed=_stable_seed("replay", s, label), context=ctx
            )
            realized[out_i] += served.sum() / oracle_total - 1.0
            selection[out_i] += st[chosen].mean() / st[star] - 1.0
            auto_share[out_i] += sum(1 for a in chosen if a == auto_i) / len(chosen)
        realized[out_i] /= n_seeds
        selection[out_i] /= n_seeds
        auto_share[out_i] /= n_seeds
    return ReplayResult(realized * 100.0, selection * 100.0, auto_share, list(indices))


def summarize(values_pct: np.ndarray) -> dict[str, float]:
    """Mean, SEM, p99 (over contexts) and the number of contexts above 10 % of a TRLT array in percent."""
    v = np.asarray(values_pct, dtype=np.float64)
    if v.size == 0:
        return {"mean": math.nan, "sem": math.nan, "p99": math.nan, "over_10": 0, "exact": math.nan, "n": 0}
    return {
        "mean": float(v.mean()),
        "sem": float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0,
        "p99": float(np.percentile(v, 99)),
        "over_10": int((v > 10.0).sum()),
        "exact": float((v <= 1e-9).mean()),
        "n": int(v.size),
    }


# ---------------------------------------------------------------------------- tuning
def _loguniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _sample(space: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, spec in space.items():
        kind = spec[0]
        if kind == "fixed":
            out[name] = spec[1]
        elif kind == "log":
            out[name] = _loguniform(rng, spec[1], spec[2])
        elif kind == "uniform":
            out[name] = rng.uniform(spec[1], spec[2])
        elif kind == "choice":
            out[name] = spec[1][rng.randrange(len(spec[1]))]
        else:
            raise TuneError(f"unknown search-space kind {kind!r}")
    return out


def _assemble(params: Mapping[str, Any]) -> dict[str, Any]:
    """Flat sampled parameters -> a policy configuration (``est_*`` keys form the estimator)."""
    cfg: dict[str, Any] = {}
    est: dict[str, Any] = {}
    for k, v in params.items():
        if k.startswith("est_"):
            est[k[4:]] = v
        else:
            cfg[k] = v
    if est:
        cfg["estimator"] = est
    return cfg


def random_search(
    pools: Pools,
    space: Mapping[str, Any],
    default: Mapping[str, Any],
    indices: Sequence[int],
    *,
    trials: int,
    seed: int = 42,
    view: str = "nominal",
    seeds: int = 1,
    objective: str = "selection",
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Seeded random search on ``indices`` (train only): trial 0 is ``default``, then ``trials`` samples.

    The objective is the mean TRLT (``"selection"``-priced, as NCCL-BOT tunes, or ``"realized"``).
    ``space`` maps a parameter to ``("fixed", v)``, ``("log", lo, hi)``, ``("uniform", lo, hi)`` or
    ``("choice", [...])``; ``est_*`` parameters configure the estimator.

    Returns:
        ``(best configuration, history)``.
    """
    rng = random.Random(seed)
    history = []
    best_cfg, best_val = None, math.inf
    if all(spec[0] in ("fixed", "choice") for spec in space.values()):
        # a finite space: every point once (``trials`` is ignored)
        values = [[spec[1]] if spec[0] == "fixed" else list(spec[1]) for spec in space.values()]
        candidates = [dict(default)] + [_assemble(dict(zip(space, combo))) for combo in itertools.product(*values)]
    else:
        candidates = [dict(default)] + [_assemble(_sample(space, rng)) for _ in range(trials)]
    for trial, cfg in enumerate(candidates):
        res = evaluate(pools, cfg, indices, view=view, seeds=seeds)
        val = float((res.selection if objective == "selection" else res.realized).mean())
        history.append({"trial": trial, "config": cfg, "objective": val})
        if val < best_val:
            best_cfg, best_val = cfg, val
    assert best_cfg is not None
    return best_cfg, history


def filter_keeps_best(pools: Pools, indices: Sequence[int], *, view: str = "nominal", rho_max: float = RHO_MAX):
    """Per context: whether the arm filter keeps the measured-best arm (``a*`` on the steady means)."""
    steady = pools.steady()
    preds = pools.predictions[view]
    out = []
    for ci in indices:
        valid = np.isfinite(pools.sim_s[ci])
        kept = filter_arms(_pred_list(preds[ci], valid), rho_max)
        out.append(int(np.argmin(steady[ci, valid])) in kept)
    return np.asarray(out, dtype=bool)


def margins(pools: Pools, indices: Sequence[int], *, view: str = "nominal") -> np.ndarray:
    """The model's runner-up margin per context."""
    preds = pools.predictions[view]
    return np.asarray([margin(_pred_list(preds[ci], np.isfinite(pools.sim_s[ci]))) for ci in indices])


# ---------------------------------------------------------------------------- tuned families
_PC = ("log", 0.1, 20.0)
#: Per family: (trial-0 default = NCCL-BOT's champion where the paper gives one, search space).
FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "ucb1": (
        {
            "policy": "ucb1",
            "alpha": 0.0928,
            "pseudo_count": 2.89,
            "estimator": {"estimator": "clipped_sgd", "lr": 0.468, "decay": 0.467, "clip": 0.389},
        },
        {
            "policy": ("fixed", "ucb1"),
            "alpha": ("log", 0.005, 1.0),
            "pseudo_count": _PC,
            "est_estimator": ("fixed", "clipped_sgd"),
            "est_lr": ("uniform", 0.05, 1.0),
            "est_decay": ("uniform", 0.0, 1.0),
            "est_clip": ("log", 0.02, 2.0),
        },
    ),
    "ucb1_cg": (
        {
            "policy": "ucb1",
            "alpha": 0.0928,
            "pseudo_count": 2.89,
            "estimator": {"estimator": "constant_gain", "eta": 0.1},
        },
        {
            "policy": ("fixed", "ucb1"),
            "alpha": ("log", 0.005, 1.0),
            "pseudo_count": _PC,
            "est_estimator": ("fixed", "constant_gain"),
            "est_eta": ("log", 0.01, 0.5),
        },
    ),
    "etc": (
        {"policy": "etc", "m": 1, "skip": 1},
        {"policy": ("fixed", "etc"), "m": ("choice", [1, 2, 3, 5]), "skip": ("choice", [0, 1, 2])},
    ),
    "eps_greedy": (
        {"policy": "eps_greedy", "epsilon": 0.0, "pseudo_count": 0.892},
        {
            "policy": ("fixed", "eps_greedy"),
            "epsilon": ("log", 0.001, 0.3),
            "decay": ("choice", [False, True]),
            "pseudo_count": _PC,
        },
    ),
    "softmax": (
        {"policy": "softmax", "tau": 0.089, "decay": True, "pseudo_count": 1.24},
        {
            "policy": ("fixed", "softmax"),
            "tau": ("log", 0.002, 0.5),
            "decay": ("choice", [False, True]),
            "pseudo_count": _PC,
        },
    ),
    "kl_ucb": (
        {"policy": "kl_ucb", "c": 0.0373, "pseudo_count": 1.56},
        {"policy": ("fixed", "kl_ucb"), "c": ("log", 0.002, 2.0), "pseudo_count": _PC},
    ),
}


def tune_size_gate(
    pools: Pools,
    config: Mapping[str, Any],
    indices: Sequence[int],
    *,
    view: str = "nominal",
    seeds: int = 1,
) -> tuple[int, list[dict[str, Any]]]:
    """The size gate (bytes) that minimizes mean train selection-priced TRLT of ``config`` (0: no gate)."""
    sizes = sorted({pools.contexts[i]["nbytes"] for i in indices})
    history = []
    best, best_val = 0, math.inf
    for gate in [0, *sizes[1:]]:
        res = evaluate(pools, config, indices, view=view, seeds=seeds, size_gate_bytes=gate)
        val = float(res.selection.mean())
        history.append({"size_gate_bytes": gate, "objective": val})
        if val < best_val - 1e-12:
            best, best_val = gate, val
    return best, history
