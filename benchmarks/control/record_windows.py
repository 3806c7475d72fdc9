"""Records the raw measurement windows of the demo's AllGather job: the change detector's test traces.

Runs :class:`~benchmarks.control.emulated_job.EmulatedJob` (8 emulated devices, rail 2 x 4, the
healthy AllGather) for ``--steps`` steps, injects ``--fault`` (``nic``, ``nvlink``, ``two`` as in
``jaxccl demo --fail-link``, at ``--depth`` of nominal) at ``--fail-step``, and writes every raw
window the controller would read (:attr:`jaxccl.telemetry.Telemetry.windows`, one row per record:
step, src, dst, emulated bytes/s) as JSON. ``tests/data/windows/`` holds the traces this wrote.

Usage:
    nice -n 10 python -m benchmarks.control.record_windows --steps 24 --fault nvlink --fail-step 14 \\
        --depth 0.4 --json tests/data/windows/demo_nvlink_degraded.json
    nice -n 10 python -m benchmarks.control.record_windows --steps 100 --time-scale 1e-2 --timestamps observed \\
        --json tests/data/windows/demo_healthy_short_windows.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxccl.demos.closed_loop import FAIL_LINKS, degraded_topology, failed_links, failure_label


def record(
    steps: int, time_scale: float, fault: str | None, fail_step: int, depth: float, timestamps: str = "link"
) -> dict[str, Any]:
    """The trace: ``what`` it is, its ``columns`` and ``rows``."""
    from benchmarks.control.emulated_job import EmulatedJob

    job = EmulatedJob.start(time_scale=time_scale, timestamps=timestamps)
    rows = []
    for step in range(steps):
        if fault and step == fail_step:
            job.comm.inject(degraded_topology(job.topology, failed_links(fault, job.topology), depth))
        job.step()
        for src, dst, rate, _ in job.comm.telemetry().windows.tolist():
            rows.append([step, int(src), int(dst), float(rate)])
    what = f"raw measurement windows of the demo's AllGather, rail 2x4 emulated at time_scale {time_scale:g}, "
    what += f"{timestamps} timestamps; "
    what += f"{failure_label(fault, depth, job.topology)} from step {fail_step}" if fault else "healthy"
    return {"what": what, "columns": ["step", "src", "dst", "rate_bytes_per_s"], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--time-scale", type=float, default=1e-4)
    ap.add_argument("--fault", choices=FAIL_LINKS, default=None, help="the failed link(s); none: healthy")
    ap.add_argument("--fail-step", type=int, default=14)
    ap.add_argument("--depth", type=float, default=0.5, help="the failed links keep this fraction of nominal")
    ap.add_argument(
        "--timestamps",
        choices=("link", "observed"),
        default="link",
        help="when a transfer counts as done: link (the emulated link's time) or observed (the receiving thread's)",
    )
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    if args.steps < 1 or not 0 < args.depth < 1 or not 0 <= args.fail_step < args.steps:
        ap.error("need --steps >= 1, 0 < --depth < 1 and 0 <= --fail-step < --steps")
    trace = record(args.steps, args.time_scale, args.fault, args.fail_step, args.depth, args.timestamps)
    with open(args.json, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
        f.write("\n")
    print(f"{len(trace['rows'])} windows of {args.steps} steps: {trace['what']} -> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
