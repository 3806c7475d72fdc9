"""One process of the model-based test of change across processes (``tests/distributed/test_multiprocess_change.py``).

Every process of the job runs the same seeded walk over the rules of the single-process state
machine (``tests/support/stateful_machine.py``) that make sense across processes, on the native CPU
executor with jaxccl's transport: agreed hot-swaps (:func:`jaxccl.distributed.transport.stage_agreed`,
the transition point now or a few calls ahead), reinstalls of the schedule used before the last
one (A -> B -> A), size and dtype changes, and closing the communicator and opening a new one.
After every step each process compares its shards of every collective bitwise with ``jax.lax``
(gloo). The walk is drawn from ``random.Random(seed)``, so every process takes the same steps
(the processes of an SPMD job must); reductions use int32 data, whose sums are exact in any
order (cross-process float sums follow gloo's order, not jaxccl's: docs/guides/multiprocess.md).

Per seed (the walks of several seeds run one after another in the job), prints ``SEED s``,
``STEP k <what>`` per step, ``MISMATCH ...`` for any difference and at the end of the walk
``COUNTS collectives=C swaps=S mismatches=M reinstalls=R``; then ``ALL OK`` or ``FAILED``.

Usage (through :func:`jaxccl.distributed.launch.launch`)::

    python tests/workers/multiprocess_change_worker.py LOCAL_DEVICES STEPS SEED[,SEED...]
"""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np

AXIS = "d"
SIZES = (3, 40, 1024)  # elements per rank block (uneven, small, 4 KiB of float32)
DTYPES = ("float32", "bfloat16", "int32")
REDUCING = ("psum_scatter", "psum")
COLLECTIVES = ("all_gather", "all_to_all", "psum_scatter", "psum")


def schedule_pool(topo: Any, n: int) -> dict[str, dict[str, Any]]:
    """Every baseline and synthesized schedule of each collective for ``topo`` (validated once)."""
    import jaxccl
    from jaxccl.runtime import default_schedules
    from jaxccl.synth import baselines
    from jaxccl.synth.ordered_reduce_scatter import ordered_reduce_scatter

    pool = {
        "all_gather": {
            "direct": default_schedules.direct_allgather(n),
            "ring": baselines.ring_allgather(topo),
            "ring2": baselines.ring_allgather(topo, channels=2),
            "recursive_doubling": baselines.recursive_doubling_allgather(n),
            "synthesized": jaxccl.synth.all_gather(topo),
        },
        "all_to_all": {"direct": baselines.direct_alltoall(n), "synthesized": jaxccl.synth.all_to_all(topo)},
        "psum_scatter": {
            "direct": baselines.direct_reduce_scatter(n),
            "ring": baselines.ring_reduce_scatter(topo),
            "ordered": ordered_reduce_scatter(topo),
        },
        "psum": {
            "direct": default_schedules.direct_allreduce(n),
            "ring": baselines.ring_allreduce(topo),
            "ordered": baselines.ordered_allreduce(n),
            "binary_tree": baselines.binary_tree_allreduce(n),
            "double_binary_tree": baselines.double_binary_tree_allreduce(n),
        },
    }
    for schedules in pool.values():
        for s in schedules.values():
            s.validate()
    return pool


def main(argv: list[str]) -> int:
    from jaxccl.distributed.launch import initialize_from_env
    from jaxccl.distributed.transport import ProcessTransport

    local_devices, steps, seeds = int(argv[0]), int(argv[1]), [int(v) for v in argv[2].split(",")]
    initialize_from_env(local_devices=local_devices)
    t = ProcessTransport.bootstrap(timeout_s=60.0)

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl
    from jaxccl.distributed.transport import attach, local_shards, stage_agreed

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    attach(t, mesh, AXIS)
    topo = jaxccl.topology.rail(hosts=t.num_processes, gpus_per_host=n // t.num_processes)
    pool = schedule_pool(topo, n)
    sharding = NamedSharding(mesh, P(AXIS))
    ops = {
        "all_gather": (jaxccl.all_gather, jax.lax.all_gather, {"axis": 0, "tiled": True}),
        "all_to_all": (jaxccl.all_to_all, jax.lax.all_to_all, {"split_axis": 0, "concat_axis": 0, "tiled": True}),
        "psum_scatter": (jaxccl.psum_scatter, jax.lax.psum_scatter, {"scatter_dimension": 0, "tiled": True}),
        "psum": (jaxccl.psum, jax.lax.psum, {}),
    }
    programs: dict[tuple[str, str], Any] = {}

    def program(collective: str, which: str) -> Any:
        if (collective, which) not in programs:
            ours, lax, kw = ops[collective]
            fn = ours if which == "ours" else lax
            body = jax.shard_map(lambda v: fn(v, AXIS, **kw), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
            programs[collective, which] = jax.jit(body)
        return programs[collective, which]

    def open_communicator() -> Any:
        c = jaxccl.Communicator(mesh, AXIS, topology=topo, backend="cpu")
        # With a topology psum is ReduceScatter + AllGather until an all_reduce schedule is installed, and a
        # program traced that way keeps it: install one before anything is traced, so psum swaps too.
        c.install("psum", pool["psum"]["direct"])
        return c

    def walk(seed: int) -> dict[str, int]:
        """One seeded walk of ``steps`` steps on communicators of its own; returns its counts."""
        programs.clear()  # traced afresh, as in a job of its own
        rng = random.Random(seed)
        comm = open_communicator()
        history = {c: ["direct"] for c in COLLECTIVES}  # schedules installed, in order
        counts = {"collectives": 0, "swaps": 0, "mismatches": 0, "reinstalls": 0}
        size, dtype = SIZES[0], DTYPES[0]

        def check(collective: str, k: int) -> None:
            data_dtype = "int32" if collective in REDUCING else dtype
            per_rank = size * n  # divisible by n for all_to_all and psum_scatter
            raw = np.random.default_rng([seed, k, COLLECTIVES.index(collective)]).integers(1, 1000, n * per_rank)
            x = jax.device_put(jnp.asarray(raw * (1 if data_dtype == "int32" else 1.25), data_dtype), sharding)
            with comm:
                ours = local_shards(program(collective, "ours")(x))
            ref = local_shards(program(collective, "lax")(x))
            counts["collectives"] += 1
            for shard, (a, b) in enumerate(zip(ours, ref)):
                if a.tobytes() != b.tobytes():
                    counts["mismatches"] += 1
                    print(
                        f"MISMATCH step {k} {collective} {history[collective][-1]} size {size} {data_dtype} "
                        f"local shard {shard}: {int(np.sum(a.view(np.uint8) != b.view(np.uint8)))} bytes differ",
                        flush=True,
                    )

        for k in range(steps):
            rule = rng.choices(("swap", "reinstall", "size", "dtype", "reopen"), weights=(5, 4, 2, 2, 1))[0]
            collective = rng.choice(COLLECTIVES)
            what = rule
            if rule in ("swap", "reinstall"):
                names = list(pool[collective])
                past = history[collective]
                if rule == "reinstall" and len(past) >= 2 and past[-2] != past[-1]:
                    name = past[-2]  # A -> B -> A
                    counts["reinstalls"] += 1
                else:
                    name = rng.choice([m for m in names if m != past[-1]])
                margin = rng.randrange(0, 4)
                version, seq = stage_agreed(
                    comm, collective, pool[collective][name], round_id=f"{seed}/{k}", margin=margin
                )
                past.append(name)
                counts["swaps"] += 1
                what = f"{rule} {collective} -> {name} (version {version}, from call {seq + 1})"
            elif rule == "size":
                size = rng.choice([s for s in SIZES if s != size])
                what = f"size {size}"
            elif rule == "dtype":
                dtype = rng.choice([d for d in DTYPES if d != dtype])
                what = f"dtype {dtype}"
            else:
                comm.close()
                comm = open_communicator()
                history = {c: ["direct"] for c in COLLECTIVES}
            print(f"STEP {k} {what}", flush=True)
            for c in COLLECTIVES:  # every collective after every step: swaps with a margin activate calls later
                check(c, k)
        comm.close()
        return counts

    ok = True
    for seed in seeds:
        print(f"SEED {seed}", flush=True)
        counts = walk(seed)
        ok &= counts["mismatches"] == 0
        print("COUNTS " + " ".join(f"{key}={value}" for key, value in counts.items()), flush=True)
    print("ALL OK" if ok else "FAILED", flush=True)
    t.close()
    jax.distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
