"""A flapping link: swaps and algbw of the closed loop while GPU 0's NIC alternates 1.0x / 0.4x every 3 steps.

The demo's AllGather job (:mod:`benchmarks.control.emulated_job`) runs ``--healthy`` healthy steps,
then ``--steps`` steps during which GPU 0's NIC runs at 0.4x of nominal for 3 steps, then 1.0x for
3 steps, and so on. Variants, interleaved in every repetition:

- ``stale``: no controller (the healthy schedule throughout), the baseline;
- one row per ``--detectors`` entry: the controller's thread beside the job (every 10 ms, as in
  ``jaxccl demo``).

Per variant: the mean algbw over the flapping steps (emulated GB/s; medians over repetitions),
its ratio to the stale schedule's in the same repetition, swaps, and the most swaps in any 10
consecutive steps. Goal (issue "react within one step"): at most one swap per 10 steps and a mean
algbw no lower than the stale schedule's.

Usage:
    nice -n 10 python -m benchmarks.control.flapping [--reps 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.control.emulated_job import EmulatedJob
from benchmarks.control.reaction import parse_detectors
from jaxccl.control import Controller
from jaxccl.demos.closed_loop import FAILED_LINK, degraded_topology
from jaxccl.util import report

WINDOW = 10  # steps: the "at most one swap per 10 steps" window


def most_swaps_in_window(versions: list[int], window: int = WINDOW) -> int:
    """The most version changes among any ``window`` consecutive steps.

    >>> most_swaps_in_window([1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 4], window=10)
    2
    """
    swaps = [k for k in range(1, len(versions)) if versions[k] != versions[k - 1]]
    return max((sum(1 for s in swaps if start <= s < start + window) for start in range(len(versions))), default=0)


def run_variant(job: EmulatedJob, detector: str | None, healthy: int, steps: int, period: int, depth: float) -> dict:
    """One run of the flapping sequence with ``detector``'s controller (None: no controller)."""
    job.comm.inject(job.topology)
    job.comm.install("all_gather", job.healthy)
    job.step()
    job.comm.telemetry()
    degraded = degraded_topology(job.topology, [FAILED_LINK], depth)
    ctl = Controller(job.comm, detector=detector, interval_s=0.01) if detector else None
    if ctl is not None:
        ctl.start()
    try:
        for _ in range(healthy):
            job.step()
        rates, versions = [], []
        for k in range(steps):
            if k % period == 0:
                job.comm.inject(degraded if (k // period) % 2 == 0 else job.topology)
            rates.append(job.algbw(job.step()))
            versions.append(job.version())
    finally:
        if ctl is not None:
            ctl.stop()
        job.comm.inject(job.topology)
    return {
        "variant": detector or "stale",
        "mean_algbw": sum(rates) / len(rates),
        "swaps": sum(1 for a, b in zip(versions, versions[1:]) if a != b),
        "most_swaps_in_10_steps": most_swaps_in_window(versions),
        "decisions": sum(1 for e in ctl.events if e.kind == "confirmed") if ctl else 0,
        "held": sum(1 for e in ctl.events if e.kind == "held") if ctl else 0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--healthy", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--period", type=int, default=3, help="steps per state (1.0x, then the degraded)")
    ap.add_argument("--depth", type=float, default=0.4, help="the NIC's capacity in its bad state (x nominal)")
    ap.add_argument("--detectors", type=parse_detectors, default=("cusum", "ewma"))
    ap.add_argument("--time-scale", type=float, default=1e-4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    job = EmulatedJob.start(time_scale=args.time_scale)
    variants = [None, *args.detectors]
    runs = []
    for rep in report.progress(range(args.reps), label="repetitions"):
        batch = [run_variant(job, v, args.healthy, args.steps, args.period, args.depth) for v in variants]
        stale = batch[0]["mean_algbw"]
        runs += [{**r, "rep": rep, "vs_stale": r["mean_algbw"] / stale} for r in batch]
    rows = []
    for v in variants:
        mine = [r for r in runs if r["variant"] == (v or "stale")]
        rows.append(
            {
                "variant": v or "stale",
                "mean_algbw_GBps": report.median([r["mean_algbw"] for r in mine]) / 1e9,
                "vs_stale": report.median([r["vs_stale"] for r in mine]),
                "swaps": report.median([r["swaps"] for r in mine]),
                "max_swaps_per_10_steps": max(r["most_swaps_in_10_steps"] for r in mine),
                "held": report.median([r["held"] for r in mine]),
            }
        )
    report.print_table(rows)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        report.write_json(args.json, {"config": config, "rows": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
