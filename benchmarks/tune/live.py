"""NCCL-BOT live, in one process: the online tuner learns from the executor's own timings through a fault.

A 2-D mesh job (8 emulated CPU devices, mesh 2 x 4, the communicator over both
axes) on the emulated rail 2 x 4 all-gathers four buffers of different sizes
in one jitted step: four contexts, one per size bucket
(``Communicator(..., size_buckets=True)``). Four policies run side by side,
each on its own communicator and emulated fabric, interleaved step by step
(the order rotates every step), with the same fault schedule: ``--steps``
healthy steps, then GPU 0's NIC drops to ``--fault-gbps`` on every fabric
and ``--steps`` more run. Every communicator starts on the synthesized
AllGather and, except ``nccl_auto``'s, runs the closed loop (a step-driven
:class:`jaxccl.control.Controller`), which re-synthesizes after the fault.

- ``ucb1``: :class:`jaxccl.tune.OnlineTuner` with NCCL-BOT's UCB1 champion,
  following the controller (its re-synthesis replaces the tree arm and
  restarts the contexts from the prior on the measured fabric);
- ``auto``: the same tuner with the AUTO policy (the cost model's choice);
- ``nccl_auto``: the AUTO tuner without the closed loop, as NCCL's AUTO: its model knows the healthy
  fabric only and its arms are the catalogue's (no controller runs on its communicator);
- ``static``: no tuner, the closed loop alone (what jaxccl runs by default).

The reward of each step is the executor's launch time of each context's
bucket slot (:func:`jaxccl.runtime.native.last_launch_seconds`). Every step's
results are compared bitwise with ``jax.lax``.

After the run, the **best arm in hindsight** is measured on a fourth
communicator by round-robin A/B (every arm of the catalogue and every
re-synthesized schedule of the run, ``--rounds`` rounds, installed for all
sizes), on the healthy fabric and then on the degraded one. Times per
policy: *realized* = the sum of the executor times the policy's steps took;
*selection-priced* = the sum, over its steps, of the A/B median of the
schedule it ran (NCCL-BOT's selection-priced TRLT, robust to the machine's
load). Regret = policy time / best-in-hindsight time - 1, best in hindsight =
steps x the A/B median of each context's best arm in that phase.

Usage:
    nice -n 10 python -m benchmarks.tune.live [--steps 60] [--rounds 9] [--time-scale 1e-3]
        [--json benchmarks/results/tuning/live_rail2x4.json] [--png docs/_static/tuning_live.png]

Example (the contexts' message sizes; the run takes minutes):
    >>> [message_bytes(e) for e in ELEMS]
    [65536, 262144, 1048576, 4194304]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import jaxccl
from jaxccl.topology import rail, scenario
from jaxccl.util import report

AXES = ("a", "b")
ELEMS = (2048, 8192, 32768, 131072)  # float32 elements per rank of the four AllGathers
POLICIES = ("ucb1", "auto", "nccl_auto", "static")
PHASES = ("healthy", "degraded")


def message_bytes(elems: int) -> int:
    """One context's message size: the AllGather output per rank (nccl-tests' convention)."""
    return 8 * elems * 4


class Run:
    """One policy's job: a communicator with size buckets on its own emulated fabric, its controller and tuner."""

    def __init__(self, policy: str, mesh: Any, topo: Any, step_fn: Any, time_scale: float):
        from jaxccl.control import Controller
        from jaxccl.runtime.emulated import LinkEmulation
        from jaxccl.tune import OnlineTuner

        self.policy = policy
        self.comm = jaxccl.Communicator(
            mesh, AXES, topology=topo, backend="cpu", link_emulation=LinkEmulation(time_scale=time_scale),
            size_buckets=True,
        )  # fmt: skip
        self.comm.install("all_gather", jaxccl.synth.all_gather(topo))
        self.controller = None if policy == "nccl_auto" else Controller(self.comm, gamma=0.15)
        self.tuner = None
        if policy == "nccl_auto":  # no loop: the model knows the healthy fabric only, the arms are the catalogue's
            self.tuner = OnlineTuner(self.comm, policy="auto")
        elif policy != "static":
            self.tuner = OnlineTuner(self.comm, policy=None if policy == "ucb1" else policy).follow(self.controller)
        self.step_fn = step_fn
        self.contexts = [("all_gather", message_bytes(e)) for e in ELEMS]
        self.times: list[list[float]] = []  # per step, per context: executor seconds
        self.ran: list[list[str]] = []  # per step, per context: digest of the schedule launched
        self.arms: list[list[str]] = []  # per step, per context: the tuner's arm (or the schedule's name)
        self.resynthesized: list[Any] = []

    def step(self, xs: Sequence[Any], want: Sequence[bytes]) -> None:
        from jaxccl.runtime import native

        arms = list(self.tuner.prepare_all(self.contexts).values()) if self.tuner else None
        launched = [self.comm.launched_schedule("all_gather", nbytes=nb) for _, nb in self.contexts]
        with self.comm:
            out = self.step_fn(*xs)
            for o, w in zip(out, want):
                if not np.array_equal(np.asarray(o).view(np.uint32), w):
                    raise AssertionError(f"{self.policy}: a result differs from jax.lax")
        slots = [self.comm.slot("all_gather", nb) for _, nb in self.contexts]
        self.times.append([native.last_launch_seconds(s) for s in slots])
        if self.tuner:
            self.tuner.record_all()
        self.ran.append([s.digest for s in launched])
        self.arms.append(arms if arms is not None else [s.name for s in launched])
        if self.controller is None:
            return
        before = {e.time_ns for e in self.controller.events if e.kind == "staged"}
        self.controller.step()
        if any(e.kind == "staged" and e.time_ns not in before for e in self.controller.events):
            self.resynthesized.append(self.comm.schedule("all_gather"))


def _program(mesh: Any, lib: Any) -> Any:
    import jax
    from jax.sharding import PartitionSpec as P

    spec = P(AXES)

    def body(*shards: Any) -> Any:
        return tuple(lib.all_gather(s, AXES, tiled=True) for s in shards)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(ELEMS), out_specs=(spec,) * len(ELEMS)))


def hindsight(
    mesh: Any, topo: Any, fault: Any, step_fn: Any, xs: Any, want: Any, extra: Sequence[Any], args: Any
) -> dict[str, dict[str, list[list[float]]]]:
    """Round-robin A/B after the run: ``{phase: {digest: [[seconds per context] per round]}}`` and the names."""
    from jaxccl.runtime import native
    from jaxccl.runtime.emulated import LinkEmulation
    from jaxccl.tune import arm_catalog

    comm = jaxccl.Communicator(
        mesh, AXES, topology=topo, backend="cpu", link_emulation=LinkEmulation(time_scale=args.time_scale),
        size_buckets=True,
    )  # fmt: skip
    schedules = {a.parts[0].digest: (a.name, a.parts[0]) for a in arm_catalog("all_gather", topo)}
    for k, s in enumerate(extra):
        schedules.setdefault(s.digest, (f"resynth{k}" if len(extra) > 1 else "resynth", s))
    out: dict[str, Any] = {"names": {d: n for d, (n, _) in schedules.items()}}
    nbs = [message_bytes(e) for e in ELEMS]
    for phase in PHASES:
        if phase == "degraded":
            comm.inject(fault)
        samples: dict[str, list[list[float]]] = {d: [] for d in schedules}
        for r in range(args.rounds):
            order = list(schedules)
            order = order[r % len(order) :] + order[: r % len(order)]
            for d in order:
                comm.install("all_gather", schedules[d][1])
                with comm:
                    for _ in range(2):  # the first launch activates the swap; time the second
                        res = step_fn(*xs)
                        same = all(np.array_equal(np.asarray(o).view(np.uint32), w) for o, w in zip(res, want))
                if not same:
                    raise AssertionError(f"A/B: {schedules[d][0]} differs from jax.lax")
                samples[d].append([native.last_launch_seconds(comm.slot("all_gather", nb)) for nb in nbs])
        out[phase] = samples
    comm.close()
    return out


def summarize(runs: dict[str, Run], ab: dict[str, Any], steps: int) -> dict[str, Any]:
    """Per context, phase and policy: realized and selection-priced times, regret vs the best in hindsight."""
    names = ab["names"]
    out: dict[str, Any] = {"contexts": {}, "total": {}}
    totals: dict[str, dict[str, dict[str, float]]] = {}
    for c, e in enumerate(ELEMS):
        key = f"all_gather/8/{message_bytes(e)}"
        ctx_out: dict[str, Any] = {}
        for p_i, phase in enumerate(PHASES):
            med = {d: float(np.median([s[c] for s in samples])) for d, samples in ab[phase].items()}
            # the arms the policies had: the catalogue, and after the fault the closed loop's re-syntheses too
            best = min((d for d in med if phase == "degraded" or not names[d].startswith("resynth")), key=med.get)
            row: dict[str, Any] = {
                "best_arm": names[best],
                "best_s": med[best] * steps,
                "ab_median_s": {names[d]: v for d, v in med.items()},
            }
            lo, hi = p_i * steps, (p_i + 1) * steps
            for p, run in runs.items():
                realized = float(sum(t[c] for t in run.times[lo:hi]))
                priced = float(sum(med[d[c]] for d in run.ran[lo:hi]))
                row[p] = {
                    "realized_s": realized,
                    "priced_s": priced,
                    "regret_realized": realized / (med[best] * steps) - 1,
                    "regret_priced": priced / (med[best] * steps) - 1,
                    "arms": _counts([a[c] for a in run.arms[lo:hi]]),
                }
                t = totals.setdefault(p, {}).setdefault(phase, {"realized_s": 0.0, "priced_s": 0.0})
                t["realized_s"] += realized
                t["priced_s"] += priced
            b = totals.setdefault("best", {}).setdefault(phase, {"s": 0.0})
            b["s"] += med[best] * steps
            ctx_out[phase] = row
        out["contexts"][key] = ctx_out
    for phase in (*PHASES, "all"):
        best = sum(totals["best"][ph]["s"] for ph in PHASES) if phase == "all" else totals["best"][phase]["s"]
        row = {"best_s": best}
        for p in runs:
            phases = PHASES if phase == "all" else (phase,)
            realized = sum(totals[p][ph]["realized_s"] for ph in phases)
            priced = sum(totals[p][ph]["priced_s"] for ph in phases)
            row[p] = {
                "realized_s": realized,
                "priced_s": priced,
                "regret_realized": realized / best - 1,
                "regret_priced": priced / best - 1,
            }
        out["total"][phase] = row
    return out


def _rounded(rows: Sequence[Sequence[float]]) -> list[list[float]]:
    """Seconds to the microsecond (the JSON stays small)."""
    return [[round(float(v), 6) for v in row] for row in rows]


def _counts(items: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def table(summary: dict[str, Any]) -> list[list[Any]]:
    """Rows: context, phase, best arm, then per policy realized ms and regret (realized / selection-priced)."""
    rows = []

    def cells(row: dict[str, Any]) -> list[Any]:
        out = []
        for p in POLICIES:
            r = row[p]
            out += [f"{r['realized_s'] * 1e3:.0f}", f"{r['regret_realized']:+.1%} / {r['regret_priced']:+.1%}"]
        return out

    for key, ctx in summary["contexts"].items():
        for phase in PHASES:
            row = ctx[phase]
            rows.append([key, phase, f"{row['best_arm']} {row['best_s'] * 1e3:.0f}", *cells(row)])
    for phase in (*PHASES, "all"):
        row = summary["total"][phase]
        rows.append(["total", phase, f"{row['best_s'] * 1e3:.0f}", *cells(row)])
    return rows


HEADER = [
    "context",
    "phase",
    "best in hindsight (ms)",
    *[x for p in POLICIES for x in (f"{p} ms", f"{p} regret (realized / priced)")],
]


def plot(runs: dict[str, Run], ab: dict[str, Any], steps: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    for p, run in runs.items():
        per_step = np.array([sum(t) for t in run.times]) * 1e3
        ax.plot(np.arange(len(per_step)), per_step, label=p, lw=1.2)
    for p_i, phase in enumerate(PHASES):
        best = sum(
            min(
                float(np.median([s[c] for s in smp]))
                for d, smp in ab[phase].items()
                if phase == "degraded" or not ab["names"][d].startswith("resynth")
            )
            for c in range(len(ELEMS))
        )
        ax.hlines(best * 1e3, p_i * steps, (p_i + 1) * steps, colors="k", linestyles="dashed", lw=1)
    ax.axvline(steps, color="r", lw=0.8)
    ax.text(steps + 1, ax.get_ylim()[1] * 0.95, "fault: GPU 0's NIC", color="r", va="top", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("executor time of the 4 AllGathers (ms)")
    ax.set_title("Live tuning, emulated rail 2x4, 4 size contexts (dashed: best arm in hindsight)")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="steps per phase (healthy, then degraded)")
    ap.add_argument("--rounds", type=int, default=9, help="round-robin A/B rounds per phase after the run")
    ap.add_argument("--time-scale", type=float, default=1e-3)
    ap.add_argument("--fault-gbps", type=float, default=100.0, help="GPU 0's NIC after the fault (of 400)")
    ap.add_argument(
        "--fault", default="nic", choices=("nic", "fail1", "fail2", "fail3"),
        help="nic: GPU 0's NIC at --fault-gbps; failN: MCCL's scenario on GPU 0 (jaxccl.topology.scenario)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="benchmarks/results/tuning/live_rail2x4.json")
    ap.add_argument("--png", default="docs/_static/tuning_live.png")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.rounds < 1 or not args.time_scale > 0 or not 0 < args.fault_gbps < 400:
        ap.error("need --steps >= 2, --rounds >= 1, --time-scale > 0 and 0 < --fault-gbps < 400")

    jaxccl.emulate(8)
    import jax
    from jax.sharding import Mesh

    t_start = time.perf_counter()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), AXES)
    topo = rail(hosts=2, gpus_per_host=4)
    if args.fault == "nic":
        fault, fault_text = (
            topo.degrade(0, "tor:s0r0", gbps=args.fault_gbps),
            f"GPU 0's NIC 400 -> {args.fault_gbps:g} Gbps",
        )
    else:
        fault, fault_text = scenario(topo, args.fault), f"MCCL's {args.fault} on GPU 0"
    step_fn, ref = _program(mesh, jaxccl), _program(mesh, jax.lax)
    rng = np.random.default_rng(args.seed)
    xs = [rng.standard_normal(8 * e).astype(np.float32) + np.float32(0.5) for e in ELEMS]
    want = [np.asarray(o).view(np.uint32) for o in ref(*xs)]
    runs = {p: Run(p, mesh, topo, step_fn, args.time_scale) for p in POLICIES}
    for run in runs.values():  # compile and warm every communicator outside the timeline
        with run.comm:
            jax.block_until_ready(step_fn(*xs))
        run.comm.telemetry()
    for phase in PHASES:
        for step in range(args.steps):
            if phase == "degraded" and step == 0:
                for run in runs.values():
                    run.comm.inject(fault)
            order = list(POLICIES)
            k = (step + (phase == "degraded") * args.steps) % len(order)
            for p in order[k:] + order[:k]:
                runs[p].step(xs, want)
        print(
            f"{phase}: {args.steps} steps x {len(POLICIES)} policies, {time.perf_counter() - t_start:.0f} s", flush=True
        )
    load_run = os.getloadavg()
    extra = [s for run in runs.values() for s in run.resynthesized]
    ab = hindsight(mesh, topo, fault, step_fn, xs, want, extra, args)
    summary = summarize(runs, ab, args.steps)
    load = os.getloadavg()
    rows = table(summary)
    report.print_table([dict(zip(HEADER, r)) for r in rows], HEADER)
    print()
    print("| " + " | ".join(HEADER) + " |")
    print("|" + " --- |" * len(HEADER))
    for r in rows:
        print("| " + " | ".join(str(v) for v in r) + " |")
    result = {
        "benchmark": "tune.live",
        "topology": "rail 2x4 (emulated)",
        "mesh": "2 x 4, communicator over both axes",
        "contexts": [f"all_gather/8/{message_bytes(e)}" for e in ELEMS],
        "fault": f"{fault_text} after step {args.steps}",
        "args": vars(args),
        "load_average_run": load_run,
        "load_average_end": load,
        "wall_s": time.perf_counter() - t_start,
        "summary": summary,
        "controller_events": {
            p: [(e.kind, e.collective) for e in r.controller.events] for p, r in runs.items() if r.controller
        },
        "resyntheses": {p: (r.tuner.resyntheses if r.tuner else []) for p, r in runs.items()},
        "steps": {
            p: {"times_s": _rounded(r.times), "arms": r.arms, "ran": [[d[:12] for d in s] for s in r.ran]}
            for p, r in runs.items()
        },
        "ab": {ph: {ab["names"][d]: _rounded(v) for d, v in ab[ph].items()} for ph in PHASES},
    }
    if args.json:
        report.write_json(args.json, result)
    if args.png:
        plot(runs, ab, args.steps, args.png)
    tot = summary["total"]
    ucb, auto = tot["all"]["ucb1"], tot["degraded"]["auto"]
    print(
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; UCB1 total {ucb['regret_realized']:+.1%} realized"
        f" / {ucb['regret_priced']:+.1%} priced vs the best arm in hindsight (goal: within 5 %); after the fault"
        f" UCB1 {tot['degraded']['ucb1']['realized_s'] * 1e3:.0f} / {tot['degraded']['ucb1']['priced_s'] * 1e3:.0f} ms"
        f" vs AUTO {auto['realized_s'] * 1e3:.0f} / {auto['priced_s'] * 1e3:.0f} ms (realized / priced)"
    )
    return result


if __name__ == "__main__":
    main()
