"""matplotlib figures (Agg backend, PNG) for the simulator's results and experiments."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["plot_fig1", "plot_fig8", "plot_fig11", "plot_links"]

_COLORS = {"nccl": "#7f7f7f", "orig": "#1f77b4", "reopt": "#d62728", "reopt_cold": "#9467bd", "reopt_1chunk": "#ff7f0e"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def _size_label(n: float) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):g} MiB"


def _ratio_bars(
    ax: Any,
    rows: list[Mapping[str, Any]],
    kinds: tuple[str, ...],
    key: str,
    groups: list[Any],
    ticks: list[str],
    title: str,
    *,
    annotate: bool = False,
    labels: Mapping[str, str] | None = None,
) -> None:
    """One bar per (group, schedule kind) of ``rows``' ``ratio``, groups along x (by ``row[key]``); a 1.0x line."""
    kinds = tuple(k for k in kinds if any(r["schedule"] == k for r in rows))
    width = 0.8 / max(len(kinds), 1)
    for i, kind in enumerate(kinds):
        ys = [next((r["ratio"] for r in rows if r["schedule"] == kind and r[key] == g), 0) for g in groups]
        xs = [j + (i - (len(kinds) - 1) / 2) * width for j in range(len(groups))]
        bars = ax.bar(xs, ys, width, label=(labels or {}).get(kind, kind), color=_COLORS.get(kind))
        if annotate:
            for b, y in zip(bars, ys):
                ax.annotate(f"{y:.1f}x", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(groups)), ticks, fontsize=7 if len(groups) > 8 else None)
    ax.set_ylabel("algbw / NCCL")
    ax.set_title(title)
    ax.legend(fontsize=8)


def plot_fig1(result: Mapping[str, Any], path: str | os.PathLike[str]) -> str:
    """Grouped bars of algbw ratio vs NCCL per NIC bandwidth, one panel per (collective, size) (MCCL Fig. 1)."""
    plt = _plt()
    rows = result["rows"]
    panels = sorted({(r["collective"], r["size_bytes"]) for r in rows})
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.2 * max(len(panels), 1), 3.4), squeeze=False)
    for ax, (coll, size) in zip(axes[0], panels):
        sel = [r for r in rows if r["collective"] == coll and r["size_bytes"] == size and r["schedule"] != "nccl"]
        bws = sorted({r["nic_gbps"] for r in sel}, reverse=True)
        kinds = ("orig", "reopt", "reopt_cold", "reopt_1chunk")
        ticks = [f"{bw:g}" for bw in bws]
        _ratio_bars(ax, sel, kinds, "nic_gbps", bws, ticks, f"{coll}, {_size_label(size)}", annotate=True)
        ax.set_xlabel("GPU 0 NIC bandwidth (Gbps)")
    fig.suptitle("MCCL Fig. 1 on jaxccl.sim (1x2x8)", fontsize=10)
    return _save(fig, path)


def plot_fig8(result: Mapping[str, Any], path: str | os.PathLike[str]) -> str:
    """Bars of algbw ratio vs NCCL per topology and failure, one panel per collective (MCCL Fig. 8)."""
    plt = _plt()
    rows = result["rows"]
    colls = sorted({r["collective"] for r in rows})
    fig, axes = plt.subplots(len(colls), 1, figsize=(11, 3.2 * max(len(colls), 1)), squeeze=False)
    for ax, coll in zip(axes[:, 0], colls):
        sel = [r for r in rows if r["collective"] == coll]
        groups = list(dict.fromkeys((r["hosts"], r["scenario"]) for r in sel))
        keyed = [{**r, "group": (r["hosts"], r["scenario"])} for r in sel]
        ticks = [f"{s}\n1x{h}x8" if s == "none" else s for h, s in groups]
        title = f"{coll}, {_size_label(result['config']['size_bytes'])} per source"
        _ratio_bars(ax, keyed, ("nccl", "orig", "reopt"), "group", groups, ticks, title, labels={"orig": "no reopt"})
    fig.suptitle("MCCL Fig. 8 on jaxccl.sim", fontsize=10)
    return _save(fig, path)


def plot_fig11(result: Mapping[str, Any], path: str | os.PathLike[str]) -> str:
    """Stacked compute/communication bars of NCCL vs jaxccl per cluster size; a panel per (workload, scenario)."""
    plt = _plt()
    rows = result["rows"]
    panels = []
    for r in rows:
        if (r["workload"], r["scenario"]) not in panels:
            panels.append((r["workload"], r["scenario"]))
    cols = len({s for _, s in panels}) or 1
    nrows = len({w for w, _ in panels}) or 1
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.2 * nrows), squeeze=False)
    workloads = sorted({w for w, _ in panels})
    scens = []
    for _, s in panels:
        if s not in scens:
            scens.append(s)
    for i, w in enumerate(workloads):
        for j, sc in enumerate(scens):
            ax = axes[i, j]
            sel = sorted((r for r in rows if r["workload"] == w and r["scenario"] == sc), key=lambda r: r["gpus"])
            xs = range(len(sel))
            for off, who, color in ((-0.2, "nccl", "#7f7f7f"), (0.2, "mccl", "#d62728")):
                comp = [r["compute_s"] for r in sel]
                comm = [r[f"comm_{who}_s"] for r in sel]
                ax.bar([x + off for x in xs], comp, 0.38, color="#c7c7c7", edgecolor=color)
                ax.bar(
                    [x + off for x in xs],
                    comm,
                    0.38,
                    bottom=comp,
                    color=color,
                    label=who if who == "nccl" else "jaxccl",
                )
            for x, r in zip(xs, sel):
                ax.annotate(f"{r['speedup']:.2f}x", (x, r["nccl_step_s"]), ha="center", va="bottom", fontsize=7)
            ax.set_xticks(list(xs), [str(r["gpus"]) for r in sel])
            ax.set_title(f"{w}, {sc}", fontsize=9)
            ax.set_xlabel("GPUs")
            ax.set_ylabel("time per batch (s)")
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.suptitle("MCCL Fig. 11 / App. E on jaxccl.sim (grey: compute)", fontsize=10)
    return _save(fig, path)


def plot_links(link_utilization: Mapping[Any, float], path: str | os.PathLike[str], *, title: str = "") -> str:
    """Per-link utilization bars (links sorted by utilization, the 60 busiest)."""
    plt = _plt()
    items = sorted(link_utilization.items(), key=lambda kv: -kv[1])[:60]
    fig, ax = plt.subplots(figsize=(10, 3.4))
    ax.bar(range(len(items)), [v for _, v in items], color="#1f77b4")
    ax.set_xticks(range(len(items)), [f"{u}->{v}" for (u, v), _ in items], rotation=90, fontsize=5)
    ax.set_ylabel("utilization")
    ax.set_ylim(0, 1.05)
    ax.set_title(title or "link utilization", fontsize=9)
    return _save(fig, path)
