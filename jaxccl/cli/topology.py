"""``jaxccl topology probe``: measure the fabric with jaxccl's own executor and write a topology JSON.

Every ordered pair of ranks is timed alone through the native executor (a schedule with one
send, :mod:`jaxccl.cli.topology_probe`): the rate of a large transfer and the latency of a small
one. The pairs become a topology by :mod:`jaxccl.cli.topology_infer`'s documented model (hosts,
a switch per host, one network switch, a NIC per host) that the synthesizers accept.

Where it measures:

- one process with ``--emulate SPEC``: the executor emulates the links of a known topology
  (``--time-scale``), so the probe can be checked against the capacities it was given;
- ``--processes P``: a job of P processes (``--devices`` ranks each) over jaxccl's transport,
  on loopback or (``--network netns``, root) one process per node of a network-namespace lab
  whose NICs ``--nic-rate-mbit`` shapes with ``tc`` (one rate for all, or one per process).
  Each process is a host.

Example:
    >>> from jaxccl.cli import main
    >>> main(["topology", "probe", "--emulate", "rail:2x2", "--small-bytes", "1M", "--large-bytes", "4K"])
    2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from typing import Any

from jaxccl.cli.args import UsageError, parse_size, positive_float, positive_int, topology
from jaxccl.cli.topology_infer import infer
from jaxccl.distributed import transport  # the module: tests replace its unavailable_reason
from jaxccl.distributed.launch import initialize_from_env, launch
from jaxccl.labs import netlab  # the module: tests replace its unavailable_reason
from jaxccl.labs.netlab import LinkShape, NetLab
from jaxccl.runtime.emulated import MIN_TIME_SCALE
from jaxccl.util import report

__all__ = ["NETWORKS", "register"]

NETWORKS = ("loopback", "netns")
DEFAULT_DEVICES = 8  # one process without --emulate
DEFAULT_JOB_TIMEOUT_S = 600.0
ENV_COORDINATOR = "JAXCCL_COORDINATOR"  # set by jaxccl.distributed.launch in every process of a job
# The options every process of a job gets as given (dest, flag); the launching ones stay with the launcher.
_VALUED = (
    ("devices", "--devices"),
    ("small_bytes", "--small-bytes"),
    ("large_bytes", "--large-bytes"),
    ("runs", "--runs"),
    ("network", "--network"),
    ("output", "--output"),
    ("pairs", "--pairs"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``probe`` to ``jaxccl topology``."""
    p = subparsers.add_parser(
        "probe",
        help="measure every GPU pair with jaxccl's executor and write a topology JSON",
        description=(
            "Times every ordered pair of ranks alone through the native executor (rate of a large transfer, "
            "latency of a small one; medians) and writes the topology they imply (hosts, a switch per host, one "
            "network switch, a NIC per host; see docs/guides/topologies.md) as JSON the synthesizers accept."
        ),
    )
    p.add_argument("--emulate", metavar="SPEC|FILE", help="one process: emulate this topology's links and probe them")
    p.add_argument("--time-scale", type=positive_float, help="with --emulate: emulated capacities x this (0.001)")
    p.add_argument(
        "--devices",
        type=positive_int,
        help=f"ranks per process (default: --emulate's GPUs; 1 per process of a job; else {DEFAULT_DEVICES})",
    )
    p.add_argument("--small-bytes", type=parse_size, default=4 << 10, metavar="SIZE", help="latency transfer (4K)")
    p.add_argument("--large-bytes", type=parse_size, default=1 << 20, metavar="SIZE", help="rate transfer (1M)")
    p.add_argument("--runs", type=positive_int, default=3, help="timed calls per pair and size; the fastest counts (3)")
    p.add_argument("--output", metavar="PATH", help="write the topology JSON here (default: stdout)")
    p.add_argument("--pairs", metavar="PATH", help="also write the measured pair table as JSON")
    p.add_argument("--processes", type=positive_int, metavar="P", help="start a job of P processes and probe across")
    p.add_argument(
        "--network",
        choices=NETWORKS,
        default="loopback",
        help="with --processes: loopback (default) or netns, one lab node per process (root), transport on TCP only",
    )
    p.add_argument(
        "--nic-rate-mbit",
        metavar="MBIT[,MBIT...]",
        help="with --network netns: shape the NICs with tc, one rate for all or one per process",
    )
    p.add_argument(
        "--job-timeout",
        type=positive_float,
        default=DEFAULT_JOB_TIMEOUT_S,
        metavar="S",
        help=f"with --processes: the whole job's deadline in seconds ({DEFAULT_JOB_TIMEOUT_S:g})",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_run)


def nic_rates(text: str | None, processes: int) -> list[float] | None:
    """``--nic-rate-mbit``: one rate per process (one given: the same for all).

    >>> nic_rates("40,80", 2), nic_rates("10", 3)
    ([40.0, 80.0], [10.0, 10.0, 10.0])
    """
    if text is None:
        return None
    rates = [positive_float(part) for part in text.split(",")]
    if len(rates) == 1:
        rates *= processes
    if len(rates) != processes:
        raise UsageError(f"--nic-rate-mbit {text!r}: give one rate or one per process ({processes})")
    return rates


def _check(args: argparse.Namespace, emulated: Any) -> None:
    if args.small_bytes < 4 or args.large_bytes <= args.small_bytes:
        raise UsageError(
            f"--small-bytes {args.small_bytes} and --large-bytes {args.large_bytes}: need 4 <= small < large"
        )
    if args.time_scale is not None:
        if emulated is None:
            raise UsageError("--time-scale scales emulated links: add --emulate")
        if not MIN_TIME_SCALE <= args.time_scale <= 1:
            raise UsageError(f"--time-scale must be in [{MIN_TIME_SCALE:g}, 1], got {args.time_scale:g}")
    if args.processes is None:
        if args.network != "loopback" or args.nic_rate_mbit is not None:
            raise UsageError("--network and --nic-rate-mbit are for a job: add --processes P")
        if emulated is not None and args.devices is not None and args.devices != emulated.num_gpus:
            raise UsageError(f"--emulate has {emulated.num_gpus} GPUs but --devices is {args.devices}")
        if (args.devices or (emulated.num_gpus if emulated is not None else DEFAULT_DEVICES)) < 2:
            raise UsageError("a probe needs at least 2 ranks")
        return
    if emulated is not None:
        raise UsageError("--emulate paces links inside one process; across processes (--processes) they are real")
    if args.processes < 2:
        raise UsageError(f"--processes {args.processes}: a job needs at least 2 processes")
    nic_rates(args.nic_rate_mbit, args.processes)
    if args.nic_rate_mbit is not None and args.network != "netns":
        raise UsageError("--nic-rate-mbit shapes the NICs of a netns lab: add --network netns")
    reason = transport.unavailable_reason()
    if reason is not None:
        raise UsageError(f"--processes: the probe runs on jaxccl's transport between processes: {reason}")
    if args.network == "netns" and (reason := netlab.unavailable_reason()) is not None:
        raise UsageError(f"--network netns: {reason}")


def _run(args: argparse.Namespace) -> int:
    if os.environ.get(ENV_COORDINATOR):
        return _worker(args)
    emulated = topology(args.emulate) if args.emulate is not None else None
    _check(args, emulated)
    if args.processes is not None:
        return _run_job(args)
    import jaxccl

    try:
        jaxccl.emulate(args.devices or (emulated.num_gpus if emulated is not None else DEFAULT_DEVICES))
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    return _probe(args, emulated, show_progress=not args.quiet)


def _probe(args: argparse.Namespace, emulated: Any, *, show_progress: bool, write: bool = True) -> int:
    """Measures (JAX started), infers and writes the topology (and the pairs) where the options say."""
    from jaxccl.cli.topology_probe import ProbeConfig, measure

    cfg = ProbeConfig(
        small_bytes=args.small_bytes,
        large_bytes=args.large_bytes,
        runs=args.runs,
        emulate=emulated,
        time_scale=args.time_scale if args.time_scale is not None else 1e-3,
        network_only=args.network == "netns",
        show_progress=show_progress,
    )
    table = measure(cfg)
    if not write:
        return 0
    where = f"emulated {emulated.name}" if emulated is not None else f"{args.network} across processes"
    topo = infer(table, name=f"probed ({where})")
    text = topo.to_json(indent=1) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
    if args.pairs is not None:
        report.write_json(args.pairs, {"command": "jaxccl topology probe", "ranks": table.num_ranks, **table.to_dict()})
    return 0


def _worker(args: argparse.Namespace) -> int:
    """One process of a job started by :func:`_run_job`: process 0 writes the results."""
    import jax

    me, _ = initialize_from_env(local_devices=args.devices or 1)
    try:
        return _probe(args, None, show_progress=False, write=me == 0)
    finally:
        jax.distributed.shutdown()


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The command every process of the job runs: this probe without the launching options.

    >>> ns = argparse.Namespace(devices=None, small_bytes=4096, large_bytes=1 << 20, runs=3, network="netns",
    ...     output="t.json", pairs=None)
    >>> " ".join(worker_argv(ns)[3:])
    'topology probe --quiet --small-bytes 4096 --large-bytes 1048576 --runs 3 --network netns --output t.json'
    """
    argv = [sys.executable, "-m", "jaxccl", "topology", "probe", "--quiet"]
    for dest, flag in _VALUED:
        value = getattr(args, dest)
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _run_job(args: argparse.Namespace) -> int:
    """Starts the job (in a lab with ``--network netns``), waits, and reports a failed process on stderr."""
    rates = nic_rates(args.nic_rate_mbit, args.processes)
    with contextlib.ExitStack() as stack:
        to_stdout = args.output is None
        if to_stdout:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxccl-probe-"))
            args = argparse.Namespace(**{**vars(args), "output": os.path.join(folder, "topology.json")})
        lab = None
        if args.network == "netns":
            shapes = {i: LinkShape(rate_mbit=r) for i, r in enumerate(rates)} if rates is not None else None
            lab = stack.enter_context(NetLab(args.processes, shapes))
        results = launch(worker_argv(args), args.processes, lab=lab, timeout_s=args.job_timeout)
        failed = [r for r in results if r.returncode != 0]
        for r in failed:
            last = next((line for line in reversed(r.output.splitlines()) if line.strip()), "no output")
            ended = (
                f"exit status {r.returncode}" if r.returncode is not None else f"killed after {args.job_timeout:g} s"
            )
            print(f"jaxccl topology probe: process {r.process_id} {ended}: {last.strip()}", file=sys.stderr)
        if failed:
            return 1
        if to_stdout:
            with open(args.output) as f:
                sys.stdout.write(f.read())
    return 0
