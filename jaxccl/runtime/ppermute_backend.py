"""The ppermute backend: any Schedule as rounds of ``jax.lax.ppermute`` inside the SPMD program.

:func:`execute` runs a :class:`~jaxccl.runtime.rounds.Plan` on a rank's flat
input buffer. Everything is ordinary JAX (``ppermute``, ``dynamic_slice``,
``dynamic_update_slice``, ``where``), so it lowers on every backend and runs
in multi-process programs on XLA's own collectives. Rank-dependent offsets and
message rows are small ``int32`` constant tables indexed by
``lax.axis_index``; ranks that do not take part in an instruction are masked
(their buffers keep their old values). Static offsets are used wherever all
active ranks agree, so symmetric schedules get static slices.

Reduction order is the schedule's: every reduce op is one
:func:`jaxccl.schedule.reduction.step` (the accumulator held by the rank, the
new term received or read from ``src``) in the order the plan executes the
ops, with the operator of the call (sum, max or min), so an ordered schedule
stays bitwise equal to ``jax.lax``; the caller applies
:func:`~jaxccl.schedule.reduction.finish` to the result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxccl.errors import ArgumentError
from jaxccl.runtime import axes as _axes
from jaxccl.runtime.rounds import Instr, Plan, plan
from jaxccl.schedule.ir import Buffer, OpKind, Schedule, period_elements
from jaxccl.schedule.reduction import ReduceOp, step

__all__ = ["execute", "fusion_barrier", "run_schedule"]


def run_schedule(schedule: Schedule, x: jax.Array, axis_name, op: ReduceOp = ReduceOp.SUM) -> jax.Array:
    """Runs ``schedule`` on this rank's flat input ``x`` over mesh axis ``axis_name``.

    Must be called inside ``jax.shard_map`` (it uses ``axis_index`` and
    ``ppermute``). ``axis_name`` is a mesh axis, a tuple of them or a
    :class:`~jaxccl.runtime.axes.GroupedAxis`. ``x`` is 1-D in the chunk layout of ``docs/schedule-ir.md``;
    the result is the rank's flat output buffer. ``op`` is the reduction
    operator of a reducing schedule.
    """
    lp = period_elements(schedule.collective, schedule.num_ranks, int(x.shape[0]))
    return execute(plan(schedule, lp), x, axis_name, op)


def fusion_barrier(x: jax.Array, axis_name, num_ranks: int) -> jax.Array:
    """``x`` through an identity ``ppermute`` over ``axis_name`` (``num_ranks`` ranks): a fusion barrier.

    XLA fuses nothing across a collective, so the value is materialized on
    both sides, as around ``lax``'s collectives. ``lax.optimization_barrier``
    is no substitute: XLA:CPU fuses across it (it is gone from the optimized
    HLO). With one rank there is nothing to permute and ``x`` is returned
    unchanged.
    """
    if num_ranks < 2:
        return x
    return _axes.ppermute(x, axis_name, perm=[(i, i) for i in range(num_ranks)])


class _Tables:
    """Per-rank table lookups (constants indexed by the rank), memoized per trace."""

    def __init__(self, idx: jax.Array):
        self.idx = idx
        self._cache: dict[tuple, jax.Array] = {}

    def pick(self, values: tuple) -> jax.Array:
        dtype = np.bool_ if isinstance(values[0], (bool, np.bool_)) else np.int32
        key = (dtype, tuple(values))
        got = self._cache.get(key)
        if got is None:
            table = jnp.asarray(np.asarray(values, dtype=dtype))
            got = lax.dynamic_index_in_dim(table, self.idx, keepdims=False)  # idx is in range: no wrapping
            self._cache[key] = got
        return got


def _uniform(values: tuple[int, ...], active: tuple[bool, ...]) -> int | None:
    """The common value of ``values`` over active ranks, or ``None`` if they differ."""
    seen = {v for v, a in zip(values, active) if a}
    return next(iter(seen)) if len(seen) == 1 else None


def _take(t: _Tables, buf: jax.Array, offs: tuple[int, ...], active: tuple[bool, ...], length: int) -> jax.Array:
    o = _uniform(offs, active)
    if o is not None:
        return lax.slice_in_dim(buf, o, o + length)
    return lax.dynamic_slice_in_dim(buf, t.pick(offs), length)


def _put(t: _Tables, buf: jax.Array, offs: tuple[int, ...], active: tuple[bool, ...], val: jax.Array) -> jax.Array:
    length = val.shape[0]
    everyone = all(active)
    o = _uniform(offs, active)
    start = o if o is not None else t.pick(offs)
    if not everyone:
        old = lax.dynamic_slice_in_dim(buf, start, length) if o is None else lax.slice_in_dim(buf, o, o + length)
        val = jnp.where(t.pick(active), val, old)
    return lax.dynamic_update_slice_in_dim(buf, val, start, 0)


class _Boxes:
    """Message boxes of one (round, length): a list of per-colour rows."""

    def __init__(self, rows: list[jax.Array]):
        self.rows = rows
        self._stacked: jax.Array | None = None

    def read(self, t: _Tables, row: tuple[int, ...], active: tuple[bool, ...]) -> jax.Array:
        c = _uniform(row, active)
        if c is not None:
            return self.rows[c]
        if self._stacked is None:
            self._stacked = jnp.stack(self.rows)
        return lax.dynamic_index_in_dim(self._stacked, t.pick(row), 0, keepdims=False)

    def write(self, t: _Tables, row: tuple[int, ...], active: tuple[bool, ...], val: jax.Array) -> None:
        c = _uniform(row, active)
        if c is not None and all(active):
            self.rows[c] = val
            return
        act = t.pick(active)
        for col in sorted({r for r, a in zip(row, active) if a}):
            mask = act if c is not None else act & (t.pick(row) == col)
            self.rows[col] = jnp.where(mask, val, self.rows[col])


def execute(p: Plan, x: jax.Array, axis_name, op: ReduceOp = ReduceOp.SUM) -> jax.Array:
    """Executes plan ``p`` on the flat input ``x`` of this rank (reducing with ``op``); returns the flat output."""
    if x.ndim != 1 or x.shape[0] != p.in_elems:
        raise ArgumentError(f"ppermute backend: expected a flat input of {p.in_elems} elements, got shape {x.shape}")
    idx = _axes.axis_index(axis_name) if p.num_ranks > 1 else jnp.int32(0)
    t = _Tables(idx)
    bufs = {
        Buffer.INPUT: x,
        Buffer.OUTPUT: jnp.zeros((p.out_elems,), x.dtype),
        Buffer.SCRATCH: jnp.zeros((p.scratch_elems,), x.dtype),
    }
    inbox: dict[tuple[int, int], _Boxes] = {}
    for d, rnd in enumerate(p.rounds):
        outbox = {(d, e.length): _Boxes([jnp.zeros((e.length,), x.dtype) for _ in e.perms]) for e in rnd.exchanges}
        for ins in rnd.instrs:
            _apply(t, ins, bufs, inbox, outbox, op)
        for e in rnd.exchanges:
            rows = outbox[(d, e.length)].rows
            inbox[(d, e.length)] = _Boxes([_axes.ppermute(row, axis_name, perm) for row, perm in zip(rows, e.perms)])
    return bufs[Buffer.OUTPUT]


def _apply(t: _Tables, ins: Instr, bufs: dict, inbox: dict, outbox: dict, op: ReduceOp) -> None:
    k, a, n = ins.kind, ins.active, ins.length
    msg = inbox[ins.msg].read(t, ins.msg_row, a) if ins.msg is not None else None
    src = _take(t, bufs[ins.src_buf], ins.src_off, a, n) if ins.src_buf is not None else None
    payload = None
    if k is OpKind.SEND:
        payload = src
    elif k is OpKind.RECV:
        bufs[ins.dst_buf] = _put(t, bufs[ins.dst_buf], ins.dst_off, a, msg)
    elif k is OpKind.RECV_COPY_SEND:
        bufs[ins.dst_buf] = _put(t, bufs[ins.dst_buf], ins.dst_off, a, msg)
        payload = msg
    elif k in (OpKind.RECV_REDUCE_COPY, OpKind.RECV_REDUCE_COPY_SEND):
        val = step(op, src, msg, jnp)
        bufs[ins.dst_buf] = _put(t, bufs[ins.dst_buf], ins.dst_off, a, val)
        payload = val if k is OpKind.RECV_REDUCE_COPY_SEND else None
    elif k is OpKind.RECV_REDUCE_SEND:
        payload = step(op, src, msg, jnp)
    elif k is OpKind.COPY:
        bufs[ins.dst_buf] = _put(t, bufs[ins.dst_buf], ins.dst_off, a, src)
    elif k is OpKind.REDUCE:
        cur = _take(t, bufs[ins.dst_buf], ins.dst_off, a, n)
        bufs[ins.dst_buf] = _put(t, bufs[ins.dst_buf], ins.dst_off, a, step(op, cur, src, jnp))
    else:  # pragma: no cover - NOPs are dropped by the planner
        raise AssertionError(k)
    if ins.out is not None:
        outbox[ins.out].write(t, ins.out_row, a, payload)
