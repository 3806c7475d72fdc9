"""Simulator scale: one ring AllGather of 128 MiB per source on 128-2048 GPUs, wall time per run.

The schedule is the rail-aligned single-channel ring of
:func:`jaxccl.synth.baselines.ring_allgather` (``N x (N-1)`` transfers: 4.2
million at 2048 GPUs) on MCCL's cluster of segments of 16 hosts x 8 GPUs,
executed in order as NCCL runs its rings.
For every size: schedule build time, event-DAG compile time, engine time,
total simulator wall time (compile + engine; the acceptance figure is the
2048-GPU one, < 5 minutes) and the CPU time the process spent in it (the
figure to compare across runs on a shared machine: wall time grows with the
load average, also recorded), simulated time and algbw, the analytic ring
time for comparison, and the process's peak memory. Progress on stderr, a
table, ``--json`` and a ``--png`` of wall time against GPUs.

Usage:
    nice -n 10 python -m benchmarks.sim.scale [--quick] [--gpus 256 2048] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import jaxccl.sim as sim
from jaxccl.sim.analytic import ring_time
from jaxccl.synth.baselines import rail_ring_order, ring_allgather
from jaxccl.topology import rail
from jaxccl.util.report import print_table, write_json

# NCCL runs its rings in order; dataflow execution gives the same simulated time (the ring's data arrives in
# program order) but 6-8x the engine time at 128-256 GPUs (more concurrent messages per connection)
EXECUTION = "in_order"


def measure(num_gpus: int, nbytes: int) -> dict:
    topo = rail(hosts=16, gpus_per_host=8, segments=num_gpus // 128)
    t0 = time.perf_counter()
    schedule = ring_allgather(topo)
    build = time.perf_counter() - t0
    marks = []

    def progress(frac: float) -> None:
        if not marks or frac - marks[-1] >= 0.1 or frac >= 1.0:
            marks.append(frac)
            print(
                f"  {num_gpus} GPUs: {frac:4.0%} of messages done, {time.perf_counter() - t0:6.1f} s", file=sys.stderr
            )

    cpu0 = time.process_time()
    res = sim.run(topo, schedule, nbytes, progress=progress, execution=EXECUTION)
    cpu = time.process_time() - cpu0
    analytic = ring_time(topo, [rail_ring_order(topo)], nbytes, steps=num_gpus - 1)
    return {
        "gpus": num_gpus,
        "flows": res.num_flows,
        "build_s": build,
        "compile_s": res.compile_s,
        "engine_s": res.stats["wall_s"],
        "sim_wall_s": res.wall_s,
        "sim_cpu_s": cpu,
        "load_avg": os.getloadavg()[0],
        "time_s": res.time_s,
        "analytic_time_s": analytic,
        "algbw_GBps": res.algbw / 1e9,
        "event_batches": res.stats["batches"],
        "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
    }


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    xs = [r["gpus"] for r in rows]
    ax.loglog(xs, [r["sim_wall_s"] for r in rows], "o-", label="simulator wall (compile + engine)")
    ax.loglog(xs, [r["sim_cpu_s"] for r in rows], "^-", label="simulator CPU time")
    ax.loglog(xs, [r["flows"] / 1e5 for r in rows], "s--", label="flows / 1e5")
    ax.axhline(300, color="r", ls=":", label="5 minutes")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("seconds")
    ax.set_title("ring AllGather, 128 MiB per source", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="128 and 256 GPUs only")
    ap.add_argument("--gpus", type=int, nargs="+", help="cluster sizes (multiples of 128)")
    ap.add_argument("--bytes", type=int, default=128 << 20, help="bytes per source")
    ap.add_argument("--json", default="benchmarks/results/sim/sim_scale.json")
    ap.add_argument("--png", default="benchmarks/results/sim/sim_scale.png")
    args = ap.parse_args(argv)
    sizes = args.gpus or ([128, 256] if args.quick else [256, 512, 1024, 2048])
    rows = []
    for n in sizes:
        print(f"simulating a {n}-GPU ring AllGather ({n * (n - 1)} transfers)", file=sys.stderr)
        rows.append(measure(n, args.bytes))
    print_table(rows)
    write_json(args.json, {"benchmark": "sim_scale", "bytes_per_source": args.bytes, "rows": rows})
    plot(rows, args.png)
    print(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
