"""The collectives users call inside ``jax.shard_map``: same signatures and semantics as ``jax.lax``.

Each function maps over the leaves of a pytree, checks its arguments (axis
name in scope, shapes, dtype), makes the operand device-varying over the
axis (as ``lax`` does, so ``check_vma=True`` type-checks), resolves the
:class:`~jaxccl.runtime.communicator.Communicator` in scope for the axis (or
the default one) and binds the primitive of :mod:`jaxccl.runtime.primitives`.

Which communicator runs a call is decided when it is traced: the innermost
``with comm:`` whose ``comm`` serves ``axis_name``, else the default
communicator of ``(axis_name, axis size)``
(:func:`jaxccl.runtime.communicator.default_communicator`: baseline
schedules, no topology, backend chosen at lowering).

Supported: one named mesh axis of ``jax.shard_map`` (a 1-tuple is accepted),
any whole-byte dtype for ``all_gather``/``all_to_all``; ``psum``/``psum_scatter``/
``pmean`` on every integer, float (float16, bfloat16, float32, float64) and
complex dtype (``psum``/``pmean`` also on bool, summed as int32 as ``lax``
does), ``pmax``/``pmin`` on integers, floats and bool, each bitwise equal to
``jax.lax`` on CPU with rank-ordered schedules (the rule:
:mod:`jaxccl.schedule.reduction`); others raise ``TypeError``. Not supported (clear
``NotImplementedError``): ``axis_index_groups``, several axes at once, axes of
``vmap``/``pmap``, ``all_gather(..., to=...)`` other than ``"varying"``.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxccl.runtime import communicator as _comm
from jaxccl.runtime import primitives as _p
from jaxccl.schedule.reduction import ReduceOp, supports

__all__ = ["all_gather", "all_to_all", "pmax", "pmean", "pmin", "psum", "psum_scatter"]

_SUB_BYTE = frozenset({"int2", "uint2", "int4", "uint4", "float4_e2m1fn"})


def _unsupported(fn: str, **options: Any) -> None:
    for name, value in options.items():
        if value is not None:
            raise NotImplementedError(f"jaxccl.{fn}: {name}={value!r} is not supported (only None)")


def _axes_in_scope() -> tuple[list[Hashable], frozenset, dict]:
    from jax.extend.core import unsafe_get_axis_names_DO_NOT_USE

    names = list(unsafe_get_axis_names_DO_NOT_USE())
    mesh = jax.sharding.get_abstract_mesh()
    manual = frozenset(getattr(mesh, "manual_axes", ())) if not mesh.empty else frozenset()
    shape = dict(mesh.shape) if not mesh.empty else {}
    return names, manual, shape


def _axis(fn: str, axis_name: Any) -> tuple[Hashable, int]:
    """The single manual mesh axis named by ``axis_name`` and its size."""
    if isinstance(axis_name, (tuple, list)):
        if len(axis_name) != 1:
            raise NotImplementedError(
                f"jaxccl.{fn}: collectives over several axes at once ({tuple(axis_name)}) are not supported; "
                "pass one mesh axis name"
            )
        axis_name = axis_name[0]
    names, manual, shape = _axes_in_scope()
    if axis_name not in names:
        where = f"axes in scope: {tuple(names)}" if names else "no named axes are in scope"
        raise NameError(
            f"jaxccl.{fn}: unbound axis name {axis_name!r} ({where}); call it inside jax.shard_map over a "
            "mesh with that axis"
        )
    if axis_name not in manual:
        raise NotImplementedError(
            f"jaxccl.{fn}: axis {axis_name!r} is not a manual axis of jax.shard_map (vmap/pmap axes are not "
            f"supported); manual mesh axes in scope: {tuple(sorted(manual, key=str))}"
        )
    return axis_name, int(shape[axis_name])


def _canon(fn: str, what: str, value: Any, ndim: int) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"jaxccl.{fn}: {what} must be an int, got {value!r}") from None
    if not -ndim <= v < ndim:
        raise ValueError(f"jaxccl.{fn}: {what}={value} is out of range for an operand with {ndim} dimension(s)")
    return v % ndim


def _check_dtype(fn: str, dtype: Any, *, reduction: bool, op: ReduceOp = ReduceOp.SUM) -> None:
    dt = np.dtype(dtype)
    if reduction and not supports(op, dt):
        what = {
            ReduceOp.SUM: "integer, floating (16-64 bit) and complex dtypes",
            ReduceOp.MAX: "integer, floating (16-64 bit) and bool dtypes",
            ReduceOp.MIN: "integer, floating (16-64 bit) and bool dtypes",
        }[op]
        raise TypeError(f"jaxccl.{fn}: dtype {dt.name} is not supported for reductions; supported: {what}")
    if not reduction and (dt.kind not in "biufcV" or dt.name in _SUB_BYTE):
        raise TypeError(f"jaxccl.{fn}: dtype {dt.name} is not supported (sub-byte and object dtypes cannot be moved)")


def _varying(x: jax.Array, axis_name: Hashable) -> jax.Array:
    """``x`` made device-varying over ``axis_name`` (no-op when it already is or check_vma=False)."""
    if axis_name in jax.typeof(x).mat.varying:
        return x
    return lax.pcast(x, (axis_name,), to="varying")


def _prepare(fn: str, x: Any, axis_name: Any, *, reduction: bool, op: ReduceOp = ReduceOp.SUM):
    name, n = _axis(fn, axis_name)
    x = jnp.asarray(x)
    _check_dtype(fn, x.dtype, reduction=reduction, op=op)
    comm = _comm.resolve(name, n)
    return _varying(x, name), name, n, comm.ref


def all_gather(
    x: Any,
    axis_name: Hashable,
    *,
    axis: int = 0,
    tiled: bool = False,
    axis_index_groups: Any = None,
    to: str = "varying",
) -> Any:
    """Gathers ``x`` from every device of mesh axis ``axis_name``; as :func:`jax.lax.all_gather`.

    Runs on the communicator in scope for ``axis_name`` (``with comm:``), else on
    the axis's default one (:func:`~jaxccl.runtime.communicator.default_communicator`).

    Args:
        x: array or pytree of arrays (per-device values inside ``jax.shard_map``).
        axis_name: the mesh axis.
        axis: where the gathered blocks go: a new axis at ``axis`` (``tiled=False``)
            or concatenated along existing axis ``axis`` (``tiled=True``).
        tiled: see ``axis``.
        axis_index_groups: not supported (must be ``None``).
        to: only ``"varying"`` (the ``lax`` default) is supported.

    Returns:
        Shape of ``x`` with ``axis_size`` inserted at ``axis`` (or ``x.shape[axis]``
        multiplied by it), bitwise equal to ``jax.lax.all_gather``.

    Example:
        >>> import jax, numpy as np, jaxccl
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
        >>> f = jax.jit(jax.shard_map(lambda x: jaxccl.all_gather(x, "i", tiled=True),
        ...                           mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        >>> f(np.arange(4.0, dtype=np.float32)).tolist()  # both devices hold [0, 1, 2, 3]
        [0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0]
    """
    _unsupported("all_gather", axis_index_groups=axis_index_groups)
    if to != "varying":
        raise NotImplementedError(f"jaxccl.all_gather: to={to!r} is not supported (only 'varying')")

    def bind(leaf):
        leaf, name, n, comm = _prepare("all_gather", leaf, axis_name, reduction=False)
        ax = _canon("all_gather", "axis", axis, leaf.ndim if tiled else leaf.ndim + 1)
        return _p.all_gather_p.bind(
            leaf, axis_name=name, axis=ax, tiled=bool(tiled), axis_size=n, comm=comm, site=_p.new_site()
        )

    return jax.tree.map(bind, x)


def all_to_all(
    x: Any,
    axis_name: Hashable,
    split_axis: int,
    concat_axis: int,
    *,
    tiled: bool = False,
    axis_index_groups: Any = None,
) -> Any:
    """Sends block ``d`` of ``x`` along ``split_axis`` to device ``d``; as :func:`jax.lax.all_to_all`.

    Runs on the communicator in scope for ``axis_name`` (``with comm:``), else on
    the axis's default one (:func:`~jaxccl.runtime.communicator.default_communicator`).

    Blocks received from device ``s`` are placed at position ``s`` along
    ``concat_axis``. With ``tiled=False`` the size of ``split_axis`` must equal
    the axis size; that axis is removed and a new one of the axis size is
    inserted at ``concat_axis``.

    Raises:
        ValueError: ``x.shape[split_axis]`` does not split over the axis size.

    Example:
        >>> import jax, numpy as np, jaxccl
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
        >>> f = jax.jit(jax.shard_map(lambda x: jaxccl.all_to_all(x, "i", 0, 0, tiled=True),
        ...                           mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        >>> f(np.arange(4, dtype=np.int32)).tolist()
        [0, 2, 1, 3]
    """
    _unsupported("all_to_all", axis_index_groups=axis_index_groups)

    def bind(leaf):
        leaf, name, n, comm = _prepare("all_to_all", leaf, axis_name, reduction=False)
        nd = leaf.ndim
        sa = _canon("all_to_all", "split_axis", split_axis, nd)
        ca = _canon("all_to_all", "concat_axis", concat_axis, nd)
        if tiled:
            if leaf.shape[sa] % n:
                raise ValueError(
                    f"jaxccl.all_to_all: split_axis {sa} has size {leaf.shape[sa]}, which is not divisible by "
                    f"the size {n} of axis {name!r}"
                )
        else:
            if leaf.shape[sa] != n:
                raise ValueError(
                    f"jaxccl.all_to_all: with tiled=False the size of split_axis {sa} ({leaf.shape[sa]}) must equal "
                    f"the size {n} of axis {name!r}"
                )
            if sa < ca:
                ca += 1
                leaf = lax.expand_dims(leaf, (ca,))
            elif sa > ca:
                leaf = lax.expand_dims(leaf, (ca,))
                sa += 1
        out = _p.all_to_all_p.bind(
            leaf, axis_name=name, split_axis=sa, concat_axis=ca, axis_size=n, comm=comm, site=_p.new_site()
        )
        if not tiled and sa != ca:
            out = lax.squeeze(out, (sa,))
        return out

    return jax.tree.map(bind, x)


def psum_scatter(
    x: Any,
    axis_name: Hashable,
    *,
    scatter_dimension: int = 0,
    tiled: bool = False,
    axis_index_groups: Any = None,
) -> Any:
    """Sums ``x`` over mesh axis ``axis_name`` and scatters the result; as :func:`jax.lax.psum_scatter`.

    Runs on the communicator in scope for ``axis_name`` (``with comm:``), else on
    the axis's default one (:func:`~jaxccl.runtime.communicator.default_communicator`).

    Device ``r`` receives block ``r`` of the sum along ``scatter_dimension``
    (``tiled=True``: that dimension shrinks by the axis size; ``tiled=False``:
    its size must equal the axis size and it is removed). With the default
    (rank-ordered) schedule the sum is bitwise equal to ``jax.lax``'s.

    Raises:
        ValueError: the scatter dimension does not split over the axis size.
        TypeError: a dtype that ``lax.psum_scatter`` does not sum either (bool, float8, sub-byte).

    Example:
        >>> import jax, numpy as np, jaxccl
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
        >>> f = jax.jit(jax.shard_map(lambda x: jaxccl.psum_scatter(x, "i", tiled=True),
        ...                           mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        >>> f(np.arange(4.0, dtype=np.float32)).tolist()
        [2.0, 4.0]
    """
    _unsupported("psum_scatter", axis_index_groups=axis_index_groups)

    def bind(leaf):
        leaf, name, n, comm = _prepare("psum_scatter", leaf, axis_name, reduction=True)
        d = _canon("psum_scatter", "scatter_dimension", scatter_dimension, leaf.ndim)
        size = leaf.shape[d]
        if tiled and size % n:
            raise ValueError(
                f"jaxccl.psum_scatter: scatter_dimension {d} has size {size}, which is not divisible by the size "
                f"{n} of axis {name!r}"
            )
        if not tiled and size != n:
            raise ValueError(
                f"jaxccl.psum_scatter: with tiled=False the size of scatter_dimension {d} ({size}) must equal the "
                f"size {n} of axis {name!r}"
            )
        return _p.reduce_scatter_p.bind(
            leaf, axis_name=name, scatter_dimension=d, tiled=bool(tiled), axis_size=n, comm=comm, site=_p.new_site()
        )

    return jax.tree.map(bind, x)


def psum(x: Any, axis_name: Hashable, *, axis_index_groups: Any = None) -> Any:
    """All-reduce sum of ``x`` over mesh axis ``axis_name``; as :func:`jax.lax.psum`.

    Runs on the communicator in scope for ``axis_name`` (``with comm:``), else on
    the axis's default one (:func:`~jaxccl.runtime.communicator.default_communicator`).

    Runs the communicator's ``all_reduce`` schedule when one is installed
    (the default: rank-ordered), else ReduceScatter + AllGather (MCCL Sec. 3).
    The result is invariant over the axis (``check_vma=True`` types it as
    ``lax.psum``'s).

    Example:
        >>> import jax, numpy as np, jaxccl
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
        >>> f = jax.jit(jax.shard_map(lambda x: jaxccl.psum(x, "i"),
        ...                           mesh=mesh, in_specs=P("i"), out_specs=P()))
        >>> f(np.arange(4.0, dtype=np.float32)).tolist()
        [2.0, 4.0]
    """
    _unsupported("psum", axis_index_groups=axis_index_groups)

    def bind(leaf):
        leaf = jnp.asarray(leaf)
        if leaf.dtype == np.bool_:  # as lax.psum: bools are summed as int32
            leaf = leaf.astype(np.int32)
        leaf, name, n, comm = _prepare("psum", leaf, axis_name, reduction=True)
        return _p.psum_p.bind(leaf, axis_name=name, axis_size=n, comm=comm, site=_p.new_site())

    return jax.tree.map(bind, x)


def pmax(x: Any, axis_name: Hashable, *, axis_index_groups: Any = None) -> Any:
    """All-reduce max of ``x`` over mesh axis ``axis_name``; as :func:`jax.lax.pmax`.

    Runs the communicator's ``all_reduce`` (or ReduceScatter + AllGather)
    schedule with the max operator: the schedule that sums also takes the max.
    As XLA:CPU, NaN terms are skipped (all-NaN gives ``-inf``) and of equal
    terms the lowest rank's wins (``-0.0`` before ``+0.0``), bitwise equal to
    ``jax.lax.pmax`` with rank-ordered schedules. No differentiation rule (as
    ``lax.pmax``).

    Raises:
        TypeError: complex dtypes (no order) and others ``lax.pmax`` does not reduce.

    Example:
        >>> import jax, numpy as np, jaxccl
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
        >>> f = jax.jit(jax.shard_map(lambda x: jaxccl.pmax(x, "i"),
        ...                           mesh=mesh, in_specs=P("i"), out_specs=P()))
        >>> f(np.array([3, -1, 2, 5], np.int8)).tolist()
        [3, 5]
    """
    return _extremum("pmax", _p.pmax_p, ReduceOp.MAX, x, axis_name, axis_index_groups)


def pmin(x: Any, axis_name: Hashable, *, axis_index_groups: Any = None) -> Any:
    """All-reduce min of ``x`` over mesh axis ``axis_name``; as :func:`jax.lax.pmin`.

    As :func:`pmax` with the min operator (all-NaN gives ``+inf``).

    Example:
        >>> import jax, numpy as np, jaxccl
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
        >>> f = jax.jit(jax.shard_map(lambda x: jaxccl.pmin(x, "i"),
        ...                           mesh=mesh, in_specs=P("i"), out_specs=P()))
        >>> f(np.array([True, True, False, True])).tolist()
        [False, True]
    """
    return _extremum("pmin", _p.pmin_p, ReduceOp.MIN, x, axis_name, axis_index_groups)


def _extremum(fn: str, prim: Any, op: ReduceOp, x: Any, axis_name: Hashable, axis_index_groups: Any) -> Any:
    _unsupported(fn, axis_index_groups=axis_index_groups)

    def bind(leaf):
        leaf, name, n, comm = _prepare(fn, leaf, axis_name, reduction=True, op=op)
        return prim.bind(leaf, axis_name=name, axis_size=n, comm=comm, site=_p.new_site())

    return jax.tree.map(bind, x)


def pmean(x: Any, axis_name: Hashable, *, axis_index_groups: Any = None) -> Any:
    """All-reduce mean of ``x`` over mesh axis ``axis_name``; as :func:`jax.lax.pmean`.

    :func:`psum` divided by the axis size, exactly as ``lax.pmean`` computes it
    (integers and bools give floats).

    Example:
        >>> import jax, numpy as np, jaxccl
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
        >>> f = jax.jit(jax.shard_map(lambda x: jaxccl.pmean(x, "i"),
        ...                           mesh=mesh, in_specs=P("i"), out_specs=P()))
        >>> f(np.arange(4, dtype=np.int32)).tolist()
        [1.0, 2.0]
    """
    total = psum(x, axis_name, axis_index_groups=axis_index_groups)
    n = lax.axis_size(axis_name)
    return jax.tree.map(lambda v: v / n, total)
