"""What ``jaxccl bench`` computes without JAX: the size sweep, buffer sizes, bus bandwidth and the table.

Sizes follow nccl-tests: ``size`` is the bytes of one rank's larger buffer
(AllGather: its output; ReduceScatter: its input; AllToAll and AllReduce:
input and output, which are equal), ``count`` the elements of that buffer,
``algbw = size / time`` and ``busbw = algbw * factor`` with the factor of
each collective (:func:`bus_factor`).

Example:
    >>> sweep(4 << 10, 64 << 10, 4)
    [4096, 16384, 65536]
    >>> buffer_elements("all_gather", 1000, num_ranks=8, itemsize=4)
    248
    >>> bus_factor("psum", 8)
    1.75
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from jaxccl.errors import UsageError
from jaxccl.schedule.reduction import ReduceOp, supports
from jaxccl.util.options import choose

__all__ = [
    "COLLECTIVES",
    "DTYPES",
    "REDOP",
    "SCHEDULE_COLLECTIVE",
    "bus_factor",
    "buffer_elements",
    "input_elements",
    "print_table",
    "refusal",
    "summary",
    "sweep",
]

COLLECTIVES = ("all_gather", "all_to_all", "psum_scatter", "psum", "pmax", "pmin", "pmean")
# The all-reduce family: one AllReduce schedule serves them all, with the call's operator.
ALL_REDUCES = ("psum", "pmax", "pmin", "pmean")
# The schedule IR's name of each collective (jaxccl.schedule.Collective values).
SCHEDULE_COLLECTIVE = {
    "all_gather": "all_gather",
    "all_to_all": "all_to_all",
    "psum_scatter": "reduce_scatter",
    **{c: "all_reduce" for c in ALL_REDUCES},
}
# nccl-tests' redop column (pmean: psum, then a division by N, as jax.lax.pmean).
REDOP = {"psum_scatter": "sum", "psum": "sum", "pmax": "max", "pmin": "min", "pmean": "avg"}
REDUCTIONS = tuple(REDOP)
# Every dtype jaxccl moves; the 64-bit ones turn on JAX's x64 mode for the run.
DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "complex64",
    "complex128",
    "bool",
)
MAX_POINTS = 64


def sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """nccl-tests' ``-b -e -f``: ``min_bytes``, times ``factor`` while at most ``max_bytes``.

    >>> sweep(1 << 20, 1 << 20, 2)
    [1048576]
    """
    if min_bytes > max_bytes:
        raise UsageError(f"--min-bytes {min_bytes} is larger than --max-bytes {max_bytes}")
    if factor < 2 and min_bytes < max_bytes:
        raise UsageError(f"--step-factor must be at least 2 to go from {min_bytes} to {max_bytes} bytes")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
        if len(sizes) > MAX_POINTS:
            raise UsageError(f"the sweep has more than {MAX_POINTS} sizes; raise --step-factor")
    return sizes


def bus_factor(collective: str, num_ranks: int) -> float:
    """busbw / algbw as nccl-tests defines it: what each rank's busiest link carries, per byte of ``size``.

    AllGather, ReduceScatter and AllToAll move ``(N-1)/N`` of the buffer over
    the links of each rank; AllReduce (``psum``, ``pmax``, ``pmin``, ``pmean``)
    is a ReduceScatter plus an AllGather, ``2(N-1)/N``. With these factors busbw is comparable with the link speed
    whatever the collective and the rank count.

    >>> bus_factor("all_gather", 4), bus_factor("all_to_all", 4), bus_factor("psum_scatter", 4)
    (0.75, 0.75, 0.75)
    """
    n = num_ranks
    choose("collective", collective, COLLECTIVES)
    if collective in ALL_REDUCES:
        return 2 * (n - 1) / n
    return (n - 1) / n


def refusal(collective: str, dtype: str) -> str | None:
    """Why ``collective`` does not take ``dtype`` (``None`` when it does), as jaxccl and ``jax.lax`` decide.

    AllGather and AllToAll move every dtype; sums take integers, floats and
    complex numbers (``psum`` and ``pmean`` also bool, summed as int32);
    ``pmax``/``pmin`` take integers, floats and bool (complex numbers have no order).

    >>> refusal("pmax", "complex64")
    'pmax has no max of complex64 (complex numbers have no order)'
    >>> refusal("psum", "bool") is None, refusal("psum_scatter", "bool")
    (True, 'psum_scatter has no sum of bool')
    """
    if collective not in REDOP:
        return None
    op = {"max": ReduceOp.MAX, "min": ReduceOp.MIN}.get(REDOP[collective], ReduceOp.SUM)
    if dtype == "bool" and collective in ("psum", "pmean"):
        return None
    if supports(op, _numpy_dtype(dtype)):
        return None
    why = " (complex numbers have no order)" if dtype.startswith("complex") else ""
    return f"{collective} has no {op.name.lower()} of {dtype}{why}"


def _numpy_dtype(name: str) -> Any:
    import ml_dtypes
    import numpy as np

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def buffer_elements(collective: str, size: int, *, num_ranks: int, itemsize: int) -> int:
    """Elements of one rank's larger buffer for a requested ``size``: rounded down to a multiple of ``num_ranks``.

    Every collective here splits its larger buffer into ``num_ranks`` equal
    blocks (nccl-tests rounds the same way); 0 means the size is too small.

    >>> buffer_elements("psum", 4096, num_ranks=8, itemsize=2)
    2048
    """
    choose("collective", collective, COLLECTIVES)
    return size // itemsize // num_ranks * num_ranks


def input_elements(collective: str, count: int, num_ranks: int) -> int:
    """Elements of one rank's input for a buffer of ``count`` elements (AllGather's input is a block of it).

    >>> input_elements("all_gather", 64, 8), input_elements("psum_scatter", 64, 8)
    (8, 64)
    """
    return count // num_ranks if collective == "all_gather" else count


_HEADER = (
    ("size", "(B)", 12),
    ("count", "(elements)", 12),
    ("type", "", 8),
    ("redop", "", 6),
    ("time", "(us)", 9),
    ("algbw", "(GB/s)", 8),
    ("busbw", "(GB/s)", 8),
    ("#wrong", "", 7),
    ("lax time", "(us)", 9),
    ("lax busbw", "(GB/s)", 10),
    ("ratio", "(jaxccl/lax)", 12),
)


def _cells(row: Mapping[str, Any]) -> list[str]:
    return [
        str(row["size"]),
        str(row["count"]),
        row["type"],
        row["redop"],
        f"{row['time_us']:.1f}",
        f"{row['algbw_GBs']:.3f}",
        f"{row['busbw_GBs']:.3f}",
        str(row["wrong"]),
        f"{row['lax_time_us']:.1f}",
        f"{row['lax_busbw_GBs']:.3f}",
        f"{row['ratio']:.2f}",
    ]


def print_table(collective: str, heading: Sequence[str], rows: Sequence[Mapping[str, Any]], out: TextIO) -> None:
    """One collective's rows as nccl-tests prints them (``#`` header lines, right-aligned columns).

    >>> import sys
    >>> row = dict(size=4096, count=1024, type="float32", redop="none", time_us=50.0, algbw_GBs=0.08192,
    ...            busbw_GBs=0.07168, wrong=0, lax_time_us=40.0, lax_busbw_GBs=0.0896, ratio=1.25)
    >>> print_table("all_gather", ["8 ranks"], [row], sys.stdout)  # doctest: +NORMALIZE_WHITESPACE
    #
    # all_gather: 8 ranks
    #
    #       size        count     type  redop      time    algbw    busbw  #wrong  lax time  lax busbw        ratio
    #        (B)   (elements)                      (us)   (GB/s)   (GB/s)              (us)     (GB/s)  (jaxccl/lax)
            4096         1024  float32   none      50.0    0.082    0.072       0      40.0      0.090         1.25
    """
    out.write("#\n")
    out.write(f"# {collective}: {'; '.join(heading)}\n")
    out.write("#\n")
    out.write("#" + " ".join(name.rjust(w) for name, _, w in _HEADER)[1:] + "\n")
    out.write("#" + " ".join(unit.rjust(w) for _, unit, w in _HEADER)[1:] + "\n")
    for row in rows:
        out.write(" ".join(c.rjust(w) for c, (_, _, w) in zip(_cells(row), _HEADER)) + "\n")
    out.flush()


def summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Average busbw (GB/s), the worst (largest) time ratio jaxccl / jax.lax and where, and the total #wrong.

    >>> summary([dict(collective="psum", size=8, busbw_GBs=1.0, ratio=2.0, wrong=0),
    ...          dict(collective="psum", size=16, busbw_GBs=3.0, ratio=0.5, wrong=3)])
    {'avg_busbw_GBs': 2.0, 'worst_ratio': 2.0, 'worst_at': ['psum', 8], 'total_wrong': 3}
    """
    if not rows:
        return {"avg_busbw_GBs": math.nan, "worst_ratio": math.nan, "worst_at": None, "total_wrong": 0}
    worst = max(rows, key=lambda r: r["ratio"])
    return {
        "avg_busbw_GBs": sum(r["busbw_GBs"] for r in rows) / len(rows),
        "worst_ratio": worst["ratio"],
        "worst_at": [worst["collective"], worst["size"]],
        "total_wrong": sum(int(r["wrong"]) for r in rows),
    }
