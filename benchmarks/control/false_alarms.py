"""False alarms of the closed loop on a healthy fabric: swaps over many steps of the demo's job, with jitter or not.

The demo's AllGather job (:mod:`benchmarks.control.emulated_job`: 8 emulated devices, rail 2 x 4,
healthy links) runs ``--steps`` steps with the controller's thread beside it (every 10 ms, as in
``jaxccl demo``), once per detector and jitter setting:

- ``none``: the emulator's own noise (2 shared cores run 8 ranks);
- ``stalls``: besides, at every step one random rank arrives 1-5 ms late (uniform);
- ``noise``: every measured window scattered by log-normal noise of ``--window-noise`` (default
  0.17, the spread of the pair rates process 0 reads across processes in ``jaxccl demo --network
  netns``; :class:`~jaxccl.runtime.emulated.LinkEmulation`'s ``window_noise``): the emulator's
  windows are exact, so this is the setting that tests the decision's statistics.

Every swap on a healthy fabric is a false one; the table gives swaps, decisions (``confirmed``
events), detections, and for the change-point test its decided shifts per test (its measured
false-alarm rate, beside the parameter), separately for the pairs across hosts and the intra-node
injection entries, and the step time.

Usage:
    nice -n 10 python -m benchmarks.control.false_alarms [--steps 10000] [--time-scale 1e-4] [--json results.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks.control.emulated_job import EmulatedJob
from benchmarks.control.reaction import parse_detectors
from jaxccl.control import Controller
from jaxccl.control.detector import ChangeDetector
from jaxccl.demos.closed_loop import NUM_DEVICES
from jaxccl.util import report

JITTER = ("none", "stalls", "noise")
WINDOW_NOISE = 0.17  # the pair rates' spread across processes (tests/data/windows/netns_nics_cut.json)


def run_one(job: EmulatedJob, detector: str, jitter: str, steps: int, false_alarm_rate: float, seed: int) -> dict:
    """``steps`` healthy steps with a fresh controller; returns the counts of the table's row."""
    rng = np.random.default_rng(seed)
    job.comm.install("all_gather", job.healthy)
    job.step()  # activates it
    job.comm.telemetry()
    ctl = Controller(job.comm, detector=detector, false_alarm_rate=false_alarm_rate, interval_s=0.01)
    times = []
    t0 = time.perf_counter()
    with ctl:
        for _ in range(steps):
            stall = (int(rng.integers(NUM_DEVICES)), float(rng.uniform(1e-3, 5e-3))) if jitter == "stalls" else None
            times.append(job.step(stall=stall))
    kinds = [e.kind for e in ctl.events]
    det = ctl.change_detector
    return {
        "detector": detector,
        "jitter": jitter,
        "steps": steps,
        "swaps": kinds.count("activated"),
        "staged": kinds.count("staged"),
        "decisions": kinds.count("confirmed"),
        "detections": kinds.count("detected"),
        "errors": kinds.count("error"),
        "step_ms_median": report.median(times) * 1e3,
        "wall_s": time.perf_counter() - t0,
        **_rates(det),
        "false_alarm_rate": false_alarm_rate if det is not None else None,
    }


def _rates(det: ChangeDetector | None) -> dict:
    """Decided shifts and tests of the change-point test, across hosts, intra-node and per link (joint); {} for the
    EWMA."""
    if det is None:
        return {}
    out = {}
    for name, keep in (("inter", lambda e: e[0] != e[1]), ("intra", lambda e: e[0] == e[1])):
        tests = 2 * sum(n for e, n in det.tested.items() if keep(e))
        shifts = sum(n for e, n in det.shifts.items() if keep(e))
        out |= {f"{name}_tests": tests, f"{name}_shifts": shifts, f"{name}_rate": shifts / tests if tests else None}
    tests = 2 * det.group_tests  # the joint tests of the pairs that share a link (their members count above too)
    joint = det.group_shifts
    out |= {"joint_tests": tests, "joint_shifts": joint, "joint_rate": joint / tests if tests else None}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--time-scale", type=float, default=1e-4, help="the demo's (1e-4): ~60 ms per step")
    ap.add_argument("--detectors", type=parse_detectors, default=("cusum",), help="comma-separated: cusum, ewma")
    ap.add_argument("--jitter", default="none,stalls,noise", help=f"comma-separated: {', '.join(JITTER)}")
    ap.add_argument("--window-noise", type=float, default=WINDOW_NOISE, help="the noise setting's log-normal spread")
    ap.add_argument("--false-alarm-rate", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    detectors = args.detectors
    jitters = [j for j in args.jitter.split(",") if j]
    bad = [j for j in jitters if j not in JITTER]
    if bad:
        ap.error(f"--jitter: unknown {bad}; known: {', '.join(JITTER)}")
    jobs: dict[float, EmulatedJob] = {}
    rows = []
    for jitter in jitters:
        noise = args.window_noise if jitter == "noise" else 0.0
        if noise not in jobs:
            jobs[noise] = EmulatedJob.start(time_scale=args.time_scale, window_noise=noise)
        for detector in detectors:
            print(f"{args.steps} healthy steps, detector {detector}, jitter {jitter} ...", flush=True)
            rows.append(run_one(jobs[noise], detector, jitter, args.steps, args.false_alarm_rate, args.seed))
    report.print_table(rows)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        report.write_json(args.json, {"config": config, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
