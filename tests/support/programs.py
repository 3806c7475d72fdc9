"""Jitted shard_map programs shared by the executor-level tests (mesh axis ``"d"``)."""

import jax
from jax.sharding import PartitionSpec as P

import jaxccl


def sharded(mesh, fn):
    """``fn`` jitted under ``shard_map`` over axis ``"d"``, input and output sharded along it."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))


def all_gather_pair(mesh):
    """(jaxccl tiled AllGather, the ``jax.lax`` reference) over axis ``"d"``."""
    return (
        sharded(mesh, lambda x: jaxccl.all_gather(x, "d", tiled=True)),
        sharded(mesh, lambda x: jax.lax.all_gather(x, "d", tiled=True)),
    )


def collective(lib, name: str, x, *, axis: int = 0, tiled: bool = True, split: int = 0, concat: int = 0):
    """``name`` over axis ``"d"`` through ``lib`` (``jaxccl`` or ``jax.lax``: the same signatures).

    ``name`` is a collective of either spelling: ``all_gather``, ``all_to_all``, ``psum_scatter`` or
    ``reduce_scatter``, ``psum`` or ``all_reduce``; ``axis`` is the gather axis or the scatter dimension.
    """
    if name == "all_gather":
        return lib.all_gather(x, "d", axis=axis, tiled=tiled)
    if name == "all_to_all":
        return lib.all_to_all(x, "d", split, concat, tiled=tiled)
    if name in ("psum_scatter", "reduce_scatter"):
        return lib.psum_scatter(x, "d", scatter_dimension=axis, tiled=tiled)
    if name in ("psum", "all_reduce"):
        return lib.psum(x, "d")
    raise ValueError(f"unknown collective {name!r}")
