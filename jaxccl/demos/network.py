"""``jaxccl demo --network netns|loopback``: the closed loop across processes on real sockets.

The single-process demo (:mod:`jaxccl.demos.closed_loop`) on real links: 8 ranks (2 emulated hosts x 4) in
separate JAX processes, the AllGather of the parameters on jaxccl's native executor with the
bytes between processes on its transport (UCX over TCP), under the closed loop across processes
(:class:`~jaxccl.control.process_loop.ProcessLoop`: the transport's completion times of
every process gathered to one controller in process 0, Algorithm 1, warm re-synthesis, every
process swapping at one agreed call).

With ``network="netns"`` (root) the job runs in a
:class:`~jaxccl.labs.rail.RailLab`: every rank is a process with its own NIC
(a veth shaped with ``tc`` to ``nic_rate_mbit``), the ranks of a host share its namespace and
reach each other over its loopback. At ``fail_step`` the launcher cuts the NICs of ``cut_ranks``
(rank 1's by default) to ``cut_rate_mbit`` live (both directions); the loop (its change-point
detector by default, ``detector="ewma"`` for the settled EWMA) detects it and routes the AllGather
around it through the hosts' loopbacks. With ``network="loopback"`` (the transport only, no root) the
processes share the machine's loopback: there is no NIC to cut, and the run checks the loss, the
measurement and that nothing is detected on a healthy network.

The losses are compared bitwise with a ``jax.lax`` run of the same training in the same
processes (the gradient reduce-scatter and the loss sum are ``jax.lax`` in both runs: on the
demo's topology communicator ``psum`` is the synthesized ReduceScatter and AllGather, not gloo's
ring, so the comparison checks the AllGather). The result has the single-process demo's keys plus
``processes``, ``network`` and ``per_process`` (each process's ranks, AllGather times, table
versions, loop times and events).

Example:
    >>> NetworkDemoConfig(network="netns").resolved_processes(), NetworkDemoConfig().resolved_processes()
    (8, 2)
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxccl.demos.closed_loop import DemoConfig, reaction_summary, write_outputs
from jaxccl.demos.network_layout import (
    FAILED_RANK,
    DemoNetworkError,
    check_cut_ranks,
    check_processes,
    default_processes,
    describe_cut,
    failed_links,
)
from jaxccl.demos.network_worker import CUT_DONE_FILE, CUT_REQUEST
from jaxccl.distributed import transport  # the module: tests replace its unavailable_reason
from jaxccl.distributed.launch import collect, start
from jaxccl.labs import netlab  # the module: tests replace its unavailable_reason
from jaxccl.labs.drill import _signal  # the drill's harness signal, shared with it
from jaxccl.labs.netlab import LinkShape
from jaxccl.labs.rail import RailLab

__all__ = ["NETWORKS", "SIZES", "DemoNetworkError", "NetworkDemoConfig", "check", "run", "unavailable_reason"]

NETWORKS = ("loopback", "netns")
# The MLP's widths: 790 KiB of parameters per rank, so that one shard sent to another process
# outlasts what the socket and the qdisc buffer (its completion time then measures the link).
SIZES = (256, 1024, 1024, 256, 16)
MAX_GROUPS = 8  # devices per rank's process (each a data group)


@dataclasses.dataclass
class NetworkDemoConfig(DemoConfig):
    """The real-socket demo's knobs (the single-process demo's, plus the network and the processes).

    ``processes`` ``None`` picks 8 for ``netns`` (a process and a NIC per rank) and 2 for
    ``loopback`` (a process per host). ``detector`` (the single-process demo's) is the
    controller's decision (``"cusum"``: the change-point test on the raw windows; ``"ewma"``:
    ``confirm`` flagged samples and a settled EWMA); ``fail_link`` and ``depth`` are the
    single-process demo's only. ``cut_ranks`` are the ranks whose NICs ``netns`` cuts at
    ``fail_step`` (not rank 0, whose NIC carries the job's coordinator); ``job_timeout_s`` is the
    deadline of the whole job. ``groups`` is the number of devices each rank's process holds: the
    mesh is ``data x model`` (8 x ``groups``), every ``model`` coordinate a ``data`` group of the 8
    ranks, so each process's NIC carries a rank of every group and a cut one degrades them all; the
    AllGather runs over ``data`` in every group at once, one communicator and one schedule for all.
    """

    steps: int = 16
    fail_step: int = 5
    ab_runs: int = 3
    gamma: float = 0.3  # Algorithm 1's threshold: 8 processes on a few shared cores make noisy samples
    network: str = "loopback"
    processes: int | None = None
    nic_rate_mbit: float = 200.0
    cut_rate_mbit: float = 40.0
    cut_ranks: tuple[int, ...] = (FAILED_RANK,)
    confirm: int = 2
    job_timeout_s: float = 900.0
    groups: int = 1

    def resolved_processes(self) -> int:
        """The number of processes this run starts."""
        return self.processes if self.processes is not None else default_processes(self.network)


def unavailable_reason(network: str) -> str | None:
    """What this machine lacks for ``network`` (``None``: the demo can run).

    >>> unavailable_reason("wifi")
    "unknown network 'wifi': expected one of ('loopback', 'netns')"
    """
    if network not in NETWORKS:
        return f"unknown network {network!r}: expected one of {NETWORKS}"
    reason = transport.unavailable_reason()
    if reason is not None:
        return reason
    if network == "netns":
        reason = netlab.unavailable_reason()
        if reason is not None:
            return f"{reason} (--network loopback needs only the transport)"
    return None


def check(cfg: NetworkDemoConfig) -> int:
    """Checks the configuration and the machine; returns the number of processes.

    Raises:
        DemoNetworkError: a bad setting, or what the machine lacks.
    """
    reason = unavailable_reason(cfg.network)
    if reason is not None:
        raise DemoNetworkError(f"jaxccl demo --network {cfg.network} cannot run here: {reason}")
    processes = cfg.resolved_processes()
    check_processes(cfg.network, processes)
    check_cut_ranks(cfg.cut_ranks)
    if not isinstance(cfg.groups, int) or isinstance(cfg.groups, bool) or not 1 <= cfg.groups <= MAX_GROUPS:
        raise DemoNetworkError(f"groups must be an integer in 1..{MAX_GROUPS} (devices per rank), got {cfg.groups!r}")
    if not 0 < cfg.cut_rate_mbit < cfg.nic_rate_mbit:
        raise DemoNetworkError(
            f"the cut rate {cfg.cut_rate_mbit:g} Mbit/s must be between 0 and the NIC's {cfg.nic_rate_mbit:g}"
        )
    if not 2 <= cfg.fail_step < cfg.steps - 2:
        raise DemoNetworkError(
            f"fail_step must be in 2..{cfg.steps - 3} for {cfg.steps} steps (healthy steps first, then room "
            f"to react), got {cfg.fail_step}"
        )
    return processes


def run(cfg: NetworkDemoConfig) -> dict[str, Any]:
    """Runs the demo's job; returns the JSON-ready result (also written to ``cfg.json``, ``cfg.png``).

    Raises:
        DemoNetworkError: the machine lacks what ``cfg.network`` needs, or a process failed (named).
    """
    if cfg.png:
        import matplotlib  # noqa: F401  (a missing matplotlib fails here, not after the run)
    processes = check(cfg)
    say = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, flush=True))
    say(
        f"jaxccl demo --network {cfg.network}: 8 ranks (2 hosts x 4) in {processes} processes"
        + (f", each rank {cfg.groups} devices (a data group each: {8 * cfg.groups} in all)" if cfg.groups > 1 else "")
        + (
            f", a {cfg.nic_rate_mbit:g} Mbit/s NIC each (network namespaces, tc); {describe_cut(cfg.cut_ranks)} cut "
            f"to {cfg.cut_rate_mbit:g} Mbit/s at step {cfg.fail_step}; detector {cfg.detector}"
            if cfg.network == "netns"
            else " on loopback (no NIC to cut: the run checks the loss and that nothing is detected)"
        )
    )
    with tempfile.TemporaryDirectory(prefix="jaxccl-demo-") as folder:
        cut_ns, lab_prefix = _run_job(cfg, processes, folder, say)
        result = _assemble(cfg, processes, folder)
    result["lab_prefix"] = lab_prefix
    result["cut_ns"] = cut_ns
    reaction_summary(result, print, failed=describe_cut(cfg.cut_ranks), unit="MB/s")
    write_outputs(result, cfg)
    return result


def _worker_config(cfg: NetworkDemoConfig, processes: int) -> str:
    keys = ("steps", "fail_step", "ab_runs", "network", "nic_rate_mbit", "lr", "batch", "quiet", "alpha", "gamma")
    keys += ("confirm", "detector", "cut_ranks", "groups")
    return json.dumps({**{k: getattr(cfg, k) for k in keys}, "processes": processes, "sizes": SIZES})


def _run_job(cfg: NetworkDemoConfig, processes: int, folder: str, say: Callable[..., None]) -> tuple[int, str | None]:
    """Runs the job; relays process 0's output and cuts the NIC when it asks. Returns the cut's time and the lab."""
    argv = [sys.executable, "-m", "jaxccl.demos.network_worker"]
    env = {"JAXCCL_DEMO_CONFIG": _worker_config(cfg, processes), "JAXCCL_DEMO_DIR": folder}
    deadline = time.monotonic() + cfg.job_timeout_s
    output: list[str] = []
    cut = {"ns": 0}
    if cfg.network == "netns":
        lab = RailLab(2, 4, LinkShape(rate_mbit=cfg.nic_rate_mbit))

        def cut_nic() -> str:
            for rank in cfg.cut_ranks:
                lab.shape(rank, LinkShape(rate_mbit=cfg.cut_rate_mbit))
            return describe_cut(cfg.cut_ranks)

        with lab:
            results = lab.launch(
                argv,
                env=env,
                timeout_s=cfg.job_timeout_s,
                during=lambda procs: _relay(procs[0], deadline, folder, cut_nic, cut, output, say),
            )
        prefix = lab.lab.prefix
    else:
        procs = start(argv, processes, env=env)
        try:
            _relay(procs[0], deadline, folder, None, cut, output, say)
            results = collect(procs, max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        prefix = None
    failed = [r for r in results if r.returncode != 0]
    if cut.get("timed_out"):
        failed = [dataclasses.replace(r, returncode=None) if r.process_id == 0 else r for r in failed]
    if failed:
        texts = {r.process_id: ("".join(output) + r.output if r.process_id == 0 else r.output) for r in failed}
        raise DemoNetworkError(
            "; ".join(_failure(r.process_id, r.returncode, texts[r.process_id], cfg.job_timeout_s) for r in failed)
        )
    return cut["ns"], prefix


def _relay(
    proc: subprocess.Popen,
    deadline: float,
    folder: str,
    cut_nic: Callable[[], str] | None,
    cut: dict[str, int],
    output: list[str],
    say: Callable[..., None],
) -> None:
    """Prints process 0's lines as they come (until it ends or the deadline); cuts the NICs when asked.

    ``cut_nic`` cuts them and returns what it cut, in words.
    """
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()  # the job's deadline
            cut["timed_out"] = 1
            return
        if line is None:
            return
        output.append(line)
        if line.startswith(CUT_REQUEST) and cut_nic is not None:
            what = cut_nic()
            cut["ns"] = time.monotonic_ns()
            _signal(Path(folder), CUT_DONE_FILE, str(cut["ns"]))
            say(f"          launcher: tc cut {what}")
        elif not line.startswith("[Gloo]"):
            say(line.rstrip("\n"))


def _failure(process_id: int, code: int | None, output: str, timeout_s: float) -> str:
    last = next((line for line in reversed(output.splitlines()) if line.strip()), "no output")
    ended = f"exit status {code}" if code is not None else f"killed at the job's deadline of {timeout_s:g} s"
    return f"process {process_id} {ended}: {last.strip()}"


def _assemble(cfg: NetworkDemoConfig, processes: int, folder: str) -> dict[str, Any]:
    """Process 0's result (the single-process demo's keys) with ``processes`` and every process's detail."""
    with open(os.path.join(folder, "result.json")) as f:
        result = json.load(f)
    per_process = []
    for p in range(processes):
        with open(os.path.join(folder, f"process-{p}.json")) as f:
            per_process.append(json.load(f))
    links = [f"{u}->{v}" for u, v in failed_links(cfg.cut_ranks)]
    result.update(
        {
            "loss_matches_reference": bool(all(p["loss_matches_reference"] for p in per_process)),
            "config": dataclasses.asdict(cfg),
            "processes": processes,
            "network": cfg.network,
            "per_process": per_process,
            "failed_link": links[0],
            "failed_links": links,
            "failure_label": (
                f"tc: {describe_cut(cfg.cut_ranks)} {cfg.nic_rate_mbit:g} -> {cfg.cut_rate_mbit:g} Mbit/s"
                if cfg.network == "netns"
                else "no failure (loopback)"
            ),
            "algbw_unit": "MB/s",
            "algbw_axis_label": "algbw, MB/s over real sockets",
            "time_scale_note": "algbw in real bytes/s over sockets (no emulation)",
        }
    )
    return result
