"""``jaxccl demo --network netns|loopback``: the closed loop across processes on real sockets.

The single-process demo (:mod:`jaxccl.demo`) on real links: 8 ranks (2 emulated hosts x 4) in
``processes`` JAX processes, the AllGather of the parameters on jaxccl's native executor with
the bytes between processes on its transport (UCX over TCP, nothing through shared memory).
With ``network="netns"`` (root) every process runs in its own network namespace of a
:class:`~jaxccl.netlab.NetLab`, its NIC shaped with ``tc`` to ``nic_rate_mbit``; at
``fail_step`` the launcher cuts process 0's uplink to ``cut_rate_mbit`` live. Each process
measures its NIC from the transport's completion times, process 0 detects the drop, re-synthesizes
the AllGather around the cut NIC and every process stages it at one agreed call
(:mod:`jaxccl.demo_network_control`). The losses are compared bitwise with a ``jax.lax`` run of
the same training in the same processes. With ``network="loopback"`` (the transport only, no
root) the processes share the loopback device: there is no NIC to cut, and the run checks the
loss, the measurement and that nothing is detected on a healthy network.

The default layout for ``netns`` is one process per rank (8): each rank has its own NIC, so the
cut one can be routed around (the healthy schedule sends 7 shards through every uplink; the
re-synthesized one sends rank 0's shard through its uplink once). With 2 processes (one per
emulated host, 4 ranks sharing its memory) one NIC carries a whole host, which no schedule can
avoid: the detector says so and keeps the schedule. Loopback defaults to 2 processes (less start
time on a small machine).

The result has the single-process demo's keys plus ``processes``, ``network`` and
``per_process`` (each process's ranks, NIC, measured uplink rates, AllGather times, versions).

Example:
    >>> NetworkDemoConfig(network="netns").resolved_processes(), NetworkDemoConfig().resolved_processes()
    (8, 2)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from jaxccl import report
from jaxccl.demo import DemoConfig, _step_at, _timeline_png, reaction_summary
from jaxccl.demo_network_layout import DemoNetworkError, check_processes, layout_topology, uplink
from jaxccl.demo_network_worker import CUT_DONE_FILE, CUT_REQUEST

NETWORKS = ("loopback", "netns")
FAILED_PROCESS = 0  # its NIC's uplink is cut
# The MLP's widths: 790 KiB of parameters per rank, so that one rank's sends to a peer outlast what
# the socket and the qdisc buffer (their completion times then measure the link, not the buffers).
SIZES = (256, 1024, 1024, 256, 16)


@dataclasses.dataclass
class NetworkDemoConfig(DemoConfig):
    """The real-socket demo's knobs (the single-process demo's, plus the network and the processes).

    ``processes`` ``None`` picks 8 for ``netns`` (a NIC per rank) and 2 for ``loopback``.
    """

    steps: int = 16
    fail_step: int = 6
    ab_runs: int = 5
    network: str = "loopback"
    processes: int | None = None
    nic_rate_mbit: float = 200.0
    cut_rate_mbit: float = 40.0
    job_timeout_s: float = 900.0

    def resolved_processes(self) -> int:
        """The number of processes this run starts."""
        if self.processes is not None:
            return self.processes
        return 8 if self.network == "netns" else 2


def unavailable_reason(network: str) -> str | None:
    """What this machine lacks for ``network`` (``None``: the demo can run).

    >>> unavailable_reason("wifi")
    "unknown network 'wifi': expected one of ('loopback', 'netns')"
    """
    if network not in NETWORKS:
        return f"unknown network {network!r}: expected one of {NETWORKS}"
    from jaxccl.runtime.multiprocess import unavailable_reason as transport_reason

    reason = transport_reason()
    if reason is not None:
        return reason
    if network == "netns":
        from jaxccl.netlab import unavailable_reason as netns_reason

        reason = netns_reason()
        if reason is not None:
            return f"--network netns: {reason} (--network loopback needs only the transport)"
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
    check_processes(processes)
    if not cfg.cut_rate_mbit < cfg.nic_rate_mbit:
        raise DemoNetworkError(
            f"the cut rate {cfg.cut_rate_mbit:g} Mbit/s must be below the NIC's {cfg.nic_rate_mbit:g}"
        )
    if not 3 <= cfg.fail_step < cfg.steps - 2:
        raise DemoNetworkError(
            f"fail_step must be in 3..{cfg.steps - 3} for {cfg.steps} steps (3 healthy steps form each NIC's "
            f"baseline), got {cfg.fail_step}"
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
        + (
            f", each in its own network namespace with a {cfg.nic_rate_mbit:g} Mbit/s NIC; process "
            f"{FAILED_PROCESS}'s uplink cut to {cfg.cut_rate_mbit:g} Mbit/s at step {cfg.fail_step}"
            if cfg.network == "netns"
            else " on loopback (no NIC to cut: the run checks the loss and that nothing is detected)"
        )
    )
    with tempfile.TemporaryDirectory(prefix="jaxccl-demo-") as folder, contextlib.ExitStack() as stack:
        lab = None
        if cfg.network == "netns":
            from jaxccl.netlab import LinkShape, NetLab

            lab = stack.enter_context(NetLab(processes, LinkShape(rate_mbit=cfg.nic_rate_mbit)))
        inject_wall = _run_job(cfg, processes, folder, lab, say)
        result = _assemble(cfg, processes, folder, inject_wall)
    reaction_summary(result, print, failed=result["failed_link"], unit="MB/s")
    if cfg.json:
        report.write_json(cfg.json, result)
        print(f"wrote {cfg.json}")
    if cfg.png:
        _timeline_png(result, cfg.png)
        print(f"wrote {cfg.png}")
    sys.stdout.flush()
    return result


def _worker_config(cfg: NetworkDemoConfig, processes: int) -> str:
    keys = ("steps", "fail_step", "ab_runs", "network", "nic_rate_mbit", "lr", "batch", "quiet")
    return json.dumps({**{k: getattr(cfg, k) for k in keys}, "processes": processes, "sizes": SIZES})


def _run_job(cfg: NetworkDemoConfig, processes: int, folder: str, lab: Any, say: Any) -> int | None:
    """Starts the processes, relays process 0's output, cuts the NIC when it asks; returns the cut's time (ns)."""
    from jaxccl.netlab import LinkShape
    from jaxccl.runtime.multiprocess_launch import collect, start

    env = {"JAXCCL_DEMO_CONFIG": _worker_config(cfg, processes), "JAXCCL_DEMO_DIR": folder}
    procs = start([sys.executable, "-m", "jaxccl.demo_network_worker"], processes, lab=lab, env=env)
    deadline = time.monotonic() + cfg.job_timeout_s
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_pump, args=(procs[0].stdout, lines), daemon=True)
    reader.start()
    output: list[str] = []
    cut_ns = None
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            output.append(line)
            if line.startswith(CUT_REQUEST) and lab is not None:
                lab.shape(FAILED_PROCESS, LinkShape(rate_mbit=cfg.cut_rate_mbit), direction="up")
                cut_ns = time.monotonic_ns()
                with open(os.path.join(folder, CUT_DONE_FILE), "w") as f:
                    f.write(str(cut_ns))
                say(f"          launcher: tc cut process {FAILED_PROCESS}'s uplink to {cfg.cut_rate_mbit:g} Mbit/s")
            elif not line.startswith("[Gloo]"):
                say(line.rstrip("\n"))
        first = _finish(procs[0], deadline)
        others = collect(procs[1:], max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(0, first, "".join(output))] if first != 0 else []
    failed += [(r.process_id + 1, r.returncode, r.output) for r in others if r.returncode != 0]
    if failed:
        raise DemoNetworkError("; ".join(_failure(pid, code, out, cfg.job_timeout_s) for pid, code, out in failed))
    return cut_ns


def _pump(stream: Any, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _finish(proc: subprocess.Popen, deadline: float) -> int | None:
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        return None


def _failure(process_id: int, code: int | None, output: str, timeout_s: float) -> str:
    last = next((line for line in reversed(output.splitlines()) if line.strip()), "no output")
    ended = f"exit status {code}" if code is not None else f"killed after the job's deadline of {timeout_s:g} s"
    return f"process {process_id} {ended}: {last.strip()}"


def _assemble(cfg: NetworkDemoConfig, processes: int, folder: str, inject_ns: int | None) -> dict[str, Any]:
    """The single-process demo's keys from process 0's record, plus ``processes`` and ``per_process``."""
    with open(os.path.join(folder, "result.json")) as f:
        r = json.load(f)
    per_process = []
    for p in range(processes):
        with open(os.path.join(folder, f"process-{p}.json")) as f:
            per_process.append(json.load(f))
    rows, events = r["rows"], r["events"]
    inject_ns = inject_ns or 0
    topo = layout_topology(processes, nic_rate_mbit=cfg.nic_rate_mbit)
    u, v = uplink(topo, processes, FAILED_PROCESS)
    failed_key = f"{u}->{v}"
    detections = [e for e in events if e["kind"] == "detected"]
    after = [e for e in events if inject_ns and e["time_ns"] >= inject_ns]
    first = {k: next((e for e in after if e["kind"] == k), None) for k in ("detected", "confirmed", "synthesized")}
    staged = next((e for e in after if e["kind"] == "staged"), None)
    swap_steps = [b["step"] for a, b in zip(rows, rows[1:]) if b["version"] != a["version"]]
    swap_step = swap_steps[0] if swap_steps else None
    v0 = rows[0]["version"]
    cut = cfg.network == "netns"
    healthy = [row["algbw"] for row in rows if not cut or row["step"] < cfg.fail_step]
    stale_steps = [row["algbw"] for row in rows if cut and row["step"] > cfg.fail_step and row["version"] == v0]
    recovered_steps = [row["algbw"] for row in rows if swap_step is not None and row["step"] >= swap_step]
    algbw_stale = report.median(r["ab_stale"]) if r["ab_stale"] else report.median(stale_steps)
    algbw_recovered = report.median(r["ab_recovered"]) if r["ab_recovered"] else float("nan")

    def since_cut(e: dict[str, Any] | None) -> float:
        return (e["time_ns"] - inject_ns) / 1e6 if e is not None and inject_ns else float("nan")

    def value(e: dict[str, Any] | None, key: str) -> float:
        return float(e[key]) if e is not None and key in e else float("nan")

    activated = next((row for row in rows if swap_step is not None and row["step"] == swap_step), None)
    return {
        "algbw_healthy": report.median(healthy),
        "algbw_stale": algbw_stale,
        "algbw_recovered": algbw_recovered,
        "recovery_ratio": algbw_recovered / algbw_stale if algbw_stale else float("nan"),
        "ab_stale": r["ab_stale"],
        "ab_recovered": r["ab_recovered"],
        "algbw_stale_timeline": report.median(stale_steps),
        "algbw_recovered_timeline": report.median(recovered_steps),
        "bytes_per_rank": r["bytes_per_rank"],
        "predicted_algbw_healthy": r["predicted_algbw_healthy"],
        "predicted_algbw_recovered": r["predicted_algbw_recovered"],
        "detect_ms": since_cut(first["detected"]),
        "detections": len(detections),
        "false_detections": sum(
            1 for e in detections if not inject_ns or e["time_ns"] < inject_ns or failed_key not in e["degraded"]
        ),
        "resyntheses": sum(1 for e in events if e["kind"] in ("synthesized", "kept")),
        "swaps": len(swap_steps),
        "swap_steps": swap_steps,
        "confirm_ms": since_cut(first["confirmed"]) - since_cut(first["detected"]),
        "synth_ms": value(first["synthesized"], "synth_ms"),
        "dispatch_ms": value(staged, "dispatch_ms"),
        "swap_ms": value(staged, "swap_ms"),
        "activation_wait_ms": (activated["start_ns"] - staged["time_ns"]) / 1e6
        if activated and staged
        else float("nan"),
        "swap_step": swap_step,
        "fail_step": cfg.fail_step if cfg.network == "netns" else None,
        "detect_step": _step_at(rows, first["detected"]["time_ns"]) if first["detected"] else None,
        "confirm_step": _step_at(rows, first["confirmed"]["time_ns"]) if first["confirmed"] else None,
        "loss_matches_reference": bool(all(pp["loss_matches_reference"] for pp in per_process)),
        "losses": r["losses"],
        "steps": rows,
        "schedules": {f"v{k}": label for k, label in r["labels"].items()},
        "events": events,
        "config": dataclasses.asdict(cfg),
        "processes": processes,
        "network": cfg.network,
        "topology": r["topology"],
        "failed_link": f"process {FAILED_PROCESS}'s NIC uplink ({failed_key})",
        "per_process": per_process,
        "failure_label": (
            f"tc: process {FAILED_PROCESS}'s uplink {cfg.nic_rate_mbit:g} -> {cfg.cut_rate_mbit:g} Mbit/s"
            if cfg.network == "netns"
            else "no failure (loopback)"
        ),
        "algbw_unit": "MB/s",
        "algbw_axis_label": "algbw, MB/s over real sockets",
        "time_scale_note": "algbw in real bytes/s over sockets (no emulation)",
    }
