"""psum on a communicator with a topology, 8 emulated CPU devices: two launches, one fused launch, jax.lax.

A communicator with a topology runs ``psum`` as its ReduceScatter and AllGather
schedules (MCCL Sec. 3). ``jaxccl-two-launch`` runs them as two launches
(``Communicator(..., fuse_all_reduce=False)``), ``jaxccl-fused`` as one launch of
their fusion (:func:`jaxccl.schedule.fusion.fuse_all_reduce`, the default),
``jaxccl-direct`` is the communicator without a topology (the rank-ordered direct
AllReduce), for reference. Both halves are the communicator's defaults (the
rank-ordered direct ReduceScatter and the direct AllGather), or with
``--synthesized`` the closed loop's schedules for the topology (the rank-ordered
ReduceScatter of :mod:`jaxccl.synth.ordered_reduce_scatter` and the tree packing
of :func:`jaxccl.synth.all_gather`).

An nccl-tests-style table per implementation: per-rank input size, median time
over ``--runs`` timed calls after warm-up, algorithm bandwidth (one rank's buffer
bytes / time) and the time ratio to ``jax.lax``. The implementations are timed
interleaved (each run calls every implementation once, in turn, starting one further
on than the run before: the call right after another implementation's can be faster),
so all see the same machine load. ``--repeat K`` sweeps the sizes K times; the table shows each
cell's median over the sweeps (the JSON keeps every sweep). Every result is
checked bitwise against ``jax.lax`` once per size and sweep (float32, random; the
ReduceScatters sum in rank order).

Usage:
    nice -n 10 python -m benchmarks.executor.topology_psum [--quick] [--json results.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import jaxccl
from benchmarks.executor.cpu import add_sweep_options, measure_interleaved, point_rows, sweep_options
from jaxccl.cli.args import topology as parse_topology
from jaxccl.cli.bench_run import implementation_runner  # axis "d"
from jaxccl.util import report

NUM_DEVICES = 8
IMPLS = ("jaxccl-two-launch", "jaxccl-fused", "lax", "jaxccl-direct")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_options(ap, IMPLS, "jaxccl-two-launch,jaxccl-fused,lax")
    ap.add_argument("--topology", default="rail:2x4", help="the communicator's topology (default rail:2x4)")
    ap.add_argument("--synthesized", action="store_true", help="install the closed loop's synthesized halves")
    ap.add_argument("--repeat", type=int, default=1, help="sweeps of every size (the table: medians over them)")
    args = ap.parse_args(argv)
    runs, sizes, impls = sweep_options(ap, args, IMPLS)
    topo = parse_topology(args.topology)
    if topo.num_gpus != NUM_DEVICES:
        ap.error(f"--topology has {topo.num_gpus} GPUs; the benchmark runs {NUM_DEVICES} devices")

    jaxccl.emulate(NUM_DEVICES)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxccl.synth.ordered_reduce_scatter import ordered_reduce_scatter

    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    comms = {
        "jaxccl-two-launch": jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu", fuse_all_reduce=False),
        "jaxccl-fused": jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu"),
        "jaxccl-direct": jaxccl.Communicator(mesh, "d", backend="cpu"),
    }
    if args.synthesized:
        halves = {"reduce_scatter": ordered_reduce_scatter(topo), "all_gather": jaxccl.synth.all_gather(topo)}
        for impl in ("jaxccl-two-launch", "jaxccl-fused"):
            for coll, schedule in halves.items():
                comms[impl].install(coll, schedule)
    fused = comms["jaxccl-fused"].launched_schedule("psum")

    rows = []
    for sweep, size in report.progress([(k, s) for k in range(args.repeat) for s in sizes], label="topology_psum"):
        elems = size // 4  # float32 per rank
        data = np.random.default_rng(size).standard_normal(NUM_DEVICES * elems).astype(np.float32)
        x = jax.device_put(data, sharding)
        fns = {impl: implementation_runner(mesh, "psum", comms.get(impl)) for impl in impls}
        # interleaved, the order rotated: a call right after jax.lax's runs faster at 4 KiB
        first, times = measure_interleaved(fns, x, warmup=args.warmup, runs=runs, rotate=True)
        rows += [{"sweep": sweep, **row} for row in point_rows(first, times, size, size)]
        del x

    print(
        f"\npsum on {topo.name}, {NUM_DEVICES} devices, float32, per-rank input size; fused schedule {fused.name} "
        f"(C={fused.chunks_per_period}); algbw = one rank's buffer bytes / time"
    )
    summary = _summary(rows)
    if args.repeat > 1:
        print(f"medians over {args.repeat} sweeps")
    report.print_table(summary, ["size_h", "impl", "time_us", "algbw_GBs", "ratio_vs_lax", "bitwise_ok"])
    wrong = report.print_differing(rows, ["impl", "size"])
    if args.json:
        report.write_json(
            args.json,
            {
                "benchmark": "topology_psum",
                "num_devices": NUM_DEVICES,
                "topology": topo.name,
                "synthesized": args.synthesized,
                "fused_schedule": fused.name,
                "runs": runs,
                "warmup": args.warmup,
                "interleaved": True,
                "quick": args.quick,
                "repeat": args.repeat,
                "load_average": list(os.getloadavg()),
                "summary": summary,
                "rows": rows,
            },
        )
    return 1 if wrong else 0


def _summary(rows: list[dict]) -> list[dict]:
    """Per (size, implementation): the medians over the sweeps of time, algbw and ratio; bitwise in every sweep."""
    cells: dict[tuple[int, str], list[dict]] = {}
    for r in rows:
        cells.setdefault((r["size"], r["impl"]), []).append(r)
    out = []
    for (size, impl), sel in cells.items():
        out.append(
            {
                "impl": impl,
                "size": size,
                "size_h": sel[0]["size_h"],
                "sweeps": len(sel),
                **{k: report.median([r[k] for r in sel]) for k in ("time_us", "algbw_GBs", "ratio_vs_lax")},
                "ratio_range": [min(r["ratio_vs_lax"] for r in sel), max(r["ratio_vs_lax"] for r in sel)],
                "bitwise_ok": None if sel[0]["bitwise_ok"] is None else all(r["bitwise_ok"] for r in sel),
            }
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
