"""``jaxccl demo``: the closed loop on 8 emulated CPU devices (MCCL Fig. 10a in miniature).

FSDP-style training of a small MLP: the parameters live as one flat vector
sharded over the 8 devices of a rail fabric of 2 hosts x 4 GPUs (emulated
links, :class:`jaxccl.runtime.emulated.LinkEmulation`). Every step all-gathers
the parameters through jaxccl (the adaptive collective, its own jitted call so
its time is measured exactly), computes the loss and gradients, and
reduce-scatters the gradients through jaxccl (static, rank-ordered). At
``--fail-step`` a gray failure halves the NIC of host 0 / GPU 0, live. The
controller thread (:class:`jaxccl.control.Controller`) notices it in the
telemetry, re-synthesizes the AllGather warm-started, and hot-swaps it between
steps. The same training with ``jax.lax`` collectives is the reference: the
losses must be bitwise equal.

After the run the stale and the re-synthesized schedule are timed against each
other on the degraded fabric (interleaved, medians), which is the recovery
ratio the demo reports.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jaxccl
from jaxccl import report

NUM_DEVICES = 8
SIZES = (128, 512, 512, 128, 16)  # the MLP's layer widths


@dataclasses.dataclass
class DemoConfig:
    steps: int = 60
    fail_step: int = 15
    time_scale: float = 3e-4
    lr: float = 0.2
    batch: int = 256
    alpha: float = 0.5
    gamma: float = 0.15
    nic_gbps: float = 200.0  # GPU 0's NIC after the failure (nominal 400)
    ab_runs: int = 7
    json: str | None = None
    png: str | None = None
    quiet: bool = False


def _model(rng: Any) -> tuple[list[Any], list[tuple[int, int]]]:
    import numpy as np

    shapes = list(zip(SIZES[:-1], SIZES[1:]))
    weights = [(rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for s in shapes]
    return weights, shapes


def _flatten(weights: list[Any], multiple: int) -> Any:
    import numpy as np

    flat = np.concatenate([w.ravel() for w in weights])
    pad = (-flat.size) % multiple
    return np.concatenate([flat, np.zeros(pad, np.float32)])


def _programs(lib: Any, mesh: Any, shapes: list[tuple[int, int]], cfg: DemoConfig) -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def gather(shard):
        return lib.all_gather(shard, "data", axis=0, tiled=True)

    def unflatten(flat):
        out, k = [], 0
        for a, b in shapes:
            out.append(flat[k : k + a * b].reshape(a, b))
            k += a * b
        return out

    def step(shard, full, xb, yb):
        def local_loss(f):
            h = xb
            ws = unflatten(f)
            for i, w in enumerate(ws):
                h = h @ w
                if i < len(ws) - 1:
                    h = jnp.tanh(h)
            logp = jax.nn.log_softmax(h)
            return -jnp.sum(jnp.take_along_axis(logp, yb[:, None], axis=1)) / cfg.batch

        loss, g = jax.value_and_grad(local_loss)(full)
        g_shard = lib.psum_scatter(g, "data", scatter_dimension=0, tiled=True)
        return shard - cfg.lr * g_shard, lib.psum(loss, "data")

    gather_fn = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    step_fn = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P("data"), P("data"), P("data"), P("data")), out_specs=(P("data"), P())
        )
    )
    return gather_fn, step_fn


def run(cfg: DemoConfig) -> dict[str, Any]:
    """Runs the demo; returns the JSON-ready result (also written to ``cfg.json``)."""
    jaxccl.emulate(NUM_DEVICES)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxccl.control import Controller
    from jaxccl.runtime import native
    from jaxccl.runtime.emulated import LinkEmulation
    from jaxccl.topology import rail

    say = (lambda *a, **k: None) if cfg.quiet else print
    mesh = Mesh(np.array(jax.devices()), ("data",))
    topo = rail(hosts=2, gpus_per_host=4)
    failed = topo.degrade(0, "tor:s0r0", gbps=cfg.nic_gbps)
    rng = np.random.default_rng(0)
    weights, shapes = _model(rng)
    flat = _flatten(weights, NUM_DEVICES)
    x = rng.standard_normal((cfg.batch, SIZES[0])).astype(np.float32)
    y = np.argmax(x @ rng.standard_normal((SIZES[0], SIZES[-1])), axis=1).astype(np.int32)
    sharding = NamedSharding(mesh, P("data"))
    xb, yb = jax.device_put(x, sharding), jax.device_put(y, sharding)
    out_bytes = flat.size * 4  # one rank's AllGather output

    comm = jaxccl.Communicator(
        mesh,
        "data",
        topology=topo,
        backend="cpu",
        link_emulation=LinkEmulation(time_scale=cfg.time_scale),
        telemetry_alpha=cfg.alpha,
    )
    healthy_schedule = jaxccl.synth.allgather(topo)
    comm.install("all_gather", healthy_schedule)
    say(
        f"jaxccl demo: MLP {SIZES} ({flat.size * 4 / 2**20:.1f} MiB of parameters), FSDP over {NUM_DEVICES} emulated "
        f"devices on {topo.name} (time scale {cfg.time_scale:g}); gray failure at step {cfg.fail_step}: "
        f"GPU 0's NIC {topo.capacity(0, 'tor:s0r0') * 8 / 1e9:.0f} -> {cfg.nic_gbps:.0f} Gbps"
    )

    # reference: jax.lax collectives, no emulation
    ref_gather, ref_step = _programs(jax.lax, mesh, shapes, cfg)
    shard = jax.device_put(flat, sharding)
    ref_losses = []
    for _ in range(cfg.steps):
        shard, loss = ref_step(shard, ref_gather(shard), xb, yb)
        ref_losses.append(np.asarray(loss))

    gather_fn, step_fn = _programs(jaxccl, mesh, shapes, cfg)
    shard = jax.device_put(flat, sharding)
    with comm:  # compile and warm up outside the timeline
        gather_fn(shard).block_until_ready()
    comm.telemetry()
    controller = Controller(comm, gamma=cfg.gamma, interval_s=0.01)
    rows: list[dict[str, Any]] = []
    losses = []
    inject_ns = 0
    controller.start()
    try:
        with comm:
            for step in range(cfg.steps):
                if step == cfg.fail_step:
                    comm.inject(failed)
                    inject_ns = time.monotonic_ns()
                t0 = time.perf_counter()
                full = gather_fn(shard)
                full.block_until_ready()
                t_ag = time.perf_counter() - t0
                version = native.last_launch_version(comm.slot("all_gather"))
                shard, loss = step_fn(shard, full, xb, yb)
                losses.append(np.asarray(loss))
                algbw = out_bytes / t_ag / cfg.time_scale
                rows.append(
                    {"step": step, "loss": float(losses[-1]), "ag_ms": t_ag * 1e3, "algbw": algbw, "version": version}
                )
                say(
                    f"step {step:3d}  loss {float(losses[-1]):.5f}  allgather {t_ag * 1e3:7.1f} ms  "
                    f"algbw {algbw / 1e9:6.1f} GB/s (emulated)  schedule v{version}"
                    + ("   <- gray failure injected" if step == cfg.fail_step else "")
                )
    finally:
        controller.stop()

    events = controller.events
    after = [e for e in events if e.time_ns >= inject_ns]
    detected = next((e for e in after if e.kind == "detected"), None)
    first = {k: next((e for e in after if e.kind == k), None) for k in ("synthesized", "staged", "activated")}
    versions = [r["version"] for r in rows]
    v0 = versions[0]
    swap_step = next((r["step"] for r in rows if r["version"] != v0), None)
    healthy = [r["algbw"] for r in rows if 2 <= r["step"] < cfg.fail_step]
    stale_steps = [r["algbw"] for r in rows if r["step"] > cfg.fail_step and r["version"] == v0]
    recovered_steps = [r["algbw"] for r in rows if swap_step is not None and r["step"] > swap_step]

    # A/B on the degraded fabric: stale vs re-synthesized, interleaved
    new_schedule = comm.schedule("all_gather")
    ab = {"stale": [], "recovered": []}
    if swap_step is not None:
        with comm:
            for _ in range(cfg.ab_runs):
                for key, s in (("stale", healthy_schedule), ("recovered", new_schedule)):
                    comm.install("all_gather", s)
                    gather_fn(shard).block_until_ready()  # the first call activates the staged schedule
                    t0 = time.perf_counter()
                    gather_fn(shard).block_until_ready()
                    ab[key].append(out_bytes / (time.perf_counter() - t0) / cfg.time_scale)
    algbw_stale = report.median(ab["stale"]) if ab["stale"] else report.median(stale_steps)
    algbw_recovered = report.median(ab["recovered"]) if ab["recovered"] else float("nan")
    matches = len(losses) == len(ref_losses) and all(a.tobytes() == b.tobytes() for a, b in zip(losses, ref_losses))

    def ms(e: Any, key: str) -> float:
        return float(e.detail[key]) if e is not None and key in e.detail else float("nan")

    result = {
        "algbw_healthy": report.median(healthy),
        "algbw_stale": algbw_stale,
        "algbw_recovered": algbw_recovered,
        "recovery_ratio": algbw_recovered / algbw_stale if algbw_stale else float("nan"),
        "algbw_stale_timeline": report.median(stale_steps),
        "algbw_recovered_timeline": report.median(recovered_steps),
        "predicted_algbw_healthy": healthy_schedule.algbw,
        "predicted_algbw_recovered": new_schedule.algbw,
        "detect_ms": (detected.time_ns - inject_ns) / 1e6 if detected is not None else float("nan"),
        "false_detections": sum(1 for e in events if e.kind == "detected" and e.time_ns < inject_ns),
        "synth_ms": ms(first["synthesized"], "synth_ms"),
        "dispatch_ms": ms(first["staged"], "dispatch_ms"),
        "swap_ms": ms(first["staged"], "swap_ms"),
        "activation_wait_ms": ms(first["activated"], "wait_ms"),
        "swap_step": swap_step,
        "fail_step": cfg.fail_step,
        "loss_matches_reference": bool(matches),
        "losses": [float(v) for v in losses],
        "steps": rows,
        "events": [e.to_dict() for e in events if e.kind != "error"] + [e.to_dict() for e in controller.errors],
        "config": dataclasses.asdict(cfg),
        "time_scale_note": "algbw in emulated bytes/s: real bytes/s divided by time_scale",
    }
    _summary(result, print)
    if cfg.json:
        report.write_json(cfg.json, result)
    if cfg.png:
        _timeline_png(result, cfg.png)
    return result


def _summary(r: dict[str, Any], say: Any) -> None:
    g = 1e9
    say("")
    say(f"loss curve equals the jax.lax reference bitwise: {'yes' if r['loss_matches_reference'] else 'NO'}")
    say(
        f"detection {r['detect_ms']:.1f} ms, synthesis {r['synth_ms']:.1f} ms, dispatch (validate + compile) "
        f"{r['dispatch_ms']:.2f} ms, swap (stage) {r['swap_ms']:.3f} ms; active from step {r['swap_step']}"
    )
    say(
        f"algbw healthy {r['algbw_healthy'] / g:.1f} GB/s; after the failure: stale schedule "
        f"{r['algbw_stale'] / g:.1f} GB/s, re-synthesized {r['algbw_recovered'] / g:.1f} GB/s "
        f"({r['recovery_ratio']:.2f}x; A/B medians on the degraded fabric)"
    )


def _timeline_png(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in r["steps"]]
    bw = [row["algbw"] / 1e9 for row in r["steps"]]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(steps, bw, marker=".", label="AllGather algbw (emulated GB/s)")
    ax.axvline(r["fail_step"], color="r", ls="--", label="gray failure (GPU 0 NIC halved)")
    if r["swap_step"] is not None:
        ax.axvline(r["swap_step"], color="g", ls="--", label="re-synthesized schedule active")
    ax.set_xlabel("training step")
    ax.set_ylabel("GB/s")
    ax.set_title("jaxccl demo: detection, re-synthesis and hot-swap")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
