"""``jaxccl synth alltoall``: synthesize one AllToAll schedule, or benchmark the synthesizer.

By default it synthesizes one schedule (column generation + deep-dive
rounding, MCCL Sec. 4.2) for ``--topology`` (a preset such as ``rail:1x2x8``
or a topology JSON file) or for the rail ``1 x --hosts x --gpus-per-host``
(default ``1 x 2 x 8``), optionally under ``--scenario`` and warm-started from
``--previous SCHEDULE.json``, checks it with the reference interpreter and
writes it with ``--out``.

With ``--benchmark`` it runs the benchmark of ``benchmarks/synth/alltoall.py``
(minutes): rail-optimized ``1 x H x 8`` topologies (MCCL Sec. 6.1) for
``H = 2, 4, ..., 64`` (16-512 GPUs; or ``--hosts 2,4,8``) in the states base,
fail1, fail2 and fail3; per (size, state) the cold time, the warm time
(``previous=`` the base schedule), iterations, columns generated and reused,
LP bound, rounded algbw, gap and chunk count; medians over ``--runs`` runs
(7 up to 16 hosts, 3 above). Cold and warm runs alternate, and the speedups
are the medians of the cold/warm ratios of adjacent runs (the machines are
shared: their speed drifts).

Times are reported twice: *solve* (topology arrays, LP by column generation,
rounding -- the optimizer, what MCCL's warm-start figure compares) and
*total* (the whole ``alltoall()`` call, including planning the messages, the
``info`` tables and the compilation into the Schedule IR). The acceptance
lines judge the warm speedup on *solve* and print *total* next to it. The
per-phase times of each run are in the JSON. A warm start keeps the
previous chunk count when that costs at most ``reuse_tolerance`` (0.25 %,
``--reuse-tolerance``) of the LP bound, so the table shows both chunk counts
and both gaps.

``rail(...)`` allows at most 32 hosts per segment (MCCL Sec. 6.1), while the
paper's own rounding table (App. F) has a single-segment 1 x 64 x 8; the
64-host point is built by the preset itself with that limit lifted for the
call (same nodes, links and attributes).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from jaxccl.cli.args import UsageError, positive_float, positive_int
from jaxccl.cli.synth_args import (
    add_mode_arguments,
    add_topology_arguments,
    finish_benchmark,
    previous_schedule,
    register_command,
    run_benchmark_script,
    single_topology,
    wants_benchmark,
)
from jaxccl.synth.alltoall import alltoall
from jaxccl.topology import rail, scenario
from jaxccl.util import report

HOSTS = (2, 4, 8, 16, 32, 64)
STATES = ("base", "fail1", "fail2", "fail3")
COLUMNS = (
    "gpus",
    "state",
    "cold_solve_s",
    "cold_total_s",
    "warm_solve_s",
    "warm_total_s",
    "speedup_solve",
    "speedup_total",
    "iters",
    "warm_iters",
    "columns",
    "reused",
    "bound_GBps",
    "algbw_GBps",
    "gap_pct",
    "warm_gap_pct",
    "k",
    "warm_k",
    "warm_mode",
)
GAP_LIMIT_PCT = 2.13  # MCCL App. F: worst rounding error over its topologies
GAP_GOAL_PCT = 1.0


def rail_1xhx8(hosts: int, gpus_per_host: int = 8):
    """The single-segment rail ``1 x hosts x gpus_per_host``, also beyond the preset's 32 hosts."""
    return rail(hosts=hosts, gpus_per_host=gpus_per_host, max_hosts_per_segment=None)


def _solve_time(s) -> float:
    """The optimizer's time: the whole call less planning, ``info`` and compilation into the IR."""
    t = s.info["timings"]
    return float(t["total"] - t.get("plan", 0.0) - t.get("compile", 0.0) - t.get("info", 0.0))


def _timed_pairs(cold, warm, runs: int) -> tuple[Any, Any, dict[str, list[float]]]:
    """``runs`` cold runs and ``runs`` warm runs, alternating: ``(last cold, last warm, times)``.

    ``times`` holds ``cold_solve``, ``cold_total``, ``warm_solve``,
    ``warm_total`` and ``ratio_solve``/``ratio_total`` (cold over warm of
    each adjacent pair). Alternating keeps a drift of the machine's speed
    (these machines are shared) out of the comparison; each pair's ratio is
    taken under the same conditions. The previous run's schedule is freed
    and the garbage collected before each clock starts (freeing a schedule
    of a million ops takes a noticeable time, and the collector's debt of
    one run must not land in the next).
    """
    times: dict[str, list[float]] = {
        k: [] for k in ("cold_solve", "cold_total", "warm_solve", "warm_total", "ratio_solve", "ratio_total")
    }
    cold_out = warm_out = None
    for _ in range(runs):
        for label, fn in (("cold", cold), ("warm", warm)):
            if label == "cold":
                cold_out = None
            else:
                warm_out = None
            gc.collect()
            t = time.perf_counter()
            out = fn()
            times[f"{label}_total"].append(time.perf_counter() - t)
            times[f"{label}_solve"].append(_solve_time(out))
            if label == "cold":
                cold_out = out
            else:
                warm_out = out
            del out
        for kind in ("solve", "total"):
            w = times[f"warm_{kind}"][-1]
            times[f"ratio_{kind}"].append(times[f"cold_{kind}"][-1] / w if w > 0 else float("inf"))
    if cold_out is None or warm_out is None:
        raise UsageError("runs must be >= 1")
    return cold_out, warm_out, times


def run_benchmark(
    hosts: Sequence[int],
    states: Sequence[str],
    *,
    runs: int | None = None,
    max_chunks: int = 10,
    validate_max_gpus: int = 256,
    reuse_tolerance: float | None = None,
    stream=None,
) -> list[dict[str, Any]]:
    """Runs the benchmark; returns one row per (hosts, state)."""
    warm_kw = {} if reuse_tolerance is None else {"reuse_tolerance": reuse_tolerance}
    rows: list[dict[str, Any]] = []
    for h in report.progress(list(hosts), label="synth alltoall", stream=stream):
        n_runs = runs if runs is not None else (7 if h <= 16 else 3)
        base_topo = rail_1xhx8(h)
        base = alltoall(base_topo, max_chunks=max_chunks)  # the previous schedule of every warm start
        for state in states:
            topo = base_topo if state == "base" else scenario(base_topo, state)
            s, warm, times = _timed_pairs(
                lambda t=topo: alltoall(t, max_chunks=max_chunks),
                lambda t=topo, b=base: alltoall(t, previous=b, max_chunks=max_chunks, **warm_kw),
                n_runs,
            )
            if s.num_ranks <= validate_max_gpus:
                s.validate()
                warm.validate()
            med = {k: statistics.median(v) for k, v in times.items()}
            cs, ct, ws, wt = med["cold_solve"], med["cold_total"], med["warm_solve"], med["warm_total"]
            rows.append(
                {
                    "hosts": h,
                    "gpus": s.num_ranks,
                    "state": state,
                    "runs": n_runs,
                    "cold_solve_s": cs,
                    "cold_total_s": ct,
                    "warm_solve_s": ws,
                    "warm_total_s": wt,
                    "speedup_solve": med["ratio_solve"],
                    "speedup_total": med["ratio_total"],
                    "ratios_total": times["ratio_total"],
                    "iters": s.info["iterations"],
                    "warm_iters": warm.info["iterations"],
                    "columns": s.info["columns_generated"],
                    "warm_columns": warm.info["columns_generated"],
                    "reused": warm.info["reused_columns"],
                    "warm_kept_schedule": warm.info["reused_schedule"],
                    "warm_mode": warm.info["warm_mode"],
                    "threadblocks_reused": warm.info.get("threadblocks_reused", 0),
                    "threadblocks": warm.num_threadblocks,
                    "bound_GBps": s.bound / 1e9,
                    "warm_bound_GBps": warm.bound / 1e9,
                    "algbw_GBps": s.algbw / 1e9,
                    "warm_algbw_GBps": warm.algbw / 1e9,
                    "gap_pct": s.info["gap_pct"],
                    "warm_gap_pct": warm.info["gap_pct"],
                    "k": s.chunks_per_period,
                    "warm_k": warm.chunks_per_period,
                    "ops": s.num_ops,
                    "validated": s.num_ranks <= validate_max_gpus,
                    "cold_timings_s": s.info["timings"],
                    "warm_timings_s": warm.info["timings"],
                }
            )
    return rows


def acceptance(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's acceptance figures, as lines of text."""
    out = []
    for r in rows:
        if r["gpus"] == 512 and r["state"] == "base":
            ok = r["cold_total_s"] < 60
            out.append(
                f"512 GPUs cold: total {r['cold_total_s']:.2f} s, solve {r['cold_solve_s']:.2f} s "
                f"(target < 60 s): {'PASS' if ok else 'FAIL'}"
            )
    for r in rows:
        if r["state"] in ("fail1", "fail2") and r["gpus"] >= 128:
            # MCCL's "up to 17.8x" compares synthesis times (LP and rounding): the solve column.
            ok = (r["speedup_solve"] or 0) >= 10
            out.append(
                f"{r['gpus']} GPUs {r['state']}: warm solve {1e3 * r['warm_solve_s']:.1f} ms vs cold "
                f"{1e3 * r['cold_solve_s']:.1f} ms = {r['speedup_solve']:.1f}x (target >= 10x): "
                f"{'PASS' if ok else 'FAIL'}; whole call incl. the IR program {r['speedup_total']:.1f}x "
                f"({1e3 * r['warm_total_s']:.1f} vs {1e3 * r['cold_total_s']:.1f} ms)"
            )
    worst = max((max(r["gap_pct"], r["warm_gap_pct"]) for r in rows), default=0.0)
    out.append(
        f"worst rounding gap {worst:.3f} % (limit {GAP_LIMIT_PCT} %: {'PASS' if worst <= GAP_LIMIT_PCT else 'FAIL'}; "
        f"goal {GAP_GOAL_PCT} %: {'met' if worst <= GAP_GOAL_PCT else 'missed'})"
    )
    same = all(abs(r["bound_GBps"] - r["warm_bound_GBps"]) <= 1e-6 * r["bound_GBps"] for r in rows)
    out.append("warm starts reach the cold LP optimum" if same else "warm and cold LP optima DIFFER")
    return out


BENCHMARK_OPTIONS = ("min_hosts", "max_hosts", "states", "runs", "validate_max_gpus")


def main(args: argparse.Namespace) -> int:
    """Runs ``jaxccl synth alltoall`` with parsed ``args``: one synthesis, or the benchmark."""
    if wants_benchmark(args, "jaxccl synth alltoall", BENCHMARK_OPTIONS):
        return _benchmark(args)
    return _single(args)


def _benchmark(args: argparse.Namespace) -> int:
    if args.topology is not None or args.scenario or args.previous or args.out:
        raise UsageError("--benchmark runs its own rail topologies: drop --topology, --scenario, --previous, --out")
    if args.gpus_per_host != 8:
        raise UsageError("--benchmark runs rail 1 x H x 8 topologies: drop --gpus-per-host")
    lo = 2 if args.min_hosts is None else args.min_hosts
    hi = HOSTS[-1] if args.max_hosts is None else args.max_hosts
    hosts = list(args.hosts) if args.hosts else [h for h in HOSTS if lo <= h <= hi]
    states = [s for s in (args.states or ",".join(STATES)).split(",") if s]
    for s in states:
        if s not in STATES:
            raise UsageError(f"--states: unknown value {s!r}; choose from {', '.join(STATES)}")
    print(f"benchmarking the AllToAll synthesizer on rail 1 x H x 8, H = {hosts}, states {states}")
    rows = run_benchmark(
        hosts,
        states,
        runs=args.runs,
        max_chunks=args.max_chunks,
        validate_max_gpus=256 if args.validate_max_gpus is None else args.validate_max_gpus,
        reuse_tolerance=args.reuse_tolerance,
    )
    return finish_benchmark(args, rows, COLUMNS, acceptance(rows))


def _single(args: argparse.Namespace) -> int:
    topo = single_topology(args)
    previous = previous_schedule(args)
    print(f"synthesizing all_to_all for {topo.name or 'the topology'} ({topo.num_gpus} GPUs)")
    s = alltoall(
        topo,
        previous=previous,
        max_chunks=args.max_chunks,
        time_budget=args.time_budget,
        minimize_steps=args.minimize_steps,
        **({} if args.reuse_tolerance is None else {"reuse_tolerance": args.reuse_tolerance}),
    )
    if not args.no_validate:
        s.validate()
    i = s.info
    print(
        f"{s!r}\n  LP bound {s.bound / 1e9:.4f} GB/s, rounded {s.algbw / 1e9:.4f} GB/s (gap {i['gap_pct']:.3f} %), "
        f"K = {i['chunks']}, {i['iterations']} iterations, {i['columns_generated']} columns generated, "
        f"{i['reused_columns']} reused, solve {_solve_time(s):.3f} s, total {i['solve_time_s']:.3f} s"
        + ("" if args.no_validate else "; checked by the reference interpreter")
    )
    if args.out:
        with open(args.out, "w") as f:
            f.write(s.to_json())
        print(f"wrote {args.out}")
    if args.json:
        summary = {k: v for k, v in i.items() if k not in ("paths", "link_chunks")}
        report.write_json(args.json, {"topology": topo.name, "algbw": s.algbw, "bound": s.bound, "info": summary})
        print(f"wrote {args.json}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jaxccl synth alltoall`` (also used by ``benchmarks/synth/alltoall.py``)."""
    add_topology_arguments(p)
    p.add_argument("--max-chunks", type=positive_int, default=10, help="most chunks per commodity (default 10)")
    p.add_argument(
        "--reuse-tolerance",
        type=float,
        default=None,
        help="warm starts keep the previous chunk count within this fraction of the LP bound (default 0.0025)",
    )
    p.add_argument("--time-budget", type=positive_float, default=None, help="seconds for the LP phase")
    p.add_argument("--minimize-steps", action="store_true", help="MCCL App. D: smallest step bound at the optimum")
    p.add_argument("--no-validate", action="store_true", help="skip the reference interpreter")
    add_mode_arguments(p)
    g = p.add_argument_group("benchmark options (with --benchmark)")
    g.add_argument("--min-hosts", type=positive_int, help="smallest H of the benchmark (default 2)")
    g.add_argument("--max-hosts", type=positive_int, help="largest H of the rail topologies (default 64)")
    g.add_argument("--states", help="comma-separated states (default all: " + ",".join(STATES) + ")")
    g.add_argument("--runs", type=positive_int, help="runs per point (default: 7 up to 16 hosts, 3 above)")
    g.add_argument(
        "--validate-max-gpus", type=positive_int, help="check schedules up to this size with the interpreter (256)"
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``alltoall`` to ``jaxccl synth``."""
    register_command(
        subparsers,
        "alltoall",
        "synthesize an AllToAll schedule by column generation (or benchmark the synthesizer)",
        __doc__,
        add_arguments,
        main,
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_benchmark_script(__doc__, add_arguments, main))
