"""Benchmark of the AllGather synthesizer (ForestColl phases, ForestColl-warm, latency-aware switch removal).

Two benchmarks:

* default: rail-optimized 1 x H x 8 topologies (MCCL Sec. 6.1) for H = 2..64
  (16-512 GPUs) in the states base, fail1, fail2, fail3: cold and warm
  (previous = the base schedule) solve times, algbw, bound, trees and max depth
  for both methods; a progress bar, a table and ``--json PATH``. The same code
  runs as ``jaxccl synth allgather --benchmark``; see :mod:`jaxccl.cli.synth_allgather`.
* ``--warm``: the re-synthesis the closed loop waits for. Per case -- the demo's
  fabric (rail 1 x 2 x 4, GPU 0's NIC at 200 Gbps, as ``jaxccl demo`` degrades it),
  rails 1 x {2,4,8,16} x 8 in fail1 and fail2, an 8 x 8 torus with one link at
  half -- the whole ``allgather(topo)`` call (cold) against the whole
  ``allgather(topo, previous=healthy schedule)`` call (warm), interleaved run by
  run in one process, medians of wall-clock and CPU time (CPU time is what a
  loaded machine distorts least); max tree depth of both, and the time of
  ``validate()`` on the warm result (the reference interpreter the controller
  runs before staging). Both results must reach the same algbw and validate.

* ``--scale``: synthesis at cluster scale (issue 32). Rails of 1, 2 and 4
  segments x 8 GPUs per host from 32 to ``--max-gpus`` (512) GPUs, and
  oversubscribed fat trees (uplinks at half the leaves' GPU links); per case
  the cold ``allgather(topo)`` call and the warm one after one degraded NIC
  (GPU 0's link to its ToR or leaf at 50 Gbps, ``previous`` = the healthy
  schedule): CPU seconds, max tree depth, algbw / the bound the schedule
  reports, which splitting switch removal used and whether the warm result
  is certified by its trees; schedules up to ``--validate-max`` GPUs also run
  through the reference interpreter. Run it with ``OPENBLAS_NUM_THREADS=1``:
  otherwise OpenBLAS's idle threads spin after every call and count as CPU
  time (2 x 4 x 8 warm: 152 ms of CPU for 77 ms of wall-clock time on 2 cores).

Usage:
    nice -n 10 python -m benchmarks.synth.allgather [--max-hosts 8] [--json results.json]
    nice -n 10 python -m benchmarks.synth.allgather --warm [--runs 20] [--json results.json]
    OPENBLAS_NUM_THREADS=1 nice -n 10 python -m benchmarks.synth.allgather --scale [--max-gpus 512] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from jaxccl.cli.synth_allgather import add_arguments, main
from jaxccl.util import report

WARM_COLUMNS = (
    "case",
    "gpus",
    "runs",
    "cold_ms",
    "warm_ms",
    "speedup",
    "cold_cpu_ms",
    "warm_cpu_ms",
    "cpu_speedup",
    "cold_depth",
    "warm_depth",
    "algbw_GBps",
    "validate_ms",
)


def warm_cases(max_hosts: int = 16) -> list[tuple[str, Callable]]:
    """``(name, make)`` per case; ``make()`` returns the healthy topology and the degraded one."""
    from jaxccl.topology import rail, scenario, torus

    def demo():
        base = rail(hosts=2, gpus_per_host=4)
        return base, base.degrade(0, "tor:s0r0", gbps=200)

    def half_link_torus():
        base = torus(8, 8)
        return base, base.degrade(0, 1, capacity=base.capacity(0, 1) / 2)

    cases = [("demo 1x2x4 NIC 200G", demo)]
    for hosts in (h for h in (2, 4, 8, 16) if h <= max_hosts):
        for state in ("fail1", "fail2"):
            cases.append((f"1x{hosts}x8 {state}", lambda h=hosts, s=state: (rail(hosts=h), scenario(rail(hosts=h), s))))
    cases.append(("torus 8x8 link at half", half_link_torus))
    return cases


def _call(fn: Callable, *args, **kwargs) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def run_warm(runs: int, max_hosts: int = 16, stream=None) -> list[dict]:
    """Cold vs warm re-synthesis per case (see the module docstring); one row per case."""
    from jaxccl.synth.allgather import allgather

    rows = []
    for name, make in report.progress(warm_cases(max_hosts), label="warm vs cold", stream=stream):
        base, topo = make()
        healthy = allgather(base)
        n_runs = runs if topo.num_gpus <= 32 else max(3, runs // 4)
        t: dict[str, list[float]] = {"cold": [], "warm": [], "cold_cpu": [], "warm_cpu": [], "validate": []}
        for _ in range(n_runs):  # interleaved: both see the same machine load
            cold, wall, cpu = _call(allgather, topo)
            t["cold"].append(wall)
            t["cold_cpu"].append(cpu)
            warm, wall, cpu = _call(allgather, topo, previous=healthy)
            t["warm"].append(wall)
            t["warm_cpu"].append(cpu)
            _, wall, _ = _call(warm.validate)
            t["validate"].append(wall)
        cold.validate()
        if warm.algbw != cold.algbw or warm.info["certificate"] != "trees":
            raise AssertionError(f"{name}: warm {warm.algbw} ({warm.info['certificate']}) vs cold {cold.algbw}")
        med = {k: statistics.median(v) for k, v in t.items()}
        rows.append(
            {
                "case": name,
                "gpus": topo.num_gpus,
                "runs": n_runs,
                "cold_ms": med["cold"] * 1e3,
                "warm_ms": med["warm"] * 1e3,
                "speedup": med["cold"] / med["warm"],
                "cold_cpu_ms": med["cold_cpu"] * 1e3,
                "warm_cpu_ms": med["warm_cpu"] * 1e3,
                "cpu_speedup": med["cold_cpu"] / med["warm_cpu"],
                "cold_depth": cold.info["max_depth"],
                "warm_depth": warm.info["max_depth"],
                "algbw_GBps": warm.algbw / 1e9,
                "validate_ms": med["validate"] * 1e3,
                "warm_phase_ms": {k: v * 1e3 for k, v in warm.info["phase_times_s"].items()},
                "warm_packing_stats": warm.info["packing_stats"],
                "times_s": t,
            }
        )
    return rows


def warm_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="warm vs cold AllGather re-synthesis (the closed loop's wait)")
    ap.add_argument("--warm", action="store_true", required=True)
    ap.add_argument("--runs", type=int, default=20, help="runs per case (a quarter, at least 3, above 32 GPUs)")
    ap.add_argument("--max-hosts", type=int, default=16, help="largest H of the 1 x H x 8 rails (default 16)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = run_warm(args.runs, args.max_hosts)
    deeper = [r["case"] for r in rows if r["warm_depth"] > r["cold_depth"]]
    return _finish(rows, WARM_COLUMNS, "warm trees deeper than cold", deeper, args.json)


def _finish(rows: list[dict], columns: tuple, what: str, cases: list[str], path: str | None, **extra: Any) -> int:
    """Prints the table and the ``cases`` that are ``what``; writes the JSON (rows, columns, ``extra``) to ``path``."""
    report.print_table(rows, columns)
    print(f"{what}: " + (", ".join(cases) if cases else "none"))
    if path:
        report.write_json(path, {"rows": rows, "columns": list(columns), **extra})
        print(f"wrote {path}")
    return 0


SCALE_COLUMNS = (
    "fabric",
    "gpus",
    "cold_cpu_s",
    "cold_depth",
    "cold_algbw_over_bound",
    "split",
    "warm_cpu_s",
    "warm_wall_s",
    "warm_depth",
    "warm_algbw_over_bound",
    "warm_certificate",
    "validated",
)
SCALE_SEGMENTS = (1, 2, 4)
SCALE_GPUS = (32, 64, 128, 256, 512)
DEGRADED_NIC_GBPS = 50


def scale_cases(max_gpus: int = 512) -> list[tuple[str, Callable]]:
    """``(name, make)`` per fabric; ``make()`` returns the healthy topology and the one with GPU 0's NIC degraded."""
    from jaxccl.topology import fat_tree, rail

    def degraded(base, switch):
        return base, base.degrade(0, switch, gbps=DEGRADED_NIC_GBPS)

    cases = []
    for segments in SCALE_SEGMENTS:
        for gpus in (g for g in SCALE_GPUS if g <= max_gpus):
            hosts = gpus // (8 * segments)
            if hosts < 1:
                continue
            make = lambda h=hosts, s=segments: degraded(  # noqa: E731
                rail(hosts=h, gpus_per_host=8, segments=s, max_hosts_per_segment=None), "tor:s0r0"
            )
            cases.append((f"rail {segments}x{hosts}x8", make))
    for leaves, per_leaf, spines in ((8, 8, 2), (16, 16, 4)):
        if leaves * per_leaf <= max_gpus:
            # 2:1 oversubscribed: each leaf's uplinks carry half of what its GPUs can send
            up = per_leaf * 400 / spines / 2
            make = lambda a=leaves, b=per_leaf, c=spines, u=up: degraded(  # noqa: E731
                fat_tree(a, b, c, uplink_gbps=u), "leaf:0"
            )
            cases.append((f"fat-tree {leaves}x{per_leaf} {spines} spines 2:1", make))
    return cases


def _forget_fabrics() -> None:
    """Empties what synthesis keeps per fabric across calls, so that the next call is a cold one."""
    from jaxccl.synth.allgather import network, switch_removal

    with network._SHAPE_LOCK:  # noqa: SLF001 - the benchmark measures a first call on the fabric
        network._SHAPE_CACHE.clear()  # noqa: SLF001
    with switch_removal._PLANS_LOCK:  # noqa: SLF001
        switch_removal._PLANS.clear()  # noqa: SLF001


def run_scale(max_gpus: int = 512, validate_max: int = 128, warm_runs: int = 5, stream=None) -> list[dict]:
    """Cold and warm synthesis per fabric of :func:`scale_cases`; one row per fabric.

    Cold: the first call on the fabric in the process (per-fabric caches emptied first). Warm: the median of
    ``warm_runs`` calls up to 128 GPUs, one above.
    """
    from jaxccl.synth.allgather import allgather

    rows = []
    for name, make in report.progress(scale_cases(max_gpus), label="scale", stream=stream):
        base, topo = make()
        _forget_fabrics()
        cold, cold_wall, cold_cpu = _call(allgather, base)
        runs = [_call(allgather, topo, previous=cold) for _ in range(warm_runs if topo.num_gpus <= 128 else 1)]
        warm = runs[-1][0]
        warm_wall = statistics.median(r[1] for r in runs)
        warm_cpu = statistics.median(r[2] for r in runs)
        validated = topo.num_gpus <= validate_max
        if validated:
            cold.validate()
            warm.validate()
        rows.append(
            {
                "fabric": name,
                "gpus": topo.num_gpus,
                "cold_cpu_s": cold_cpu,
                "cold_wall_s": cold_wall,
                "cold_depth": cold.info["max_depth"],
                "cold_algbw_over_bound": cold.algbw / cold.bound,
                "split": cold.info["switch_removal"]["split"],
                "warm_cpu_s": warm_cpu,
                "warm_wall_s": warm_wall,
                "warm_depth": warm.info["max_depth"],
                "warm_algbw_over_bound": warm.algbw / warm.bound,
                "warm_certificate": warm.info["certificate"],
                "validated": validated,
                "cold_phase_s": cold.info["phase_times_s"],
                "warm_phase_s": warm.info["phase_times_s"],
                "k": cold.chunks_per_period,
                "trees": cold.info["num_trees"],
            }
        )
    return rows


def scale_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="AllGather synthesis at cluster scale: multi-segment rails, fat trees")
    ap.add_argument("--scale", action="store_true", required=True)
    ap.add_argument("--max-gpus", type=int, default=512, help="largest fabric (default 512 GPUs)")
    ap.add_argument("--validate-max", type=int, default=128, help="validate schedules up to this many GPUs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = run_scale(args.max_gpus, args.validate_max)
    blas = os.environ.get("OPENBLAS_NUM_THREADS")
    print(f"OPENBLAS_NUM_THREADS={blas} (unset: OpenBLAS's idle threads spin and count as CPU time)")
    short = [r["fabric"] for r in rows if min(r["cold_algbw_over_bound"], r["warm_algbw_over_bound"]) < 1 - 2e-3]
    return _finish(rows, SCALE_COLUMNS, "more than 0.2 % below the bound", short, args.json, openblas_num_threads=blas)


if __name__ == "__main__":
    if "--warm" in sys.argv[1:]:
        sys.exit(warm_main(sys.argv[1:]))
    if "--scale" in sys.argv[1:]:
        sys.exit(scale_main(sys.argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.set_defaults(benchmark=True)  # the script is the benchmark
    sys.exit(main(ap.parse_args()))
