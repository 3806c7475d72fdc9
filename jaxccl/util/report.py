"""Small reporting helpers shared by benchmarks and the command line: progress, tables, JSON."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TextIO, TypeVar

from jaxccl.errors import ArgumentError

T = TypeVar("T")


def progress(
    items: Iterable[T], *, total: int | None = None, label: str = "", stream: TextIO | None = None
) -> Iterator[T]:
    """Yields ``items`` while drawing a one-line progress bar on stderr.

    Redraws in place on a terminal; elsewhere prints one line per item so logs stay readable.

    >>> list(progress(range(3), stream=open(os.devnull, "w")))
    [0, 1, 2]
    """
    out = stream or sys.stderr
    seq = list(items) if total is None and not hasattr(items, "__len__") else items
    n = total if total is not None else len(seq)  # type: ignore[arg-type]
    tty = hasattr(out, "isatty") and out.isatty()
    start = time.perf_counter()
    for i, item in enumerate(seq, 1):
        yield item
        done = 30 * i // max(n, 1)
        elapsed = time.perf_counter() - start
        line = f"{label} [{'#' * done}{'.' * (30 - done)}] {i}/{n} {elapsed:6.1f}s"
        out.write(("\r" + line) if tty else (line + "\n"))
        out.flush()
    if tty:
        out.write("\n")


def timed_runs(fn: Callable[[], T], runs: int, solve_time: Callable[[T], float]) -> tuple[T, list[float], list[float]]:
    """Calls ``fn`` ``runs`` times; returns the last result, the solve times ``solve_time(result)``
    reports and the wall times of the whole calls (seconds)."""
    solves: list[float] = []
    totals: list[float] = []
    out: T | None = None
    for _ in range(runs):
        t = time.perf_counter()
        out = fn()
        totals.append(time.perf_counter() - t)
        solves.append(float(solve_time(out)))
    if out is None:
        raise ArgumentError("timed_runs needs runs >= 1")
    return out, solves, totals


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (NaN if empty)."""
    return statistics.median(values) if values else math.nan


def format_bytes(n: float) -> str:
    """Human-readable byte count: ``format_bytes(4096) == '4 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if float(n).is_integer() else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def print_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
    *,
    stream: TextIO | None = None,
    floatfmt: str = ".4g",
) -> None:
    """Prints ``rows`` (dicts) as an aligned text table with the given column order."""
    out = stream or sys.stdout
    if not rows:
        out.write("(no rows)\n")
        return
    cols = list(columns or rows[0].keys())

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return format(v, floatfmt)
        return str(v)

    table = [[cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(cols)]
    out.write("  ".join(c.rjust(w) for c, w in zip(cols, widths)) + "\n")
    for row in table:
        out.write("  ".join(v.rjust(w) for v, w in zip(row, widths)) + "\n")


def print_differing(rows: Sequence[Mapping[str, Any]], fields: Sequence[str], reference: str = "jax.lax") -> bool:
    """Prints the rows whose result differed from ``reference`` (``bitwise_ok`` False), named by ``fields``;
    returns whether there were any (a benchmark's exit status).

    Example:
        >>> print_differing([{"impl": "ring", "size": 4096, "bitwise_ok": False}], ["impl", "size"])
        <BLANKLINE>
        results differing from jax.lax: [('ring', 4096)]
        True
    """
    wrong = [tuple(r[f] for f in fields) for r in rows if r.get("bitwise_ok") is False]
    if wrong:
        print(f"\nresults differing from {reference}: {wrong}")
    return bool(wrong)


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Writes ``data`` as indented JSON, creating parent folders; NaN/inf become null."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, Mapping):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    path = os.fspath(path)
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(clean(data), f, indent=2)
        f.write("\n")
