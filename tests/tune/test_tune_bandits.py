"""jaxccl.tune bandits: determinism and replication, estimators, filter, size gate, replay metrics, bad input."""

import json
import math
import os
import random

import numpy as np
import pytest

from jaxccl.tune.arms import Context, TuneError
from jaxccl.tune.bandits import (
    DEFAULT_POLICY,
    ClippedSGD,
    ConstantGain,
    ContextBandit,
    SampleMean,
    Selector,
    filter_arms,
    make_policy,
)
from jaxccl.tune.replay import (
    HEADLINE_VIEW,
    PoolConfig,
    Pools,
    calibrate_model,
    evaluate,
    filter_keeps_best,
    load_pools,
    predict_pools,
    replay_context,
    simulate_pools,
    summarize,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAVED_POOLS = os.path.join(ROOT, "benchmarks", "results", "tuning", "pools.npz")

ARMS = ["ring", "nccl_ring", "tree", "direct"]
PRED = {"ring": 4e-3, "nccl_ring": 1.1e-3, "tree": 1e-3, "direct": 3.9e-3}
TRUE = {"ring": 4.1e-3, "nccl_ring": 1.0e-3, "tree": 1.6e-3, "direct": 9e-3}  # the model mis-ranks tree


def _latency(rng, arm):
    return TRUE[arm] * math.exp(0.05 * rng.gauss(0.0, 1.0))


def _run(sel, ctx, steps, rng):
    chosen = []
    for _ in range(steps):
        a = sel.choose(ctx)
        chosen.append(a)
        sel.observe(ctx, a, _latency(rng, a))
    return chosen


# ------------------------------------------------------------------------ determinism / replication
@pytest.mark.parametrize(
    "estimator", [None, {"estimator": "clipped_sgd"}, {"estimator": "constant_gain", "eta": 0.1}, "mean"]
)
def test_ucb1_warm_start_is_deterministic_given_identical_statistics(estimator):
    policy = dict(DEFAULT_POLICY) if estimator is None else {**DEFAULT_POLICY, "estimator": estimator}
    ctx = Context("all_gather", 16, 1 << 26)
    a, b = Selector(ARMS, lambda c: PRED, policy=policy), Selector(ARMS, lambda c: PRED, policy=policy)
    rng = random.Random(7)
    seq_a, seq_b = [], []
    for _ in range(100):
        x, y = a.choose(ctx), b.choose(ctx)
        seq_a.append(x)
        seq_b.append(y)
        lat = _latency(rng, x)  # both replicas apply the same (agreed) observation
        a.observe(ctx, x, lat)
        b.observe(ctx, y, lat)
    assert seq_a == seq_b
    assert seq_a[0] == "tree"  # the warm start plays the model's argmin first
    assert "nccl_ring" in seq_a[-20:]  # and learning leaves it for the measured-best arm
    assert a.export_state() == b.export_state()


@pytest.mark.parametrize("policy", [DEFAULT_POLICY, {"policy": "softmax", "tau": 0.05, "pseudo_count": 1.0}])
def test_export_import_round_trip_replicates_future_choices(policy):
    ctxs = [Context("all_gather", 16, 1 << 26), Context("all_reduce", 16, 1 << 20)]
    rng = random.Random(3)
    leader = Selector(ARMS, lambda c: PRED, policy=policy, seed=11)
    for ctx in ctxs:
        _run(leader, ctx, 30, rng)
    text = leader.to_json()
    replica = Selector(ARMS, lambda c: PRED, policy=policy, seed=11)
    replica.load_json(text)
    assert json.loads(replica.to_json()) == json.loads(text)
    state = random.Random(5).getstate()
    r1, r2 = random.Random(), random.Random()
    r1.setstate(state)
    r2.setstate(state)
    for ctx in ctxs:
        assert _run(leader, ctx, 40, r1) == _run(replica, ctx, 40, r2)
    assert leader.to_json() == replica.to_json()


def test_identical_statistics_give_identical_choices_and_ties_go_to_the_lowest_index():
    b1 = ContextBandit(Context("all_gather", 8, 1 << 20), ARMS, [1e-3] * 4, DEFAULT_POLICY)
    b2 = ContextBandit(Context("all_gather", 8, 1 << 20), ARMS, [1e-3] * 4, DEFAULT_POLICY)
    assert b1.choose() == b2.choose() == "ring"  # four equal priors: arm order decides
    b2.policy.load_state(b1.policy.state())
    for _ in range(25):
        assert b1.choose() == b2.choose()
        a = b1.choose()
        b1.observe(a, TRUE[a])
        b2.observe(a, TRUE[a])


def test_import_rejects_another_configuration_and_malformed_state():
    a = Selector(ARMS, lambda c: PRED)
    a.choose(("all_gather", 8, 1024))
    b = Selector(ARMS, lambda c: PRED, rho_max=3.0)
    with pytest.raises(TuneError, match="config"):
        b.import_state(a.export_state())
    with pytest.raises(TuneError, match="schema"):
        b.import_state({"contexts": {}})
    with pytest.raises(TuneError, match="malformed selector JSON"):
        b.load_json("{not json")
    state = a.export_state()
    state["contexts"]["all_gather/8/1024"]["policy"]["means"] = [1.0]
    with pytest.raises(TuneError, match="arms"):
        Selector(ARMS, lambda c: PRED).import_state(state)


# ------------------------------------------------------------------------ estimators
@pytest.mark.parametrize(
    ("estimator", "tol"), [(SampleMean(), 0.01), (ClippedSGD(), 0.03), (ConstantGain(eta=0.05), 0.05)]
)
def test_estimators_converge_on_a_stationary_arm(estimator, tol):
    rng = random.Random(1)
    for truth in (0.3, 0.9):
        mean, n = 1.0, 2.0  # a wrong warm-start prior with pseudo-count 2
        for _ in range(3000):
            n += 1
            mean = estimator.update(mean, n, truth + 0.1 * rng.gauss(0.0, 1.0))
        assert abs(mean - truth) < tol


@pytest.mark.parametrize("estimator", ["mean", "clipped_sgd", "constant_gain"])
def test_ucb1_finds_the_best_of_a_stationary_arm_set(estimator):
    means = [0.6, 0.9, 0.75]
    p = make_policy({"policy": "ucb1", "alpha": 0.1, "pseudo_count": 1.0, "estimator": estimator}, [1.0, 0.5, 0.8])
    rng = random.Random(2)
    late = []
    for t in range(600):
        a = p.select()
        p.update(a, means[a] + 0.05 * rng.gauss(0.0, 1.0))
        if t >= 400:
            late.append(a)
    assert late.count(1) / len(late) > 0.9
    assert abs(p.means[1] - 0.9) < 0.05


@pytest.mark.parametrize(
    "config",
    [
        {"policy": "eps_greedy", "epsilon": 0.05, "pseudo_count": 1.0},
        {"policy": "softmax", "tau": 0.05, "pseudo_count": 1.0},
        {"policy": "kl_ucb", "c": 0.05, "pseudo_count": 1.0},
        {"policy": "etc", "m": 3, "skip": 1},
    ],
)
def test_baselines_find_the_best_arm(config):
    means = [0.6, 0.9, 0.75]
    late = []
    for seed in range(5):
        p = make_policy(config, [1.0, 0.5, 0.8], seed=seed)
        rng = random.Random(9)
        picks = []
        for _ in range(400):
            a = p.select()
            p.update(a, means[a] + 0.03 * rng.gauss(0.0, 1.0))
            picks.append(a)
        late.append(picks[-100:].count(1))
    assert np.median(late) >= 80


def test_auto_never_learns():
    p = make_policy("auto", [0.5, 1.0, None])
    for _ in range(10):
        assert p.select() == 1
        p.update(1, 0.01)


# ------------------------------------------------------------------------ filter and gate
def test_filter_drops_arms_above_rho_max_and_keeps_undefined_ones():
    assert filter_arms([1.0, 2.0, 2.01, None], 2.0) == [0, 1, 3]
    assert filter_arms([None, None]) == [0, 1]
    b = ContextBandit(Context("all_gather", 8, 4096), ARMS, [1.0, 2.5, 1.2, None], DEFAULT_POLICY)
    assert b.arms == ["ring", "tree", "direct"]
    assert b.mu_min == 1.0
    assert b.policy.priors == [1.0, pytest.approx(1 / 1.2), None]
    assert b.observe("nccl_ring", 1.0) is False  # filtered: ignored
    assert b.choose() == "direct"  # no prediction: explored first


def test_size_gate_keeps_the_models_choice_and_skips_timing():
    sel = Selector(ARMS, lambda c: PRED, size_gate_bytes=1 << 20)
    small, large = Context("all_gather", 16, 1 << 19), Context("all_gather", 16, 1 << 20)
    assert not sel.wants_timing(small) and sel.wants_timing(large)
    rng = random.Random(0)
    for _ in range(30):
        assert sel.choose(small) == "tree"
        assert sel.observe(small, "tree", 1.0) is False
    assert sel.bandit(small).policy.t == 0
    seq = _run(sel, large, 60, rng)
    assert seq[0] == "tree" and seq[-1] == "nccl_ring"


# ------------------------------------------------------------------------ bad input
def test_bad_input_errors():
    sel = Selector(ARMS, lambda c: PRED)
    with pytest.raises(TuneError, match=r"unknown context field\(s\) \['size'\]"):
        sel.choose({"collective": "all_gather", "num_ranks": 8, "nbytes": 1, "size": 3})
    with pytest.raises(TuneError, match="missing"):
        sel.choose({"collective": "all_gather", "num_ranks": 8})
    with pytest.raises(TuneError, match="unknown collective"):
        sel.choose(("allgather", 8, 1024))
    with pytest.raises(TuneError, match="num_ranks"):
        sel.choose(("all_gather", 0, 1024))
    with pytest.raises(TuneError, match="nbytes"):
        Context("all_gather", 8, -1)
    with pytest.raises(TuneError, match="no arms"):
        Selector([], None).choose(("all_gather", 8, 1024))
    with pytest.raises(TuneError, match="no arms"):
        ContextBandit(Context("all_gather", 8, 1), [], [], DEFAULT_POLICY)
    ctx = ("all_gather", 8, 1024)
    for bad in (-1e-3, 0.0, float("nan"), float("inf"), "1ms"):
        with pytest.raises(TuneError, match="latency"):
            sel.observe(ctx, "ring", bad)
    with pytest.raises(TuneError, match="unknown arm 'bogus'"):
        sel.observe(ctx, "bogus", 1e-3)
    with pytest.raises(TuneError, match="unknown policy"):
        Selector(ARMS, policy="ucb2")
    with pytest.raises(TuneError, match="bad parameters"):
        Selector(ARMS, policy={"policy": "ucb1", "beta": 1.0})
    with pytest.raises(TuneError, match="alpha"):
        Selector(ARMS, policy={"policy": "ucb1", "alpha": -1.0})
    with pytest.raises(TuneError, match="rho_max"):
        Selector(ARMS, rho_max=0.5)
    with pytest.raises(TuneError, match="prediction"):
        Selector(ARMS, lambda c: {"ring": -1.0}).choose(ctx)
    with pytest.raises(TuneError, match="does not offer"):
        Selector(ARMS, lambda c: {"bogus": 1.0}).choose(ctx)
    with pytest.raises(TuneError, match="unknown estimator"):
        make_policy({"policy": "ucb1", "estimator": "median"}, [1.0])


# ------------------------------------------------------------------------ replay metrics
def _hand_pools():
    """One context, two arms: 'slow' 1.5x 'fast'; the model ranks them wrong or right by view."""
    cfg = PoolConfig(hosts=(2,), train_hosts=(2,), sizes=(1024,), scenarios=("healthy",), collectives=("all_gather",))
    depth = cfg.depth
    samples = np.ones((1, 2, depth))
    samples[0, 0] = 1.5
    samples[0, :, :8] *= 1.13  # first-use transient
    return Pools(
        cfg,
        [
            {
                "collective": "all_gather",
                "hosts": 2,
                "scenario": "healthy",
                "nbytes": 1024,
                "num_ranks": 4,
                "split": "train",
            }
        ],
        {"all_gather": ["slow", "fast"]},
        np.array([[1.5, 1.0]]),
        samples,
        {"wrong": np.array([[1.0, 1.2]]), "right": np.array([[1.2, 1.0]])},
    )


def test_trlt_accounting_on_a_hand_built_pool():
    pools = _hand_pools()
    wrong = evaluate(pools, "auto", [0], view="wrong")
    assert wrong.selection[0] == pytest.approx(50.0)
    assert wrong.realized[0] == pytest.approx(50.0)  # both sides pay the transient once
    right = evaluate(pools, "auto", [0], view="right")
    assert right.selection[0] == pytest.approx(0.0) and right.realized[0] == pytest.approx(0.0)
    ucb = evaluate(pools, DEFAULT_POLICY, [0], view="wrong")
    assert 0.0 < ucb.selection[0] < 10.0  # learns to leave the model's wrong choice
    chosen, served = replay_context(DEFAULT_POLICY, ["slow", "fast"], [1.0, 1.2], pools.samples[0])
    assert len(chosen) == 100 and served[0] == pytest.approx(1.5 * 1.13)
    s = summarize(np.array([0.0, 5.0, 20.0, 40.0]))
    assert s["over_10"] == 2 and s["mean"] == pytest.approx(16.25) and s["exact"] == pytest.approx(0.25)


def _check_filter(pools):
    # The headline replay's view (the model is told the scenario's topology). Under the "nominal" stress
    # view the model cannot see a failure and the filter can drop the measured-best arm (docs/tuning.md).
    test = pools.indices("test")
    assert test
    keeps = filter_keeps_best(pools, test, view=HEADLINE_VIEW)
    dropped = [pools.contexts[i] for i, k in zip(test, keeps) if not k]
    assert not dropped, f"the filter drops the measured-best arm on {len(dropped)} contexts: {dropped[:3]}"


def test_filter_never_drops_the_measured_best_arm_on_a_fresh_pool():
    cfg = PoolConfig(
        hosts=(2, 4),
        train_hosts=(2,),
        sizes=(1 << 10, 1 << 20, 1 << 30),
        scenarios=("healthy", "fail2", "fail3"),
        collectives=("all_gather", "reduce_scatter"),
    )
    pools = simulate_pools(cfg, show_progress=False)
    model, report = calibrate_model(pools)
    assert report["calibrated_on"] == ["all_gather/2h/healthy", "reduce_scatter/2h/healthy"]
    pools.predictions = predict_pools(pools, model)
    _check_filter(pools)


@pytest.mark.skipif(not os.path.exists(SAVED_POOLS), reason="benchmarks/results/tuning/pools.npz not generated")
def test_filter_never_drops_the_measured_best_arm_on_the_saved_test_pools():
    pools = load_pools(SAVED_POOLS)
    assert pools.predictions, "saved pools carry the calibrated model's predictions"
    assert all("healthy" in c and "/16h/" not in c and "/32h/" not in c for c in pools.model["calibrated_on"])
    _check_filter(pools)


def test_selector_for_topology_offers_the_catalogue_and_learns():
    from jaxccl.topology import rail
    from jaxccl.tune.arms import arm_names

    topo = rail(hosts=2, gpus_per_host=2)
    sel = Selector.for_topology(topo)
    ctx = Context("all_reduce", topo.num_gpus, 1 << 24)
    b = sel.bandit(ctx)
    assert b.all_arms == [a for a in arm_names("all_reduce") if a in b.all_arms]
    assert all(p is not None and p > 0 for p in b.predictions)
    arm = sel.choose(ctx)
    assert arm == b.auto_arm  # warm start: the model's argmin first
    parts = sel.schedules(ctx, arm)
    assert parts and all(p.num_ranks == topo.num_gpus for p in parts)
    for _ in range(10):  # far slower than predicted: the clipped-SGD mean falls and the choice moves on
        assert sel.observe(ctx, arm, 1.0)
        if sel.choose(ctx) != arm:
            break
    assert sel.choose(ctx) != arm
    with pytest.raises(TuneError, match="ranks"):
        sel.choose(("all_reduce", 8, 1024))
    with pytest.raises(TuneError, match="without an arm catalogue"):
        Selector(ARMS).schedules(ctx, "ring")
