"""NCCL-BOT live across processes: tuners learn from the executor's launch times on the netns lab, a NIC cut mid-run.

The job: 8 processes of one rank each on the lab's rail (2 hosts x 4 NICs, ``--rate-mbit`` each), one
mesh axis, and two contexts: AllGather at ``--sizes`` (message bytes, nccl-tests' convention). Every
policy drives its own communicators (one per context, so each context has its own registry slot), and
the policies run interleaved, step by step, on the same network:

- ``ucb1``: a :class:`~jaxccl.tune.process_tuner.ProcessTuner` with the default policy (NCCL-BOT's UCB1
  champion), warm-started from the cost model on the lab's topology;
- ``auto``: the same with the cost model's choice, never learning;
- ``loop``: the closed loop alone (MCCL): the synthesized tree, re-synthesized by a
  :class:`~jaxccl.control.process_loop.ProcessLoop` when it measures the cut; both tuners follow that loop
  (its schedule becomes their tree arm, and their contexts restart from the prior on the measured fabric);
- ``static``: what a communicator runs untuned (the direct AllGather).

First every arm runs twice on every communicator (connections and buffers set up before anything is
timed). After ``--steps`` healthy steps every arm (and the loop's re-synthesized schedule, if any), each
on a communicator of its own, runs ``--rounds`` round-robin rounds per context, timed as the steps are:
the best arm in hindsight, measured in the same run. Then the launcher cuts ``--cut-rank``'s NIC to
``--cut-rate-mbit``, and the same follows on the cut network.

A step makes every policy's agreements first, then every policy's calls, each after a tiny AllGather
that lines the processes up (a launch's time runs from this process's start, so it would also count how
late the others finished the call before). A step's time per policy and context is the slowest
process's launch time (what the tuners learn from); regret is a policy's total over a phase over the
best arm's median times the steps, minus 1. Every result is compared bitwise with ``jax.lax``'s.

Usage (root, for the namespaces):
    nice -n 10 python -m benchmarks.tune.live_multiprocess [--steps 24] [--rounds 5] [--json results.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.multiprocess.jobs import collected_rows, publish_rows
from jaxccl.util import report

POLICIES = ("ucb1", "auto", "loop", "static")
STATIC_ARM = "direct"  # the communicator's default AllGather (jaxccl.runtime.default_schedules.direct_allgather)
CUT_REQUEST, CUT_DONE = "JAXCCL-TUNE-CUT", "cut-done"
WAIT_S = 300.0


def worker(args: argparse.Namespace) -> int:
    """One process of the job; process 0 publishes the rows."""
    from jaxccl.distributed.launch import initialize_from_env
    from jaxccl.distributed.transport import NETWORK_ONLY, ProcessTransport, attach, local_shards

    me, nproc = initialize_from_env(local_devices=1)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl
    from jaxccl.cli.bench_run import AXIS, implementation_runner
    from jaxccl.control.process_loop import ProcessLoop
    from jaxccl.labs.drill import _wait_signal  # the harness's file signal, shared with the drill
    from jaxccl.labs.netlab import LinkShape
    from jaxccl.labs.rail import (
        rank_rail,
        transport_options_from_env,  # every rank's bytes through its own NIC
    )
    from jaxccl.tune import Selector, arm_catalog
    from jaxccl.tune.process_tuner import ProcessTuner

    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    n = mesh.size
    transport = ProcessTransport.bootstrap(options=transport_options_from_env() or dict(NETWORK_ONLY))
    attach(transport, mesh, AXIS)
    topo = rank_rail(2, n // 2, LinkShape(rate_mbit=args.rate_mbit))
    folder = Path(args.folder)
    contexts = [("all_gather", size) for size in args.sizes]
    catalog = arm_catalog("all_gather", topo)
    static = Selector([STATIC_ARM], catalog=lambda ctx: [a for a in catalog if a.name == STATIC_ARM])

    # one communicator per policy and context (its own registry slot), and per arm and context one for the
    # round-robin, each holding its arm ("arm:resynth": the loop's latest re-synthesis, until then the tree)
    arm_keys = [("arm:" + name, c) for name in (*(a.name for a in catalog), "resynth") for c in contexts]
    keys = [(p, c) for p in POLICIES for c in contexts] + arm_keys
    comms = {key: jaxccl.Communicator(mesh, AXIS, topology=topo, backend="cpu") for key in keys}
    tuners = {}
    for p, c in keys:
        options = {"policy": "auto" if p == "auto" else None} if p in ("ucb1", "auto") else {"selector": static}
        tuners[p, c] = ProcessTuner(comms[p, c], key_prefix=f"tune-bench/{p}/{c[1]}", timeout_s=WAIT_S, **options)
    fns = {key: implementation_runner(mesh, "all_gather", comm) for key, comm in comms.items()}
    lax_fn = implementation_runner(mesh, "all_gather", None)
    sharding = NamedSharding(mesh, P(AXIS))
    inputs, expected = {}, {}
    for c in contexts:
        data = np.random.default_rng(c[1]).standard_normal(c[1] // 4).astype(np.float32)  # n shards of size/n
        inputs[c] = jax.make_array_from_callback(data.shape, sharding, lambda idx, data=data: data[idx])
        expected[c] = b"".join(s.tobytes() for s in local_shards(lax_fn(inputs[c])))
    wrong = {"calls": 0, "wrong": 0}

    barrier_comm = jaxccl.Communicator(mesh, AXIS, backend="cpu")
    barrier_fn = implementation_runner(mesh, "all_gather", barrier_comm)
    barrier_input = jax.make_array_from_callback((n,), sharding, lambda idx: np.ones(n, np.float32)[idx])

    def sync() -> None:
        barrier_fn(barrier_input).block_until_ready()

    def run(key) -> None:
        out = fns[key](inputs[key[1]])
        out.block_until_ready()
        wrong["calls"] += 1
        wrong["wrong"] += b"".join(s.tobytes() for s in local_shards(out)) != expected[key[1]]

    for key, tuner in tuners.items():  # every arm once on every communicator: no arm pays the first call's setup
        for arm in catalog:
            tuner.install("all_gather", arm.parts[0])
            run(key)
            run(key)
    # The closed loop (MCCL) on the largest context's "loop" communicator, which starts on the synthesized tree;
    # the tuners follow it (a re-synthesis becomes their tree arm, their contexts restart from the new prior), and
    # the loop's other communicators take its schedule at the next step.
    healthy_tree = next(a for a in catalog if a.name == "tree").parts[0]
    for c in contexts:
        tuners["loop", c].install("all_gather", healthy_tree)
    for p, c in arm_keys:
        arm = next((a for a in catalog if "arm:" + a.name == p), None)
        tuners[p, c].install("all_gather", (arm.parts[0] if arm is not None else healthy_tree))
    # the smaller context's sends finish in the sockets' buffers, far faster than a NIC: the loop leaves out
    # windows above 4x their path's capacity, which would otherwise hide the cut in the pairs' means
    loop = ProcessLoop(
        comms["loop", contexts[-1]], margin=0, timeout_s=WAIT_S, key_prefix="tune-bench/loop", max_over_capacity=4.0
    )
    for p in ("ucb1", "auto"):
        for c in contexts:
            tuners[p, c].follow(loop)
    resynthesized: list = []
    loop.add_resynthesis_hook(lambda coll, schedule, topology: resynthesized.append(schedule))

    def follow_resynthesis(followers) -> None:
        """Stages the loop's latest re-synthesis on ``followers`` (agreed) where they run another schedule."""
        for key in followers:
            if resynthesized and comms[key].schedule("all_gather").digest != resynthesized[-1].digest:
                tuners[key].install("all_gather", resynthesized[-1])

    rows: list[dict] = []
    for phase in ("healthy", "cut"):
        if phase == "cut":
            if me == 0:
                print(CUT_REQUEST, flush=True)
            _wait_signal(folder, CUT_DONE, WAIT_S)
        for step in range(args.steps):
            follow_resynthesis([("loop", c) for c in contexts[:-1]])  # the loop's other communicators
            # Every agreement first, then the timed calls, interleaved (every policy meets the same network at each
            # step), each after a tiny AllGather that lines the processes up: a launch's time counts from this
            # process's start, so without it a call would also time how late the others finished the one before.
            order = [(p, c) for p in POLICIES for c in contexts]
            arms = {key: tuners[key].prepare(*key[1]) for key in order if key[0] != "loop"}
            for key in order:
                sync()
                run(key)
            for p, c in order:
                tuner = tuners[p, c]
                if p == "loop":
                    arm, s = "loop", tuner.slowest_launch("all_gather", "loop")
                else:
                    tuner.record(*c, arms[p, c])
                    _, arm, s = tuner.history[-1]
                rows.append(dict(phase=phase, step=step, policy=p, context=c[1], arm=arm, s=s))
            loop.step()
        # the best arm in hindsight: every arm's communicator in turn, timed as the policies' steps are
        follow_resynthesis([key for key in arm_keys if key[0] == "arm:resynth"])
        timed = [key for key in arm_keys if key[0] != "arm:resynth" or resynthesized]
        for r in range(args.rounds):
            for key in timed:
                sync()
                run(key)
            for p, c in timed:
                s = tuners[p, c].slowest_launch("all_gather", p)
                rows.append(dict(phase=phase, step=r, policy=p, context=c[1], arm=p[4:], s=s))
    events = [e.kind for e in loop.events]
    if me == 0:
        publish_rows([*rows, {"phase": "check", **wrong, "loop_events": events, "loop_errors": len(loop.errors)}])
    for comm in [*comms.values(), barrier_comm]:
        comm.close()
    transport.close()
    jax.distributed.shutdown()
    return 0


def _summary(rows: list[dict], steps: int) -> list[dict]:
    """Per phase and context: each policy's total, the best arm in hindsight and the regret against it."""
    out = []
    for phase in ("healthy", "cut"):
        for context in sorted({r["context"] for r in rows if r["phase"] == phase}):
            sel = [r for r in rows if r["phase"] == phase and r["context"] == context]
            arms = {r["arm"] for r in sel if r["policy"].startswith("arm:")}
            medians = {a: report.median([r["s"] for r in sel if r["policy"] == "arm:" + a]) for a in arms}
            best = min(medians, key=medians.get)
            best_total = medians[best] * steps
            for p in POLICIES:
                times = [r["s"] for r in sel if r["policy"] == p]
                chosen = [r["arm"] for r in sel if r["policy"] == p]
                out.append(
                    {
                        "phase": phase,
                        "context": report.format_bytes(context),
                        "policy": p,
                        "total_ms": sum(times) * 1e3,
                        "best_arm": best,
                        "best_total_ms": best_total * 1e3,
                        "regret_pct": (sum(times) / best_total - 1) * 100,
                        "last_arm": chosen[-1],
                        "steps_on_best": sum(a == best for a in chosen),
                    }
                )
    return out


def _totals(summary: list[dict]) -> list[dict]:
    """Per phase and policy, summed over the contexts: total time and regret against the best arms."""
    out = []
    for phase in ("healthy", "cut"):
        for p in POLICIES:
            sel = [r for r in summary if r["phase"] == phase and r["policy"] == p]
            total, best = sum(r["total_ms"] for r in sel), sum(r["best_total_ms"] for r in sel)
            out.append(
                {
                    "phase": phase,
                    "policy": p,
                    "total_ms": total,
                    "best_ms": best,
                    "regret_pct": (total / best - 1) * 100,
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=f"{1 << 20},{8 << 20}", help="AllGather message sizes in bytes (contexts)")
    ap.add_argument("--steps", type=int, default=24, help="tuned steps per phase (healthy, cut)")
    ap.add_argument("--rounds", type=int, default=5, help="round-robin rounds per arm for the best arm in hindsight")
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="every NIC's rate")
    ap.add_argument("--cut-rank", type=int, default=1)
    ap.add_argument("--cut-rate-mbit", type=float, default=40.0)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--json", metavar="PATH", help="write the rows and the summary as JSON")
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.steps < 1 or args.rounds < 1 or not args.sizes or any(s <= 0 or s % 32 for s in args.sizes):
        ap.error("need --steps >= 1, --rounds >= 1 and sizes that are positive multiples of 32 bytes (8 ranks x f32)")
    if not 0 <= args.cut_rank < 8:
        ap.error("--cut-rank must be one of the 8 ranks")
    if args.worker:
        return worker(args)

    from jaxccl.distributed.transport import unavailable_reason
    from jaxccl.labs import netlab
    from jaxccl.labs.drill import _signal
    from jaxccl.labs.netlab import LinkShape
    from jaxccl.labs.rail import RailLab

    for reason in (unavailable_reason(), netlab.unavailable_reason()):
        if reason is not None:
            print(f"cannot run: {reason}")
            return 2
    lines: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxccl-tune-") as folder:
        worker_argv = [sys.executable, "-m", "benchmarks.tune.live_multiprocess", "--worker", "--folder", folder]
        worker_argv += argv if argv is not None else sys.argv[1:]

        def relay(procs) -> None:
            for line in procs[0].stdout:
                lines.append(line)
                if line.startswith(CUT_REQUEST):
                    lab.shape(args.cut_rank, LinkShape(rate_mbit=args.cut_rate_mbit))
                    _signal(Path(folder), CUT_DONE)
                    print(f"cut rank {args.cut_rank}'s NIC to {args.cut_rate_mbit:g} Mbit/s", flush=True)

        with RailLab(2, 4, LinkShape(rate_mbit=args.rate_mbit)) as lab:
            results = lab.launch(worker_argv, timeout_s=args.timeout_s, during=relay, env={"PYTHONPATH": str(_ROOT)})
    rows = collected_rows(results, lines)
    if rows is None:
        return 1
    check = rows.pop()
    summary = _summary(rows, args.steps)
    totals = _totals(summary)
    print(
        f"NCCL-BOT live across 8 processes (netns rail 2x4, {args.rate_mbit:g} Mbit/s NICs; rank {args.cut_rank}'s NIC "
        f"cut to {args.cut_rate_mbit:g} Mbit/s after {args.steps} steps); AllGather; a step's time = the slowest "
        "process's launch time; best arm = round-robin medians in the same run"
    )
    report.print_table(
        summary,
        [
            "phase",
            "context",
            "policy",
            "total_ms",
            "best_arm",
            "best_total_ms",
            "regret_pct",
            "last_arm",
            "steps_on_best",
        ],
    )
    print()
    report.print_table(totals, ["phase", "policy", "total_ms", "best_ms", "regret_pct"])
    kinds = {k: check["loop_events"].count(k) for k in dict.fromkeys(check["loop_events"])}
    print(f"\nthe loop (process 0): events {kinds}, errors {check['loop_errors']}")
    print(f"{check['calls']} calls compared with jax.lax, {check['wrong']} differed ({time.perf_counter() - t0:.0f} s)")
    if args.json:
        report.write_json(
            args.json,
            {
                "benchmark": "tune_live_multiprocess",
                "config": vars(args),
                "rows": rows,
                "summary": summary,
                "totals": totals,
                "check": check,
            },
        )
    return 0 if check["wrong"] == 0 else 1


_ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    sys.exit(main())
