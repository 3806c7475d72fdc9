"""Reaction of the closed loop across processes on real sockets (MCCL Fig. 10b): seeded NIC cuts in the netns demo.

Each run is one ``jaxccl demo --network netns`` job (:func:`jaxccl.demos.network.run`, called
in this process; it starts the 8 JAX processes in a fresh rail lab of 2 hosts x 4 ranks, one
``tc``-shaped NIC per rank, and removes the lab afterwards). Every run draws, from ``--seed``:

- the fault step, in ``[6, 10]`` (``--steps`` leaves at least 8 steps after the latest one),
- the cut NICs: one rank's, or two ranks' on different hosts (never rank 0's: it carries the
  job's coordinator),
- the depth, uniform in ``[0.3, 0.7]``: the cut NICs keep that fraction of their rate
  (``cut_rate_mbit = depth * nic_rate_mbit``).

With ``--detectors cusum,ewma`` every draw runs once per detector, interleaved (run k: cusum, then
ewma with the same draw), so both meet the same machine load. Phases, from the demo's JSON
(process 0's events; the launcher's cut time shares ``time.monotonic_ns`` with them):

- detect: NIC cut -> the controller's first flag,
- confirm: first flag -> decision (cusum: the change-point test decided; ewma: confirmed, EWMA settled),
- synth: the warm-started tree packing on the measured topology,
- dispatch: reference-interpreter validation + table compilation,
- agree: every process stages the decision at one agreed call (MCCL's OOB synchronization),
- swap: staging the table in the registry; activation wait: staged -> the first launch on it,
- staged after change: the first degraded measurement the controller saw -> staged,
- total: NIC cut -> the first launch on the new schedule.

Steps: ``steps_to_active`` is the step the new schedule first ran minus the fault step
(1: active at the next step after the first degraded one; the issue's goal across processes is
within 2), counted as in the single-process benchmark over the draws whose cut warrants a swap
(:func:`warranted`: the demo's whole-shard synthesizer beats the stale schedule on the cut
fabric by more than ``min_gain``); the swaps of the other draws are counted apart. MCCL's
testbed numbers are printed beside ours: detection 53.1 ms, synthesizer 13.1 ms, hot-swap
11.6 ms (OOB synchronization 5.74 ms), total 78.2 ms.

``--groups 4`` gives every rank's process 4 devices, each a ``data`` group of the 8 ranks (32
ranks; every NIC carries a rank of each group, so a cut one degrades all four); the loop's one
schedule serves every group. Each run then also reports the whole step's A/B (the AllGather and
the training step, whose gloo reductions cross the cut NIC too): ``step_recovery_ratio``.

Usage (as root, with namespaces; a run takes 1-2 minutes on a small machine, 2-3 with --groups 4):
    nice -n 10 python -m benchmarks.multiprocess.reaction [--runs 5] [--seed 0] [--detectors cusum,ewma]
        [--groups 1] [--json results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from typing import Any

from benchmarks.control.reaction import outcome, parse_detectors, phase_table, swap_warranted
from jaxccl.demos import network
from jaxccl.demos.closed_loop import degraded_topology
from jaxccl.demos.network import NetworkDemoConfig
from jaxccl.demos.network_layout import (
    HOSTS,
    NUM_RANKS,
    RANKS_PER_HOST,
    demo_allgather,
    demo_topology,
    failed_links,
)
from jaxccl.errors import JaxcclError
from jaxccl.util import report

MCCL = {"detect_ms": 53.1, "synth_ms": 13.1, "agree_ms": 5.74, "swap_ms": 11.6, "total_ms": 78.2}
PHASES = (
    "detect_ms",
    "confirm_ms",
    "synth_ms",
    "dispatch_ms",
    "agree_ms",
    "swap_ms",
    "activation_wait_ms",
    "staged_after_change_ms",
    "total_ms",
)
# The fault step's range, both ends included: at least 6 healthy steps, one more than the change-point
# detector's warm-up (Controller(warmup=5)), which learns each link's noise from one sample per step here.
FAIL_STEPS = (6, 10)
STEPS_AFTER_FAULT = 8  # steps after the latest fault step: room to react and to see the new schedule run
DEPTHS = (0.3, 0.7)


@dataclasses.dataclass(frozen=True)
class Draw:
    """One run's fault: its step, the ranks whose NICs are cut and the fraction of the rate they keep."""

    fail_step: int
    cut_ranks: tuple[int, ...]
    depth: float


def draw(rng: random.Random) -> Draw:
    """One seeded fault: a step in ``FAIL_STEPS``, one NIC or two on different hosts (never rank 0's), a depth.

    >>> draws = [draw(random.Random(seed)) for seed in range(20)]
    >>> all(6 <= d.fail_step <= 10 and 0 not in d.cut_ranks and 0.3 <= d.depth <= 0.7 for d in draws)
    True
    >>> all(len({r // RANKS_PER_HOST for r in d.cut_ranks}) == len(d.cut_ranks) for d in draws)  # different hosts
    True
    >>> sorted({len(d.cut_ranks) for d in draws})
    [1, 2]
    """
    fail_step = rng.randint(*FAIL_STEPS)
    if rng.random() < 0.5:
        cut_ranks: tuple[int, ...] = (rng.randrange(1, NUM_RANKS),)
    else:  # one NIC on each host
        hosts = [range(h * RANKS_PER_HOST, (h + 1) * RANKS_PER_HOST) for h in range(HOSTS)]
        cut_ranks = tuple(rng.choice([r for r in ranks if r != 0]) for ranks in hosts)
    return Draw(fail_step, cut_ranks, round(rng.uniform(*DEPTHS), 3))


def demo_config(
    d: Draw, detector: str, steps: int, nic_rate_mbit: float, job_timeout_s: float, groups: int = 1
) -> NetworkDemoConfig:
    """The netns demo's settings for one draw and detector (quiet, no files); ``groups`` devices per rank.

    >>> cfg = demo_config(Draw(5, (1, 6), 0.5), "ewma", 16, 200.0, 600.0)
    >>> cfg.network, cfg.cut_ranks, cfg.cut_rate_mbit, cfg.detector
    ('netns', (1, 6), 100.0, 'ewma')
    """
    return NetworkDemoConfig(
        network="netns",
        steps=steps,
        fail_step=d.fail_step,
        cut_ranks=d.cut_ranks,
        cut_rate_mbit=round(d.depth * nic_rate_mbit, 3),
        nic_rate_mbit=nic_rate_mbit,
        detector=detector,
        job_timeout_s=job_timeout_s,
        quiet=True,
        groups=groups,
    )


def extra_phases(result: dict[str, Any]) -> dict[str, float]:
    """The phases the demo's reaction fields leave out: the agreement across processes and the total.

    >>> events = [{"kind": "agreed", "time_ns": 9, "detail": {"agree_ms": 3.0}},
    ...           {"kind": "activated", "time_ns": 12, "detail": {"activated_ns": 11_000_010}}]
    >>> extra_phases({"cut_ns": 10, "events": events})
    {'agree_ms': nan, 'total_ms': 11.0}
    """
    after = [e for e in result["events"] if e["time_ns"] > result["cut_ns"]]

    def first(kind: str) -> dict[str, Any] | None:
        return next((e for e in after if e["kind"] == kind), None)

    agreed, activated = first("agreed"), first("activated")
    return {
        "agree_ms": float(agreed["detail"]["agree_ms"]) if agreed else float("nan"),
        "total_ms": (activated["detail"]["activated_ns"] - result["cut_ns"]) / 1e6 if activated else float("nan"),
    }


def warranted(d: Draw, nic_rate_mbit: float, min_gain: float = 0.05) -> bool:
    """Whether the draw's cut warrants a swap: the demo's synthesizer (at most ``MAX_CHUNKS`` chunks per shard)
    beats the healthy schedule on the cut fabric by more than ``min_gain``. In halves of a shard the best
    schedule runs at 2/3 of the healthy rate whatever the depth, so a cut that keeps more than about 0.63 of
    its rate warrants none.

    >>> warranted(Draw(6, (2,), 0.35), 200.0), warranted(Draw(6, (2,), 0.65), 200.0)
    (True, False)
    """
    topo = demo_topology(nic_rate_mbit)
    degraded = degraded_topology(topo, failed_links(d.cut_ranks), d.depth)
    return swap_warranted(topo, degraded, demo_allgather, min_gain)


def summary_of(detector: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`~benchmarks.control.reaction.outcome` over the finished runs whose cut warrants a swap, with the
    runs' steps to the active schedule and the swaps of the runs whose cut warrants none."""
    done = [r for r in records if r["detector"] == detector and r["result"] is not None]
    needed = [r["result"] for r in done if r["warranted"]]
    return {
        "detector": detector,
        "runs": len(done),
        "warranted": len(needed),
        **(outcome(needed) if needed else {}),
        "steps_to_active": [r["result"]["steps_to_active"] for r in done],
        "swaps_unwarranted": sum(r["result"]["swaps"] for r in done if not r["warranted"]),
    }


def one_run(cfg: NetworkDemoConfig) -> dict[str, Any]:
    """Runs the demo once; returns its result with the extra phases."""
    result = network.run(cfg)
    result.update(extra_phases(result))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="draws; each runs once per detector, each in a fresh lab")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--detectors", type=parse_detectors, default=("cusum",), help="comma-separated: cusum,ewma")
    ap.add_argument("--steps", type=int, default=FAIL_STEPS[1] + STEPS_AFTER_FAULT)
    ap.add_argument("--nic-rate-mbit", type=float, default=NetworkDemoConfig.nic_rate_mbit)
    ap.add_argument("--job-timeout", type=float, default=600.0, help="seconds per job")
    ap.add_argument(
        "--groups", type=int, default=1, help="devices per rank, each a data group (4: 32 ranks in 8 processes)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.runs < 1 or args.steps < FAIL_STEPS[1] + 3:
        ap.error(f"need --runs >= 1 and --steps >= {FAIL_STEPS[1] + 3} (room to react after the latest fault step)")
    reason = network.unavailable_reason("netns")
    if reason is not None:
        print(f"benchmarks.multiprocess.reaction cannot run here: {reason}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    draws = [draw(rng) for _ in range(args.runs)]
    records: list[dict[str, Any]] = []
    jobs = [(k, d, det) for k, d in enumerate(draws) for det in args.detectors]
    for k, d, det in report.progress(jobs, label="netns demo jobs"):
        record: dict[str, Any] = {"run": k, "detector": det, "draw": dataclasses.asdict(d), "result": None}
        try:
            cfg = demo_config(d, det, args.steps, args.nic_rate_mbit, args.job_timeout, args.groups)
            record["result"] = one_run(cfg)
        except JaxcclError as e:  # a job that failed is reported, not hidden; the others still count
            record["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
        records.append(record)
    for r in records:
        r["warranted"] = warranted(Draw(**r["draw"]), args.nic_rate_mbit)
    summaries, phases = [], {}
    for det in args.detectors:
        runs = [r["result"] for r in records if r["detector"] == det and r["result"] is not None]
        print(f"\ndetector {det}: {len(runs)} of {args.runs} jobs finished")
        phases[det] = phase_table([r for r in runs if r["swap_step"] is not None], PHASES, MCCL)
        report.print_table(phases[det])
        summaries.append(summary_of(det, records))
    print("\nover the runs whose cut warrants a swap (steps_to_active_le_2: the goal across processes):")
    report.print_table([{k: v for k, v in s.items() if k != "steps_to_active"} for s in summaries])
    for r in records:
        result = r["result"]
        outcome_text = r.get("error") or (
            f"steps_to_active {result['steps_to_active']}, AllGather ratio {result['recovery_ratio']:.2f}, "
            f"whole step ratio {result['step_recovery_ratio'] or float('nan'):.2f}"
        )
        print(f"  run {r['run']} {r['detector']}: {r['draw']} warranted {r['warranted']} -> {outcome_text}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        report.write_json(args.json, {"settings": settings, "phases": phases, "summary": summaries, "runs": records})
    finished = [r["result"] for r in records if r["result"] is not None]
    swapped = any(r["swap_step"] is not None for r in finished)
    return 0 if swapped and all(r["loss_matches_reference"] for r in finished) else 1


if __name__ == "__main__":
    sys.exit(main())
