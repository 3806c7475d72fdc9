"""``jaxccl bench --tune``: measured forced-arm pools for the tuner's replay (:mod:`jaxccl.tune.measured`).

Only the options: the fabric (``--topology``, a rail preset; default
``rail:2x4``), the sizes (``-b -e -f``), ``--samples``, ``--fabrics``,
``--collectives`` (``all_gather``, ``psum_scatter``, ``psum``; default all three),
``--time-scale``, ``-w`` (warm-up rounds) and ``--json`` (the pools file, in
:func:`jaxccl.tune.replay.load_pools`'s format). The device count is set from
the topology before JAX starts.

Example:
    >>> from jaxccl.cli import main
    >>> main(["bench", "--tune", "--fabrics", "healthy,fail9", "--json", "p.npz"])  # one line on stderr
    2
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jaxccl
from jaxccl.cli.args import UsageError, topology
from jaxccl.errors import TuneError
from jaxccl.topology import rail
from jaxccl.tune.measured import MeasureConfig, measure_pools, parse_fabrics, save_pools
from jaxccl.util import report

__all__ = ["DEFAULT_SAMPLES", "DEFAULT_TOPOLOGY", "add_arguments", "config_of", "run"]

DEFAULT_TOPOLOGY = "rail:2x4"
DEFAULT_SAMPLES = 40
DEFAULT_FABRICS = "healthy,fail1,fail2,fail3"
#: bench's collective names -> the tuner's (the collectives with an arm catalogue).
TUNED = {"all_gather": "all_gather", "psum_scatter": "reduce_scatter", "psum": "all_reduce"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--tune`` and the options only it reads."""
    p.add_argument(
        "--tune",
        action="store_true",
        help="record measured latency pools of every tuner arm (jaxccl.tune.arm_catalog) on the emulated fabrics "
        f"of --topology (a rail preset, default {DEFAULT_TOPOLOGY}) into --json PATH, for "
        "benchmarks/tune/replay.py --pools measured PATH",
    )
    p.add_argument(
        "--samples",
        type=int,
        metavar="N",
        help=f"--tune: measured calls per context and arm after the warm-up (default {DEFAULT_SAMPLES}; above 10)",
    )
    p.add_argument(
        "--fabrics",
        metavar="LIST",
        help=f"--tune: comma-separated fabrics to inject, from {DEFAULT_FABRICS} (default: all)",
    )


def _collectives(text: str | None) -> tuple[str, ...]:
    """``--collectives`` in bench's names (``all_gather,psum_scatter,psum``) as the tuner's (default: all three)."""
    if text is None:
        return tuple(TUNED.values())
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in TUNED]
    if bad or not names:
        raise UsageError(f"--tune --collectives: {bad or [text]} have no arm catalogue; choose from {', '.join(TUNED)}")
    return tuple(dict.fromkeys(TUNED[c] for c in names))


def config_of(args: argparse.Namespace, sizes: list[int]) -> MeasureConfig:
    """The checked :class:`MeasureConfig` of the command line (before JAX starts).

    Raises:
        UsageError: an option ``--tune`` does not take or a bad value.
    """
    if not args.json:
        raise UsageError("--tune writes a pools file: add --json PATH")
    for flag, value, default in (
        ("--backend", args.backend, "cpu"),
        ("--schedule", args.schedule, "direct"),
        ("--scenario", args.scenario, None),
        ("--processes", args.processes, None),
        ("--coordinator", args.coordinator, None),
    ):
        if value != default:
            raise UsageError(f"--tune measures every arm on the native cpu executor; it does not take {flag}")
    if args.samples is not None and args.samples < 1:
        raise UsageError(f"--samples must be a positive integer, got {args.samples}")
    topo = topology(args.topology or DEFAULT_TOPOLOGY)
    meta = topo.meta
    if meta.get("preset") != "rail" or meta.get("segments", 1) != 1:
        raise UsageError(f"--tune needs a one-segment rail preset (rail:HxN), got {topo.name or 'a custom topology'}")
    hosts, gpus = int(meta["hosts"]), int(meta["gpus_per_host"])
    if topo.fingerprint != rail(hosts=hosts, gpus_per_host=gpus).fingerprint:
        raise UsageError("--tune measures the preset rail fabric; custom link rates are not supported")
    if args.devices is not None and args.devices != hosts * gpus:
        raise UsageError(f"--devices {args.devices}: the rail {hosts}x{gpus} needs {hosts * gpus}")
    try:
        return MeasureConfig(
            collectives=_collectives(args.collectives),
            hosts=hosts,
            gpus_per_host=gpus,
            fabrics=parse_fabrics(args.fabrics or DEFAULT_FABRICS),
            sizes=tuple(sizes),
            samples=args.samples if args.samples is not None else DEFAULT_SAMPLES,
            warmup=args.warmup,
            time_scale=args.time_scale,
        )
    except TuneError as e:
        raise UsageError(f"--tune: {e}") from None


def run(args: argparse.Namespace, sizes: list[int]) -> int:
    """Measures the pools ``args`` describe, writes them to ``--json`` and prints each context's best arm."""
    cfg = config_of(args, sizes)
    try:
        jaxccl.emulate(cfg.num_ranks)
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    pools = measure_pools(cfg, show_progress=not args.quiet)
    save_pools(pools, args.json)
    meas: dict[str, Any] = pools.model["measurement"]
    rows = []
    for i, c in enumerate(pools.contexts):
        names = pools.arm_names(i)
        med = {n: float(pools.sim_s[i, pools.arms[c["collective"]].index(n)]) for n in names}
        best = min(med, key=med.__getitem__)
        rows.append(
            {
                "fabric": c["scenario"],
                "collective": c["collective"],
                "size": c["nbytes"],
                "split": c["split"],
                "best arm": best,
                "best us": med[best] / cfg.time_scale * 1e6,
                "worst/best": max(med.values()) / med[best],
            }
        )
    out = sys.stdout
    out.write(f"# jaxccl bench --tune: {meas['fabric']}\n")
    out.write(f"# {cfg.samples} samples per arm after {cfg.warmup} warm-up rounds; {meas['latency']}\n")
    out.write("# best us: median real launch time of the best arm; worst/best: the slowest arm's median over it\n")
    report.print_table(rows, stream=out)
    checks = meas["checks"]["bitwise_vs_jax_lax"]
    out.write(
        f"# bitwise equal to jax.lax: {sum(checks.values())} (context, arm) checks ({checks}); load average "
        f"{meas['load_average_before']} before, {meas['load_average_per_fabric'][-1]} after; "
        f"{meas['wall_s']:.0f} s; wrote {args.json}\n"
    )
    return 0
