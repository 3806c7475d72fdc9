"""NCCL-BOT's replay (Sec. 5, Table 1) on jaxccl: AUTO vs UCB1 vs ETC, eps-greedy, Softmax, KL-UCB.

Forced-arm latency pools per context come from jaxccl's simulator (see
:mod:`jaxccl.tune.replay`): AllGather / ReduceScatter / AllReduce on rail
topologies of 4, 8, 16 and 32 hosts (2 GPUs per host by default), 26 message
sizes from 512 B to 16 GiB, healthy and MCCL's fail1-3, 100 samples per arm
(simulated time x lognormal noise, sigma 0.05, fixed seed; first 8 samples
x 1.13). The cost model is calibrated on the healthy 4/8-host contexts only;
every policy family is tuned on the 4/8-host (train) contexts by a seeded
random search on mean selection-priced TRLT; the champions are scored once
on the 16/32-host (test) contexts. Two views of the model are reported:
``actual`` (the model is given the degraded topology; its constants stay the
healthy calibration) and ``nominal`` (the model only knows the healthy
topology, as a cost model frozen at communicator creation).

The pools, the split and the model's predictions are saved under
``benchmarks/results/tuning/`` so the tables re-run without simulating.

``--pools measured [PATH]`` replays measured pools (``jaxccl bench --tune``) instead:
:mod:`benchmarks.tune.replay_measured`.

Usage:
    nice -n 10 python -m benchmarks.tune.replay [--quick] [--views actual nominal]
        [--pools PATH | --pools measured [PATH]] [--resimulate] [--recalibrate] [--trials N] [--seeds N]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

from jaxccl.tune.measured import read_measurement
from jaxccl.tune.replay import (
    FAMILIES,
    PAPER,
    PoolConfig,
    build_catalogs,
    calibrate_model,
    evaluate,
    filter_keeps_best,
    load_pools,
    margins,
    predict_pools,
    random_search,
    simulate_pools,
    summarize,
    tune_size_gate,
)
from jaxccl.util.report import print_table, write_json

OUT = os.path.join("benchmarks", "results", "tuning")
MEASURED_POOLS = os.path.join(OUT, "measured_pools_rail2x4.npz")  # jaxccl bench --tune's recorded pools
QUICK_CONFIG = PoolConfig(hosts=(4, 8, 16), sizes=tuple(1 << k for k in range(9, 35, 3)))
ROWS = [  # (row label, family, paper key)
    ("AUTO", "auto", "auto"),
    ("UCB1 (clipped-SGD, featured)", "ucb1", "ucb1"),
    ("UCB1 (constant gain)", "ucb1_cg", None),
    ("ETC", "etc", "etc"),
    ("eps-greedy", "eps_greedy", None),
    ("Softmax", "softmax", "softmax"),
    ("KL-UCB", "kl_ucb", "kl_ucb"),
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def get_pools(args: argparse.Namespace):
    path = args.pools or os.path.join(OUT, "pools.npz")
    if args.quick and not args.pools and not os.path.exists(path):
        path = os.path.join(OUT, "pools_quick.npz")
    pools = None
    if os.path.exists(path) and not args.resimulate:
        pools = load_pools(path)
        log(f"loaded {pools.num_contexts} contexts from {path} (simulated in {pools.sim_wall_s:.0f} s)")
    if pools is None:
        cfg = QUICK_CONFIG if args.quick and path.endswith("pools_quick.npz") else PoolConfig()
        log(f"simulating pools: {cfg.to_dict()}")
        pools = simulate_pools(cfg, log=log)
        pools.save(path)
    if args.recalibrate or not pools.predictions:
        t = time.perf_counter()
        cats = build_catalogs(pools)
        model, report = calibrate_model(pools, catalogs=cats)
        log(f"calibrated on {report['calibrated_on']}: {report['params']} (rms log err {report['rms_log_error']:.3f})")
        pools.model = report
        pools.predictions = predict_pools(pools, model, catalogs=cats)
        pools.save(path)
        log(f"model + predictions in {time.perf_counter() - t:.0f} s; saved {path}")
    split_path = os.path.join(os.path.dirname(path), "split.json" if "quick" not in path else "split_quick.json")
    write_json(split_path, pools.split_dict())
    return pools, path


def run_view(pools, view: str, args: argparse.Namespace) -> dict[str, Any]:
    train, test = pools.indices("train"), pools.indices("test")
    out: dict[str, Any] = {"champions": {}, "tuning": {}, "test": {}, "train": {}}
    for _, family, _ in ROWS:
        t = time.perf_counter()
        if family == "auto":
            cfg: dict[str, Any] = {"policy": "auto"}
            hist: list = []
        else:
            default, space = FAMILIES[family]
            cfg, hist = random_search(
                pools, space, default, train, trials=args.trials, seed=42, view=view, seeds=args.tune_seeds
            )
        out["champions"][family] = cfg
        out["tuning"][family] = hist
        tr = evaluate(pools, cfg, train, view=view, seeds=args.seeds)
        te = evaluate(pools, cfg, test, view=view, seeds=args.seeds)
        out["train"][family] = {"realized": summarize(tr.realized), "selection": summarize(tr.selection)}
        out["test"][family] = {
            "realized": summarize(te.realized),
            "selection": summarize(te.selection),
            "auto_arm_share": float(te.auto_share.mean()),
            "per_context_realized": te.realized.tolist(),
            "per_context_selection": te.selection.tolist(),
        }
        log(
            f"[{view}] {family}: {len(hist)} trials, train sel {tr.selection.mean():.3f} %, "
            f"test real {te.realized.mean():.3f} % ({time.perf_counter() - t:.0f} s)"
        )
    gate, gate_hist = tune_size_gate(pools, out["champions"]["ucb1"], train, view=view, seeds=args.seeds)
    te = evaluate(pools, out["champions"]["ucb1"], test, view=view, size_gate_bytes=gate)
    out["size_gate"] = {
        "bytes": gate,
        "history": gate_hist,
        "test": {"realized": summarize(te.realized), "selection": summarize(te.selection)},
    }
    keeps = filter_keeps_best(pools, test, view=view)
    m = margins(pools, test, view=view)
    auto = np.asarray(out["test"]["auto"]["per_context_realized"])
    out["diagnostics"] = {
        "filter_keeps_best_test": float(keeps.mean()),
        "filter_drops_best_contexts": int((~keeps).sum()),
        "auto_exact_test": float((np.asarray(out["test"]["auto"]["per_context_selection"]) <= 1e-9).mean()),
        "auto_over_10_low_margin": int(((auto > 10) & (m < 0.5)).sum()),
        "auto_over_10_high_margin": int(((auto > 10) & (m >= 0.5)).sum()),
        "ucb1_auto_arm_share": out["test"]["ucb1"]["auto_arm_share"],
    }
    a, u = out["test"]["auto"]["realized"], out["test"]["ucb1"]["realized"]
    out["goal"] = {
        "p99_cut": a["p99"] / u["p99"] if u["p99"] > 0 else float("inf"),
        "over_10_cut": a["over_10"] / u["over_10"] if u["over_10"] else float("inf"),
        "mean_no_worse": u["mean"] <= a["mean"],
    }
    out["goal"]["met"] = bool(
        out["goal"]["p99_cut"] >= 5 and out["goal"]["over_10_cut"] >= 5 and out["goal"]["mean_no_worse"]
    )
    return out


def table(pools, view: str, res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, family, paper_key in ROWS:
        r, s = res["test"][family]["realized"], res["test"][family]["selection"]
        p = PAPER.get(paper_key or "", {})
        rows.append(
            {
                "policy": label,
                "mean %": f"{r['mean']:.2f}±{r['sem']:.2f}",
                "p99 %": round(r["p99"], 1),
                ">10%": r["over_10"],
                "sel mean %": round(s["mean"], 2),
                "sel p99 %": round(s["p99"], 1),
                "sel >10%": s["over_10"],
                "paper mean": p.get("mean", "-"),
                "paper p99": p.get("p99", "-"),
                "paper >10%": p.get("over_10", "-"),
            }
        )
    g = res["size_gate"]
    rows.append(
        {
            "policy": f"UCB1 + size gate ({g['bytes']} B)",
            "mean %": f"{g['test']['realized']['mean']:.2f}±{g['test']['realized']['sem']:.2f}",
            "p99 %": round(g["test"]["realized"]["p99"], 1),
            ">10%": g["test"]["realized"]["over_10"],
            "sel mean %": round(g["test"]["selection"]["mean"], 2),
            "sel p99 %": round(g["test"]["selection"]["p99"], 1),
            "sel >10%": g["test"]["selection"]["over_10"],
            "paper mean": 1.15,
            "paper p99": 9.5,
            "paper >10%": "-",
        }
    )
    return rows


def _pools_argument(ap: argparse.ArgumentParser, values: list[str] | None) -> tuple[bool, str | None]:
    """``--pools``: ``(measured?, path)``; ``measured [PATH]``, or a file whose metadata says it was measured."""
    if not values:
        return False, None
    if values[0] == "measured":
        if len(values) > 2:
            ap.error("--pools measured takes at most one PATH")
        return True, values[1] if len(values) == 2 else MEASURED_POOLS
    if len(values) != 1:
        ap.error("--pools takes one PATH, or 'measured [PATH]'")
    path = values[0]
    return bool(os.path.exists(path) and read_measurement(path) is not None), path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small tuning budget (and a small pool if none is saved)")
    ap.add_argument(
        "--pools",
        nargs="+",
        metavar="[measured] PATH",
        help="pools file (default benchmarks/results/tuning/pools.npz); 'measured [PATH]' (or a file written by "
        "jaxccl bench --tune) replays measured pools (benchmarks/tune/replay_measured.py; default "
        "benchmarks/results/tuning/measured_pools_rail2x4.npz)",
    )
    ap.add_argument("--resimulate", action="store_true", help="simulate the pools even if the file exists")
    ap.add_argument("--recalibrate", action="store_true", help="re-fit the cost model and its predictions")
    ap.add_argument("--views", nargs="+", default=["actual", "nominal"], choices=["actual", "nominal"])
    ap.add_argument("--trials", type=int, help="random-search trials per family (default 40; quick 6)")
    ap.add_argument("--seeds", type=int, help="seeds per context for random policies when scoring (default 10)")
    ap.add_argument("--tune-seeds", type=int, help="seeds per context while tuning (default 3)")
    ap.add_argument("--json", help="output JSON (default benchmarks/results/tuning/replay[_quick].json)")
    args = ap.parse_args(argv)
    args.trials = args.trials if args.trials is not None else (6 if args.quick else 40)
    args.seeds = args.seeds if args.seeds is not None else (3 if args.quick else 10)
    args.tune_seeds = args.tune_seeds if args.tune_seeds is not None else (1 if args.quick else 3)
    measured, args.pools = _pools_argument(ap, args.pools)
    if measured:
        # imported here: replay_measured imports this module (run_view, log)
        from benchmarks.tune import replay_measured

        out = replay_measured.run(args.pools, args)
        dest = args.json or os.path.join(OUT, "measured_replay_rail2x4.json")
        write_json(dest, out)
        log(f"wrote {dest} ({out['wall_s']:.0f} s)")
        return 0
    t0 = time.perf_counter()
    pools, path = get_pools(args)
    train, test = pools.indices("train"), pools.indices("test")
    log(f"{len(train)} train / {len(test)} test contexts; arms {pools.arms}")
    results: dict[str, Any] = {}
    for view in args.views:
        results[view] = run_view(pools, view, args)
        print(
            f"\nHeld-out contexts ({len(test)}: 16/32 hosts x healthy/fail1-3), model view '{view}'. "
            "Realized TRLT (mean±SEM, p99, contexts > 10 %) and selection-priced TRLT; NCCL-BOT Table 1 beside."
        )
        print_table(table(pools, view, results[view]))
        g, d = results[view]["goal"], results[view]["diagnostics"]
        print(
            f"goal (UCB1 vs AUTO): p99 cut {g['p99_cut']:.1f}x, >10% cut {g['over_10_cut']:.1f}x, "
            f"mean no worse: {g['mean_no_worse']} -> {'met' if g['met'] else 'NOT met'}; "
            f"filter keeps the measured-best arm on {100 * d['filter_keeps_best_test']:.1f} % of test contexts; "
            f"AUTO exact on {100 * d['auto_exact_test']:.1f} %; UCB1 plays AUTO's arm on "
            f"{100 * d['ucb1_auto_arm_share']:.1f} % of steps"
        )
    out = {
        "benchmark": "tuning_replay",
        "pools": path,
        "config": pools.config.to_dict(),
        "arms": pools.arms,
        "cost_model": pools.model,
        "num_train": len(train),
        "num_test": len(test),
        "args": {k: v for k, v in vars(args).items()},
        "paper": PAPER,
        "views": results,
        "wall_s": time.perf_counter() - t0,
    }
    dest = args.json or os.path.join(OUT, "replay_quick.json" if args.quick else "replay.json")
    write_json(dest, out)
    log(f"wrote {dest} ({out['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
