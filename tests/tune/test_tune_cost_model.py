"""jaxccl.tune: arm catalogue, the alpha-beta cost model, its margin and its calibration."""

import math

import numpy as np
import pytest

import jaxccl.sim as sim
from jaxccl.sim.analytic import ring_time
from jaxccl.synth.baselines import rail_ring_order
from jaxccl.topology import rail, scenario
from jaxccl.tune.arms import Context, TuneError, arm_catalog, direct_allgather
from jaxccl.tune.cost_model import CostModel, CostParams, calibrate, margin


@pytest.fixture(scope="module")
def topo():
    return rail(hosts=2, gpus_per_host=4)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_catalogue_schedules_pass_the_interpreter(topo, collective):
    arms = arm_catalog(collective, topo)
    assert len(arms) >= 4
    for arm in arms:
        assert arm.collective == collective and arm.num_ranks == topo.num_gpus
        for part in arm.parts:
            part.validate()


def test_catalogue_order_and_power_of_two_rule():
    assert [a.name for a in arm_catalog("all_gather", rail(hosts=2, gpus_per_host=4))] == [
        "ring",
        "nccl_ring",
        "rd",
        "tree",
        "direct",
    ]
    assert "rd" not in [a.name for a in arm_catalog("all_gather", rail(hosts=3, gpus_per_host=2))]
    with pytest.raises(TuneError, match="unknown arm"):
        arm_catalog("all_gather", rail(hosts=2, gpus_per_host=2), names=["ring", "bogus"])
    with pytest.raises(TuneError, match="no arm catalogue"):
        arm_catalog("all_to_all", rail(hosts=2, gpus_per_host=2))


def test_direct_allgather_validates_and_simulates_as_one_step():
    s = direct_allgather(5).validate()
    assert s.num_ops == 5 * (1 + 2 * 4)
    t = rail(hosts=1, gpus_per_host=5)
    res = sim.run(t, s, bytes_per_rank=1 << 20)
    assert res.time_s > 0


def test_ring_prediction_matches_the_closed_form_and_the_simulator(topo):
    """A ring keeps every hop busy: the model's load bound is the exact large-message time."""
    model = CostModel()
    arm = next(a for a in arm_catalog("all_gather", topo) if a.name == "ring")
    n = 1 << 30
    shard = n / topo.num_gpus
    pred = float(model.predict(arm, topo, n)[0])
    closed = ring_time(topo, [rail_ring_order(topo)], shard, steps=topo.num_gpus - 1)
    simulated = sim.run(topo, arm.parts[0], bytes_per_rank=shard).time_s
    assert pred == pytest.approx(closed, rel=1e-3)
    assert pred == pytest.approx(simulated, rel=1e-3)


def test_small_message_prediction_is_the_latency_critical_path(topo):
    """At a few bytes the ring costs N-1 store-and-forward hops of route latency."""
    arm = next(a for a in arm_catalog("all_gather", topo) if a.name == "ring")
    order = rail_ring_order(topo)
    hops = [topo.path_latency(order[i], order[(i + 1) % len(order)]) for i in range(len(order))]
    pred = float(CostModel().predict(arm, topo, 8)[0])
    # a message crosses N - 1 consecutive ring hops; the slowest such chain sets the time
    chains = [sum(hops[(s + i) % len(hops)] for i in range(len(hops) - 1)) for s in range(len(hops))]
    assert pred == pytest.approx(max(chains), rel=1e-3)
    scaled = CostModel(CostParams(hop_overhead_s=1e-6)).predict(arm, topo, 8)[0]
    assert scaled == pytest.approx(pred + (topo.num_gpus - 1) * 1e-6, rel=1e-3)


def test_composite_arm_is_the_sum_of_its_parts(topo):
    model = CostModel()
    arms = {a.name: a for a in arm_catalog("all_reduce", topo)}
    ag = {a.name: a for a in arm_catalog("all_gather", topo)}
    rs = {a.name: a for a in arm_catalog("reduce_scatter", topo)}
    n = 1 << 24
    total = model.predict(arms["rs_ag_tree"], topo, n)[0]
    assert total == pytest.approx(model.predict(rs["tree"], topo, n)[0] + model.predict(ag["tree"], topo, n)[0])


def test_predictions_follow_a_degraded_link(topo):
    model = CostModel()
    arm = next(a for a in arm_catalog("all_gather", topo) if a.name == "nccl_ring")
    bad = scenario(topo, "fail2")
    assert model.predict(arm, bad, 1 << 30)[0] > 2 * model.predict(arm, topo, 1 << 30)[0]


def test_margin():
    assert margin({"a": 2.0, "b": 3.0, "c": 9.0}) == pytest.approx(0.5)
    assert margin([4.0, None, 1.0]) == pytest.approx(3.0)
    assert margin({"a": 1.0, "b": None}) == math.inf
    assert margin([]) == math.inf
    with pytest.raises(TuneError, match="positive"):
        margin([1.0, -2.0])


def test_context_margin_from_the_model(topo):
    model = CostModel()
    arms = arm_catalog("all_gather", topo)
    pred = model.predict_context(Context("all_gather", topo.num_gpus, 1 << 28), arms, topo)
    best, second = sorted(pred.values())[:2]
    assert margin(pred) == pytest.approx(second / best - 1)
    assert margin(pred) > 0


def test_calibration_recovers_known_constants(topo):
    """Measurements made by the model at known constants are fit back exactly (the grid holds them)."""
    truth = CostModel(CostParams(latency_scale=1.5, hop_overhead_s=0.25e-6, bw_efficiency=0.8, base_s=1e-6))
    sizes = [1 << k for k in range(9, 31, 3)]
    samples = []
    for coll in ("all_gather", "all_reduce"):
        for arm in arm_catalog(coll, topo):
            samples.append((arm, topo, sizes, truth.predict(arm, topo, sizes)))
    model, report = calibrate(samples)
    assert model.params == truth.params
    assert report["rms_log_error"] == pytest.approx(0.0, abs=1e-9)
    assert report["rms_log_error_physical"] > 0.01


def test_bad_input(topo):
    model = CostModel()
    arm = arm_catalog("all_gather", topo)[0]
    with pytest.raises(TuneError, match="sizes"):
        model.predict(arm, topo, [-1])
    with pytest.raises(TuneError, match="ranks"):
        model.predict_context(Context("all_gather", 4, 1024), [arm], topo)
    with pytest.raises(TuneError, match="runs all_gather"):
        model.predict_context(Context("all_reduce", 8, 1024), [arm], topo)
    with pytest.raises(TuneError, match="bw_efficiency"):
        CostParams(bw_efficiency=0)
    with pytest.raises(TuneError, match="unknown cost-model parameter"):
        CostParams.from_dict({"latency": 1.0})
    with pytest.raises(TuneError, match="does not fit"):
        model.predict(arm, rail(hosts=1, gpus_per_host=2), 1024)
    with pytest.raises(TuneError, match="at least one sample"):
        calibrate([])
    with pytest.raises(TuneError, match="unknown calibration parameter"):
        calibrate([(arm, topo, [1024], [1e-5])], grid={"alpha": (1.0,)})
    round_trip = CostModel.from_dict(CostModel(CostParams(base_s=1e-6)).to_dict())
    assert round_trip.params.base_s == 1e-6
    assert np.isfinite(round_trip.predict(arm, topo, [0, 1 << 20])).all()
