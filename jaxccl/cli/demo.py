"""``jaxccl demo``: the closed loop (measurement, Algorithm 1, warm re-synthesis, hot-swap) on emulated devices."""

from __future__ import annotations

import argparse

from jaxccl.cli.args import UsageError, positive_float, positive_int, require_matplotlib
from jaxccl.demo import DemoConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``demo`` to ``jaxccl``."""
    p = subparsers.add_parser(
        "demo",
        help="the closed loop on 8 emulated CPU devices: a gray failure, detected and routed around",
        description=(
            "FSDP training of a small MLP on 8 emulated devices (rail fabric 2 hosts x 4 GPUs, emulated links); "
            "a gray failure halves GPU 0's NIC at --fail-step; jaxccl detects it, re-synthesizes the AllGather "
            "and hot-swaps it. Prints per-step progress, the reaction times and algbw before/after."
        ),
    )
    p.add_argument(
        "--steps", type=positive_int, default=DemoConfig.steps, help=f"training steps (default {DemoConfig.steps})"
    )
    p.add_argument(
        "--fail-step",
        type=positive_int,
        default=DemoConfig.fail_step,
        help=f"step at which the failure is injected (default {DemoConfig.fail_step})",
    )
    p.add_argument(
        "--time-scale",
        type=positive_float,
        default=DemoConfig.time_scale,
        help=f"emulated link capacities x this (default {DemoConfig.time_scale:g})",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--png", default=None, metavar="PATH", help="write the algbw timeline as PNG")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.steps < 4:
        raise UsageError(f"--steps must be at least 4, got {args.steps}")
    if not 0 < args.fail_step < args.steps - 2:
        raise UsageError(f"--fail-step must be in 1..{args.steps - 3} for --steps {args.steps}, got {args.fail_step}")
    if args.png:
        require_matplotlib()
    from jaxccl.demo import run

    cfg = DemoConfig(
        steps=args.steps,
        fail_step=args.fail_step,
        time_scale=args.time_scale,
        json=args.json,
        png=args.png,
        quiet=args.quiet,
    )
    result = run(cfg)
    if not result["loss_matches_reference"]:
        print("jaxccl demo: the loss curve differs from the jax.lax reference")
        return 1
    if result["swap_step"] is None:
        print("jaxccl demo: the controller never swapped in a new schedule")
        return 1
    return 0
