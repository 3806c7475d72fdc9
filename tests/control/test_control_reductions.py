"""ReduceScatter and AllReduce in the closed loop, and the controller driven from the training step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl
from jaxccl.control import Controller, managed_collectives, ordered_reduce_scatter, predicted_algbw
from jaxccl.errors import ScheduleError, SynthesisError, TopologyError
from jaxccl.runtime.default_schedules import gloo_tree_reduce_scatter
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.synth import baselines
from jaxccl.topology import fat_tree, rail, ring, single_node

TOPO = rail(hosts=2, gpus_per_host=4)
NIC = (0, "tor:s0r0")
FAILED = TOPO.degrade(*NIC, gbps=200)
SHARD = 1 << 15  # parameter elements per rank: messages large enough to be measured

HEALTHY = 6  # steps before a fault: the change detector learns every entry's noise from its first 5 samples


# ------------------------------------------------------------------ the rank-ordered ReduceScatter (pure)
@pytest.mark.parametrize(
    "topo",
    [
        TOPO,
        FAILED,
        rail(hosts=4, gpus_per_host=2),
        rail(hosts=2, gpus_per_host=4, segments=2),
        rail(hosts=3, gpus_per_host=2),
        single_node(4),
        ring(5),
        fat_tree(leaves=2, gpus_per_leaf=3, spines=2),
    ],
    ids=lambda t: t.name,
)
def test_ordered_reduce_scatter_sums_in_rank_order_on_any_topology(topo):
    s = ordered_reduce_scatter(topo)
    s.validate(ordered_reduction=True)  # the interpreter proves ((x0 + x1) + x2) + ... for every output chunk
    assert s.info["ordered_reduction"] and s.collective.value == "reduce_scatter"
    assert s.algbw == pytest.approx(predicted_algbw(s, topo))


def test_ordered_reduce_scatter_routes_around_a_degraded_nic():
    stale, new = ordered_reduce_scatter(TOPO), ordered_reduce_scatter(FAILED)
    assert predicted_algbw(new, FAILED) >= 1.6 * predicted_algbw(stale, FAILED)
    nic_load = {(u, v): k for u, v, k in new.info["chunk_loads"]}
    healthy_nic = (1, "tor:s0r1")
    per_chunk = new.chunks_per_period
    # the degraded NIC carries about half of what a healthy one does, per chunk of the period
    assert nic_load.get(NIC, 0) / per_chunk < 0.75 * nic_load[healthy_nic] / per_chunk
    # twice the direct (rank-ordered) ReduceScatter on the healthy fabric: every block crosses once per host boundary
    assert predicted_algbw(stale, TOPO) == pytest.approx(2 * predicted_algbw(baselines.direct_reduce_scatter(8), TOPO))


def test_ordered_reduce_scatter_bad_input():
    with pytest.raises(SynthesisError, match="max_chunks"):
        ordered_reduce_scatter(TOPO, max_chunks=0)
    with pytest.raises(TopologyError, match="at least 2 GPUs"):
        ordered_reduce_scatter(single_node(1))


def test_tree_reduce_scatter_does_not_sum_in_rank_order():
    """Why the loop does not stage the tree packing: its sums follow the trees (the interpreter says so)."""
    tree = jaxccl.synth.reduce_scatter(TOPO)
    assert not tree.info["ordered_reduction"]
    tree.validate()  # a correct ReduceScatter ...
    with pytest.raises(ScheduleError, match="ascending rank order"):
        tree.validate(ordered_reduction=True)  # ... whose float sums are not jax.lax's


def test_managed_collectives():
    assert managed_collectives(["all_reduce"]) == ("reduce_scatter", "all_gather")
    assert managed_collectives(["all_gather", "psum", "psum_scatter"]) == ("all_gather", "reduce_scatter")


# ------------------------------------------------------------------ the loop on the emulated fabric
def _comm(time_scale=1e-3, alpha=0.5):
    mesh = Mesh(np.array(jax.devices()), ("d",))
    comm = jaxccl.Communicator(
        mesh,
        "d",
        topology=TOPO,
        backend="cpu",
        link_emulation=LinkEmulation(time_scale=time_scale),
        telemetry_alpha=alpha,
    )
    return mesh, comm


def _fsdp_body(lib):
    """One FSDP step's collectives: reduce-scatter the full local gradients, all-gather the parameter shards."""

    def body(grads, shard):
        return (
            lib.psum_scatter(grads, "d", scatter_dimension=0, tiled=True),
            lib.all_gather(shard, "d", axis=0, tiled=True),
            lib.psum(grads[:64], "d"),
        )

    return jax.shard_map(
        body, mesh=Mesh(np.array(jax.devices()), ("d",)), in_specs=P("d"), out_specs=(P("d"), P("d"), P())
    )


def _fsdp_pair():
    return jax.jit(_fsdp_body(jaxccl)), jax.jit(_fsdp_body(jax.lax))


def _inputs(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    if dtype == np.int32:
        return rng.integers(-(2**30), 2**30, 8 * 8 * SHARD, dtype=np.int32), rng.integers(
            -100, 100, 8 * SHARD, dtype=np.int32
        )
    grads = (rng.standard_normal(8 * 8 * SHARD) * np.exp(rng.uniform(-8, 8, 8 * 8 * SHARD))).astype(dtype) + 0.25
    return grads, rng.standard_normal(8 * SHARD).astype(dtype)


def _equal(ours, ref, args):
    for a, b in zip(ours(*args), ref(*args)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _drive(comm, ctl, steps, *, inject_at=None, seed=0, dtype=np.float32, pair=None):
    ours, ref = pair or _fsdp_pair()
    with comm:
        for k in range(steps):
            if k == inject_at:
                comm.inject(FAILED)
            _equal(ours, ref, _inputs(seed + k, dtype))
            if ctl is not None:
                ctl.step()


def _kinds(ctl, collective):
    return [e.kind for e in ctl.events if e.collective == collective]


def _step_time(rs, ag, topo):
    """Predicted time of one FSDP step's collectives per byte of gradients: ReduceScatter + AllGather."""
    return 1 / predicted_algbw(rs, topo) + 1 / predicted_algbw(ag, topo)


def test_degraded_nic_resynthesizes_and_swaps_reduce_scatter_and_all_gather():
    _, comm = _comm()
    stale_ag, stale_rs = jaxccl.synth.all_gather(TOPO), ordered_reduce_scatter(TOPO)
    comm.install("all_gather", stale_ag)
    comm.install("reduce_scatter", stale_rs)
    ctl = Controller(comm, collectives=("all_reduce",), gamma=0.15)  # psum = ReduceScatter + AllGather: both halves
    _drive(comm, ctl, HEALTHY)
    assert not [e for e in ctl.events if e.kind == "detected"]
    _drive(comm, ctl, 14, inject_at=0, seed=100)
    for coll in ("reduce_scatter", "all_gather"):
        kinds = _kinds(ctl, coll)
        assert kinds.count("staged") == 1 and kinds.count("activated") == 1, (coll, kinds)
        staged = next(e for e in ctl.events if e.kind == "staged" and e.collective == coll)
        assert staged.detail["predicted_algbw"] > staged.detail["stale_algbw"]
    new_rs, new_ag = comm.schedule("reduce_scatter"), comm.schedule("all_gather")
    assert new_rs is not stale_rs and new_ag is not stale_ag
    new_rs.validate(ordered_reduction=True)
    assert _step_time(stale_rs, stale_ag, FAILED) >= 1.3 * _step_time(new_rs, new_ag, FAILED)
    _drive(comm, None, 3, seed=200)  # still bitwise equal after the swaps (psum_scatter, all_gather and psum)
    assert not ctl.errors


def test_a_reduction_that_changes_the_sum_order_is_never_staged():
    _, comm = _comm()
    comm.install("reduce_scatter", ordered_reduce_scatter(TOPO))
    running = comm.schedule("reduce_scatter")

    def tree(topo, previous):
        return jaxccl.synth.reduce_scatter(topo)

    ctl = Controller(comm, collectives=("reduce_scatter",), gamma=0.15, synthesizers={"reduce_scatter": tree})
    _drive(comm, ctl, HEALTHY + 11, inject_at=HEALTHY)
    kinds = _kinds(ctl, "reduce_scatter")
    assert "synthesized" in kinds and "rejected" in kinds and "staged" not in kinds, kinds
    rejected = next(e for e in ctl.events if e.kind == "rejected")
    assert "order" in rejected.detail["reason"]
    assert comm.schedule("reduce_scatter") is running


def _psum_scatter_alone(lib):
    body = lambda g: lib.psum_scatter(g, "d", scatter_dimension=0, tiled=True)  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=Mesh(np.array(jax.devices()), ("d",)), in_specs=P("d"), out_specs=P("d")))


def _step_with_all_gather(comm, ctl):
    """FSDP steps (the AllGather's messages are what the emulated meter measures), a NIC degraded after HEALTHY."""
    step = jax.jit(_fsdp_body(jaxccl))
    with comm:
        for k in range(HEALTHY + 11):
            if k == HEALTHY:
                comm.inject(FAILED)
            jax.block_until_ready(step(*_inputs(k)))
            ctl.step()


def test_a_reduce_scatter_in_gloo_tree_order_is_resynthesized_in_that_order():
    # Across processes jax.lax sums a ReduceScatter in gloo's tree and so does the running schedule
    # (info["fold"]): the loop re-routes it with tree_reduce_scatter, whose sums are the same bits.
    _, comm = _comm()
    comm.install("reduce_scatter", gloo_tree_reduce_scatter(8))
    ours, ascending = _psum_scatter_alone(jaxccl), _psum_scatter_alone(jax.lax)
    grads, _ = _inputs(7)
    with comm:
        before = np.asarray(ours(grads))
    ctl = Controller(comm, collectives=("reduce_scatter",), gamma=0.15)
    _step_with_all_gather(comm, ctl)
    assert "activated" in _kinds(ctl, "reduce_scatter"), ctl.events
    new = comm.schedule("reduce_scatter")
    assert new.name == "tree_reduce_scatter" and new.info["fold"] == "gloo_tree"
    assert predicted_algbw(new, FAILED) > predicted_algbw(gloo_tree_reduce_scatter(8), FAILED)
    with comm:
        after = np.asarray(ours(grads))
    np.testing.assert_array_equal(after, before)
    assert not np.array_equal(after, np.asarray(ascending(grads)))  # gloo's bits, not one process's order
    assert not ctl.errors


def test_a_rank_ordered_reduce_scatter_never_replaces_one_in_gloo_tree_order():
    _, comm = _comm()
    comm.install("reduce_scatter", gloo_tree_reduce_scatter(8))
    running = comm.schedule("reduce_scatter")
    synthesizers = {"reduce_scatter": lambda topo, previous: ordered_reduce_scatter(topo)}
    ctl = Controller(comm, collectives=("reduce_scatter",), gamma=0.15, synthesizers=synthesizers)
    _step_with_all_gather(comm, ctl)
    rejected = [e for e in ctl.events if e.kind == "rejected"]
    assert rejected and "gloo_tree" in rejected[0].detail["reason"], ctl.events
    assert "staged" not in _kinds(ctl, "reduce_scatter")
    assert comm.schedule("reduce_scatter") is running


def test_tree_order_sums_are_staged_on_request_and_exact_for_integers():
    """``exact_reductions=False``: the warm tree packing runs; integer sums do not depend on the order."""
    _, comm = _comm()
    tree = jaxccl.synth.reduce_scatter(TOPO)
    comm.install("reduce_scatter", tree)
    ctl = Controller(comm, collectives=("psum_scatter",), gamma=0.15, exact_reductions=False)
    _drive(comm, ctl, HEALTHY + 11, inject_at=HEALTHY, dtype=np.int32)
    assert "activated" in _kinds(ctl, "reduce_scatter"), _kinds(ctl, "reduce_scatter")
    new = comm.schedule("reduce_scatter")
    assert new is not tree and "trees" in new.info and not new.info["ordered_reduction"]
    _drive(comm, None, 2, dtype=np.int32, seed=300)


def test_float_sums_of_the_tree_packing_differ_from_jax_lax():
    """What exact_reductions guards against, on the executor: same data, other last bits."""
    _, comm = _comm()
    comm.install("reduce_scatter", jaxccl.synth.reduce_scatter(TOPO))
    ours, ref = _fsdp_pair()
    with comm:
        differs = [
            not np.array_equal(np.asarray(a), np.asarray(b))
            for seed in range(3)
            for a, b in zip(ours(*_inputs(seed))[:1], ref(*_inputs(seed))[:1])
        ]
    assert any(differs)


def test_all_reduce_with_its_own_schedule_is_refused():
    _, comm = _comm()
    comm.install("all_reduce", baselines.ordered_allreduce(8))
    with pytest.raises(ValueError, match="all_reduce schedule"):
        Controller(comm, collectives=("psum",))


# ------------------------------------------------------------------ driven from the training step
def _train_step(ctl):
    body = _fsdp_body(jaxccl)

    @jax.jit
    def step(grads, shard):
        out = body(grads, shard)
        ctl.at_step_end(*out)
        return out

    return step


def test_step_driven_controller_swaps_between_steps():
    _, comm = _comm()
    comm.install("all_gather", jaxccl.synth.all_gather(TOPO))
    comm.install("reduce_scatter", ordered_reduce_scatter(TOPO))
    ctl = Controller(comm, collectives=("all_reduce",), gamma=0.15)
    step, ref = _train_step(ctl), jax.jit(_fsdp_body(jax.lax))
    steps = HEALTHY + 16
    _drive(comm, None, steps, inject_at=HEALTHY, pair=(step, ref))  # no ctl.step() and no thread: the step drives it
    jax.effects_barrier()
    assert len(ctl.step_times.ns) == steps  # one callback per step
    for coll in ("reduce_scatter", "all_gather"):
        assert "activated" in _kinds(ctl, coll), (coll, _kinds(ctl, coll))
    assert not ctl.errors


def test_step_driven_controller_failures_never_reach_the_step():
    _, comm = _comm()
    comm.install("reduce_scatter", ordered_reduce_scatter(TOPO))
    running = comm.schedule("reduce_scatter")

    def broken(topo, previous):
        raise RuntimeError("synthesizer exploded")

    ctl = Controller(comm, collectives=("reduce_scatter",), gamma=0.15, synthesizers={"reduce_scatter": broken})
    step, ref = _train_step(ctl), jax.jit(_fsdp_body(jax.lax))
    _drive(comm, None, HEALTHY + 9, inject_at=HEALTHY, pair=(step, ref))
    jax.effects_barrier()
    assert ctl.errors and "synthesizer exploded" in ctl.errors[0].detail["error"]
    assert comm.schedule("reduce_scatter") is running


def test_step_end_callback_records_what_escapes_the_controller():
    """Even a controller whose step() itself raises leaves the training step running."""

    class Exploding(Controller):
        def step(self):
            raise RuntimeError("step exploded")

    _, comm = _comm()
    ctl = Exploding(comm, collectives=("reduce_scatter",))

    @jax.jit
    def f(x):
        y = x * 2
        ctl.at_step_end(y)
        return y

    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(jnp.arange(4.0))), np.arange(4.0) * 2)
    jax.effects_barrier()
    assert len(ctl.errors) == 3 and "step exploded" in ctl.errors[0].detail["error"]
    assert len(ctl.step_times.ns) == 3


def test_step_driven_controller_every_kth_step():
    _, comm = _comm()
    comm.install("reduce_scatter", ordered_reduce_scatter(TOPO))
    ctl = Controller(comm, collectives=("reduce_scatter",))

    @jax.jit
    def f(x):
        y = x + 1
        ctl.at_step_end(y, every=3)
        return y

    for _ in range(7):
        f(jnp.arange(4.0)).block_until_ready()
    jax.effects_barrier()
    assert len(ctl.step_times.ns) == 3  # steps 1, 4 and 7
    with pytest.raises(ValueError, match="every"):
        jax.jit(lambda x: ctl.at_step_end(x, every=0))(jnp.ones(2))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
@pytest.mark.parametrize("topo", [TOPO, FAILED], ids=["healthy", "failed"])
def test_ordered_reduce_scatter_is_bitwise_equal_to_jax_lax(topo, dtype):
    mesh, comm = _comm(time_scale=1e-2)
    comm.install("reduce_scatter", ordered_reduce_scatter(topo))

    def rs(lib):
        body = lambda x: (lib.psum_scatter(x, "d", scatter_dimension=1, tiled=True), lib.psum(x, "d"))  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P())))

    rng = np.random.default_rng(3)
    x = rng.standard_normal((8 * 3, 8 * 40)) * np.exp(rng.uniform(-10, 10, (8 * 3, 8 * 40)))
    x = (x * 1000).astype(np.int32) if dtype == np.int32 else jnp.asarray(x, dtype)
    with comm:
        _equal(rs(jaxccl), rs(jax.lax), (x,))
