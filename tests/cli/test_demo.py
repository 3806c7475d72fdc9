"""``jaxccl demo``: the closed loop's story, told truthfully (one failure, one detection, one swap), and its outputs."""

import json
import math

import pytest

from jaxccl.cli import main
from jaxccl.control import Event
from jaxccl.demos.closed_loop import (
    FAILED_LINK,
    DemoConfig,
    _is_false_detection,
    failed_links,
    failure_label,
    reaction_fields,
    run,
)
from jaxccl.errors import ArgumentError
from jaxccl.topology import rail

REQUIRED = (
    "algbw_healthy",
    "algbw_stale",
    "algbw_recovered",
    "detect_ms",
    "synth_ms",
    "swap_ms",
    "loss_matches_reference",
)


def _detected(t_ns, *links):
    return Event("detected", t_ns, "all_gather", {"degraded": dict.fromkeys(links, 0.5)})


def test_false_detection_rules():
    u, v = FAILED_LINK
    assert not _is_false_detection(_detected(10, f"{u}->{v}", "tor:s0r0->4"), inject_ns=5)
    assert not _is_false_detection(_detected(10, f"{v}->{u}"), inject_ns=5)  # the reverse direction counts
    assert _is_false_detection(_detected(10, "3->tor:s0r3"), inject_ns=5)  # blames another link
    assert _is_false_detection(_detected(4, f"{u}->{v}"), inject_ns=5)  # before the failure
    assert _is_false_detection(_detected(4, f"{u}->{v}"), inject_ns=0)  # no failure injected at all


def test_two_failed_links_count_either():
    two = failed_links("two", rail(hosts=2, gpus_per_host=4))
    assert two == ((0, "tor:s0r0"), (5, "tor:s0r1"))
    assert not _is_false_detection(_detected(10, "tor:s0r1->5"), 5, two)
    assert not _is_false_detection(_detected(10, "0->tor:s0r0"), 5, two)
    assert _is_false_detection(_detected(10, "4->tor:s0r0"), 5, two)


def test_each_fault_names_its_links_and_depth():
    topo = rail(hosts=2, gpus_per_host=4)
    assert failed_links("nic", topo) == (FAILED_LINK,)
    assert failed_links("nvlink", topo) == ((0, "nvs:h0"),)
    assert failure_label("nvlink", 0.3, topo) == "gray failure: GPU 0's NVLink 2880 -> 864 Gbps"
    with pytest.raises(ArgumentError, match="fail_link"):
        failed_links("pcie", topo)


@pytest.mark.parametrize(
    "bad",
    [{"detector": "glr"}, {"fail_link": "pcie"}, {"depth": 0}, {"depth": 1.0}, {"depth": math.nan}, {"depth": True}],
)
def test_bad_settings_are_argument_errors(bad):
    with pytest.raises(ArgumentError, match=next(iter(bad))):
        DemoConfig(**bad)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--depth", "1.5"], "--depth"),
        (["--depth", "0"], "--depth"),
        (["--fail-link", "pcie"], "--fail-link"),
        (["--detector", "glr"], "--detector"),
        (["--network", "loopback", "--fail-link", "two"], "--fail-link applies to the single-process demo only"),
        (["--network", "loopback", "--depth", "0.4"], "--depth applies to the single-process demo only"),
    ],
)
def test_bad_flags_are_one_line_usage_errors(argv, needle, capsys):
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def _event(kind, t_ns, **detail):
    return Event(kind, t_ns, "all_gather", detail)


def test_reaction_counts_steps_to_active_and_the_time_from_the_change_to_staging():
    rows = [{"step": k, "start_ns": 100 * k, "algbw": 4.0 if k < 4 else 2.0, "version": 2 + (k >= 5)} for k in range(8)]
    events = [
        _event("detected", 420, degraded={"tor:s0r1->5": 0.5}),
        _event("confirmed", 430, confirm_ms=0.01, detector="cusum", change_ns=410),
        _event("synthesized", 440, synth_ms=0.01),
        _event("staged", 460, dispatch_ms=0.01, swap_ms=0.001),
    ]
    ab = {"stale": [], "recovered": []}
    links = failed_links("two", rail(hosts=2, gpus_per_host=4))
    r = reaction_fields(rows, events, 400, 4, ab, failed_links=links)
    assert (r["steps_to_active"], r["swap_step"], r["false_detections"], r["detector"]) == (1, 5, 0, "cusum")
    assert r["staged_after_change_ms"] == pytest.approx(50e-6) and r["failure_to_staged_ms"] == pytest.approx(60e-6)
    assert reaction_fields(rows, events, 400, 4, ab)["false_detections"] == 1  # GPU 5's NIC is not the default link
    quiet = reaction_fields(rows[:5], events[:1], 400, 4, ab, detector="ewma")
    assert quiet["steps_to_active"] is None and math.isnan(quiet["staged_after_change_ms"])
    assert quiet["detector"] == "ewma"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    cfg = DemoConfig(steps=20, fail_step=6, ab_runs=5, json=str(out / "demo.json"), png=None)
    result = run(cfg)
    return result, out


def test_demo_swaps_once_and_counts_every_event(demo):
    r, _ = demo
    assert r["loss_matches_reference"]
    kinds = [e["kind"] for e in r["events"]]
    assert r["detections"] == kinds.count("detected") == 1, kinds
    assert r["resyntheses"] == kinds.count("synthesized") == 1
    assert r["swaps"] == kinds.count("activated") == 1 and len(r["swap_steps"]) == 1
    assert r["false_detections"] == 0
    versions = [row["version"] for row in r["steps"]]
    assert len(set(versions)) == 2 and versions == sorted(versions)
    assert r["steps"][0]["schedule"] == "healthy" and r["steps"][-1]["schedule"] == "re-synthesized #1"
    assert r["fail_step"] < r["detect_step"] <= r["confirm_step"] <= r["swap_step"]
    assert r["steps_to_active"] == r["swap_step"] - r["fail_step"] and r["detector"] == "cusum"
    assert r["failure_label"] == "gray failure: GPU 0's NIC 400 -> 200 Gbps"


def test_demo_recovers_and_explains_its_rates(demo):
    r, out = demo
    assert r["algbw_recovered"] > 1.2 * r["algbw_stale"], (r["ab_recovered"], r["ab_stale"])
    assert r["simulated_algbw_healthy"] <= r["predicted_algbw_healthy"]
    assert r["measured_over_simulated"] == pytest.approx(r["algbw_healthy"] / r["simulated_algbw_healthy"])
    data = json.loads((out / "demo.json").read_text())
    for key in REQUIRED:
        assert key in data, key
    assert isinstance(data["loss_matches_reference"], bool)


def test_demo_png(demo, tmp_path):
    pytest.importorskip("matplotlib")
    from jaxccl.demos.closed_loop import _timeline_png

    r, _ = demo
    path = tmp_path / "demo.png"
    _timeline_png(r, str(path))
    assert path.stat().st_size > 20_000
