"""``jaxccl demo --network``: the closed loop across processes on real sockets.

The loopback run needs jaxccl's transport (the ``multiprocess`` extra, built); the netns run
also needs root and ``ip netns``. Each starts its own multi-process job through the CLI and
checks the JSON it writes: the single-process demo's keys plus ``processes`` and ``per_process``,
the loss curve bitwise equal to ``jax.lax`` in every process, and on netns a live ``tc`` cut of one
NIC detected, routed around and hot-swapped, with nothing of the lab left behind.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from jaxccl.demo_network import NetworkDemoConfig, check, unavailable_reason
from jaxccl.demo_network_control import UplinkWatch, uplink_rate
from jaxccl.demo_network_layout import DemoNetworkError, layout_topology, pairwise_view, process_of_rank, uplink
from jaxccl.errors import JaxcclError

# The single-process demo's keys (jaxccl.demo.run), which the real-socket demo keeps.
DEMO_KEYS = {
    "algbw_healthy",
    "algbw_stale",
    "algbw_recovered",
    "recovery_ratio",
    "ab_stale",
    "ab_recovered",
    "algbw_stale_timeline",
    "algbw_recovered_timeline",
    "bytes_per_rank",
    "predicted_algbw_healthy",
    "predicted_algbw_recovered",
    "detect_ms",
    "detections",
    "false_detections",
    "resyntheses",
    "swaps",
    "swap_steps",
    "confirm_ms",
    "synth_ms",
    "dispatch_ms",
    "swap_ms",
    "activation_wait_ms",
    "swap_step",
    "fail_step",
    "detect_step",
    "confirm_step",
    "loss_matches_reference",
    "losses",
    "steps",
    "schedules",
    "events",
    "config",
    "time_scale_note",
}
JOB_TIMEOUT_S = 240


def _demo(tmp_path, *args: str) -> dict:
    out = tmp_path / "demo.json"
    argv = [sys.executable, "-m", "jaxccl", "demo", "--json", str(out), "--job-timeout", str(JOB_TIMEOUT_S), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=JOB_TIMEOUT_S + 60, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def _check_common(r: dict, processes: int) -> None:
    missing = DEMO_KEYS - set(r)
    assert not missing, f"keys of the single-process demo missing: {sorted(missing)}"
    assert r["processes"] == processes and len(r["per_process"]) == processes
    assert sorted(rank for p in r["per_process"] for rank in p["ranks"]) == list(range(8))
    assert r["loss_matches_reference"] is True
    assert all(p["loss_matches_reference"] for p in r["per_process"])
    assert len(set(r["losses"])) > 1  # the model trains: the curve is not constant
    measured = [v for p in r["per_process"] for v in p["uplink_rates"] if math.isfinite(v)]
    assert measured and min(measured) > 0  # the transport's completion times reached every process's meter
    assert r["false_detections"] == 0


def test_layout_topology_describes_the_processes_nics():
    topo = layout_topology(8, nic_rate_mbit=80)
    assert topo.num_gpus == 8 and process_of_rank(8) == list(range(8))
    assert topo.capacity(*uplink(topo, 8, 3)) == 10e6
    two = layout_topology(2, nic_rate_mbit=80)
    assert process_of_rank(2) == [0] * 4 + [1] * 4
    assert len(two.path(0, 5)) == 4  # rank -> memory -> bridge -> memory -> rank: one NIC each way
    with pytest.raises(DemoNetworkError, match="--processes 4"):
        layout_topology(4, nic_rate_mbit=80)


def test_uplink_watch_routes_around_a_cut_nic_and_keeps_a_host_nic():
    topo = layout_topology(8, nic_rate_mbit=80)
    import jaxccl

    healthy = jaxccl.synth.allgather(topo)
    view = lambda t: pairwise_view(t, 8)  # noqa: E731
    watch = UplinkWatch(topo, [uplink(topo, 8, p) for p in range(8)], healthy, 200e3, view=view)
    steady = [10e6] * 8
    decisions = [watch.observe(k, steady) for k in range(4)]
    cut = [2e6] + [10e6] * 7
    decisions += [watch.observe(k, cut) for k in range(4, 8)]
    assert decisions[:5] == [None] * 5  # calibration, healthy steps, the first flagged sample
    new = decisions[5]
    assert new is not None and decisions[6:] == [None, None]
    new.validate()
    assert [e.kind for e in watch.events] == ["detected", "confirmed", "synthesized"]
    assert watch.events[0].detail["degraded"] == {"0->net": pytest.approx(0.2)}
    # Every NIC slower together (everyone waits for one slow peer or host): a shared cause, no NIC blamed.
    shared = UplinkWatch(topo, [uplink(topo, 8, p) for p in range(8)], healthy, 200e3, view=view)
    assert [shared.observe(k, steady) for k in range(3)] + [shared.observe(k, [3e6] * 8) for k in range(3, 6)] == [
        None
    ] * 6
    assert shared.events == []
    # Two processes: one NIC carries a whole host, so no schedule is faster; the watch keeps the old one.
    two = layout_topology(2, nic_rate_mbit=80)
    host = UplinkWatch(
        two,
        [uplink(two, 2, p) for p in range(2)],
        jaxccl.synth.allgather(two),
        200e3,
        view=lambda t: pairwise_view(t, 2),
    )
    got = [host.observe(k, [10e6, 10e6]) for k in range(3)] + [host.observe(k, [2e6, 10e6]) for k in range(3, 6)]
    assert got == [None] * 6 and [e.kind for e in host.events] == ["detected", "confirmed", "kept"]


def test_uplink_rate_uses_the_union_of_in_flight_times():
    assert uplink_rate([(0, 4, 1 << 20, 0, 1_000_000), (1, 5, 1 << 20, 0, 1_000_000)]) == pytest.approx(
        2 * 2**20 / 1e-3
    )
    assert math.isnan(uplink_rate([(0, 4, 100, 0, 1_000)]))  # under MIN_MEASURED_BYTES: not the link's time


def test_bad_settings_are_named_errors():
    with pytest.raises(DemoNetworkError, match="unknown network"):
        check(NetworkDemoConfig(network="wifi"))
    assert issubclass(DemoNetworkError, JaxcclError)
    if unavailable_reason("loopback") is None:
        with pytest.raises(DemoNetworkError, match="--processes 3"):
            check(NetworkDemoConfig(network="loopback", processes=3))
        with pytest.raises(DemoNetworkError, match="fail_step"):
            check(NetworkDemoConfig(network="loopback", steps=6, fail_step=2))


def test_cli_names_what_netns_lacks():
    reason = unavailable_reason("netns")
    if reason is None:
        pytest.skip("this machine has everything --network netns needs")
    argv = [sys.executable, "-m", "jaxccl", "demo", "--network", "netns"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "cannot run here" in done.stderr + done.stdout


def test_plain_demo_rejects_processes_without_network():
    argv = [sys.executable, "-m", "jaxccl", "demo", "--processes", "8"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "--network" in done.stderr + done.stdout


@pytest.mark.skipif(unavailable_reason("loopback") is not None, reason=str(unavailable_reason("loopback")))
def test_loopback_demo_matches_lax_and_detects_nothing(tmp_path):
    r = _demo(tmp_path, "--network", "loopback", "--steps", "8", "--fail-step", "4")
    _check_common(r, 2)
    assert r["network"] == "loopback" and r["detections"] == 0 and r["swaps"] == 0


@pytest.mark.skipif(unavailable_reason("netns") is not None, reason=str(unavailable_reason("netns")))
def test_netns_demo_detects_the_cut_and_swaps(tmp_path):
    from jaxccl.netlab.commands import LAB_PREFIX, list_namespaces

    before = {n for n in list_namespaces() if n.startswith(LAB_PREFIX)}
    png = tmp_path / "demo.png"
    r = _demo(tmp_path, "--network", "netns", "--steps", "14", "--fail-step", "5", "--png", str(png))
    _check_common(r, 8)
    assert r["detections"] >= 1 and r["swaps"] >= 1 and r["swap_step"] > r["fail_step"]
    assert math.isfinite(r["detect_ms"]) and r["detect_ms"] > 0
    assert r["ab_stale"] and r["ab_recovered"]
    assert png.stat().st_size > 10_000
    after = {n for n in list_namespaces() if n.startswith(LAB_PREFIX)}
    assert after <= before, f"namespaces left behind: {sorted(after - before)}"
    if os.path.isdir("/etc/netns"):
        assert not [n for n in os.listdir("/etc/netns") if n.startswith(LAB_PREFIX) and n not in before]
