"""A hybrid-sharded training step across processes: jaxccl (native executor, UCX) vs jax.lax (gloo), interleaved.

The layout large jobs use (HSDP): a ``data x model`` mesh with one ``data`` row per process; every
weight is sharded over ``model`` (inside a process) and all-gathered there before use (its gradient
is reduce-scattered back by autodiff), the gradients are averaged over ``data`` (across processes,
``pmean``) and the loss over ``("data", "model")``. An MLP of ``--layers`` square layers of each
``--widths`` entry; per width, process 0 times ``--steps`` steps of each implementation in turn
(the same start, the same batch) and reports the median step time after ``--warmup`` steps, the
ratio to ``jax.lax`` in the same run, and whether the loss curves and the final weights are
bitwise equal (jaxccl's sums across processes follow gloo's orders).

Usage:
    nice -n 10 python -m benchmarks.multiprocess.hsdp_step [--processes 2] [--devices 4]
        [--widths 256,512,1024,2048] [--steps 16] [--json results.json]
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.multiprocess.jobs import launch_rows, publish_rows
from jaxccl.util import report

WIDTHS = (256, 512, 1024, 2048)
IMPLS = ("lax", "jaxccl")


def worker(args: argparse.Namespace) -> int:
    """One process of the job; process 0 prints the rows as JSON."""
    from jaxccl.distributed.launch import initialize_from_env
    from jaxccl.distributed.transport import ProcessTransport, attach, local_shards

    me, nproc = initialize_from_env(local_devices=args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl

    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    mesh = Mesh(devices.reshape(nproc, args.devices), ("data", "model"))
    transport = ProcessTransport.bootstrap()
    axes = ("data", "model", ("data", "model"))
    for axis in axes:
        attach(transport, mesh, axis)
    comms = [jaxccl.Communicator(mesh, axis, backend="cpu") for axis in axes]

    def step(weights, x):
        def loss_fn(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ lax.all_gather(w, "model", axis=0, tiled=True))
            return jnp.mean(h * h)

        loss, grads = jax.value_and_grad(loss_fn)(weights)
        grads = [lax.pmean(g, "data") for g in grads]
        return [w - 0.1 * g for w, g in zip(weights, grads)], lax.pmean(loss, ("data", "model"))

    def place(a, spec):
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])

    w_spec = [P("model")] * args.layers
    sharded = jax.shard_map(step, mesh=mesh, in_specs=(w_spec, P(("data", "model"))), out_specs=(w_spec, P()))
    fns = {"lax": jax.jit(sharded), "jaxccl": jax.jit(jaxccl.offload(sharded, comm=comms))}
    rows = []
    for width in args.widths:
        rng = np.random.default_rng(width)
        start = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32) for _ in w_spec]
        x = place(rng.standard_normal((args.batch * mesh.size, width)).astype(np.float32), P(("data", "model")))
        weights = {impl: [place(w, P("model")) for w in start] for impl in IMPLS}
        times = {impl: [] for impl in IMPLS}
        losses = {impl: [] for impl in IMPLS}
        for _ in range(args.warmup + args.steps):
            for impl in IMPLS:  # interleaved
                t0 = time.perf_counter()
                weights[impl], loss = fns[impl](weights[impl], x)
                loss.block_until_ready()
                times[impl].append(time.perf_counter() - t0)
                losses[impl].append(np.asarray(loss.addressable_data(0)).tobytes())
        final = {impl: b"".join(s.tobytes() for w in weights[impl] for s in local_shards(w)) for impl in IMPLS}
        median = {impl: report.median(times[impl][args.warmup :]) for impl in IMPLS}
        rows.append(
            {
                "width": width,
                "shard_bytes": width * width * 4 // args.devices,
                "shard_h": report.format_bytes(width * width * 4 // args.devices),
                "lax_ms": median["lax"] * 1e3,
                "jaxccl_ms": median["jaxccl"] * 1e3,
                "ratio_vs_lax": median["jaxccl"] / median["lax"],
                "bitwise_ok": losses["lax"] == losses["jaxccl"] and final["lax"] == final["jaxccl"],
            }
        )
    if me == 0:
        publish_rows(rows)
    for comm in comms:
        comm.close()
    transport.close()
    jax.distributed.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2, help="processes: the data axis")
    ap.add_argument("--devices", type=int, default=4, help="CPU devices per process: the model axis")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="comma-separated layer widths")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="rows per device")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per implementation and width")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.widths = [int(w) for w in args.widths.split(",") if w]
    if args.processes < 2 or args.devices < 1 or args.steps < 1 or args.layers < 1:
        ap.error("need --processes >= 2, --devices >= 1, --steps >= 1 and --layers >= 1")
    if any(w % args.devices for w in args.widths):
        ap.error(f"every width must divide by --devices ({args.devices})")
    if args.worker:
        return worker(args)

    from jaxccl.distributed.transport import unavailable_reason

    if (reason := unavailable_reason()) is not None:
        print(f"cannot run: {reason}")
        return 2
    t0 = time.perf_counter()
    rows = launch_rows(__file__, argv, args.processes, timeout_s=args.timeout_s)
    if rows is None:
        return 1
    print(
        f"HSDP step, {args.processes} processes x {args.devices} devices (loopback), {args.layers} layers; medians of "
        f"{args.steps} steps after {args.warmup}, interleaved; ratio = jaxccl / jax.lax (gloo) in the same run"
    )
    report.print_table(rows, ["width", "shard_h", "lax_ms", "jaxccl_ms", "ratio_vs_lax", "bitwise_ok"])
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.json:
        report.write_json(
            args.json,
            {
                "benchmark": "hsdp_step",
                "processes": args.processes,
                "devices": args.devices,
                "layers": args.layers,
                "steps": args.steps,
                "warmup": args.warmup,
                "interleaved": True,
                "rows": rows,
            },
        )
    return 0 if all(r["bitwise_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
