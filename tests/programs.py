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
