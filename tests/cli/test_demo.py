"""``jaxccl demo``: the closed loop's story, told truthfully (one failure, one detection, one swap), and its outputs."""

import json

import pytest

from jaxccl.control import Event
from jaxccl.demos.closed_loop import FAILED_LINK, DemoConfig, _is_false_detection, run

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
