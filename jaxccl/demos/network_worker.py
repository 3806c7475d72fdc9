"""One process of the real-socket demo (started by :func:`jaxccl.demos.network.run`; not for direct use).

The process reads the demo's settings from ``JAXCCL_DEMO_CONFIG`` (JSON) and its role from the
launcher's ``JAXCCL_*`` variables, joins the JAX job (gloo for ``jax.lax``), connects jaxccl's
transport (on a rail lab restricted to its own NIC and its host's loopback; elsewhere every byte
on sockets) and attaches it to the 8-rank mesh. It trains the demo's MLP twice from the same
start: with ``jax.lax`` collectives (the reference), then with every collective through jaxccl's
native executor (the AllGather, the gradient ReduceScatter and the loss sum) under the closed loop
across processes (:class:`~jaxccl.control.process_loop.ProcessLoop`: every process's measurements,
one controller in process 0, agreed swaps). The loop manages the AllGather and the ReduceScatter:
both re-route around a cut NIC, and the ReduceScatter keeps gloo's tree order
(:func:`~jaxccl.demos.network_layout.demo_reduce_scatter`) and the loss sum gloo's ring, so the
losses stay bitwise equal to the reference. At the failure step process 0 asks the launcher to
cut the NICs (:data:`CUT_REQUEST` on its output; the launcher answers with the file
:data:`CUT_DONE_FILE` in ``JAXCCL_DEMO_DIR`` holding its ``time.monotonic_ns()`` of the cut), and
every process waits for that answer before the step, so that the failure step's transfers all
meet the cut network. After the run the stale and the re-synthesized schedules alternate on the
cut network (A/B). Each process writes ``process-<id>.json`` there; process 0 also ``result.json``.

>>> CUT_REQUEST
'JAXCCL-DEMO-CUT'
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jaxccl
from jaxccl.control.process_loop import ProcessLoop
from jaxccl.demos.closed_loop import (
    DemoConfig,
    _batch,
    _describe,
    _flatten,
    _model,
    _programs,
    _simulated,
    reaction_fields,
)
from jaxccl.demos.network_layout import (
    NUM_RANKS,
    check_processes,
    demo_allgather,
    demo_reduce_scatter,
    demo_topology,
    failed_links,
    process_of_rank,
)
from jaxccl.distributed.launch import initialize_from_env
from jaxccl.distributed.transport import NETWORK_ONLY, ProcessTransport, attach, stage_agreed

# The drill's harness signals (an atomic file per signal), shared with it.
from jaxccl.errors import DemoNetworkError
from jaxccl.labs.drill import _wait_signal
from jaxccl.labs.rail import transport_options_from_env
from jaxccl.util import report

CUT_REQUEST = "JAXCCL-DEMO-CUT"
CUT_DONE_FILE = "cut-done"
WAIT_S = 120.0  # every wait on another process or on the launcher
LOOP_KEY_PREFIX = "jaxccl/demo"


def _first_shard(arr: Any) -> Any:
    import numpy as np

    return np.asarray(min(arr.addressable_shards, key=lambda s: s.device.id).data)


class _Worker:
    """This process's part: the model, the reference run, the run under the loop, the A/B."""

    def __init__(self, cfg: dict[str, Any], folder: str):
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        self.cfg, self.folder = cfg, folder
        self.me, self.n = jax.process_index(), jax.process_count()
        self.say = (lambda *a: None) if (cfg["quiet"] or self.me != 0) else (lambda *a: print(*a, flush=True))
        self.train = DemoConfig(lr=cfg["lr"], batch=cfg["batch"])
        options = transport_options_from_env() or dict(NETWORK_ONLY)  # a rail lab's, else sockets only
        self.transport = ProcessTransport.bootstrap(timeout_s=WAIT_S, options=options)
        groups = self.groups = int(cfg["groups"])
        devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
        if devices.size != NUM_RANKS * groups:
            raise DemoNetworkError(f"the demo needs {NUM_RANKS} x {groups} devices, the job has {devices.size}")
        # a rank's devices are consecutive: row r of data x model is rank r, its columns the groups
        mesh = Mesh(devices.reshape(NUM_RANKS, groups), ("data", "model"))
        attach(self.transport, mesh, "data")
        self.topo = demo_topology(cfg["nic_rate_mbit"])
        self.comm = jaxccl.Communicator(mesh, "data", topology=self.topo, backend="cpu")
        self.healthy = demo_allgather(self.topo)
        self.comm.install("all_gather", self.healthy)
        self.slot = self.comm.slot("all_gather")
        self.healthy_rs = demo_reduce_scatter(self.topo)
        self.comm.install("reduce_scatter", self.healthy_rs)
        self.rs_slot = self.comm.slot("reduce_scatter")

        rng = np.random.default_rng(0)  # the same model and data in every process
        sizes = tuple(cfg["sizes"])
        weights, shapes = _model(rng, sizes)
        self.flat = _flatten(weights, NUM_RANKS)
        x, y = _batch(rng, self.train.batch, sizes)
        sharding = NamedSharding(mesh, P("data"))
        self.put = lambda a: jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])
        self.xb, self.yb = self.put(x), self.put(y)
        self.out_bytes = self.flat.size * 4
        self.sizes = sizes
        self.reference = _programs(jax.lax, mesh, shapes, self.train)
        self.programs = _programs(jaxccl, mesh, shapes, self.train)

    def reference_losses(self) -> list[Any]:
        gather, step = self.reference
        shard, losses = self.put(self.flat), []
        for _ in range(self.cfg["steps"]):
            shard, loss = step(shard, gather(shard), self.xb, self.yb)
            losses.append(_first_shard(loss))
        return losses

    def train_under_loop(self) -> tuple[list[dict[str, Any]], list[Any], Any, int, dict[int, str]]:
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

        cfg = self.cfg
        gather_fn, step_fn = self.programs
        shard = self.put(self.flat)
        with self.comm:
            for _ in range(2):  # compile, and connect every pair once, outside the timeline
                step_fn(shard, gather_fn(shard), self.xb, self.yb)[1].block_until_ready()
        loop = ProcessLoop(
            self.comm,
            margin=0,  # loop.step() runs after the step's collectives finished in every process
            timeout_s=WAIT_S,
            alpha=cfg["alpha"],
            key_prefix=LOOP_KEY_PREFIX,
            gamma=cfg["gamma"],
            confirm=cfg["confirm"],
            detector=cfg["detector"],
            collectives=("all_gather", "reduce_scatter"),
            synthesizers={"all_gather": demo_allgather, "reduce_scatter": demo_reduce_scatter},
        )
        labels = {native.current_version(self.slot): "healthy"}
        rows, losses, inject_ns, told = [], [], 0, 0
        cut = cfg["network"] == "netns"
        self.say(f"training {cfg['steps']} steps; the loop gathers every process's measurements to process 0")
        with self.comm:
            for step in range(cfg["steps"]):
                if cut and step == cfg["fail_step"]:
                    if self.me == 0:
                        print(f"{CUT_REQUEST} {step}", flush=True)
                    # every process waits for the cut: the failure step is degraded from its first byte everywhere
                    inject_ns = int(_wait_signal(Path(self.folder), CUT_DONE_FILE, WAIT_S))
                start_ns = time.monotonic_ns()
                t0 = time.perf_counter()
                full = gather_fn(shard)
                full.block_until_ready()
                t_ag = time.perf_counter() - t0
                version = native.last_launch_version(self.slot)
                labels.setdefault(version, f"re-synthesized #{len(labels)}")
                shard, loss = step_fn(shard, full, self.xb, self.yb)
                losses.append(_first_shard(loss))
                rs_version = native.last_launch_version(self.rs_slot)
                loop.step()  # measure, gather, decide (process 0), agree, swap: never raises
                rows.append(
                    {
                        "step": step,
                        "start_ns": start_ns,
                        "loss": float(losses[-1]),
                        "ag_ms": t_ag * 1e3,
                        "algbw": self.out_bytes / t_ag,
                        "version": version,
                        "schedule": labels[version],
                        "rs_version": rs_version,
                        "loop_ms": {k: round(v, 3) for k, v in vars(loop.times).items()},
                    }
                )
                self.say(
                    f"step {step:3d}  loss {float(losses[-1]):.5f}  allgather {t_ag * 1e3:7.1f} ms  "
                    f"algbw {self.out_bytes / t_ag / 1e6:6.2f} MB/s  schedule v{version} ({labels[version]})"
                    + ("   <- NIC cut" if cut and step == cfg["fail_step"] else "")
                )
                events = loop.events
                for e in events[told:]:
                    if e.kind == "staged":
                        labels.setdefault(e.detail["version"], f"re-synthesized #{len(labels)}")
                    self.say(f"          loop: {_describe(e, labels)}")
                told = len(events)
        return rows, losses, loop, inject_ns, labels

    def ab(self, recovered: Any, recovered_rs: Any, rounds: int) -> dict[str, list[float]]:
        """The stale and the re-synthesized schedules alternately on the cut network: the AllGather's algbw
        (``stale``, ``recovered``) and the whole step's time in ms, the AllGather and the training step with
        its ReduceScatter (``step_stale``, ``step_recovered``)."""
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

        gather_fn, step_fn = self.programs
        shard = self.put(self.flat)
        ab: dict[str, list[float]] = {"stale": [], "recovered": [], "step_stale": [], "step_recovered": []}
        with self.comm:
            for i in range(rounds):
                for key, schedule, rs in (
                    ("stale", self.healthy, self.healthy_rs),
                    ("recovered", recovered, recovered_rs),
                ):
                    version, _ = stage_agreed(
                        self.comm, "all_gather", schedule, round_id=f"{LOOP_KEY_PREFIX}/ab/{i}/{key}", margin=0
                    )
                    rs_version, _ = stage_agreed(
                        self.comm, "reduce_scatter", rs, round_id=f"{LOOP_KEY_PREFIX}/ab-rs/{i}/{key}", margin=0
                    )
                    full = gather_fn(shard)
                    step_fn(shard, full, self.xb, self.yb)[1].block_until_ready()  # the agreed transition calls
                    if native.last_launch_version(self.slot) != version:
                        raise DemoNetworkError(f"A/B: the staged AllGather v{version} did not run at the agreed call")
                    if native.last_launch_version(self.rs_slot) != rs_version:
                        raise DemoNetworkError(
                            f"A/B: the staged ReduceScatter v{rs_version} did not run at the agreed call"
                        )
                    t0 = time.perf_counter()
                    gather_fn(shard).block_until_ready()
                    ab[key].append(self.out_bytes / (time.perf_counter() - t0))
                    t0 = time.perf_counter()
                    _, loss = step_fn(shard, gather_fn(shard), self.xb, self.yb)
                    loss.block_until_ready()
                    ab[f"step_{key}"].append((time.perf_counter() - t0) * 1e3)
        return ab

    def run(self) -> None:
        cfg = self.cfg
        self.say(
            f"  {self.topo.name} at {cfg['nic_rate_mbit']:g} Mbit/s per NIC; schedule {self.healthy.name}; "
            f"MLP {self.sizes} ({self.out_bytes / 2**20:.1f} MiB of parameters)"
        )
        self.say(f"running the jax.lax reference ({cfg['steps']} steps, gloo across the processes) ...")
        ref_losses = self.reference_losses()
        self.say("compiling the jaxccl training step (every collective on the native executor across processes) ...")
        rows, losses, loop, inject_ns, labels = self.train_under_loop()
        swapped = any(r["version"] != rows[0]["version"] or r["rs_version"] != rows[0]["rs_version"] for r in rows)
        recovered = self.comm.schedule("all_gather")
        recovered_rs = self.comm.schedule("reduce_scatter")
        if swapped:
            self.say(f"A/B on the cut network: stale vs re-synthesized, {cfg['ab_runs']} rounds ...")
        ab = self.ab(recovered, recovered_rs, cfg["ab_runs"] if swapped else 0)
        step_ratio = None
        if swapped:
            stale_ms, recovered_ms = report.median(ab["step_stale"]), report.median(ab["step_recovered"])
            step_ratio = stale_ms / recovered_ms
            self.say(
                f"the whole step (AllGather + training step with its ReduceScatter): stale {stale_ms:.1f} ms, "
                f"re-synthesized {recovered_ms:.1f} ms ({step_ratio:.2f}x; A/B medians)"
            )
        matches = len(losses) == len(ref_losses) and all(a.tobytes() == b.tobytes() for a, b in zip(losses, ref_losses))
        detail = {
            "process_id": self.me,
            "ranks": [r for r, p in enumerate(process_of_rank(self.n)) if p == self.me],
            "ag_ms": [r["ag_ms"] for r in rows],
            "loop_ms": [r["loop_ms"] for r in rows],
            "versions": [r["version"] for r in rows],
            "rs_versions": [r["rs_version"] for r in rows],
            "ab_stale": ab["stale"],
            "ab_recovered": ab["recovered"],
            "loss_matches_reference": bool(matches),
            "loop_events": [e.to_dict() for e in loop.events],
            "loop_errors": len(loop.errors),
        }
        with open(os.path.join(self.folder, f"process-{self.me}.json"), "w") as f:
            json.dump(detail, f, default=float)
        if self.me == 0:
            fail_step = cfg["fail_step"] if cfg["network"] == "netns" else None
            events = loop.events
            links = failed_links(tuple(cfg["cut_ranks"]))
            reaction = reaction_fields(
                rows, events, inject_ns, fail_step, ab, failed_links=links, detector=cfg["detector"]
            )
            bytes_per_rank = self.out_bytes // len(process_of_rank(self.n))
            simulated, simulated_in_order = _simulated(self.topo, self.healthy, bytes_per_rank)
            measured = reaction["algbw_healthy"]
            result = {
                **reaction,
                "bytes_per_rank": bytes_per_rank,
                "predicted_algbw_healthy": float(self.healthy.algbw),
                "predicted_algbw_recovered": float(recovered.algbw),
                "reduce_scatter": {
                    "healthy": self.healthy_rs.name,
                    "predicted_algbw_healthy": float(self.healthy_rs.algbw),
                    "predicted_algbw_recovered": float(recovered_rs.algbw),
                    "swapped": any(r["rs_version"] != rows[0]["rs_version"] for r in rows),
                },
                "simulated_algbw_healthy": simulated,
                "simulated_algbw_healthy_in_order": simulated_in_order,
                "measured_over_predicted": measured / self.healthy.algbw,
                "measured_over_simulated": measured / simulated,
                "predicted_note": (
                    "predicted_algbw_healthy is the schedule's large-message limit on the lab's NIC rates (the "
                    "loopback inside a host counted as 40 NICs); simulated_algbw_healthy is the flow-level simulator "
                    "at this message size; the measured rate runs on 8 processes sharing this machine's cores"
                ),
                "loss_matches_reference": bool(matches),
                "losses": [float(v) for v in losses],
                "steps": rows,
                "schedules": {f"v{v}": label for v, label in labels.items()},
                "events": [e.to_dict() for e in events],
                "inject_ns": inject_ns,
                "topology": self.topo.name,
                "groups": self.groups,
                "ab_step_stale_ms": ab["step_stale"],
                "ab_step_recovered_ms": ab["step_recovered"],
                "step_recovery_ratio": step_ratio,
            }
            with open(os.path.join(self.folder, "result.json"), "w") as f:
                json.dump(result, f, default=float)
        self.comm.close()
        self.transport.close()


def main() -> int:
    """Runs this process's part of the demo; returns its exit status."""
    cfg = json.loads(os.environ["JAXCCL_DEMO_CONFIG"])

    local = check_processes(cfg["network"], cfg["processes"]) * int(cfg["groups"])
    initialize_from_env(local_devices=local, timeout_s=WAIT_S)
    _Worker(cfg, os.environ["JAXCCL_DEMO_DIR"]).run()
    import jax

    jax.distributed.shutdown()  # a barrier: the coordinator (process 0) leaves last
    return 0


if __name__ == "__main__":
    sys.exit(main())
