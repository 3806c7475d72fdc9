"""The change-point test on recorded measurement windows (tests/data/windows) and on synthetic noise.

The demo traces are the raw windows of the demo's AllGather (rail 2 x 4, emulated links,
``benchmarks/control/record_windows.py``): GPU 0's NIC halved at step 14, GPU 0's NVLink uplink at
0.4x from step 14 (time scale 1e-4, the links' own timestamps: exact windows), and a healthy one at
time scale 1e-2 with the receiving threads' timestamps, whose short windows read low and scatter
(the host's wake-up latency): the noise that made the EWMA controller wait for confirmation. The
netns trace is what process 0's controller read in ``jaxccl demo --network netns`` (8 processes on
2 cores, one sample per pair and step, ~16 % spread) with the NICs of ranks 2 and 4 cut from step 9.
"""

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from jaxccl.control.detector import ChangeDetector, cusum_threshold
from jaxccl.errors import ArgumentError
from jaxccl.telemetry.matrix import WINDOW_DTYPE, route_links
from jaxccl.topology import rail

DATA = Path(__file__).resolve().parents[1] / "data" / "windows"


def _steps(name):
    """The trace's windows grouped by step, in order: ``[(step, WINDOW_DTYPE rows)]``."""
    rows = json.loads((DATA / name).read_text())["rows"]
    by_step: dict[int, list] = {}
    for step, src, dst, rate in rows:
        by_step.setdefault(step, []).append((src, dst, rate, 1))
    return [(s, np.array(w, dtype=WINDOW_DTYPE)) for s, w in sorted(by_step.items())]


def _replay(name, **options):
    det = ChangeDetector(**options)
    decided = [(s, c) for s, w in _steps(name) for c in det.update(w, now_ns=s)]
    first_learned: dict = {}
    for s, c in decided:
        if c.kind == "learned":
            first_learned.setdefault(c.entry, s)
    inter = [s for e, s in first_learned.items() if e[0] != e[1]]
    assert inter and set(inter) == {det.warmup - 1}  # one window per pair and step: learned at the warmup
    return det, [(s, c) for s, c in decided if c.kind == "shift"]


def test_a_halved_nic_is_decided_on_its_first_degraded_window():
    det, changes = _replay("demo_nic_halved.json")
    inter = [(s, c) for s, c in changes if c.entry[0] != c.entry[1]]
    assert sorted(c.entry for _, c in inter) == [(0, 4), (4, 0)], inter  # GPU 0's pairs across its NIC, only
    assert all(s == 14 and c.samples == 1 and c.change_ns == 14 for s, c in inter)
    assert all(c.ratio == pytest.approx(0.5, rel=0.02) for _, c in inter)  # the degraded rate, estimated
    assert det.level((0, 4)) == pytest.approx(0.5 * det.level((1, 5)), rel=0.02)


def test_a_degraded_nvlink_is_decided_on_its_first_degraded_injection_window():
    det, changes = _replay("demo_nvlink_degraded.json")
    assert not [c for _, c in changes if c.entry[0] != c.entry[1]]  # nothing across hosts changed
    assert [(s, c.entry) for s, c in changes] == [(14, (0, 0))], changes  # GPU 0's injection, in the fault's step
    assert changes[0][1].samples == 1 and changes[0][1].ratio == pytest.approx(0.4, rel=0.02)
    assert det.level((0, 0)) == pytest.approx(0.4 * 360e9, rel=0.02)  # the uplink's capacity x 0.4


def test_short_windows_that_read_low_decide_no_fall():
    det, changes = _replay("demo_healthy_short_windows.json")
    # 100 healthy steps of ~30 % noise: no fall decided; the job's first steps ran 2-4x slower than the rest (its
    # warm-up), and the levels learned from them rise once, to the steady rate
    assert all(c.ratio > 1.2 for _, c in changes), changes
    assert len({c.entry for _, c in changes}) == len(changes)
    assert det.sigma((0, 4)) > 0.2  # the noise model learned the scatter (the emulator's exact windows: 0.02)


def test_nics_cut_across_processes_are_decided_on_their_pairs_only():
    det, changes = _replay("netns_nics_cut.json")
    cut = {(0, 4), (4, 0), (2, 6), (6, 2)}  # the pairs across the NICs of ranks 2 and 4
    assert changes and all(s >= 9 for s, _ in changes), changes  # nothing before the cut
    assert {c.entry for _, c in changes} <= cut, changes
    first = {}
    for s, c in changes:
        first.setdefault(c.entry, (s, c))
    assert len(first) >= 3, first
    for s, c in first.values():
        assert s - 9 <= 7 and c.ratio < 0.6, (s, c)  # one sample per step of ~17 % noise: within 8; the fall


def test_nics_cut_across_processes_are_decided_a_step_earlier_jointly_with_their_reverse_pairs():
    """Each cut NIC carries two pairs of the trace, one each way: tested jointly, both NICs are decided on the
    second fully degraded step (the cut came during step 9), a step or two before either pair alone, and on
    their own pairs only; the healthy steps before decide nothing."""
    topo = rail(hosts=2, gpus_per_host=4)
    det, changes = _replay("netns_nics_cut.json", links_of=functools.partial(route_links, topo))
    cut = {(0, 4), (4, 0), (2, 6), (6, 2)}
    assert {c.entry for _, c in changes} == cut, changes
    assert all(s == 11 and c.ratio < 0.6 for s, c in changes), changes
    assert det.group_shifts == 2
    alone, alone_changes = _replay("netns_nics_cut.json")
    assert min(s for s, _ in alone_changes) == 12 and alone.group_tests == 0


@pytest.mark.parametrize("rate", [1e-3, 1e-5])
def test_joint_tests_keep_the_stated_false_alarm_rate_on_gaussian_noise(rate):
    """40 pairs, each sharing a link with its reverse pair: the joint tests add one test per link and sample, and
    their decisions stay near the rate too."""
    rng = np.random.default_rng(3)
    det = ChangeDetector(false_alarm_rate=rate, sigma_floor=1e-3, links_of=lambda e: [frozenset(e)])  # one link
    decided = 0
    for t in range(500):
        w = np.zeros(40, WINDOW_DTYPE)
        node, back = np.repeat(np.arange(20), 2), np.arange(40) % 2 == 1
        w["src"], w["dst"], w["count"] = np.where(back, 100, node), np.where(back, node, 100), 1  # (i, 100), (100, i)
        w["rate"] = 1e9 * np.exp(0.05 * rng.standard_normal(40))
        decided += len([c for c in det.update(w, now_ns=t) if c.kind == "shift"])
    tests = 2 * (sum(det.tested.values()) + det.group_tests)  # a downward and an upward test per sample
    assert det.group_tests > 0.9 * 20 * (500 - det.warmup - 1)
    assert decided <= max(3.0, 5 * rate * tests), decided
    assert len(det._thresholds) < 1000  # k on a grid: the memo does not grow with every update (was 87k here)


@pytest.mark.parametrize("seed", range(4))
def test_an_entry_in_several_links_groups_is_decided_once(seed):
    """(1, 0) shares one link with (0, 1) and another with (0, 2): a fall of all three to 0.8x under 5 % noise is
    decided within a few samples, partly jointly, and every entry once (a decision restarts the joint tests that
    hold its samples from before)."""
    links = {(0, 1): ["a"], (1, 0): ["a", "b"], (0, 2): ["b"]}
    det = ChangeDetector(links_of=links.__getitem__)
    rng = np.random.default_rng(seed)
    decided = []
    for t in range(60):
        w = np.zeros(3, WINDOW_DTYPE)
        w["src"], w["dst"], w["count"] = [0, 1, 0], [1, 0, 2], 1
        w["rate"] = 1e9 * (0.8 if t >= 40 else 1.0) * np.exp(0.05 * rng.standard_normal(3))
        decided += [(t, c.entry) for c in det.update(w, now_ns=t) if c.kind == "shift"]
    assert sorted(e for _, e in decided) == [(0, 1), (0, 2), (1, 0)], decided
    assert all(40 <= t <= 44 for t, _ in decided) and det.group_shifts >= 1, decided


def _false_decisions(rate, entries, samples, seed):
    """Decided shifts on ``samples`` samples of 5 % Gaussian noise for each of ``entries`` entries, and the bound
    the stated rate allows (5x its expectation over every tested sample and direction, at least 3)."""
    rng = np.random.default_rng(seed)
    det = ChangeDetector(false_alarm_rate=rate, min_shift=0.15, sigma_floor=1e-3)
    decided = 0
    for t in range(samples):
        w = np.zeros(entries, WINDOW_DTYPE)
        w["src"], w["dst"], w["count"] = np.arange(entries), np.arange(entries) + 1, 1
        w["rate"] = 1e9 * np.exp(0.05 * rng.standard_normal(entries))
        decided += len([c for c in det.update(w, now_ns=t) if c.kind == "shift"])
    tests = entries * (samples - det.warmup) * 2  # a downward and an upward decision per tested sample
    return decided, max(3.0, 5 * rate * tests)


@pytest.mark.parametrize("rate", [1e-3, 1e-6])
def test_false_decisions_on_gaussian_noise_stay_near_the_stated_rate(rate):
    decided, bound = _false_decisions(rate, entries=40, samples=500, seed=0)
    assert decided <= bound, decided


def test_a_small_shift_is_found_by_accumulation_and_its_level_estimated():
    rng = np.random.default_rng(1)
    det = ChangeDetector(false_alarm_rate=1e-6)
    found = []
    for t in range(200):
        w = np.zeros(1, WINDOW_DTYPE)
        w["src"], w["dst"], w["count"] = 0, 4, 1
        w["rate"] = 1e9 * (0.8 if t >= 100 else 1.0) * np.exp(0.05 * rng.standard_normal())
        found += [c for c in det.update(w, now_ns=t) if c.kind == "shift"]
    assert len(found) == 1, found
    c = found[0]
    assert 100 <= c.decided_ns <= 110 and 95 <= c.change_ns <= c.decided_ns
    assert c.ratio == pytest.approx(0.8, rel=0.05)


def test_after_a_decision_the_entry_relearns_its_centre_and_keeps_its_spread():
    det = ChangeDetector(warmup=3)
    w = np.zeros(1, WINDOW_DTYPE)
    w["src"], w["dst"], w["count"] = 1, 5, 1
    for t, r in enumerate([1.0, 1.01, 0.99, 1.0]):
        w["rate"] = r
        assert [c.kind for c in det.update(w, now_ns=t)] == (["learned"] if t == 2 else [])
    sigma = det.sigma((1, 5))
    kinds = []
    for t, r in ((10, 0.5), (11, 0.52), (12, 0.5)):
        w["rate"] = r
        kinds += [(c.kind, c.change_ns) for c in det.update(w, now_ns=t)]
    # decided on the first low sample, then re-learned from it and the next two, reported from when it began
    assert kinds == [("shift", 10), ("learned", 10)]
    # the spread stays the learned one; its confidence bound only tightens as residuals accumulate
    assert det.level((1, 5)) == pytest.approx(0.5) and det.sigma_floor < det.sigma((1, 5)) <= sigma


def test_bad_parameters_are_named_errors():
    with pytest.raises(ArgumentError, match="false_alarm_rate"):
        ChangeDetector(false_alarm_rate=1.5)
    with pytest.raises(ArgumentError, match="warmup"):
        ChangeDetector(warmup=1)
    with pytest.raises(ArgumentError, match="k must"):
        cusum_threshold(1e-3, 0.0)
    with pytest.raises(ArgumentError, match="WINDOW_DTYPE"):
        ChangeDetector().update(np.zeros(3), now_ns=0)


def test_a_spread_learned_from_few_samples_is_not_trusted():
    """Entries that just finished learning from 5 samples keep their false-alarm rate: the spread is raised to
    its 99 % upper bound and moderated by the pool (a bare 5-sample estimate is often half the true spread)."""
    decided, bound = _false_decisions(1e-3, entries=2000, samples=20, seed=4)
    assert decided <= bound, decided
