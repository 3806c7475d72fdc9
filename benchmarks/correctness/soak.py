"""Soak: many collectives of random kinds and sizes under random hot-swaps and link faults, all checked bitwise.

On 8 emulated CPU devices (a rail of 2 hosts x 4 GPUs with emulated links),
``--collectives`` calls of ``all_gather``, ``all_to_all``, ``psum_scatter`` and
``psum`` with random per-rank sizes run through jaxccl's ``cpu`` backend; every
result is compared bitwise with the ``jax.lax`` reference on the same input.
Meanwhile, at random points, a collective's schedule is hot-swapped (another
synthesized or baseline schedule, staged without recompiling), a link fault is
injected or healed (``comm.inject``), and a throwaway Communicator is created,
used and dropped. Resources are read before and after: resident memory,
threads, open file descriptors and the native executor's slots and pending rendezvous;
once more after ``jax.clear_caches()``, since a program traced with a
communicator keeps that communicator's native slots while JAX caches it; and
once more after glibc's ``malloc_trim(0)``: resident memory the C allocator
keeps in its per-thread arenas after it was freed (a plateau, returned by the
trim) is not a leak, memory still in use is.

Reductions run on int32 data (any summation order is then exact) so that every
reduction schedule, ordered or not, is checked against ``jax.lax`` bitwise.

Usage:
    nice -n 10 python -m benchmarks.correctness.soak [--collectives 10000] [--seed 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import threading
import time

import jaxccl
from jaxccl.util import report

NUM_DEVICES = 8
KINDS = ("all_gather", "all_to_all", "psum_scatter", "psum")
ELEMS = (64, 1024, 8192, 65536)  # per rank, 4 bytes each: 256 B .. 256 KiB
DEFAULT_JSON = os.path.join(os.path.dirname(__file__), "..", "results", "soak.json")


def resources() -> dict[str, float]:
    """Resident memory (MiB), OS threads, open descriptors, and the native executor's bookkeeping."""
    from jaxccl.runtime import native

    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    stats = native.stats()
    return {
        "rss_mib": rss,
        "os_threads": len(os.listdir("/proc/self/task")),
        "python_threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "native_slots": int(stats["slots"]),
        "native_pending_rendezvous": int(stats["pending_rendezvous"]),
    }


def release_free_heap() -> bool:
    """Returns the C heap's free pages to the OS (glibc ``malloc_trim``); False where there is none."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collectives", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--swap-prob", type=float, default=0.02, help="chance of a hot-swap before each collective")
    ap.add_argument("--fault-prob", type=float, default=0.01, help="chance of injecting or healing a fault")
    ap.add_argument("--comm-prob", type=float, default=0.002, help="chance of a throwaway Communicator")
    ap.add_argument("--time-scale", type=float, default=1e-2, help="link emulation time scale")
    ap.add_argument("--json", default=DEFAULT_JSON)
    args = ap.parse_args(argv)

    jaxccl.emulate(NUM_DEVICES)
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jaxccl.runtime.emulated import LinkEmulation
    from jaxccl.synth import baselines
    from jaxccl.topology import rail, scenario

    rng = np.random.default_rng(args.seed)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    topo = rail(hosts=2, gpus_per_host=4)
    faults = [scenario(topo, "fail1"), scenario(topo, "fail2"), topo.degrade(0, "tor:s0r0", gbps=100), topo]
    pools = {
        "all_gather": [jaxccl.synth.all_gather(topo), baselines.ring_allgather(topo, channels=2)],
        "all_to_all": [jaxccl.synth.all_to_all(topo), baselines.direct_alltoall(topo)],
        "reduce_scatter": [baselines.ring_reduce_scatter(topo), baselines.direct_reduce_scatter(topo)],
    }
    for pool in pools.values():
        for s in pool:
            s.validate()

    def programs(lib):
        def make(kind):
            def body(x):
                if kind == "all_gather":
                    return lib.all_gather(x, "d", tiled=True)
                if kind == "all_to_all":
                    return lib.all_to_all(x, "d", 0, 0, tiled=True)
                if kind == "psum_scatter":
                    return lib.psum_scatter(x, "d", scatter_dimension=0, tiled=True)
                return lib.psum(x, "d")

            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

        return {k: make(k) for k in KINDS}

    ours, ref = programs(jaxccl), programs(jax.lax)
    comm = jaxccl.Communicator(
        mesh, "d", topology=topo, backend="cpu", link_emulation=LinkEmulation(time_scale=args.time_scale)
    )
    for coll, pool in pools.items():
        comm.install(coll, pool[0])

    def data(kind: str, elems: int, seed: int):
        g = np.random.default_rng(seed)
        if kind.startswith("psum"):
            return g.integers(-(2**20), 2**20, size=NUM_DEVICES * elems, dtype=np.int32)
        return (g.standard_normal(NUM_DEVICES * elems) + 0.25).astype(np.float32)

    # Warm-up: compile every program once, so the "before" figures include the compiled programs.
    with comm:
        for kind in KINDS:
            for elems in ELEMS:
                x = data(kind, elems, 0)
                ours[kind](x).block_until_ready()
                ref[kind](x).block_until_ready()
    gc.collect()
    before = resources()

    counts = {"collectives": 0, "mismatches": 0, "swaps": 0, "faults": 0, "throwaway_communicators": 0}
    per_kind = {k: 0 for k in KINDS}
    rss_curve: list[tuple[int, float]] = []  # (collectives done, resident MiB): a leak grows, a plateau does not
    t0 = time.perf_counter()
    with comm:
        for i in report.progress(range(args.collectives), label="soak"):
            if rng.random() < args.swap_prob:
                coll = str(rng.choice(sorted(pools)))
                comm.install(coll, pools[coll][int(rng.integers(len(pools[coll])))])
                counts["swaps"] += 1
            if rng.random() < args.fault_prob:
                comm.inject(faults[int(rng.integers(len(faults)))])
                counts["faults"] += 1
            if rng.random() < args.comm_prob:
                extra = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu")
                extra.install("all_gather", pools["all_gather"][1])
                with extra:
                    x = data("all_gather", ELEMS[0], i)
                    if not np.array_equal(np.asarray(ours["all_gather"](x)), np.asarray(ref["all_gather"](x))):
                        counts["mismatches"] += 1
                del extra
                counts["throwaway_communicators"] += 1
            kind = KINDS[int(rng.integers(len(KINDS)))]
            x = data(kind, ELEMS[int(rng.integers(len(ELEMS)))], i)
            got, want = np.asarray(ours[kind](x)), np.asarray(ref[kind](x))
            if got.shape != want.shape or not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                counts["mismatches"] += 1
            counts["collectives"] += 1
            per_kind[kind] += 1
            if (i + 1) % max(1, args.collectives // 10) == 0:
                rss_curve.append((i + 1, resources()["rss_mib"]))
    elapsed = time.perf_counter() - t0
    comm.inject(topo)
    gc.collect()
    after = resources()
    # Programs traced with the throwaway communicators keep their slots while JAX caches them.
    jax.clear_caches()
    gc.collect()
    after_clear = resources()
    # What the C allocator holds but no longer uses (freed memory kept in its arenas) is not a leak.
    release_free_heap()
    after_trim = resources()

    rows = [
        {
            "resource": k,
            "before": before[k],
            "after": after[k],
            "delta": after[k] - before[k],
            "after clear_caches": after_clear[k],
            "delta then": after_clear[k] - before[k],
            "after malloc_trim": after_trim[k],
            "delta trimmed": after_trim[k] - before[k],
        }
        for k in before
    ]
    print()
    report.print_table([{**counts, "seconds": elapsed}])
    print()
    report.print_table(rows, floatfmt=".1f")
    print()
    report.print_table([{"collectives": n, "rss_mib": r} for n, r in rss_curve], floatfmt=".1f")
    report.write_json(
        args.json,
        {
            "benchmark": "soak",
            "seed": args.seed,
            "counts": counts,
            "per_kind": per_kind,
            "seconds": elapsed,
            "before": before,
            "after": after,
            "delta": {k: after[k] - before[k] for k in before},
            "rss_curve": rss_curve,
            "after_clear_caches": after_clear,
            "delta_after_clear_caches": {k: after_clear[k] - before[k] for k in before},
            "after_malloc_trim": after_trim,
            "delta_after_malloc_trim": {k: after_trim[k] - before[k] for k in before},
        },
    )
    print(f"wrote {args.json}")
    return 1 if counts["mismatches"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
