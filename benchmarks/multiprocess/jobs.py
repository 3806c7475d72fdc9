"""Running a benchmark's worker processes and collecting process 0's rows (shared by the multiprocess benchmarks).

A benchmark script re-runs itself with ``--worker`` in every process (:func:`launch_rows`); process 0
prints its measured rows with :func:`publish_rows`, one line the launcher parses.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROWS_PREFIX = "ROWS "
_ROOT = str(Path(__file__).resolve().parents[2])  # the workers run as scripts and import benchmarks from here


def publish_rows(rows: Sequence[Mapping[str, Any]]) -> None:
    """Prints ``rows`` as the one line :func:`launch_rows` reads (process 0 of a worker job)."""
    print(ROWS_PREFIX + json.dumps(rows), flush=True)


def launch_rows(
    script: str,
    argv: Sequence[str] | None,
    processes: int,
    *,
    timeout_s: float,
    lab: Any = None,
    env: Mapping[str, str] | None = None,
) -> list[dict[str, Any]] | None:
    """Runs ``script --worker ARGV`` in ``processes`` processes (:func:`jaxccl.distributed.launch.launch`,
    on ``lab``'s namespaces if given); returns process 0's published rows, or ``None`` after printing every
    process's exit status and output tail when a process failed or published none.
    """
    from jaxccl.distributed.launch import launch

    argv_worker = [sys.executable, script, "--worker", *(argv if argv is not None else sys.argv[1:])]
    path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
    results = launch(argv_worker, processes, lab=lab, timeout_s=timeout_s, env={**(env or {}), "PYTHONPATH": path})
    return collected_rows(results, results[0].output.splitlines())


def collected_rows(results: Sequence[Any], lines: Sequence[str]) -> list[dict[str, Any]] | None:
    """Process 0's published rows among ``lines`` (its output), or ``None`` after printing every process's exit
    status and output tail (``lines``' too, where the caller read them itself) when a process failed or process
    0 published none."""
    rows = next((json.loads(line[len(ROWS_PREFIX) :]) for line in lines if line.startswith(ROWS_PREFIX)), None)
    if rows is None or any(r.returncode != 0 for r in results):
        if not results[0].output:  # the caller consumed process 0's output
            print("".join(lines[-40:]))
        for r in results:
            print(f"process {r.process_id} (rc {r.returncode}):\n{r.output[-3000:]}")
        return None
    return rows
