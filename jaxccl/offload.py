"""``jaxccl.offload``: run an unmodified program's ``jax.lax`` collectives through jaxccl.

:func:`offload` traces the function to a jaxpr and evaluates it again,
equation by equation: every ``jax.lax`` collective inside ``jax.shard_map``
(``psum``, ``pmax``, ``pmin``, ``all_gather``, ``psum_scatter``,
``all_to_all``; ``pmean`` is a ``psum`` and a division) is
replaced by the jaxccl collective with the same arguments, and every other
equation is bound again unchanged. Sub-programs are rewritten recursively
(``shard_map``, ``jit``, ``cond``/``switch``, ``while_loop``, ``scan``,
``checkpoint``/``remat``, ``custom_jvp``/``custom_vjp`` functions); one that
holds no collective is kept as it is.

Limits:

- The function is traced once per call signature, as ``jax.jit`` would;
  wrap the result in ``jax.jit`` to compile it (``jax.jit(offload(step))``).
- A ``custom_jvp``/``custom_vjp`` function keeps its rules: its primal
  computation runs through jaxccl, but when the *offloaded* function is
  differentiated, the collectives inside its JVP/forward/backward rules run
  as written, on ``jax.lax`` (differentiate inside the function you offload,
  as a training step does, and everything runs through jaxccl).
- Collectives jaxccl refuses keep jaxccl's error (for example a reduction
  dtype it does not handle, or ``all_gather(..., to="reduced")``).
- Collectives outside ``jax.shard_map`` (``pmap``) and ``ppermute``,
  ``psend``/``precv``, ``ragged_all_to_all`` and the ``*_start``/``*_done``
  async forms are left to ``jax.lax``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

from jaxccl.errors import UnsupportedError

__all__ = ["eval_jaxpr", "offload"]

# JAX is imported inside the functions: ``import jaxccl`` imports this module (so that ``jaxccl.offload`` is
# the function, never the module) and must not start JAX before ``jaxccl.emulate()``.


def offload(fn: Callable[..., Any], comm: Any = None) -> Callable[..., Any]:
    """Returns ``fn`` with its ``jax.lax`` collectives (inside ``jax.shard_map``) run by jaxccl.

    Results are bitwise equal to ``fn``'s wherever the jaxccl collectives are
    (:mod:`jaxccl.runtime.collectives`); everything else in ``fn`` is left as
    traced. See the module docstring for what is and is not rewritten.

    Args:
        fn: any function JAX can trace (typically a training step that calls
            ``jax.shard_map``, or the ``shard_map``-ed function itself).
        comm: ``None`` (the communicators in scope when the result is called,
            else the default ones), a :class:`jaxccl.Communicator` or a
            sequence of them, entered (``with comm:``) while the rewritten
            program is traced.

    Returns:
        A function with ``fn``'s signature (keyword arguments are static).

    Example:
        >>> import jax, numpy as np, jaxccl
        >>> from jax import lax
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
        >>> step = jax.shard_map(lambda x: lax.psum(x * x, ("data", "model")),
        ...                      mesh=mesh, in_specs=P(("data", "model")), out_specs=P())
        >>> x = np.arange(4.0, dtype=np.float32)
        >>> fast = jax.jit(jaxccl.offload(step))
        >>> fast(x).tolist(), "jaxccl_psum" in str(jax.make_jaxpr(jaxccl.offload(step))(x))
        ([14.0], True)
    """
    import jax

    comms: Sequence[Any] = () if comm is None else tuple(comm) if isinstance(comm, (list, tuple)) else (comm,)

    @functools.wraps(fn)
    def offloaded(*args: Any, **kwargs: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(functools.partial(fn, **kwargs), return_shape=True)(*args)
        with contextlib.ExitStack() as scope:
            for c in comms:
                scope.enter_context(c)
            out = eval_jaxpr(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return offloaded


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluates ``jaxpr`` on ``args`` with its collectives replaced by jaxccl's (the core of :func:`offload`)."""
    from jax.extend import core as jex_core

    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with _eqn_context(eqn):
            outs = _apply(eqn, invals)
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jex_core.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


@contextlib.contextmanager
def _eqn_context(eqn: Any):
    """The equation's own context (compute type, name stack), as ``jax.core.eval_jaxpr`` sets it."""
    from jax._src import source_info_util

    with contextlib.ExitStack() as stack:
        ctx = getattr(eqn, "ctx", None)
        if ctx is not None:
            stack.enter_context(ctx.manager)
        info = eqn.source_info
        name_stack = source_info_util.current_name_stack() + info.name_stack
        stack.enter_context(source_info_util.user_context(info.traceback, name_stack=name_stack))
        yield


def _bind_as_traced(eqn: Any, invals: list[Any], params: dict | None = None) -> list[Any]:
    prim = eqn.primitive
    out = prim.bind(*invals, **prim.get_bind_params(eqn.params if params is None else params))
    return list(out) if prim.multiple_results else [out]


def _apply(eqn: Any, invals: list[Any]) -> list[Any]:
    swap = _swaps().get(eqn.primitive)
    if swap is not None:
        outs = [swap(x, eqn.params) for x in invals]
        _check_types(eqn, outs)
        return outs
    if not _has_collectives(eqn):
        return _bind_as_traced(eqn, invals)
    special = _HIGHER_ORDER.get(eqn.primitive.name)
    if special is not None:
        return special(eqn, invals)
    return _bind_as_traced(eqn, invals, _rewrite_params(eqn))


def _check_types(eqn: Any, outs: list[Any]) -> None:
    import jax

    for v, o in zip(eqn.outvars, outs):
        want, got = v.aval, jax.typeof(o)
        if (want.shape, want.dtype) != (got.shape, got.dtype):  # pragma: no cover - a bug in a swap rule
            raise AssertionError(
                f"jaxccl.offload: {eqn.primitive} {eqn.params} gave {got.str_short()}, expected {want.str_short()}"
            )


# ------------------------------------------------------------------ the swaps
def _groups(params: dict) -> dict:
    groups = params.get("axis_index_groups")
    return {} if groups is None else {"axis_index_groups": groups}


def _reduction(name: str) -> Callable[[Any, dict], Any]:
    def swap(x: Any, params: dict) -> Any:
        from jaxccl.runtime import collectives  # imports JAX

        return getattr(collectives, name)(x, params["axes"], **_groups(params))

    return swap


def _all_gather(x: Any, params: dict, to: str = "varying") -> Any:
    from jaxccl.runtime import collectives  # imports JAX

    return collectives.all_gather(
        x,
        params["axis_name"],
        axis=params["all_gather_dimension"],
        tiled=params["tiled"],
        to=to,
        **_groups(params),
    )


def _psum_scatter(x: Any, params: dict) -> Any:
    from jaxccl.runtime import collectives  # imports JAX

    return collectives.psum_scatter(
        x, params["axis_name"], scatter_dimension=params["scatter_dimension"], tiled=params["tiled"], **_groups(params)
    )


def _all_to_all(x: Any, params: dict) -> Any:
    from jaxccl.runtime import collectives  # imports JAX

    # The primitive is always the tiled form: lax.all_to_all(tiled=False) reshapes around it.
    return collectives.all_to_all(
        x, params["axis_name"], params["split_axis"], params["concat_axis"], tiled=True, **_groups(params)
    )


@functools.cache
def _swaps() -> dict[Any, Callable[[Any, dict], Any]]:
    """``jax.lax`` collective primitive -> its jaxccl replacement (one operand, the equation's params)."""
    from jax._src.lax import parallel as lax_parallel

    table = {
        "psum_p": _reduction("psum"),
        "psum_invariant_p": _reduction("psum"),
        "pmax_p": _reduction("pmax"),
        "pmin_p": _reduction("pmin"),
        "all_gather_p": _all_gather,
        "all_gather_invariant_p": functools.partial(_all_gather, to="invarying"),
        "reduce_scatter_p": _psum_scatter,
        "all_to_all_p": _all_to_all,
    }
    return {getattr(lax_parallel, k): v for k, v in table.items() if hasattr(lax_parallel, k)}


# ------------------------------------------------------------ sub-programs
def _jaxprs(params: dict) -> list[Any]:
    from jax.extend import core as jex_core

    return list(jex_core.jaxprs_in_params(params))


@functools.lru_cache(maxsize=4096)
def _jaxpr_has_collectives(jaxpr: Any) -> bool:
    swaps = _swaps()
    for eqn in jaxpr.eqns:
        if eqn.primitive in swaps:
            return True
        if any(_jaxpr_has_collectives(_open(j)) for j in _jaxprs(eqn.params)):
            return True
    return False


def _open(j: Any) -> Any:
    from jax.extend import core as jex_core

    return j.jaxpr if isinstance(j, jex_core.ClosedJaxpr) else j


def _has_collectives(eqn: Any) -> bool:
    return any(_jaxpr_has_collectives(_open(j)) for j in _jaxprs(eqn.params))


def _rewrite_closed(closed: Any) -> Any:
    """A ClosedJaxpr of the same type whose collectives are jaxccl's."""
    from jax._src import linear_util as lu
    from jax._src.interpreters import partial_eval as pe
    from jax.extend import core as jex_core

    def fun(*xs: Any) -> list[Any]:
        return eval_jaxpr(closed.jaxpr, closed.consts, xs)

    wrapped = lu.wrap_init(fun, debug_info=closed.jaxpr.debug_info)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, closed.in_avals)
    return jex_core.ClosedJaxpr(jaxpr, consts)


def _rewrite_params(eqn: Any) -> dict:
    """The equation's params with every ClosedJaxpr (or tuple of them) rewritten."""
    from jax.extend import core as jex_core

    params = dict(eqn.params)
    for key, value in eqn.params.items():
        if isinstance(value, jex_core.ClosedJaxpr):
            params[key] = _rewrite_closed(value)
        elif isinstance(value, tuple) and value and all(isinstance(v, jex_core.ClosedJaxpr) for v in value):
            params[key] = tuple(_rewrite_closed(v) for v in value)
        elif isinstance(value, jex_core.Jaxpr) and _jaxpr_has_collectives(value):
            raise UnsupportedError(
                f"jaxccl.offload: cannot rewrite the collectives inside {eqn.primitive} (its sub-program is an open "
                "jaxpr); call jaxccl's collectives directly there"
            )
    return params


def _shard_map(eqn: Any, invals: list[Any]) -> list[Any]:
    import jax

    p = eqn.params
    body = p["jaxpr"]

    def fun(*xs: Any) -> tuple[Any, ...]:
        return tuple(eval_jaxpr(body, (), xs))

    out = jax.shard_map(
        fun,
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        check_vma=p["check_vma"],
        axis_names=set(p.get("newly_manual_axes", p.get("manual_axes", ()))),
    )(*invals)
    return list(out)


def _checkpoint(eqn: Any, invals: list[Any]) -> list[Any]:
    import jax

    p = eqn.params
    body = p["jaxpr"]

    def fun(*xs: Any) -> list[Any]:
        return eval_jaxpr(body, (), xs)

    return list(jax.checkpoint(fun, prevent_cse=p["prevent_cse"], policy=p["policy"])(*invals))


def _custom_rule(eqn: Any, invals: list[Any]) -> list[Any]:
    """A ``custom_jvp``/``custom_vjp`` function: its primal program rewritten, its rules kept as written."""
    params = {**eqn.params, "call_jaxpr": _rewrite_closed(eqn.params["call_jaxpr"])}
    return _bind_as_traced(eqn, invals, params)


def _inline(eqn: Any, invals: list[Any]) -> list[Any]:
    from jax.extend import core as jex_core

    closed = eqn.params["call_jaxpr"]
    jaxpr, consts = (closed.jaxpr, closed.consts) if isinstance(closed, jex_core.ClosedJaxpr) else (closed, ())
    return eval_jaxpr(jaxpr, consts, invals)


_HIGHER_ORDER: dict[str, Callable[[Any, list[Any]], list[Any]]] = {
    "shard_map": _shard_map,
    "checkpoint": _checkpoint,
    "remat2": _checkpoint,
    "custom_jvp_call": _custom_rule,
    "custom_vjp_call": _custom_rule,
    "closed_call": _inline,
    "core_call": _inline,
}
