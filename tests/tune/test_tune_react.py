"""REACT (jaxccl.tune.react): patterns, transforms, bitvector check, degree pruning, detection, Algorithm 1."""

from __future__ import annotations

import doctest
import importlib
import random
from collections import Counter

import networkx as nx
import numpy as np
import pytest

from jaxccl.errors import ScheduleError, TopologyError
from jaxccl.schedule.interpreter import simulate_rounds
from jaxccl.synth import baselines
from jaxccl.topology import fat_tree
from jaxccl.tune import react
from jaxccl.tune.react import (
    ExternalFlows,
    FlowHistory,
    FlowKind,
    ReactConfig,
    SimulatorRunner,
    Transform,
    TransformKind,
    apply_transforms,
    compile_pattern,
    critical_path,
    degree_preserving,
    detect_congestion,
    double_binary_tree_pattern,
    flow_times,
    pattern_measurer,
    position_equivalent_swaps,
    recursive_doubling_pattern,
    ring_allreduce_pattern,
    run_react,
    viable_set,
)

PATTERNS = [
    ("tree", 3),
    ("tree", 5),
    ("tree", 8),
    ("tree", 16),
    ("ring", 2),
    ("ring", 5),
    ("ring", 8),
    ("recursive_doubling", 2),
    ("recursive_doubling", 8),
    ("recursive_doubling", 16),
]
BASELINE = {
    "tree": baselines.double_binary_tree_allreduce,
    "ring": baselines.ring_allreduce,
    "recursive_doubling": baselines.recursive_doubling_allgather,
}


def _messages(schedule) -> Counter:
    return Counter((a.rank, b.rank) for a, b in simulate_rounds(schedule).receiver.items())


@pytest.mark.parametrize("name,n", PATTERNS)
def test_untransformed_patterns_are_the_baselines(name, n):
    p = react.pattern_for(name, n)
    assert p.is_identity() and p.semantics.valid, p.semantics.reason
    s = p.to_schedule().validate(num_slots=1)
    assert _messages(s) == _messages(BASELINE[name](n))
    assert s.info["ordered_reduction"] is False


def test_tree_pattern_is_fig_1():
    """NCCL's trees over 16 ranks as in REACT Fig. 1: node 3 reduces 1 and 5 in the even-leaf tree."""
    p = double_binary_tree_pattern(16)
    kids = sorted(f.src for f in p.flows if f.chunk_graph == 1 and f.dst == 3 and f.kind is FlowKind.REDUCE)
    assert kids == [1, 5]
    leaves = {f.src for f in p.flows if f.kind is FlowKind.REDUCE and f.step == 0}
    assert {r % 2 for r in leaves if any(f.chunk_graph == 0 and f.src == r and f.step == 0 for f in p.flows)} == {1}


# ------------------------------------------------------------------------------ transforms
def _random_chain(p, rng: random.Random, length: int):
    """A random sequence of viable transforms (random congested device and flows each time)."""
    cur = p
    applied = []
    for _ in range(length):
        x = rng.randrange(p.num_ranks)
        incident = cur.incident_flows(x, rng.choice(["in", "out", "both"])).tolist()
        cong = rng.sample(incident, k=max(1, len(incident) // 2)) if incident else []
        cands = viable_set(cur, x, congested_flows=cong)
        if not cands:
            continue
        c = rng.choice(cands)
        cur = c.pattern
        applied.append(c.transform)
    return cur, applied


@pytest.mark.parametrize("name,n", [("tree", 5), ("tree", 8), ("tree", 16), ("ring", 4), ("ring", 6)])
@pytest.mark.parametrize("seed", range(3))
def test_viable_transforms_preserve_semantics_and_never_raise_a_degree(name, n, seed):
    p = react.pattern_for(name, n)
    cur, applied = _random_chain(p, random.Random(seed), 6)
    assert applied or name == "ring"
    assert cur.semantics.valid, cur.semantics.reason
    assert (cur.flow_degree <= p.flow_degree).all()  # k_f (Eq. 1) of no flow grows
    # hence no device sends or receives more flows at a step than the original's largest k_f of that step
    for t in range(p.num_steps):
        bound = p.flow_degree[p.steps == t].max()
        assert cur.out_degree[t].max() <= bound and cur.in_degree[t + 1].max() <= bound
    cur.to_schedule().validate(num_slots=1)
    assert react.apply_all(p, applied) == cur


@pytest.mark.parametrize("n", [4, 8, 16])
@pytest.mark.parametrize("seed", range(2))
def test_recursive_doubling_transforms(n, seed):
    p = recursive_doubling_pattern(n)
    cur, applied = _random_chain(p, random.Random(seed), 5)
    assert applied
    assert cur.semantics.valid
    assert (cur.flow_degree <= p.flow_degree).all()
    assert int(cur.flow_size.sum()) == int(p.flow_size.sum())  # every block still travels once per receiver
    cur.to_schedule().validate(num_slots=1)


@pytest.mark.parametrize("name,n", [("tree", 7), ("ring", 5), ("recursive_doubling", 8)])
def test_any_global_permutation_is_safe(name, n):
    p = react.pattern_for(name, n)
    rng = np.random.default_rng(n)
    for _ in range(3):
        perm = rng.permutation(n)
        q = p.with_placement(perm[p.placement])
        assert q.semantics.valid
        assert np.array_equal(np.sort(q.flow_degree), np.sort(p.flow_degree))
        assert (q.flow_degree == p.flow_degree).all()
        q.to_schedule().validate()


@pytest.mark.parametrize("name,n", [("tree", 6), ("tree", 8), ("ring", 4), ("recursive_doubling", 8)])
def test_bitvector_check_agrees_with_the_interpreter(name, n):
    """Random position swaps: App. A.3's bitvector check accepts exactly what the reference interpreter accepts."""
    p = react.pattern_for(name, n)
    rng = random.Random(7)
    seen = Counter()
    for _ in range(40):
        g = rng.randrange(p.num_chunk_graphs)
        t = rng.randrange(p.num_steps + 1)
        x, y = rng.sample(range(n), 2)
        q = Transform(TransformKind.POSITION, x, y, chunk_graph=g, time=t).apply(p)
        ok = q.semantics.valid
        seen[ok] += 1
        if ok:
            q.to_schedule().validate()
        else:
            with pytest.raises(ScheduleError):
                q.to_schedule().validate()
    assert seen[False] > 0


def test_position_equivalent_swaps_are_exactly_the_valid_ones():
    p = double_binary_tree_pattern(8)
    found = {s.key for s in position_equivalent_swaps(p, chunk_graph=1)}
    brute = set()
    for t in range(p.num_steps + 1):
        for x in range(8):
            for y in range(x + 1, 8):
                tr = Transform(TransformKind.POSITION, x, y, chunk_graph=1, time=t)
                q = tr.apply(p)
                moved = not (np.array_equal(q.src_device, p.src_device) and np.array_equal(q.dst_device, p.dst_device))
                if q.semantics.valid and moved:
                    brute.add(tr.key)
    assert found == brute and found
    # leaves of a tree are interchangeable at the time they send (Fig. 2's same-colored nodes)
    assert ("position", 1, 0, 0, 2) in found


def test_ring_only_admits_global_swaps():
    """App. A.2: chunk-local swaps raise degrees in a ring; no position-equivalent swaps exist."""
    p = ring_allreduce_pattern(8)
    assert position_equivalent_swaps(p) == []
    for g in range(8):
        for y in range(1, 8):
            assert not degree_preserving(p, Transform(TransformKind.CHUNK, 0, y, chunk_graph=g).apply(p))
    cands = viable_set(p, 0, congested_flows=p.incident_flows(0, "in"))
    assert cands and {c.transform.kind for c in cands} == {TransformKind.GLOBAL}


def test_fig_1_viable_nodes():
    """REACT Fig. 1: for congested node 3, nodes 4 and 12 are pruned; 2 is viable and lowers 3's in-degree."""
    p = double_binary_tree_pattern(16)
    cong = [f.index for f in p.flows if f.chunk_graph == 1 and f.dst == 3]
    cands = viable_set(p, 3, congested_flows=cong, kinds=[TransformKind.CHUNK])
    by_partner = {c.transform.y: c for c in cands}
    assert 4 not in by_partner and 12 not in by_partner
    assert by_partner[2].reduces_degree and by_partner[2].tier < by_partner[11].tier
    assert not by_partner[11].reduces_degree  # same degree as 3: a "yellow" node
    with pytest.raises(ScheduleError):
        Transform(TransformKind.CHUNK, 3, 3, chunk_graph=1)
    with pytest.raises(ScheduleError):
        Transform(TransformKind.CHUNK, 3, 4, chunk_graph=5).apply(p)


def test_bad_patterns_are_refused():
    with pytest.raises(ScheduleError, match="power-of-two"):
        recursive_doubling_pattern(6)
    p = ring_allreduce_pattern(4)
    bad = p.placement.copy()
    bad[0, 0, 0] = 1
    with pytest.raises(ScheduleError, match="permutation"):
        p.with_placement(bad)
    with pytest.raises(ScheduleError, match="unknown REACT pattern"):
        react.pattern_for("butterfly", 4)


# ------------------------------------------------------------------------------- detection
def _batch(rng, degrees, noise=0.03, epochs=6):
    base = degrees.astype(float)  # a flow of degree k gets 1/k of its links
    return base[None, :] * rng.lognormal(0.0, noise, size=(epochs, degrees.size))


@pytest.mark.parametrize("seed", range(5))
def test_healthy_noisy_batch_is_not_flagged(seed):
    rng = np.random.default_rng(seed)
    degrees = rng.integers(1, 4, size=60)
    c = detect_congestion(_batch(rng, degrees), sizes=np.ones(60), degrees=degrees)
    assert not c and not c.steady and not c.erratic


@pytest.mark.parametrize("seed", range(5))
def test_steady_and_erratic_congestion_are_told_apart(seed):
    rng = np.random.default_rng(seed)
    degrees = rng.integers(1, 4, size=60)
    fct = _batch(rng, degrees)
    fct[:, 7] *= 1.6  # steady: slower than its peers in every epoch (p90 throughput < 0.8 x peers)
    fct[[1, 4], 11] *= 2.0  # erratic: slow in two of six epochs
    c = detect_congestion(fct, sizes=np.ones(60), degrees=degrees)
    assert c.steady == {7}
    assert c.erratic == {11}
    assert c.flows == {7, 11}


def test_detection_uses_degree_peers_and_sizes():
    degrees = np.array([1, 1, 1, 2, 2, 2])
    sizes = np.array([1.0, 1.0, 4.0, 1.0, 1.0, 1.0])
    fct = np.tile([1.0, 1.0, 4.0, 2.0, 2.0, 2.0], (6, 1))  # degree-2 flows slower, a large flow longer: healthy
    assert not detect_congestion(fct, sizes=sizes, degrees=degrees)
    fct[:, 4] = 3.0
    assert detect_congestion(fct, sizes=sizes, degrees=degrees).steady == {4}
    with pytest.raises(ValueError):
        detect_congestion(fct[0], sizes=sizes, degrees=degrees)
    with pytest.raises(ValueError):
        detect_congestion(fct, sizes=sizes[:3], degrees=degrees)


def test_simulated_congestion_is_detected_on_the_congested_node():
    p = double_binary_tree_pattern(8)
    c = compile_pattern(p)
    topo = fat_tree(1, 9)
    healthy = flow_times(c, SimulatorRunner(16 << 20)(c.schedule, topo))
    congested = flow_times(c, SimulatorRunner(16 << 20, external=[ExternalFlows(8, 3, 2)])(c.schedule, topo))
    assert not detect_congestion(np.tile(healthy, (6, 1)), sizes=p.flow_size, degrees=p.flow_degree)
    cong = detect_congestion(np.tile(congested, (6, 1)), sizes=p.flow_size, degrees=p.flow_degree)
    into3 = set(np.flatnonzero(p.dst_device == 3).tolist())
    assert into3 <= cong.steady
    assert react.problem_devices(p, sorted(cong.flows), cong.flows)[0] == 3


# --------------------------------------------------------------------------- critical path
@pytest.mark.parametrize("name,n", [("tree", 6), ("ring", 4), ("recursive_doubling", 8)])
def test_critical_path_is_the_longest_path(name, n):
    p = react.pattern_for(name, n)
    w = np.random.default_rng(n).uniform(0.5, 2.0, p.num_flows)
    cp = critical_path(p, w)
    best = 0.0
    for g in range(p.num_chunk_graphs):
        dag = nx.DiGraph()
        for t in range(p.num_steps):
            for d in range(n):
                dag.add_edge((t, d), (t + 1, d), weight=0.0)
        for f in p.graph_flows(g).tolist():
            s, d = p.flow_devices(f)
            t = int(p.steps[f])
            dag.add_edge((t, s), (t + 1, d), weight=w[f])  # no parallel flows between one pair in one step
        best = max(best, nx.dag_longest_path_length(dag, weight="weight"))
    assert cp.time == pytest.approx(best)
    assert react.path_time(cp, w) == pytest.approx(cp.time)
    steps = [int(p.steps[f]) for f in cp.flows]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert len(react.critical_paths(p, np.tile(w, (6, 1)))) == 7


# ---------------------------------------------------------------------------------- model
def test_model_scales_known_pairs_and_prices_unknown_ones_by_degree():
    p = double_binary_tree_pattern(8)
    fct = np.where(p.flow_degree == 2, 2e-3, 1e-3)
    h = FlowHistory()
    h.record(p, fct)
    np.testing.assert_allclose(h.estimate(p), fct)
    q = Transform(TransformKind.GLOBAL, 0, 5).apply(p)
    np.testing.assert_allclose(h.estimate(q), fct)  # pairs change, degrees do not: same-degree medians
    slow = fct.copy()
    slow[p.dst_device == 3] *= 3
    h2 = FlowHistory(unknown="node")
    h2.record(p, slow)
    r = Transform(TransformKind.GLOBAL, 3, 6).apply(p)
    into3 = r.dst_device == 3
    assert (h2.estimate(r)[into3] > 2 * fct[into3]).all()  # unseen pairs into a slow device stay slow
    assert react.accepts(1.05, 1.0) and not react.accepts(1.0499, 1.0)
    with pytest.raises(ValueError):
        FlowHistory().estimate(p)


# ------------------------------------------------------------------------------ Algorithm 1
def _congested_tree(n=8, target=3, p=2):
    pat = double_binary_tree_pattern(n)
    runner = SimulatorRunner(16 << 20, external=[ExternalFlows(n, target, p)])
    return pat, pattern_measurer(runner, fat_tree(1, n + 1))


@pytest.mark.parametrize("epsilon", [0.05, 0.15, 10.0])
def test_algorithm_1_accepts_only_with_epsilon_predicted_gain(epsilon):
    pat, measure = _congested_tree()
    _, fct = measure(pat)
    batch = np.tile(fct, (6, 1))
    h = FlowHistory()
    h.record_batch(pat, batch)
    out = apply_transforms(pat, batch, h, config=ReactConfig(epsilon=epsilon))
    assert out.decisions and out.problem_devices[0] == 3
    for d in out.decisions:
        assert d.accepted == (d.predicted_gain >= epsilon - 1e-9)
    assert sum(d.accepted for d in out.decisions) == len(out.accepted)
    if epsilon >= 10.0:
        assert out.pattern is pat and not out.accepted
    else:
        assert out.accepted
        assert out.predicted_after * (1 + epsilon) ** len(out.accepted) <= out.predicted_before * (1 + 1e-9)
    assert out.pattern.semantics.valid and degree_preserving(pat, out.pattern)


def test_no_congestion_no_change():
    pat = double_binary_tree_pattern(8)
    measure = pattern_measurer(SimulatorRunner(16 << 20), fat_tree(1, 8))
    res = run_react(pat, measure)
    assert res.pattern is pat and res.improvement == 0.0 and len(res.rounds) == 1 and res.epochs == 6
    assert not res.rounds[0].outcome.congestion


def test_react_improves_a_congested_tree_in_the_simulator():
    pat, measure = _congested_tree()
    res = run_react(pat, measure, seed=0)
    again = run_react(pat, _congested_tree()[1], seed=0)
    assert res.improvement > 0.13  # measured in the simulator, checked by tau_r
    assert res.pattern == again.pattern and res.time_final == again.time_final  # deterministic given the seed
    assert res.pattern.semantics.valid and (res.pattern.flow_degree <= pat.flow_degree).all()
    res.pattern.to_schedule().validate()
    kept = [r for r in res.rounds if r.kept]
    assert kept and all(r.time_before >= 1.05 * r.time_after for r in kept)


def test_runner_checks_its_external_flows():
    pat = double_binary_tree_pattern(4)
    s = pat.to_schedule()
    with pytest.raises(TopologyError):
        SimulatorRunner(1 << 20, external=[ExternalFlows(2, 3, 1)])(s, fat_tree(1, 5))
    with pytest.raises(TopologyError):
        SimulatorRunner(1 << 20, external=[ExternalFlows(5, 5, 1)])(s, fat_tree(1, 8))
    with pytest.raises(ValueError):
        SimulatorRunner(0)


# ------------------------------------------------------------------------------- executor
def test_transformed_schedules_run_on_the_cpu_executor_bitwise():
    """Integer AllReduce is order-free, so transformed trees are bitwise equal to lax.psum; AllGather always is."""
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxccl
    from jaxccl.runtime.communicator import native_available

    if not native_available():
        pytest.skip("native CPU executor not built")
    n = 8
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))

    def jit(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    x = np.random.default_rng(3).integers(-(2**20), 2**20, size=n * 36, dtype=np.int32)
    want = np.asarray(jit(lambda v: jax.lax.psum(v, "d"))(x))
    tree, _ = _random_chain(double_binary_tree_pattern(n), random.Random(1), 6)
    assert not tree.is_identity()
    f = jit(lambda v: jaxccl.psum(v, "d"))
    xg = np.random.default_rng(4).standard_normal(n * 10).astype(np.float32)
    want_g = np.asarray(jit(lambda v: jax.lax.all_gather(v, "d", tiled=True))(xg))
    rd, _ = _random_chain(recursive_doubling_pattern(n), random.Random(2), 4)
    assert not rd.is_identity()
    g = jit(lambda v: jaxccl.all_gather(v, "d", tiled=True))
    with comm:
        comm.install("all_reduce", tree.to_schedule())
        assert np.asarray(f(x)).tobytes() == want.tobytes()
        comm.install("all_gather", rd.to_schedule())
        assert np.asarray(g(xg)).tobytes() == want_g.tobytes()


def _native_or_skip():
    pytest.importorskip("jax")
    from jaxccl.runtime.communicator import native_available

    if not native_available():
        pytest.skip("native CPU executor not built")


def test_executor_runner_measures_every_send_and_stays_bitwise():
    """The emulated executor as a REACT runner: one op_times entry per sending op; transformed trees equal lax.psum."""
    _native_or_skip()
    import jax
    from jax.sharding import PartitionSpec as P

    import jaxccl

    n = 8
    topo = fat_tree(1, n)
    runner = react.ExecutorRunner.create(topo, 256 << 10, time_scale=1e-2)
    tree, _ = _random_chain(double_binary_tree_pattern(n), random.Random(1), 6)
    assert not tree.is_identity()
    for pat in (double_binary_tree_pattern(n), tree):
        c = compile_pattern(pat)
        m = runner(c.schedule, topo)  # check=True: the result is compared bitwise with jax.lax.psum
        assert set(m.op_times) == set(c.send_ops)  # exactly one entry per sending op
        assert len(c.send_ops) == sum(op.kind.sends for tbs in c.schedule.ranks for tb in tbs for op in tb.ops)
        starts, ends = np.array(list(m.op_times.values())).T
        assert starts.min() == 0.0 and (ends > starts).all() and m.time_s == pytest.approx(ends.max())
        fct = flow_times(c, m)
        assert np.isfinite(fct).all() and (fct > 0).all()
        assert m.output_bytes == runner.input_bytes and m.wall_s > 0
        # healthy 400 Gbps star: no message beats its link (bytes / capacity + route latency)
        assert (fct >= (runner.input_bytes / 2) / topo.capacity(0, "leaf:0")).all()
    assert runner.installs == 2 and runner.runs == 2
    # AllGather: sends with several dependencies sit behind nops in the compiled table (trace op indices differ)
    rd, _ = _random_chain(recursive_doubling_pattern(n), random.Random(2), 4)
    c = compile_pattern(rd)
    m = runner(c.schedule, topo)  # compared bitwise with jax.lax.all_gather
    assert set(m.op_times) == set(c.send_ops) and m.output_bytes == n * runner.input_bytes
    # the transformed schedule, explicitly: int32 sums are order-free, so bitwise equal to jax.lax.psum
    ax = runner.comm.axis_name
    mesh = runner.comm.mesh

    def jit(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(ax), out_specs=P(ax)))

    x = np.random.default_rng(11).integers(-(2**30), 2**30, size=n * 40, dtype=np.int32)
    want = np.asarray(jit(lambda v: jax.lax.psum(v, ax))(x))
    with runner.comm:
        got = np.asarray(jit(lambda v: jaxccl.psum(v, ax))(x))
    assert runner.comm.schedule("all_reduce").digest == compile_pattern(tree).schedule.digest
    assert got.tobytes() == want.tobytes()


def test_executor_runner_sees_reduced_capacity_as_steady_congestion():
    """A rank whose incoming link keeps 1/5 of its capacity: REACT's Eq. 1 flags every flow into it, and it leads.

    Other flows may be flagged too: each link is a FIFO server of whole messages, so of two messages a rank
    sends at once the second waits for the first (a real NIC would interleave them).
    """
    _native_or_skip()
    n, target = 8, 3
    topo = fat_tree(1, n)
    cong = react.degraded_topology(topo, [target], 4)
    assert cong.capacity("leaf:0", target) == topo.capacity("leaf:0", target) / 5
    assert cong.capacity(target, "leaf:0") == topo.capacity(target, "leaf:0")  # only its incoming link
    with pytest.raises(TopologyError):
        react.degraded_topology(topo, [8], 1)
    with pytest.raises(ValueError):
        react.degraded_topology(topo, [1], -1)
    runner = react.ExecutorRunner.create(topo, 256 << 10, time_scale=1e-3)
    p = double_binary_tree_pattern(n)
    measure = pattern_measurer(runner, cong)
    fct = np.stack([measure(p)[1] for _ in range(6)])
    assert runner.injections == 1
    c = detect_congestion(fct, sizes=p.flow_size, degrees=p.flow_degree)
    into = p.dst_device == target
    assert set(np.flatnonzero(into).tolist()) <= c.steady
    # REACT Sec. 5.4.1: a device all of whose incoming flows are steady congested. (Which device *leads* the
    # problem list is not stable: the FIFO links flag some healthy flows too, and high-degree tree nodes touch more.)
    from jaxccl.tune.react.algorithm import steady_congested_devices

    assert target in steady_congested_devices(p, c.steady)
    assert target in react.problem_devices(p, sorted(c.flows), c.flows)
    rate = (p.flow_size / fct).mean(axis=0)
    assert rate[into].max() < 0.6 * np.median(rate[~into])


def _synthetic_trace(schedule, expected, scale=1e-3):
    from jaxccl.runtime.emulated import TRACE_DTYPE

    table = react.table_op_indices(schedule)  # the trace names ops by their compiled-table index
    recs = []
    for i, ((r, t, o), b) in enumerate(sorted(expected.items())):
        post = 1_000_000 + 1000 * i
        recs.append((r, schedule.ranks[r][t].send_peer, t, table[r][t][o], 0, 0, b, post, post + 500, post + 900))
    return np.array(recs, dtype=TRACE_DTYPE)


@pytest.mark.parametrize("name,n", [("tree", 8), ("ring", 5), ("recursive_doubling", 8)])
def test_table_op_indices_match_the_compiled_table(name, n):
    from jaxccl.schedule.ir import OpKind
    from jaxccl.schedule.table import compile_table, decode

    pat, _ = _random_chain(react.pattern_for(name, n), random.Random(5), 4)
    s = pat.to_schedule()
    d = decode(compile_table(s))
    idx = react.table_op_indices(s)
    if name == "recursive_doubling":  # its sends wait for several receives: nops in front of them
        assert any(j != i for r in idx for tb in r for i, j in enumerate(tb))
    g = 0
    for r, tbs in enumerate(s.ranks):
        for t, tb in enumerate(tbs):
            row = d["threadblocks"][g]
            ops = d["ops"][row["first_op"] : row["first_op"] + row["num_ops"]]
            assert [ops[j]["kind"] for j in idx[r][t]] == [op.kind.code for op in tb.ops]
            assert all(ops[j]["kind"] == OpKind.NOP.code for j in set(range(len(ops))) - set(idx[r][t]))
            g += 1


def test_trace_measurement_maps_records_to_sending_ops_and_checks_them():
    from jaxccl.errors import ExecutorError

    s = compile_pattern(double_binary_tree_pattern(4)).schedule
    topo = fat_tree(1, 4)
    expected = react.expected_sends(s, 64, 4)
    assert set(expected.values()) == {128}  # 2 chunks of 32 int32 each
    tr = _synthetic_trace(s, expected)
    m = react.trace_measurement(tr, s, time_scale=1e-3, topology=topo, output_bytes=256, expected=expected)
    assert len(m.op_times) == len(expected)
    k0 = min(expected)
    lat = topo.path_latency(k0[0], int(s.ranks[k0[0]][k0[1]].send_peer))
    assert m.op_times[k0] == pytest.approx((0.0, 500e-9 * 1e-3 + lat))
    obs = react.trace_measurement(tr, s, time_scale=1e-3, topology=topo, output_bytes=256, end="observed")
    assert obs.op_times[k0] == pytest.approx((0.0, 900e-9 * 1e-3))
    assert m.algbw == pytest.approx(256 / m.time_s)
    split = np.concatenate([tr, tr[:1]])  # one op's message in two records: one span, bytes summed
    split["bytes"][[0, -1]] = 64
    split["post_ns"][-1] += 100
    split["tx_end_ns"][-1] += 100
    m2 = react.trace_measurement(split, s, time_scale=1e-3, topology=topo, output_bytes=256, expected=expected)
    assert m2.op_times[k0] == pytest.approx((0.0, 600e-9 * 1e-3 + lat))
    with pytest.raises(ExecutorError, match="lacks"):
        react.trace_measurement(tr[1:], s, time_scale=1e-3, topology=topo, output_bytes=256, expected=expected)
    wrong = tr.copy()
    wrong["bytes"][0] = 64
    with pytest.raises(ExecutorError, match="carried 64 bytes"):
        react.trace_measurement(wrong, s, time_scale=1e-3, topology=topo, output_bytes=256, expected=expected)
    wrong = tr.copy()
    wrong["dst"][0] = next(d for d in range(4) if d not in (wrong["src"][0], wrong["dst"][0]))  # not its send peer
    with pytest.raises(ExecutorError, match="not a send"):
        react.trace_measurement(wrong, s, time_scale=1e-3, topology=topo, output_bytes=256)
    wrong = tr.copy()
    wrong["src"][0] = 4
    with pytest.raises(ExecutorError, match="outside"):
        react.trace_measurement(wrong, s, time_scale=1e-3, topology=topo, output_bytes=256)
    with pytest.raises(ExecutorError, match="empty"):
        react.trace_measurement(tr[:0], s, time_scale=1e-3, topology=topo, output_bytes=256)
    with pytest.raises(ValueError, match="end"):
        react.trace_measurement(tr, s, time_scale=1e-3, topology=topo, output_bytes=256, end="nic")


def test_executor_runner_needs_a_trace():
    _native_or_skip()
    import jax
    from jax.sharding import Mesh

    import jaxccl
    from jaxccl.errors import ExecutorError
    from jaxccl.runtime.emulated import LinkEmulation

    topo = fat_tree(1, 2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    plain = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu")
    with pytest.raises(ExecutorError, match="link_emulation"):
        react.ExecutorRunner(plain, 1 << 10)
    no_trace = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu", link_emulation=LinkEmulation())
    with pytest.raises(ExecutorError, match="trace=True"):
        react.ExecutorRunner(no_trace, 1 << 10)
    traced = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu", link_emulation=LinkEmulation(trace=True))
    with pytest.raises(ValueError, match="bytes_per_rank"):
        react.ExecutorRunner(traced, 8)


# -------------------------------------------------------------------------------- doctests
@pytest.mark.parametrize(
    "module",
    ["", "pattern", "semantics", "compile", "transforms", "detect", "critical_path", "model", "measure", "algorithm"],
)
def test_docstring_examples(module):
    mod = importlib.import_module("jaxccl.tune.react" + (f".{module}" if module else ""))
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
