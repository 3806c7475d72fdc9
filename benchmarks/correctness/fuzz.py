"""A long fuzzing campaign: the property-based suites of the tests, with many more examples.

Runs ``tests/schedule/test_fuzz_parsers.py`` (MSCCL XML, schedule JSON, topology JSON),
``tests/runtime/test_fuzz_collectives.py`` (collective arguments against jax.lax) and
``tests/schedule/test_fuzz_tables.py`` (mutated compiled tables) under the ``long``
Hypothesis profile (``JAXCCL_FUZZ=long``: randomized, not derandomized,
thousands of examples per property) and prints one row per suite: outcome,
wall time. CI runs the same properties derandomized with a small budget.

Then a counted table campaign (``--tables``, 20,000 by default): random
mutations of compiled tables (the mutations of ``tests/schedule/test_fuzz_tables.py``),
each checked by the native registry as it comes (*sealed* by the compiler: the
checksum refuses every real change) and once more after :func:`seal` recomputed
its checksum (*resealed*: only the structural checks stand between it and the
executor). Accepted tables are checked by :func:`jaxccl.schedule.table.verify`
(is it what the compiler writes for a valid schedule?), run (every compiler
output, and up to ``--runs`` other resealed tables) and compared bitwise with
``jax.lax``; the counts are the
table's rows. A compiler output that runs wrong is an executor bug: the
campaign fails.

Usage:
    nice -n 10 python -m benchmarks.correctness.fuzz [--seed N] [--tables 20000] [--runs 150] [--json PATH]
    nice -n 10 python -m benchmarks.correctness.fuzz --tables-only
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from jaxccl.util import report  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SUITES = (
    "tests/schedule/test_fuzz_parsers.py",
    "tests/runtime/test_fuzz_collectives.py",
    "tests/schedule/test_fuzz_tables.py",
)
DEFAULT_JSON = os.path.join(ROOT, "benchmarks", "results", "fuzz.json")


def table_campaign(count: int, seed: int, max_runs: int) -> list[dict]:
    """Counts of ``count`` random table mutations, sealed as mutated and resealed (see the module doc)."""
    import jaxccl

    jaxccl.emulate(8)
    import jax
    import numpy as np
    from jax.sharding import Mesh

    sys.path.insert(0, os.path.join(ROOT, "tests", "schedule"))
    import test_fuzz_tables as tf

    from jaxccl.errors import ExecutorError, ScheduleError
    from jaxccl.runtime import native
    from jaxccl.schedule.table import seal, verify

    rng = np.random.default_rng(seed)
    runner = tf.Runner(tf.base_schedules(), Mesh(np.array(jax.devices()[: tf.N]), ("d",)))
    old_timeout = native.get_timeout()
    native.set_timeout(5.0)  # a resealed table may deadlock: its launch ends at the deadline
    keys = ("mutations", "no-op", "refused", "accepted changed", "compiler output")
    keys += ("ran bitwise", "ran wrong", "compiler output ran wrong", "run error", "not run")
    rows = {mode: dict.fromkeys(keys, 0) for mode in ("sealed", "resealed")}
    errors: dict[str, int] = {}
    try:
        for i in report.progress(range(count), label="tables"):
            k = int(rng.integers(len(runner.tables)))
            table = runner.tables[k]
            edits = []
            for _ in range(int(rng.integers(1, 4))):
                how = tf.MUTATIONS[int(rng.integers(len(tf.MUTATIONS)))]
                value = int(rng.integers(-2, 41)) if how == "small" else int(rng.integers(-(2**31), 2**31))
                edits.append((int(rng.integers(table.size)), how, value))
            mutated = tf.mutate(table, edits)
            for mode, candidate in (("sealed", mutated), ("resealed", seal(mutated))):
                row = rows[mode]
                row["mutations"] += 1
                unchanged = np.array_equal(candidate, table)
                row["no-op"] += unchanged
                try:
                    native.validate_table(candidate)
                except ExecutorError:
                    row["refused"] += 1
                    continue
                row["accepted changed"] += not unchanged
                try:
                    verify(candidate)
                    compiler_output = True
                except ScheduleError:
                    compiler_output = False
                row["compiler output"] += compiler_output
                ran = row["ran bitwise"] + row["ran wrong"] + row["run error"] - row["compiler output"]
                if mode == "resealed" and not compiler_output and ran >= max_runs:
                    row["not run"] += 1
                    continue
                try:
                    bitwise = runner.run(k, candidate, seed=i)
                    row["ran bitwise" if bitwise else "ran wrong"] += 1
                    row["compiler output ran wrong"] += compiler_output and not bitwise
                except Exception as e:  # noqa: BLE001 - tallied by kind: what a bad table does at run time
                    row["run error"] += 1
                    kind = type(e).__name__ + (": deadline" if "deadline" in str(e).lower() else "")
                    errors[kind] = errors.get(kind, 0) + 1
                finally:
                    native.install(runner.slots[k], table)
    finally:
        native.set_timeout(old_timeout)
        runner.close()
    out = [{"tables": mode, **row} for mode, row in rows.items()]
    out.append({"tables": "run errors", **{"kinds": ", ".join(f"{k} x{v}" for k, v in sorted(errors.items()))}})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random)")
    ap.add_argument("--tables", type=int, default=20_000, help="mutations of the counted table campaign")
    ap.add_argument("--runs", type=int, default=150, help="accepted resealed tables run at most")
    ap.add_argument("--tables-only", action="store_true", help="only the counted table campaign")
    ap.add_argument("--json", default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    env = {**os.environ, "JAXCCL_FUZZ": "long"}
    rows = []
    for suite in () if args.tables_only else SUITES:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", suite]
        if args.seed is not None:
            cmd.append(f"--hypothesis-seed={args.seed}")
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        summary = (proc.stdout.strip().splitlines() or [""])[-1]
        rows.append({"suite": suite, "result": summary, "exit": proc.returncode, "seconds": time.perf_counter() - t})
        if proc.returncode:
            print(proc.stdout[-4000:], file=sys.stderr)
    if rows:
        report.print_table(rows, floatfmt=".1f")
    t = time.perf_counter()
    tables = table_campaign(args.tables, 0 if args.seed is None else args.seed, args.runs) if args.tables else []
    seconds = time.perf_counter() - t
    if tables:
        report.print_table([r for r in tables if "kinds" not in r])
        print("resealed run errors:", tables[-1]["kinds"] or "none")
    result = {"benchmark": "fuzz", "profile": "long", "seed": args.seed, "suites": rows}
    result["tables"] = {"rows": tables, "seconds": seconds}
    report.write_json(args.json, result)
    print(f"wrote {args.json}")
    sealed = next((r for r in tables if r["tables"] == "sealed"), {})
    bad = sealed.get("accepted changed", 0) or sealed.get("ran wrong", 0)
    bad = bad or any(r.get("compiler output ran wrong", 0) for r in tables)
    return int(any(r["exit"] for r in rows) or bad)


if __name__ == "__main__":
    raise SystemExit(main())
