"""``jaxccl bench``: nccl-tests for jaxccl, every collective against ``jax.lax`` in the same run.

Sweeps sizes as nccl-tests' ``-b -e -f`` and prints, per collective, a row
per size: size, count, type, redop, time, algbw, busbw and ``#wrong`` of
jaxccl, then ``jax.lax``'s time and busbw and the ratio of the two times,
measured interleaved in the same run (:mod:`jaxccl.cli.bench_run`). jaxccl's
collectives are out-of-place only (they return new buffers; XLA owns
them), so there are no in-place columns. A summary closes the output:
average busbw, the worst ratio, the total ``#wrong`` (exit status 1 if not
0). ``--json PATH`` writes the same as data.

In a multi-process job (``--coordinator HOST:PORT --num-processes P
--process-id I``, or ``JAXCCL_COORDINATOR``, ``JAXCCL_NUM_PROCESSES``,
``JAXCCL_PROCESS_ID``) every process runs the same command over the devices
of all processes and process 0 prints. The ``ppermute`` backend runs across
processes through XLA; the native ``cpu`` backend through jaxccl's transport
(UCX, the ``multiprocess`` extra), bootstrapped and attached by the bench.
``--processes P`` starts such a job itself, on loopback or one process per
node of a network-namespace lab (:mod:`jaxccl.cli.bench_launch`).

Example:
    >>> from jaxccl.cli import main
    >>> main(["bench", "--collectives", "psum,bogus"])  # one line on stderr, exit status 2
    2
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import jaxccl
from jaxccl import topology as t
from jaxccl.cli import bench_launch, bench_memory, bench_tune
from jaxccl.cli.args import UsageError, parse_size, positive_float, positive_int, topology
from jaxccl.cli.bench_run import BenchConfig, run
from jaxccl.cli.bench_schedules import NAMES, load_file
from jaxccl.cli.bench_sweep import COLLECTIVES, DTYPES, SCHEDULE_COLLECTIVE, print_table, refusal, summary, sweep
from jaxccl.distributed import transport  # the module: tests replace its unavailable_reason
from jaxccl.runtime.emulated import MIN_TIME_SCALE
from jaxccl.util import report

__all__ = ["BACKENDS", "DTYPES", "register"]

BACKENDS = ("cpu", "cuda", "ppermute")
DEFAULT_DEVICES = 8
SCENARIOS = ("fail1", "fail2", "fail3")
ENV = {"coordinator": "JAXCCL_COORDINATOR", "num_processes": "JAXCCL_NUM_PROCESSES", "process_id": "JAXCCL_PROCESS_ID"}
INIT_TIMEOUT_S = 60
X64_DTYPES = ("float64", "int64", "uint64", "complex128")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``bench`` to ``jaxccl``."""
    p = subparsers.add_parser(
        "bench",
        help="nccl-tests for jaxccl: time, algbw, busbw and #wrong per size, beside jax.lax",
        description=(
            "Sweeps sizes (-b to -e, times -f) for each collective and prints nccl-tests' table for jaxccl with "
            "jax.lax's time and the ratio beside every row (interleaved, same run). size = bytes of one rank's "
            "larger buffer; busbw = algbw x (N-1)/N (all_gather, all_to_all, psum_scatter) or 2(N-1)/N (psum, pmax, "
            "pmin, pmean). "
            "#wrong = elements differing bitwise from jax.lax's result. Exit status 1 if any #wrong."
        ),
    )
    p.add_argument(
        "--collectives",
        metavar="LIST",
        help=f"comma-separated, from {', '.join(COLLECTIVES)} (default: all that take --dtype; with a schedule "
        "file, its collective)",
    )
    p.add_argument("-b", "--min-bytes", type=parse_size, default=4 << 10, metavar="SIZE", help="smallest size (4K)")
    p.add_argument("-e", "--max-bytes", type=parse_size, default=16 << 20, metavar="SIZE", help="largest size (16M)")
    p.add_argument("-f", "--step-factor", type=positive_int, default=4, metavar="F", help="size multiplier (4)")
    p.add_argument("-n", "--iters", type=positive_int, default=20, help="timed iterations per size (20)")
    p.add_argument("-w", "--warmup", type=_non_negative, default=5, help="warm-up iterations per size (5)")
    p.add_argument(
        "-d",
        "--dtype",
        choices=DTYPES,
        default="float32",
        metavar="TYPE",
        help=f"element type, one of {', '.join(DTYPES)} (float32; the 64-bit ones turn on JAX's x64 mode)",
    )
    p.add_argument("--backend", choices=BACKENDS, default="cpu", help="jaxccl's executor (cpu)")
    p.add_argument(
        "--schedule",
        default="direct",
        metavar="NAME|FILE",
        help="direct (default), ring, nccl, synth (for the topology and --scenario), static (for the healthy "
        "topology), or a schedule JSON / MSCCL XML file",
    )
    p.add_argument(
        "--topology",
        metavar="SPEC|FILE",
        help="rail:SxHxN, rail:HxN, single:N, ring:N, fattree:LxG or a topology JSON file "
        "(default single:N where a topology is needed)",
    )
    p.add_argument("--emulate-links", action="store_true", help="pace transfers at the topology's link capacities")
    p.add_argument("--time-scale", type=positive_float, default=1e-3, help="emulated capacities x this (default 0.001)")
    p.add_argument(
        "--scenario",
        metavar="NAME|U,V,GBPS",
        help="inject fail1, fail2, fail3, or the link U-V degraded to GBPS (e.g. 0,tor:s0r0,50) into the "
        "emulated links (needs --emulate-links)",
    )
    p.add_argument(
        "--no-validate",
        action="store_true",
        help="skip the reference interpreter on --schedule (for testing the checker: #wrong must catch it)",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--devices", type=positive_int, help=f"emulated CPU devices per process (default {DEFAULT_DEVICES})")
    p.add_argument(
        "--coordinator", metavar="HOST:PORT", help=f"multi-process job: the coordinator (${ENV['coordinator']})"
    )
    p.add_argument("--num-processes", type=positive_int, help=f"multi-process job: processes (${ENV['num_processes']})")
    p.add_argument("--process-id", type=_non_negative, help=f"multi-process job: this process (${ENV['process_id']})")
    p.add_argument(
        "--network",
        choices=bench_launch.NETWORKS,
        default="loopback",
        help="across processes: loopback (default), or netns: a network-namespace lab, one node per process "
        "(root), the transport on TCP only so every byte crosses the lab's links",
    )
    bench_launch.add_arguments(p)
    bench_tune.add_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_run)


def _non_negative(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return positive_int(text)
    except UsageError:
        raise UsageError(f"expected a non-negative integer, got {text!r}") from None


def _collectives(text: str) -> tuple[str, ...]:
    names = tuple(c.strip() for c in text.split(",") if c.strip())
    for c in names:
        if c not in COLLECTIVES:
            raise UsageError(f"--collectives: unknown collective {c!r}; choose from {', '.join(COLLECTIVES)}")
    if not names:
        raise UsageError("--collectives: give at least one collective")
    return tuple(dict.fromkeys(names))


def _node(text: str) -> Any:
    return int(text) if text.strip().isdigit() else text.strip()


def _scenario(spec: str | None) -> Callable[[Any], Any] | None:
    """``--scenario`` as a function healthy topology -> degraded topology."""
    if spec is None:
        return None

    if spec in SCENARIOS:
        return lambda topo: t.scenario(topo, spec)
    parts = spec.split(",")
    try:
        gbps = float(parts[2]) if len(parts) == 3 else float("nan")
    except ValueError:
        gbps = float("nan")
    if not gbps > 0 or gbps == float("inf"):
        raise UsageError(f"--scenario {spec!r}: expected {', '.join(SCENARIOS)} or U,V,GBPS (e.g. 0,tor:s0r0,50)")
    u, v = _node(parts[0]), _node(parts[1])

    def degrade(topo: Any) -> Any:
        if not topo.has_edge(u, v):
            raise UsageError(f"--scenario {spec!r}: the topology has no link {u!r} -> {v!r}")
        return topo.degrade(u, v, gbps=gbps)

    return degrade


def _processes(args: argparse.Namespace) -> tuple[str | None, int, int]:
    """(coordinator, processes, this process) from the options or the environment; (None, 1, 0) alone."""
    coordinator = args.coordinator or os.environ.get(ENV["coordinator"])
    count, pid = args.num_processes, args.process_id
    if count is None and os.environ.get(ENV["num_processes"]):
        count = positive_int(os.environ[ENV["num_processes"]])
    if pid is None and os.environ.get(ENV["process_id"]):
        pid = _non_negative(os.environ[ENV["process_id"]])
    if coordinator is None and count is None and pid is None:
        return None, 1, 0
    if coordinator is None or count is None or pid is None:
        raise UsageError("a multi-process job needs --coordinator, --num-processes and --process-id (or JAXCCL_*)")
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--coordinator {coordinator!r}: expected HOST:PORT")
    if pid >= count:
        raise UsageError(f"--process-id {pid} is not below --num-processes {count}")
    return coordinator, count, pid


def _check(args: argparse.Namespace, processes: int) -> None:
    if processes > 1:
        _check_across_processes(args)
    if args.emulate_links and args.backend != "cpu":
        raise UsageError(f"--emulate-links needs --backend cpu, not {args.backend}")
    if args.scenario is not None and not args.emulate_links:
        raise UsageError("--scenario is injected into the emulated links: add --emulate-links")
    if not MIN_TIME_SCALE <= args.time_scale <= 1:
        raise UsageError(f"--time-scale must be in [{MIN_TIME_SCALE:g}, 1], got {args.time_scale:g}")
    if args.backend == "cuda":
        if args.devices is not None:
            raise UsageError("--devices emulates CPU devices; --backend cuda runs on the GPUs it finds")
        if not jaxccl.has_cuda_support():
            raise UsageError("--backend cuda: jaxccl was built without CUDA or no CUDA device is visible")
    if args.no_validate and args.schedule in NAMES:
        raise UsageError("--no-validate applies to a schedule file (--schedule PATH)")


def _check_across_processes(args: argparse.Namespace) -> None:
    if args.backend == "cuda":
        raise UsageError("--backend cuda runs in one process; use --backend cpu or ppermute across processes")
    if args.emulate_links:
        raise UsageError("--emulate-links paces links inside one process; across processes the links are real")
    if args.backend == "cpu":
        reason = transport.unavailable_reason()
        if reason is not None:
            raise UsageError(f"--backend cpu across processes: {reason}")


def _collectives_of(args: argparse.Namespace) -> tuple[str, ...]:
    """``--collectives``, each taking ``--dtype``; by default all that take it, or a schedule file's collective."""
    if args.schedule in NAMES:
        if args.collectives is None:
            return tuple(c for c in COLLECTIVES if refusal(c, args.dtype) is None)
        chosen = _collectives(args.collectives)
    else:
        collective, _ = load_file(args.schedule)  # fails early, before JAX starts, on a bad file
        chosen = _collectives(args.collectives) if args.collectives is not None else (collective,)
        if SCHEDULE_COLLECTIVE[collective] not in {SCHEDULE_COLLECTIVE[c] for c in chosen}:
            raise UsageError(f"--schedule {args.schedule!r} implements {collective}, which --collectives leaves out")
    for c in chosen:
        if (why := refusal(c, args.dtype)) is not None:
            raise UsageError(f"--dtype {args.dtype}: {why}; leave {c} out of --collectives")
    return chosen


def _check_memory(
    args: argparse.Namespace, collectives: tuple[str, ...], sizes: list[int], processes: int, processes_here: int = 1
) -> None:
    """Refuses, before JAX starts, device counts and sizes this machine cannot hold (:mod:`.bench_memory`).

    The ``cuda`` backend keeps its buffers in GPU memory, whose size is not known before JAX starts: not checked.
    """
    if args.backend == "cuda":
        return
    devices = args.devices or DEFAULT_DEVICES
    bench_memory.check_devices(devices)
    bench_memory.check_memory(
        collectives,
        sizes,
        args.dtype,
        local_devices=devices,
        num_ranks=devices * processes,
        processes_here=processes_here,
    )


def _start_jax(args: argparse.Namespace, coordinator: str | None, processes: int, pid: int) -> None:
    if args.backend != "cuda":
        try:
            jaxccl.emulate(args.devices or DEFAULT_DEVICES)
        except RuntimeError as e:
            raise UsageError(str(e)) from None
    if coordinator is None:
        return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator, num_processes=processes, process_id=pid, initialization_timeout=INIT_TIMEOUT_S
    )


def _header(cfg: Any, bench: Any, processes: int) -> list[str]:
    topo = bench.topology
    links = "not emulated"
    if cfg.emulate_links:
        links = f"emulated at time scale {cfg.time_scale:g}" + (" with --scenario injected" if cfg.scenario else "")
    return [
        f"# jaxccl bench: {bench.num_ranks} devices in {processes} process(es), backend {cfg.backend}, "
        f"dtype {cfg.dtype}, {cfg.iters} iterations after {cfg.warmup} warm-up",
        f"# topology {topo.name if topo is not None else 'none'}; links {links}",
        "# out-of-place only: jaxccl's collectives return new buffers (XLA owns them), no in-place columns",
        "# each iteration runs jaxccl and jax.lax in alternating order; times are medians; "
        "ratio = jaxccl time / jax.lax time",
        "# #wrong: elements of one more call differing bitwise from jax.lax's result",
    ]


def _run(args: argparse.Namespace) -> int:
    collectives = _collectives_of(args)
    try:
        sizes = sweep(args.min_bytes, args.max_bytes, args.step_factor)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.tune:
        return bench_tune.run(args, sizes)
    topo = topology(args.topology) if args.topology is not None else None
    if args.processes is not None:
        _check(args, args.processes)
        _scenario(args.scenario)
        _check_memory(args, collectives, sizes, args.processes, processes_here=args.processes)
        return bench_launch.run_job(args)
    coordinator, processes, pid = _processes(args)
    _check(args, processes)
    if args.network == "netns" and processes == 1:
        raise UsageError("--network netns is for a job of several processes: add --processes P")
    scenario = _scenario(args.scenario)
    _check_memory(args, collectives, sizes, processes)
    _start_jax(args, coordinator, processes, pid)
    import jax

    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", x64 or args.dtype in X64_DTYPES)
    try:
        return _bench(args, collectives, sizes, topo, scenario, processes, pid)
    finally:
        jax.config.update("jax_enable_x64", x64)
        if coordinator is not None:
            jax.distributed.shutdown()


def _bench(
    args: argparse.Namespace,
    collectives: tuple[str, ...],
    sizes: list[int],
    topo: Any,
    scenario: Callable[[Any], Any] | None,
    processes: int,
    pid: int,
) -> int:
    cfg = BenchConfig(
        collectives=collectives,
        sizes=tuple(sizes),
        iters=args.iters,
        warmup=args.warmup,
        dtype=args.dtype,
        backend=args.backend,
        schedule=args.schedule,
        topology=topo,
        scenario=scenario,
        emulate_links=args.emulate_links,
        time_scale=args.time_scale,
        validate=not args.no_validate,
        show_progress=pid == 0 and not args.quiet,
        network_only=args.network == "netns",
    )
    bench, rows = run(cfg)
    result = summary(rows)
    if pid != 0:
        return 1 if result["total_wrong"] else 0
    out = sys.stdout
    for line in _header(cfg, bench, processes):
        out.write(line + "\n")
    for c in collectives:
        heading = [f"{bench.num_ranks} ranks", f"schedule {bench.schedule_names[c]}"]
        print_table(c, heading, [r for r in rows if r["collective"] == c], out)
    if bench.skipped:
        out.write(f"# skipped (smaller than one element per rank): {bench.skipped}\n")
    out.write(f"# Out of bounds values : {result['total_wrong']} {'OK' if not result['total_wrong'] else 'FAILED'}\n")
    out.write(f"# Avg bus bandwidth    : {result['avg_busbw_GBs']:.4g} GB/s\n")
    if result["worst_at"] is not None:
        c, s = result["worst_at"]
        out.write(f"# Worst jaxccl/jax.lax : {result['worst_ratio']:.2f} ({c}, {s} B)\n")
    if args.json:
        report.write_json(
            args.json,
            {
                "command": "jaxccl bench",
                "num_devices": bench.num_ranks,
                "num_processes": processes,
                "backend": cfg.backend,
                "dtype": cfg.dtype,
                "iters": cfg.iters,
                "warmup": cfg.warmup,
                "interleaved": True,
                "in_place": False,
                "topology": bench.topology.name if bench.topology is not None else None,
                "emulate_links": cfg.emulate_links,
                "time_scale": cfg.time_scale if cfg.emulate_links else None,
                "scenario": args.scenario,
                "schedules": bench.schedule_names,
                "validated": cfg.validate,
                "rows": rows,
                "skipped": [list(p) for p in bench.skipped],
                "summary": result,
            },
        )
    return 1 if result["total_wrong"] else 0
