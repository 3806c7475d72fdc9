"""Step time of the examples/transformer.py model on 8 CPU devices: jax.lax against jaxccl (through offload).

One table row per (model size, implementation): the training step as written
(``lax``), the same step through ``jaxccl.offload`` on the native CPU executor
(``jaxccl-cpu``) and on the ppermute backend (``jaxccl-ppermute``). Each step
is jitted once and warmed up; then every run calls each implementation once, in
turn (interleaved, so all see the same machine load), on the same parameters
and batch; medians over the runs. Throughput is tokens per second (a model
step has no single algorithm bandwidth); ``ratio_vs_lax`` is the median step
time over ``lax``'s from the same run. ``bitwise_ok``: the step's new
parameters and loss equal ``lax``'s bit for bit.

Usage:
    nice -n 10 python -m benchmarks.executor.transformer_step [--quick] [--runs 15] [--json results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import pathlib
import sys
import time

import jaxccl
from jaxccl.util import report

NUM_DEVICES = 8
IMPLS = ("lax", "jaxccl-cpu", "jaxccl-ppermute")
SIZES = {  # name -> Config overrides (examples/transformer.py)
    "small": {},
    "medium": {"vocab": 256, "d_model": 128, "heads": 8, "head_dim": 16, "d_ff": 512, "seq": 64, "batch": 16},
}


def _example():
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "transformer.py"
    spec = importlib.util.spec_from_file_location("transformer_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small model only, few runs (smoke test)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per point (default 15; --quick: 5)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    runs = args.runs or (5 if args.quick else 15)
    sizes = ["small"] if args.quick else list(SIZES)

    jaxccl.emulate(NUM_DEVICES)
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    T = _example()
    rows = []
    for size in report.progress(sizes, label="transformer_step"):
        cfg = T.Config(**SIZES[size])
        mesh = T.make_mesh(cfg)
        step = T.make_step(cfg, mesh)
        comms = {
            impl: [
                jaxccl.Communicator(mesh, a, backend=impl.split("-")[1]) for a in ("data", "model", ("data", "model"))
            ]
            for impl in IMPLS
            if impl != "lax"
        }
        fns = {impl: jax.jit(step if impl == "lax" else jaxccl.offload(step, comm=comms[impl])) for impl in IMPLS}
        shard = functools.partial(_place, mesh)
        params = jax.tree.map(shard, T.init_params(cfg), T.param_specs(cfg))
        tokens = shard(T.make_batches(cfg, 1)[0], P("data"))
        first = {}
        for impl, fn in fns.items():
            for _ in range(args.warmup):
                out = jax.block_until_ready(fn(params, tokens))
            first[impl] = jax.tree.map(np.asarray, out)
        times = {impl: [] for impl in IMPLS}
        for _ in range(runs):
            for impl, fn in fns.items():  # interleaved
                t0 = time.perf_counter()
                jax.block_until_ready(fn(params, tokens))
                times[impl].append(time.perf_counter() - t0)
        n_params = sum(int(np.prod(s)) for s in jax.tree.leaves(T.param_shapes(cfg), is_leaf=_is_shape))
        lax_t = report.median(times["lax"])
        for impl in IMPLS:
            t = report.median(times[impl])
            rows.append(
                {
                    "model": size,
                    "params": n_params,
                    "tokens_per_step": cfg.batch * cfg.seq,
                    "impl": impl,
                    "time_ms": t * 1e3,
                    "tokens_per_s": cfg.batch * cfg.seq / t,
                    "ratio_vs_lax": t / lax_t,
                    "bitwise_ok": T.bitwise_equal(first[impl], first["lax"]),
                    "config": dataclasses.asdict(cfg),
                }
            )

    print(f"\ntransformer training step, {NUM_DEVICES} CPU devices (data x model = 2 x 4), median of {runs} runs")
    report.print_table(
        rows, ["model", "params", "tokens_per_step", "impl", "time_ms", "tokens_per_s", "ratio_vs_lax", "bitwise_ok"]
    )
    if args.json:
        report.write_json(
            args.json,
            {
                "benchmark": "transformer_step",
                "num_devices": NUM_DEVICES,
                "runs": runs,
                "warmup": args.warmup,
                "interleaved": True,
                "quick": args.quick,
                "rows": rows,
            },
        )
    return 0


def _place(mesh, array, spec):
    import jax
    from jax.sharding import NamedSharding

    return jax.device_put(array, NamedSharding(mesh, spec))


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


if __name__ == "__main__":
    sys.exit(main())
