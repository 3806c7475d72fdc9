"""``jaxccl demo``: the closed loop on 8 emulated CPU devices (MCCL Fig. 10a in miniature).

FSDP-style training of a small MLP: the parameters live as one flat vector
sharded over the 8 devices of a rail fabric of 2 hosts x 4 GPUs (emulated
links, :class:`jaxccl.runtime.emulated.LinkEmulation`). Every step all-gathers
the parameters through jaxccl (the adaptive collective, its own jitted call so
its time is measured exactly), computes the loss and gradients, and
reduce-scatters the gradients through jaxccl (static, rank-ordered). At
``--fail-step`` a gray failure cuts a link to ``depth`` of its capacity, live:
by default GPU 0's NIC to half (``fail_link``: ``"nic"``; ``"nvlink"``: GPU 0's
NVLink to its host's NVSwitch; ``"two"``: the NICs of GPU 0 and GPU 5). The
controller thread (:class:`jaxccl.control.Controller`, with the ``detector``
asked for) notices it in the telemetry, re-synthesizes the AllGather
warm-started, and hot-swaps it between steps. The same training with ``jax.lax`` collectives is the reference: the
losses must be bitwise equal.

After the run the stale and the re-synthesized schedule are timed against each
other on the degraded fabric (interleaved, medians), which is the recovery
ratio the demo reports.

The summary counts every detection, re-synthesis and swap the controller
made, and calls a detection false when it came before the failure or blames
none of the failed links. It also sets the measured healthy rate
beside two predictions: the schedule's large-message limit
(``predicted_algbw_healthy``, bandwidth only) and the flow-level simulator's
rate at the demo's message size with the fabric's per-hop latencies, which is
what the emulated links can deliver at this size.

Example:
    >>> DemoConfig().steps, DemoConfig().fail_step, DemoConfig().detector
    (40, 12, 'cusum')
    >>> failed_links("two", rail(hosts=2, gpus_per_host=4))
    ((0, 'tor:s0r0'), (5, 'tor:s0r1'))
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

import jaxccl
from jaxccl import sim
from jaxccl.control import DETECTORS, Controller
from jaxccl.errors import ArgumentError
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.topology import rail
from jaxccl.util import report

NUM_DEVICES = 8
SIZES = (128, 512, 512, 128, 16)  # the MLP's layer widths


FAILED_LINK = (0, "tor:s0r0")  # GPU 0's NIC
FAIL_LINKS = ("nic", "nvlink", "two")  # GPU 0's NIC; GPU 0's NVLink uplink; the NICs of GPUs 0 and 5
_FAULTS = {"nic": ((0, "nic"),), "nvlink": ((0, "nvlink"),), "two": ((0, "nic"), (5, "nic"))}
_LINK_NAMES = {"nic": "NIC", "nvlink": "NVLink"}


@dataclasses.dataclass
class DemoConfig:
    """The demo's knobs (the command line sets all but ``lr``, ``batch``, ``alpha``, ``gamma`` and ``ab_runs``).

    ``time_scale`` multiplies the emulated link capacities: at ``1e-4`` one
    AllGather takes ~75 ms of emulated link time, well above this host's
    scheduling noise, so the failure and the recovery stand out per step.
    ``fail_link`` (one of :data:`FAIL_LINKS`) picks the links the failure
    cuts to ``depth`` of their nominal capacity; ``detector`` (one of
    :data:`DETECTORS`) is the controller's decision rule. Bad values raise
    :class:`~jaxccl.errors.ArgumentError`:

    >>> DemoConfig(depth=1.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    jaxccl.errors.ArgumentError: DemoConfig: depth must be a fraction of the nominal capacity in (0, 1), got 1.0
    """

    steps: int = 40
    fail_step: int = 12
    time_scale: float = 1e-4
    lr: float = 0.2
    batch: int = 256
    alpha: float = 0.5
    gamma: float = 0.15
    detector: str = "cusum"
    fail_link: str = "nic"
    depth: float = 0.5  # the failed links' capacity after the failure, as a fraction of nominal
    ab_runs: int = 7
    json: str | None = None
    png: str | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.detector not in DETECTORS:
            raise ArgumentError(f"DemoConfig: detector must be one of {', '.join(DETECTORS)}, got {self.detector!r}")
        if self.fail_link not in FAIL_LINKS:
            raise ArgumentError(f"DemoConfig: fail_link must be one of {', '.join(FAIL_LINKS)}, got {self.fail_link!r}")
        check_depth(self.depth)


def check_depth(depth: Any, name: str = "DemoConfig: depth", error: type[ArgumentError] = ArgumentError) -> float:
    """``depth`` if it is a fraction of the nominal capacity in (0, 1), else ``error`` naming it ``name``.

    >>> check_depth(0.3)
    0.3
    >>> check_depth(float("nan"), "--depth")
    Traceback (most recent call last):
    ...
    jaxccl.errors.ArgumentError: --depth must be a fraction of the nominal capacity in (0, 1), got nan
    """
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 < depth < 1:
        raise error(f"{name} must be a fraction of the nominal capacity in (0, 1), got {depth!r}")
    return float(depth)


def failed_links(fail_link: str, topo: Any) -> tuple[tuple[Any, Any], ...]:
    """The links (GPU, switch) that the failure ``fail_link`` (one of :data:`FAIL_LINKS`) cuts in ``topo``.

    Each GPU's NIC and NVLink uplink are looked up in the topology (``rail``'s link kinds).

    >>> failed_links("nvlink", rail(hosts=2, gpus_per_host=4))
    ((0, 'nvs:h0'),)
    """
    if fail_link not in _FAULTS:
        raise ArgumentError(f"fail_link must be one of {', '.join(FAIL_LINKS)}, got {fail_link!r}")
    g = topo.graph
    return tuple(
        (gpu, next(v for v in g.successors(gpu) if g.edges[gpu, v].get("kind") == kind))
        for gpu, kind in _FAULTS[fail_link]
    )


def failure_label(fail_link: str, depth: float, topo: Any) -> str:
    """The failure in words, for the prints and the PNG.

    >>> t = rail(hosts=2, gpus_per_host=4)
    >>> failure_label("nic", 0.5, t), failure_label("two", 0.35, t)
    ("gray failure: GPU 0's NIC 400 -> 200 Gbps", "gray failure: GPU 0's and GPU 5's NICs 400 -> 140 Gbps")
    >>> failure_label("nvlink", 0.5, t)
    "gray failure: GPU 0's NVLink 2880 -> 1440 Gbps"
    """
    nominal = topo.capacity(*failed_links(fail_link, topo)[0]) * 8 / 1e9
    return f"gray failure: {failed_text(fail_link)} {nominal:.0f} -> {nominal * depth:.0f} Gbps"


def failed_text(fail_link: str) -> str:
    """The failed links of ``fail_link`` in words.

    >>> failed_text("nic"), failed_text("two")
    ("GPU 0's NIC", "GPU 0's and GPU 5's NICs")
    """
    faults = _FAULTS[fail_link]
    gpus = " and ".join(f"GPU {gpu}'s" for gpu, _ in faults)
    return f"{gpus} {_LINK_NAMES[faults[0][1]]}{'s' if len(faults) > 1 else ''}"


def degraded_topology(topo: Any, links: Collection[tuple[Any, Any]], depth: float) -> Any:
    """``topo`` with every link of ``links`` (both directions) at ``depth`` of its capacity."""
    for u, v in links:
        topo = topo.degrade(u, v, capacity=topo.capacity(u, v) * depth)
    return topo


def _model(rng: Any, sizes: tuple[int, ...] = SIZES) -> tuple[list[Any], list[tuple[int, int]]]:
    import numpy as np

    shapes = list(zip(sizes[:-1], sizes[1:]))
    weights = [(rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for s in shapes]
    return weights, shapes


def _batch(rng: Any, batch: int, sizes: tuple[int, ...] = SIZES) -> tuple[Any, Any]:
    """The training batch: random inputs, labels from a random linear teacher (drawn after the weights)."""
    import numpy as np

    x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
    y = np.argmax(x @ rng.standard_normal((sizes[0], sizes[-1])), axis=1).astype(np.int32)
    return x, y


def _flatten(weights: list[Any], multiple: int) -> Any:
    import numpy as np

    flat = np.concatenate([w.ravel() for w in weights])
    pad = (-flat.size) % multiple
    return np.concatenate([flat, np.zeros(pad, np.float32)])


def _programs(
    lib: Any, mesh: Any, shapes: list[tuple[int, int]], cfg: DemoConfig, *, reductions: Any = None
) -> tuple[Any, Any]:
    """The jitted AllGather of the parameters and the training step, with ``lib``'s collectives.

    ``reductions`` (default ``lib``) supplies the gradient reduce-scatter and the loss sum: across
    processes both runs use ``jax.lax`` for them, so that the two runs differ in the AllGather alone
    (the one collective the loop manages).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    red = lib if reductions is None else reductions

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
        g_shard = red.psum_scatter(g, "data", scatter_dimension=0, tiled=True)
        return shard - cfg.lr * g_shard, red.psum(loss, "data")

    gather_fn = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    step_fn = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P("data"), P("data"), P("data"), P("data")), out_specs=(P("data"), P())
        )
    )
    return gather_fn, step_fn


def _say(quiet: bool) -> Callable[..., None]:
    if quiet:
        return lambda *a, **k: None
    return lambda *a, **k: print(*a, **k, flush=True)


def _is_false_detection(event: Any, inject_ns: int, failed_links: Collection[tuple[Any, Any]] = (FAILED_LINK,)) -> bool:
    """A detection before the failure, or one that blames none of the failed links (in either direction)."""
    if not inject_ns or event.time_ns < inject_ns:
        return True
    blamed = event.detail.get("degraded", {})
    return not any(f"{u}->{v}" in blamed or f"{v}->{u}" in blamed for u, v in failed_links)


_DETECTOR_NAMES = {"cusum": "the change-point test (CUSUM on the raw windows)", "ewma": "the settled EWMA"}
_DETECTOR_TITLES = {"cusum": " (change-point test)", "ewma": " (EWMA confirmation)"}


def _describe(event: Any, labels: dict[int, str]) -> str:
    d = event.detail
    if event.kind == "detected":
        links = ", ".join(f"{k} at {100 * f:.0f} %" for k, f in d.get("degraded", {}).items()) or "none below nominal"
        flag = f" (slack deviation {d['max_delta']:.2f})" if "max_delta" in d else ""
        return f"Algorithm 1 flagged the schedule{flag}; measured low: {links}"
    if event.kind == "confirmed" and d.get("detector", "ewma") != "ewma":
        return f"decided by the change-point test {d['confirm_ms']:.0f} ms after the first flag"
    if event.kind == "confirmed":
        return (
            f"confirmed after {d.get('flagged_samples', '?')} flagged samples, {d['confirm_ms']:.0f} ms "
            f"(the EWMA has settled on the new capacity)"
        )
    if event.kind == "held":
        return f"decision held until launch {d.get('until_launch', '?')} (hysteresis: one swap per `hold` launches)"
    if event.kind == "discarded":
        return f"speculative re-synthesis discarded: {d.get('reason', 'the change cleared')}"
    if event.kind == "cleared":
        return f"flag cleared after {d['flagged_samples']} samples (a burst): no action"
    if event.kind == "synthesized":
        return f"re-synthesized warm-started in {d['synth_ms']:.1f} ms, predicted {_rate_text(d['predicted_algbw'])}"
    if event.kind == "staged":
        return f"staged as v{d['version']} (validated + compiled in {d['dispatch_ms']:.1f} ms)"
    if event.kind == "activated":
        return f"v{d['version']} ({labels.get(d['version'], '?')}) active {d['wait_ms']:.0f} ms after staging"
    return f"{event.kind}: {dict(d)}"


def _rate_text(bytes_per_s: float) -> str:
    """``"400 GB/s"`` for the emulated fabric's rates, ``"12.5 MB/s"`` for real sockets'.

    >>> _rate_text(4e11), _rate_text(1.25e7)
    ('400 GB/s', '12.5 MB/s')
    """
    return f"{bytes_per_s / 1e9:.0f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.1f} MB/s"


def _simulated(topo: Any, schedule: Any, bytes_per_rank: float) -> tuple[float, float]:
    """The flow-level simulator's algbw at the demo's size: as the executor runs (dataflow), and in order."""
    dataflow = sim.run(topo, schedule, bytes_per_rank, execution="dataflow").algbw
    in_order = sim.run(topo, schedule, bytes_per_rank, execution="in_order").algbw
    return float(dataflow), float(in_order)


def run(cfg: DemoConfig) -> dict[str, Any]:
    """Runs the demo; returns the JSON-ready result (also written to ``cfg.json``)."""
    if cfg.png:
        import matplotlib  # noqa: F401  (a missing matplotlib fails here, not after the run)
    say = _say(cfg.quiet)
    say(f"jaxccl demo: starting {NUM_DEVICES} emulated CPU devices (JAX on this host's CPU) ...")
    jaxccl.emulate(NUM_DEVICES)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    topo = rail(hosts=2, gpus_per_host=4)
    links = failed_links(cfg.fail_link, topo)
    label = failure_label(cfg.fail_link, cfg.depth, topo)
    failed = degraded_topology(topo, links, cfg.depth)
    rng = np.random.default_rng(0)
    weights, shapes = _model(rng)
    flat = _flatten(weights, NUM_DEVICES)
    x, y = _batch(rng, cfg.batch)
    sharding = NamedSharding(mesh, P("data"))
    xb, yb = jax.device_put(x, sharding), jax.device_put(y, sharding)
    out_bytes = flat.size * 4  # one rank's AllGather output

    say(f"synthesizing the AllGather for the healthy fabric ({topo.name}) ...")
    comm = jaxccl.Communicator(
        mesh,
        "data",
        topology=topo,
        backend="cpu",
        link_emulation=LinkEmulation(time_scale=cfg.time_scale),
        telemetry_alpha=cfg.alpha,
    )
    healthy_schedule = jaxccl.synth.all_gather(topo)
    comm.install("all_gather", healthy_schedule)
    healthy_version = native.swap_state(comm.slot("all_gather"))["staged_version"] or native.current_version(
        comm.slot("all_gather")
    )
    labels = {healthy_version: "healthy"}
    sim_dataflow, sim_in_order = _simulated(topo, healthy_schedule, out_bytes / NUM_DEVICES)
    say(
        f"  schedule v{healthy_version} = {healthy_schedule.name} for the healthy fabric (v1 is the communicator's "
        f"default direct AllGather); predicted {healthy_schedule.algbw / 1e9:.0f} GB/s for large messages, "
        f"{sim_dataflow / 1e9:.0f} GB/s simulated at this size"
    )
    say(
        f"  MLP {SIZES} ({out_bytes / 2**20:.1f} MiB of parameters), FSDP over {NUM_DEVICES} emulated devices, "
        f"links at {cfg.time_scale:g} x their speed; at step {cfg.fail_step} a {label}; "
        f"the controller decides with {_DETECTOR_NAMES[cfg.detector]}"
    )

    say(f"running the jax.lax reference ({cfg.steps} steps, no emulation) ...")
    ref_gather, ref_step = _programs(jax.lax, mesh, shapes, cfg)
    shard = jax.device_put(flat, sharding)
    ref_losses = []
    for _ in range(cfg.steps):
        shard, loss = ref_step(shard, ref_gather(shard), xb, yb)
        ref_losses.append(np.asarray(loss))

    say("compiling the jaxccl training step ...")
    gather_fn, step_fn = _programs(jaxccl, mesh, shapes, cfg)
    shard = jax.device_put(flat, sharding)
    with comm:  # compile and warm up outside the timeline
        gather_fn(shard).block_until_ready()
    comm.telemetry()
    controller = Controller(comm, gamma=cfg.gamma, interval_s=0.01, detector=cfg.detector)
    rows: list[dict[str, Any]] = []
    losses = []
    inject_ns = 0
    told = 0
    say(f"training {cfg.steps} steps; the controller watches the measured links meanwhile")
    controller.start()
    try:
        with comm:
            for step in range(cfg.steps):
                if step == cfg.fail_step:
                    comm.inject(failed)
                    inject_ns = time.monotonic_ns()
                start_ns = time.monotonic_ns()
                t0 = time.perf_counter()
                full = gather_fn(shard)
                full.block_until_ready()
                t_ag = time.perf_counter() - t0
                version = native.last_launch_version(comm.slot("all_gather"))
                labels.setdefault(version, f"re-synthesized #{len(labels)}")
                shard, loss = step_fn(shard, full, xb, yb)
                losses.append(np.asarray(loss))
                algbw = out_bytes / t_ag / cfg.time_scale
                rows.append(
                    {
                        "step": step,
                        "start_ns": start_ns,
                        "loss": float(losses[-1]),
                        "ag_ms": t_ag * 1e3,
                        "algbw": algbw,
                        "version": version,
                        "schedule": labels[version],
                    }
                )
                say(
                    f"step {step:3d}  loss {float(losses[-1]):.5f}  allgather {t_ag * 1e3:7.1f} ms  "
                    f"algbw {algbw / 1e9:6.1f} GB/s (emulated)  schedule v{version} ({labels[version]})"
                    + ("   <- gray failure injected" if step == cfg.fail_step else "")
                )
                events = controller.events
                for e in events[told:]:
                    if e.kind == "staged":
                        labels.setdefault(e.detail["version"], f"re-synthesized #{len(labels)}")
                    say(f"          controller: {_describe(e, labels)}")
                told = len(events)
    finally:
        controller.stop()

    events = controller.events
    for e in events[told:]:
        say(f"          controller: {_describe(e, labels)}")
    versions = [r["version"] for r in rows]
    v0 = versions[0]
    swap_step = next(iter(swap_steps_of(rows)), None)

    new_schedule = comm.schedule("all_gather")
    ab: dict[str, list[float]] = {"stale": [], "recovered": []}
    if swap_step is not None:
        say(f"A/B on the degraded fabric: stale v{v0} vs re-synthesized v{versions[-1]}, {cfg.ab_runs} rounds ...")
        with comm:
            for _ in range(cfg.ab_runs):
                for key, s in (("stale", healthy_schedule), ("recovered", new_schedule)):
                    comm.install("all_gather", s)
                    gather_fn(shard).block_until_ready()  # the first call activates the staged schedule
                    t0 = time.perf_counter()
                    gather_fn(shard).block_until_ready()
                    ab[key].append(out_bytes / (time.perf_counter() - t0) / cfg.time_scale)
    matches = len(losses) == len(ref_losses) and all(a.tobytes() == b.tobytes() for a, b in zip(losses, ref_losses))

    reaction = reaction_fields(rows, events, inject_ns, cfg.fail_step, ab, failed_links=links, detector=cfg.detector)
    algbw_healthy = reaction["algbw_healthy"]
    result = {
        **reaction,
        "bytes_per_rank": out_bytes // NUM_DEVICES,
        "predicted_algbw_healthy": healthy_schedule.algbw,
        "predicted_algbw_recovered": new_schedule.algbw,
        "simulated_algbw_healthy": sim_dataflow,
        "simulated_algbw_healthy_in_order": sim_in_order,
        "measured_over_predicted": algbw_healthy / healthy_schedule.algbw,
        "measured_over_simulated": algbw_healthy / sim_dataflow,
        "predicted_note": (
            "predicted_algbw_healthy is the schedule's large-message limit (bytes over link bandwidth, no latency); "
            "simulated_algbw_healthy is the flow-level simulator at this demo's message size with the fabric's "
            "per-hop latencies, executing as the executor does (dataflow: no head-of-line blocking; _in_order: "
            "MSCCL's in-order threadblocks, for comparison); the measured rate is compared with both"
        ),
        "failed_links": [f"{u}->{v}" for u, v in links],
        "failure_label": label,
        "loss_matches_reference": bool(matches),
        "losses": [float(v) for v in losses],
        "steps": rows,
        "schedules": {f"v{v}": label for v, label in labels.items()},
        "events": [e.to_dict() for e in events if e.kind != "error"] + [e.to_dict() for e in controller.errors],
        "config": dataclasses.asdict(cfg),
        "time_scale_note": "algbw in emulated bytes/s: real bytes/s divided by time_scale",
    }
    _summary(result, print, failed=failed_text(cfg.fail_link))
    write_outputs(result, cfg)
    return result


def write_outputs(result: dict[str, Any], cfg: Any) -> None:
    """Writes a demo's ``result`` as ``cfg.json`` and its timeline as ``cfg.png`` (each when set)."""
    if cfg.json:
        report.write_json(cfg.json, result)
        print(f"wrote {cfg.json}")
    if cfg.png:
        _timeline_png(result, cfg.png)
        print(f"wrote {cfg.png}")
    sys.stdout.flush()


def swap_steps_of(rows: list[dict[str, Any]]) -> list[int]:
    """The steps whose AllGather ran another table version than the step before.

    >>> swap_steps_of([{"step": 0, "version": 2}, {"step": 1, "version": 2}, {"step": 2, "version": 3}])
    [2]
    """
    return [r["step"] for prev, r in zip(rows, rows[1:]) if r["version"] != prev["version"]]


def reaction_fields(
    rows: list[dict[str, Any]],
    events: list[Any],
    inject_ns: int,
    fail_step: int | None,
    ab: dict[str, list[float]],
    *,
    failed_links: Collection[tuple[Any, Any]] = (FAILED_LINK,),
    detector: str | None = None,
) -> dict[str, Any]:
    """The demo's rates and reaction times from its per-step rows, the controller's events and the A/B.

    Shared by the single-process and the real-socket demo. ``rows`` hold ``step``, ``start_ns``,
    ``algbw`` and ``version`` per training step; ``events`` are the controller's events;
    ``inject_ns`` is the failure's ``time.monotonic_ns()`` (0 and ``fail_step`` ``None``: no
    failure, so every detection is a false one); ``ab`` the A/B rates ``stale`` and ``recovered``.
    ``failed_links`` are the links the failure degraded (default: GPU 0's NIC); a
    detection that blames none of them is a false one. ``detector`` (``"cusum"``, ``"ewma"``)
    defaults to what the first confirmation after the failure names.

    ``steps_to_active`` counts the steps from the first degraded one (``fail_step``) to the first
    that ran another schedule (1: the next step); ``staged_after_change_ms`` runs from the first
    degraded measurement the controller saw (the confirmation's ``change_ns``) to staging.

    >>> rows = [{"step": k, "start_ns": k, "algbw": 4.0 if k < 3 else 1.0, "version": 2} for k in range(5)]
    >>> r = reaction_fields(rows, [], 0, None, {"stale": [], "recovered": []})
    >>> r["swaps"], r["detections"], r["algbw_healthy"], r["steps_to_active"], r["detector"]
    (0, 0, 1.0, None, None)
    """
    after = [e for e in events if inject_ns and e.time_ns >= inject_ns]
    detections = [e for e in events if e.kind == "detected"]
    first = {k: next((e for e in after if e.kind == k), None) for k in ("detected", *_REACTION_KINDS)}
    swap_steps = swap_steps_of(rows)
    swap_step = swap_steps[0] if swap_steps else None
    v0 = rows[0]["version"]
    healthy = [r["algbw"] for r in rows if r["step"] >= 2 and (fail_step is None or r["step"] < fail_step)]
    stale = [r["algbw"] for r in rows if fail_step is not None and r["step"] > fail_step and r["version"] == v0]
    recovered = [r["algbw"] for r in rows if swap_step is not None and r["step"] > swap_step]
    algbw_stale = report.median(ab["stale"]) if ab["stale"] else report.median(stale)
    algbw_recovered = report.median(ab["recovered"]) if ab["recovered"] else float("nan")
    detected, confirmed, staged = first["detected"], first["confirmed"], first["staged"]

    def ms(e: Any, key: str) -> float:
        return float(e.detail[key]) if e is not None and key in e.detail else math.nan

    def since(e: Any, t0_ns: Any) -> float:
        return (e.time_ns - t0_ns) / 1e6 if e is not None and t0_ns else math.nan

    change_ns = confirmed.detail.get("change_ns") if confirmed is not None else None

    return {
        "algbw_healthy": report.median(healthy),
        "algbw_stale": algbw_stale,
        "algbw_recovered": algbw_recovered,
        "recovery_ratio": algbw_recovered / algbw_stale if algbw_stale else float("nan"),
        "ab_stale": ab["stale"],
        "ab_recovered": ab["recovered"],
        "algbw_stale_timeline": report.median(stale),
        "algbw_recovered_timeline": report.median(recovered),
        "detect_ms": since(detected, inject_ns),
        "detections": len(detections),
        "false_detections": sum(1 for e in detections if _is_false_detection(e, inject_ns, failed_links)),
        "resyntheses": sum(1 for e in events if e.kind == "synthesized"),
        "swaps": len(swap_steps),
        "swap_steps": swap_steps,
        "confirm_ms": ms(confirmed, "confirm_ms"),
        "synth_ms": ms(first["synthesized"], "synth_ms"),
        "dispatch_ms": ms(staged, "dispatch_ms"),
        "swap_ms": ms(staged, "swap_ms"),
        "activation_wait_ms": ms(first["activated"], "wait_ms"),
        "staged_after_change_ms": since(staged, change_ns),
        "failure_to_staged_ms": since(staged, inject_ns),
        "swap_step": swap_step,
        "steps_to_active": swap_step - fail_step if swap_step is not None and fail_step is not None else None,
        "detector": detector or (confirmed.detail.get("detector") if confirmed is not None else None),
        "fail_step": fail_step,
        "detect_step": _step_at(rows, detected.time_ns) if detected is not None else None,
        "confirm_step": _step_at(rows, confirmed.time_ns) if confirmed is not None else None,
    }


_REACTION_KINDS = ("confirmed", "synthesized", "staged", "activated")


def _step_at(rows: list[dict[str, Any]], t_ns: int) -> float:
    """The (fractional) step at monotonic time ``t_ns``: step k starts at k.0."""
    for a, b in zip(rows, rows[1:]):
        if a["start_ns"] <= t_ns < b["start_ns"]:
            return a["step"] + (t_ns - a["start_ns"]) / (b["start_ns"] - a["start_ns"])
    return float(rows[-1]["step"]) if t_ns >= rows[-1]["start_ns"] else float(rows[0]["step"])


def reaction_summary(r: dict[str, Any], say: Any, *, failed: str = "GPU 0's NIC", unit: str = "GB/s") -> None:
    """Prints the loss check, the controller's counts, its first reaction and the algbw before/after.

    Shared by the single-process and the real-socket demo; ``unit`` is ``"GB/s"`` or ``"MB/s"``.

    >>> r = dict(loss_matches_reference=True, detections=1, false_detections=0, resyntheses=1, swaps=1,
    ...     swap_steps=[9], detect_ms=5.0, confirm_ms=9.0, synth_ms=3.0, dispatch_ms=1.0, swap_ms=0.1, swap_step=9,
    ...     algbw_healthy=4e6, algbw_stale=1e6, algbw_recovered=3e6, recovery_ratio=3.0)
    >>> reaction_summary(r, print, unit="MB/s")  # doctest: +ELLIPSIS
    <BLANKLINE>
    loss curve equals the jax.lax reference bitwise: yes
    ...
    algbw healthy 4.0 MB/s; after the failure: stale schedule 1.0 MB/s, re-synthesized 3.0 MB/s (3.00x; ...)

    With the change-point test (``detector="cusum"``) the reaction names it and counts the steps:

    >>> r.update(detector="cusum", fail_step=8, steps_to_active=1, staged_after_change_ms=14.2)
    >>> reaction_summary(r, print, unit="MB/s")  # doctest: +ELLIPSIS
    <BLANKLINE>
    ...
    first reaction: detection 5.0 ms after the failure, decided by the change-point test (+9.0 ms), ...
      active from step 9: 1 step(s) after the first degraded step; staged 14.2 ms after the first degraded measurement
    ...
    """
    g = {"GB/s": 1e9, "MB/s": 1e6}[unit]
    say("")
    say(f"loss curve equals the jax.lax reference bitwise: {'yes' if r['loss_matches_reference'] else 'NO'}")
    if r.get("fail_step", 0) is None:  # a run without a failure: what the loop did on healthy links
        say(
            f"no failure injected: algbw {r['algbw_healthy'] / g:.1f} {unit}; the controller flagged "
            f"{r['detections']} time(s) and swapped {r['swaps']} time(s)"
        )
        return
    say(
        f"controller: {r['detections']} detection(s), {r['false_detections']} false (before the failure or not "
        f"blaming {failed}), {r['resyntheses']} re-synthesis(es), {r['swaps']} swap(s) at step(s) "
        f"{', '.join(map(str, r['swap_steps'])) or '-'}"
    )
    say(
        f"first reaction: detection {r['detect_ms']:.1f} ms after the failure, "
        f"{decision_text(r.get('detector'), r['confirm_ms'])}, synthesis {r['synth_ms']:.1f} ms, "
        f"dispatch (validate + compile) {r['dispatch_ms']:.2f} ms, swap (stage) {r['swap_ms']:.3f} ms"
    )
    if "steps_to_active" in r:
        say(
            f"  active from step {r['swap_step']}: {r['steps_to_active']} step(s) after the first degraded step; "
            f"staged {r['staged_after_change_ms']:.1f} ms after the first degraded measurement"
            if r["swap_step"] is not None
            else "  no new schedule became active"
        )
    else:  # a result of before steps_to_active
        say(f"  active from step {r['swap_step']}")
    say(
        f"algbw healthy {r['algbw_healthy'] / g:.1f} {unit}; after the failure: stale schedule "
        f"{r['algbw_stale'] / g:.1f} {unit}, re-synthesized {r['algbw_recovered'] / g:.1f} {unit} "
        f"({r['recovery_ratio']:.2f}x; A/B medians on the degraded fabric)"
    )


def decision_text(detector: str | None, confirm_ms: float) -> str:
    """How the controller decided, for the summary and the PNG (``None``: a result of the EWMA-only days).

    >>> decision_text("ewma", 1402.4), decision_text("cusum", 21.0)
    ('confirmed, EWMA settled (+1402 ms)', 'decided by the change-point test (+21 ms)')
    >>> decision_text("cusum", 0.34)
    'decided by the change-point test (+0.3 ms)'
    """
    how = "decided by the change-point test" if detector == "cusum" else "confirmed, EWMA settled"
    return f"{how} (+{confirm_ms:.{0 if confirm_ms >= 10 else 1}f} ms)"


def _summary(r: dict[str, Any], say: Any, *, failed: str) -> None:
    g = 1e9
    reaction_summary(r, say, failed=failed)
    say(
        f"healthy rate vs prediction: measured {r['algbw_healthy'] / g:.0f} GB/s = {r['measured_over_predicted']:.2f} "
        f"of the large-message limit {r['predicted_algbw_healthy'] / g:.0f} GB/s; at this size "
        f"({report.format_bytes(r['bytes_per_rank'])} per rank) "
        f"the per-hop latencies cap it: the simulator gives {r['simulated_algbw_healthy'] / g:.0f} GB/s executing "
        f"as the executor does ({r['simulated_algbw_healthy_in_order'] / g:.0f} GB/s with in-order threadblocks), so "
        f"the measurement is {r['measured_over_simulated']:.2f} of that"
        + (
            " (the executor cuts relayed chunks into tiles that pipeline across hops, which the simulator does not "
            "model)"
            if r["measured_over_simulated"] > 1
            else "; the rest is host overhead (2 cores run 8 ranks)"
        )
    )


def _timeline_png(r: dict[str, Any], path: str) -> None:
    """The story in one picture: per-step algbw from 0, the failure, detection, confirmation, swap, and the A/B."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    unit = r.get("algbw_unit", "GB/s")
    g = {"GB/s": 1e9, "MB/s": 1e6}[unit]
    steps = [row["step"] for row in r["steps"]]
    bw = [row["algbw"] / g for row in r["steps"]]
    last = steps[-1]
    fail = r["fail_step"] if r["fail_step"] is not None else last  # None: a run without a failure
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ax.plot(steps, bw, marker=".", color="tab:blue", lw=1.2, label="AllGather algbw of each training step")
    healthy = r["algbw_healthy"] / g
    ax.hlines(healthy, 0, fail, colors="tab:blue", linestyles=":", lw=1)
    ax.text(0.2, healthy * 1.03, f"healthy: {healthy:.0f} {unit}", color="tab:blue", fontsize=8, va="bottom")
    failure = r.get("failure_label", "gray failure: GPU 0's NIC 400 -> 200 Gbps")
    if r["fail_step"] is not None:
        ax.axvline(fail, color="tab:red", ls="--", lw=1.5, label=failure)
    if r["detect_step"] is not None:
        ax.axvline(
            r["detect_step"], color="tab:orange", ls=":", lw=2, label=f"detected ({r['detect_ms']:.0f} ms later)"
        )
    confirm_step = r.get("confirm_step")
    if confirm_step is not None:
        ax.axvline(
            confirm_step,
            color="tab:orange",
            ls="-.",
            lw=1.5,
            label=decision_text(r.get("detector"), r["confirm_ms"]),
        )
    active = "re-synthesized schedule active"
    if r.get("steps_to_active") is not None:
        active += f" ({r['steps_to_active']} step(s) after the first degraded one)"
    for k, s in enumerate(r["swap_steps"]):
        ax.axvline(s, color="tab:green", ls="--", lw=1.5, label=active if k == 0 else None)
    bands = (
        ("ab_stale", "tab:red", "stale schedule"),
        ("ab_recovered", "tab:green", "re-synthesized"),
    )
    for key, color, name in bands:
        values = [v / g for v in r[key]]
        if values:
            lo, med, hi = min(values), report.median(values), max(values)
            ax.fill_between([fail + 0.5, last + 0.5], lo, hi, color=color, alpha=0.15, lw=0)
            ax.hlines(med, fail + 0.5, last + 0.5, colors=color, lw=2.5)
            ax.text(
                last + 0.3,
                med * 0.97,
                f"A/B after the run, {name}: {med:.0f} {unit}",
                color=color,
                ha="right",
                va="top",
                fontsize=8,
                fontweight="bold",
            )
    ax.set_xlim(-0.5, last + 0.5)
    ax.set_ylim(0, max([*bw, healthy]) * 1.25)
    ax.set_xlabel("training step")
    ax.set_ylabel(r.get("algbw_axis_label", f"algbw, emulated {unit}"))
    detector = _DETECTOR_TITLES.get(r.get("detector"), "")
    ax.set_title(
        f"jaxccl demo: a gray failure, detected{detector}, re-synthesized and hot-swapped\n"
        f"on the degraded fabric the re-synthesized schedule runs {r['recovery_ratio']:.2f}x the stale one "
        "(A/B: line = median, band = min-max)",
        fontsize=10,
    )
    ax.legend(loc="lower left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
