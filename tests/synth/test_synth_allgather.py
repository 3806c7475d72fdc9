"""AllGather synthesis: optimality against independent max-flow bounds, tree structure, warm starts, both
switch-removal methods, ReduceScatter from reversed trees, bad inputs, and bitwise execution on the CPU executor."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from fractions import Fraction

import networkx as nx
import numpy as np
import pytest

import jaxccl
from jaxccl.errors import OptionError, SynthesisError, TopologyError
from jaxccl.schedule import chunk_bounds
from jaxccl.synth.allgather import allgather, reduce_scatter
from jaxccl.topology import Topology, gbps, rail, ring, scenario, single_node, torus

GB = 1e9


# ------------------------------------------------------------------ independent bounds
def brute_force_bound(topo: Topology) -> float:
    """N * min over node sets X (some but not all GPUs) of out-capacity(X) / |X ∩ GPUs|, by enumeration."""
    g = topo.graph
    nodes = list(g.nodes)
    n = topo.num_gpus
    best = float("inf")
    for size in range(1, len(nodes)):
        for xs in itertools.combinations(nodes, size):
            x = set(xs)
            gpus = sum(1 for v in x if isinstance(v, int))
            if gpus == 0 or gpus == n:
                continue
            out = sum(d["capacity"] for u, v, d in g.edges(data=True) if u in x and v not in x)
            best = min(best, out / gpus)
    return n * best


def networkx_check(topo: Topology, algbw: float, rel: float = 1e-9) -> None:
    """Independent max-flow check (networkx): rate algbw/N is feasible and (1+rel) times it is not."""
    n = topo.num_gpus

    def feasible(x: float) -> bool:
        g = nx.DiGraph()
        for u, v, d in topo.graph.edges(data=True):
            g.add_edge(("n", u), ("n", v), capacity=d["capacity"] / GB)
        for r in range(n):
            g.add_edge("S", ("n", r), capacity=x / GB)
        return all(nx.maximum_flow_value(g, "S", ("n", v)) >= n * x / GB * (1 - 1e-12) for v in range(n))

    x = algbw / n
    assert feasible(x)
    assert not feasible(x * (1 + rel) + 1.0)


def hand_example() -> Topology:
    """Heterogeneous and asymmetric: two switches of different speeds plus direct links, one of them one-way."""
    edges = []
    for gpu, cap in ((0, 30), (1, 20), (2, 10)):
        edges += [(gpu, "a", cap * GB, 1e-6), ("a", gpu, cap * GB, 1e-6)]
    for gpu, cap in ((2, 25), (3, 25)):
        edges += [(gpu, "b", cap * GB, 1e-6), ("b", gpu, cap * GB, 1e-6)]
    edges += [(0, 3, 5 * GB, 2e-6), (3, 0, 5 * GB, 2e-6), (1, 3, 7 * GB, 2e-6)]
    return Topology.from_edges(4, edges, name="hand")


# ------------------------------------------------------------------ tree checks
def check_trees(s, topo: Topology) -> None:
    """Every tree is an arborescence spanning all ranks; weights add up to k per root; links fit."""
    n, k = s.num_ranks, s.chunks_per_period
    trees = s.info["trees"]
    assert len(trees) == n
    load: dict[tuple[int, int], int] = {}
    for root, per_root in enumerate(trees):
        assert sum(w for w, _ in per_root) == k
        for w, edges in per_root:
            assert w >= 1 and len(edges) == n - 1
            parent = {}
            for p, c in edges:
                assert c not in parent and c != root
                parent[c] = p
                load[(p, c)] = load.get((p, c), 0) + w
            assert set(parent) == set(range(n)) - {root}
            for v in range(n):  # walking up reaches the root without a cycle
                seen = set()
                while v != root:
                    assert v not in seen
                    seen.add(v)
                    v = parent[v]
    # independent algbw: logical links follow the topology's switch routes; time per chunk = load / capacity
    phys: dict[tuple, float] = {}
    for (u, v), chunks in load.items():
        for a, b in topo.path(u, v):
            phys[(a, b)] = phys.get((a, b), 0) + chunks
    rate = min(topo.capacity(a, b) / c for (a, b), c in phys.items())
    assert rate * k * n == pytest.approx(s.algbw, rel=1e-12)


CLOSED_FORM = {
    "single node x8": (lambda: single_node(8), 8 * gbps(2880) / 7),
    "ring x6": (lambda: ring(6), 6 * 2 * gbps(400) / 5),
    "rail 1x2x8": (lambda: rail(hosts=2), 16 * (gbps(2880) + gbps(400)) / 15),
    "rail 1x2x8 fail2": (lambda: scenario(rail(hosts=2), "fail2"), 16 * (gbps(2880) + gbps(50)) / 15),
    "hand": (hand_example, None),
}


@pytest.mark.parametrize("name", list(CLOSED_FORM))
@pytest.mark.parametrize("method", ["forestcoll", "latency"])
def test_optimal_on_closed_form_topologies(name, method):
    make, closed = CLOSED_FORM[name]
    topo = make()
    s = allgather(topo, method=method)
    assert s.algbw == s.bound  # exact: the trees reach the max-flow bound
    assert s.info["gap"] == 0.0 and s.info["exact"]
    if closed is not None:
        assert s.bound == pytest.approx(closed, rel=1e-12)
    if topo.graph.number_of_nodes() <= 12:
        assert s.bound == pytest.approx(brute_force_bound(topo), rel=1e-12)
    networkx_check(topo, s.bound)
    check_trees(s, topo)
    s.validate()


def test_hand_example_trees_use_real_links():
    topo = hand_example()
    s = allgather(topo)
    assert s.bound == pytest.approx(brute_force_bound(topo), rel=1e-12)
    for _w, edges in itertools.chain.from_iterable(s.info["trees"]):
        for p, c in edges:  # every tree edge is a route of physical links
            assert topo.paths(p, c)
    # chunks per physical link never exceed what the rate allows
    per_chunk = s.info["chunk_rate_bytes_per_s"]
    for u, v, chunks in s.info["link_chunks"]:
        assert chunks * per_chunk <= topo.capacity(u, v) * (1 + 1e-12)


def test_info_reports_cut_and_slacks():
    topo = rail(hosts=2)
    s = allgather(topo)
    info = s.info
    assert info["method"] == "forestcoll" and info["k"] == s.chunks_per_period == 41
    assert info["solve_time_s"] > 0 and info["max_depth"] >= 1
    # the critical cut attains the bound: out-capacity / GPUs inside
    cut = set(map(str, info["critical_cut"]))
    inside = [v for v in topo.graph.nodes if str(v) in cut]
    gpus = sum(isinstance(v, int) for v in inside)
    out = sum(topo.capacity(u, v) for u, v, _, _ in topo.edges() if u in inside and v not in inside)
    assert 16 * out / gpus == pytest.approx(s.bound, rel=1e-12)
    assert len(info["bottleneck_cut"]) == len(info["base_slacks"]) > 0
    assert all(0.0 <= x < 1.0 for x in info["base_slacks"])
    assert min(info["base_slacks"]) == 0.0  # an exact schedule saturates its bottleneck
    import json

    json.dumps(info)  # JSON-serializable


@pytest.mark.parametrize("state", ["fail1", "fail2", "fail3"])
def test_warm_start_reaches_the_cold_throughput(state):
    base = rail(hosts=2)
    prev = allgather(base)
    topo = scenario(base, state)
    cold = allgather(topo)
    warm = allgather(topo, previous=prev)
    assert warm.algbw == cold.algbw == warm.bound
    assert warm.info["warm"] is not None and 0.0 <= warm.info["warm"]["reused"] <= 1.0
    assert cold.info["warm"] is None
    check_trees(warm, topo)
    warm.validate()


@pytest.mark.parametrize("state", ["fail1", "fail2", "fail3"])
def test_warm_start_back_to_the_healthy_topology(state):
    """The way back after a degradation clears (previous = the degraded schedule) reaches the healthy optimum."""
    base = rail(hosts=2)
    warm = allgather(base, previous=allgather(scenario(base, state)))
    assert warm.algbw == warm.bound == allgather(base).algbw
    assert warm.info["warm"] is not None
    check_trees(warm, base)
    warm.validate()


def test_warm_start_on_unchanged_topology_reuses_everything():
    topo = rail(hosts=2, gpus_per_host=4)
    prev = allgather(topo)
    again = allgather(topo, previous=prev)
    assert again.algbw == prev.algbw
    assert again.info["warm"]["reused"] == 1.0


@pytest.mark.parametrize("topo", [rail(hosts=2), scenario(rail(hosts=2), "fail1"), scenario(rail(hosts=4), "fail2")])
def test_latency_method_same_throughput_no_deeper(topo):
    a = allgather(topo, method="forestcoll")
    b = allgather(topo, method="latency")
    assert a.algbw == b.algbw == a.bound
    assert b.info["max_depth"] <= a.info["max_depth"]
    assert b.info["switch_removal"]["lp_solves"] > 0
    b.validate()


@pytest.mark.parametrize("make", [lambda: rail(hosts=2), lambda: scenario(rail(hosts=2), "fail2"), hand_example])
def test_reduce_scatter_from_reversed_trees(make):
    topo = make()
    s = reduce_scatter(topo)
    assert s.collective.value == "reduce_scatter"
    assert s.algbw == s.bound
    assert s.info["ordered_reduction"] is False
    s.validate()


def test_larger_rail_states_validate():
    for state in (None, "fail1", "fail2", "fail3"):
        topo = rail(hosts=4)
        topo = scenario(topo, state) if state else topo
        s = allgather(topo)
        assert s.algbw == s.bound
        check_trees(s, topo)
        s.validate()


def test_max_chunks_rounds_with_a_reported_gap():
    topo = scenario(rail(hosts=2), "fail2")  # exact k = 293
    s = allgather(topo, max_chunks=16)
    assert s.chunks_per_period <= 16
    assert 0 < s.info["gap"] < 0.1 and s.algbw < s.bound
    assert not s.info["exact"]
    s.validate()


def test_a_coarse_chunk_limit_gets_the_best_rate_its_trees_can_reach():
    """GPU 2's NIC at half its rate, at most 2 chunks per shard: each host's 4 shards leave over NICs of 0.5, 1, 1
    and 1 NIC rates. In halves of a shard, a period T carries floor(2 * 0.5 T) + 3 floor(2 T) halves, which reaches
    the 8 needed first at T = 1.5 (1.25 and 4/3 carry 7): 2/3 of the healthy rate. Whole shards need T = 2, no
    better than the healthy trees on the cut NIC; trees sized x*/2 found no more than that."""
    topo = rail(hosts=2, gpus_per_host=4)
    cut = topo.degrade(2, "tor:s0r2", capacity=topo.capacity(2, "tor:s0r2") / 2)  # both directions
    s = allgather(cut, max_chunks=2)
    assert s.chunks_per_period == 2
    assert s.algbw == pytest.approx(allgather(topo).algbw * 2 / 3, rel=1e-9)
    assert s.info["gap"] > 0 and not s.info["exact"]
    s.validate()
    check_trees(s, cut)


def test_bad_inputs():
    one = Topology.from_edges(1, [(0, "sw", GB, 1e-6), ("sw", 0, GB, 1e-6)])
    with pytest.raises(TopologyError, match="at least 2 GPUs"):
        allgather(one)
    with pytest.raises(TopologyError, match="disconnected"):
        Topology.from_edges(2, [(0, "sw", GB, 1e-6), ("sw", 0, GB, 1e-6), (1, "t", GB, 1e-6), ("t", 1, GB, 1e-6)])
    with pytest.raises(TopologyError, match="capacity"):
        Topology.from_edges(2, [(0, 1, 0.0, 1e-6), (1, 0, GB, 1e-6)])
    with pytest.raises(OptionError, match="method='magic' is not one of 'forestcoll', 'latency'"):
        allgather(rail(hosts=2), method="magic")
    with pytest.raises(SynthesisError, match="previous"):
        allgather(rail(hosts=2), previous="not a schedule")
    with pytest.raises(SynthesisError, match="ranks"):
        allgather(rail(hosts=2), previous=allgather(rail(hosts=2, gpus_per_host=4)))
    with pytest.raises(TopologyError):
        allgather("rail")
    import dataclasses

    prev = allgather(rail(hosts=2, gpus_per_host=4))
    trees = [[[w, [list(e) for e in edges]] for w, edges in per_root] for per_root in prev.info["trees"]]
    trees[3][0][1][0] = [trees[3][0][1][1][1], trees[3][0][1][0][1]]  # a parent that is its own descendant: a cycle
    trees[3][0][1][1] = [trees[3][0][1][0][1], trees[3][0][1][1][1]]
    with pytest.raises(SynthesisError, match="previous tree of root 3"):
        allgather(
            rail(hosts=2, gpus_per_host=4), previous=dataclasses.replace(prev, info={**prev.info, "trees": trees})
        )
    with pytest.raises(SynthesisError, match="previous trees are given for 7 roots"):
        allgather(
            rail(hosts=2, gpus_per_host=4), previous=dataclasses.replace(prev, info={**prev.info, "trees": trees[:7]})
        )


# ------------------------------------------------------------------ execution
def _mesh(n):
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:n]), ("d",))


def _run(fn, mesh, x):
    import jax
    from jax.sharding import PartitionSpec as P

    return np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x))


@pytest.mark.parametrize(("state", "warm"), [(None, False), ("fail2", False), ("fail1", True), ("fail2", True)])
def test_allgather_runs_bitwise_on_cpu_executor(state, warm):
    pytest.importorskip("jaxccl.runtime.native", reason="jaxccl native CPU executor is not built")
    import jax

    base = rail(hosts=2, gpus_per_host=4)
    topo = scenario(base, state) if state else base
    s = allgather(topo, previous=allgather(base) if warm else None)
    assert s.info["packing"] == ("warm-repair" if warm else "matching")
    mesh = _mesh(8)
    comm = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu")
    x = np.random.default_rng(3).standard_normal(8 * 999).astype(np.float32)  # 999: uneven chunks
    want = _run(lambda v: jax.lax.all_gather(v, "d", tiled=True), mesh, x)
    with comm:
        comm.install("all_gather", s)
        got = _run(lambda v: jaxccl.all_gather(v, "d", tiled=True), mesh, x)
    assert got.tobytes() == want.tobytes()


def _tree_order_reduce_scatter(s, x: np.ndarray, n: int) -> np.ndarray:
    """psum_scatter in the schedule's tree order: acc(v) = ((in_v + acc(c1)) + acc(c2)) + ..., children ascending."""
    k = s.chunks_per_period
    per_rank = x.reshape(n, -1)
    period = per_rank.shape[1] // n
    out = np.zeros((n, period), dtype=x.dtype)
    for r, trees in enumerate(s.info["trees"]):
        lo = 0
        for w, edges in trees:
            a, _ = chunk_bounds(lo, k, period)
            _, b = chunk_bounds(lo + w - 1, k, period)
            kids: dict[int, list[int]] = {}
            for p, c in edges:
                kids.setdefault(p, []).append(c)

            def acc(v, a=a, b=b, kids=kids, r=r):
                total = per_rank[v, r * period + a : r * period + b].copy()
                for c in sorted(kids.get(v, [])):
                    total = total + acc(c, a, b, kids, r)
                return total

            out[r, a:b] = acc(r)
            lo += w
    return out.reshape(-1)


def test_reduce_scatter_runs_on_cpu_executor_in_tree_order():
    pytest.importorskip("jaxccl.runtime.native", reason="jaxccl native CPU executor is not built")
    topo = scenario(rail(hosts=2, gpus_per_host=4), "fail2")
    s = reduce_scatter(topo)
    mesh = _mesh(8)
    comm = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu")
    x = np.random.default_rng(4).standard_normal(8 * 8 * 250).astype(np.float32)
    want = _tree_order_reduce_scatter(s, x, 8)
    with comm:
        comm.install("reduce_scatter", s)
        got = _run(lambda v: jaxccl.psum_scatter(v, "d", tiled=True), mesh, x)
    assert got.tobytes() == want.tobytes()
    exact = x.astype(np.float64).reshape(8, 8, -1).sum(axis=0).reshape(-1)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)


_SIXTEEN = textwrap.dedent(
    """
    import jaxccl
    jaxccl.emulate(16)
    import jax, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxccl.synth.allgather import allgather
    from jaxccl.topology import rail, scenario
    mesh = Mesh(np.array(jax.devices()), ("d",))
    run = lambda f, x: np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x))
    x = np.random.default_rng(5).standard_normal(16 * 4096).astype(np.float32)
    want = run(lambda v: jax.lax.all_gather(v, "d", tiled=True), x)
    base = rail(hosts=2, gpus_per_host=8)
    healthy = allgather(base)
    for topo, prev in ((base, None), (scenario(base, "fail1"), None), (scenario(base, "fail2"), healthy)):
        s = allgather(topo, previous=prev)
        comm = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu")
        with comm:
            comm.install("all_gather", s)
            got = run(lambda v: jaxccl.all_gather(v, "d", tiled=True), x)
        assert got.tobytes() == want.tobytes(), topo.name
        print("OK", topo.name, s.chunks_per_period)
    """
)


def test_allgather_runs_bitwise_on_16_emulated_devices():
    pytest.importorskip("jaxccl.runtime.native", reason="jaxccl native CPU executor is not built")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    env.pop("PJRT_NPROC", None)
    res = subprocess.run(
        [sys.executable, "-c", _SIXTEEN], env=env, capture_output=True, text=True, timeout=300, cwd=root
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("OK") == 3


def test_rates_are_exact_fractions():
    from jaxccl.synth.allgather.bound import optimal_rate
    from jaxccl.synth.allgather.network import build_net

    net = build_net(rail(hosts=2))
    b = optimal_rate(net)
    assert float(net.unit) == 10 * GB  # gcd of 360 GB/s (NVLink) and 50 GB/s (NIC)
    assert b.rate == Fraction(36 + 5, 15)  # a GPU's in-capacity over the 15 other roots


# ------------------------------------------------------------------ phases directly
def _logical(topo):
    from jaxccl.synth.allgather.bound import optimal_rate, tree_units
    from jaxccl.synth.allgather.network import build_net
    from jaxccl.synth.allgather.switch_removal import remove_switches

    net = build_net(topo)
    units = tree_units(net, optimal_rate(net))
    return net, units, remove_switches(net, units.caps, units.k)


def _check_packing(p, links):
    load = p.link_load()
    assert all(load[e] <= links[e] for e in load)
    for r, trees in enumerate(p.trees()):
        assert sum(w for w, _ in trees) == p.k
        for _, edges in trees:
            assert len(edges) == p.n - 1 and {c for _, c in edges} == set(range(p.n)) - {r}
    p.max_depth()  # raises on a cycle or a GPU not reached


@pytest.mark.parametrize("strategy", ["full", "local", "forestcoll"])
def test_every_packing_strategy_is_exact(strategy):
    from jaxccl.synth.allgather.driver import switch_groups
    from jaxccl.synth.allgather.packing import forestcoll_pack, match_pack

    net, units, logical = _logical(scenario(rail(hosts=2, gpus_per_host=4), "fail1"))
    links = logical.gpu_links()
    if strategy == "forestcoll":
        p = forestcoll_pack(net.num_gpus, units.k, links)
    else:
        p = match_pack(net.num_gpus, units.k, links, check=strategy, sets=switch_groups(net))
    _check_packing(p, links)


def test_repair_keeps_previous_trees_and_regrows_only_what_they_lost():
    from jaxccl.synth.allgather.driver import switch_groups
    from jaxccl.synth.allgather.packing import tree_groups
    from jaxccl.synth.allgather.repair import repair_pack

    topo = rail(hosts=2, gpus_per_host=4)
    prev = allgather(topo)
    net, units, logical = _logical(scenario(topo, "fail3"))
    links = logical.gpu_links()
    groups = tree_groups(net.num_gpus, units.k, prev.info["trees"])
    p = repair_pack(net.num_gpus, units.k, links, groups, sets=switch_groups(net))
    _check_packing(p, links)
    assert p.method == "warm-repair"
    assert p.stats["overloaded_links"] > 0 and p.stats["cut_pieces"] > 0  # fail3 weakens GPU 0's links
    assert p.stats["kept_units"] > 0.8 * sum(c for c in p.link_load().values())
    # every previous (root, parent, child) hop that is not on a weakened link of GPU 0 is still there
    old = {(r, pc, ch) for r, per_root in enumerate(prev.info["trees"]) for _, e in per_root for pc, ch in e}
    new = {(r, pc, ch) for r, per_root in enumerate(p.trees()) for _, e in per_root for pc, ch in e}
    assert {h for h in old if 0 not in h[1:]} <= new
    # on the unchanged topology nothing is cut
    net0, units0, logical0 = _logical(topo)
    same = repair_pack(net0.num_gpus, units0.k, logical0.gpu_links(), tree_groups(8, units0.k, prev.info["trees"]))
    assert same.stats["cut_pieces"] == 0 and same.stats["repaired_groups"] == 0


def test_repair_frees_a_set_that_previous_trees_enter_twice():
    """A kept tree entering a tight set twice wastes capacity a re-grown group needs: the repair cuts the repeat."""
    from jaxccl.synth.allgather.packing import match_pack, tree_groups
    from jaxccl.synth.allgather.repair import _Forest, _free_tight_sets, set_slacks

    n = 4
    links = {(0, 1): 2, (1, 0): 2, (0, 2): 1, (1, 3): 1, (2, 3): 2, (3, 2): 2, (2, 0): 1, (3, 1): 1}
    trees = [
        [[1, [[0, 1], [0, 2], [1, 3]]]],  # root 0 enters S = {2, 3} twice
        [[1, [[1, 0], [0, 2], [2, 3]]]],
        [[1, [[2, 0], [0, 1], [2, 3]]]],
        [[1, [[1, 0], [3, 1], [3, 2]]]],
    ]
    f = _Forest(tree_groups(n, 1, trees), n)
    f.held[1, [0, 2, 3]] = False  # root 1's tree lost everything below GPU 1 (e.g. its link 1 -> 0 failed)
    cap = np.zeros(n * n, dtype=np.int64)
    for (u, v), c in links.items():
        cap[u * n + v] = c
    gi, vi = np.nonzero(f.held[: f.size] & (f.parent[: f.size] >= 0))
    load = np.bincount(f.parent[gi, vi] * n + vi, weights=f.count[gi], minlength=n * n).astype(np.int64)
    sets = [np.array([2, 3])]
    member = np.zeros((1, n), dtype=bool)
    member[0, [2, 3]] = True
    assert set_slacks(f, member, cap - load)[0] < 0  # root 1 cannot enter S any more
    stats = {"cut_pieces": 0, "cut_units": 0, "splits": 0}
    _free_tight_sets(f, n, cap, load, sets, stats)
    assert stats["tight_sets"] == 1 and not f.held[0, 3]  # root 0's second entry (1 -> 3) was cut
    assert set_slacks(f, member, cap - load)[0] >= 0
    # and the partial trees now complete
    from jaxccl.synth.allgather.packing import PartialForest

    part = np.flatnonzero(~f.held[: f.size].all(axis=1))
    left = cap - load
    residual = {(int(e) // n, int(e) % n): int(left[e]) for e in np.flatnonzero(left > 0)}
    start = PartialForest(f.root[part], f.first[part], f.count[part], f.held[part], f.depth[part], 2)
    grown = match_pack(n, 1, residual, check="full", start=start)
    assert sum(len(p) for p in grown.pieces) == int((~f.held[part]).sum())


def networkx_bipartite_value(demand, allowed, icap, entry) -> int:
    g = nx.DiGraph()
    for i, c in enumerate(demand.tolist()):
        g.add_edge("s", ("r", i), capacity=c)
    for j, c in enumerate(icap.tolist()):
        g.add_edge(("c", j), "t", capacity=c)
    for i, j in zip(*np.nonzero(allowed)):
        g.add_edge(("r", int(i)), ("c", int(j)), capacity=int(entry[i, j]))
    g.add_nodes_from(["s", "t"])
    return nx.maximum_flow_value(g, "s", "t")


def test_small_bipartite_matching_is_a_maximum_flow():
    from jaxccl.synth.allgather.flow import small_bipartite_flow
    from jaxccl.synth.allgather.packing import _bipartite

    rng = np.random.default_rng(7)
    for _ in range(300):
        m, d = rng.integers(1, 10, size=2)
        allowed = rng.random((m, d)) < rng.random()
        demand, icap = rng.integers(0, 20, m), rng.integers(0, 20, d)
        flow = small_bipartite_flow(demand, allowed, icap)
        assert (flow >= 0).all() and (flow[~allowed] == 0).all()
        assert (flow.sum(axis=1) <= demand).all() and (flow.sum(axis=0) <= icap).all()
        assert flow.sum() == _bipartite(demand, allowed, icap).sum()  # scipy's max-flow value
        entry = rng.integers(0, 4, (m, d))
        capped = small_bipartite_flow(demand, allowed, icap, entry)
        assert (capped <= entry).all() and (capped[~allowed] == 0).all()
        assert (capped.sum(axis=1) <= demand).all() and (capped.sum(axis=0) <= icap).all()
        assert capped.sum() == networkx_bipartite_value(demand, allowed, icap, entry)


def test_fast_compile_builds_the_reference_program():
    import sys

    from jaxccl.synth.allgather.compile import allgather_schedule, allgather_schedule_reference

    mod = sys.modules["jaxccl.synth.allgather.driver"]
    seen = []
    original = mod.allgather_schedule

    def grab(packing, **kwargs):
        seen.append(packing)
        return original(packing, **kwargs)

    mod.allgather_schedule = grab
    try:
        base = rail(hosts=4)
        prev = allgather(base)
        allgather(scenario(base, "fail2"), previous=prev)  # repaired trees: split groups, forwards of several pieces
        allgather(scenario(rail(hosts=2, gpus_per_host=4), "fail1"))
    finally:
        mod.allgather_schedule = original
    assert any(p.method == "warm-repair" for p in seen)
    for p in seen:
        fast = allgather_schedule(p, name="x")
        assert fast.digest == allgather_schedule_reference(p, name="x").digest
        fast.validate()


def test_switch_split_preserves_throughput_and_capacity():
    from jaxccl.synth.allgather.flow import RootedCheck

    net, units, logical = _logical(scenario(rail(hosts=4), "fail2"))
    src, dst, cap = logical.arrays(net.num_gpus)
    assert RootedCheck(net.num_gpus, net.num_gpus, src, dst).violation(cap, units.k, net.num_gpus * units.k) is None
    # the logical links, unrolled to physical links, fit the physical capacities
    load = logical.physical_load(logical.gpu_links())
    assert (load <= units.caps).all()


def test_transport_plan_keeps_totals():
    from jaxccl.synth.allgather.switch_removal import transport_plan

    a = np.array([5, 9, 2, 7])
    b = np.array([6, 6, 6, 5])
    y = transport_plan(a, b, ~np.eye(4, dtype=bool))
    assert (y.sum(axis=1) == a).all() and (y.sum(axis=0) == b).all()
    assert (np.diag(y) == 0).all() and (y >= 0).all()


def test_measured_capacities_without_a_common_unit():
    """Capacities with no small common unit are rounded to an int32 grid; the gap is reported and tiny."""
    import math

    topo = rail(hosts=2, gpus_per_host=4).degrade(0, "tor:s0r0", capacity=1e10 * math.pi)
    topo = topo.degrade(1, "nvs:h0", capacity=2e11 * math.e)
    s = allgather(topo)
    assert not s.info["exact"]
    assert s.algbw <= s.bound <= brute_force_bound(topo) * (1 + 1e-12)
    assert s.algbw >= 0.99 * brute_force_bound(topo)
    s.validate()


# ------------------------------------------------------------------ any topology (issue 15)
def link_chunks_rate(s, topo: Topology) -> float:
    """algbw from the chunks the schedule puts on every physical link: N * k * min(capacity / chunks)."""
    rate = min(topo.capacity(u, v) / c for u, v, c in s.info["link_chunks"])
    return rate * s.chunks_per_period * s.num_ranks


RAIL_SEGMENTS = [(1, 2, 2), (1, 4, 2), (1, 4, 3), (2, 4, 2), (3, 4, 2), (2, 2, 2), (1, 1, 3), (2, 1, 2), (1, 8, 2)]


@pytest.mark.parametrize("shape", RAIL_SEGMENTS, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("method", ["forestcoll", "latency"])
def test_multi_segment_rails_reach_the_bound(shape, method):
    hosts, gpus, segments = shape
    topo = rail(hosts=hosts, gpus_per_host=gpus, segments=segments)
    s = allgather(topo, method=method).validate()
    assert s.algbw == s.bound and s.info["gap"] == 0.0
    assert link_chunks_rate(s, topo) == pytest.approx(s.algbw, rel=1e-12)
    networkx_check(topo, s.bound)
    r = reduce_scatter(topo, method=method).validate()
    assert r.algbw == r.bound == pytest.approx(s.bound, rel=1e-12)


def test_greedy_split_counts_only_sets_that_miss_a_gpu():
    # Splitting the aggregation switch between two ToRs weakens sets that hold the switch but neither ToR;
    # on a 2x1x2 rail such sets can hold every GPU, and those constrain nothing (ForestColl's condition).
    from jaxccl.synth.allgather.bound import optimal_rate, tree_units
    from jaxccl.synth.allgather.logical import Logical
    from jaxccl.synth.allgather.network import build_net
    from jaxccl.synth.allgather.switch_removal import SplitStats, greedy_split

    net = build_net(rail(hosts=1, gpus_per_host=2, segments=2))
    units = tree_units(net, optimal_rate(net))
    logical = Logical(net, units.caps)
    stats = SplitStats()
    greedy_split(logical, net.names.index("agg"), units.k, stats)
    assert stats.dropped == 0


def test_nearly_dead_link_is_left_out():
    healthy = torus(4, 4)
    for capacity in (1e3, 1.0):
        topo = healthy.degrade(0, 1, capacity=capacity)
        s = allgather(topo).validate()
        assert s.info["dead_links"] == [[0, 1, capacity], [1, 0, capacity]]
        networkx_check(healthy.cut(0, 1), s.bound)
        assert link_chunks_rate(s, healthy.cut(0, 1)) == pytest.approx(s.algbw, rel=1e-12)


def egress_heavy_switch() -> Topology:
    """Four GPUs sending 10 GB/s into a switch that sends 30 GB/s back to each."""
    edges = []
    for g in range(4):
        edges += [(g, "w", 10 * GB, 1e-6), ("w", g, 30 * GB, 1e-6)]
    return Topology.from_edges(4, edges, name="egress-heavy")


@pytest.mark.parametrize("method", ["forestcoll", "latency"])
def test_switch_with_more_egress_than_ingress_gets_a_bound_trees_reach(method):
    # Without multicast every unit leaving the switch entered it: all 4 * 3 * x of the gathered data crosses
    # the 40 GB/s of ingress, so x = 40/12 GB/s per root (the max-flow bound, 10 GB/s per root, needs copies).
    topo = egress_heavy_switch()
    s = allgather(topo, method=method).validate()
    assert s.algbw == s.bound == pytest.approx(4 * 40 * GB / 12, rel=1e-12)
    assert s.info["balanced_switches"] == [["w", 40 * GB, 120 * GB]]
    assert link_chunks_rate(s, topo) >= s.algbw * (1 - 1e-12)
    r = reduce_scatter(topo, method=method).validate()  # reversed: ingress-heavy, the same limit
    assert r.algbw == r.bound == pytest.approx(s.bound, rel=1e-12)


@pytest.mark.parametrize("method", ["forestcoll", "latency"])
def test_one_way_degraded_switch_links_validate(method):
    from jaxccl.topology import fat_tree

    topo = fat_tree(2, 2, 2).degrade(0, "leaf:0", gbps=100, both=False)
    s = allgather(topo, method=method).validate()
    assert s.algbw == s.bound and s.info["balanced_switches"]
    assert link_chunks_rate(s, topo) >= s.algbw * (1 - 1e-12)
    assert s.bound <= brute_force_bound(topo) * (1 + 1e-12)


@pytest.mark.parametrize(
    ("healthy", "change"),
    [
        (lambda: rail(hosts=2), lambda t: scenario(t, "fail1")),
        (lambda: torus(6, 6), lambda t: t.degrade(0, 1, capacity=25e9)),
    ],
    ids=["rail 1x2x8 fail1", "torus 6x6 one link at half"],
)
def test_warm_trees_are_lifted_to_the_cold_depth(healthy, change):
    base = healthy()
    topo = change(base)
    warm = allgather(topo, previous=allgather(base)).validate()
    cold = allgather(topo)
    assert warm.info["certificate"] == "trees" and warm.algbw == cold.algbw == warm.bound
    assert warm.info["max_depth"] <= cold.info["max_depth"]
    assert "shorten" in warm.info["phase_times_s"]
    assert link_chunks_rate(warm, topo) == pytest.approx(warm.algbw, rel=1e-12)
