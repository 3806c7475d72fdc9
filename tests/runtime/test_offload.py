"""jaxccl.offload: an unmodified jax.lax program runs its collectives through jaxccl, bitwise equal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl

MESH = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
SPEC = P(("data", "model"))
LAX_COLLECTIVES = {"psum", "psum_invariant", "all_gather", "all_gather_invariant", "reduce_scatter", "all_to_all"}


def _data(shape, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return (rng.standard_normal(shape) * np.logspace(-3, 3, int(np.prod(shape))).reshape(shape)).astype(dtype)


def _names(jaxpr) -> list[str]:
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _names(getattr(sub, "jaxpr", sub))
    return out


def _assert_bitwise(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _nested(v):
    """Collectives at every nesting level offload rewrites: jit, checkpoint, cond, scan, while, custom_jvp."""
    a = lax.psum(v, ("data", "model"))
    b = jax.checkpoint(lambda z: lax.all_gather(jnp.sin(z), "model", tiled=True))(v)
    uniform = lax.psum(v[0], ("data", "model")) > 0  # a predicate every device agrees on
    c = lax.cond(uniform, lambda z: lax.psum_scatter(z, "data", tiled=True), lambda z: -z[: z.shape[0] // 2], v)
    zero = lax.pcast(jnp.zeros((), v.dtype), ("data",), to="varying")
    d = lax.scan(lambda carry, z: (carry + lax.psum(z, "model"), carry * z), zero, v)[1]
    e = jax.jit(lambda z: lax.all_to_all(z.reshape(4, -1), "model", 0, 1, tiled=True))(v)
    f = lax.pmean(v, "data")
    g = _clipped_sum(v)
    h = _doubled_gather(v)
    w = lax.while_loop(lambda s: s[1] < 3, lambda s: (lax.all_gather(s[0], "data", tiled=True)[8:24], s[1] + 1), (v, 0))
    return {"a": a, "b": b, "c": c, "d": d, "e": e, "f": f, "g": g, "h": h, "w": w[0]}


@jax.custom_jvp
def _clipped_sum(v):
    return lax.psum(jnp.clip(v, -1.0, 1.0), "model")


@_clipped_sum.defjvp
def _clipped_sum_jvp(primals, tangents):
    return _clipped_sum(*primals), lax.psum(tangents[0], "model")


@jax.custom_vjp
def _doubled_gather(v):
    return lax.all_gather(v, "model", tiled=True) * 2


def _doubled_gather_fwd(v):
    return _doubled_gather(v), None


def _doubled_gather_bwd(_, ct):
    return (lax.psum_scatter(ct, "model", tiled=True) * 2,)


_doubled_gather.defvjp(_doubled_gather_fwd, _doubled_gather_bwd)


def _nested_program():
    out_specs = {k: SPEC for k in "bcdeghw"} | {"a": P(), "f": P("model")}
    return jax.shard_map(_nested, mesh=MESH, in_specs=SPEC, out_specs=out_specs)


@pytest.mark.parametrize("backend", ["cpu", "ppermute"])
def test_nested_program_bitwise_equal_and_fully_swapped(backend):
    step = _nested_program()
    x = _data((8 * 16,), seed=1)
    comms = [jaxccl.Communicator(MESH, a, backend=backend) for a in ("data", "model", ("data", "model"))]
    want = jax.jit(step)(x)
    got = jax.jit(jaxccl.offload(step, comm=comms))(x)
    _assert_bitwise(got, want)
    names = _names(jax.make_jaxpr(jaxccl.offload(step))(x).jaxpr)
    assert not set(names) & LAX_COLLECTIVES
    assert {"jaxccl_psum", "jaxccl_all_gather", "jaxccl_reduce_scatter", "jaxccl_all_to_all"} <= set(names)


def test_grad_through_offload_and_offload_of_grad():
    step = _nested_program()

    def loss(x):
        out = step(x)
        return sum(jnp.sum(jnp.sin(v)) for k, v in out.items() if k not in ("w",))

    x = _data((8 * 16,), seed=2)
    want = jax.jit(jax.value_and_grad(loss))(x)
    _assert_bitwise(jax.jit(jaxccl.offload(jax.value_and_grad(loss)))(x), want)

    def loss_of_offloaded(x):
        out = jaxccl.offload(step)(x)
        return sum(jnp.sum(jnp.sin(v)) for k, v in out.items() if k not in ("w",))

    _assert_bitwise(jax.jit(jax.value_and_grad(loss_of_offloaded))(x), want)


def test_check_vma_false_groups_and_vmap():
    def body(v):
        return {
            "psum groups": lax.psum(v, "model", axis_index_groups=((0, 2), (1, 3))),
            "gather groups": lax.all_gather(v, "model", axis_index_groups=((3, 0), (1, 2))),
            "vmapped scatter": jax.vmap(lambda u: lax.psum_scatter(u, ("model", "data"), tiled=True))(v),
            "invariant gather": lax.all_gather(v, ("model", "data"), to="invarying"),
        }

    step = jax.shard_map(body, mesh=MESH, in_specs=SPEC, out_specs=SPEC, check_vma=False)
    x = _data((8 * 8, 16), seed=3)
    _assert_bitwise(jax.jit(jaxccl.offload(step))(x), jax.jit(step)(x))


def test_keyword_arguments_are_static_and_pytrees_pass_through():
    def step(tree, *, scale):
        f = jax.shard_map(
            lambda t: jax.tree.map(lambda v: lax.psum(v * scale, "data"), t),
            mesh=MESH,
            in_specs=({"x": SPEC, "i": SPEC},),
            out_specs={"x": P("model"), "i": P("model")},
        )
        return f(tree)

    tree = {"x": _data((8 * 4,), seed=4), "i": _data((8 * 4,), seed=5, dtype=np.int32)}
    want = step(tree, scale=3)
    got = jaxccl.offload(step)(tree, scale=3)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    _assert_bitwise(got, want)


def test_programs_without_collectives_are_unchanged():
    def f(x):
        return jax.nn.softmax(jnp.cumsum(x) * 2.0)

    x = _data((16,), seed=6)
    assert str(jax.make_jaxpr(jaxccl.offload(f))(x)) == str(jax.make_jaxpr(f)(x))
    _assert_bitwise(jaxccl.offload(f)(x), f(x))


def test_reductions_jaxccl_lacks_stay_with_jax_lax():
    step = jax.shard_map(lambda v: lax.pmax(v, "model"), mesh=MESH, in_specs=SPEC, out_specs=P("data"))
    x = _data((8 * 4,), seed=7)
    names = _names(jax.make_jaxpr(jaxccl.offload(step))(x).jaxpr)
    assert ("jaxccl_pmax" in names) == hasattr(jaxccl, "pmax")
    _assert_bitwise(jax.jit(jaxccl.offload(step))(x), jax.jit(step)(x))


def test_refusals_keep_jaxccls_error():
    step = jax.shard_map(lambda v: lax.psum(v, "model"), mesh=MESH, in_specs=SPEC, out_specs=P("data"), check_vma=False)
    x = _data((8 * 4,), seed=8).astype(jnp.float8_e4m3fn)  # lax sums float8, jaxccl refuses it
    with pytest.raises(TypeError, match="jaxccl.psum: dtype float8_e4m3fn"):
        jax.make_jaxpr(jaxccl.offload(step))(x)


def test_communicators_given_to_offload_are_the_ones_used():
    step = jax.shard_map(lambda v: lax.all_gather(v, "data", tiled=True), mesh=MESH, in_specs=SPEC, out_specs=SPEC)
    comm = jaxccl.Communicator(MESH, "data", backend="ppermute")
    jaxpr = jax.make_jaxpr(jaxccl.offload(step, comm=comm))(_data((8 * 4,), seed=9))
    (gather,) = [e for e in jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "jaxccl_all_gather"]
    assert gather.params["comm"].uid == comm.uid
