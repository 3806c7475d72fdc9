"""The four collectives on 8 emulated CPU devices: jaxccl's cpu executor against jax.lax.

An nccl-tests-style table per collective (all_gather, all_to_all, psum_scatter,
psum): per-rank input size, median time over ``--runs`` timed calls after
warm-up, algorithm bandwidth (bytes of one rank's output buffer / time, as
nccl-tests) and the time ratio jaxccl / jax.lax. ``jaxccl-cpu-unprepared`` is the
cpu executor with its output preparation turned off (no prefault, no huge
pages: docs/executor.md, "Output memory"), ``jaxccl-cpu-noidentity`` the cpu executor whose
receivers do not check message identities (docs/executor.md, "Message identity"), both for
comparisons only. The implementations are timed
interleaved (each run calls every implementation once, in turn), so both see
the same machine load; medians over the runs. Every jaxccl result is checked
bitwise against ``jax.lax`` once per size (float32 inputs, random).

Acceptance: jaxccl / jax.lax <= 1.0 at every per-rank size >= 1 MiB and <= 1.3 at 4 KiB, for every
collective.

Usage:
    nice -n 10 python -m benchmarks.executor.cpu [--quick] [--json results.json]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import jaxccl
from jaxccl.cli.bench_run import implementation_runner  # axis "d"
from jaxccl.util import report

NUM_DEVICES = 8
COLLECTIVES = ("all_gather", "all_to_all", "psum_scatter", "psum")
# The last two are the cpu executor with settings turned off (for comparisons): see the module docstring.
IMPLS = ("jaxccl-cpu", "lax", "jaxccl-ppermute", "jaxccl-cpu-unprepared", "jaxccl-cpu-noidentity")
FULL_SIZES = [4 << 10 << (2 * i) for i in range(7)]  # 4 KiB, 16 KiB, ..., 16 MiB
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20]
ACCEPT = ((1 << 20, None, 1.0), (4 << 10, 4 << 10, 1.3))  # (from size, to size or None, largest ratio)


def add_sweep_options(ap: argparse.ArgumentParser, impls: tuple[str, ...], default_impls: str) -> None:
    """The options of an executor sweep against ``jax.lax``: sizes, runs, warm-up, implementations, JSON."""
    ap.add_argument("--quick", action="store_true", help="small sizes and few runs (smoke test)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per point (default 15; --quick: 5)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--impls", default=default_impls, help=f"comma-separated, from {impls}")
    ap.add_argument("--sizes", default=None, help="comma-separated per-rank sizes in bytes")


def sweep_options(
    ap: argparse.ArgumentParser, args: argparse.Namespace, impls: tuple[str, ...]
) -> tuple[int, list[int], list[str]]:
    """``(runs, sizes, implementations)`` of :func:`add_sweep_options`' options; an unknown one is a usage error."""
    runs = args.runs or (5 if args.quick else 15)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else QUICK_SIZES if args.quick else FULL_SIZES
    chosen = [i for i in args.impls.split(",") if i]
    for i in chosen:
        if i not in impls:
            ap.error(f"unknown implementation {i!r}; choose from {impls}")
    return runs, sizes, chosen


def measure_interleaved(
    fns: dict[str, Callable[[Any], Any]], x: Any, *, warmup: int, runs: int, rotate: bool = False
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """``warmup`` calls of each implementation, then ``runs`` rounds calling each once in turn (``rotate``: the
    order rotated from round to round). Returns each one's first result (numpy) and its times (seconds)."""
    import numpy as np

    first = {}
    for impl, fn in fns.items():
        for _ in range(warmup):
            out = fn(x)
            out.block_until_ready()
        first[impl] = np.asarray(out)
        del out
    impls = list(fns)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for run in range(runs):
        k = run % len(impls) if rotate else 0
        for impl in impls[k:] + impls[:k]:
            t0 = time.perf_counter()
            out = fns[impl](x)
            out.block_until_ready()
            times[impl].append(time.perf_counter() - t0)
            del out
    gc.collect()
    return first, times


def point_rows(first: dict[str, Any], times: dict[str, list[float]], size: int, out_bytes: int) -> list[dict[str, Any]]:
    """One row per implementation: median time, algbw of ``out_bytes`` and the ratio to ``lax`` (when measured),
    and whether its result is bitwise ``lax``'s."""
    import numpy as np

    lax_t = report.median(times["lax"]) if "lax" in times else float("nan")
    rows = []
    for impl, ts in times.items():
        t = report.median(ts)
        rows.append(
            {
                "impl": impl,
                "size": size,
                "size_h": report.format_bytes(size),
                "time_us": t * 1e6,
                "algbw_GBs": out_bytes / t / 1e9,
                "ratio_vs_lax": t / lax_t,
                "bitwise_ok": None if "lax" not in first else bool(np.array_equal(first[impl], first["lax"])),
            }
        )
    return rows


def _bound(size: int) -> float | None:
    for lo, hi, ratio in ACCEPT:
        if size >= lo and (hi is None or size <= hi):
            return ratio
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_options(ap, IMPLS, "jaxccl-cpu,lax")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    args = ap.parse_args(argv)
    runs, sizes, impls = sweep_options(ap, args, IMPLS)
    collectives = [c for c in args.collectives.split(",") if c]
    for c in collectives:
        if c not in COLLECTIVES:
            ap.error(f"unknown collective {c!r}; choose from {COLLECTIVES}")

    jaxccl.emulate(NUM_DEVICES)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    from jaxccl.runtime import native

    cpu = jaxccl.Communicator(mesh, "d", backend="cpu")
    comms = {
        "jaxccl-cpu": cpu,
        "jaxccl-cpu-unprepared": cpu,
        "jaxccl-cpu-noidentity": cpu,
        "jaxccl-ppermute": jaxccl.Communicator(mesh, "d", backend="ppermute"),
    }
    settings_off = {  # the executor settings a variant turns off while its calls run
        "jaxccl-cpu-unprepared": (native.set_prefault, native.set_huge_pages),
        "jaxccl-cpu-noidentity": (native.set_identity_checks,),
    }

    def build(collective: str, impl: str):
        run = implementation_runner(mesh, collective, comms.get(impl))
        setters = settings_off.get(impl, ())
        if not setters:
            return run

        def variant(x):  # the settings apply while the call runs (XLA:CPU dispatches asynchronously)
            for set_on in setters:
                set_on(False)
            try:
                out = run(x)
                out.block_until_ready()
                return out
            finally:
                for set_on in setters:
                    set_on(True)

        return variant

    rows = []
    points = [(c, s) for c in collectives for s in sizes]
    for collective, size in report.progress(points, label="executor_cpu"):
        elems = size // 4  # float32 per rank
        if elems % n:
            continue
        data = np.random.default_rng(size).standard_normal(n * elems).astype(np.float32)
        x = jax.device_put(data, sharding)
        out_bytes = {"all_gather": size * n, "psum_scatter": size // n}.get(collective, size)
        fns = {impl: build(collective, impl) for impl in impls}
        first, times = measure_interleaved(fns, x, warmup=args.warmup, runs=runs)
        rows += [{"collective": collective, **row} for row in point_rows(first, times, size, out_bytes)]
        del x

    cols = ["size_h", "impl", "time_us", "algbw_GBs", "ratio_vs_lax", "bitwise_ok"]
    for collective in collectives:
        sel = [r for r in rows if r["collective"] == collective]
        print(f"\n{collective}, {n} devices, float32, per-rank input size; algbw = one rank's output bytes / time")
        report.print_table(sel, cols)

    judged = [r for r in rows if r["impl"] == "jaxccl-cpu" and _bound(r["size"]) is not None and "lax" in impls]
    failing = [r for r in judged if r["ratio_vs_lax"] > _bound(r["size"])]
    if judged:
        print(
            "\nacceptance (jaxccl-cpu / lax <= 1.0 at >= 1 MiB per rank, <= 1.3 at 4 KiB): "
            + ("PASS" if not failing else f"FAIL at {[(r['collective'], r['size_h']) for r in failing]}")
        )
    wrong = report.print_differing(rows, ["collective", "impl", "size"])
    if args.json:
        report.write_json(
            args.json,
            {
                "benchmark": "executor_cpu",
                "num_devices": n,
                "runs": runs,
                "warmup": args.warmup,
                "interleaved": True,
                "quick": args.quick,
                "rows": rows,
                "acceptance": {
                    "criterion": "jaxccl-cpu / lax <= 1.0 at per-rank size >= 1 MiB, <= 1.3 at 4 KiB",
                    "pass": (not failing) if judged else None,
                    "failing": [(r["collective"], r["size"], r["ratio_vs_lax"]) for r in failing],
                },
            },
        )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
