"""An emulated FSDP step after a degraded NIC: stale schedules against the closed loop's re-synthesized ones.

8 emulated devices, rail fabric of 2 hosts x 4 GPUs, link emulation. One FSDP
step's collectives run as one jitted program: ``psum_scatter`` of every rank's
full gradient vector and ``all_gather`` of the parameter shards (the same
bytes per rank: ``size``).

1. The closed loop: the communicator starts with the schedules synthesized for
   the healthy fabric (AllGather: tree packing; ReduceScatter: the rank-ordered
   fold of :mod:`jaxccl.synth.ordered_reduce_scatter`), GPU 0's NIC drops to ``--nic-gbps``
   live, and the :class:`~jaxccl.control.Controller` (managing ``all_reduce``:
   both halves) runs after every step until both re-synthesized schedules are
   active. Every step's results are compared bitwise with ``jax.lax``.
2. The A/B: on the degraded fabric, per size, the stale schedules, the
   re-synthesized ones and jaxccl's defaults (direct AllGather, rank-ordered
   direct ReduceScatter) run interleaved (each repetition runs every variant
   once, in turn); medians. One more row shows what the tree-order
   ReduceScatter (:func:`jaxccl.synth.reduce_scatter`, re-synthesized, not
   bitwise equal to ``jax.lax`` for floats) would give.

``algbw`` is ``size`` over the step's real time, divided by the time scale
(emulated bytes/s); ``ratio`` is the stale step time over the variant's.
``predicted_ms`` adds the two schedules' large-message predictions.

Usage:
    nice -n 10 python -m benchmarks.control.fsdp_recovery [--quick] [--json results.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import jaxccl
from jaxccl.util import report

NIC = (0, "tor:s0r0")


def _programs(mesh):
    import jax
    from jax.sharding import PartitionSpec as P

    def body(lib):
        def step(grads, shard):
            return (
                lib.psum_scatter(grads, "d", scatter_dimension=0, tiled=True),
                lib.all_gather(shard, "d", axis=0, tiled=True),
            )

        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d"))))

    return body(jaxccl), body(jax.lax)


def _inputs(rng, size):
    import numpy as np

    elems = size // 4
    grads = rng.standard_normal(8 * elems).astype(np.float32) * np.float32(1e-3) + np.float32(0.5)
    return grads, rng.standard_normal(elems).astype(np.float32)


def _same(a, b) -> bool:
    import numpy as np

    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


def closed_loop(args, mesh, ours, ref, healthy, failed, rng):
    """Runs the loop until both halves are re-synthesized and active; returns the schedules and the events."""
    from jaxccl.control import Controller, ordered_reduce_scatter
    from jaxccl.runtime.emulated import LinkEmulation

    comm = jaxccl.Communicator(
        mesh, "d", topology=healthy, backend="cpu", link_emulation=LinkEmulation(time_scale=args.time_scale)
    )
    comm.install("all_gather", jaxccl.synth.all_gather(healthy))
    comm.install("reduce_scatter", ordered_reduce_scatter(healthy))
    stale = {c: comm.schedule(c) for c in ("reduce_scatter", "all_gather")}
    ctl = Controller(comm, collectives=("all_reduce",), gamma=0.15)
    x = _inputs(rng, args.loop_size)
    bitwise = True
    with comm:
        for step in report.progress(range(args.loop_steps), label="closed loop"):
            if step == args.fail_step:
                comm.inject(failed)
            bitwise &= _same(ours(*x), ref(*x))
            ctl.step()
            active = {e.collective for e in ctl.events if e.kind == "activated"}
            if {"reduce_scatter", "all_gather"} <= active:
                break
    new = {c: comm.schedule(c) for c in ("reduce_scatter", "all_gather")}
    comm.close()
    return stale, new, ctl, bitwise, step + 1


def ab(args, mesh, ours, ref, failed, variants, rng):
    from jaxccl.control import predicted_algbw
    from jaxccl.runtime.emulated import LinkEmulation

    comms = {}
    for name, scheds in variants.items():
        comm = jaxccl.Communicator(
            mesh, "d", topology=failed, backend="cpu", link_emulation=LinkEmulation(time_scale=args.time_scale)
        )
        for coll, s in scheds.items():
            comm.install(coll, s)
        comms[name] = comm
    rows = []
    for size in args.sizes:
        x = _inputs(rng, size)
        want = ref(*x)
        exact = {}
        for name, comm in comms.items():
            with comm:
                exact[name] = _same(ours(*x), want)  # also the warm-up
        times = {name: [] for name in comms}
        for _ in report.progress(range(args.reps), label=f"A/B {report.format_bytes(size)}"):
            for name, comm in comms.items():  # interleaved
                with comm:
                    t0 = time.perf_counter()
                    for leaf in ours(*x):
                        leaf.block_until_ready()
                    times[name].append(time.perf_counter() - t0)
        stale_t = report.median(times["stale"])
        for name, scheds in variants.items():
            t = report.median(times[name])
            predicted = sum(size / predicted_algbw(s, failed) for s in scheds.values()) / args.time_scale
            rows.append(
                {
                    "size": report.format_bytes(size),
                    "bytes": size,
                    "schedules": name,
                    "time_ms": t * 1e3,
                    "predicted_ms": predicted * 1e3,
                    "algbw_GBps": size / t / args.time_scale / 1e9,
                    "ratio": stale_t / t,
                    "bitwise": exact[name],
                }
            )
    for comm in comms.values():
        comm.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    p.add_argument("--time-scale", type=float, default=1e-4)
    p.add_argument("--nic-gbps", type=float, default=200.0, help="GPU 0's NIC after the failure (nominal 400)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.reps = 5 if args.quick else 9
    args.sizes = [1 << 20] if args.quick else [1 << 20, 4 << 20]
    args.loop_size, args.loop_steps, args.fail_step = 1 << 20, 60, 4

    jaxccl.emulate(8)
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jaxccl.runtime import default_schedules
    from jaxccl.synth import baselines
    from jaxccl.topology import rail

    mesh = Mesh(np.array(jax.devices()), ("d",))
    healthy = rail(hosts=2, gpus_per_host=4)
    failed = healthy.degrade(*NIC, gbps=args.nic_gbps)
    ours, ref = _programs(mesh)
    rng = np.random.default_rng(0)
    stale, new, ctl, bitwise, steps = closed_loop(args, mesh, ours, ref, healthy, failed, rng)
    swapped = {e.collective for e in ctl.events if e.kind == "activated"}
    print(f"closed loop: {steps} steps; activated: {sorted(swapped)}; bitwise equal every step: {bitwise}")
    for e in ctl.events:
        if e.kind in ("detected", "synthesized", "staged", "activated", "rejected", "error"):
            keep = ("synth_ms", "predicted_algbw", "stale_algbw", "reason", "error")
            print(f"  {e.kind:11s} {e.collective}: { ({k: v for k, v in e.detail.items() if k in keep}) }")
    variants = {
        "stale": stale,
        "re-synthesized": new,
        "defaults (direct)": {
            "reduce_scatter": baselines.direct_reduce_scatter(8),
            "all_gather": default_schedules.direct_allgather(8),
        },
        "re-synthesized, tree-order RS (not bitwise)": {
            "reduce_scatter": jaxccl.synth.reduce_scatter(failed),
            "all_gather": new["all_gather"],
        },
    }
    rows = ab(args, mesh, ours, ref, failed, variants, rng)
    report.print_table(rows, ["size", "schedules", "time_ms", "predicted_ms", "algbw_GBps", "ratio", "bitwise"])
    if args.json:
        report.write_json(
            args.json,
            {
                "config": {
                    "topology": "rail(hosts=2, gpus_per_host=4)",
                    "failed_link": list(NIC),
                    "nic_gbps": args.nic_gbps,
                    "time_scale": args.time_scale,
                    "reps": args.reps,
                    "interleaved": True,
                    "statistic": "median",
                },
                "closed_loop": {
                    "steps": steps,
                    "activated": sorted(swapped),
                    "bitwise_every_step": bitwise,
                    "events": [e.to_dict() for e in ctl.events],
                    "schedules": {c: {"stale": stale[c].name, "new": new[c].name} for c in stale},
                },
                "rows": rows,
            },
        )
    return 0 if bitwise and {"reduce_scatter", "all_gather"} <= swapped else 1


if __name__ == "__main__":
    sys.exit(main())
