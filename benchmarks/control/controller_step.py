"""What the step-driven controller costs per training step.

8 emulated devices, rail fabric of 2 hosts x 4 GPUs, link emulation on a
healthy fabric (the controller checks every step and never re-synthesizes).
One jitted step: a small MLP's forward and backward pass on each device
between an ``all_gather`` of the parameter shards and a ``psum_scatter`` of the
gradients, through jaxccl. Three variants, interleaved (each repetition runs
every variant once, in turn), medians over repetitions:

- ``no controller``: the step alone (the baseline);
- ``bare io_callback``: the step with an unordered callback that does
  nothing (what the mechanism alone costs);
- ``step-driven``: the same step with :meth:`Controller.at_step_end` (one
  unordered ``io_callback`` that runs one controller iteration: telemetry
  drain, Algorithm 1 for ReduceScatter and AllGather);
- ``step-driven, every 4th step``: the same with ``every=4`` (the callback
  still runs each step; the controller iteration on every 4th);
- ``background thread``: the step alone while the controller's thread runs
  every ``--interval-ms``.

Each repetition times ``--burst`` steps back to back (each step's output is
the next one's input, as in training) and counts their mean.
``overhead_ms`` is the variant's median minus the baseline's;
``callback_ms`` is the median host time of a controller iteration inside the
callback (from ``Controller.step_times``; both step-driven variants share one
controller, so it is given once).

Usage:
    nice -n 10 python -m benchmarks.control.controller_step [--quick] [--json results.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import jaxccl
from jaxccl.util import report


def _step_fns(mesh, ctl, width: int):
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback
    from jax.sharding import PartitionSpec as P

    def body(shard, xb):
        full = jaxccl.all_gather(shard, "d", axis=0, tiled=True)
        w = full[: width * width].reshape(width, width)

        def loss(w):
            return jnp.sum(jnp.tanh(xb @ w) ** 2)

        g = jax.grad(loss)(w).reshape(-1)
        g = jnp.concatenate([g, jnp.zeros(full.shape[0] - g.shape[0], g.dtype)])
        return shard - 1e-3 * jaxccl.psum_scatter(g, "d", scatter_dimension=0, tiled=True)

    inner = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"))

    @jax.jit
    def plain(shard, xb):
        return inner(shard, xb)

    @jax.jit
    def driven(shard, xb):
        out = inner(shard, xb)
        ctl.at_step_end(out)
        return out

    @jax.jit
    def driven_every_4(shard, xb):
        out = inner(shard, xb)
        ctl.at_step_end(out, every=4)
        return out

    @jax.jit
    def bare_callback(shard, xb):
        out = inner(shard, xb)
        io_callback(lambda token: None, None, jnp.ravel(out)[0], ordered=False)
        return out

    return plain, driven, driven_every_4, bare_callback


def run(args) -> dict:
    jaxccl.emulate(8)
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jaxccl.control import Controller, ordered_reduce_scatter
    from jaxccl.runtime.emulated import LinkEmulation
    from jaxccl.topology import rail

    mesh = Mesh(np.array(jax.devices()), ("d",))
    topo = rail(hosts=2, gpus_per_host=4)
    comm = jaxccl.Communicator(
        mesh, "d", topology=topo, backend="cpu", link_emulation=LinkEmulation(time_scale=args.time_scale)
    )
    comm.install("all_gather", jaxccl.synth.all_gather(topo))
    comm.install("reduce_scatter", ordered_reduce_scatter(topo))
    rows = []
    for size in args.sizes:
        width = int((size // 4) ** 0.5)
        ctl = Controller(comm, collectives=("all_reduce",), gamma=0.15, interval_s=args.interval_ms / 1e3)
        plain, driven, driven_every_4, bare_callback = _step_fns(mesh, ctl, width)
        fns = {
            "no controller": plain,
            "bare io_callback (no controller)": bare_callback,
            "step-driven": driven,
            "step-driven, every 4th step": driven_every_4,
            "background thread": plain,
        }
        rng = np.random.default_rng(0)
        shard = rng.standard_normal(size // 4).astype(np.float32)  # the parameters, sharded over the 8 ranks
        xb = rng.standard_normal((8 * 32, width)).astype(np.float32)
        times = {name: [] for name in fns}
        with comm:
            for fn in (plain, driven, driven_every_4, bare_callback):
                fn(shard, xb).block_until_ready()
            jax.effects_barrier()
            ctl.step_times.ns.clear()
            for _ in report.progress(range(args.reps), label=f"steps {report.format_bytes(size)}"):
                for name in times:  # interleaved
                    fn = fns[name]
                    if name == "background thread":
                        ctl.start()
                    t0 = time.perf_counter()
                    out = shard
                    for _ in range(args.burst):  # back to back, as training runs: callbacks overlap the next step
                        out = fn(out, xb)
                    out.block_until_ready()
                    if fn is not plain:
                        jax.effects_barrier()  # the burst is over only once its last callback ran
                    times[name].append((time.perf_counter() - t0) / args.burst)
                    if name == "background thread":
                        ctl.stop()
        base = report.median(times["no controller"])
        for name, ts in times.items():
            t = report.median(ts)
            rows.append(
                {
                    "size": report.format_bytes(size),
                    "bytes": size,
                    "variant": name,
                    "time_ms": t * 1e3,
                    "algbw_GBps": size / t / args.time_scale / 1e9,
                    "overhead_ms": (t - base) * 1e3,
                    "ratio": t / base,
                    "callback_ms": report.median(ctl.step_times.ns) / 1e6 if name == "step-driven" else float("nan"),
                }
            )
        kinds = {e.kind for e in ctl.events}
        if kinds & {"synthesized", "error"}:
            raise SystemExit(f"the controller acted on a healthy fabric: {sorted(kinds)}")
    comm.close()
    return {
        "config": {
            "topology": "rail(hosts=2, gpus_per_host=4)",
            "time_scale": args.time_scale,
            "reps": args.reps,
            "interval_ms": args.interval_ms,
            "burst": args.burst,
            "interleaved": True,
            "statistic": "median",
        },
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    p.add_argument("--time-scale", type=float, default=1e-2)
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--burst", type=int, default=5, help="steps timed back to back per repetition")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.reps = 15 if args.quick else 41
    args.sizes = [256 << 10] if args.quick else [64 << 10, 256 << 10, 1 << 20]
    result = run(args)
    report.print_table(
        result["rows"], ["size", "variant", "time_ms", "overhead_ms", "ratio", "callback_ms", "algbw_GBps"]
    )
    if args.json:
        report.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
