"""The online tuner in a job: one context per (collective, size bucket), executor rewards, the closed loop."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl
from jaxccl.control import Controller
from jaxccl.errors import JaxcclError
from jaxccl.runtime import native
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.topology import rail
from jaxccl.tune import OnlineTuner, Selector, TuneError, exact_arm

TOPO = rail(hosts=2, gpus_per_host=4)
AXES = ("a", "b")
SPEC = P(AXES)
EXPLORE = {"policy": "ucb1", "alpha": 1.0, "pseudo_count": 0.0}  # cold: every arm runs early


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 4), AXES)


def _comm(mesh, time_scale=1e-2):
    return jaxccl.Communicator(
        mesh, AXES, topology=TOPO, backend="cpu", link_emulation=LinkEmulation(time_scale=time_scale), size_buckets=True
    )


def _jit(mesh, body, n):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(SPEC,) * n, out_specs=(SPEC,) * n))


def _data(rng, n):
    x = rng.standard_normal(n).astype(np.float32)
    return np.where(x == 0, np.float32(0.5), x)  # random, non-zero


def _same(got, want):
    for g, w in zip(got, want):
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


def test_two_sizes_two_contexts_each_runs_its_arm():
    mesh = _mesh()
    comm = _comm(mesh)
    sizes = (128, 2048)  # elements per rank

    def body(lib):
        return lambda s, m: tuple(lib.all_gather(v, AXES, tiled=True) for v in (s, m))

    f, ref = _jit(mesh, body(jaxccl), 2), _jit(mesh, body(jax.lax), 2)
    tuner = OnlineTuner(comm, policy=EXPLORE)
    ctxs = [("all_gather", 8 * n * 4) for n in sizes]
    rng = np.random.default_rng(0)
    with comm:
        for _ in range(6):
            arms = tuner.prepare_all(ctxs)
            for (coll, nb), arm in zip(ctxs, arms.values()):
                want = tuner.selector.schedules((coll, 8, nb), arm)[0]
                assert comm.launched_schedule(coll, nbytes=nb).digest == want.digest
            xs = [_data(rng, 8 * n) for n in sizes]
            _same(f(*xs), ref(*xs))
            assert tuner.record_all() == 2
    assert f._cache_size() == 1  # every swap without recompiling
    assert [c.key for c in tuner.contexts] == ["all_gather/8/4096", "all_gather/8/65536"]
    seen = {k: {a for kk, a, _ in tuner.history if kk == k} for k in ("all_gather/8/4096", "all_gather/8/65536")}
    assert all(len(v) >= 2 for v in seen.values()), seen  # exploration ran several arms in each context
    assert all(lat is not None and lat > 0 for _, _, lat in tuner.history)
    last = tuner.history[-1]
    assert last[2] == pytest.approx(native.last_launch_seconds(comm.slot("all_gather", 65536)))


def test_exploration_never_breaks_bitwise_equality():
    """ReduceScatter and AllReduce contexts ask for exact sums: only rank-ordered arms run, every step bitwise."""
    mesh = _mesh()
    comm = _comm(mesh, time_scale=1e-1)
    n = 8 * 64  # elements per rank: a multiple of the rank count

    def body(lib):
        def step(g1, g2, v):
            return (
                lib.psum_scatter(g1, AXES, tiled=True),
                lib.psum_scatter(g2, AXES, tiled=True),
                lib.psum(v, AXES),
            )

        return step

    f, ref = _jit(mesh, body(jaxccl), 3), _jit(mesh, body(jax.lax), 3)
    tuner = OnlineTuner(comm, policy={"policy": "eps_greedy", "epsilon": 1.0}, seed=3)  # explores every step
    ctxs = [("reduce_scatter", n * 4), ("reduce_scatter", 4 * n * 4), ("all_reduce", n * 4)]
    for coll in ("reduce_scatter", "all_reduce"):
        offered = tuner.arms(coll)
        assert len(offered) >= 2
        assert all(exact_arm(a) for a in tuner._catalog(jaxccl.tune.Context(coll, 8, 1)))
    rng = np.random.default_rng(1)
    ran = set()
    with comm:
        for _ in range(9):
            ran |= {(k, a) for k, a in tuner.prepare_all(ctxs).items()}
            xs = [_data(rng, 8 * n), _data(rng, 8 * 4 * n), _data(rng, 8 * n)]
            _same(f(*xs), ref(*xs))
            tuner.record_all()
    assert len({a for k, a in ran if k.startswith("reduce_scatter/8/2048")}) >= 2

    # a given selector that offers unordered arms is refused where the context asks for exact sums
    unordered = OnlineTuner(comm, Selector.for_topology(TOPO, policy="auto"))
    sel = unordered.selector
    ctx = ("reduce_scatter", 8, 1 << 20)
    if not exact_arm(jaxccl.tune.Arm("x", "reduce_scatter", sel.schedules(ctx, sel.choose(ctx)))):
        with pytest.raises(TuneError, match="rank order"):
            unordered.prepare("reduce_scatter", 1 << 20)


def test_resynthesis_replaces_the_synthesized_arm_and_resets_the_context():
    mesh = _mesh()
    comm = _comm(mesh)
    tuner = OnlineTuner(comm, policy={"policy": "ucb1", "alpha": 0.1, "pseudo_count": 2.0})
    nb = 8 * 1024 * 4
    x = _data(np.random.default_rng(2), 8 * 1024)
    f = _jit(mesh, lambda v: (jaxccl.all_gather(v, AXES, tiled=True),), 1)
    with comm:
        for _ in range(3):
            tuner.prepare("all_gather", nb)
            f(x)[0].block_until_ready()
            tuner.record("all_gather", nb)
    ctx = ("all_gather", 8, nb)
    assert sum(tuner.selector.bandit(ctx).policy.state()["pulls"]) == 3
    degraded = TOPO.degrade(0, "tor:s0r0", gbps=100)
    new = jaxccl.synth.all_gather(degraded)
    tuner.on_resynthesis("all_gather", new, degraded)
    arm = tuner.prepare("all_gather", nb)
    assert tuner.resyntheses == [("all_gather", new.name)]
    assert tuner.topology is degraded
    assert tuner.selector.schedules(ctx, "tree")[0].digest == new.digest
    b = tuner.selector.bandit(ctx)
    want = tuner.model.predict_context(ctx, tuner._catalog(jaxccl.tune.Context(*ctx)), degraded)
    assert tuner.prediction_scale == pytest.approx(1e2)  # 1 / the emulation's time scale: the rewards' units
    assert b.predictions == [want[a] * tuner.prediction_scale for a in b.all_arms]  # the prior, degraded fabric
    assert len(tuner.history) == 3 and arm in b.arms
    assert sum(b.policy.state()["pulls"]) == 0  # the estimates restarted
    with pytest.raises(TuneError):
        tuner.on_resynthesis("all_gather", "not a schedule", degraded)


def test_follow_a_live_controller():
    """The closed loop re-synthesizes after a fault; the tuner takes the new schedule as its tree arm."""
    mesh = _mesh()
    comm = _comm(mesh, time_scale=1e-3)
    comm.install("all_gather", jaxccl.synth.all_gather(TOPO))
    elems = 8192
    f = _jit(mesh, lambda v: (jaxccl.all_gather(v, AXES, tiled=True),), 1)
    ref = _jit(mesh, lambda v: (jax.lax.all_gather(v, AXES, tiled=True),), 1)
    controller = Controller(comm, gamma=0.15)
    tuner = OnlineTuner(comm, policy="auto").follow(controller)
    nb = 8 * elems * 4
    x = _data(np.random.default_rng(3), 8 * elems)
    with comm:
        for step in range(60):
            if step == 4:
                comm.inject(TOPO.degrade(0, "tor:s0r0", gbps=100))
            tuner.prepare("all_gather", nb)
            _same(f(x), ref(x))
            tuner.record("all_gather", nb)
            controller.step()
            if tuner.resyntheses:
                tuner.prepare("all_gather", nb)
                break
    assert not controller.errors
    assert tuner.resyntheses, [e.kind for e in controller.events]
    assert tuner.topology is not TOPO
    staged = [e for e in controller.events if e.kind == "staged"]
    assert staged and tuner.selector.schedules(("all_gather", 8, nb), "tree")[0].name == tuner.resyntheses[0][1]
    _same(f(x), ref(x))


def test_tuner_bad_input():
    mesh = _mesh()
    comm = _comm(mesh)
    tuner = OnlineTuner(comm)
    for bad in (0, -1, 1.5, "8", None):
        with pytest.raises(TuneError, match="nbytes"):
            tuner.prepare("all_gather", bad)
    with pytest.raises(TuneError, match="no arms"):
        tuner.prepare("all_to_all", 1024)
    with pytest.raises(TuneError):
        tuner.prepare(3, 1024)
    with pytest.raises(TuneError, match="none prepared"):
        tuner.record("all_gather", 1024)
    with pytest.raises(TuneError, match="policy"):
        OnlineTuner(comm, Selector.for_topology(TOPO), policy="ucb1")
    for bad in (0, -1.0, float("inf"), "2", True):
        with pytest.raises(TuneError, match="prediction_scale"):
            OnlineTuner(comm, prediction_scale=bad)
    with pytest.raises(TuneError, match="exact_reductions"):
        OnlineTuner(comm, exact_reductions="yes")
    with pytest.raises(TuneError, match="topology"):
        OnlineTuner(jaxccl.Communicator(mesh, AXES, backend="cpu"))
    with pytest.raises(TuneError, match="own selector"):
        OnlineTuner(comm, Selector.for_topology(TOPO)).follow(Controller(comm))
    with pytest.raises(JaxcclError):
        Controller(comm).add_resynthesis_hook(42)
    tuner.prepare("all_gather", 1024)
    with pytest.raises(TuneError, match="latency"):
        tuner.record("all_gather", 1024, latency_s=-1.0)


def test_a_jitted_step_drives_the_tuner_at_its_end():
    """``at_step_end(tuner, ...)``: each step's callback learns from its launch and stages the next arm."""
    from jaxccl.control.step_driven import at_step_end

    mesh = _mesh()
    comm = _comm(mesh)
    n = 512  # elements per rank
    tuner = OnlineTuner(comm, policy=EXPLORE)
    tuner.prepare_all([("all_gather", 8 * n * 4)])
    gather = jax.shard_map(lambda v: jaxccl.all_gather(v, AXES, tiled=True), mesh=mesh, in_specs=SPEC, out_specs=SPEC)
    reference = jax.jit(
        jax.shard_map(lambda v: jax.lax.all_gather(v, AXES, tiled=True), mesh=mesh, in_specs=SPEC, out_specs=SPEC)
    )

    @jax.jit
    def step(x):
        y = gather(x)
        at_step_end(tuner, y)  # outside shard_map: one callback per step
        return y

    rng = np.random.default_rng(4)
    with comm:
        for _ in range(6):
            x = _data(rng, 8 * n)
            _same([step(x)], [reference(x)])
        jax.effects_barrier()
    assert tuner.errors == []
    assert len(tuner.history) == 6 and all(lat is not None and lat > 0 for _, _, lat in tuner.history)
    assert len({arm for _, arm, _ in tuner.history}) >= 2  # the callbacks switched arms between steps
    assert step._cache_size() == 1
