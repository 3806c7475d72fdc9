"""Synthesized AllGather on the emulated executor: measured algbw against the schedule's prediction.

8 emulated devices on a rail fabric of 2 hosts x 4 GPUs with link emulation (every
message paced over its route's links), healthy and under MCCL's fail2. For each
scenario the AllGather is synthesized for that fabric and run through jaxccl, and
for comparison the same schedule in program order (every threadblock in order,
untiled: the executor before dataflow order) and the ring baseline on the same
fabric, interleaved, in the same run; algbw (emulated bytes/s: one rank's output bytes over the real time divided
by the time scale) is the median over repetitions. The default time scale (1e-4) keeps the
host's own work (copies, thread wake-ups) small against the emulated transfers. The acceptance ratio is
measured / predicted (the synthesizer's large-message algbw). ``--tile-cap N`` adds the synthesized
schedule with at most N tiles per launch (``native.set_tile_cap``), interleaved with the others: what
the executor's tile cap buys at sizes whose messages exceed N x 64 KiB; ``--no-baselines`` leaves out
program order and the ring (slow at large sizes).

Usage:
    nice -n 10 python -m benchmarks.executor.emulated [--quick] [--json results.json]
    nice -n 10 python -m benchmarks.executor.emulated --mib 64 --tile-cap 32 --no-baselines
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jaxccl
from jaxccl.util import report

SCENARIOS = ("none", "fail2")


def _run(args: argparse.Namespace) -> dict:
    jaxccl.emulate(8)
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jaxccl.runtime import native
    from jaxccl.runtime.emulated import LinkEmulation
    from jaxccl.synth import baselines
    from jaxccl.topology import rail, scenario

    mesh = Mesh(np.array(jax.devices()), ("d",))
    base = rail(hosts=2, gpus_per_host=4)
    shard_elems = (args.mib << 20) // 4 // 8
    rng = np.random.default_rng(0)
    x = rng.standard_normal(8 * shard_elems).astype(np.float32)
    out_bytes = x.nbytes
    rows = []
    capped = f"synthesized, at most {args.tile_cap} tiles"

    def configure(key: str) -> None:
        native.set_program_order(key == "synthesized, program order")
        native.set_tile_cap(args.tile_cap if key == capped else None)

    for name in SCENARIOS:
        topo = base if name == "none" else scenario(base, name)
        emulation = LinkEmulation(time_scale=args.time_scale)
        synthesized = jaxccl.synth.all_gather(topo)
        schedules = {"synthesized": synthesized}
        if args.tile_cap:
            schedules[capped] = synthesized
        if not args.no_baselines:
            schedules["synthesized, program order"] = synthesized
            schedules["ring"] = baselines.ring_allgather(8)
        comms, fns = {}, {}
        for key, s in schedules.items():
            comm = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu", link_emulation=emulation)
            comm.install("all_gather", s)
            f = jax.jit(
                jax.shard_map(
                    lambda v: jaxccl.all_gather(v, "d", tiled=True), mesh=mesh, in_specs=P("d"), out_specs=P("d")
                )
            )
            configure(key)
            with comm:
                out = np.asarray(f(x)).reshape(8, -1)
            if not all(np.array_equal(row, x) for row in out):
                raise SystemExit(f"{name}/{key}: result differs from the input gathered")
            comms[key], fns[key] = comm, f
        times = {k: [] for k in schedules}
        for _ in range(args.reps):
            for key in schedules:  # interleaved
                configure(key)
                with comms[key]:
                    t0 = time.perf_counter()
                    fns[key](x).block_until_ready()
                    times[key].append(time.perf_counter() - t0)
        for key, s in schedules.items():
            algbw = out_bytes / report.median(times[key]) / args.time_scale
            rows.append(
                {
                    "scenario": name,
                    "schedule": key,
                    "bytes_per_rank_out": out_bytes,
                    "time_ms": report.median(times[key]) * 1e3,
                    "algbw_GBps": algbw / 1e9,
                    "predicted_GBps": s.algbw / 1e9 if s is synthesized else float("nan"),
                    "measured/predicted": algbw / s.algbw if s is synthesized else float("nan"),
                }
            )
    native.set_program_order(False)
    native.set_tile_cap(None)
    return {
        "time_scale": args.time_scale,
        "reps": args.reps,
        "mib": args.mib,
        "max_tiles": native.module().MAX_TILES,
        "tile_cap_compared": args.tile_cap,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--mib", type=int, default=16, help="one rank's AllGather output in MiB")
    p.add_argument("--time-scale", type=float, default=1e-4)
    p.add_argument("--tile-cap", type=int, default=None, help="also run the synthesized schedule with this tile cap")
    p.add_argument("--no-baselines", action="store_true", help="leave out program order and the ring")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.reps = 5 if args.quick else 11
    result = _run(args)
    cols = ("scenario", "schedule", "time_ms", "algbw_GBps", "predicted_GBps", "measured/predicted")
    print(" | ".join(cols))
    for r in result["rows"]:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
