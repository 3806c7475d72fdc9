"""The transformer of ``transformer.py`` trained across processes: tensor parallel inside a process, FSDP across.

One command starts the job (``--processes`` processes on this machine, ``--devices`` CPU devices
each, on loopback) and waits for it. Each process joins the JAX job (gloo carries ``jax.lax``'s
collectives between processes), connects jaxccl's transport (UCX) and attaches the mesh's axes to
it. The mesh is ``data x model`` with one ``data`` row per process, so:

- **tensor parallelism over ``model``** runs inside each process (the blocks' ``psum``\\ s and their
  transposes), on jaxccl's native executor in shared memory;
- **FSDP over ``data``** runs across processes (each weight's ``all_gather`` before use and the
  gradients' ``psum_scatter``), on jaxccl's executor over the transport;
- the gradient norm's ``psum`` over ``("data", "model")`` spans every device.

The same step (``transformer.make_step``, ``jax.lax`` collectives only) runs twice from the same
start in the same processes, interleaved step by step: as written (gloo) and through
``jaxccl.offload``. jaxccl's sums across processes follow gloo's orders (docs/guides/multiprocess.md,
"Sums across processes"), so the two loss curves and the final weights must be bitwise equal; the
command exits 1 if they are not. With ``--loop`` (the default) the closed loop runs across the
processes on the ``data`` communicator (:class:`jaxccl.control.process_loop.ProcessLoop`: every
process's transport measurements gathered to process 0, one controller, swaps at agreed calls).

Process 0 prints the loss curves and the step times (medians over the steps after the first two;
jaxccl's includes the loop's time); ``--json`` writes them.

Usage:
    python examples/multihost_transformer.py [--processes 2] [--devices 4] [--steps 20] [--no-loop] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

from transformer import Config, bitwise_equal, init_params, make_batches, make_step, param_specs

import jaxccl

WAIT_S = 120.0  # every wait on another process
NIC_RATE_MBIT = 10_000.0  # the data communicator's topology: one NIC per process (loopback is faster)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2, help="processes (the data axis); default 2")
    ap.add_argument("--devices", type=int, default=4, help="CPU devices per process (the model axis); default 4")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--loop", action=argparse.BooleanOptionalAction, default=True, help="the closed loop on data")
    ap.add_argument("--json", help="process 0 writes the loss curves, step times and the verdict here")
    ap.add_argument("--timeout", type=float, default=600.0, help="deadline of the whole job, seconds")
    args = ap.parse_args(argv)
    if args.processes < 2 or args.devices < 1 or args.steps < 1:
        ap.error("need --processes >= 2, --devices >= 1 and --steps >= 1")
    return args


def config(args: argparse.Namespace) -> Config:
    """The example's model on a ``processes x devices`` mesh (every sharded dimension divides).

    Wider than ``transformer.py``'s: a device's shard of the large weights is 24-64 KiB, so their
    transfers between processes outlast the transport's buffers and the loop measures the links
    (:data:`jaxccl.distributed.transport.MIN_MEASURED_BYTES`).
    """
    return dataclasses.replace(
        Config(),
        vocab=128,
        d_model=128,
        head_dim=32,
        d_ff=256 * args.devices,
        data=args.processes,
        model=args.devices,
        batch=4 * args.processes,
    )


def _place(mesh: Any, array: Any, spec: Any) -> Any:
    """A global array from the same host value in every process."""
    import jax
    from jax.sharding import NamedSharding

    return jax.make_array_from_callback(array.shape, NamedSharding(mesh, spec), lambda idx: array[idx])


def _local(tree: Any) -> Any:
    """This process's shards of every leaf, in device order (what the bitwise comparison reads)."""
    import jax

    from jaxccl.distributed.transport import local_shards

    return jax.tree.map(local_shards, tree)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One process's part: both runs interleaved; returns what process 0 reports."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jaxccl.control.process_loop import ProcessLoop
    from jaxccl.distributed.launch import initialize_from_env
    from jaxccl.distributed.transport import ProcessTransport, attach
    from jaxccl.labs.rail import LinkShape, rank_rail
    from jaxccl.runtime import native

    me, nproc = initialize_from_env(local_devices=args.devices, timeout_s=WAIT_S)
    cfg = config(args)
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    mesh = Mesh(devices.reshape(cfg.data, cfg.model), ("data", "model"))
    transport = ProcessTransport.bootstrap(timeout_s=WAIT_S)
    axes = ("data", "model", ("data", "model"))
    for axis in axes:  # in the same order in every process
        attach(transport, mesh, axis)
    topology = rank_rail(cfg.data, 1, LinkShape(rate_mbit=NIC_RATE_MBIT))  # a data group: one rank per process
    comms = {
        axis: jaxccl.Communicator(mesh, axis, backend="cpu", topology=topology if axis == "data" else None)
        for axis in axes
    }
    step = make_step(cfg, mesh)
    offloaded = jaxccl.offload(step, comm=list(comms.values()))
    steps = {"lax": jax.jit(step, donate_argnums=0), "jaxccl": jax.jit(offloaded, donate_argnums=0)}
    start = init_params(cfg)
    params = {via: jax.tree.map(lambda a, s: _place(mesh, a, s), start, param_specs(cfg)) for via in steps}
    loop = ProcessLoop(comms["data"], timeout_s=WAIT_S, margin=0, key_prefix="jaxccl/example") if args.loop else None
    losses: dict[str, list[Any]] = {via: [] for via in steps}
    times: dict[str, list[float]] = {via: [] for via in steps}
    loop_ms: list[float] = []
    measured = 0
    for tokens in make_batches(cfg, args.steps):
        batch = _place(mesh, tokens, P("data"))
        for via, fn in steps.items():  # interleaved: each step runs both, in turn
            t0 = time.perf_counter()
            params[via], loss = fn(params[via], batch)
            loss.block_until_ready()
            if via == "jaxccl" and loop is not None:  # the loop's time counts in jaxccl's step
                t1 = time.perf_counter()
                loop.step()  # after the step's collectives finished in every process: margin 0 is safe
                loop_ms.append((time.perf_counter() - t1) * 1e3)
                measured += len(loop.published)
            times[via].append(time.perf_counter() - t0)
            losses[via].append(np.asarray(loss.addressable_data(0)))
    same = bitwise_equal(losses["lax"], losses["jaxccl"]) and bitwise_equal(
        _local(params["lax"]), _local(params["jaxccl"])
    )
    median = {via: statistics.median(t[2:] or t) for via, t in times.items()}  # after compiling and connecting
    report = {
        "process": me,
        "processes": nproc,
        "config": dataclasses.asdict(cfg),
        "loss_lax": [float(v) for v in losses["lax"]],
        "loss_jaxccl": [float(v) for v in losses["jaxccl"]],
        "step_s_lax": median["lax"],
        "step_s_jaxccl": median["jaxccl"],
        "ratio": median["jaxccl"] / median["lax"],
        "loop": args.loop,
        "loop_ms": statistics.median(loop_ms) if loop_ms else None,
        "loop_measured": measured,
        "loop_events": [e.kind for e in loop.events] if loop is not None else [],
        "native_launches": {
            f"{axis} {c}": native.launch_count(comm.slot(c))
            for axis, comm in comms.items()
            for c in ("all_gather", "reduce_scatter", "all_reduce")
            if comm.schedule(c) is not None
        },
        "loop_errors": [e.detail.get("error") for e in loop.errors] if loop is not None else [],
        "bitwise_equal": bool(same),
    }
    for comm in comms.values():
        comm.close()
    transport.close()
    jax.distributed.shutdown()  # a barrier: the coordinator (process 0) leaves last
    return report


def show(report: dict[str, Any]) -> None:
    for i, (a, b) in enumerate(zip(report["loss_lax"], report["loss_jaxccl"])):
        print(f"step {i:3d}  loss jax.lax {a:.7f}  jaxccl {b:.7f}{'' if a == b else '  DIFFERENT'}")
    loop = f", of which the loop {report['loop_ms']:.1f} ms" if report["loop"] else ""
    print(
        f"median step time: jax.lax (gloo) {report['step_s_lax'] * 1e3:.1f} ms, jaxccl "
        f"{report['step_s_jaxccl'] * 1e3:.1f} ms ({report['ratio']:.2f}x){loop}"
    )
    launches = ", ".join(f"{k} {v}" for k, v in report["native_launches"].items())
    print(f"native launches in process 0 (communicator, collective): {launches}")
    if report["loop"]:
        events = ", ".join(report["loop_events"]) or "none"
        print(f"the loop: {report['loop_measured']} link measurements published by process 0; events: {events}")
    print("loss curves and final weights bitwise equal" if report["bitwise_equal"] else "MISMATCH: jax.lax vs jaxccl")


def launcher(args: argparse.Namespace, argv: list[str]) -> int:
    """Starts the job's processes, waits for them, prints process 0's report."""
    from jaxccl.distributed.launch import launch
    from jaxccl.distributed.transport import unavailable_reason

    missing = unavailable_reason()
    if missing is not None:
        print(f"this install has no transport between processes: {missing}", file=sys.stderr)
        return 1
    results = launch([sys.executable, os.path.abspath(__file__), *argv], args.processes, timeout_s=args.timeout)
    failed = [r for r in results if r.returncode != 0]
    for r in failed:
        state = "missed the deadline" if r.returncode is None else f"exited with {r.returncode}"
        print(f"process {r.process_id} {state}:\n{r.output[-4000:]}", file=sys.stderr)
    # gloo reports every connection it makes; the example's own lines are the rest
    print("".join(line for line in results[0].output.splitlines(True) if not line.startswith("[Gloo]")), end="")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if "JAXCCL_PROCESS_ID" not in os.environ:
        return launcher(args, argv)
    report = worker(args)
    if report["process"] == 0:
        show(report)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    return 0 if report["bitwise_equal"] and not report["loop_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
