"""The ppermute backend inside a larger program: a collective's consumer sees the bits it sees on jax.lax.

On the ppermute backend a collective is ordinary XLA operations, and without
a fusion barrier XLA:CPU fused the tail of the schedule (``finish``'s select,
a schedule's last reduce step, the ``dynamic_update_slice`` into the output
buffer, the reshape back) into the fusion of the consumer. XLA:CPU emits a
``reduce``'s accumulation as ``fadd reassoc``, so LLVM may reorder it, and
with the extra operations in the loop body it did: the consumer's sum was
vectorized (8 lanes, two accumulators, then a tree) where the same consumer
of a ``jax.lax`` collective is a sequential fold with FMAs. These are the
smallest programs that showed it (each collective alone was bitwise equal);
the first was the first tensor to differ in ``examples/transformer.py``'s
step, the backward pass of an RMS norm after the ``psum`` over ``model``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl

AXES = ("data", "model", ("data", "model"))


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def _data(shape, seed: int) -> np.ndarray:
    """Normal values scaled over eight decades (never zero): any change of summation order shows in the bits."""
    rng = np.random.default_rng(seed)
    scale = np.logspace(-4, 4, int(np.prod(shape))).reshape(shape)
    return (rng.standard_normal(shape) * rng.permutation(scale.ravel()).reshape(shape)).astype(np.float32)


def _assert_bitwise_equal_to_lax(body, in_specs, out_specs, *args) -> None:
    mesh = _mesh()
    step = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    comms = [jaxccl.Communicator(mesh, axes, backend="ppermute") for axes in AXES]
    want = np.asarray(jax.jit(step)(*args))
    got = np.asarray(jax.jit(jaxccl.offload(step, comm=comms))(*args))
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.tobytes() == want.tobytes(), f"{np.count_nonzero(got != want)} of {got.size} elements differ"


def _size(axis) -> int:
    return int(np.prod([dict(data=2, model=4)[a] for a in ((axis,) if isinstance(axis, str) else axis)]))


@pytest.mark.parametrize("axis", AXES, ids=str)
def test_psum_into_the_backward_pass_of_a_norm(axis):
    """``rms``'s backward pass after a tensor-parallel layer: a row sum of ``x * (psum(g) * scale)``."""

    def body(x, g, scale):
        return jnp.sum(x * (lax.psum(g[0], axis) * scale), axis=-1)

    n = _size(axis)
    x, g, scale = _data((4, 16, 32), 0), _data((n, 4, 16, 32), 1), _data((32,), 2)
    _assert_bitwise_equal_to_lax(body, (P(), P(axis), P()), P(), x, g, scale)


@pytest.mark.parametrize("axis", AXES, ids=str)
def test_psum_scatter_into_a_sum_of_squares(axis):
    """FSDP: the gradient shard (``psum_scatter``) and its squared norm, as the step's gradient clipping."""

    def body(g):
        shard = lax.psum_scatter(g, axis, scatter_dimension=0, tiled=True)
        return jnp.stack([jnp.sum(shard * shard), jnp.sum(shard / 2.0)])[None]

    _assert_bitwise_equal_to_lax(body, (P(),), P(axis), _data((64, 32), 3))


@pytest.mark.parametrize("axis", AXES, ids=str)
def test_psum_scatter_into_a_row_reduction(axis):
    def body(x, scale):
        n = _size(axis)
        shard = lax.psum_scatter(x, axis, scatter_dimension=2, tiled=True)
        return jnp.sum(x[:, :, : 32 // n] * (shard * scale[: 32 // n]), axis=-1)[None]

    _assert_bitwise_equal_to_lax(body, (P(), P()), P(axis), _data((4, 16, 32), 4), _data((32,), 5))


@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather_into_an_activation_and_a_row_reduction(axis, dim):
    """A gathered weight through a GELU into a row sum (a non-reducing collective's consumer)."""

    def body(x, w):
        return jnp.sum(jax.nn.gelu(lax.all_gather(w, axis, axis=dim, tiled=True)) * x, axis=-1)[None]

    spec = (axis, None) if dim == 0 else (None, axis)
    x = _data((16, 32), 6)
    _assert_bitwise_equal_to_lax(body, (P(), P(*spec)), P(axis), x, x * 0.5)
