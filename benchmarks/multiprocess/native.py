"""The four collectives across processes: jaxccl's native executor (UCX) vs jax.lax (gloo) vs the ppermute backend.

A multi-process JAX job on one machine (``--processes`` processes sharing ``--ranks`` CPU
devices), on loopback or with every process in its own network namespace (``--network netns``,
root only; ``--rate-mbit`` shapes each process's NIC). For each collective and per-rank input
size: the median time over ``--runs`` timed calls after warm-up, measured in process 0 with the
three implementations interleaved (each run calls each once, in turn), algorithm bandwidth (one
rank's output bytes / time, as nccl-tests), the ratio to jax.lax's time in the same run and the
median CPU time of process 0 per call (all its threads: on shared cores, what a call costs). Every
result is checked bitwise against jax.lax once per size, float reductions too (jaxccl's
communicators sum in gloo's orders across processes: docs/guides/multiprocess.md, "Sums across
processes"; gloo's own ReduceScatter can come out wrong on shards of 512 KiB and more, which a
``bitwise_ok`` of False at those sizes may be).

Usage:
    nice -n 10 python -m benchmarks.multiprocess.native [--network loopback|netns] \\
        [--processes 2] [--ranks 8] [--quick] [--json results.json]
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.multiprocess.jobs import launch_rows, publish_rows
from jaxccl.cli.bench_run import implementation_runner  # axis "d"
from jaxccl.util import report

COLLECTIVES = ("all_gather", "all_to_all", "psum_scatter", "psum")
IMPLS = ("jaxccl-cpu", "lax", "jaxccl-ppermute")
FULL_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20]


def worker(args: argparse.Namespace) -> int:
    """One process of the job: runs every point and, in process 0, prints the rows as JSON."""
    from jaxccl.distributed.launch import initialize_from_env
    from jaxccl.distributed.transport import NETWORK_ONLY, ProcessTransport, attach, local_shards

    me, nproc = initialize_from_env(local_devices=args.ranks // args.processes)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    transport = ProcessTransport.bootstrap(options=NETWORK_ONLY if args.network == "netns" else None)
    attach(transport, mesh, "d")
    sharding = NamedSharding(mesh, P("d"))
    comms = {
        "jaxccl-cpu": jaxccl.Communicator(mesh, "d", backend="cpu"),
        "jaxccl-ppermute": jaxccl.Communicator(mesh, "d", backend="ppermute"),
    }

    def build(collective: str, impl: str):
        return implementation_runner(mesh, collective, comms.get(impl))

    def local_bytes(out) -> bytes:
        return b"".join(s.tobytes() for s in local_shards(out))

    rows = []
    for collective in args.collectives:
        for size in args.sizes:
            elems = size // 4
            if elems % n:
                continue
            data = np.random.default_rng(size).standard_normal(n * elems).astype(np.float32)
            x = jax.make_array_from_callback(data.shape, sharding, lambda idx, data=data: data[idx])
            out_bytes = {"all_gather": size * n, "psum_scatter": size // n}.get(collective, size)
            fns = {impl: build(collective, impl) for impl in args.impls}
            first = {}
            for impl, fn in fns.items():
                for _ in range(args.warmup):
                    out = fn(x)
                    out.block_until_ready()
                first[impl] = local_bytes(out)
            times = {impl: [] for impl in args.impls}
            cpu = {impl: [] for impl in args.impls}
            for _ in range(args.runs):
                for impl, fn in fns.items():  # interleaved
                    c0, t0 = time.process_time(), time.perf_counter()
                    fn(x).block_until_ready()
                    times[impl].append(time.perf_counter() - t0)
                    cpu[impl].append(time.process_time() - c0)
            reference = "lax"
            lax_t = report.median(times["lax"])
            for impl in args.impls:
                t = report.median(times[impl])
                rows.append(
                    {
                        "collective": collective,
                        "impl": impl,
                        "size": size,
                        "size_h": report.format_bytes(size),
                        "time_us": t * 1e6,
                        "cpu_us": report.median(cpu[impl]) * 1e6,
                        "algbw_GBs": out_bytes / t / 1e9,
                        "ratio_vs_lax": t / lax_t,
                        "bitwise_ok": first[impl] == first[reference],
                        "checked_against": reference,
                    }
                )
            if me == 0:
                print(f"POINT {collective} {size}", file=sys.stderr, flush=True)
    if me == 0:
        publish_rows(rows)
    for comm in comms.values():
        comm.close()
    transport.close()
    jax.distributed.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--network", choices=("loopback", "netns"), default="loopback")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=8, help="CPU devices in all, split evenly over the processes")
    ap.add_argument("--rate-mbit", type=float, default=None, help="netns: shape each process's NIC (both ways)")
    ap.add_argument("--quick", action="store_true", help="small sizes and few runs (smoke test)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per point (default 11; --quick: 5)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("--sizes", default=None, help="comma-separated per-rank sizes in bytes")
    ap.add_argument(
        "--impls", default=",".join(IMPLS), help="implementations to run (jax.lax always runs: it is the baseline)"
    )
    ap.add_argument("--timeout-s", type=float, default=3000.0)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.runs = args.runs or (5 if args.quick else 11)
    args.sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else QUICK_SIZES if args.quick else FULL_SIZES
    args.collectives = [c for c in args.collectives.split(",") if c]
    chosen = {i for i in args.impls.split(",") if i}
    if unknown := chosen - set(IMPLS):
        ap.error(f"unknown implementations {sorted(unknown)}; choose from {IMPLS}")
    args.impls = [i for i in IMPLS if i in chosen or i == "lax"]
    for c in args.collectives:
        if c not in COLLECTIVES:
            ap.error(f"unknown collective {c!r}; choose from {COLLECTIVES}")
    if args.processes < 2 or args.ranks % args.processes:
        ap.error(f"--ranks ({args.ranks}) must split evenly over --processes ({args.processes}) >= 2")
    if args.worker:
        return worker(args)

    from jaxccl.distributed.transport import unavailable_reason

    if (reason := unavailable_reason()) is not None:
        print(f"cannot run: {reason}")
        return 2
    import contextlib

    from jaxccl.labs.netlab import LinkShape, NetLab

    with contextlib.ExitStack() as stack:
        lab = None
        if args.network == "netns":
            shape = LinkShape(rate_mbit=args.rate_mbit) if args.rate_mbit else None
            lab = stack.enter_context(NetLab(args.processes, shape))
        t0 = time.perf_counter()
        rows = launch_rows(
            __file__, argv, args.processes, lab=lab, timeout_s=args.timeout_s, env={"JAXCCL_TIMEOUT_S": "120"}
        )
        elapsed = time.perf_counter() - t0
    if rows is None:
        return 1
    cols = ["size_h", "impl", "time_us", "cpu_us", "algbw_GBs", "ratio_vs_lax", "bitwise_ok"]
    where = f"{args.network}" + (f", NICs at {args.rate_mbit:g} Mbit/s" if args.rate_mbit else "")
    for collective in args.collectives:
        sel = [r for r in rows if r["collective"] == collective]
        print(
            f"\n{collective}, {args.ranks} ranks in {args.processes} processes ({where}), float32, per-rank input; "
            "algbw = one rank's output bytes / time; times measured in process 0"
        )
        report.print_table(sel, cols)
    wrong = report.print_differing(rows, ["collective", "impl", "size"], "their reference")
    print(f"\n({elapsed:.0f} s)")
    if args.json:
        report.write_json(
            args.json,
            {
                "benchmark": "multiprocess",
                "network": args.network,
                "rate_mbit": args.rate_mbit,
                "processes": args.processes,
                "ranks": args.ranks,
                "runs": args.runs,
                "warmup": args.warmup,
                "interleaved": True,
                "rows": rows,
            },
        )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
