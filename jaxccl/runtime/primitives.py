"""JAX primitives of the jaxccl collectives: abstract eval, lowering, transpose and batching rules.

Seven primitives mirror ``jax.lax``'s: ``jaxccl_all_gather``,
``jaxccl_all_gather_invariant`` (``to="invarying"``: the result is invariant
over the axes and transposes to this device's slice, as ``lax``'s),
``jaxccl_all_to_all`` (always tiled; the front end reshapes as ``lax`` does),
``jaxccl_reduce_scatter``, ``jaxccl_psum``, ``jaxccl_pmax`` and ``jaxccl_pmin``
(the last three one all-reduce with the operator of
:class:`~jaxccl.schedule.reduction.ReduceOp`; like ``lax.pmax``/``lax.pmin``,
max and min have batching rules but no differentiation rules). Their parameters are the
``lax`` ones (``axis_name`` is one mesh axis or a tuple of them, see
:mod:`jaxccl.runtime.axes`; ``axis_index_groups`` ``None`` or a tuple of
tuples; ``axis_size`` the devices per group) plus
``comm`` (the :class:`~jaxccl.runtime.communicator.Communicator` resolved at
trace time) and ``site``, a fresh id per bind (rebinding rules allocate new
ones). The site keeps equations distinct, and the lowerings are registered
``cacheable=False``: JAX otherwise emits identical equations as one cached
function, and two call sites would share one native rendezvous id.

``shard_map`` with ``check_vma=True``. In jax 0.10.2 the varying-manual-axes
type lives in the avals (``jax.typeof(x).mat.varying``); ``shard_map`` has no
per-primitive rule tables any more: it calls the primitive's abstract eval and
reads the output's ``mat``. So the abstract evals here propagate it exactly as
``lax``'s collectives do: AllGather, AllToAll and ReduceScatter return the
input's varying set (the front end first makes the input varying over the
axis with ``jax.lax.pcast(..., to="varying")``, as ``lax`` does); ``psum``,
``pmax`` and ``pmin`` remove the axis (their result is invariant). Under ``check_vma=False`` the
sets are empty and pass through unchanged. Transposes follow the types:
``all_gather`` <-> ``psum_scatter``, ``all_to_all`` <-> ``all_to_all`` with
split and concat swapped, and ``psum``'s transpose is ``pcast`` to varying
when the input was varying (check_vma=True; ``lax.psum``'s rule) or ``psum``
(check_vma=False, where ``lax`` keeps the old psum-of-cotangent rule).

Lowering is written in JAX ops with ``mlir.lower_fun``: reshape/transpose to
the flat chunk layout of ``docs/schedule-ir.md``, run the flat collective on
the backend the communicator picks for the platform (the native FFI executor
or the ppermute rounds), and reshape back. Three details make reductions
bitwise equal to XLA:CPU's (the rule: :mod:`jaxccl.schedule.reduction`):

- bf16 is promoted to f32 around the flat collective (a sum rounds once at the
  end), as XLA:CPU does; f16 sums round after every step, as XLA:CPU does, so
  they run in f16 (:func:`~jaxccl.schedule.reduction.wire_dtype`);
- XLA:CPU's folds start from the identity, ``((0 + x0) + x1) + ...``, so a sum
  of negative zeros is +0 and a max skips NaNs; a rank-ordered schedule starts
  from ``x0``, and the step and finish rules make the two folds agree (the
  native executors' steps do it themselves, ``xla_ffi/core/reduce.h``);
- on the ppermute backend the operand first passes an identity ``ppermute``,
  a fusion barrier: otherwise XLA fuses e.g. a multiply producing the operand
  into the schedule's additions and LLVM contracts them into an FMA.

The program around a collective must also compile as it does around
``lax``'s, whose collective is an opaque operation between two materialized
buffers. The native backends' custom calls are such operations; on the
ppermute backend every collective, reducing or not, is bracketed by identity
``ppermute`` operations
(:func:`~jaxccl.runtime.ppermute_backend.fusion_barrier`, in
:func:`_materialized`). Without the one after the result XLA:CPU fuses the
schedule's tail (``finish``'s select, a last reduce step, the update of the
output buffer, the reshape back) into the consumer's fusion; XLA:CPU emits a
``reduce``'s accumulation as ``fadd reassoc``, and with the extra operations
in the loop LLVM vectorized the consumer's sum (8 lanes, two accumulators,
then a tree) where ``lax``'s consumer is a sequential fold with FMAs: the
backward pass of ``examples/transformer.py``'s RMS norms, after a ``psum``,
differed in the last bit (``tests/runtime/test_ppermute_whole_step.py``).
``lax.optimization_barrier`` does not prevent that fusion on XLA:CPU.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.interpreters.mlir import ir

from jaxccl.errors import ContextError, UnsupportedError
from jaxccl.runtime import axes as _axes
from jaxccl.runtime import communicator as _comm
from jaxccl.runtime import native_backend, ppermute_backend, process_layouts
from jaxccl.schedule.fusion import input_padding
from jaxccl.schedule.ir import Collective
from jaxccl.schedule.reduction import ReduceOp, finish, gloo_ring_chunk, wire_dtype

__all__ = ["all_gather_invariant_p", "all_gather_p", "all_to_all_p", "pmax_p", "pmin_p", "psum_p", "reduce_scatter_p"]

all_gather_p = Primitive("jaxccl_all_gather")
all_gather_invariant_p = Primitive("jaxccl_all_gather_invariant")
all_to_all_p = Primitive("jaxccl_all_to_all")
reduce_scatter_p = Primitive("jaxccl_reduce_scatter")
psum_p = Primitive("jaxccl_psum")
pmax_p = Primitive("jaxccl_pmax")
pmin_p = Primitive("jaxccl_pmin")

_sites = itertools.count(1)


def _no_impl(name: str):
    def impl(*args, **kwargs):
        raise ContextError(f"jaxccl.{name} must be called inside jax.shard_map (under jax.jit or not)")

    return impl


# ---------------------------------------------------------------- abstract eval
def _ag_shape(shape, axis: int, tiled: bool, n: int) -> tuple[int, ...]:
    s = list(shape)
    if tiled:
        s[axis] *= n
    else:
        s.insert(axis, n)
    return tuple(s)


def _rs_shape(shape, dim: int, tiled: bool, n: int) -> tuple[int, ...]:
    s = list(shape)
    if tiled:
        s[dim] //= n
    else:
        del s[dim]
    return tuple(s)


def _a2a_shape(shape, split_axis: int, concat_axis: int, n: int) -> tuple[int, ...]:
    s = list(shape)
    s[split_axis] //= n
    s[concat_axis] *= n
    return tuple(s)


def _all_gather_abstract_eval(x, *, axis_name, axis, tiled, axis_size, **_):
    return x.update(shape=_ag_shape(x.shape, axis, tiled, axis_size), weak_type=False)


def _invariant(x, axis_name):
    """``x``'s type with the axes of ``axis_name`` removed from its varying set."""
    mat = x.mat
    return x.update(manual_axis_type=mat.update(varying=frozenset(mat.varying) - set(_axes.names(axis_name))))


def _all_gather_invariant_abstract_eval(x, *, axis_name, **params):
    return _invariant(_all_gather_abstract_eval(x, axis_name=axis_name, **params), axis_name)


def _reduce_scatter_abstract_eval(x, *, scatter_dimension, tiled, axis_size, **_):
    return x.update(shape=_rs_shape(x.shape, scatter_dimension, tiled, axis_size), weak_type=False)


def _all_to_all_abstract_eval(x, *, split_axis, concat_axis, axis_size, **_):
    return x.update(shape=_a2a_shape(x.shape, split_axis, concat_axis, axis_size), weak_type=False)


def _psum_abstract_eval(x, *, axis_name, **_):
    return _invariant(x, axis_name).update(weak_type=False)


# ---------------------------------------------------------------------- transposes
def new_site() -> int:
    """A fresh collective-site id. Every bind gets one (rebinds in transpose/batching rules too), so
    two call sites never share an id even where JAX caches identical lowerings."""
    return next(_sites)


def _rebind(prim: Primitive, x, params: dict, **changes):
    return prim.bind(x, **{**params, **changes, "site": new_site()})


def _all_gather_transpose(ct, x, *, axis, tiled, **params):
    return (_rebind(reduce_scatter_p, ct, params, scatter_dimension=axis, tiled=tiled),)


def _all_gather_invariant_transpose(ct, x, *, axis, tiled, **params):
    """As ``lax.all_gather_invariant``'s: the cotangent's block of this device (invariant -> varying)."""
    n = params["axis_size"]
    size = ct.shape[axis] // n
    out = lax.dynamic_slice_in_dim(ct, _axes.axis_index(params["axis_name"]) * size, size, axis=axis)
    return (out if tiled else lax.squeeze(out, (axis,)),)


def _reduce_scatter_transpose(ct, x, *, scatter_dimension, tiled, **params):
    return (_rebind(all_gather_p, ct, params, axis=scatter_dimension, tiled=tiled),)


def _all_to_all_transpose(ct, x, *, split_axis, concat_axis, **params):
    return (_rebind(all_to_all_p, ct, params, split_axis=concat_axis, concat_axis=split_axis),)


def _psum_transpose(ct, x, **params):
    axes = _axes.names(params["axis_name"])
    if set(axes) & x.aval.mat.varying:  # check_vma=True: psum is varying -> invariant, as lax.psum
        return (lax.pcast(ct, axes, to="varying"),)
    return (_rebind(psum_p, ct, params),)  # check_vma=False: lax's psum_p transposes to psum


# ------------------------------------------------------------------------ batching
def _batch_rule(prim: Primitive, *axis_params: str):
    """vmap: move the batch dim to the front and shift the positional axis parameters by one."""

    def rule(vals, dims, **params):
        (x,), (d,) = vals, dims
        if d is None:
            return _rebind(prim, x, params), None
        x = x if d == 0 else jnp.moveaxis(x, d, 0)
        return _rebind(prim, x, params, **{k: params[k] + 1 for k in axis_params}), 0

    return rule


# ------------------------------------------------------------------------ lowering
def _flat_collective(
    coll: Collective,
    flat: jax.Array,
    *,
    axis_name,
    axis_size,
    comm,
    site: int,
    backend,
    dep=None,
    axis_index_groups=None,
    op: ReduceOp = ReduceOp.SUM,
    nbytes: int | None = None,
) -> jax.Array:
    """The flat-buffer collective on this rank (chunk layout of docs/schedule-ir.md), reducing with ``op``.

    ``nbytes`` is the call's message size (default: :func:`~jaxccl.runtime.communicator.message_bytes` of
    ``flat``); on a communicator with size buckets it picks the bucket's slot (or, on ``ppermute``, its
    schedule). Shapes are static, so the bucket is chosen here, when the program is lowered, rather than by
    the executor at launch: the same choice for every launch of this call.
    """
    axis = _axes.grouped(axis_name, axis_index_groups)
    if nbytes is None:
        nbytes = _comm.message_bytes(coll, int(flat.shape[0]), flat.dtype.itemsize, axis_size)
    nbytes = max(int(nbytes), 1)
    if backend == "ppermute":
        y = ppermute_backend.run_schedule(comm.launched_schedule(coll, nbytes=nbytes), flat, axis, op)
        # the native executors' steps finish themselves (xla_ffi/core/reduce.h)
        return finish(op, y, jnp) if coll.reduces else y

    kind, group_axes, first_group = backend
    run = functools.partial(
        native_backend.flat_collective,
        coll,
        axis_name=axis,
        axis_size=axis_size,
        group_axes=group_axes,
        first_group=first_group,
        slot=comm.slot(coll, nbytes),
        site=site,
        backend=kind,
        dep=dep,
        reduce_op=int(op),
    )
    if not _axes.partial(axis):
        return run(flat)
    # Groups covering part of the axis (one size of uneven groups): only their members meet in the
    # executor; the others skip the call, and their (unused) result is zeros.
    n_out = native_backend.output_elems(coll, int(flat.shape[0]), axis_size)
    return lax.cond(_axes.is_member(axis), run, lambda f: jnp.zeros((n_out,), f.dtype), flat)


def _reduce(coll: Collective, flat: jax.Array, *, op: ReduceOp = ReduceOp.SUM, **kw) -> jax.Array:
    """A reducing flat collective in the operator's wire dtype (bf16 in f32, rounded once, as XLA:CPU)."""
    dtype = flat.dtype
    flat = flat.astype(wire_dtype(op, dtype))
    return _flat_collective(coll, flat, op=op, **kw).astype(dtype)


def _kw(axis_name, axis_size, comm, site, backend, dep=None, sub: int = 0, axis_index_groups=None) -> dict:
    # Native site ids: two sub-calls per primitive site (psum = ReduceScatter + AllGather).
    return dict(
        axis_name=axis_name,
        axis_size=axis_size,
        comm=comm,
        site=2 * site + sub,
        backend=backend,
        dep=dep,
        axis_index_groups=axis_index_groups,
    )


def _all_gather_impl(x, *, axis, tiled, **params):
    n = params["axis_size"]
    y = _flat_collective(Collective.ALL_GATHER, x.reshape(-1), **_kw(**params))
    y = jnp.moveaxis(y.reshape((n, *x.shape)), 0, axis)
    return y.reshape(_ag_shape(x.shape, axis, tiled, n))


def _blocks_first(x, dim: int, n: int):
    """``x`` with ``dim`` split into ``(n, dim // n)`` and the ``n`` blocks moved to the front."""
    s = x.shape
    x = x.reshape((*s[:dim], n, s[dim] // n, *s[dim + 1 :]))
    return jnp.moveaxis(x, dim, 0)


def _all_to_all_impl(x, *, split_axis, concat_axis, **params):
    n = params["axis_size"]
    xb = _blocks_first(x, split_axis, n)  # (n, *block); block d goes to rank d
    y = _flat_collective(Collective.ALL_TO_ALL, xb.reshape(-1), **_kw(**params))
    y = jnp.moveaxis(y.reshape(xb.shape), 0, concat_axis)  # the block from rank s lands at position s
    return y.reshape(_a2a_shape(x.shape, split_axis, concat_axis, n))


def _reduce_scatter_impl(x, *, scatter_dimension, tiled, **params):
    n = params["axis_size"]
    xb = _blocks_first(x, scatter_dimension, n)
    y = _reduce(Collective.REDUCE_SCATTER, xb.reshape(-1), **_kw(**params))
    return y.reshape(_rs_shape(x.shape, scatter_dimension, tiled, n))


def _allreduce_impl(x, *, op: ReduceOp, **params):
    n, comm = params["axis_size"], params["comm"]
    flat = x.reshape(-1)
    e = flat.shape[0]
    # the message size of the call (its size bucket), on the wire: the padding below does not change it
    nbytes = max(e * wire_dtype(op, flat.dtype).itemsize, 1)
    schedule = comm.launched_schedule(Collective.ALL_REDUCE, nbytes=nbytes)  # installed, or the halves fused
    if schedule is not None and schedule.info.get("fold") == "gloo_ring" and n > 1:
        # gloo's ring order holds on gloo's chunks: pad to N of them (the padding is its own elements).
        chunk = gloo_ring_chunk(e, wire_dtype(op, flat.dtype).itemsize, n)
        work = jnp.concatenate([flat, jnp.zeros((n * chunk - e,), flat.dtype)]) if n * chunk > e else flat
        return _reduce(Collective.ALL_REDUCE, work, op=op, nbytes=nbytes, **_kw(**params))[:e].reshape(x.shape)
    if schedule is not None:
        pad = input_padding(schedule, e)  # a fused schedule sums as its halves on a multiple of N elements
        work = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)]) if pad else flat
        y = _reduce(Collective.ALL_REDUCE, work, op=op, nbytes=nbytes, **_kw(**params))
        return (y[:e] if pad else y).reshape(x.shape)
    # ReduceScatter + AllGather in two launches on a buffer padded to a multiple of N (MCCL Sec. 3); the padding
    # is dropped.
    work = flat
    if e % n:
        work = jnp.concatenate([work, jnp.zeros((-e % n,), work.dtype)])
    part = _reduce(Collective.REDUCE_SCATTER, work, op=op, **_kw(**params))
    full = _flat_collective(Collective.ALL_GATHER, part, **{**_kw(**params, sub=1), "dep": None})
    return full[:e].reshape(x.shape)


def _first_group(ctx, axis_name, axis_index_groups) -> int:
    """Across processes: where the groups of the attached layout of the lowered mesh and ``axis_name`` start."""
    if jax.process_count() == 1:
        return 0
    if axis_index_groups is not None:
        raise UnsupportedError(
            "jaxccl: axis_index_groups across processes are not supported on the native backends yet "
            "(the attached layouts have one group per coordinate of the other mesh axes); use backend='ppermute'"
        )
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if mesh is None:
        raise UnsupportedError("jaxccl: a native collective across processes needs the mesh of a jax.shard_map")
    shape = dict(mesh.shape)
    return process_layouts.first_group(mesh.axis_names, [shape[a] for a in mesh.axis_names], axis_name)


def _group_axes(ctx, axis_name) -> tuple[tuple[object, int], ...]:
    """The manual mesh axes outside ``axis_name`` (name, size): their coordinates identify this rank's group."""
    axis_context = ctx.module_context.axis_context
    mesh = getattr(axis_context, "mesh", None)
    if mesh is None:
        return ()
    manual = getattr(axis_context, "manual_axes", frozenset(mesh.axis_names))
    shape = dict(mesh.shape)
    auto = [a for a in mesh.axis_names if a not in manual and shape[a] > 1]
    if auto:
        raise UnsupportedError(
            f"jaxccl native backends need every mesh axis manual in jax.shard_map; axes {auto} are not "
            "(use backend='ppermute' for partially manual shard_map)"
        )
    inside = set(_axes.names(axis_name))
    return tuple((a, int(shape[a])) for a in mesh.axis_names if a not in inside and a in manual)


_CHAIN_KEY = "jaxccl_last_native_collective"


def _chain_dep(prev: jax.Array) -> jax.Array:
    """An int32 zero that XLA cannot fold away and that depends on ``prev``."""
    first = prev.reshape(-1)[:1]
    if jnp.issubdtype(first.dtype, jnp.complexfloating):
        first = jnp.real(first)
    return lax.clamp(jnp.int32(0), first.astype(jnp.int32)[0], jnp.int32(0))


def _materialized(impl):
    """``impl`` with its operand and its result behind barriers: optimization barriers, or on the
    ppermute backend identity ``ppermute`` operations (XLA:CPU fuses across an optimization barrier).

    ``lax``'s collectives read a materialized operand and hand their consumers
    a plain buffer. Without the barriers XLA fuses the reshapes/transposes to
    and from the flat layout (and on the ppermute backend the schedule's first
    and last operations) into the producer and the consumer, which changes
    their loops: a consumer's reduction (a loss's ``sum``, a norm's backward
    pass) runs in another order, a producer's ``cos`` may take another code
    path, and the bits differ from the same program on ``lax``.
    """

    @functools.wraps(impl)
    def run(x, *args, **kwargs):
        if kwargs["backend"] != "ppermute":
            return lax.optimization_barrier(impl(lax.optimization_barrier(x), *args, **kwargs))
        axis = _axes.grouped(kwargs["axis_name"], kwargs.get("axis_index_groups"))
        barrier = functools.partial(ppermute_backend.fusion_barrier, axis_name=axis, num_ranks=kwargs["axis_size"])
        return barrier(impl(barrier(x), *args, **kwargs))

    return run


def _lowering(impl):
    """Lowering rule: ``impl`` in JAX ops for the backend the communicator runs on this platform.

    Native calls are chained: each one's ``coords`` operand depends (through a
    zero XLA cannot fold) on the result of the previous jaxccl native collective
    lowered into the same block. XLA:CPU orders custom calls only by their
    buffers and runs independent ones concurrently, in an order that can differ
    between devices; the executor's calls block until their peers arrive, so
    without an order common to all devices a program with several independent
    collectives can deadlock (observed: 27 independent calls on a 2x4 mesh).
    """

    impl = _materialized(impl)

    def rule(ctx, x, *, comm, **params):
        platforms = ctx.module_context.platforms
        backends = {_comm.lowering_backend(comm, p) for p in platforms}
        if len(backends) != 1:
            raise UnsupportedError(f"jaxccl: lowering for several platforms at once ({platforms}) is not supported")
        backend = backends.pop()
        if backend == "ppermute":
            fn = functools.partial(impl, backend=backend)
            return mlir.lower_fun(fn, multiple_results=False)(ctx, x, comm=comm, **params)
        name, groups = params["axis_name"], params.get("axis_index_groups")
        backend = (backend, _group_axes(ctx, name), _first_group(ctx, name, groups))
        chain = ctx.module_context.cached_primitive_lowerings  # a per-module dict
        key = (_CHAIN_KEY, ir.InsertionPoint.current.block)
        prev = chain.get(key)
        if prev is None or not prev[1].size:
            fn = functools.partial(impl, backend=backend, dep=None)
            out = mlir.lower_fun(fn, multiple_results=False)(ctx, x, comm=comm, **params)
        else:

            def fn(x, p, **kw):
                return impl(x, backend=backend, dep=_chain_dep(p), **kw)

            sub = ctx.replace(avals_in=[*ctx.avals_in, prev[1]])
            out = mlir.lower_fun(fn, multiple_results=False)(sub, x, prev[0], comm=comm, **params)
        chain[key] = (_first_ir_value(out), ctx.avals_out[0])
        return out

    return rule


def _first_ir_value(out: Any) -> Any:
    """The first ``ir.Value`` of what ``mlir.lower_fun`` returned (a value or nested sequences of them).

    Written out instead of ``mlir.ir_tree_registry``, which jax only has from 0.10.2 on.
    """
    while isinstance(out, (list, tuple)):
        out = out[0]
    return out


# ---------------------------------------------------------------- registration
for _p, _name in (
    (all_gather_p, "all_gather"),
    (all_gather_invariant_p, "all_gather"),
    (all_to_all_p, "all_to_all"),
    (reduce_scatter_p, "psum_scatter"),
    (psum_p, "psum"),
    (pmax_p, "pmax"),
    (pmin_p, "pmin"),
):
    _p.def_impl(_no_impl(_name))

all_gather_p.def_abstract_eval(_all_gather_abstract_eval)
all_gather_invariant_p.def_abstract_eval(_all_gather_invariant_abstract_eval)
all_to_all_p.def_abstract_eval(_all_to_all_abstract_eval)
reduce_scatter_p.def_abstract_eval(_reduce_scatter_abstract_eval)
for _p in (psum_p, pmax_p, pmin_p):
    _p.def_abstract_eval(_psum_abstract_eval)

ad.deflinear2(all_gather_p, _all_gather_transpose)
ad.deflinear2(all_gather_invariant_p, _all_gather_invariant_transpose)
ad.deflinear2(all_to_all_p, _all_to_all_transpose)
ad.deflinear2(reduce_scatter_p, _reduce_scatter_transpose)
ad.deflinear2(psum_p, _psum_transpose)
# pmax/pmin: no differentiation rules, as lax.pmax/lax.pmin.

batching.primitive_batchers[all_gather_p] = _batch_rule(all_gather_p, "axis")
batching.primitive_batchers[all_gather_invariant_p] = _batch_rule(all_gather_invariant_p, "axis")
batching.primitive_batchers[all_to_all_p] = _batch_rule(all_to_all_p, "split_axis", "concat_axis")
batching.primitive_batchers[reduce_scatter_p] = _batch_rule(reduce_scatter_p, "scatter_dimension")
batching.primitive_batchers[psum_p] = _batch_rule(psum_p)
batching.primitive_batchers[pmax_p] = _batch_rule(pmax_p)
batching.primitive_batchers[pmin_p] = _batch_rule(pmin_p)

mlir.register_lowering(all_gather_p, _lowering(_all_gather_impl), cacheable=False)
mlir.register_lowering(all_gather_invariant_p, _lowering(_all_gather_impl), cacheable=False)
mlir.register_lowering(all_to_all_p, _lowering(_all_to_all_impl), cacheable=False)
mlir.register_lowering(reduce_scatter_p, _lowering(_reduce_scatter_impl), cacheable=False)
for _p, _op in ((psum_p, ReduceOp.SUM), (pmax_p, ReduceOp.MAX), (pmin_p, ReduceOp.MIN)):
    mlir.register_lowering(_p, _lowering(functools.partial(_allreduce_impl, op=_op)), cacheable=False)
