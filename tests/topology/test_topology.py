"""Topology presets, scenarios, derivation, routes, JSON and validation."""

import json

import networkx as nx
import pytest

import jaxccl
from jaxccl.topology import Topology, fat_tree, gbps, rail, ring, scenario, single_node


def test_rail_structure_matches_mccl_section_6_1():
    t = rail(hosts=2, gpus_per_host=8)
    assert t.num_gpus == 16
    assert t.hosts == (tuple(range(8)), tuple(range(8, 16)))
    # one NVSwitch per host, one ToR per rail, no aggregation layer in one segment
    assert sorted(t.switches) == sorted([f"nvs:h{h}" for h in range(2)] + [f"tor:s0r{i}" for i in range(8)])
    assert t.capacity(3, "nvs:h0") == gbps(2880) == 360e9
    assert t.latency(3, "nvs:h0") == pytest.approx(25e-9)
    assert t.capacity(11, "tor:s0r3") == gbps(400)
    assert t.latency("tor:s0r3", 11) == pytest.approx(0.5e-6)
    # same rail across hosts goes through the rail's ToR; same host through the NVSwitch
    assert t.path(3, 11) == ((3, "tor:s0r3"), ("tor:s0r3", 11))
    assert t.path(1, 6) == ((1, "nvs:h0"), ("nvs:h0", 6))
    # different rail and host: a rail-only fabric forwards through a GPU (PXN)
    assert len(t.path(0, 9)) == 4


def test_rail_segment_limit_can_be_lifted_for_single_segments():
    big = rail(hosts=40, max_hosts_per_segment=None)
    assert big.num_gpus == 320 and big.path(0, 39 * 8) == ((0, "tor:s0r0"), ("tor:s0r0", 312))
    with pytest.raises(jaxccl.TopologyError, match="max_hosts_per_segment"):
        rail(hosts=40)


def test_rail_segments_join_through_aggregation():
    t = rail(hosts=4, gpus_per_host=8, segments=2)
    assert t.num_gpus == 64
    assert t.path(0, 32) == ((0, "tor:s0r0"), ("tor:s0r0", "agg"), ("agg", "tor:s1r0"), ("tor:s1r0", 32))
    # non-blocking uplinks by default: hosts x 400 Gbps
    assert t.capacity("tor:s0r0", "agg") == 4 * gbps(400)
    assert rail(hosts=4, segments=2, uplink_gbps=400).capacity("agg", "tor:s1r5") == gbps(400)


@pytest.mark.parametrize("bad", [dict(hosts=0), dict(hosts=33), dict(gpus_per_host=0), dict(nic_gbps=0)])
def test_rail_rejects_bad_parameters(bad):
    with pytest.raises(jaxccl.TopologyError):
        rail(**bad)


def test_scenarios_follow_mccl():
    t = rail(hosts=2)
    f1 = scenario(t, "fail1")
    assert f1.capacity(0, "nvs:h0") == gbps(800) and f1.capacity("nvs:h0", 0) == gbps(800)
    assert f1.capacity(1, "nvs:h0") == gbps(2880)
    f2 = scenario(t, "fail2")
    assert f2.capacity(0, "tor:s0r0") == gbps(50) and f2.capacity("tor:s0r0", 0) == gbps(50)
    assert f2.capacity(8, "tor:s0r0") == gbps(400)
    f3 = scenario(t, "fail3")
    assert f3.capacity(0, "nvs:h0") == gbps(50)
    assert f3.capacity(0, "tor:s0r0") == gbps(100)
    assert f3.latency(0, "tor:s0r0") == pytest.approx(1.5e-6)
    assert f3.path_latency(0, 8) > t.path_latency(0, 8)
    with pytest.raises(jaxccl.TopologyError, match="unknown scenario"):
        scenario(t, "fail4")
    with pytest.raises(jaxccl.TopologyError, match="rail"):
        scenario(ring(4), "fail1")


def test_degrade_cut_and_immutability():
    t = rail(hosts=2)
    d = t.degrade(8, "tor:s0r0", gbps=100)
    assert d.capacity(8, "tor:s0r0") == gbps(100) and d.capacity("tor:s0r0", 8) == gbps(100)
    assert t.capacity(8, "tor:s0r0") == gbps(400)
    one_way = t.degrade(8, "tor:s0r0", capacity=1e9, both=False)
    assert one_way.capacity(8, "tor:s0r0") == 1e9 and one_way.capacity("tor:s0r0", 8) == gbps(400)
    assert t.degrade(0, "nvs:h0", latency=1e-6).latency(0, "nvs:h0") == 1e-6
    with pytest.raises(jaxccl.TopologyError, match="no link"):
        t.degrade(0, 1, gbps=10)
    with pytest.raises(jaxccl.TopologyError, match="unknown node"):
        t.degrade(0, "nvs:h9", gbps=10)
    with pytest.raises(jaxccl.TopologyError, match="capacity .* must be positive"):
        t.degrade(0, "nvs:h0", gbps=0)
    with pytest.raises(jaxccl.TopologyError, match="disconnected"):
        single_node(2).cut(0, "nvs:h0")
    r = ring(4).cut(0, 1, both=False)  # still strongly connected the other way round
    assert not r.has_edge(0, 1) and r.has_edge(1, 0)
    with pytest.raises(nx.NetworkXError, match="Frozen"):
        t.graph.add_edge(0, 1)


def test_json_round_trip_and_errors():
    for t in (
        rail(hosts=2),
        rail(hosts=2, segments=2),
        scenario(rail(hosts=2), "fail3"),
        ring(5),
        fat_tree(),
        single_node(3),
    ):
        back = Topology.from_json(t.to_json())
        assert back == t and back.fingerprint == t.fingerprint and back.meta == t.meta
        assert back.paths(0, t.num_gpus - 1) == t.paths(0, t.num_gpus - 1)
    with pytest.raises(jaxccl.TopologyError, match="malformed"):
        Topology.from_json("{not json")
    with pytest.raises(jaxccl.TopologyError, match="schema"):
        Topology.from_json(json.dumps({"schema": "other"}))
    data = rail(hosts=2).to_dict()
    data["edges"][0]["capacity"] = -1
    with pytest.raises(jaxccl.TopologyError, match="capacity"):
        Topology.from_dict(data)
    data = rail(hosts=2).to_dict()
    data["edges"].append({"u": 0, "v": "nowhere", "capacity": 1.0, "latency": 0.0})
    with pytest.raises(jaxccl.TopologyError, match="unknown node"):
        Topology.from_dict(data)


def test_from_edges_validation():
    ok = Topology.from_edges(2, [(0, 1, 1e9, 1e-6), (1, 0, 1e9, 1e-6)])
    assert ok.path(0, 1) == ((0, 1),) and ok.path_capacity(0, 1) == 1e9
    with pytest.raises(jaxccl.TopologyError, match="disconnected"):
        Topology.from_edges(3, [(0, 1, 1e9, 0), (1, 0, 1e9, 0)])
    with pytest.raises(jaxccl.TopologyError, match="capacity"):
        Topology.from_edges(2, [(0, 1, 0.0, 0), (1, 0, 1e9, 0)])
    with pytest.raises(jaxccl.TopologyError, match="unknown GPU"):
        Topology.from_edges(2, [(0, 5, 1e9, 0)])
    with pytest.raises(jaxccl.TopologyError, match="unknown GPU"):
        ok.path(0, 2)


def test_ecmp_paths_in_fat_tree():
    t = fat_tree(leaves=2, gpus_per_leaf=2, spines=2)
    routes = t.paths(0, 2)
    assert len(routes) == 2  # one per spine
    assert all(r[0] == (0, "leaf:0") and r[-1] == ("leaf:1", 2) for r in routes)
