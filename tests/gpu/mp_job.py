"""Runs one multi-process job of tests/gpu/mp_worker.py on this machine and writes how each process ended as JSON.

The processes start through :func:`jaxccl.distributed.launch.launch` (loopback coordinator, one
deadline for the whole job, stragglers killed) with this process's environment. The JSON file holds
``{"processes": [{"process_id", "returncode", "output"}], "wall_s"}`` (``returncode`` null: killed at
the deadline); tests/gpu/run_all.py reads it.

Usage:
    CUDA_VISIBLE_DEVICES=0 python tests/gpu/mp_job.py --processes 2 --timeout 150 --json out.json \\
        -- --platform cuda --parts cases,lax
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "mp_worker.py"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, required=True)
    ap.add_argument("--timeout", type=float, required=True, help="seconds for the whole job")
    ap.add_argument("--json", required=True, metavar="PATH")
    ap.add_argument("worker_args", nargs=argparse.REMAINDER, help="after --: mp_worker.py's arguments")
    args = ap.parse_args(argv)
    worker_args = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args

    from jaxccl.distributed.launch import launch

    t0 = time.monotonic()
    results = launch(
        [sys.executable, "-u", str(WORKER), *worker_args],
        args.processes,
        timeout_s=args.timeout,
    )
    summary = {
        "processes": [{"process_id": r.process_id, "returncode": r.returncode, "output": r.output} for r in results],
        "wall_s": time.monotonic() - t0,
    }
    Path(args.json).write_text(json.dumps(summary))
    return 0 if all(r.returncode == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
