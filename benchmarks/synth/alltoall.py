"""Benchmark of the AllToAll synthesizer (column generation on HiGHS, deep-dive rounding; MCCL Sec. 4.2).

Rail-optimized 1 x H x 8 topologies (MCCL Sec. 6.1) for H = 2..64 (16-512
GPUs) in the states base, fail1, fail2, fail3: cold and warm (previous = the
base schedule) times (solve and total, medians of ``--runs``), iterations,
columns generated and reused, LP bound, rounded algbw, gap and chunk count of
both, and the warm mode; a progress bar, a table and ``--json PATH``. The
same code runs as ``jaxccl synth alltoall``; see :mod:`jaxccl.cli.synth_alltoall`.

``--cold-vs REF`` instead times cold calls of this tree against the tree of
the git revision ``REF`` (e.g. ``main``) on rails 1 x H x 8 (base and fail2)
and tori 4x4, 6x6, 8x8 (healthy and with one link at a quarter of its
rate): CPU seconds (``time.process_time()``) and wall seconds of the whole
``alltoall()`` call, each in a fresh process, the two trees alternating
(``--runs`` pairs; medians, and the median of the per-pair CPU ratios),
with the algbw, gap and chunk count of both.

Usage:
    nice -n 10 python -m benchmarks.synth.alltoall [--min-hosts 16] [--max-hosts 64] \
        [--runs 3] [--json results.json]
    nice -n 10 python -m benchmarks.synth.alltoall --cold-vs main [--runs 3] [--cases torus:8:healthy,...] \
        [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from jaxccl.cli.synth_alltoall import add_arguments, main

REPO = Path(__file__).resolve().parents[2]
CASES = (
    "rail:2:base",
    "rail:2:fail2",
    "rail:8:base",
    "rail:8:fail2",
    "rail:16:base",
    "rail:16:fail2",
    "torus:4:healthy",
    "torus:4:degraded",
    "torus:6:healthy",
    "torus:6:degraded",
    "torus:8:healthy",
    "torus:8:degraded",
)

# Runs in a fresh interpreter: imports jaxccl from the tree given as argv[1] (dropping the import
# hook of an editable install, which would otherwise win), synthesizes argv[2] cold, prints JSON.
_CHILD = """
import json, sys, time
sys.meta_path = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
sys.path.insert(0, sys.argv[1])
from jaxccl.synth.alltoall import alltoall
from jaxccl.topology import rail, scenario, torus
family, size, state = sys.argv[2].split(":")
if family == "rail":
    topo = rail(hosts=int(size))
    topo = topo if state == "base" else scenario(topo, state)
else:
    topo = torus(int(size), int(size))
    if state == "degraded":
        topo = topo.degrade(0, 1, capacity=topo.capacity(0, 1) / 4)
cpu, wall = time.process_time(), time.perf_counter()
s = alltoall(topo)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
s.validate()
print(json.dumps({"cpu_s": cpu, "wall_s": wall, "algbw": s.algbw, "bound": s.bound,
                  "gap_pct": s.info["gap_pct"], "chunks": s.chunks_per_period}))
"""


def checkout(ref: str, into: str) -> str:
    """Extracts the ``jaxccl`` package of git revision ``ref`` into the folder ``into``; returns it."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "jaxccl"], check=True, capture_output=True)
    path = Path(into) / "tree.tar"
    path.write_bytes(archive.stdout)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return into


def cold_run(tree: str, case: str, timeout: float) -> dict:
    """One cold ``alltoall()`` of ``case`` with the jaxccl of ``tree``, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, tree, case], check=True, capture_output=True, text=True, timeout=timeout, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(
    ref: str, runs: int, cases: tuple[str, ...] = CASES, timeout: float = 1800.0, json_path: str | None = None
) -> list[dict]:
    """Per case: medians of both trees' cold runs (alternating) and the median per-pair CPU ratio.

    With ``json_path`` the rows so far are written after every case.
    """
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"baseline": checkout(ref, tmp), "current": str(REPO)}
        for case in cases:
            got: dict[str, list[dict]] = {"baseline": [], "current": []}
            for i in range(runs):
                order = ("baseline", "current") if i % 2 == 0 else ("current", "baseline")
                for name in order:
                    got[name].append(cold_run(trees[name], case, timeout))
            row: dict = {"case": case, "runs": runs}
            for name, results in got.items():
                last = results[-1]
                row[name] = {
                    "cpu_s": statistics.median(r["cpu_s"] for r in results),
                    "wall_s": statistics.median(r["wall_s"] for r in results),
                    "algbw": last["algbw"],
                    "bound": last["bound"],
                    "gap_pct": last["gap_pct"],
                    "chunks": last["chunks"],
                }
            ratios = [b["cpu_s"] / c["cpu_s"] for b, c in zip(got["baseline"], got["current"])]
            row["cpu_speedup"] = statistics.median(ratios)
            rows.append(row)
            print(_line(row), flush=True)
            if json_path:
                with open(json_path, "w") as f:
                    json.dump({"baseline_ref": ref, "rows": rows}, f, indent=1)
    return rows


def _line(row: dict) -> str:
    b, c = row["baseline"], row["current"]
    return (
        f"| {row['case']} | {b['cpu_s']:.2f} s | {c['cpu_s']:.2f} s | {row['cpu_speedup']:.2f} | "
        f"{b['wall_s']:.2f} s | {c['wall_s']:.2f} s | {b['algbw'] / 1e9:.2f} / {c['algbw'] / 1e9:.2f} GB/s | "
        f"{b['gap_pct']:.3f} / {c['gap_pct']:.3f} % | {b['chunks']} / {c['chunks']} |"
    )


HEADER = (
    "| case | CPU baseline | CPU now | CPU x | wall baseline | wall now | algbw baseline / now | gap | K |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--cold-vs", metavar="REF", help="time cold calls against the tree of git revision REF")
    ap.add_argument("--cases", help=f"with --cold-vs: comma-separated cases (default: {','.join(CASES)})")
    ap.set_defaults(benchmark=True)  # the script is the benchmark
    args = ap.parse_args()
    if args.cold_vs:
        print(HEADER, flush=True)
        cases = tuple(args.cases.split(",")) if args.cases else CASES
        compare(args.cold_vs, args.runs or 3, cases, json_path=args.json)
        if args.json:
            print(f"wrote {args.json}")
        sys.exit(0)
    del args.cold_vs, args.cases
    sys.exit(main(args))
