"""One process of the real-socket demo (started by :func:`jaxccl.demo_network.run`; not for direct use).

The process reads the demo's settings from ``JAXCCL_DEMO_CONFIG`` (JSON) and its role from the
launcher's ``JAXCCL_*`` variables, joins the JAX job (gloo for ``jax.lax``), connects jaxccl's
transport (every byte on the network: ``NETWORK_ONLY``) and attaches it to the 8-rank mesh. It
trains the demo's MLP twice from the same start: with ``jax.lax`` collectives (the reference),
then with the AllGather through jaxccl's native executor, measured and hot-swapped (the
reductions stay ``jax.lax`` in both runs). At the failure step process 0 asks the launcher to cut
its NIC (``CUT_REQUEST`` on its output; the launcher answers with the file ``cut-done`` in
``JAXCCL_DEMO_DIR``). After the run the stale and the re-synthesized schedule alternate on the cut
network (A/B). Each process writes ``process-<id>.json`` there; process 0 also ``result.json``.

>>> CUT_REQUEST
'JAXCCL-DEMO-CUT'
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

CUT_REQUEST = "JAXCCL-DEMO-CUT"  # process 0 prints it, the launcher cuts the NIC
CUT_DONE_FILE = "cut-done"  # the launcher writes its monotonic time (ns) of the cut into it
CUT_WAIT_S = 60.0
BOOTSTRAP_TIMEOUT_S = 120.0
AB_MAX_CALLS = 4  # calls after staging until the staged version runs


def _shard_values(arr: Any) -> list[Any]:
    import numpy as np

    return [np.asarray(s.data) for s in sorted(arr.addressable_shards, key=lambda s: s.device.id)]


def _wait_for_cut(folder: str, deadline_s: float) -> int:
    from jaxccl.errors import DeadlineError

    path = os.path.join(folder, CUT_DONE_FILE)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                text = f.read().strip()
            if text:
                return int(text)
        time.sleep(0.005)
    raise DeadlineError(f"the launcher did not cut the NIC within {deadline_s} s")


def main() -> int:
    """Runs this process's part of the demo; returns its exit status."""
    cfg = json.loads(os.environ["JAXCCL_DEMO_CONFIG"])
    folder = os.environ["JAXCCL_DEMO_DIR"]
    from jaxccl.demo_network_layout import NUM_RANKS, check_processes
    from jaxccl.runtime.multiprocess_launch import initialize_from_env

    me, n = initialize_from_env(local_devices=check_processes(cfg["processes"]), timeout_s=BOOTSTRAP_TIMEOUT_S)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl
    from jaxccl.demo import DemoConfig, _batch, _flatten, _model, _programs
    from jaxccl.demo_network_control import Event, UplinkWatch, control_round, uplink_rate
    from jaxccl.demo_network_layout import layout_topology, pairwise_view, process_of_rank, uplink
    from jaxccl.runtime import native
    from jaxccl.runtime.multiprocess import NETWORK_ONLY, ProcessTransport, TransportMeter, attach, stage_agreed

    say = (lambda *a: None) if (cfg["quiet"] or me != 0) else (lambda *a: print(*a, flush=True))
    train = DemoConfig(lr=cfg["lr"], batch=cfg["batch"])
    transport = ProcessTransport.bootstrap(timeout_s=BOOTSTRAP_TIMEOUT_S, options=NETWORK_ONLY)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    if mesh.size != NUM_RANKS:
        raise RuntimeError(f"the demo needs {NUM_RANKS} ranks, the job has {mesh.size}")
    attach(transport, mesh, "data")
    topo = layout_topology(n, nic_rate_mbit=cfg["nic_rate_mbit"])
    comm = jaxccl.Communicator(mesh, "data", topology=topo, backend="cpu")
    healthy = jaxccl.synth.allgather(topo)
    comm.install("all_gather", healthy)
    slot = comm.slot("all_gather")
    current = healthy  # the schedule staged last (stage_agreed goes around comm.install)

    rng = np.random.default_rng(0)  # the same model and data in every process
    sizes = tuple(cfg["sizes"])
    weights, shapes = _model(rng, sizes)
    flat = _flatten(weights, NUM_RANKS)
    x, y = _batch(rng, train.batch, sizes)
    sharding = NamedSharding(mesh, P("data"))

    def put(a: Any) -> Any:
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    xb, yb = put(x), put(y)
    out_bytes = flat.size * 4
    say(f"  {topo.name}; schedule {healthy.name} for the healthy links; MLP {sizes} ({out_bytes / 2**20:.1f} MiB)")

    say(f"running the jax.lax reference ({cfg['steps']} steps, gloo across the processes) ...")
    ref_gather, ref_step = _programs(jax.lax, mesh, shapes, train)
    shard = put(flat)
    ref_losses = []
    for _ in range(cfg["steps"]):
        shard, loss = ref_step(shard, ref_gather(shard), xb, yb)
        ref_losses.append(_shard_values(loss)[0])

    say("compiling the jaxccl training step (AllGather on the native executor across processes) ...")
    gather_fn, step_fn = _programs(jaxccl, mesh, shapes, train, reductions=jax.lax)
    shard = put(flat)
    with comm:
        for _ in range(2):  # compile, and connect every pair once, outside the timeline
            gather_fn(shard).block_until_ready()
    meter = TransportMeter(NUM_RANKS)
    meter.drain()
    uplinks = [uplink(topo, n, p) for p in range(n)]
    view = lambda t: pairwise_view(t, n)  # noqa: E731
    watch = UplinkWatch(topo, uplinks, healthy, out_bytes / NUM_RANKS, view=view) if me == 0 else None
    events: list[Event] = []
    labels = {native.current_version(slot): "healthy"}
    rows: list[dict[str, Any]] = []
    losses = []
    inject_ns = 0
    told = 0
    cut = cfg["network"] == "netns"
    say(f"training {cfg['steps']} steps; every process measures its NIC's sends, process 0 decides")
    with comm:
        for step in range(cfg["steps"]):
            if cut and me == 0 and step == cfg["fail_step"]:
                print(f"{CUT_REQUEST} {step}", flush=True)
                inject_ns = _wait_for_cut(folder, CUT_WAIT_S)
            start_ns = time.monotonic_ns()
            t0 = time.perf_counter()
            full = gather_fn(shard)
            full.block_until_ready()
            t_ag = time.perf_counter() - t0
            version = native.last_launch_version(slot)
            labels.setdefault(version, f"re-synthesized #{len(labels)}")
            shard, loss = step_fn(shard, full, xb, yb)
            losses.append(_shard_values(loss)[0])
            rate = uplink_rate(meter.drain())
            rows.append(
                {
                    "step": step,
                    "start_ns": start_ns,
                    "loss": float(losses[-1]),
                    "ag_ms": t_ag * 1e3,
                    "algbw": out_bytes / t_ag,
                    "version": version,
                    "schedule": labels[version],
                    "uplink_rate": rate,
                }
            )
            chosen = control_round(step, rate, me, n, watch)
            if chosen is not None:
                t0 = time.perf_counter()
                new_version, seq = stage_agreed(comm, "all_gather", chosen, round_id=step, margin=1)
                current = chosen
                stage_ms = (time.perf_counter() - t0) * 1e3
                labels[new_version] = f"re-synthesized #{len(labels)}"
                staged = {"version": new_version, "transition_seq": seq, "dispatch_ms": stage_ms, "swap_ms": stage_ms}
                events.append(Event("staged", time.monotonic_ns(), {"step": step, **staged}))
            say(
                f"step {step:3d}  loss {float(losses[-1]):.5f}  allgather {t_ag * 1e3:7.1f} ms  "
                f"algbw {out_bytes / t_ag / 1e6:6.2f} MB/s  uplink {rate / 1e6:6.2f} MB/s  "
                f"schedule v{version} ({labels[version]})"
                + ("   <- NIC cut" if cut and step == cfg["fail_step"] else "")
            )
            if watch is not None:
                for e in watch.events[told:]:
                    say(f"          process 0: {e.kind} {json.dumps(e.detail, default=str)}")
                told = len(watch.events)

    versions = [r["version"] for r in rows]
    swap_steps = [r["step"] for prev, r in zip(rows, rows[1:]) if r["version"] != prev["version"]]
    ab: dict[str, list[float]] = {"stale": [], "recovered": []}
    if swap_steps:
        say(f"A/B on the cut network: stale v{versions[0]} vs re-synthesized v{versions[-1]}, {cfg['ab_runs']} rounds")
        with comm:
            for i in range(cfg["ab_runs"]):
                for j, (key, s) in enumerate((("stale", healthy), ("recovered", current))):
                    want, _ = stage_agreed(comm, "all_gather", s, round_id=100_000 + 2 * i + j, margin=1)
                    for _ in range(AB_MAX_CALLS):
                        gather_fn(shard).block_until_ready()
                        if native.last_launch_version(slot) == want:
                            break
                    t0 = time.perf_counter()
                    gather_fn(shard).block_until_ready()
                    ab[key].append(out_bytes / (time.perf_counter() - t0))
    matches = len(losses) == len(ref_losses) and all(a.tobytes() == b.tobytes() for a, b in zip(losses, ref_losses))
    mine = [r for r, p in enumerate(process_of_rank(n)) if p == me]
    detail = {
        "process_id": me,
        "ranks": mine,
        "uplink": list(map(str, uplinks[me])),
        "uplink_rates": [r["uplink_rate"] for r in rows],
        "ag_ms": [r["ag_ms"] for r in rows],
        "versions": versions,
        "ab_stale": ab["stale"],
        "ab_recovered": ab["recovered"],
        "loss_matches_reference": bool(matches),
        "meter_dropped": meter.dropped,
        "staged": [e.to_dict() for e in events],
    }
    with open(os.path.join(folder, f"process-{me}.json"), "w") as f:
        json.dump(detail, f, default=float)
    if me == 0:
        result = {
            "rows": rows,
            "events": [e.to_dict() for e in sorted([*watch.events, *events], key=lambda e: e.time_ns)],
            "labels": {str(k): v for k, v in labels.items()},
            "inject_ns": inject_ns,
            "ab_stale": ab["stale"],
            "ab_recovered": ab["recovered"],
            "loss_matches_reference": bool(matches),
            "losses": [float(v) for v in losses],
            "bytes_per_rank": out_bytes // NUM_RANKS,
            "predicted_algbw_healthy": float(healthy.algbw),
            "predicted_algbw_recovered": float(current.algbw),
            "topology": topo.name,
        }
        with open(os.path.join(folder, "result.json"), "w") as f:
            json.dump(result, f, default=float)
    comm.close()
    transport.close()
    jax.distributed.shutdown()  # a barrier: the coordinator (process 0) leaves last
    return 0


if __name__ == "__main__":
    sys.exit(main())
