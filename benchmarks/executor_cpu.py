"""AllGather and AllToAll on 8 emulated CPU devices: jaxccl's cpu executor vs jax.lax vs the ppermute backend.

An nccl-tests-style table per collective: per-rank input size, median time
over ``--runs`` timed calls (after warm-up), algorithm bandwidth (bytes of one
rank's output buffer / time, as nccl-tests), bus bandwidth
(``algbw * (N-1)/N`` for both collectives, as nccl-tests) and the time ratio
to ``jax.lax`` measured in the same run. Every jaxccl result is checked
bitwise against ``jax.lax`` once per size.

Acceptance figure: the jaxccl cpu AllGather takes at most 1.1x the time of
``jax.lax.all_gather`` at every per-rank size >= 1 MiB.

Usage:
    PYTHONPATH=. nice -n 10 python benchmarks/executor_cpu.py [--quick] [--json results.json]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import jaxccl
from jaxccl import report

NUM_DEVICES = 8
IMPLS = ("jaxccl-cpu", "lax", "jaxccl-ppermute")
FULL_SIZES = [4 << 10 << (2 * i) for i in range(7)]  # 4 KiB, 16 KiB, ..., 16 MiB
FULL_SIZES.append(64 << 20)
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20]
ACCEPT_RATIO = 1.1
ACCEPT_FROM = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and few runs (smoke test)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per point (default 9; --quick: 3)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--collectives", default="all_gather,all_to_all")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument(
        "--max-ppermute-bytes",
        type=int,
        default=64 << 20,
        help="largest per-rank size for the ppermute backend (it needs several output-sized temporaries)",
    )
    args = ap.parse_args(argv)
    runs = args.runs or (3 if args.quick else 9)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    impls = [i for i in args.impls.split(",") if i]
    for i in impls:
        if i not in IMPLS:
            ap.error(f"unknown implementation {i!r}; choose from {IMPLS}")

    jaxccl.emulate(NUM_DEVICES)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    comms = {
        "jaxccl-cpu": jaxccl.Communicator(mesh, "d", backend="cpu"),
        "jaxccl-ppermute": jaxccl.Communicator(mesh, "d", backend="ppermute"),
    }

    def build(collective: str, impl: str):
        lib = jax.lax if impl == "lax" else jaxccl
        if collective == "all_gather":
            body = lambda v: lib.all_gather(v, "d", tiled=True)  # noqa: E731
        else:
            body = lambda v: lib.all_to_all(v, "d", 0, 0, tiled=True)  # noqa: E731
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        comm = comms.get(impl)
        if comm is None:
            return f

        def run(x):
            with comm:
                return f(x)

        return run

    def time_it(fn, x) -> tuple[float, bytes | None]:
        out = None
        for _ in range(args.warmup):
            out = fn(x)
            out.block_until_ready()
        first = np.asarray(out.addressable_shards[0].data).tobytes()
        del out
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            out = fn(x)
            out.block_until_ready()
            times.append(time.perf_counter() - t0)
            del out
        return report.median(times), first

    rows = []
    points = [(c, s) for c in args.collectives.split(",") for s in sizes]
    for collective, size in report.progress(points, label="executor_cpu"):
        elems = size // 4  # float32 per rank
        if collective == "all_to_all" and elems % n:
            continue
        data = np.random.default_rng(size).standard_normal(n * elems).astype(np.float32)
        x = jax.device_put(data, sharding)
        out_bytes = size * n if collective == "all_gather" else size
        measured, ref_bytes = {}, None
        for impl in impls:
            if impl == "jaxccl-ppermute" and size > args.max_ppermute_bytes:
                continue
            t, first = time_it(build(collective, impl), x)
            measured[impl] = (t, first)
            gc.collect()
        if "lax" in measured:
            ref_bytes = measured["lax"][1]
        for impl, (t, first) in measured.items():
            lax_t = measured.get("lax", (float("nan"),))[0]
            algbw = out_bytes / t
            rows.append(
                {
                    "collective": collective,
                    "impl": impl,
                    "size": size,
                    "size_h": report.format_bytes(size),
                    "time_us": t * 1e6,
                    "algbw_GBs": algbw / 1e9,
                    "busbw_GBs": algbw * (n - 1) / n / 1e9,
                    "ratio_vs_lax": t / lax_t,
                    "bitwise_ok": None if ref_bytes is None else first == ref_bytes,
                }
            )
        del x

    cols = ["size_h", "impl", "time_us", "algbw_GBs", "busbw_GBs", "ratio_vs_lax", "bitwise_ok"]
    for collective in args.collectives.split(","):
        sel = [r for r in rows if r["collective"] == collective]
        print(f"\n{collective}, {n} devices, float32, per-rank input size; algbw = one rank's output bytes / time")
        report.print_table(sel, cols)

    ag = [r for r in rows if r["collective"] == "all_gather" and r["impl"] == "jaxccl-cpu" and r["size"] >= ACCEPT_FROM]
    accept = bool(ag) and all(r["ratio_vs_lax"] <= ACCEPT_RATIO for r in ag)
    worst = max((r["ratio_vs_lax"] for r in ag), default=float("nan"))
    if ag:
        print(
            f"\nacceptance (jaxccl-cpu all_gather <= {ACCEPT_RATIO}x lax at >= 1 MiB per rank): "
            f"{'PASS' if accept else 'FAIL'} (worst ratio {worst:.3f})"
        )
    wrong = [r for r in rows if r["bitwise_ok"] is False]
    if wrong:
        print(f"\nresults differing from jax.lax: {[(r['collective'], r['impl'], r['size']) for r in wrong]}")
    if args.json:
        report.write_json(
            args.json,
            {
                "benchmark": "executor_cpu",
                "num_devices": n,
                "runs": runs,
                "warmup": args.warmup,
                "quick": args.quick,
                "rows": rows,
                "acceptance": {
                    "criterion": f"jaxccl-cpu all_gather time <= {ACCEPT_RATIO} x lax at per-rank size >= 1 MiB",
                    "pass": accept if ag else None,
                    "worst_ratio": worst,
                },
            },
        )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
