"""``jaxccl topology probe``: probed capacities against emulated links and ``tc``-shaped NICs; named errors.

(a) one process, the executor emulating a rail fabric's links: every pair's probed rate is its
path's bottleneck, hosts and NICs come out as the preset has them; (b) a netns lab of three
processes whose NICs ``tc`` shapes at different rates: every probed NIC within 10 % of its rate
(root; skipped with the lab's reason elsewhere); (c) bad arguments and tables are named errors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxccl.cli import main
from jaxccl.cli.topology import nic_rates
from jaxccl.cli.topology_infer import NET, PairTable, group_by_rate, host_switch, infer
from jaxccl.cli.topology_probe import pair_schedule
from jaxccl.distributed.transport import unavailable_reason as transport_unavailable
from jaxccl.errors import ScheduleError, TopologyError, UsageError
from jaxccl.labs.netlab import LinkShape, unavailable_reason
from jaxccl.synth import all_gather
from jaxccl.topology import Topology, rail

ROOT = Path(__file__).resolve().parents[2]
NETNS = unavailable_reason() or transport_unavailable()
TOLERANCE = 0.10


def _probe(argv: list[str], tmp_path: Path, timeout: float) -> tuple[Topology, dict]:
    out, pairs = tmp_path / "topology.json", tmp_path / "pairs.json"
    cmd = [sys.executable, "-m", "jaxccl", "topology", "probe", "--quiet", "--output", str(out), "--pairs", str(pairs)]
    done = subprocess.run(cmd + argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    topo = Topology.from_json(out.read_text())
    assert all_gather(topo).validate().num_ranks == topo.num_gpus  # the synthesizers take it
    return topo, json.loads(pairs.read_text())


def test_emulated_links_are_probed_at_their_capacities(tmp_path):
    known = rail(hosts=2, gpus_per_host=2)
    # 1 MiB crosses an emulated 400 Gbps NIC in 0.2 s at this scale: rates come out within 2 % on a loaded machine.
    topo, pairs = _probe(
        ["--emulate", "rail:2x2", "--time-scale", "1e-4", "--large-bytes", "1M", "--runs", "3"], tmp_path, timeout=300
    )
    rates = pairs["rates_bytes_per_s"]
    for i in range(4):
        for j in range(4):
            if i != j:
                expected = known.path_capacity(i, j)
                assert abs(rates[i][j] - expected) <= TOLERANCE * expected, (i, j, rates[i][j], expected)
    assert topo.hosts == known.hosts
    for h, ranks in enumerate(known.hosts):
        nic = topo.capacity(host_switch(h), NET)
        assert abs(nic - known.capacity(0, "tor:s0r0")) <= TOLERANCE * nic  # 400 Gbps NICs
        nvlink = topo.capacity(ranks[0], host_switch(h))
        assert abs(nvlink - known.capacity(ranks[0], f"nvs:h{h}")) <= TOLERANCE * nvlink
    assert topo.path_latency(0, 2) > topo.path_latency(0, 1)  # two switch hops against NVLink's


@pytest.mark.skipif(NETNS is not None, reason=f"needs the netns lab and the transport: {NETNS}")
def test_netns_nics_are_probed_within_ten_percent_of_tc(tmp_path):
    mbit = [40.0, 80.0, 80.0]  # every host has a peer at least as fast: the model sees every NIC
    argv = ["--processes", "3", "--network", "netns", "--nic-rate-mbit", ",".join(f"{r:g}" for r in mbit)]
    topo, pairs = _probe([*argv, "--large-bytes", "1M", "--job-timeout", "240"], tmp_path, timeout=300)
    assert pairs["hosts"] == [0, 1, 2]
    for rank, rate in enumerate(mbit):
        shaped = LinkShape(rate_mbit=rate).rate_bytes_per_s
        probed = topo.capacity(rank, NET)  # one rank per process: its own NIC
        assert abs(probed - shaped) <= TOLERANCE * shaped, (rank, probed, shaped)
    slow = pairs["rates_bytes_per_s"][1][0]  # a flow runs at its slower end's rate
    assert abs(slow - LinkShape(rate_mbit=40).rate_bytes_per_s) <= TOLERANCE * slow


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--emulate", "rail:2x2", "--small-bytes", "1M", "--large-bytes", "4K"], "need 4 <= small < large"),
        (["--emulate", "rail:2x"], "bad topology"),
        (["--emulate", "rail:2x2", "--devices", "3"], "has 4 GPUs but --devices is 3"),
        (["--time-scale", "0.1"], "add --emulate"),
        (["--emulate", "rail:2x2", "--time-scale", "2"], "--time-scale must be in"),
        (["--devices", "1"], "at least 2 ranks"),
        (["--network", "netns"], "add --processes"),
        (["--processes", "2", "--emulate", "rail:2x2"], "across processes"),
        (["--processes", "1"], "at least 2 processes"),
        (["--processes", "2", "--nic-rate-mbit", "10,20,30"], "one rate or one per process"),
        (["--processes", "2", "--nic-rate-mbit", "0"], "positive"),
        (["--processes", "2", "--nic-rate-mbit", "10"], "add --network netns"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(["topology", "probe", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_bad_tables_and_rates_are_named_errors():
    with pytest.raises(TopologyError, match="at least 2 ranks"):
        PairTable([[0.0]], [[0.0]])
    with pytest.raises(TopologyError, match="2 x 2"):
        PairTable([[0, 1.0], [1.0]], [[0, 0], [0, 0]])
    with pytest.raises(TopologyError, match="pair 1 -> 0: rate"):
        PairTable([[0, 1.0], [float("nan"), 0]], [[0, 0], [0, 0]])
    with pytest.raises(TopologyError, match="pair 0 -> 1: latency"):
        PairTable([[0, 1.0], [1.0, 0]], [[0, float("inf")], [0, 0]])
    with pytest.raises(TopologyError, match="hosts"):
        PairTable([[0, 1.0], [1.0, 0]], [[0, 0], [0, 0]], hosts=[0])
    with pytest.raises(UsageError, match="one rate or one per process"):
        nic_rates("1,2", 3)


def test_inference_model():
    # Alike rates: one host, direct through its switch; hosts given: they win over rates.
    alike = PairTable([[0, 10.0, 9.0], [10.0, 0, 9.5], [9.0, 9.5, 0]], [[0, 1e-6, 1e-6]] * 3)
    assert group_by_rate(alike) == [0, 0, 0]
    assert NET not in infer(alike).switches
    given = infer(PairTable(alike.rates, alike.latencies, hosts=[5, 5, 7]))
    assert given.hosts == ((0, 1), (2,))
    # NICs of 1, 2, 2 units (a process each): each host's best pair is its own NIC; latencies never below 0.
    rates = [[0, 1.0, 1.0], [1.0, 0, 2.0], [1.0, 2.0, 0]]
    topo = infer(PairTable(rates, [[0, -1e-3, 2e-6], [2e-6, 0, 2e-6], [2e-6, 2e-6, 0]], hosts=[0, 1, 2]))
    assert [topo.capacity(r, NET) for r in range(3)] == [1.0, 2.0, 2.0]
    assert all(lat >= 0 for *_, lat in topo.edges())


def test_pair_schedule_is_one_send_and_no_collective():
    s = pair_schedule(3, (2, 0))
    assert [sum(len(tb.ops) for tb in s.ranks[r]) for r in range(3)] == [1, 0, 1]
    with pytest.raises(ScheduleError):  # why the probe stages it without the interpreter
        s.validate()
