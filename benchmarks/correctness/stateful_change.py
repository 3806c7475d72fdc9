"""Long profile of the model-based change test: the state machine of tests/support/stateful_machine.py for an hour.

The machine of ``tests/runtime/test_stateful_change.py`` (installs, reinstalls ``A -> B -> A``,
tables staged at an agreed call, hot-swaps from another thread under running
collectives, size and dtype changes, link faults, closing and reopening
communicators) runs here in its batched form: every call of a collective is one
jitted program that runs ``K`` collectives (64 at small sizes, 16 at 64 KiB per
rank) on fresh pseudo-random data and compares each bitwise with ``jax.lax``
inside the program. Hypothesis draws the steps (randomized, one seed per chunk
of examples derived from ``--seed``); nothing is shrunk: mismatches and errors
are counted (errors by type, the failed communicator replaced by a new one) and
the run goes on until ``--minutes`` have passed.

A watchdog stops the run when one call does not return within ``--hang-seconds``
(the executor's own deadline, ``--executor-timeout``, is shorter, so a stuck
collective normally surfaces as a ``DeadlineError`` first): it prints which
call hung, writes the JSON with ``hangs: 1`` and exits with status 3.

At the end it prints a table and writes ``--json`` (collectives, swaps,
mismatches, errors by type, hangs, wall and CPU seconds, per-collective, dtype
and size counts, samples of mismatches and errors). Exit status 1 when anything
mismatched or failed.

Usage:
    nice -n 10 python -m benchmarks.correctness.stateful_change [--minutes 60] [--seed 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))  # the state machine lives with the tests

DEFAULT_JSON = os.path.join(ROOT, "benchmarks", "results", "stateful_change.json")


def _report(harness: Any, args: argparse.Namespace, wall: float, cpu: float, *, hang: str | None) -> dict[str, Any]:
    """The JSON document of a run."""
    stats = harness.stats.as_dict()
    return {
        "benchmark": "stateful_change",
        "seed": args.seed,
        "minutes": args.minutes,
        "collectives": stats["collectives"],
        "swaps": stats["swaps"],
        "mismatches": stats["mismatches"],
        "errors": stats["errors"],
        "hangs": 1 if hang else 0,
        "hang": hang,
        "wall_s": wall,
        "cpu_s": cpu,
        "collectives_per_s": stats["collectives"] / wall if wall > 0 else 0.0,
        "swaps_per_s": stats["swaps"] / wall if wall > 0 else 0.0,
        "batch": list(harness.batch),
        "time_scale": harness.time_scale,
        "reopen_interval_s": harness.reopen_interval_s,
        "stats": stats,
    }


def _summary_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    s = doc["stats"]
    return [
        {
            "collectives": doc["collectives"],
            "calls": s["calls"],
            "swaps": doc["swaps"],
            "thread swaps": s["thread_swaps"],
            "staged at seq": s["staged_at_seq"],
            "faults": s["faults"],
            "reopens": s["reopens"],
            "mismatches": doc["mismatches"],
            "errors": sum(doc["errors"].values()),
            "hangs": doc["hangs"],
            "wall s": doc["wall_s"],
            "cpu s": doc["cpu_s"],
            "coll/s": doc["collectives_per_s"],
        }
    ]


def main(argv: list[str] | None = None) -> int:
    """Runs the long profile; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="how long to run")
    ap.add_argument("--seed", type=int, default=0, help="seeds Hypothesis (per chunk) and the data")
    ap.add_argument("--json", default=DEFAULT_JSON)
    ap.add_argument("--examples-per-chunk", type=int, default=5, help="Hypothesis examples per seed")
    ap.add_argument("--steps", type=int, default=50, help="steps per example")
    ap.add_argument("--reopen-interval", type=float, default=600.0, help="seconds between communicator reopens")
    ap.add_argument("--time-scale", type=float, default=1e-2, help="link emulation time scale of the rail comm")
    ap.add_argument("--hang-seconds", type=float, default=300.0, help="a call running longer is a hang")
    ap.add_argument("--executor-timeout", type=float, default=30.0, help="native executor deadline (seconds)")
    ap.add_argument("--progress-seconds", type=float, default=30.0)
    args = ap.parse_args(argv)

    import jaxccl

    jaxccl.emulate(8)
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test
    from stateful_machine import ChangeMachine, Harness, schedule_pool

    from jaxccl.runtime import native
    from jaxccl.util import report

    native.set_timeout(args.executor_timeout)
    t0, c0 = time.perf_counter(), time.process_time()
    print("building the schedule pool ...", flush=True)
    pool = schedule_pool()
    print(f"  {sum(len(p) for p in pool.values())} schedules in {time.perf_counter() - t0:.1f} s", flush=True)
    harness = Harness(
        mode="batched", strict=False, seed=args.seed, time_scale=args.time_scale, reopen_interval_s=args.reopen_interval
    )

    class LongChange(ChangeMachine):
        harness_factory = staticmethod(lambda: harness)
        owns_harness = False
        raise_at_teardown = False  # counted, not raised: nothing to shrink in a long run

    done = threading.Event()

    def finish(hang: str | None) -> dict[str, Any]:
        doc = _report(harness, args, time.perf_counter() - t0, time.process_time() - c0, hang=hang)
        report.write_json(args.json, doc)
        return doc

    def watchdog() -> None:
        while not done.wait(min(1.0, args.hang_seconds / 4)):
            busy = harness.busy
            if busy is not None and time.monotonic() - busy[0] > args.hang_seconds:
                msg = f"HANG: '{busy[1]}' did not return within {args.hang_seconds:g} s; stopping the run"
                print(f"\n{msg}", file=sys.stderr, flush=True)
                doc = finish(msg)
                report.print_table(_summary_rows(doc), floatfmt=".1f")
                print(f"wrote {args.json}", flush=True)
                os._exit(3)  # the hung call cannot be interrupted

    def progress() -> None:
        while not done.wait(args.progress_seconds):
            s = harness.stats
            el = time.perf_counter() - t0
            print(
                f"[{el / 60:6.1f} min] collectives {s.collectives:>9,}  swaps {s.swaps:>7,}  "
                f"mismatches {s.mismatching_collectives}  errors {sum(s.errors.values())}  "
                f"reopens {s.reopens}  {s.collectives / max(el, 1e-9):,.0f} coll/s",
                flush=True,
            )

    threading.Thread(target=watchdog, name="watchdog", daemon=True).start()
    threading.Thread(target=progress, name="progress", daemon=True).start()
    stop_at = time.perf_counter() + 60.0 * args.minutes
    timer = threading.Timer(max(0.0, stop_at - time.perf_counter()), harness.stop.set)
    timer.daemon = True
    timer.start()
    profile = settings(
        max_examples=args.examples_per_chunk,
        stateful_step_count=args.steps,
        deadline=None,
        database=None,
        derandomize=False,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    chunk = 0
    while not harness.stop.is_set():

        def factory() -> ChangeMachine:
            return LongChange()

        factory._hypothesis_internal_use_seed = args.seed * 1_000_003 + chunk  # type: ignore[attr-defined]
        try:
            run_state_machine_as_test(factory, settings=profile)
        except Exception as e:  # noqa: BLE001 - the harness records what it can; count the rest and go on
            harness.stats.errors[f"hypothesis:{type(e).__name__}"] += 1
            samples = harness.stats.error_samples.setdefault(f"hypothesis:{type(e).__name__}", [])
            if len(samples) < 5:
                samples.append(str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
        chunk += 1
    done.set()
    timer.cancel()
    doc = finish(None)
    doc["chunks"] = chunk
    report.write_json(args.json, doc)
    harness.close()

    print()
    report.print_table(_summary_rows(doc), floatfmt=".1f")
    print()
    s = doc["stats"]
    report.print_table(
        [{"collective": k, "collectives": v} for k, v in sorted(s["per_collective"].items())]
        + [{"collective": f"dtype {k}", "collectives": v} for k, v in sorted(s["per_dtype"].items())]
        + [{"collective": f"{k} elements/rank", "collectives": v} for k, v in s["per_size"].items()]
    )
    if doc["errors"]:
        print()
        report.print_table([{"error": k, "count": v} for k, v in sorted(doc["errors"].items())])
    for m in s["mismatch_samples"][:10]:
        print(f"MISMATCH: {m['what']}")
    for kind, samples in s["error_samples"].items():
        print(f"ERROR {kind}: {samples[0]}")
    print(f"wrote {args.json}")
    return 1 if doc["mismatches"] or doc["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
