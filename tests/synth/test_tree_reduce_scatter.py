"""The ReduceScatter in gloo's tree order (``jaxccl.synth.tree_reduce_scatter``): proofs, routing, bits."""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl
from jaxccl.errors import ScheduleError, SynthesisError, TopologyError
from jaxccl.runtime.default_schedules import direct_allreduce, gloo_tree_reduce_scatter
from jaxccl.schedule.reduction import gloo_tree
from jaxccl.synth.ordered_reduce_scatter import ordered_reduce_scatter
from jaxccl.synth.tree_reduce_scatter import predicted_algbw, tree_reduce_scatter
from jaxccl.topology import rail, single_node

TOPO = rail(hosts=2, gpus_per_host=4)
NIC = (0, "tor:s0r0")
SLOW = TOPO.degrade(*NIC, capacity=0.3 * TOPO.capacity(*NIC))  # both directions


# ------------------------------------------------------------------------------------------- the proof
@pytest.mark.parametrize(
    "topo",
    [
        TOPO,
        SLOW,
        rail(hosts=4, gpus_per_host=2),
        rail(hosts=2, gpus_per_host=3),  # 6 ranks: gloo's blocks 4 + 2
        rail(hosts=3, gpus_per_host=4),
        single_node(2),
        rail(hosts=2, gpus_per_host=8),
    ],
    ids=lambda t: t.name,
)
def test_sums_in_gloos_tree_order(topo):
    s = tree_reduce_scatter(topo)
    s.validate()  # the interpreter proves gloo's tree term for every output chunk
    assert s.collective.value == "reduce_scatter" and s.num_ranks == topo.num_gpus
    assert s.info["fold"] == "gloo_tree" and s.info["algorithm"] == "tree_fold"
    assert not s.info["ordered_reduction"]
    assert s.algbw == pytest.approx(predicted_algbw(s, topo))
    assert {(u, v): k for u, v, k in s.info["chunk_loads"]}  # every link it loads, with its chunks per period


def test_32_ranks_synthesize_fast():
    topo = rail(hosts=4, gpus_per_host=8)
    t0 = time.perf_counter()
    s = tree_reduce_scatter(topo)  # validated inside
    assert time.perf_counter() - t0 < 2.0
    assert s.num_ranks == 32 and s.info["fold"] == "gloo_tree"
    # the butterfly's placement keeps the NICs busy less than the direct tree does
    assert s.algbw > 2 * predicted_algbw(gloo_tree_reduce_scatter(32), topo)


def test_the_interpreter_rejects_another_order():
    for topo in (rail(hosts=2, gpus_per_host=2), rail(hosts=2, gpus_per_host=3), TOPO):
        s = ordered_reduce_scatter(topo)  # ((x0 + x1) + x2) + x3 ...: not gloo's tree from 4 ranks on
        claims = dataclasses.replace(s, info={**s.info, "fold": "gloo_tree"})
        with pytest.raises(ScheduleError, match="does not sum in gloo's tree order"):
            claims.validate()
    s = ordered_reduce_scatter(rail(hosts=3, gpus_per_host=1))  # 3 ranks: gloo sums (x0 + x1) + x2 too
    dataclasses.replace(s, info={**s.info, "fold": "gloo_tree"}).validate()
    for n in range(1, 18):
        gloo_tree_reduce_scatter(n).validate()  # the default schedule across processes: the same tree
    assert gloo_tree(5) == (((0, 1), (2, 3)), 4)
    assert direct_allreduce(4).validate()  # claims no gloo fold: only the ascending one is checked


# ------------------------------------------------------------------------------------------- the routing
def test_routes_around_a_degraded_nic():
    healthy, rerouted = tree_reduce_scatter(TOPO), tree_reduce_scatter(SLOW)
    assert rerouted.algbw == pytest.approx(predicted_algbw(rerouted, SLOW))
    assert rerouted.algbw > 2 * predicted_algbw(healthy, SLOW)
    assert rerouted.algbw > 5 * predicted_algbw(gloo_tree_reduce_scatter(8), SLOW)
    # healthy: every NIC carries one chunk per block each way, a quarter of the direct tree's four
    assert healthy.algbw == pytest.approx(4 * predicted_algbw(gloo_tree_reduce_scatter(8), TOPO))
    loads = {(u, v): k / rerouted.chunks_per_period for u, v, k in rerouted.info["chunk_loads"]}
    assert loads.get(NIC, 0) < 0.5 * loads[(1, "tor:s0r1")]  # the degraded NIC sends less than a healthy one


def test_bad_input():
    with pytest.raises(SynthesisError, match="max_chunks"):
        tree_reduce_scatter(TOPO, max_chunks=0)
    with pytest.raises(SynthesisError, match="max_chunks"):
        tree_reduce_scatter(TOPO, max_chunks=True)
    with pytest.raises(TopologyError, match="at least 2 GPUs"):
        tree_reduce_scatter(single_node(1))


# ------------------------------------------------------------------------------------------- the bits
def _tree_sum(blocks: np.ndarray) -> np.ndarray:
    """``blocks[s]`` (rank s's terms) summed along gloo's tree, one rounding per addition in their dtype."""

    def term(t):
        return blocks[t] if isinstance(t, int) else term(t[0]) + term(t[1])

    return term(gloo_tree(len(blocks)))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_bitwise_equal_to_a_gloo_tree_fold_on_the_executor(dtype):
    n = 8
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    comm = jaxccl.Communicator(mesh, "d", topology=TOPO, backend="cpu")
    f = jax.jit(
        jax.shard_map(
            lambda x: jaxccl.psum_scatter(x, "d", scatter_dimension=1, tiled=True),
            mesh=mesh,
            in_specs=P("d"),
            out_specs=P("d"),
        )
    )
    rng = np.random.default_rng(7)
    rows, cols = 3, 40
    x = rng.standard_normal((n * rows, n * cols)) * np.exp(rng.uniform(-8, 8, (n * rows, n * cols)))
    x = np.asarray(jnp.asarray(x, dtype))
    assert np.all(x != 0)
    # blocks[s, b]: rank s's rows, the columns of block b; bfloat16 is reduced in float32, rounded once
    blocks = x.astype(np.float32).reshape(n, rows, n, cols).transpose(0, 2, 1, 3)
    want = np.concatenate([_tree_sum(blocks[:, b]) for b in range(n)])
    ascending = np.concatenate([functools.reduce(np.add, blocks[:, b]) for b in range(n)])
    assert not np.array_equal(want, ascending)  # the order shows in float32 (bfloat16's rounding may hide it)
    want, ascending = want.astype(dtype), ascending.astype(dtype)
    with comm:
        for schedule in (tree_reduce_scatter(TOPO), tree_reduce_scatter(SLOW), gloo_tree_reduce_scatter(n)):
            comm.install("reduce_scatter", schedule)
            got = np.asarray(f(x))
            assert got.dtype == want.dtype
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), schedule.name
    comm.install("reduce_scatter", ordered_reduce_scatter(TOPO))
    with comm:
        assert np.array_equal(np.asarray(f(x)).view(np.uint8), ascending.view(np.uint8))  # and jax.lax's order
