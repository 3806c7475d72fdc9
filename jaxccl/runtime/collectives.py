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

Axes. ``axis_name`` is one manual mesh axis of ``jax.shard_map`` or a tuple
of them (``psum(x, ("data", "fsdp"))``): the collective then runs over the
devices that share the other axes' coordinates, ranked as ``jax.lax`` ranks
them (the linear index along the named axes in the order given; see
:mod:`jaxccl.runtime.axes`); a communicator serves a tuple when it was built
for that tuple (``Communicator(mesh, ("data", "fsdp"))``).
``axis_index_groups`` are accepted wherever ``jax.lax`` accepts them inside
``shard_map`` (not for ``psum`` under ``check_vma=True``, nor with
``all_gather(..., to="invarying")``, where ``jax.lax`` refuses them too; nor
for ``pmax``/``pmin`` under ``check_vma=True``, where ``jax.lax`` types the
result as invariant although the groups' results differ); a
group of another size than the communicator in scope runs on a communicator of
the group's size with the same backend. As in ``jax.lax``, the reductions
(``psum``, ``pmax``, ``pmin``, ``pmean``) also take groups of different sizes
(``[[0, 1], [2, 3, 4, 5, 6, 7]]``): one collective per size, each device
keeping its group's result. ``all_gather(..., to="invarying")``
gives an axis-invariant result as ``jax.lax``'s.

Dtypes: any whole-byte dtype for ``all_gather``/``all_to_all``;
``psum``/``psum_scatter``/``pmean`` on every integer, float (float16,
bfloat16, float32, float64) and complex dtype (``psum``/``pmean`` also on
bool, summed as int32 as ``lax`` does), ``pmax``/``pmin`` on integers, floats
and bool, each bitwise equal to ``jax.lax`` on CPU with rank-ordered schedules
(the rule: :mod:`jaxccl.schedule.reduction`); others raise ``TypeError``. Not
supported (clear errors): axes of ``vmap``/``pmap`` (``NotImplementedError``),
``all_gather(..., to="reduced")`` (explicit-sharding reduced types).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxccl.errors import ArgumentError, UnboundAxisError, UnsupportedError, UnsupportedTypeError
from jaxccl.runtime import axes as _axes
from jaxccl.runtime import communicator as _comm
from jaxccl.runtime import primitives as _p
from jaxccl.schedule.reduction import ReduceOp, supports
from jaxccl.util.options import choose

__all__ = ["all_gather", "all_to_all", "pmax", "pmean", "pmin", "psum", "psum_scatter"]

_ALL_GATHER_TO = ("varying", "invarying", "reduced")
_SUB_BYTE = frozenset({"int2", "uint2", "int4", "uint4", "float4_e2m1fn"})


def _axes_in_scope() -> tuple[list[Hashable], frozenset, dict]:
    from jax.extend.core import unsafe_get_axis_names_DO_NOT_USE

    names = list(unsafe_get_axis_names_DO_NOT_USE())
    mesh = jax.sharding.get_abstract_mesh()
    manual = frozenset(getattr(mesh, "manual_axes", ())) if not mesh.empty else frozenset()
    shape = dict(mesh.shape) if not mesh.empty else {}
    return names, manual, shape


def _axis(fn: str, axis_name: Any) -> tuple[Any, int]:
    """The manual mesh axis, or tuple of axes, named by ``axis_name`` and how many devices it spans.

    A 1-tuple is the name itself; two or more names stay a tuple, in the
    caller's order (which is ``jax.lax``'s device order: the first name is
    the major one).
    """
    given = _axes.names(axis_name)
    if not given:
        raise ArgumentError(f"jaxccl.{fn}: axis_name is an empty tuple; name at least one mesh axis")
    if len(set(given)) != len(given):
        raise ArgumentError(f"jaxccl.{fn}: axis_name {tuple(given)} names an axis more than once")
    names, manual, shape = _axes_in_scope()
    for name in given:
        if name not in names:
            where = f"axes in scope: {tuple(names)}" if names else "no named axes are in scope"
            raise UnboundAxisError(
                f"jaxccl.{fn}: unbound axis name {name!r} ({where}); call it inside jax.shard_map over a "
                "mesh with that axis"
            )
        if name not in manual:
            raise UnsupportedError(
                f"jaxccl.{fn}: axis {name!r} is not a manual axis of jax.shard_map (vmap/pmap axes are not "
                f"supported); manual mesh axes in scope: {tuple(sorted(manual, key=str))}"
            )
    key = given[0] if len(given) == 1 else given
    return key, math.prod(int(shape[name]) for name in given)


def _canon(fn: str, what: str, value: Any, ndim: int) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise UnsupportedTypeError(f"jaxccl.{fn}: {what} must be an int, got {value!r}") from None
    if not -ndim <= v < ndim:
        raise ArgumentError(f"jaxccl.{fn}: {what}={value} is out of range for an operand with {ndim} dimension(s)")
    return v % ndim


def _check_dtype(fn: str, dtype: Any, *, reduction: bool, op: ReduceOp = ReduceOp.SUM) -> None:
    dt = np.dtype(dtype)
    if reduction and not supports(op, dt):
        what = {
            ReduceOp.SUM: "integer, floating (16-64 bit) and complex dtypes",
            ReduceOp.MAX: "integer, floating (16-64 bit) and bool dtypes",
            ReduceOp.MIN: "integer, floating (16-64 bit) and bool dtypes",
        }[op]
        raise UnsupportedTypeError(f"jaxccl.{fn}: dtype {dt.name} is not supported for reductions; supported: {what}")
    if not reduction and (dt.kind not in "biufcV" or dt.name in _SUB_BYTE):
        raise UnsupportedTypeError(
            f"jaxccl.{fn}: dtype {dt.name} is not supported (sub-byte and object dtypes cannot be moved)"
        )


def _varying(x: jax.Array, axis_name: Any) -> jax.Array:
    """``x`` made device-varying over the axes of ``axis_name`` (no-op where it is or check_vma=False)."""
    varying = jax.typeof(x).mat.varying
    missing = tuple(a for a in _axes.names(axis_name) if a not in varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def _prepare_in_groups(
    fn: str,
    x: Any,
    axis_name: Any,
    groups: Any,
    *,
    reduction: bool,
    op: ReduceOp = ReduceOp.SUM,
    uneven: bool = False,
):
    """Checks a call and returns (operand made varying, axis key, devices per group, groups, communicator ref).

    ``uneven``: the groups may differ in size (the all-reductions, run by :func:`_reduce_in_groups`);
    the devices per group and the communicator are then those of the first group.
    """
    name, size = _axis(fn, axis_name)
    groups = _axes.canonical_groups(fn, groups, size, uneven=uneven)
    n = len(groups[0]) if groups is not None else size
    x = jnp.asarray(x)
    _check_dtype(fn, x.dtype, reduction=reduction, op=op)
    comm = _comm.resolve(name, n) if groups is None else _group_communicator(name, n)
    return _varying(x, name), name, n, groups, comm.ref


def _refuse_typed_groups(fn: str, x: jax.Array, axis_name: Any, groups: Any) -> None:
    """``jax.lax`` has no type for a reduction over groups under ``check_vma=True``: refuse it as lax does."""
    if groups is not None and set(_axes.names(axis_name)) & jax.typeof(x).mat.varying:
        raise UnsupportedError(
            f"jaxccl.{fn}: axis_index_groups under jax.shard_map(check_vma=True) is not supported (jax.lax "
            "refuses it too); use check_vma=False"
        )


def _group_communicator(name: Any, n: int) -> _comm.Communicator:
    """Where collectives over ``axis_index_groups`` of ``n`` devices run.

    The communicator in scope for the axis if it has ``n`` devices; else one
    of ``n`` devices with its backend (baseline schedules, no topology: its
    schedules are for the whole axis), made once per (communicator, ``n``) and
    kept as long as that communicator; with none in scope, the default one of
    ``(name, n)``.
    """
    scope = _comm.current(name)
    if scope is None:
        return _comm.default_communicator(name, n)
    if scope.axis_size == n:
        return scope
    derived = scope.__dict__.setdefault("_jaxccl_group_communicators", {})
    comm = derived.get(n)
    if comm is None:
        comm = _comm.Communicator.__new__(_comm.Communicator)
        comm._init(name, n, mesh=None, topology=None, backend=scope.backend)
        derived[n] = comm
    return comm


def _reduce_in_groups(prim: Any, x: jax.Array, name: Any, n: int, groups: Any, comm: Any) -> jax.Array:
    """Binds the all-reduce ``prim`` over ``groups``; groups of different sizes as one collective per size.

    Each size runs on a communicator of that size (:func:`_group_communicator`) over its groups
    only; every device keeps the result of its own group's size. Summation orders stay those of
    one group (each result comes from exactly one collective), so the result is bitwise
    ``jax.lax``'s.
    """
    classes = _axes.size_classes(groups) if groups is not None else ()
    if len(classes) <= 1:
        return prim.bind(x, axis_name=name, axis_size=n, axis_index_groups=groups, comm=comm, site=_p.new_site())
    outs = [
        prim.bind(
            x,
            axis_name=name,
            axis_size=len(cls[0]),
            axis_index_groups=cls,
            comm=_group_communicator(name, len(cls[0])).ref,
            site=_p.new_site(),
        )
        for cls in classes
    ]
    return lax.select_n(_axes.class_index(name, classes), *outs)


def _prepare(fn: str, x: Any, axis_name: Any, *, reduction: bool, op: ReduceOp = ReduceOp.SUM):
    x, name, n, _, comm = _prepare_in_groups(fn, x, axis_name, None, reduction=reduction, op=op)
    return x, name, n, comm


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
        axis_name: the mesh axis, or a tuple of mesh axes (ranked as ``jax.lax`` ranks them).
        axis: where the gathered blocks go: a new axis at ``axis`` (``tiled=False``)
            or concatenated along existing axis ``axis`` (``tiled=True``).
        tiled: see ``axis``.
        axis_index_groups: optional groups of indices along the axis, all of one
            size, covering it once; each group gathers separately, in its
            listed order.
        to: ``"varying"`` (the ``lax`` default) or ``"invarying"`` (the result
            is typed invariant over the axes and transposes to a slice, as
            ``jax.lax.all_gather(..., to="invarying")``); ``"reduced"`` raises
            ``NotImplementedError``.

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
    choose("to", to, _ALL_GATHER_TO)
    if to == "reduced":
        raise UnsupportedError(
            "jaxccl.all_gather: to='reduced' (explicit-sharding reduced types) is not supported; use 'varying' "
            "or 'invarying'"
        )
    if to == "invarying" and axis_index_groups is not None:
        raise UnsupportedError("jaxccl.all_gather: to='invarying' does not take axis_index_groups (as jax.lax)")
    if not _axes.names(axis_name):
        return x
    prim = _p.all_gather_invariant_p if to == "invarying" else _p.all_gather_p

    def bind(leaf):
        leaf, name, n, groups, comm = _prepare_in_groups(
            "all_gather", leaf, axis_name, axis_index_groups, reduction=False
        )
        ax = _canon("all_gather", "axis", axis, leaf.ndim if tiled else leaf.ndim + 1)
        return prim.bind(
            leaf,
            axis_name=name,
            axis=ax,
            tiled=bool(tiled),
            axis_size=n,
            axis_index_groups=groups,
            comm=comm,
            site=_p.new_site(),
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

    def bind(leaf):
        leaf, name, n, groups, comm = _prepare_in_groups(
            "all_to_all", leaf, axis_name, axis_index_groups, reduction=False
        )
        nd = leaf.ndim
        sa = _canon("all_to_all", "split_axis", split_axis, nd)
        ca = _canon("all_to_all", "concat_axis", concat_axis, nd)
        if tiled:
            if leaf.shape[sa] % n:
                raise ArgumentError(
                    f"jaxccl.all_to_all: split_axis {sa} has size {leaf.shape[sa]}, which is not divisible by "
                    f"the size {n} of axis {name!r}"
                )
        else:
            if leaf.shape[sa] != n:
                raise ArgumentError(
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
            leaf,
            axis_name=name,
            split_axis=sa,
            concat_axis=ca,
            axis_size=n,
            axis_index_groups=groups,
            comm=comm,
            site=_p.new_site(),
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

    def bind(leaf):
        leaf, name, n, groups, comm = _prepare_in_groups(
            "psum_scatter", leaf, axis_name, axis_index_groups, reduction=True
        )
        d = _canon("psum_scatter", "scatter_dimension", scatter_dimension, leaf.ndim)
        size = leaf.shape[d]
        if tiled and size % n:
            raise ArgumentError(
                f"jaxccl.psum_scatter: scatter_dimension {d} has size {size}, which is not divisible by the size "
                f"{n} of axis {name!r}"
            )
        if not tiled and size != n:
            raise ArgumentError(
                f"jaxccl.psum_scatter: with tiled=False the size of scatter_dimension {d} ({size}) must equal the "
                f"size {n} of axis {name!r}"
            )
        return _p.reduce_scatter_p.bind(
            leaf,
            axis_name=name,
            scatter_dimension=d,
            tiled=bool(tiled),
            axis_size=n,
            axis_index_groups=groups,
            comm=comm,
            site=_p.new_site(),
        )

    return jax.tree.map(bind, x)


def psum(x: Any, axis_name: Hashable, *, axis_index_groups: Any = None) -> Any:
    """All-reduce sum of ``x`` over mesh axis ``axis_name``; as :func:`jax.lax.psum`.

    Runs on the communicator in scope for ``axis_name`` (``with comm:``), else on
    the axis's default one (:func:`~jaxccl.runtime.communicator.default_communicator`).

    Runs the communicator's ``all_reduce`` schedule when one is installed
    (the default: rank-ordered), else (a communicator with a topology) its
    ReduceScatter and AllGather fused into one launch (MCCL Sec. 3;
    :meth:`~jaxccl.runtime.communicator.Communicator.launched_schedule`).
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

        Over two axes at once (all four devices of a 2 x 2 mesh):

        >>> mesh2 = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
        >>> g = jax.jit(jax.shard_map(lambda x: jaxccl.psum(x, ("b", "a")),
        ...                           mesh=mesh2, in_specs=P(("a", "b")), out_specs=P()))
        >>> g(np.arange(4.0, dtype=np.float32)).tolist()
        [6.0]
    """
    if not _axes.names(axis_name):
        return x

    def bind(leaf):
        leaf = jnp.asarray(leaf)
        if leaf.dtype == np.bool_:  # as lax.psum: bools are summed as int32
            leaf = leaf.astype(np.int32)
        leaf, name, n, groups, comm = _prepare_in_groups(
            "psum", leaf, axis_name, axis_index_groups, reduction=True, uneven=True
        )
        _refuse_typed_groups("psum", leaf, name, groups)
        return _reduce_in_groups(_p.psum_p, leaf, name, n, groups, comm)

    return jax.tree.map(bind, x)


def pmax(x: Any, axis_name: Hashable, *, axis_index_groups: Any = None) -> Any:
    """All-reduce max of ``x`` over mesh axis ``axis_name``; as :func:`jax.lax.pmax`.

    Runs the communicator's ``all_reduce`` (or fused ReduceScatter + AllGather)
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
    if not _axes.names(axis_name):
        return x

    def bind(leaf):
        leaf, name, n, groups, comm = _prepare_in_groups(
            fn, leaf, axis_name, axis_index_groups, reduction=True, op=op, uneven=True
        )
        _refuse_typed_groups(fn, leaf, name, groups)
        return _reduce_in_groups(prim, leaf, name, n, groups, comm)

    return jax.tree.map(bind, x)


def pmean(x: Any, axis_name: Hashable, *, axis_index_groups: Any = None) -> Any:
    """All-reduce mean of ``x`` over mesh axis ``axis_name``; as :func:`jax.lax.pmean`.

    :func:`psum` divided by the axis size, exactly as ``lax.pmean`` computes it
    (integers and bools give floats). With ``axis_index_groups`` it divides by the
    size of the *first* group, as ``lax.pmean`` does (for groups of different
    sizes the other groups' means are off by the ratio of the sizes in
    ``jax.lax`` too; bitwise equality with ``jax.lax`` is the contract here).

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
    if not _axes.names(axis_name):
        return total
    n = len(axis_index_groups[0]) if axis_index_groups is not None else _axis("pmean", axis_name)[1]
    return jax.tree.map(lambda v: v / n, total)
