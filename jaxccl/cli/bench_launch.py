"""``jaxccl bench --processes P``: the bench starts its own multi-process job and prints process 0's table.

The P processes run the same ``jaxccl bench`` command (every option but the
launching ones, plus ``--quiet``), started by
:func:`jaxccl.distributed.launch.launch`: on loopback, or with
``--network netns`` one process per node of a :class:`~jaxccl.labs.netlab.NetLab`
(root; ``--nic-rate-mbit`` shapes every node's NIC), so every byte between
processes crosses the lab's links. Each process learns its role from the
launcher's ``JAXCCL_*`` variables; one deadline (``--job-timeout``) covers
the whole job.

Example:
    >>> import argparse
    >>> ns = argparse.Namespace(collectives="psum", min_bytes=4096, max_bytes=4096, step_factor=4, iters=2,
    ...     warmup=1, dtype="float32", backend="cpu", schedule="direct", topology=None, emulate_links=False,
    ...     time_scale=1e-3, scenario=None, no_validate=False, json=None, devices=2, network="loopback")
    >>> " ".join(worker_argv(ns)[3:])
    'bench --quiet --collectives psum -b 4096 -e 4096 -f 4 -n 2 -w 1 -d float32 --backend cpu --schedule direct \
--time-scale 0.001 --devices 2 --network loopback'
"""

from __future__ import annotations

import argparse
import sys

from jaxccl.cli.args import UsageError, positive_float, positive_int
from jaxccl.distributed.launch import launch
from jaxccl.labs import netlab  # the module: tests replace its unavailable_reason
from jaxccl.labs.netlab import LinkShape, NetLab

__all__ = ["NETWORKS", "add_arguments", "run_job", "worker_argv"]

NETWORKS = ("loopback", "netns")
DEFAULT_JOB_TIMEOUT_S = 1800.0
HEADER_START = "# jaxccl bench:"  # the first line the bench prints (jaxccl.cli.bench)
# The options every process of the job gets as given (dest, flag); the launching ones stay here.
_VALUED = (
    ("collectives", "--collectives"),
    ("min_bytes", "-b"),
    ("max_bytes", "-e"),
    ("step_factor", "-f"),
    ("iters", "-n"),
    ("warmup", "-w"),
    ("dtype", "-d"),
    ("backend", "--backend"),
    ("schedule", "--schedule"),
    ("topology", "--topology"),
    ("time_scale", "--time-scale"),
    ("scenario", "--scenario"),
    ("json", "--json"),
    ("devices", "--devices"),
    ("network", "--network"),
)
_FLAGS = (("emulate_links", "--emulate-links"), ("no_validate", "--no-validate"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--processes``, ``--nic-rate-mbit`` and ``--job-timeout`` (``--network`` is the bench's own)."""
    p.add_argument(
        "--processes",
        type=positive_int,
        metavar="P",
        help="start a job of P processes (each with --devices devices) running this command; print process 0's",
    )
    p.add_argument(
        "--nic-rate-mbit",
        type=positive_float,
        metavar="MBIT",
        help="with --processes and --network netns: shape every node's NIC to this rate (both ways)",
    )
    p.add_argument(
        "--job-timeout",
        type=positive_float,
        default=DEFAULT_JOB_TIMEOUT_S,
        metavar="S",
        help=f"with --processes: the whole job's deadline in seconds ({DEFAULT_JOB_TIMEOUT_S:g})",
    )


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The command every process of the job runs: this bench without the launching options."""
    argv = [sys.executable, "-m", "jaxccl", "bench", "--quiet"]
    for dest, flag in _VALUED:
        value = getattr(args, dest)
        if value is not None:
            argv += [flag, str(value)]
    return argv + [flag for dest, flag in _FLAGS if getattr(args, dest)]


def _check(args: argparse.Namespace) -> None:
    if args.processes < 2:
        raise UsageError(f"--processes {args.processes}: a job needs at least 2 processes")
    if args.coordinator is not None or args.num_processes is not None or args.process_id is not None:
        raise UsageError("--processes starts the job itself: leave out --coordinator, --num-processes, --process-id")
    if args.nic_rate_mbit is not None and args.network != "netns":
        raise UsageError("--nic-rate-mbit shapes the NICs of a netns lab: add --network netns")
    if args.network == "netns":
        reason = netlab.unavailable_reason()
        if reason is not None:
            raise UsageError(f"--network netns: {reason}")


def _table(output: str) -> str:
    r"""Process 0's output from the bench's header on (the libraries' log lines before it left out).

    >>> _table("[Gloo] Rank 0 is connected to 7 peer ranks\n# jaxccl bench: 8 devices\n...\n")
    '# jaxccl bench: 8 devices\n...\n'
    """
    start = output.find(HEADER_START)
    return output[start:] if start >= 0 else output


def run_job(args: argparse.Namespace) -> int:
    """Runs the job, writes process 0's output to stdout; a failed process is one line on stderr each.

    Returns process 0's exit status when every process ended, else 1 (a process killed at the
    deadline or failed while process 0 did not).
    """
    import contextlib

    _check(args)
    with contextlib.ExitStack() as stack:
        lab = None
        if args.network == "netns":
            shape = LinkShape(rate_mbit=args.nic_rate_mbit) if args.nic_rate_mbit is not None else None
            lab = stack.enter_context(NetLab(args.processes, shape))
        results = launch(worker_argv(args), args.processes, lab=lab, timeout_s=args.job_timeout)
    status = results[0].returncode
    sys.stdout.write(_table(results[0].output) if status in (0, 1) else results[0].output)
    sys.stdout.flush()
    for r in results:
        if r.returncode not in (0, status) or r.returncode is None:
            last = next((line for line in reversed(r.output.splitlines()) if line.strip()), "no output")
            ended = (
                f"exit status {r.returncode}" if r.returncode is not None else f"killed after {args.job_timeout:g} s"
            )
            print(f"jaxccl bench: process {r.process_id} {ended}: {last.strip()}", file=sys.stderr)
    if any(r.returncode is None for r in results) or (status == 0 and any(r.returncode for r in results)):
        return 1
    return status
