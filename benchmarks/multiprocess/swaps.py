"""Stress: agreed hot-swaps across processes while a NIC is cut and restored live; counts hung jobs.

Each job is one :func:`~jaxccl.labs.drill.run_drill` in a fresh rail lab (2 hosts
x 2 ranks, one process per rank): several cut/recover/measure/restore cycles, so the job swaps
schedules many times (the loop's swap, the interleaved stale/recovered rounds, the restore) on
links whose rate changes under it. A job that ends with a ``DeadlineError`` is a hang: the
executor's deadline (``--deadline-s``, kept short so a hang costs little) turned it into an error.
Each process's whole output is kept under ``--logs`` (with ``JAXCCL_TRANSPORT_TRACE=1`` every launch
across processes prints its slot, launch number, table and tags, and a deadline's error carries
what the proxy posted and completed), and the first line naming a missed message is reported.

Needs root (network namespaces) and the ``multiprocess`` extra. Run:

    nice -n 10 python -m benchmarks.multiprocess.swaps --jobs 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from jaxccl.labs.drill import DrillConfig, run_drill

MISSED = re.compile(r"deadline exceeded: .*")


def one_job(config: DrillConfig, logs: Path, timeout_s: float) -> dict:
    """Runs one drill; returns its outcome: ``ok``, ``hang`` (a deadline) or ``failed``, and the missed message."""
    t0 = time.perf_counter()
    try:
        report = run_drill(config, timeout_s=timeout_s, log_dir=logs)
        outcome = "ok" if report["bitwise_ok"] else "mismatch"
        detail = ""
    except RuntimeError as e:
        text = str(e)
        outcome = "hang" if "deadline exceeded" in text or "DeadlineError" in text else "failed"
        found = MISSED.search(text)
        detail = found.group(0)[:2000] if found else text[-2000:]
    return {"outcome": outcome, "seconds": round(time.perf_counter() - t0, 1), "detail": detail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8, help="drills to run (each in a fresh lab)")
    parser.add_argument("--cycles", type=int, default=3, help="cut/restore cycles per job")
    parser.add_argument("--deadline-s", type=float, default=20.0, help="the executor's deadline (JAXCCL_TIMEOUT_S)")
    parser.add_argument("--stop-on-hang", action="store_true", help="stop at the first hung job")
    parser.add_argument("--trace", action="store_true", help="JAXCCL_TRANSPORT_TRACE=1: every launch prints its tags")
    parser.add_argument("--logs", type=Path, default=None, help="every process's output (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    args = parser.parse_args(argv)

    os.environ["JAXCCL_TIMEOUT_S"] = f"{args.deadline_s:g}"
    if args.trace:
        os.environ["JAXCCL_TRANSPORT_TRACE"] = "1"
    logs = args.logs or Path(tempfile.mkdtemp(prefix="jaxccl-swaps-"))
    config = DrillConfig(cycles=args.cycles, reps=2, timeout_s=max(60.0, 3 * args.deadline_s))
    jobs = []
    for j in range(args.jobs):
        job = one_job(config, logs / f"job-{j}", timeout_s=120.0 + 150.0 * args.cycles)
        jobs.append(job)
        print(f"job {j}: {job['outcome']} in {job['seconds']} s {job['detail'][:300]}", flush=True)
        if args.stop_on_hang and job["outcome"] == "hang":
            break
    counts = {k: sum(j["outcome"] == k for j in jobs) for k in ("ok", "hang", "failed", "mismatch")}
    print(f"{len(jobs)} jobs: {counts}; logs in {logs}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"config": {"cycles": args.cycles, "deadline_s": args.deadline_s}, "counts": counts, "jobs": jobs}
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if counts["ok"] == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
