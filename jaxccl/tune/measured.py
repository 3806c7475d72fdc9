"""Measured forced-arm pools: every (context, arm) timed by the native CPU executor on emulated links.

The counterpart of :func:`jaxccl.tune.replay.simulate_pools` on this machine.
One communicator (``backend="cpu"``) spans a rail fabric
(:func:`jaxccl.topology.rail`, ``hosts`` x ``gpus_per_host`` emulated CPU
devices) whose links the executor paces at their capacities times
``time_scale`` (:class:`jaxccl.runtime.emulated.LinkEmulation`). Each fabric
(healthy, or MCCL's fail1/fail2/fail3 on GPU 0, the scenarios of the simulated
pools) is injected into the running communicator in turn
(:meth:`~jaxccl.runtime.communicator.Communicator.inject`); the arms of
:func:`jaxccl.tune.arms.arm_catalog` are built for the *healthy* fabric, as a
communicator installs them before a failure.

**One sample** of an arm is one call of its collective: the executor's own
launch time (:func:`jaxccl.runtime.native.last_launch_seconds`: from the
launch's start, once every rank's call has arrived, to the last rank's end,
so the slowest rank sets it and host-side dispatch does not count); an arm of
several parts (AllReduce as ReduceScatter then AllGather) runs them back to
back in one program and its sample is the sum of the two launches. Samples
are taken round-robin: each round runs every arm of the context once (a
hot-swap before each call, nothing recompiles), so a change of the machine's
load falls on all arms alike. The version each launch ran is checked against
the one staged for the arm. Times are stored in the *fabric's* seconds (real
seconds x ``time_scale``), the unit of the simulated pools and of the cost
model; the host's own work (copies, thread wake-ups) is part of them.

**Check.** Once per (context, arm), on random non-zero data, the arm's result
is compared bitwise with ``jax.lax``'s: float32 normal samples where the arm is
exact (AllGather, and reductions whose parts all sum in ascending rank order,
``info["ordered_reduction"]``), int32 random bits otherwise (wrapping integer
sums are exact in any order). A mismatch raises :class:`TuneError`.

The result is a :class:`~jaxccl.tune.replay.Pools` (``sim_s`` holds each arm's
median sample; no model predictions yet) that :func:`save_pools` writes in
:func:`~jaxccl.tune.replay.load_pools`'s format, with the measurement's
description added to the metadata (:func:`read_measurement`).

Example (needs JAX with at least 4 devices; seconds on 2 cores):
    >>> cfg = MeasureConfig(gpus_per_host=2, sizes=(1 << 12,), fabrics=("healthy",),
    ...                     collectives=("all_gather",), samples=11)
    >>> pools = measure_pools(cfg, show_progress=False)  # doctest: +SKIP
    >>> pools.samples.shape  # doctest: +SKIP
    (1, 5, 11)
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxccl.topology import rail, scenario
from jaxccl.tune.arms import COLLECTIVES, Arm, Context, TuneError, arm_catalog, arm_names, exact_arm
from jaxccl.tune.replay import POOL_SCHEMA, SCENARIOS, STEADY_FROM, PoolConfig, Pools
from jaxccl.util.report import progress

__all__ = [
    "MEASURED_SOURCE",
    "SPLITS",
    "MeasureConfig",
    "measure_pools",
    "parse_fabrics",
    "read_measurement",
    "save_pools",
]

#: ``"source"`` of a measured pools file's metadata (simulated pools have none).
MEASURED_SOURCE = "measured"
#: How contexts are split into train (calibration, tuning) and test (scoring); see :class:`MeasureConfig`.
SPLITS = ("size_parity", "scenario")
AXIS = "d"
_MAX_SAMPLES = 10_000


def _default_sizes() -> tuple[int, ...]:
    return tuple(4 << (10 + 2 * k) for k in range(7))  # 4 KiB .. 16 MiB, every 4x


@dataclasses.dataclass(frozen=True)
class MeasureConfig:
    """What :func:`measure_pools` measures.

    Attributes:
        hosts, gpus_per_host: the rail fabric (``hosts * gpus_per_host`` emulated devices).
        collectives: from :data:`jaxccl.tune.arms.COLLECTIVES`.
        fabrics: from ``healthy``, ``fail1``, ``fail2``, ``fail3`` (MCCL's scenarios on GPU 0).
        sizes: message sizes in bytes (nccl-tests convention, :class:`~jaxccl.tune.arms.Context`); each
            must give every rank a whole number of float32 elements.
        samples: measured calls per (context, arm) after the warm-up; more than the 10-sample transient
            window of the replay's steady means.
        warmup: unrecorded rounds per context (the first calls of a new program or size).
        time_scale: emulated link capacities x this (:class:`~jaxccl.runtime.emulated.LinkEmulation`).
        split: ``"size_parity"``: train = the 1st, 3rd, ... size, test = the others, every fabric in both
            (test sizes lie between train sizes); ``"scenario"``: train = healthy and fail1, test = fail2
            and fail3.
        seed: seeds the check data.
    """

    hosts: int = 2
    gpus_per_host: int = 4
    collectives: tuple[str, ...] = COLLECTIVES
    fabrics: tuple[str, ...] = SCENARIOS
    sizes: tuple[int, ...] = dataclasses.field(default_factory=_default_sizes)
    samples: int = 50
    warmup: int = 2
    time_scale: float = 1e-3
    split: str = "size_parity"
    seed: int = 2026

    def __post_init__(self) -> None:
        for name in ("collectives", "fabrics", "sizes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("hosts", "gpus_per_host"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TuneError(f"MeasureConfig.{name} must be a positive integer, got {value!r}")
        if self.num_ranks < 2:
            raise TuneError(f"MeasureConfig: a fabric of {self.num_ranks} GPU has nothing to measure")
        bad = [c for c in self.collectives if c not in COLLECTIVES]
        if bad or not self.collectives:
            raise TuneError(f"unknown collective(s) {bad}; expected some of {list(COLLECTIVES)}")
        bad = [f for f in self.fabrics if f not in SCENARIOS]
        if bad or not self.fabrics:
            raise TuneError(f"unknown fabric(s) {bad}; expected some of {list(SCENARIOS)}")
        if len(set(self.fabrics)) != len(self.fabrics) or len(set(self.collectives)) != len(self.collectives):
            raise TuneError("MeasureConfig: fabrics and collectives must not repeat")
        if not self.sizes or len(set(self.sizes)) != len(self.sizes):
            raise TuneError(f"MeasureConfig: sizes must be distinct and at least one, got {self.sizes}")
        unit = 4 * self.num_ranks
        for n in self.sizes:
            if isinstance(n, bool) or not isinstance(n, int) or n < unit or n % unit:
                raise TuneError(
                    f"size {n!r}: must be a positive multiple of {unit} B (float32 x {self.num_ranks} ranks)"
                )
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples <= STEADY_FROM:
            raise TuneError(
                f"samples must be an integer above {STEADY_FROM} (the replay's steady mean starts at sample "
                f"{STEADY_FROM + 1}), got {self.samples!r}"
            )
        if self.samples > _MAX_SAMPLES:
            raise TuneError(f"samples must be at most {_MAX_SAMPLES}, got {self.samples}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise TuneError(f"warmup must be a non-negative integer, got {self.warmup!r}")
        if not 1e-9 <= self.time_scale <= 1:
            raise TuneError(f"time_scale must be in [1e-9, 1], got {self.time_scale!r}")
        if self.split not in SPLITS:
            raise TuneError(f"unknown split {self.split!r}; expected one of {list(SPLITS)}")

    @property
    def num_ranks(self) -> int:
        return self.hosts * self.gpus_per_host

    def topology(self) -> Any:
        """The healthy rail fabric."""
        return rail(hosts=self.hosts, gpus_per_host=self.gpus_per_host)

    def split_of(self, fabric: str, size: int) -> str:
        """``"train"`` or ``"test"`` for a context on ``fabric`` at ``size`` (see :attr:`split`).

        >>> cfg = MeasureConfig()
        >>> [cfg.split_of("healthy", n) for n in cfg.sizes[:3]], cfg.split_of("fail3", cfg.sizes[0])
        (['train', 'test', 'train'], 'train')
        """
        if self.split == "scenario":
            return "train" if fabric in ("healthy", "fail1") else "test"
        return "train" if sorted(self.sizes).index(size) % 2 == 0 else "test"

    def pool_config(self) -> PoolConfig:
        """The :class:`PoolConfig` a measured :class:`Pools` carries (no noise, no synthetic transient)."""
        return PoolConfig(
            collectives=self.collectives,
            hosts=(self.hosts,),
            train_hosts=(self.hosts,),
            gpus_per_host=self.gpus_per_host,
            scenarios=self.fabrics,
            sizes=self.sizes,
            depth=self.samples,
            noise_sigma=0.0,
            transient_steps=0,
            transient_factor=1.0,
            seed=self.seed,
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


# ---------------------------------------------------------------------------- programs
def _body(parts: tuple[str, ...], lib: Any) -> Callable[[Any], Any]:
    """The per-device function running ``parts`` (collective names) of ``lib`` back to back over :data:`AXIS`."""

    def one(name: str, v: Any) -> Any:
        if name == "all_gather":
            return lib.all_gather(v, AXIS, tiled=True)
        if name == "reduce_scatter":
            return lib.psum_scatter(v, AXIS, scatter_dimension=0, tiled=True)
        return lib.psum(v, AXIS)

    def run(v: Any) -> Any:
        for name in parts:
            v = one(name, v)
        return v

    return run


class _Programs:
    """Jitted programs over the mesh, one per (parts, library), shared by arms (jit compiles each shape once)."""

    def __init__(self, mesh: Any, comm: Any):
        self.mesh, self.comm = mesh, comm
        self._cache: dict[tuple[Any, ...], Callable[[Any], Any]] = {}

    def get(self, parts: tuple[str, ...], ours: bool) -> Callable[[Any], Any]:
        key = (parts, ours)
        fn = self._cache.get(key)
        if fn is None:
            import jax  # JAX starts only once the device count is set
            from jax.sharding import PartitionSpec as P

            import jaxccl.runtime.collectives as jc

            lib = jc if ours else jax.lax
            fn = jax.jit(jax.shard_map(_body(parts, lib), mesh=self.mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
            self._cache[key] = fn
        return fn


def _parts_key(arm: Arm) -> tuple[str, ...]:
    return tuple(p.collective.value for p in arm.parts)


def _input(mesh: Any, ctx: Context, dtype: str, rng: np.random.Generator | None) -> Any:
    """The global input of a context: per rank ``part_bytes`` of the arm's first collective; ones if no ``rng``."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    per_rank = int(ctx.part_bytes(ctx.collective)) // 4
    shape = (ctx.num_ranks * per_rank,)
    if rng is None:
        values = np.ones(shape, dtype=dtype)
    elif dtype == "float32":
        values = (rng.standard_normal(shape) * 1000).astype(np.float32)
        values[values == 0] = 1.0
    else:
        values = rng.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max, size=shape, dtype=np.int32)
        values[values == 0] = 1
    return jax.device_put(values, NamedSharding(mesh, P(AXIS)))


def _bitwise_equal(a: Any, b: Any) -> bool:
    x, y = np.asarray(a), np.asarray(b)
    return x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()


# ---------------------------------------------------------------------------- measuring
class _Runner:
    """Stages an arm's parts in the communicator's slots and times one call of them."""

    def __init__(self, comm: Any, programs: _Programs):
        self.comm, self.programs = comm, programs
        self._staged: dict[str, tuple[str, int]] = {}  # collective -> (schedule digest, version staged)

    def stage(self, arm: Arm) -> list[tuple[int, int]]:
        """Makes ``arm``'s parts the active schedules; returns (slot, version) per part."""
        out = []
        for part in arm.parts:
            coll = part.collective.value
            held = self._staged.get(coll)
            if held is None or held[0] != part.digest:
                version = self.comm.stage_validated(coll, part)
                held = (part.digest, int(version))
                self._staged[coll] = held
            out.append((self.comm.slot(coll), held[1]))
        return out

    def time(self, arm: Arm, x: Any) -> float:
        """Real seconds of one call of ``arm`` on ``x``: the executor's launch time, summed over parts."""
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

        slots = self.stage(arm)
        fn = self.programs.get(_parts_key(arm), ours=True)
        with self.comm:
            fn(x).block_until_ready()
        total = 0.0
        for slot, version in slots:
            ran = native.last_launch_version(slot)
            if ran != version:
                raise TuneError(f"arm {arm.name!r}: slot {slot} ran table version {ran}, not the staged {version}")
            total += native.last_launch_seconds(slot)
        return total

    def check(self, arm: Arm, ctx: Context, mesh: Any, seed: int) -> str:
        """Compares ``arm``'s result bitwise with ``jax.lax``'s on random data; returns the dtype checked."""
        dtype = "float32" if exact_arm(arm) else "int32"
        x = _input(mesh, ctx, dtype, np.random.default_rng(seed))
        self.stage(arm)
        with self.comm:
            ours = self.programs.get(_parts_key(arm), ours=True)(x)
        ref_parts = ("all_reduce",) if ctx.collective == "all_reduce" else (ctx.collective,)
        ref = self.programs.get(ref_parts, ours=False)(x)
        if not _bitwise_equal(ours, ref):
            diff = int(np.count_nonzero(np.asarray(ours).view(np.uint8) != np.asarray(ref).view(np.uint8)))
            raise TuneError(f"{ctx.key} arm {arm.name!r}: result differs from jax.lax ({dtype}, {diff} bytes)")
        return dtype


def _load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return None


def measure_pools(
    config: MeasureConfig | None = None,
    *,
    show_progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> Pools:
    """Measures every (fabric, collective, size, arm) of ``config`` (see the module docstring).

    JAX must expose at least ``config.num_ranks`` devices (:func:`jaxccl.emulate` before JAX starts); the
    first ``num_ranks`` form the mesh. The measurement's description (fabric, time scale, load averages,
    checks, wall time) is in ``pools.model["measurement"]`` until :func:`save_pools` moves it to the file's
    metadata.

    Raises:
        TuneError: too few devices, or an arm whose result differs from ``jax.lax``'s.
    """
    cfg = config or MeasureConfig()
    import jax  # JAX starts here: the caller has set the device count
    from jax.sharding import Mesh

    from jaxccl.runtime.communicator import Communicator
    from jaxccl.runtime.emulated import LinkEmulation

    devices = jax.devices()
    if len(devices) < cfg.num_ranks:
        raise TuneError(f"a rail {cfg.hosts}x{cfg.gpus_per_host} needs {cfg.num_ranks} devices, JAX has {len(devices)}")
    mesh = Mesh(np.array(devices[: cfg.num_ranks]), (AXIS,))
    healthy = cfg.topology()
    fabrics = {f: healthy if f == "healthy" else scenario(healthy, f) for f in cfg.fabrics}
    catalogs = {c: arm_catalog(c, healthy) for c in cfg.collectives}
    for arms in catalogs.values():
        for arm in arms:
            for part in arm.parts:
                part.validate()  # once: later swaps skip the interpreter
    names = {c: arm_names(c) for c in cfg.collectives}
    width = max(len(v) for v in names.values())
    load_before = _load_average()
    t0 = time.perf_counter()
    comm = Communicator(
        mesh,
        AXIS,
        topology=healthy,
        backend="cpu",
        link_emulation=LinkEmulation(time_scale=cfg.time_scale, measure=False),
        fuse_all_reduce=False,
    )
    runner = _Runner(comm, _Programs(mesh, comm))
    contexts: list[dict[str, Any]] = []
    rows: list[np.ndarray] = []
    checks: dict[str, int] = {"float32": 0, "int32": 0}
    loads: list[list[float]] = []
    points = [(f, c, n) for f in cfg.fabrics for c in cfg.collectives for n in cfg.sizes]
    walk = progress(points, label="measure pools") if show_progress else points
    try:
        current = None
        for fabric, coll, n in walk:
            if fabric != current:
                comm.inject(fabrics[fabric])
                current = fabric
                if (la := _load_average()) is not None:
                    loads.append(la)
            ctx = Context(coll, cfg.num_ranks, int(n))
            arms = catalogs[coll]
            for k, arm in enumerate(arms):
                checks[runner.check(arm, ctx, mesh, seed=cfg.seed + 7919 * k + n)] += 1
            x = _input(mesh, ctx, "float32", np.random.default_rng(cfg.seed))
            block = np.full((width, cfg.samples), np.nan)
            for r in range(cfg.warmup + cfg.samples):
                for arm in arms:
                    seconds = runner.time(arm, x)
                    if r >= cfg.warmup:
                        block[names[coll].index(arm.name), r - cfg.warmup] = seconds * cfg.time_scale
            del x
            contexts.append(
                {
                    "collective": coll,
                    "hosts": cfg.hosts,
                    "scenario": fabric,
                    "nbytes": int(n),
                    "num_ranks": cfg.num_ranks,
                    "split": cfg.split_of(fabric, int(n)),
                }
            )
            rows.append(block)
            if log:
                best = min(arms, key=lambda a: np.median(block[names[coll].index(a.name)]))
                log(f"{fabric} {ctx.key}: best {best.name} ({time.perf_counter() - t0:.0f} s)")
    finally:
        comm.close()
    if (la := _load_average()) is not None:
        loads.append(la)
    samples = np.stack(rows).astype(np.float32).astype(np.float64)  # what a saved pool holds
    measured = np.isfinite(samples).all(axis=2)
    sim_s = np.full(samples.shape[:2], np.nan)
    sim_s[measured] = np.median(samples[measured], axis=1)
    wall = time.perf_counter() - t0
    measurement = {
        "source": MEASURED_SOURCE,
        "config": cfg.to_dict(),
        "fabric": f"rail {cfg.hosts} hosts x {cfg.gpus_per_host} GPUs ({healthy.name}), links emulated by the "
        f"native CPU executor at time scale {cfg.time_scale:g}; fabrics injected live: {list(cfg.fabrics)}",
        "latency": "executor launch time (start once every rank's call arrived -> last rank done), parts summed, "
        "x time_scale (fabric seconds)",
        "order": "round-robin over a context's arms (one hot-swap per call), warm-up rounds dropped",
        "checks": {"bitwise_vs_jax_lax": checks},
        "load_average_before": load_before,
        "load_average_per_fabric": loads,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "wall_s": wall,
    }
    return Pools(
        cfg.pool_config(), contexts, names, sim_s, samples, model={"measurement": measurement}, sim_wall_s=wall
    )


def save_pools(pools: Pools, path: str | os.PathLike[str], measurement: Mapping[str, Any] | None = None) -> None:
    """Writes ``pools`` as :meth:`Pools.save` does, with ``"source"`` and ``"measurement"`` added to the metadata.

    :func:`~jaxccl.tune.replay.load_pools` reads the file unchanged (it ignores the added keys);
    :func:`read_measurement` returns them. ``measurement`` defaults to ``pools.model["measurement"]``.
    """
    meas = dict(measurement if measurement is not None else pools.model.get("measurement", {}))
    model = {k: v for k, v in pools.model.items() if k != "measurement"}
    extra = {"source": meas.get("source", MEASURED_SOURCE), "measurement": meas}
    dataclasses.replace(pools, model=model).save(path, extra=extra)


def read_measurement(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``"measurement"`` metadata of a pools file (``None``: simulated pools, which have none).

    Raises:
        TuneError: not a pools file.
    """
    try:
        with np.load(os.fspath(path)) as z:
            meta = json.loads(bytes(z["meta"]).decode())
    except (OSError, ValueError, KeyError) as e:
        raise TuneError(f"cannot read pools from {os.fspath(path)!r}: {e}") from None
    if meta.get("schema") != POOL_SCHEMA:
        raise TuneError(f"{os.fspath(path)!r} is not a {POOL_SCHEMA} file")
    return meta.get("measurement") if meta.get("source") == MEASURED_SOURCE else None


def parse_fabrics(text: str | Sequence[str]) -> tuple[str, ...]:
    """A comma-separated list (or a sequence) of fabric names, checked.

    >>> parse_fabrics("healthy,fail2")
    ('healthy', 'fail2')
    """
    names = tuple(s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip())
    bad = [s for s in names if s not in SCENARIOS]
    if bad or not names:
        raise TuneError(f"unknown fabric(s) {bad or [text]}; expected some of {list(SCENARIOS)}")
    return tuple(dict.fromkeys(names))
