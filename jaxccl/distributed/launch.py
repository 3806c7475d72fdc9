"""Starting the processes of a multi-process JAX job on one machine: on loopback, or one per node of a lab.

:func:`launch` starts ``num_processes`` copies of a command as a JAX job's processes do (each
gets the coordinator address, the process count and its id in ``JAXCCL_COORDINATOR``,
``JAXCCL_NUM_PROCESSES`` and ``JAXCCL_PROCESS_ID``), waits for all of them with one deadline and
kills the rest when one misses it. With a :class:`~jaxccl.labs.netlab.NetLab`, process ``i`` runs in
node ``i``'s namespace and the coordinator listens on node 0's address, so every byte between
processes crosses the lab's shaped links. :func:`initialize_from_env` is the worker's side.

>>> coordinator_address(None, 1234)
'127.0.0.1:1234'
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxccl.devices import emulate
from jaxccl.errors import ArgumentError, DeadlineError

if TYPE_CHECKING:  # the launcher runs a process in a lab's namespace; labs sit above it and import it
    from jaxccl.labs.netlab import NetLab

LAB_COORDINATOR_PORT = 23456  # a fresh namespace has every port free


@dataclass
class ProcessResult:
    """How one process of a job ended: its id, exit code (``None``: killed at the deadline) and output."""

    process_id: int
    returncode: int | None
    output: str


def coordinator_address(lab: NetLab | None, port: int) -> str:
    """Where process 0 runs ``jax.distributed``'s coordinator."""
    return f"{lab.address(0) if lab is not None else '127.0.0.1'}:{port}"


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    argv: Sequence[str],
    num_processes: int,
    *,
    lab: NetLab | None = None,
    env: Mapping[str, str] | None = None,
) -> list[subprocess.Popen]:
    """Starts the job's processes (``argv`` each, output captured); see :func:`launch`."""
    if lab is not None and lab.num_nodes < num_processes:
        raise ArgumentError(f"a lab of {lab.num_nodes} nodes cannot hold {num_processes} processes")
    port = LAB_COORDINATOR_PORT if lab is not None else free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    base.update(env or {})
    base["JAXCCL_COORDINATOR"] = coordinator_address(lab, port)
    base["JAXCCL_NUM_PROCESSES"] = str(num_processes)
    procs = []
    for i in range(num_processes):
        penv = dict(base, JAXCCL_PROCESS_ID=str(i))
        kwargs = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=penv)
        procs.append(lab.popen(i, list(argv), **kwargs) if lab is not None else subprocess.Popen(list(argv), **kwargs))
    return procs


def collect(procs: Sequence[subprocess.Popen], timeout_s: float) -> list[ProcessResult]:
    """Waits for every process until one shared deadline; kills those still running then."""
    deadline = time.monotonic() + timeout_s
    results = []
    for i, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append(ProcessResult(i, p.returncode, out))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            results.append(ProcessResult(i, None, out))
    return results


def launch(
    argv: Sequence[str],
    num_processes: int,
    *,
    lab: NetLab | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    during: Callable[[list[subprocess.Popen]], None] | None = None,
) -> list[ProcessResult]:
    """Runs a job of ``num_processes`` processes of ``argv`` and returns how each ended.

    Args:
        argv: the command of every process (each reads its role from the environment).
        num_processes: how many processes.
        lab: run process ``i`` in node ``i`` of this open lab (else all on loopback).
        env: extra environment variables for every process.
        timeout_s: one deadline for the whole job; processes still running then are killed
            (their ``returncode`` is ``None``).
        during: called with the running processes (to cut a link or kill one), before the wait.
    """
    procs = start(argv, num_processes, lab=lab, env=env)
    try:
        if during is not None:
            during(procs)
        return collect(procs, timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def initialize_from_env(*, timeout_s: float = 60.0, local_devices: int | None = None) -> tuple[int, int]:
    """The worker's side of :func:`launch`: emulated devices, gloo, ``jax.distributed.initialize``.

    Returns ``(process_id, num_processes)``.

    Raises:
        DeadlineError: the job's variables are not set (not started by :func:`launch`).
    """
    try:
        address = os.environ["JAXCCL_COORDINATOR"]
        n, me = int(os.environ["JAXCCL_NUM_PROCESSES"]), int(os.environ["JAXCCL_PROCESS_ID"])
    except KeyError as e:
        raise DeadlineError(f"not a process of a jaxccl launch: {e} is not set") from e
    if local_devices is not None:
        emulate(local_devices)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes=n, process_id=me, initialization_timeout=int(timeout_s))
    return me, n
