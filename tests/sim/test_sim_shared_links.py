"""Group collectives at once on shared links (Fig. 11's relayed groups): the fluid model and its use.

The fluid time of a schedule alone is checked against the event simulator
(which runs the schedule's messages over their own routes), in both link
directions; with relays, the groups that share a host are checked against a
bound computed by hand from the host's NIC capacities.
"""

from __future__ import annotations

import pytest

from jaxccl.errors import ScheduleError, TopologyError
from jaxccl.schedule.ir import Collective
from jaxccl.sim import run as sim_run
from jaxccl.sim.experiments import Synthesizers, _relay_call, _symmetric_records
from jaxccl.sim.shared_links import fluid_time, link_bytes
from jaxccl.sim.workloads import WORKLOADS, group_gpus
from jaxccl.synth import all_gather, reduce_scatter
from jaxccl.topology import rail, scenario
from jaxccl.topology.groups import groups_within, relay_domain, subtopology
from jaxccl.topology.presets import tor

MiB = 1 << 20


def _one_way_slow_nic() -> object:
    """1x2x4 with GPU 0's NIC slow towards its ToR only (an asymmetric topology)."""
    return rail(hosts=2, gpus_per_host=4).degrade(0, tor(0, 0), gbps=50)


@pytest.mark.parametrize("collective", [Collective.ALL_GATHER, Collective.REDUCE_SCATTER])
def test_fluid_time_of_one_schedule_matches_the_simulator(collective):
    topo = _one_way_slow_nic()
    make = all_gather if collective is Collective.ALL_GATHER else reduce_scatter
    s = make(topo)
    nbytes = 256 * MiB
    members = list(range(topo.num_gpus))
    loads = link_bytes(s, topo, members, nbytes)
    res = sim_run(topo, s, nbytes)
    # the same bytes on the same links, in the same direction, as the simulator's messages over their routes
    assert set(loads) == set(res.link_bytes)
    for link, nbytes_on_link in res.link_bytes.items():
        assert loads[link] == pytest.approx(nbytes_on_link, rel=1e-9), link
    assert fluid_time(topo, [loads]) == pytest.approx(res.time_s, rel=0.03)


def test_groups_sharing_relays_are_slower_together_than_alone():
    topo = rail(hosts=2, gpus_per_host=2)
    groups = [[0, 2], [1, 3]]
    schedules = [all_gather(topo, group=g) for g in groups]
    assert all(s.info["group"]["view"] == "relays" for s in schedules)
    loads = [link_bytes(s, topo, g, 64 * MiB) for s, g in zip(schedules, groups)]
    alone = fluid_time(topo, loads[:1])
    together = fluid_time(topo, loads)
    # each group alone uses both NICs of its host; together they split them: twice the time
    assert together == pytest.approx(2 * alone, rel=1e-9)


def test_fig11_relayed_dp_ep_groups_meet_the_host_nic_bound():
    """DeepSeek's DP_EP AllGather at 128 GPUs under fail2: 8 groups relay through one another's NICs."""
    workload = WORKLOADS["deepseek671b"]
    call = next(c for c in workload.calls if c.label() == "all_gather:DP_EP")
    cluster = rail(hosts=16, gpus_per_host=8)
    bad = scenario(cluster, "fail2")
    gpus = group_gpus(workload, "DP_EP", 128, 0)
    out = _relay_call(workload, call, cluster, bad, gpus, Synthesizers(), {})
    assert out is not None and out["groups"] == 8 and out["domain_gpus"] == 16
    assert out["views"] == ["relays"] and set(out["relays"]) >= {1, 2, 3, 4, 5, 6, 7}
    # every group moves its shard from host 0 to host 8 and back: 8 shards over host 0's NICs
    shard = call.bytes_per_rank(len(gpus))
    nics = [bad.graph.edges[g, tor(0, g)]["capacity"] for g in range(8)]
    bound = 8 * shard / sum(nics)
    assert bound * (1 - 1e-9) <= out["time_s"] <= 1.02 * bound
    # alone, GPU 0's group would borrow the whole host's NICs: 8x faster than with its neighbours
    assert out["alone_s"] < out["time_s"] / 4


def test_relay_domain_and_groups_within_on_a_two_segment_cluster():
    cluster = rail(hosts=16, gpus_per_host=8, segments=2)
    gpus = group_gpus(WORKLOADS["deepseek671b"], "DP_EP", 256, 0)
    assert gpus == [0, 64, 128, 192]
    domain = relay_domain(cluster, gpus)
    assert len(domain) == 32 and set(gpus) <= set(domain)
    groups = [group_gpus(WORKLOADS["deepseek671b"], "DP_EP", 256, g) for g in range(64)]
    inside = groups_within(groups, domain)
    assert len(inside) == 8 and all(set(g) <= set(domain) for g in inside)
    assert subtopology(cluster, domain).num_gpus == 32


def test_bad_inputs_are_named():
    topo = rail(hosts=2, gpus_per_host=2)
    s = all_gather(topo, group=[0, 2])
    with pytest.raises(ScheduleError, match="ranks"):
        link_bytes(s, topo, [0, 1, 2], MiB)
    with pytest.raises(ScheduleError, match="lacks"):
        link_bytes(s, rail(hosts=2, gpus_per_host=1), [0, 1], MiB)
    with pytest.raises(ScheduleError, match="per-link loads"):
        link_bytes(s.replace(info={}), topo, [0, 2], MiB)
    with pytest.raises(TopologyError):
        relay_domain(topo, [0, 99])


def test_rail_twins_take_the_loads_their_own_synthesis_gives():
    """Groups mapped from a rail twin carry exactly the loads that synthesizing them gives (fail2: 0 differs)."""
    cluster = scenario(rail(hosts=16, gpus_per_host=8), "fail2")
    gpus = group_gpus(WORKLOADS["deepseek671b"], "DP_EP", 128, 0)
    domain = relay_domain(cluster, gpus)
    topo = subtopology(cluster, domain)
    members = [[domain.index(g), domain.index(g + 64)] for g in range(8)]
    records = _symmetric_records(topo, members, lambda m: all_gather(topo, group=m), MiB)
    assert [r["synthesized"] for r in records] == [True, True] + [False] * 6
    for m, r in zip(members, records):
        want = link_bytes(all_gather(topo, group=m), topo, m, MiB)
        assert fluid_time(topo, [r["loads"]]) == pytest.approx(fluid_time(topo, [want]), rel=1e-12)
        nic = (m[0], tor(0, m[0]))
        assert r["loads"].get(nic, 0.0) == pytest.approx(want.get(nic, 0.0), rel=1e-12)
