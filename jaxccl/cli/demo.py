"""``jaxccl demo``: the closed loop (measurement, Algorithm 1, warm re-synthesis, hot-swap) on emulated devices."""

from __future__ import annotations

import argparse

from jaxccl.cli.args import UsageError, positive_float, positive_int, require_matplotlib
from jaxccl.demos import closed_loop, network
from jaxccl.demos.closed_loop import DETECTORS, FAIL_LINKS, DemoConfig, check_depth
from jaxccl.demos.network import NETWORKS, NetworkDemoConfig
from jaxccl.demos.network_layout import DemoNetworkError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``demo`` to ``jaxccl``."""
    p = subparsers.add_parser(
        "demo",
        help="the closed loop on 8 emulated CPU devices: a gray failure, detected and routed around",
        description=(
            "FSDP training of a small MLP on 8 emulated devices (rail fabric 2 hosts x 4 GPUs, emulated links); "
            "a gray failure cuts a link (--fail-link, default GPU 0's NIC) to --depth of its capacity at "
            "--fail-step; jaxccl detects it (--detector), re-synthesizes the AllGather and hot-swaps it. Prints "
            "per-step progress, the reaction times and algbw before/after."
        ),
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help=f"training steps (default {DemoConfig.steps}; {NetworkDemoConfig.steps} with --network)",
    )
    p.add_argument(
        "--fail-step",
        type=positive_int,
        default=None,
        help=(
            f"step at which the failure is injected (default {DemoConfig.fail_step}; "
            f"{NetworkDemoConfig.fail_step} with --network)"
        ),
    )
    p.add_argument(
        "--time-scale",
        type=positive_float,
        default=DemoConfig.time_scale,
        help=f"emulated link capacities x this (default {DemoConfig.time_scale:g})",
    )
    p.add_argument(
        "--detector",
        choices=DETECTORS,
        default=DemoConfig.detector,
        help=(
            f"how the controller decides (default {DemoConfig.detector}): cusum = a change-point test on the raw "
            "measurement windows, ewma = wait until the EWMA has settled (the old controller)"
        ),
    )
    p.add_argument(
        "--fail-link",
        choices=FAIL_LINKS,
        default=None,
        help=(
            f"without --network: the failed link(s) (default {DemoConfig.fail_link}): nic = GPU 0's NIC, "
            "nvlink = GPU 0's NVLink to its NVSwitch, two = the NICs of GPU 0 and GPU 5"
        ),
    )
    p.add_argument(
        "--depth",
        type=_depth,
        default=None,
        help=(
            "without --network: the failed links' capacity after the failure as a fraction of nominal, "
            f"in (0, 1) (default {DemoConfig.depth:g})"
        ),
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--png", default=None, metavar="PATH", help="write the algbw timeline as PNG")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    p.add_argument(
        "--network",
        choices=NETWORKS,
        default=None,
        help=(
            "run across processes on real sockets: netns (root: a network namespace and a tc-shaped NIC per "
            "process, one NIC cut live) or loopback (no NIC to cut); uses jaxccl's UCX transport"
        ),
    )
    p.add_argument(
        "--processes",
        type=positive_int,
        default=None,
        help="with --network loopback: 2 (one per host, the default) or 8 (one per rank); netns runs 8",
    )
    p.add_argument(
        "--groups",
        type=positive_int,
        default=None,
        help=(
            "with --network: devices per rank (default 1); each is a data group of the 8 ranks, so every NIC "
            "carries a rank of every group (8 x GROUPS devices, one schedule for all groups)"
        ),
    )
    p.add_argument(
        "--nic-rate-mbit",
        type=positive_float,
        default=NetworkDemoConfig.nic_rate_mbit,
        help=f"with --network netns: every NIC's rate (default {NetworkDemoConfig.nic_rate_mbit:g})",
    )
    p.add_argument(
        "--cut-rate-mbit",
        type=positive_float,
        default=NetworkDemoConfig.cut_rate_mbit,
        help=f"with --network netns: rank 1's NIC after the cut (default {NetworkDemoConfig.cut_rate_mbit:g})",
    )
    p.add_argument(
        "--job-timeout",
        type=positive_float,
        default=NetworkDemoConfig.job_timeout_s,
        help=f"with --network: the whole job's deadline in seconds (default {NetworkDemoConfig.job_timeout_s:g})",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    base = NetworkDemoConfig if args.network else DemoConfig
    args.steps = base.steps if args.steps is None else args.steps
    args.fail_step = base.fail_step if args.fail_step is None else args.fail_step
    for flag, value in (("--processes", args.processes), ("--groups", args.groups)):
        if args.network is None and value is not None:
            raise UsageError(f"{flag} needs --network netns or --network loopback")
    for flag, value in (("--fail-link", args.fail_link), ("--depth", args.depth)):
        if args.network and value is not None:
            raise UsageError(f"{flag} applies to the single-process demo only, not with --network")
    if args.steps < 4:
        raise UsageError(f"--steps must be at least 4, got {args.steps}")
    if not 0 < args.fail_step < args.steps - 2:
        raise UsageError(f"--fail-step must be in 1..{args.steps - 3} for --steps {args.steps}, got {args.fail_step}")
    if args.png:
        require_matplotlib()
    if args.network:
        return _run_network(args)
    cfg = DemoConfig(
        steps=args.steps,
        fail_step=args.fail_step,
        time_scale=args.time_scale,
        detector=args.detector,
        fail_link=args.fail_link or DemoConfig.fail_link,
        depth=DemoConfig.depth if args.depth is None else args.depth,
        json=args.json,
        png=args.png,
        quiet=args.quiet,
    )
    result = closed_loop.run(cfg)
    if not result["loss_matches_reference"]:
        print("jaxccl demo: the loss curve differs from the jax.lax reference")
        return 1
    if result["swap_step"] is None:
        print("jaxccl demo: the controller never swapped in a new schedule")
        return 1
    return 0


def _depth(text: str) -> float:
    """``--depth``: a fraction in (0, 1)."""
    return check_depth(positive_float(text), "the depth", UsageError)


def _run_network(args: argparse.Namespace) -> int:
    cfg = NetworkDemoConfig(
        steps=args.steps,
        fail_step=args.fail_step,
        json=args.json,
        png=args.png,
        quiet=args.quiet,
        network=args.network,
        processes=args.processes,
        nic_rate_mbit=args.nic_rate_mbit,
        cut_rate_mbit=args.cut_rate_mbit,
        job_timeout_s=args.job_timeout,
        detector=args.detector,
        groups=args.groups or 1,
    )
    try:
        network.check(cfg)
    except DemoNetworkError as e:
        raise UsageError(str(e)) from e
    result = network.run(cfg)
    if not result["loss_matches_reference"]:
        print("jaxccl demo: the loss curve differs from the jax.lax reference")
        return 1
    if args.network == "netns" and result["swap_step"] is None:
        print("jaxccl demo: the loop never swapped in a schedule around the cut NIC")
        return 1
    return 0
