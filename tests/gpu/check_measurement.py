"""GPU check of the CUDA executor's passive measurement (MCCL Sec. 5.1-5.2, Fig. 9a, Table 2).

On every local GPU (one rank per GPU, the ``cuda`` backend):

1. correctness: AllGather results are compared bitwise with ``jax.lax.all_gather`` on
   random data, with measurement off and on, for NCCL-style rings
   (``jaxccl.synth.baselines.ring_allgather(n, channels=k)``) and pipelined rings
   (``depth`` chunks per channel and rank, so every threadblock streams many messages);
2. measurement: the drained records name exactly the expected keys (every GPU's
   intra-node injection; with the GPUs split into two pretend hosts, the cross-host
   pairs as inter-node keys), every bandwidth is finite and positive, and it is
   printed per GPU / pair next to the rate the collective's timing implies;
3. reductions are not measured (a ReduceScatter adds no record and no window);
4. a full Measurements Buffer (one slot per threadblock, never drained) drops
   records without blocking the collective and counts the drops;
5. overhead: AllGather time with measurement on vs off for 1-32 channels and
   128 KiB / 1 MiB chunks (MCCL Fig. 9a), as medians of interleaved runs;
6. memory footprint of the accumulators, caches and buffer (MCCL Table 2).

Without a CUDA device (or without a CUDA module) it prints
``skipped: no CUDA device`` and exits 0. Exit status 1 means a check failed.

Usage:
    PYTHONPATH=. python tests/gpu/check_measurement.py [--quick] [--runs N] [--json PATH]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxccl.telemetry.records import INTER, INTRA, decode

KIND_NAMES = {INTRA: "intra", INTER: "inter"}
CHUNKS = (128 << 10, 1 << 20)
FULL_CHANNELS = (1, 2, 4, 8, 16, 32)
QUICK_CHANNELS = (1, 4)
PIPELINE_DEPTH = 8


def pipelined_ring_allgather(n: int, channels: int, depth: int) -> Any:
    """Ring AllGather whose channel ``j`` carries ``depth`` consecutive chunks of every rank.

    ``C = channels * depth`` chunks per period; each rank forwards a chunk to its
    successor as soon as it has received it, so each send threadblock posts
    ``depth * (N - 1)`` messages (``ring_allgather`` posts ``N - 1``).
    """
    from jaxccl.schedule import Buffer, ScheduleBuilder
    from jaxccl.synth import baselines

    if depth == 1:
        return baselines.ring_allgather(n, channels=channels)
    c = channels * depth
    b = ScheduleBuilder("all_gather", num_ranks=n, chunks_per_period=c)
    inp, out = Buffer.INPUT, Buffer.OUTPUT
    for r in range(n):
        b.copy(r, (inp, 0), (out, r * c), c)
    held: dict[tuple[int, int, int], Any] = {}  # (holder, origin, chunk) -> handle of the receive
    for step in range(n - 1):
        for origin in range(n):
            holder = (origin + step) % n
            for i in range(c):
                src = (inp, i) if step == 0 else (out, origin * c + i)
                after = () if step == 0 else (held[(holder, origin, i)],)
                h = b.transfer(holder, (holder + 1) % n, src, (out, origin * c + i), channel=i // depth, after=after)
                held[((holder + 1) % n, origin, i)] = h
    return b.build(name=f"pipelined_ring_allgather_c{channels}_d{depth}").validate()


def per_key(recs: np.ndarray) -> dict[tuple[int, int, int], tuple[int, float]]:
    """(src, dst, kind) -> (windows, mean bandwidth in bytes/s)."""
    acc: dict[tuple[int, int, int], list[float]] = {}
    for r in recs:
        a = acc.setdefault((int(r["src"]), int(r["dst"]), int(r["kind"])), [0, 0.0])
        a[0] += int(r["count"])
        a[1] += float(r["sum_bw"])
    return {k: (int(c), s / c if c else math.nan) for k, (c, s) in acc.items()}


def ring_keys(n: int, hosts: list[int]) -> set[tuple[int, int, int]]:
    """What a ring 0 -> 1 -> ... -> n-1 -> 0 measures: each rank's injection, or its cross-host pair."""
    keys = set()
    for r in range(n):
        nxt = (r + 1) % n
        keys.add((r, -1, INTRA) if hosts[r] == hosts[nxt] else (r, nxt, INTER))
    return keys


class Checker:
    """Collects named pass/fail checks with a message."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Records and prints one check; returns ``ok``."""
        self.results.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}")
        return bool(ok)

    @property
    def all_ok(self) -> bool:
        return all(r["ok"] for r in self.results)


def main(argv: list[str] | None = None) -> int:
    """Runs the checks; 0 if all pass (or there is no GPU), 1 otherwise."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer channel counts and runs (the pytest smoke run)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per point and setting (default 15; quick 5)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    args = ap.parse_args(argv)
    runs = args.runs or (5 if args.quick else 15)

    import jaxccl
    from jaxccl.util import report

    reason = _no_gpu_reason(jaxccl)
    if reason:
        print(f"skipped: no CUDA device ({reason})")
        if args.json:
            report.write_json(args.json, {"benchmark": "gpu_measurement", "skipped": True, "reason": reason})
        return 0

    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxccl.runtime import native

    cu = native._cuda_module()  # jaxccl's own build or the cuda12 plugin's
    from jaxccl.synth import baselines

    native.set_timeout(60.0)
    devices = jax.devices("gpu")
    n = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    comm = jaxccl.Communicator(mesh, "d", backend="cuda")
    chk = Checker()
    print(f"{n} GPU(s): {[d.device_kind for d in devices]}")

    def jitted(body: Callable) -> Callable:
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    ag_jaxccl = jitted(lambda v: jaxccl.all_gather(v, "d", tiled=True))
    ag_lax = jitted(lambda v: jax.lax.all_gather(v, "d", tiled=True))

    def run_ag(x: jax.Array) -> jax.Array:
        with comm:
            return ag_jaxccl(x)

    def data(per_rank_bytes: int, dtype: Any, seed: int) -> jax.Array:
        elems = per_rank_bytes // np.dtype(dtype).itemsize
        rng = np.random.default_rng(seed)
        if np.issubdtype(np.dtype(dtype), np.integer):
            host = rng.integers(-(2**30), 2**30, size=n * elems).astype(dtype)
        else:
            host = rng.standard_normal(n * elems).astype(dtype)
        return jax.device_put(host, sharding)

    def filler(per_rank_bytes: int) -> jax.Array:
        """Timing input made on the devices (its values do not matter; no results are compared)."""
        elems = n * per_rank_bytes // 4
        return jax.jit(lambda: jax.numpy.ones((elems,), jax.numpy.float32), out_shardings=sharding)()

    def configure(enabled: bool, hosts: list[int] | None = None, slots: int = 64) -> None:
        cu.measure_configure(enabled, hosts or [0] * n, 1, 1, slots)

    # ------------------------------------------------------------------ 1. correctness
    print("\n1. AllGather vs jax.lax.all_gather, bitwise")
    cases = [(1, 1), (4, 1), (2, 4)] if n > 1 else [(1, 1)]
    for channels, depth in cases:
        sched = pipelined_ring_allgather(n, channels, depth)
        comm.install("all_gather", sched)
        for dtype in (np.float32, jax.numpy.bfloat16, np.int32):
            for enabled in (False, True):
                configure(enabled)
                x = data(channels * depth * (64 << 10), dtype, seed=channels * 10 + depth)
                got = np.asarray(run_ag(x))
                want = np.asarray(ag_lax(x))
                chk.check(
                    f"{sched.name} {np.dtype(dtype).name} measure={'on' if enabled else 'off'}",
                    got.tobytes() == want.tobytes(),
                )
    cu.measure_drain()

    if n == 1:
        print("\nonly one GPU: nothing is sent, so there is nothing to measure; stopping after correctness")
        return _finish(args, chk, report, {"num_gpus": n})

    # ------------------------------------------------------------------ 2. what is measured
    print("\n2. measured bandwidth (one host; then two pretend hosts)")
    channels, depth, chunk = 4, PIPELINE_DEPTH, 1 << 20
    comm.install("all_gather", pipelined_ring_allgather(n, channels, depth))
    x = data(channels * depth * chunk, np.float32, seed=7)
    per_rank = channels * depth * chunk
    measured: dict[str, Any] = {}
    for label, hosts in (("one_host", [0] * n), ("two_hosts", [r * 2 // n for r in range(n)])):
        configure(True, hosts)
        run_ag(x).block_until_ready()  # compiles for this shape
        cu.measure_reset()
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            run_ag(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        raw, dropped = cu.measure_drain()
        keys = per_key(decode(raw, num_gpus=n))
        expected = ring_keys(n, hosts)
        chk.check(f"{label}: measured keys are the ring's", set(keys) == expected, f"got {sorted(keys)}")
        chk.check(f"{label}: no record dropped", dropped == 0, f"dropped {dropped}")
        chk.check(
            f"{label}: every bandwidth finite and > 0",
            all(math.isfinite(bw) and bw > 0 for _, bw in keys.values()),
        )
        # Each GPU injects (N-1) * per_rank bytes per call; timing includes launch and rendezvous.
        implied = (n - 1) * per_rank / report.median(times)
        rows = [
            {
                "src": s,
                "dst": "-" if d < 0 else d,
                "kind": KIND_NAMES[k],
                "windows": w,
                "measured_GBs": bw / 1e9,
                "timing_GBs": implied / 1e9,
                "ratio": bw / implied,
            }
            for (s, d, k), (w, bw) in sorted(keys.items())
        ]
        report.print_table(rows, ["src", "dst", "kind", "windows", "measured_GBs", "timing_GBs", "ratio"])
        measured[label] = {"hosts": hosts, "rows": rows, "median_time_s": report.median(times)}

    # ------------------------------------------------------------------ 3. reductions
    print("\n3. reductions are not measured")
    configure(True)
    cu.measure_reset()
    rs_jaxccl = jitted(lambda v: jaxccl.psum_scatter(v, "d", scatter_dimension=0, tiled=True))
    rs_lax = jitted(lambda v: jax.lax.psum_scatter(v, "d", scatter_dimension=0, tiled=True))
    xi = data(n * (256 << 10), np.int32, seed=3)
    with comm:
        got = np.asarray(rs_jaxccl(xi))
    chk.check("reduce_scatter int32 bitwise vs jax.lax", got.tobytes() == np.asarray(rs_lax(xi)).tobytes())
    raw, dropped = cu.measure_drain()
    st = cu.measure_stats()
    chk.check("reduce_scatter left no record and no window", len(raw) == 0 and st["windows"] == 0, f"{st}")

    # ------------------------------------------------------------------ 4. full buffer
    print("\n4. a full Measurements Buffer drops without blocking")
    comm.install("all_gather", pipelined_ring_allgather(n, 1, 16))
    configure(True, slots=1)
    cu.measure_reset()
    xf = data(16 * (64 << 10), np.float32, seed=11)
    want = np.asarray(ag_lax(xf)).tobytes()
    ok = True
    for _ in range(3):
        ok &= np.asarray(run_ag(xf)).tobytes() == want
    st = cu.measure_stats()
    chk.check("collectives with a full buffer complete and stay correct", ok)
    send_tbs = n  # one send threadblock per rank
    chk.check(
        "records fit the slots; the rest are dropped and counted",
        st["records"] <= send_tbs
        and st["used"] == st["records"]
        and st["records"] + st["dropped"] > send_tbs
        and st["dropped"] >= 1,
        f"records {st['records']}, used {st['used']}, dropped {st['dropped']}, slots {st['slots']}",
    )
    raw, dropped = cu.measure_drain()
    chk.check(
        "drain returns the written records and the drop count",
        len(decode(raw)) == st["records"] and dropped == st["dropped"] and cu.measure_stats()["used"] == 0,
        f"drained {len(decode(raw))}, dropped {dropped}",
    )

    # ------------------------------------------------------------------ 5. overhead
    print("\n5. overhead: measurement on vs off (MCCL Fig. 9a)")
    rows = []
    channel_list = QUICK_CHANNELS if args.quick else FULL_CHANNELS
    chunk_list = CHUNKS[:1] if args.quick else CHUNKS
    points = [(k, c, d) for k in channel_list for c in chunk_list for d in (1, PIPELINE_DEPTH)]
    for k, chunk, depth in report.progress(points, label="overhead"):
        comm.install(
            "all_gather",
            baselines.ring_allgather(n, channels=k) if depth == 1 else pipelined_ring_allgather(n, k, depth),
        )
        size = k * depth * chunk
        x = filler(size)
        timing: dict[bool, list[float]] = {False: [], True: []}
        for enabled in (False, True):
            configure(enabled)
            for _ in range(args.warmup):
                run_ag(x).block_until_ready()
        for _ in range(runs):
            for enabled in (False, True):
                configure(enabled)
                t0 = time.perf_counter()
                run_ag(x).block_until_ready()
                timing[enabled].append(time.perf_counter() - t0)
            cu.measure_drain()  # outside the timed calls, so the buffer never fills
        off, on = report.median(timing[False]), report.median(timing[True])
        rows.append(
            {
                "channels": k,
                "chunk": report.format_bytes(chunk),
                "depth": depth,
                "size": report.format_bytes(size),
                "time_off_us": off * 1e6,
                "time_on_us": on * 1e6,
                "algbw_off_GBs": n * size / off / 1e9,
                "algbw_on_GBs": n * size / on / 1e9,
                "overhead_pct": (on / off - 1) * 100,
            }
        )
        del x
    report.print_table(
        rows,
        [
            "channels",
            "chunk",
            "depth",
            "size",
            "time_off_us",
            "time_on_us",
            "algbw_off_GBs",
            "algbw_on_GBs",
            "overhead_pct",
        ],
    )

    # ------------------------------------------------------------------ 6. footprint
    st = cu.measure_stats()
    footprint = {
        k: st[k]
        for k in (
            "accumulator_bytes",
            "cache_bytes",
            "buffer_bytes",
            "counter_bytes",
            "regions",
            "slots",
            "slots_per_tb",
            "cache_entry_bytes",
            "cache_entries_per_tb",
        )
    }
    print("\n6. memory footprint (MCCL Table 2), all workspaces so far:")
    report.print_table([footprint])
    configure(False)
    return _finish(args, chk, report, {"num_gpus": n, "measured": measured, "overhead": rows, "footprint": footprint})


def _no_gpu_reason(jaxccl: Any) -> str:
    """Why this machine cannot run the check ('' if it can)."""
    try:
        import jax

        if not jax.devices("gpu"):
            return "jax sees no GPU"
    except RuntimeError as e:
        return f"jax has no GPU backend: {str(e).splitlines()[0]}"
    if not jaxccl.has_cuda_support():
        from jaxccl.runtime import native

        return f"no CUDA executor: {native.cuda_status()[1]}"
    return ""


def _finish(args: argparse.Namespace, chk: Checker, report: Any, extra: dict[str, Any]) -> int:
    print(f"\n{sum(r['ok'] for r in chk.results)}/{len(chk.results)} checks passed")
    if args.json:
        report.write_json(
            args.json,
            {
                "benchmark": "gpu_measurement",
                "skipped": False,
                "quick": args.quick,
                "checks": chk.results,
                "all_ok": chk.all_ok,
                **extra,
            },
        )
    return 0 if chk.all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
