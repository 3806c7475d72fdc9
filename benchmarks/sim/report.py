"""Markdown tables of the simulator benchmarks for ``docs/results.md``, our numbers next to MCCL's.

Reads the JSON that ``benchmarks/sim/fig1.py``, ``sim_fig8.py``, ``sim_fig11.py`` and
``sim_scale.py`` wrote (default ``benchmarks/results/sim/``) and prints one markdown
section per file found; a missing file is named and skipped.

Usage:
    python -m benchmarks.sim.report [--dir benchmarks/results/sim]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

SCENARIOS = ("none", "fail1", "fail2", "fail3")


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def fig1(d: dict[str, Any]) -> str:
    """NIC bandwidth rows; per schedule the 128 MiB ratio, the 1 GiB one in brackets when it differs by > 0.05."""
    paper = d["paper"]["reopt"]
    sizes = sorted(d["config"]["sizes"])
    ratio = {(r["collective"], r["schedule"], r["nic_gbps"], r["size_bytes"]): r["ratio"] for r in d["rows"]}

    def cell(coll: str, kind: str, bw: float) -> str:
        vals = [ratio.get((coll, kind, bw, s)) for s in sizes]
        if vals[0] is None:
            return "-"
        out = _x(vals[0])
        if len(vals) > 1 and vals[-1] is not None and abs(vals[-1] - vals[0]) > 0.05:
            out += f" [{_x(vals[-1])}]"
        return out

    rows = []
    for bw in sorted(d["config"]["nic_gbps"], reverse=True):
        p = {k: v.get(str(int(bw)), v.get(int(bw), "-")) for k, v in paper.items()}  # JSON made the keys strings
        rows.append(
            [
                f"{bw:g} Gbps",
                f"{cell('all_to_all', 'reopt', bw)} ({p['all_to_all']})",
                f"{cell('all_gather', 'reopt', bw)} ({p['all_gather']})",
                cell("all_gather", "reopt_cold", bw),
                f"{cell('all_gather', 'reopt_1chunk', bw)} ({p['all_gather_1chunk']})",
                f"{cell('all_gather', 'orig', bw)} / {cell('all_to_all', 'orig', bw)}",
            ]
        )
    header = [
        "NIC",
        "AllToAll reopt (paper)",
        "AllGather reopt (paper)",
        "AllGather cold",
        "AllGather 1 tree (paper, TE-CCL 1 ch)",
        "orig AG / A2A",
    ]
    return _table(header, rows)


def fig8(d: dict[str, Any]) -> str:
    """Per collective: topologies x scenarios, cells ``no reopt / reopt (predicted)``; then simulated / predicted."""
    out = []
    rows = d["rows"]
    nccl = {(r["hosts"], r["collective"], r["scenario"]): r["algbw"] for r in rows if r["schedule"] == "nccl"}
    for coll in d["config"]["collectives"]:
        body, fractions = [], []
        for h in d["config"]["hosts"]:
            line, frac = [f"1x{h}x8"], [f"1x{h}x8"]
            for sc in d["config"]["scenarios"]:
                got = {r["schedule"]: r for r in rows if (r["hosts"], r["collective"], r["scenario"]) == (h, coll, sc)}
                if "reopt" not in got:
                    line.append("-")
                    frac.append("-")
                    continue
                re = got["reopt"]
                pred = re["predicted_algbw"] / nccl[(h, coll, sc)] if re.get("predicted_algbw") else None
                line.append(f"{_x(got['orig']['ratio'])} / **{_x(re['ratio'])}** ({_x(pred)})")
                if not re.get("predicted_algbw"):
                    frac.append("-")
                    continue
                cell = _x(re["algbw"] / re["predicted_algbw"])
                if re.get("algbw_what_if_tiles"):
                    cell += f" [{_x(re['algbw_what_if_tiles'] / re['predicted_algbw'])}]"
                frac.append(cell)
            body.append(line)
            fractions.append(frac)
        out.append(f"**{coll}**\n\n" + _table(["topology", *d["config"]["scenarios"]], body))
        what_if = d["config"].get("what_if_tiles")
        note = f" [with at most {what_if} tiles per launch instead of 32]" if what_if else ""
        out.append(
            f"**{coll}, reopt: simulated / predicted algbw{note}**\n\n"
            + _table(["topology", *d["config"]["scenarios"]], fractions)
        )
    return "\n\n".join(out)


def fig11(d: dict[str, Any]) -> str:
    """Workload x cluster rows; per scenario the step speedup over NCCL of jaxccl and of jaxccl with a static RS."""
    scens = d["config"]["scenarios"]
    by = {(r["workload"], r["gpus"], r["scenario"]): r for r in d["rows"]}
    body = []
    for w in d["config"]["workloads"]:
        for n in d["config"]["gpus"]:
            line = [w, str(n)]
            healthy = by.get((w, n, "none"))
            line.append(f"{healthy['nccl_step_s']:.0f}" if healthy else "-")
            for sc in scens:
                r = by.get((w, n, sc))
                if r is None:
                    line.append("-")
                elif "speedup_static_rs" in r:
                    line.append(f"{_x(r['speedup'])} / {_x(r['speedup_static_rs'])}")
                else:  # results of the harness before ReduceScatter was re-synthesized by default
                    line.append(f"{_x(r['speedup_rs'])} / {_x(r['speedup'])}")
            body.append(line)
    header = ["workload", "GPUs", "healthy NCCL step (s)", *[f"{sc}: jaxccl / static RS" for sc in scens]]
    return _table(header, body)


def scale(d: dict[str, Any]) -> str:
    """Simulator wall time of one ring AllGather per cluster size."""
    body = [
        [
            str(r["gpus"]),
            f"{r['flows']:,}",
            f"{r['compile_s']:.1f}",
            f"{r['engine_s']:.1f}",
            f"**{r['sim_wall_s']:.1f}**",
            f"{r['sim_cpu_s']:.1f}" if "sim_cpu_s" in r else "-",
            f"{r['load_avg']:.1f}" if "load_avg" in r else "-",
            f"{r['time_s'] * 1e3:.1f} / {r['analytic_time_s'] * 1e3:.1f}",
            f"{r['event_batches']:,}",
            f"{r['peak_rss_MB']:.0f}",
        ]
        for r in d["rows"]
    ]
    header = [
        "GPUs",
        "flows",
        "compile (s)",
        "engine (s)",
        "simulator wall (s)",
        "CPU (s)",
        "load avg",
        "simulated / analytic (ms)",
        "event batches",
        "peak RSS (MB)",
    ]
    return _table(header, body)


SECTIONS: dict[str, Callable[[dict[str, Any]], str]] = {
    "sim_fig1.json": fig1,
    "sim_fig8.json": fig8,
    "sim_fig11.json": fig11,
    "sim_scale.json": scale,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="benchmarks/results/sim", help="where the benchmarks wrote their JSON")
    args = ap.parse_args(argv)
    for name, fn in SECTIONS.items():
        path = os.path.join(args.dir, name)
        if not os.path.exists(path):
            print(f"<!-- {path}: not found -->\n")
            continue
        with open(path) as f:
            data = json.load(f)
        wall = data.get("wall_s")
        print(f"### {name}" + (f" (harness wall {wall:.0f} s)" if wall else "") + "\n")
        print(fn(data) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
