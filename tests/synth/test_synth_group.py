"""Group collectives (issue 15): AllGather / ReduceScatter over some GPUs, relaying through the others.

The relay view's bound comes from the sweep's independent max-flow
(networkx); the schedules validate, keep the group's rank order, beat the
group's own view where relays help, and run bitwise on the CPU executor.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_synth_sweep import allgather_bound

import jaxccl
from jaxccl.errors import TopologyError
from jaxccl.synth import all_gather, reduce_scatter
from jaxccl.synth.group import relay_name, relay_topology
from jaxccl.topology import rail, torus
from jaxccl.topology.groups import subtopology

CASES = {
    "torus row": (lambda: torus(4, 4), [0, 1, 2, 3]),
    "torus diagonal": (lambda: torus(4, 4), [0, 5, 10, 15]),
    "rail 0 of 4 hosts": (lambda: rail(hosts=4, gpus_per_host=4), [0, 4, 8, 12]),
    "one host, reversed order": (lambda: rail(hosts=2, gpus_per_host=4), [3, 2, 1, 0]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_group_relays_when_faster_and_reaches_the_independent_bound(name):
    make, group = CASES[name]
    topo = make()
    s = all_gather(topo, group=group).validate()
    info = s.info["group"]
    assert s.num_ranks == len(group) and info["gpus"] == group
    bound_relays = allgather_bound(relay_topology(topo, group))
    assert s.algbw == s.bound
    assert s.algbw >= bound_relays * (1 - 5e-3)
    try:
        own = allgather_bound(subtopology(topo, group))
    except TopologyError:  # the group's own GPUs and switches do not connect it
        own = 0.0
    assert s.algbw >= own * (1 - 1e-9)
    if info["view"] == "relays":
        assert info["relays"] and not set(info["relays"]) & set(group)
        assert s.algbw > own
    r = reduce_scatter(topo, group=group).validate()
    assert r.algbw == pytest.approx(s.algbw, rel=1e-12)


def test_relays_beat_the_group_view_on_a_rail():
    # GPUs 0, 4, 8, 12 share one 50 GB/s rail; through their hosts' NVSwitches they reach the other rails too
    topo = rail(hosts=4, gpus_per_host=4)
    s = all_gather(topo, group=[0, 4, 8, 12])
    assert s.info["group"]["view"] == "relays"
    assert s.info["group"]["algbw"]["relays"] == pytest.approx(4 * s.info["group"]["algbw"]["own"], rel=1e-9)
    assert relay_name(1) in {str(u) for u, _, _ in s.info["link_chunks"]}


def test_whole_topology_as_a_group_equals_no_group():
    topo = rail(hosts=2, gpus_per_host=4)
    assert all_gather(topo, group=range(8)).algbw == all_gather(topo).algbw


@pytest.mark.parametrize(
    ("group", "match"), [([0, 0, 1], "twice"), ([0, 99], "GPU 99"), ([3], "at least 2"), (["a", 1], "sequence")]
)
def test_bad_groups_are_named(group, match):
    with pytest.raises(TopologyError, match=match):
        all_gather(rail(hosts=2, gpus_per_host=4), group=group)


def test_group_schedule_runs_bitwise_on_cpu_executor():
    pytest.importorskip("jaxccl.runtime.native", reason="jaxccl native CPU executor is not built")
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    s = all_gather(torus(4, 4), group=[0, 4, 8, 12])
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    x = np.random.default_rng(5).standard_normal(4 * 333).astype(np.float32)

    def run(fn):
        return np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x))

    want = run(lambda v: jax.lax.all_gather(v, "d", tiled=True))
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    with comm:
        comm.install("all_gather", s)
        got = run(lambda v: jaxccl.all_gather(v, "d", tiled=True))
    assert got.tobytes() == want.tobytes()
