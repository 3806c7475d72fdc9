"""Benchmark of the synthesizers beyond rails (issue 15): tori, warm AllGather, group collectives.

Three tables, every ratio against a baseline measured in the same run:

* **AllToAll on tori** (4x4, 6x6, 8x8): CPU seconds of the whole cold call
  (``time.process_time``; the target is 10 s at 8x8), the rounding gap, ``K``,
  and algbw against the direct baseline (every pair on its one shortest
  route, rate from the link loads).
* **Warm AllGather** on the demo's 8-GPU fabric (GPU 0's NIC at 200 Gbps)
  and on 1x16x8 fail2: the whole call a user waits for, warm
  (``previous=`` the healthy schedule) and cold interleaved, medians; max
  tree depth of both.
* **Group collectives**: AllGather over one torus row / one rail of a
  rail fabric, the group's own view against the view with relays.

Usage:
    nice -n 10 python -m benchmarks.synth.topologies [--runs 7] [--max-torus 8] \
        [--json benchmarks/results/synth_topologies.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter

from jaxccl.synth import all_gather, all_to_all
from jaxccl.topology import Topology, rail, scenario, torus


def direct_algbw(topo: Topology) -> float:
    """algbw of every pair on its one minimum-latency route: N * rate, rate = min over links of capacity / pairs."""
    load: Counter = Counter()
    for s in topo.gpus:
        for d in topo.gpus:
            if s != d:
                load.update(topo.path(s, d))
    return topo.num_gpus * min(topo.capacity(u, v) / n for (u, v), n in load.items())


def alltoall_tori(max_side: int) -> list[dict]:
    rows = []
    for side in range(4, max_side + 1, 2):
        topo = torus(side, side)
        cpu, wall = time.process_time(), time.perf_counter()
        s = all_to_all(topo)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        base = direct_algbw(topo)
        rows.append(
            {
                "topology": topo.name,
                "cpu_s": cpu,
                "wall_s": wall,
                "rounding_wall_s": s.info["timings"]["rounding"],
                "algbw": s.algbw,
                "bound": s.bound,
                "gap_pct": s.info["gap_pct"],
                "chunks": s.chunks_per_period,
                "direct_algbw": base,
                "ratio_vs_direct": s.algbw / base,
            }
        )
        print(f"  alltoall {topo.name}: {cpu:.1f} s CPU", file=sys.stderr, flush=True)
    return rows


def warm_allgather(runs: int) -> list[dict]:
    demo = rail(hosts=2, gpus_per_host=4)
    cases = [
        ("demo 1x2x4, GPU 0 NIC 200 Gbps", demo, demo.degrade(0, "tor:s0r0", gbps=200), runs),
        ("1x16x8 fail2", rail(hosts=16), scenario(rail(hosts=16), "fail2"), max(3, runs // 2)),
    ]
    rows = []
    for name, healthy, failed, n in cases:
        base = all_gather(healthy)
        warm_t, cold_t = [], []
        for _ in range(n):  # interleaved: this machine drifts
            t = time.perf_counter()
            warm = all_gather(failed, previous=base)
            warm_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            cold = all_gather(failed)
            cold_t.append(time.perf_counter() - t)
        ratios = [c / w for c, w in zip(cold_t, warm_t)]
        rows.append(
            {
                "case": name,
                "runs": n,
                "warm_ms": 1e3 * statistics.median(warm_t),
                "cold_ms": 1e3 * statistics.median(cold_t),
                "speedup": statistics.median(ratios),
                "warm_depth": warm.info["max_depth"],
                "cold_depth": cold.info["max_depth"],
                "same_algbw": warm.algbw == cold.algbw,
                "warm_phases_ms": {k: 1e3 * v for k, v in warm.info["phase_times_s"].items()},
            }
        )
        print(f"  warm allgather {name}: done", file=sys.stderr, flush=True)
    return rows


def groups() -> list[dict]:
    cases = [
        ("torus 4x4, row 0", torus(4, 4), [0, 1, 2, 3]),
        ("torus 4x4, column 0", torus(4, 4), [0, 4, 8, 12]),
        ("rail 1x4x8, rail 0", rail(hosts=4), [0, 8, 16, 24]),
        ("rail 1x4x8, host 0", rail(hosts=4), list(range(8))),
    ]
    rows = []
    for name, topo, group in cases:
        s = all_gather(topo, group=group)
        info = s.info["group"]
        own = info["algbw"].get("own", 0.0)
        rows.append(
            {
                "case": name,
                "own_algbw": own,
                "relays_algbw": info["algbw"]["relays"],
                "view": info["view"],
                "ratio": info["algbw"]["relays"] / own if own else None,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--max-torus", type=int, default=8)
    ap.add_argument("--json", default="benchmarks/results/synth_topologies.json")
    args = ap.parse_args(argv)
    out = {
        "alltoall_tori": alltoall_tori(args.max_torus),
        "warm_allgather": warm_allgather(args.runs),
        "groups": groups(),
    }
    print("\nAllToAll, cold, on tori (baseline: every pair on its shortest route)")
    print("| topology | CPU | wall | algbw | bound | gap | K | direct | x direct |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out["alltoall_tori"]:
        print(
            f"| {r['topology']} | {r['cpu_s']:.2f} s | {r['wall_s']:.2f} s | {r['algbw'] / 1e9:.2f} GB/s | "
            f"{r['bound'] / 1e9:.2f} GB/s | {r['gap_pct']:.3f} % | {r['chunks']} | "
            f"{r['direct_algbw'] / 1e9:.2f} GB/s | {r['ratio_vs_direct']:.2f} |"
        )
    print("\nAllGather, warm vs cold, whole call (interleaved medians)")
    print("| case | runs | warm | cold | cold / warm | depth warm / cold |\n|---|---|---|---|---|---|")
    for r in out["warm_allgather"]:
        print(
            f"| {r['case']} | {r['runs']} | {r['warm_ms']:.1f} ms | {r['cold_ms']:.1f} ms | {r['speedup']:.2f} | "
            f"{r['warm_depth']} / {r['cold_depth']} |"
        )
    print("\nAllGather of a group: own view vs relays through other GPUs")
    print("| case | own view | with relays | x | kept |\n|---|---|---|---|---|")
    for r in out["groups"]:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        print(
            f"| {r['case']} | {r['own_algbw'] / 1e9:.1f} GB/s | {r['relays_algbw'] / 1e9:.1f} GB/s | {ratio} | "
            f"{r['view']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
