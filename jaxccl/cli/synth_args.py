"""What ``jaxccl synth allgather`` and ``jaxccl synth alltoall`` share: the topology options and the mode.

Both commands synthesize one schedule by default, for ``--topology`` or for
the rail ``1 x --hosts x --gpus-per-host`` (default ``1 x 2 x 8``), and run
their benchmark only with ``--benchmark``. ``--hosts`` means the same in both:
the hosts of rail topologies ``1 x H x N``, one value for a synthesis, a list
(``2 4 8`` or ``2,4,8``, as ``jaxccl sim fig8 --hosts``) for the benchmark. Earlier spellings that ran the benchmark
without ``--benchmark`` still do, with a deprecation message on stderr.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> add_topology_arguments(p)
    >>> args = p.parse_args(["--hosts", "4", "--scenario", "fail2"])
    >>> single_topology(args).num_gpus
    32
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jaxccl.cli.args import HostCountsAction, UsageError, host_counts, positive_int, topology
from jaxccl.cli.text import plain
from jaxccl.schedule import Schedule
from jaxccl.topology import rail, scenario
from jaxccl.util import report

__all__ = ["add_mode_arguments", "add_topology_arguments", "single_topology", "wants_benchmark"]

DEFAULT_HOSTS = 2
DEFAULT_GPUS_PER_HOST = 8


def add_topology_arguments(p: argparse.ArgumentParser) -> None:
    """``--topology``, ``--hosts``, ``--gpus-per-host``, ``--scenario``: the topology of one synthesis."""
    p.add_argument(
        "--topology",
        type=topology,
        metavar="SPEC|FILE",
        help="rail:SxHxN, rail:HxN, single:N, ring:N, fattree:LxG or a topology JSON file "
        "(default: the rail 1 x --hosts x --gpus-per-host)",
    )
    p.add_argument(
        "--hosts",
        type=host_counts,
        nargs="+",
        action=HostCountsAction,
        metavar="H",
        help=f"hosts of the rail 1 x H x --gpus-per-host: one value to synthesize (default {DEFAULT_HOSTS}), "
        "several (2 4 8 or 2,4,8) with --benchmark",
    )
    p.add_argument(
        "--gpus-per-host",
        type=positive_int,
        default=DEFAULT_GPUS_PER_HOST,
        help=f"GPUs per host of the rail (default {DEFAULT_GPUS_PER_HOST})",
    )
    p.add_argument("--scenario", choices=("fail1", "fail2", "fail3"), help="apply an MCCL failure scenario")


def add_mode_arguments(p: argparse.ArgumentParser) -> None:
    """``--benchmark`` and the output options of one synthesis."""
    p.add_argument("--benchmark", action="store_true", help="run the synthesizer's benchmark (minutes) instead")
    p.add_argument("--previous", metavar="FILE", help="warm start from this schedule JSON")
    p.add_argument("--out", metavar="PATH", help="write the schedule JSON here")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


def single_topology(args: argparse.Namespace) -> Any:
    """The topology of one synthesis: ``--topology``, else the rail ``1 x --hosts x --gpus-per-host``.

    Raises:
        UsageError: several ``--hosts``, or ``--hosts`` together with ``--topology``.
    """
    hosts = args.hosts or (DEFAULT_HOSTS,)
    if len(hosts) != 1:
        raise UsageError(f"--hosts {','.join(map(str, hosts))}: one synthesis takes one host count")
    if args.topology is not None:
        if args.hosts:
            raise UsageError("give --topology or --hosts, not both")
        topo = args.topology
    else:
        topo = rail(hosts=hosts[0], gpus_per_host=args.gpus_per_host, max_hosts_per_segment=None)
    return scenario(topo, args.scenario) if args.scenario else topo


def previous_schedule(args: argparse.Namespace) -> Schedule | None:
    """The schedule of ``--previous`` (a warm start), or None."""
    if not args.previous:
        return None
    with open(args.previous) as f:
        return Schedule.from_json(f.read())


def finish_benchmark(args: argparse.Namespace, rows: list[dict], columns: Sequence[Any], lines: list[str]) -> int:
    """Prints a benchmark's table and acceptance lines, writes ``--json``; the command's exit code."""
    report.print_table(rows, columns)
    print("\n".join(lines))
    if args.json:
        report.write_json(args.json, {"rows": rows, "acceptance": lines})
        print(f"wrote {args.json}")
    return 0


def register_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    summary: str,
    doc: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    main: Callable[[argparse.Namespace], int],
) -> None:
    """Adds ``jaxccl synth <name>``, described by the command module's docstring ``doc``."""
    p = subparsers.add_parser(
        name, help=summary, description=plain(doc), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    p.set_defaults(func=main)


def run_benchmark_script(
    doc: str, add_arguments: Callable[[argparse.ArgumentParser], None], main: Callable[[argparse.Namespace], int]
) -> int:
    """A command module run as a script: its benchmark (what ``benchmarks/synth/*.py`` do)."""
    ap = argparse.ArgumentParser(description=plain(doc.splitlines()[0]))
    add_arguments(ap)
    ap.set_defaults(benchmark=True)
    return main(ap.parse_args())


def wants_benchmark(args: argparse.Namespace, command: str, benchmark_options: Sequence[str]) -> bool:
    """Whether to run the benchmark: ``--benchmark``, or (deprecated) a spelling that used to imply it.

    Before ``--benchmark`` existed, a list of ``--hosts`` (allgather) or any
    benchmark-only option without ``--topology``/``--hosts`` ran the benchmark;
    they still do, with a deprecation message, unless an option of one
    synthesis (``--topology``, ``--scenario``, ``--previous``, ``--out``) says otherwise.
    """
    if args.benchmark:
        return True
    if args.topology is not None or args.scenario or args.previous or args.out:
        return False  # one synthesis was asked for
    old = []
    if args.hosts is not None and len(args.hosts) > 1:
        old.append("--hosts H,H,...")
    if args.hosts is None or len(args.hosts) > 1:
        old += [f"--{name.replace('_', '-')}" for name in benchmark_options if getattr(args, name) is not None]
    if not old:
        return False
    print(
        f"{command}: {', '.join(old)} without --benchmark is deprecated; running the benchmark "
        f"(add --benchmark to keep doing so)",
        file=sys.stderr,
    )
    return True
