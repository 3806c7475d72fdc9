"""The closed loop: Algorithm 1, the controller, and hot-swap at the agreed sequence number."""

import dataclasses
import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from programs import all_gather_pair

import jaxccl
from jaxccl.control import Controller, check, measured_topology, nominal_capacities, profile
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.synth import baselines
from jaxccl.topology import rail

TOPO = rail(hosts=2, gpus_per_host=4)
NIC = (0, "tor:s0r0")
HEALTHY = 6  # steps before a fault: the change detector learns every entry's noise from its first 5 samples


@pytest.fixture(scope="module")
def ag():
    return jaxccl.synth.all_gather(TOPO)


# ------------------------------------------------------------------ Algorithm 1 (pure)
@pytest.mark.parametrize("kind", ["allgather", "alltoall", "ring"])
def test_algorithm1_flags_a_degraded_cut_link_only(kind, ag):
    s = {"allgather": ag, "alltoall": jaxccl.synth.all_to_all(TOPO), "ring": baselines.ring_allgather(TOPO)}[kind]
    p = profile(s, TOPO)
    cut_link = next(a for a in p.cut if 0 in a or 4 in a)  # a NIC link of GPU 0's rail
    healthy = nominal_capacities(TOPO)
    assert not check(p, healthy, gamma=0.1).flagged
    assert check(p, nominal_capacities(TOPO.degrade(*cut_link, gbps=200)), gamma=0.1).flagged
    uniform = {a: c * (0.5 if a in p.cut else 1.0) for a, c in healthy.items()}
    assert not check(p, uniform, gamma=0.1).flagged  # the whole cut scaled: nothing to re-balance
    off_cut = nominal_capacities(TOPO.degrade(0, "nvs:h0", gbps=2850))  # slower, but still not binding
    assert (0, "nvs:h0") not in p.cut
    assert not check(p, off_cut, gamma=0.1).flagged


def test_measured_topology_rounds_and_symmetrizes():
    est = {NIC: TOPO.capacity(*NIC) * 0.503, (1, "tor:s0r1"): TOPO.capacity(1, "tor:s0r1") * 0.99}
    t = measured_topology(TOPO, est, tolerance=0.05)
    assert t.capacity(*NIC) == pytest.approx(0.5 * TOPO.capacity(*NIC))
    assert t.capacity("tor:s0r0", 0) == pytest.approx(0.5 * TOPO.capacity("tor:s0r0", 0))
    assert t.capacity(1, "tor:s0r1") == TOPO.capacity(1, "tor:s0r1")  # within tolerance: healthy
    assert measured_topology(TOPO, {}, tolerance=0.05) is TOPO


# ------------------------------------------------------------------ controller on the emulated fabric
def _setup(alpha=0.5, emulation=None):
    mesh = Mesh(np.array(jax.devices()), ("d",))
    comm = jaxccl.Communicator(
        mesh,
        "d",
        topology=TOPO,
        backend="cpu",
        link_emulation=emulation or LinkEmulation(time_scale=1e-3),
        telemetry_alpha=alpha,
    )
    f, ref = all_gather_pair(mesh)
    return comm, f, ref


def _x(seed, elems=1 << 15):
    return np.random.default_rng(seed).standard_normal(8 * elems).astype(np.float32) + 0.25


def _drive(comm, ctl, f, ref, steps, *, on_step=None, seed=0):
    """Training-like loop: one collective then one controller iteration per step; bitwise checks throughout."""
    with comm:
        for k in range(steps):
            if on_step:
                on_step(k)
            x = _x(seed + k)
            np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(ref(x)))
            ctl.step()


@pytest.mark.parametrize("detector", ["cusum", "ewma"])
def test_persistent_degradation_on_the_cut_is_resynthesized_and_swapped(ag, detector):
    comm, f, ref = _setup()
    comm.install("all_gather", ag)
    ctl = Controller(comm, gamma=0.15, detector=detector)
    failed = TOPO.degrade(*NIC, gbps=200)
    _drive(comm, ctl, f, ref, HEALTHY)
    assert not [e for e in ctl.events if e.kind == "detected"]
    _drive(comm, ctl, f, ref, 10, on_step=lambda k: k == 0 and comm.inject(failed), seed=100)
    kinds = [e.kind for e in ctl.events]
    assert "detected" in kinds and "staged" in kinds and "activated" in kinds, kinds
    staged = next(e for e in ctl.events if e.kind == "staged")
    assert staged.detail["predicted_algbw"] > staged.detail["stale_algbw"]
    assert comm.schedule("all_gather") is not ag
    comm.schedule("all_gather").validate()


def test_a_communicator_on_its_default_schedule_is_resynthesized_cold():
    # The running AllGather is the communicator's default (direct, not a tree packing the synthesizer can
    # warm-start from): the re-synthesis starts cold instead of failing (it raised SynthesisError before).
    comm, f, ref = _setup()
    assert "trees" not in comm.schedule("all_gather").info
    ctl = Controller(comm, gamma=0.15)
    _drive(comm, ctl, f, ref, HEALTHY)
    _drive(comm, ctl, f, ref, 8, on_step=lambda k: k == 0 and comm.inject(TOPO.degrade(*NIC, gbps=200)), seed=100)
    kinds = [e.kind for e in ctl.events]
    assert "error" not in kinds and "synthesized" in kinds, [e.to_dict() for e in ctl.events if e.kind == "error"]
    assert "trees" in comm.schedule("all_gather").info


@pytest.mark.parametrize("detector", ["cusum", "ewma"])
def test_one_persistent_failure_gives_one_resynthesis_for_the_settled_capacity(ag, detector):
    """The EWMA falls towards the new capacity over several samples; acting on it half-way would synthesize
    for a capacity the link does not have and swap again at every later sample (one failure, several swaps).
    The change-point test estimates the new rate from the samples after the change instead."""
    comm, f, ref = _setup()
    comm.install("all_gather", ag)
    ctl = Controller(comm, gamma=0.15, detector=detector)
    _drive(comm, ctl, f, ref, HEALTHY)
    _drive(comm, ctl, f, ref, 20, on_step=lambda k: k == 0 and comm.inject(TOPO.degrade(*NIC, gbps=200)), seed=50)
    kinds = [e.kind for e in ctl.events]
    assert kinds.count("detected") == kinds.count("confirmed") == kinds.count("synthesized") == 1, kinds
    assert kinds.count("staged") == 1 and kinds.count("activated") == 1, kinds
    assert kinds.index("detected") < kinds.index("confirmed") < kinds.index("synthesized")
    nic = f"{NIC[0]}->{NIC[1]}"
    detected, confirmed = (next(e for e in ctl.events if e.kind == k) for k in ("detected", "confirmed"))
    assert nic in detected.detail["degraded"]  # the first sample already blames GPU 0's NIC
    blamed = confirmed.detail["degraded"]
    assert blamed[nic] == pytest.approx(0.5, abs=0.05)  # re-synthesized for the capacity the link now has
    assert all(link.startswith(("0->", "4->")) or link.endswith(("->0", "->4")) for link in blamed), blamed
    staged = next(e for e in ctl.events if e.kind == "staged")
    assert staged.detail["predicted_algbw"] > staged.detail["stale_algbw"]


@pytest.mark.parametrize("detector", ["cusum", "ewma"])
def test_a_resynthesis_below_the_minimum_gain_is_rejected(ag, detector):
    comm, f, ref = _setup()
    comm.install("all_gather", ag)
    ctl = Controller(comm, gamma=0.15, min_gain=5.0, detector=detector)  # asks for 6x the stale schedule's algbw
    _drive(comm, ctl, f, ref, HEALTHY)
    _drive(comm, ctl, f, ref, 12, on_step=lambda k: k == 0 and comm.inject(TOPO.degrade(*NIC, gbps=200)), seed=70)
    rejected = [e for e in ctl.events if e.kind == "rejected"]
    assert rejected and "min_gain" in rejected[0].detail["reason"], [e.kind for e in ctl.events]
    assert rejected[0].detail["stale_algbw"] < rejected[0].detail["predicted_algbw"]  # better, not enough
    assert "staged" not in [e.kind for e in ctl.events]
    assert comm.schedule("all_gather") is ag


def test_no_resynthesis_for_a_burst_shorter_than_the_ewma_window(ag):
    comm, f, ref = _setup(alpha=0.2)
    comm.install("all_gather", ag)
    ctl = Controller(comm, gamma=0.15, detector="ewma")
    failed = TOPO.degrade(*NIC, gbps=200)

    def burst(k):
        if k == 3:
            comm.inject(failed)
        if k == 4:  # one collective later the link is back
            comm.inject(TOPO)

    _drive(comm, ctl, f, ref, 12, on_step=burst)
    assert not [e for e in ctl.events if e.kind in ("synthesized", "staged")], [e.kind for e in ctl.events]
    assert comm.schedule("all_gather") is ag


@pytest.mark.parametrize("detector", ["cusum", "ewma"])
def test_no_resynthesis_when_the_degraded_link_is_off_the_cut(ag, detector):
    comm, f, ref = _setup()
    comm.install("all_gather", ag)
    ctl = Controller(comm, gamma=0.15, detector=detector)
    off_cut = TOPO.degrade(0, "nvs:h0", gbps=2850)
    _drive(comm, ctl, f, ref, HEALTHY + 6, on_step=lambda k: k == HEALTHY and comm.inject(off_cut))
    assert not [e for e in ctl.events if e.kind in ("synthesized", "staged")]


@pytest.mark.parametrize("detector", ["cusum", "ewma"])
def test_no_resynthesis_when_the_whole_cut_is_scaled_uniformly(ag, detector):
    comm, f, ref = _setup()
    comm.install("all_gather", ag)
    ctl = Controller(comm, gamma=0.15, detector=detector)
    cut = profile(ag, TOPO).cut
    slower = TOPO.with_edges({e: {"capacity": 0.5 * TOPO.capacity(*e)} for e in cut})
    _drive(comm, ctl, f, ref, HEALTHY + 6, on_step=lambda k: k == HEALTHY and comm.inject(slower))
    assert not [e for e in ctl.events if e.kind in ("synthesized", "staged")]
    assert comm.telemetry().matrix[0, 4] < 0.6 * TOPO.capacity(*NIC)  # the slowdown was seen, and ignored


def test_a_controller_exception_never_breaks_the_training_step(ag):
    comm, f, ref = _setup()
    comm.install("all_gather", ag)

    def broken(topo, previous):
        raise RuntimeError("synthesizer exploded")

    ctl = Controller(comm, gamma=0.15, synthesizers={"all_gather": broken}, interval_s=0.005)
    with ctl, comm:  # the background thread keeps failing while training runs
        for k in range(HEALTHY + 10):
            if k == HEALTHY:
                comm.inject(TOPO.degrade(*NIC, gbps=200))
            x = _x(k)
            np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(ref(x)))
    errors = ctl.errors
    assert errors and "synthesizer exploded" in errors[0].detail["error"]
    assert comm.schedule("all_gather") is ag  # the active schedule kept running


def test_controller_bad_input():
    mesh = Mesh(np.array(jax.devices()), ("d",))
    with pytest.raises(ValueError, match="topology"):
        Controller(jaxccl.Communicator(mesh, "d", backend="cpu"))
    comm, _, _ = _setup()
    with pytest.raises(ValueError, match="synthesizer"):
        Controller(comm, collectives=("broadcast",))
    with pytest.raises(ValueError, match="gamma"):
        Controller(comm, gamma=-1)
    with pytest.raises(ValueError, match="min_gain"):
        Controller(comm, min_gain=-0.1)
    with pytest.raises(ValueError, match="detector"):
        Controller(comm, detector="page")
    with pytest.raises(ValueError, match="hold"):
        Controller(comm, hold=-1)
    with pytest.raises(ValueError, match="false_alarm_rate"):
        Controller(comm, false_alarm_rate=0.0)


# ------------------------------------------------------------------ hot-swap property
def test_results_stay_bitwise_equal_across_hot_swaps_at_random_points(ag):
    comm, f, ref = _setup(emulation=LinkEmulation(time_scale=1e-2))
    schedules = [
        ag,
        baselines.ring_allgather(TOPO, channels=2),
        baselines.recursive_doubling_allgather(8),
        jaxccl.synth.all_gather(TOPO.degrade(*NIC, gbps=200)),
    ]
    rng = np.random.default_rng(7)
    stop = threading.Event()
    installed = []

    def swapper():
        while not stop.is_set():
            s = schedules[int(rng.integers(len(schedules)))]
            comm.install("all_gather", s)
            installed.append(s.name)
            stop.wait(float(rng.uniform(0.0, 0.03)))

    th = threading.Thread(target=swapper)
    th.start()
    versions = []
    try:
        with comm:
            for k in range(40):
                x = _x(k, elems=int(rng.integers(1, 2048)))
                np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(ref(x)))
                versions.append(jaxccl.runtime.native.last_launch_version(comm.slot("all_gather")))
    finally:
        stop.set()
        th.join(10)
    assert len(set(versions)) > 3, versions  # it really swapped many times mid-run
    assert versions == sorted(versions)  # launches never go back to an older version
    st = comm.swap_state("all_gather")
    assert st["last_swap_seq"] <= st["issued"]


def test_staged_schedule_activates_at_the_next_sequence_number(ag):
    comm, f, ref = _setup(emulation=LinkEmulation(time_scale=1e-2))
    x = _x(1, 64)
    with comm:
        f(x).block_until_ready()
        before = comm.swap_state("all_gather")
        v = comm.stage_validated("all_gather", ag)
        st = comm.swap_state("all_gather")
        assert st["staged_version"] == v and st["current_version"] == before["current_version"]
        assert st["transition_seq"] == before["issued"]
        np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(ref(x)))
        st = comm.swap_state("all_gather")
    assert st["current_version"] == v and st["staged_version"] == 0
    assert st["last_swap_seq"] == before["issued"] + 1


# ------------------------------------------------------------------ the change-point controller's hysteresis
def _versions_during(comm, ctl, f, ref, steps, on_step):
    out = []

    def record(k):
        on_step(k)
        if k:
            out.append(jaxccl.runtime.native.last_launch_version(comm.slot("all_gather")))

    _drive(comm, ctl, f, ref, steps, on_step=record)
    return out


def test_a_flapping_link_is_planned_for_its_worse_state(ag):
    comm, f, ref = _setup()
    comm.install("all_gather", ag)
    ctl = Controller(comm, gamma=0.15, hold=10)
    bad = TOPO.degrade(*NIC, gbps=160)  # 0.4x, every other 3 steps

    def flap(k):
        if k >= HEALTHY and (k - HEALTHY) % 3 == 0:
            comm.inject(bad if (k - HEALTHY) // 3 % 2 == 0 else TOPO)

    versions = _versions_during(comm, ctl, f, ref, HEALTHY + 30, flap)
    swaps = [k for k in range(1, len(versions)) if versions[k] != versions[k - 1]]
    assert len(swaps) == 1, (swaps, [e.kind for e in ctl.events])  # one swap, to the schedule for the worse state
    staged = next(e for e in ctl.events if e.kind == "staged")
    assert staged.detail["predicted_algbw"] > staged.detail["stale_algbw"]
    confirmed = next(e for e in ctl.events if e.kind == "confirmed")
    assert confirmed.detail["degraded"][f"{NIC[0]}->{NIC[1]}"] == pytest.approx(0.4, abs=0.05)


def test_a_healed_link_is_swapped_back_after_the_hold(ag):
    comm, f, ref = _setup()
    comm.install("all_gather", ag)
    hold = 6
    ctl = Controller(comm, gamma=0.15, hold=hold)

    def burst(k):
        if k == HEALTHY:
            comm.inject(TOPO.degrade(*NIC, gbps=160))
        if k == HEALTHY + 2:
            comm.inject(TOPO)

    versions = _versions_during(comm, ctl, f, ref, HEALTHY + 2 + 2 * hold + 4, burst)
    swaps = [k for k in range(1, len(versions)) if versions[k] != versions[k - 1]]
    assert len(swaps) == 2 and swaps[1] - swaps[0] >= hold, (swaps, [e.kind for e in ctl.events])
    back = [e for e in ctl.events if e.kind == "confirmed"][-1]
    assert back.detail["degraded"] == {}  # re-synthesized for the healed fabric
    staged = [e for e in ctl.events if e.kind == "staged"][-1]
    assert staged.detail["predicted_algbw"] > 1.05 * staged.detail["stale_algbw"]


class _MeterReadsHigh:
    """The communicator, with a meter that reads every inter-node pair ``factor`` x too fast (as sends that
    complete in socket and qdisc buffers do across processes); everything else is the communicator's."""

    def __init__(self, comm, factor):
        self._comm, self._factor, self._seen, self._scaled = comm, factor, None, None

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def telemetry(self):
        t = self._comm.telemetry()
        if t is not self._seen:  # one reading per snapshot: the controller feeds each once
            w = t.windows.copy()
            w["rate"] = np.where(w["src"] != w["dst"], w["rate"] * self._factor, w["rate"])
            self._seen, self._scaled = t, dataclasses.replace(t, windows=w)
        return self._scaled


@pytest.mark.parametrize("factor", [1.0, 1.4])
def test_a_meter_that_reads_high_is_calibrated_to_the_links_capacity(ag, factor):
    """A pair first learned above its route's capacity has its levels scaled so that it reads the capacity: a NIC
    at half its rate is re-synthesized for half, not for the 0.7 it reads through a meter 1.4x too fast."""
    comm, f, ref = _setup()
    comm.install("all_gather", ag)
    ctl = Controller(_MeterReadsHigh(comm, factor), gamma=0.15)
    _drive(comm, ctl, f, ref, HEALTHY)
    _drive(comm, ctl, f, ref, 4, on_step=lambda k: k == 0 and comm.inject(TOPO.degrade(*NIC, gbps=200)), seed=90)
    confirmed = next(e for e in ctl.events if e.kind == "confirmed")
    assert confirmed.detail["degraded"][f"{NIC[0]}->{NIC[1]}"] == pytest.approx(0.5, abs=0.03)
    assert "staged" in [e.kind for e in ctl.events]


SEED = 2  # a seed whose noise shows both: deterministic (every entry draws its own sequence)


@pytest.mark.parametrize("fault", ["persistent", "one-step dip"])
def test_a_suspected_change_is_synthesized_ahead_and_a_cleared_one_discarded(ag, fault):
    """With noisy windows (``window_noise`` 10 %) a NIC at 0.65x is suspected a sample before it is decided (at
    0.6x its two pairs decide it jointly at once): the decision takes the schedule synthesized for the suspicion
    (``synth_ms`` 0); a one-step dip is suspected, then discarded. The healthy steps before give no event at all."""
    comm, f, ref = _setup(emulation=LinkEmulation(time_scale=1e-3, window_noise=0.1, noise_seed=SEED))
    comm.install("all_gather", ag)
    ctl = Controller(comm, gamma=0.15)
    _drive(comm, ctl, f, ref, 3 * HEALTHY)
    assert not ctl.events, [e.kind for e in ctl.events]

    def on_step(k):
        if k == 0:
            comm.inject(TOPO.degrade(*NIC, gbps=260))
        if k == 1 and fault == "one-step dip":
            comm.inject(TOPO)

    _drive(comm, ctl, f, ref, 6, on_step=on_step, seed=200)
    kinds = [e.kind for e in ctl.events]
    if fault == "one-step dip":
        assert "discarded" in kinds and "staged" not in kinds, kinds
        return
    synthesized = next(e for e in ctl.events if e.kind == "synthesized")
    assert synthesized.detail["synth_ms"] == 0.0 and synthesized.detail["speculative_ms"] > 0, synthesized.detail
    assert "staged" in kinds and "discarded" not in kinds, kinds


def test_two_cut_nics_are_planned_for_together_when_one_is_decided_first(ag):
    """GPU 0's NIC at 0.4x is decided on its first degraded window; GPU 5's (the other host, another rail) at
    0.6x is only a suspect then. The schedule synthesized at the decision is planned for both (the suspect at its
    provisional level), not for GPU 0's alone, which would load GPU 5's cut NIC and need a second swap."""
    comm, f, ref = _setup(emulation=LinkEmulation(time_scale=1e-3, window_noise=0.1, noise_seed=SEED))
    comm.install("all_gather", ag)
    ctl = Controller(comm, gamma=0.15, hold=4)
    _drive(comm, ctl, f, ref, 3 * HEALTHY)
    second = (5, "tor:s0r1")
    both = TOPO.degrade(*NIC, gbps=160).degrade(*second, gbps=240)
    _drive(comm, ctl, f, ref, 16, on_step=lambda k: k == 0 and comm.inject(both), seed=300)
    confirmed = next(e for e in ctl.events if e.kind == "confirmed")
    assert [c.split(" ")[0] for c in confirmed.detail["changes"]] == ["4->0", "0->4"]  # GPU 0's NIC decided alone
    degraded = confirmed.detail["degraded"]
    assert degraded[f"{NIC[0]}->{NIC[1]}"] == pytest.approx(0.4, abs=0.06), degraded
    assert degraded[f"{second[0]}->{second[1]}"] == pytest.approx(0.6, abs=0.1), degraded
    assert [e.kind for e in ctl.events].count("staged") == 1, [e.kind for e in ctl.events]
    comm.schedule("all_gather").validate()
