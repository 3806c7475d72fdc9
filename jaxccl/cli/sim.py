"""``jaxccl sim ...``: run the flow-level simulator and MCCL's simulation experiments.

Subcommands:

- ``jaxccl sim run``: one collective on one topology (``--topology rail:1x2x8``,
  ``--scenario fail2``, ``--collective all_gather``, ``--schedule nccl|ring|synth``);
  prints time, algbw and simulator wall time; ``--json`` and ``--png`` (per-link
  utilization).
- ``jaxccl sim fig1|fig8|fig11``: the experiments of :mod:`jaxccl.sim.experiments`
  (``--quick`` for a seconds-long configuration), a table on stdout, ``--json``
  and ``--png``.
"""

from __future__ import annotations

import argparse
from typing import Any

import jaxccl.sim as sim
from jaxccl.cli.args import UsageError, parse_size, positive_int, require_matplotlib, topology
from jaxccl.cli.text import plain
from jaxccl.schedule.ir import Collective
from jaxccl.sim import experiments, plots
from jaxccl.sim.experiments import Synthesizers
from jaxccl.sim.plots import plot_links
from jaxccl.synth import baselines
from jaxccl.synth.nccl import nccl_schedule
from jaxccl.topology import scenario
from jaxccl.util.report import format_bytes, print_table, write_json


def parse_topology(spec: str) -> Any:
    """``rail:SxHxN`` / ``rail:HxN``, ``single:N``, ``ring:N``, ``fattree:LxG`` or a topology JSON file -> Topology.

    Kept for callers of the earlier name; the rule lives in :func:`jaxccl.cli.args.topology`.
    """
    return topology(spec)


def _iterations(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


def _schedule(args: argparse.Namespace, topo: Any, healthy: Any):
    col = Collective(args.collective)
    if args.schedule == "nccl":
        return nccl_schedule(col, topo)
    if args.schedule == "ring":
        fn = {
            Collective.ALL_GATHER: baselines.ring_allgather,
            Collective.REDUCE_SCATTER: baselines.ring_reduce_scatter,
            Collective.ALL_REDUCE: baselines.ring_allreduce,
            Collective.ALL_TO_ALL: baselines.direct_alltoall,
        }[col]
        return fn(topo)
    synth = Synthesizers()
    if args.schedule == "static":
        s = synth.synth(col, healthy)
    else:
        base = synth.synth(col, healthy) if topo is not healthy else None
        s = synth.synth(col, topo, previous=base)
    if s is None:
        raise UsageError(f"no synthesized schedule: {synth.missing}")
    return s


def _cmd_run(args: argparse.Namespace) -> int:
    if args.png:
        require_matplotlib()
    healthy = args.topology
    topo = healthy if args.scenario == "none" else scenario(healthy, args.scenario)
    s = _schedule(args, topo, healthy)
    print(f"simulating {s} on {topo} with {format_bytes(args.bytes)} per rank")
    res = sim.run(
        topo, s, args.bytes, pipeline_bytes=None if args.no_pipeline else args.pipeline, iterations=args.iterations
    )
    row = {
        "schedule": s.name,
        "ranks": s.num_ranks,
        "bytes": format_bytes(args.bytes),
        "time_ms": res.time_s * 1e3,
        "algbw_GBps": res.algbw / 1e9,
        "flows": res.num_flows,
        "iterations": res.jobs[0].iterations,
        "sim_wall_s": res.wall_s,
        "max_util": res.max_link_utilization,
    }
    print_table([row])
    if args.json:
        out = {**res.summary(), "schedule": s.name, "topology": topo.name, "bytes_per_rank": args.bytes}
        out["link_utilization"] = {f"{u}->{v}": x for (u, v), x in res.link_utilization.items()}
        write_json(args.json, out)
        print(f"wrote {args.json}")
    if args.png:
        print(f"wrote {plot_links(res.link_utilization, args.png, title=f'{s.name} on {topo.name}')}")
    return 0


def _experiment(name: str):
    def cmd(args: argparse.Namespace) -> int:
        if args.png:
            require_matplotlib()

        kwargs: dict[str, Any] = {"quick": args.quick}
        if name == "fig8" and args.hosts:
            kwargs["hosts"] = args.hosts
        if name == "fig8":
            kwargs["execution"] = args.model
            if args.collective:
                kwargs["collectives"] = args.collective
        if name == "fig11" and args.gpus:
            kwargs["gpus"] = args.gpus
        if name == "fig11" and args.workload:
            kwargs["workloads"] = args.workload
        if name in ("fig8", "fig11") and args.scenario:
            kwargs["scenarios"] = args.scenario
        print(f"running MCCL {name} on jaxccl.sim{' (quick)' if args.quick else ''}")
        result = getattr(experiments, name)(**kwargs)
        print_table(_table(name, result))
        for key, why in result["missing"].items():
            print(f"missing {key}: {why}")
        if args.json:
            write_json(args.json, result)
            print(f"wrote {args.json}")
        if args.png:
            print(f"wrote {getattr(plots, 'plot_' + name)(result, args.png)}")
        print(f"done in {result['wall_s']:.1f} s")
        return 0

    return cmd


def _table(name: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = result["rows"]
    if name == "fig1":
        cols = ("collective", "size_bytes", "nic_gbps", "schedule", "algbw", "ratio")
    elif name == "fig8":
        cols = ("topology", "collective", "scenario", "schedule", "algbw", "ratio")
    else:
        cols = ("workload", "gpus", "scenario", "compute_s", "nccl_step_s", "mccl_step_s", "speedup")
    out = []
    for r in rows:
        d = {c: r.get(c) for c in cols}
        if "size_bytes" in d:
            d["size_bytes"] = format_bytes(d["size_bytes"])
        if d.get("algbw") is not None:
            d["algbw"] = f"{d['algbw'] / 1e9:.2f} GB/s"
        if isinstance(d.get("ratio"), float):
            d["ratio"] = f"{d['ratio']:.2f}x"
        out.append(d)
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``run``, ``fig1``, ``fig8`` and ``fig11`` under ``jaxccl sim``."""
    p = subparsers.add_parser(
        "run",
        help="simulate one collective on one topology",
        description=plain(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--topology",
        type=topology,
        default="rail:1x2x8",
        metavar="SPEC|FILE",
        help="rail:SxHxN, rail:HxN, single:N, ring:N, fattree:LxG or a topology JSON file (default rail:1x2x8)",
    )
    p.add_argument("--scenario", default="none", choices=("none", "fail1", "fail2", "fail3"))
    p.add_argument(
        "--collective", default="all_gather", choices=("all_gather", "all_to_all", "reduce_scatter", "all_reduce")
    )
    p.add_argument(
        "--schedule",
        default="nccl",
        choices=("nccl", "ring", "synth", "static"),
        help="nccl: NCCL-like baseline; ring: single-ring/direct baseline; synth: synthesized for the "
        "(degraded) topology; static: synthesized for the healthy topology",
    )
    p.add_argument("--bytes", type=parse_size, default=128 << 20, help="input bytes per rank (e.g. 128M)")
    p.add_argument("--pipeline", type=parse_size, default=512 << 10, help="pipeline piece size (default 512K)")
    p.add_argument("--no-pipeline", action="store_true", help="store-and-forward")
    p.add_argument(
        "--iterations",
        type=_iterations,
        default=1,
        help="MSCCL loop iterations (tiles of the buffer); 'auto': one piece per chunk",
    )
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--png", metavar="PATH", help="per-link utilization plot")
    p.set_defaults(func=_cmd_run)
    helps = {
        "fig1": "MCCL Fig. 1: 1x2x8 with GPU 0's NIC degraded",
        "fig8": "MCCL Fig. 8: 1x{2..32}x8 under Fail1-3",
        "fig11": "MCCL Fig. 11 / App. E: Llama 405B and DeepSeek 671B training steps",
    }
    for name, text in helps.items():
        q = subparsers.add_parser(name, help=text, description=text)
        q.add_argument("--quick", action="store_true", help="a small configuration that runs in seconds")
        q.add_argument("--json", metavar="PATH")
        q.add_argument("--png", metavar="PATH")
        if name == "fig8":
            q.add_argument("--hosts", type=positive_int, nargs="+", help="hosts per segment (default 2 4 8 16 32)")
            q.add_argument("--collective", nargs="+", choices=("all_gather", "all_to_all"))
            q.add_argument(
                "--model",
                default="dataflow",
                choices=("dataflow", "in_order"),
                help="dataflow: jaxccl's executors, no head-of-line blocking (default); in_order: MSCCL's runtime",
            )
        if name == "fig11":
            q.add_argument("--gpus", type=positive_int, nargs="+", help="cluster sizes (default 128 ... 2048)")
            q.add_argument("--workload", nargs="+", choices=("llama405b", "deepseek671b"))
        if name in ("fig8", "fig11"):
            q.add_argument("--scenario", nargs="+", choices=("none", "fail1", "fail2", "fail3"))
        q.set_defaults(func=_experiment(name))
