"""Transpose and batching rules: jax.grad and jax.vmap through jaxccl collectives equal jax.lax's, bitwise."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl

N = 4
BACKENDS = ("cpu", "ppermute")


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:N]), ("d",))


def _grad_of(collective):
    """d/dv of sum(sin(collective(v)) * w), a scalar loss per device."""

    def loss(v):
        y = collective(v)
        w = jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) / y.size
        return jnp.sum(jnp.sin(y) * w)

    return jax.grad(loss)


def _grad_cases(lib):
    return {
        "all_gather": _grad_of(lambda v: lib.all_gather(v, "d", axis=1, tiled=True)),
        "all_gather stacked": _grad_of(lambda v: lib.all_gather(v, "d", axis=0)),
        "all_to_all": _grad_of(lambda v: lib.all_to_all(v, "d", 1, 0, tiled=True)),
        "psum_scatter": _grad_of(lambda v: lib.psum_scatter(v, "d", scatter_dimension=1, tiled=True)),
        "psum": _grad_of(lambda v: lib.psum(v, "d")),
    }


def _vmap_cases(lib):
    return {
        "all_gather": jax.vmap(lambda v: lib.all_gather(v, "d", axis=1, tiled=True), in_axes=1),
        "all_gather stacked": jax.vmap(lambda v: lib.all_gather(v, "d", axis=0), in_axes=2, out_axes=1),
        "all_to_all": jax.vmap(lambda v: lib.all_to_all(v, "d", 0, 1, tiled=True), in_axes=2),
        "all_to_all untiled": jax.vmap(lambda v: lib.all_to_all(v[:, :N], "d", 1, 0), in_axes=0),
        "psum_scatter": jax.vmap(lambda v: lib.psum_scatter(v, "d", scatter_dimension=1, tiled=True), in_axes=2),
        "psum": jax.vmap(lambda v: lib.psum(v, "d"), in_axes=1),
    }


@functools.cache
def _program(kind: str, lib_name: str, check_vma: bool):
    lib = jaxccl if lib_name == "jaxccl" else jax.lax
    cases = _grad_cases(lib) if kind == "grad" else _vmap_cases(lib)
    if not check_vma:  # the transposes that differ between the two vma modes
        cases = {k: v for k, v in cases.items() if k in ("all_gather", "psum")}

    def body(x):
        return {k: f(x) for k, f in cases.items()}

    out_specs = {k: P() if (kind == "vmap" and k == "psum") else P("d") for k in cases}
    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=out_specs, check_vma=check_vma))


def _x(seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((4 * N, 8, 8)).astype(dtype)


def _check(kind: str, backend: str, check_vma: bool = True, dtype=np.float32) -> None:
    x = _x(3, dtype)
    with jaxccl.Communicator(_mesh(), "d", backend=backend):
        got = _program(kind, "jaxccl", check_vma)(x)
    want = _program(kind, "lax", check_vma)(x)
    assert set(got) == set(want)
    bad = [k for k in want if np.asarray(got[k]).tobytes() != np.asarray(want[k]).tobytes()]
    shapes = {k: (np.shape(got[k]), np.shape(want[k])) for k in bad}
    assert bad == [], shapes


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_equals_lax(backend):
    _check("grad", backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_equals_lax(backend):
    _check("vmap", backend)


def test_grad_equals_lax_without_vma_checks():
    # check_vma=False: lax transposes psum to psum (not to a pcast); all_gather still to psum_scatter.
    _check("grad", "cpu", check_vma=False)


def test_grad_bf16():
    _check("grad", "cpu", dtype=jnp.bfloat16)


def test_jaxpr_types_match_lax():
    """Under check_vma=True the output types (shape, dtype, varying axes) are lax's."""
    mesh = _mesh()

    def types(lib):
        def body(v):
            outs = [
                lib.all_gather(v, "d", axis=1, tiled=True),
                lib.all_to_all(v, "d", 1, 0, tiled=True),
                lib.psum_scatter(v, "d", scatter_dimension=1, tiled=True),
                lib.psum(v, "d"),
                lib.psum(jnp.ones(3), "d"),  # an invariant operand
            ]
            return [str(jax.typeof(o)) for o in outs]

        seen = []

        def capture(v):
            seen.extend(body(v))
            return v

        jax.eval_shape(jax.shard_map(capture, mesh=mesh, in_specs=P("d"), out_specs=P("d")), _x(0))
        return seen

    assert types(jaxccl) == types(jax.lax)
