"""The closed loop across processes: measurement gathered to one controller, agreed hot-swaps, real links.

- On loopback (needs the transport): two processes of two devices run AllGather steps with a
  ProcessLoop; the controller of process 0 re-synthesizes from the gathered measurements and
  every process swaps at the same call, every step bitwise equal to jax.lax; a synthesizer
  that raises is recorded and training goes on with the running schedule.
- On real links (needs the transport, root and network namespaces): a RailLab of 2 hosts x 2
  ranks, one process and one shaped NIC per rank; one NIC is cut live with tc, the loop detects
  it from the transport's completion times, re-synthesizes around it and swaps in every
  process, and the recovered AllGather is >= 1.2x the stale one on the cut network (both
  measured in the same run, interleaved). Everything the lab made is gone afterwards.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from jaxccl.distributed.launch import ProcessResult, launch
from jaxccl.distributed.transport import unavailable_reason as transport_unavailable
from jaxccl.labs.netlab import unavailable_reason as netns_unavailable
from jaxccl.labs.netlab.commands import list_namespaces

WORKER = Path(__file__).parents[1] / "workers" / "multiprocess_loop_worker.py"
TRANSPORT = transport_unavailable()
NETNS = netns_unavailable()
needs_netns = pytest.mark.skipif(NETNS is not None, reason=f"no network namespaces here: {NETNS}")
pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(TRANSPORT is not None, reason=f"{TRANSPORT}")]


def _report(results: list[ProcessResult]) -> str:
    return "\n----\n".join(f"process {r.process_id} (rc {r.returncode}):\n{r.output[-3000:]}" for r in results)


def _run(synthesizer: str, steps: int) -> list[ProcessResult]:
    results = launch(
        [sys.executable, str(WORKER), synthesizer, str(steps)], 2, env={"JAXCCL_TIMEOUT_S": "60"}, timeout_s=300
    )
    report = _report(results)
    assert all(r.returncode == 0 for r in results), report
    for r in results:
        checks = [line for line in r.output.splitlines() if line.startswith("CHECK step")]
        assert len(checks) == steps and all(c.endswith(" ok") for c in checks), report
    return results


def _installed(r: ProcessResult) -> int:
    return int(re.search(r"INSTALLED (\d+)", r.output).group(1))


def _events(r: ProcessResult) -> list[str]:
    return [line.split()[1] for line in r.output.splitlines() if line.startswith("EVENT ")]


def test_one_controller_swaps_every_process_at_the_same_call():
    results = _run("default", 8)
    report = _report(results)
    swaps = {re.search(r"SWAP (\d+) (\d+)", r.output).groups() for r in results}
    assert len(swaps) == 1, report  # one version, one transition call, in every process
    version, _ = swaps.pop()
    assert int(version) > _installed(results[0]), report
    kinds = _events(results[0])
    for kind in ("detected", "confirmed", "synthesized", "agreed", "staged", "activated"):
        assert kind in kinds, report
    assert "agreed" in _events(results[1]) and "error" not in kinds, report
    # Only the last round's keys stay in the coordinator's store (8 rounds ran), and at most one swap's.
    rounds, swap_keys = map(int, re.search(r"KEY_ROUNDS (\d+) SWAP_KEYS (\d+)", results[0].output).groups())
    assert rounds == 1 and swap_keys <= 2, report


def test_a_failing_synthesizer_never_stops_training():
    results = _run("raise", 5)
    report = _report(results)
    assert "EVENT error RuntimeError: synthesizer failed on purpose" in results[0].output, report
    for r in results:  # the installed schedule kept running everywhere
        assert int(re.search(r"SWAP (\d+) ", r.output).group(1)) == _installed(r), report
        assert "agreed" not in _events(r), report


@needs_netns
def test_a_live_nic_cut_is_detected_routed_around_and_swapped_everywhere():
    from jaxccl.labs.drill import DrillConfig, run_drill

    config = DrillConfig()
    report = run_drill(config, timeout_s=240)
    assert not [ns for ns in list_namespaces() if ns.startswith(report["lab_prefix"])], "the lab left namespaces"
    cycle = report["cycles"][0]
    context = {k: v for k, v in cycle.items() if k != "events"}
    assert report["bitwise_ok"], context
    assert cycle["swapped_after_steps"] is not None, cycle["events"]
    after_cut = [e for e in cycle["events"] if e["time_ns"] > cycle["cut_ns"]]
    kinds = [e["kind"] for e in after_cut]
    for kind in ("detected", "confirmed", "synthesized", "agreed", "staged", "activated"):
        assert kind in kinds, cycle["events"]
    confirmed = next(e for e in after_cut if e["kind"] == "confirmed")
    victim_rail = f"tor:s0r{config.victim % config.gpus_per_host}"
    assert any(victim_rail in link for link in confirmed["detail"]["degraded"]), confirmed
    print(
        f"AllGather algbw (bytes/s): healthy {cycle['algbw_healthy']:.3g}, stale on the cut network "
        f"{cycle['algbw_stale']:.3g}, recovered {cycle['algbw_recovered']:.3g}"
    )
    assert cycle["algbw_recovered"] >= 1.2 * cycle["algbw_stale"], context
