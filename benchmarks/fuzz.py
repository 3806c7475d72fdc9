"""A long fuzzing campaign: the property-based suites of the tests, with many more examples.

Runs ``tests/test_fuzz_parsers.py`` (MSCCL XML, schedule JSON, topology JSON)
and ``tests/test_fuzz_collectives.py`` (collective arguments against jax.lax)
under the ``long`` Hypothesis profile (``JAXCCL_FUZZ=long``: randomized, not
derandomized, thousands of examples per property) and prints one row per
suite: examples asked for, outcome, wall time. CI runs the same properties
derandomized with a small budget.

Usage:
    nice -n 10 python benchmarks/fuzz.py [--seed N] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jaxccl import report  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")
SUITES = ("tests/test_fuzz_parsers.py", "tests/test_fuzz_collectives.py")
DEFAULT_JSON = os.path.join(os.path.dirname(__file__), "results", "fuzz.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random)")
    ap.add_argument("--json", default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    env = {**os.environ, "JAXCCL_FUZZ": "long"}
    rows = []
    for suite in SUITES:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", suite]
        if args.seed is not None:
            cmd.append(f"--hypothesis-seed={args.seed}")
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        summary = (proc.stdout.strip().splitlines() or [""])[-1]
        rows.append({"suite": suite, "result": summary, "exit": proc.returncode, "seconds": time.perf_counter() - t})
        if proc.returncode:
            print(proc.stdout[-4000:], file=sys.stderr)
    report.print_table(rows, floatfmt=".1f")
    report.write_json(args.json, {"benchmark": "fuzz", "profile": "long", "seed": args.seed, "suites": rows})
    print(f"wrote {args.json}")
    return int(any(r["exit"] for r in rows))


if __name__ == "__main__":
    raise SystemExit(main())
