"""The reduction operators and their one rule per step, in Python (``xla_ffi/core/reduce.h`` in C++).

A reduction is a property of the *call*, not of the schedule: the same
ReduceScatter/AllReduce schedule computes a sum, a max or a min. What a
schedule fixes is the order of the terms; with a rank-ordered schedule the
result is bitwise equal to XLA:CPU's all-reduce, which folds the ranks in
ascending order starting from the operator's identity, one step at a time in
the element type (measured bit for bit, ``tests/schedule/test_reductions.py``):

====== ================================== ==========================================
op     step (``acc`` so far, ``x`` new)   identity and what it implies
====== ================================== ==========================================
sum    ``x + acc``                        ``+0``: a sum of negative zeros is ``+0``
max    ``x if acc < x else acc``          ``-inf``: NaN terms are skipped, ties keep
                                          the earlier term (``max(-0, +0) = -0``)
min    ``x if x < acc else acc``          ``+inf``
====== ================================== ==========================================

float16 therefore rounds to float16 after every step. Of two NaNs a float32,
float64 or complex64 sum keeps the new term's, a float16 sum the accumulator's
(payload and sign are part of "bitwise"; for complex128 XLA:CPU's choice depends
on the element's position, which this rule does not reproduce). float32 and float64 run with the CPU's
denormals-are-zero and flush-to-zero modes: a subnormal term counts as a zero of
its sign, a max/min returns it as that zero, a subnormal sum becomes zero.
XLA and the native executor set these modes in hardware; numpy code emulates
them here, and max/min flush explicitly (a select does not flush). bfloat16 is
reduced in float32 (XLA:CPU promotes it; :func:`wire_dtype`): a sum rounds
once at the end, and a subnormal bfloat16 term of a max is flushed too.
Integer sums wrap. On GPUs NCCL's ring/tree orders are
the reference instead (its sums round after every step in the element type,
bfloat16 included); a GPU run is bitwise equal to NCCL only with the same
order.

Across processes XLA:CPU's reductions are gloo's instead (every device is a gloo rank, ranked along
the collective's axes in mesh order): a ring all-reduce whose chunk ``c`` folds the ranks
downwards from ``c - 1``, ``x_c + (x_(c+1) + (... + (x_(c-2) + x_(c-1))))`` (indices mod N), on
chunks of :func:`gloo_ring_chunk` elements; a schedule with that order
(:func:`jaxccl.runtime.default_schedules.gloo_ring_allreduce`) gives gloo's sums. A reduce-scatter
across processes is gloo's halving-doubling instead, whose every element is one tree over the
ranks, :func:`gloo_tree` (``info["fold"] == "gloo_tree"``, proven by the reference interpreter). Three
differences remain: gloo's fold has no identity (a sum of negative zeros stays ``-0``, this rule
makes it ``+0``), its float16 addition drops the incoming partial sum where its ``float16``
comparison mistakes bits for an integer (large values only), and its NaN choice is the hardware's.

A schedule's fold starts from its first term, not from the identity;
:func:`step` and :func:`finish` are written so that the two agree bitwise: max
and min replace a NaN accumulator by the identity, and a float sum's ``-0`` is
turned into ``+0`` once at the end (:func:`finish`). Both take the array
module as ``xp`` (``numpy`` or ``jax.numpy``), so the reference interpreter and
the ppermute backend run the same code.

>>> import numpy as np
>>> xs = [np.float32(np.nan), np.float32(-0.0), np.float32(0.0)]
>>> acc = xs[0]
>>> for x in xs[1:]:
...     acc = step(ReduceOp.MAX, acc, x)
>>> float(acc), bool(np.signbit(acc))
(-0.0, True)
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from jaxccl.errors import ArgumentError

__all__ = ["ReduceOp", "finish", "gloo_ring_chunk", "gloo_tree", "reduce_terms", "step", "supports", "wire_dtype"]

GLOO_MAX_SEGMENT_BYTES = 1 << 20  # gloo::AllreduceOptions' default maxSegmentSize, which XLA:CPU keeps


class ReduceOp(enum.IntEnum):
    """A reduction operator; the value is the native executor's ``reduce_op`` attribute."""

    SUM = 0
    MAX = 1
    MIN = 2


def _is_float(dtype: Any) -> bool:
    dt = np.dtype(dtype)
    return dt.kind == "f" or dt.name == "bfloat16"


def supports(op: ReduceOp, dtype: Any) -> bool:
    """Whether jaxccl (and ``jax.lax``) reduces ``dtype`` with ``op``.

    Sums: integers, floats (float16, bfloat16, float32, float64) and complex
    numbers. Max and min: integers, floats and bool (complex numbers have no
    order). Sub-byte and float8 types are not reduced.

    >>> supports(ReduceOp.SUM, np.complex64), supports(ReduceOp.MAX, np.complex64)
    (True, False)
    >>> supports(ReduceOp.MIN, np.bool_), supports(ReduceOp.SUM, np.bool_)
    (True, False)
    """
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        return dt.itemsize in (1, 2, 4, 8)
    if _is_float(dt):
        return dt.name in ("float16", "bfloat16", "float32", "float64")
    if dt.kind == "c":
        return op is ReduceOp.SUM
    if dt.kind == "b":
        return op is not ReduceOp.SUM
    return False


def wire_dtype(op: ReduceOp, dtype: Any) -> np.dtype:
    """The dtype the collective reduces in: bfloat16 in float32 (as XLA:CPU), else ``dtype``.

    The operator does not matter today; it is an argument because the rule is per (operator, dtype).

    >>> import ml_dtypes
    >>> wire_dtype(ReduceOp.SUM, ml_dtypes.bfloat16).name, wire_dtype(ReduceOp.MAX, ml_dtypes.bfloat16).name
    ('float32', 'float32')
    >>> wire_dtype(ReduceOp.SUM, np.float16).name
    'float16'
    """
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":
        return np.dtype(np.float32)
    return dt


def gloo_ring_chunk(elems: int, itemsize: int, ranks: int) -> int:
    """Elements per chunk of gloo's ring all-reduce of ``elems`` elements of ``itemsize`` bytes over ``ranks``.

    gloo (``allreduce.cc``, ``ring``) cuts the buffer into ``S`` segments of at most 1 MiB, ``S`` a
    multiple of ``ranks`` and at least ``2 * ranks``, each segment rounded up to whole elements;
    rank ``r``'s chunk is segments ``r * S / ranks`` on (its last chunks may be short or empty).
    Every element of a chunk is folded along the same ring path, so this size fixes the order.
    ``itemsize`` is that of the reduced dtype (:func:`wire_dtype`: 4 for bfloat16).

    >>> gloo_ring_chunk(1, 4, 8), gloo_ring_chunk(65537, 4, 8), gloo_ring_chunk(4_194_305, 4, 8)
    (2, 8194, 524289)
    """

    def ceil_div(a: int, b: int) -> int:
        return -(a // -b)

    total = elems * itemsize
    max_segment = itemsize * max(1, GLOO_MAX_SEGMENT_BYTES // itemsize)
    segments = ceil_div(max(ceil_div(total, max_segment), 2 * ranks), ranks) * ranks
    segment_elems = ceil_div(ceil_div(total, segments), itemsize)
    return segments // ranks * segment_elems


GlooTree = Any  # a rank (a leaf, int) or a pair (left, right) of trees: the sum left + right


def gloo_tree(n: int) -> GlooTree:
    """The order of gloo's halving-doubling sums (XLA:CPU's reduce-scatter across processes) over ``n`` ranks.

    A binary tree as nested pairs: a leaf is a rank (``int``), a node ``(left, right)`` the sum
    ``left + right`` (sums commute bit for bit: only the shape matters). Every element of every
    shard is summed along this one tree, whatever the chunk size. For a power of two it is the
    butterfly tree, lowest bit first: ``(x0 + x1) + (x2 + x3)`` for 4 ranks. Other counts split
    into gloo's binary blocks, largest first (6 = 4 + 2), each a butterfly tree, folded from the
    smallest up: ``T(block 0) + (T(block 1) + (... + T(block k)))`` (measured against XLA at 3 and
    6 ranks). :func:`jaxccl.runtime.default_schedules.gloo_tree_reduce_scatter` and
    :func:`jaxccl.synth.tree_reduce_scatter.tree_reduce_scatter` sum along it; the reference
    interpreter proves it of every schedule with ``info["fold"] == "gloo_tree"``.

    >>> gloo_tree(8)
    (((0, 1), (2, 3)), ((4, 5), (6, 7)))
    >>> gloo_tree(6), gloo_tree(7), gloo_tree(3), gloo_tree(1)
    ((((0, 1), (2, 3)), (4, 5)), (((0, 1), (2, 3)), ((4, 5), 6)), ((0, 1), 2), 0)
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ArgumentError(f"gloo_tree: needs at least one rank, got {n!r}")
    blocks: list[GlooTree] = []
    start = 0
    for bit in reversed(range(n.bit_length())):
        if n >> bit & 1:
            level: list[GlooTree] = list(range(start, start + (1 << bit)))
            while len(level) > 1:  # the butterfly: neighbours first, then pairs of pairs
                level = [(a, b) for a, b in zip(level[::2], level[1::2])]
            blocks.append(level[0])
            start += 1 << bit
    tree = blocks[-1]
    for block in reversed(blocks[:-1]):
        tree = (block, tree)
    return tree


def step(op: ReduceOp, acc: Any, x: Any, xp: Any = np) -> Any:
    """One step of the fold: ``acc`` (the terms so far) combined with the new term ``x``.

    Args:
        op: the operator.
        acc: the accumulator (the first term when the fold starts).
        x: the next term, same shape and dtype.
        xp: the array module, ``numpy`` or ``jax.numpy``.

    >>> float(step(ReduceOp.MIN, np.float32(np.nan), np.float32(np.nan)))  # both skipped: the identity
    inf
    >>> step(ReduceOp.SUM, np.int8(127), np.int8(1)).item()  # wraps
    -128
    """
    kind = np.dtype(acc.dtype).kind
    if op is ReduceOp.SUM:
        if kind == "c":  # two float sums
            return _complex(_float_sum(xp.real(acc), xp.real(x), xp), _float_sum(xp.imag(acc), xp.imag(x), xp), acc, xp)
        return _float_sum(acc, x, xp) if _is_float(acc.dtype) else x + acc
    floating = _is_float(acc.dtype)
    if floating:
        acc, x = _flush(acc, xp), _flush(x, xp)
    if op is ReduceOp.MAX:
        if floating:
            acc = xp.where(xp.isnan(acc), xp.asarray(-np.inf, acc.dtype), acc)
        return xp.where(acc < x, x, acc)
    if floating:
        acc = xp.where(xp.isnan(acc), xp.asarray(np.inf, acc.dtype), acc)
    return xp.where(x < acc, x, acc)


def finish(op: ReduceOp, y: Any, xp: Any = np) -> Any:
    """The fold's result made equal to one that starts from the identity: a float sum's ``-0`` becomes ``+0``.

    Complex sums are fixed per component. Written as a select because XLA folds ``y + 0``.

    >>> bool(np.signbit(finish(ReduceOp.SUM, np.float32(-0.0))))
    False
    >>> finish(ReduceOp.SUM, np.array([complex(-0.0, -0.0)], np.complex64)).view(np.uint32).tolist()
    [0, 0]
    """
    kind = np.dtype(y.dtype).kind
    if op is not ReduceOp.SUM or not (_is_float(y.dtype) or kind == "c"):
        return y
    if kind != "c":
        return _plus_zero(y, xp)
    return _complex(_plus_zero(xp.real(y), xp), _plus_zero(xp.imag(y), xp), y, xp)


def _float_sum(acc: Any, x: Any, xp: Any) -> Any:
    # Which NaN of two is chosen explicitly, since compilers commute additions (XLA's own `x + acc` can
    # return either): XLA:CPU's all-reduce keeps the new term's in f32/f64 and the accumulator's in f16.
    if np.dtype(acc.dtype).itemsize == 2:
        return xp.where(xp.isnan(acc), acc, x + acc)
    if xp is np:  # XLA and the native executor have the modes in hardware
        acc, x = _flush(acc, xp), _flush(x, xp)
        return _flush(np.where(np.isnan(x), x, x + acc), xp)
    return xp.where(xp.isnan(x), x, x + acc)


def _flush(v: Any, xp: Any) -> Any:
    """Subnormal float32/float64 values as zeros of their sign (denormals-are-zero, flush-to-zero)."""
    dt = np.dtype(v.dtype)
    if dt.kind != "f" or dt.itemsize < 4:
        return v
    tiny = xp.asarray(np.finfo(dt).tiny, dt)
    return xp.where(xp.abs(v) < tiny, xp.where(xp.signbit(v), -xp.zeros((), dt), xp.zeros((), dt)), v)


def _complex(re: Any, im: Any, like: Any, xp: Any) -> Any:
    """The complex array of dtype ``like.dtype`` with parts ``re`` and ``im`` (exactly, even for inf/NaN parts)."""
    if xp is np:
        out = np.array(like, copy=True)
        out.real, out.imag = re, im
        return out
    from jax import lax  # the other array module is jax.numpy

    return lax.complex(re, im)


def _plus_zero(y: Any, xp: Any) -> Any:
    zero = xp.zeros((), y.dtype)
    return xp.where(y == zero, zero, y)


def reduce_terms(op: ReduceOp, terms: Any, xp: Any = np) -> Any:
    """The reference reduction of ``terms[0], terms[1], ...`` in that order (rank order).

    >>> reduce_terms(ReduceOp.SUM, np.array([[-0.0], [-0.0]], np.float32)).tolist()
    [0.0]
    """
    acc = terms[0]
    for x in terms[1:]:
        acc = step(op, acc, x, xp)
    return finish(op, acc, xp)
