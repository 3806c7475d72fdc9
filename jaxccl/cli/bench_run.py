"""The JAX half of ``jaxccl bench``: one communicator, the sweep, interleaved timing and the bitwise check.

Every point (collective, size) compiles the jaxccl and the ``jax.lax``
version of the collective over a 1-D mesh of all devices, runs each
``warmup`` times, then ``iters`` timed iterations that each run both, in
alternating order, so both see the same load; times are medians. One more
call of each (nccl-tests' check iteration) is compared bitwise, element by
element, over every shard: the differing elements are the row's ``#wrong``.

The data is random and never all zero: for AllGather, AllToAll, ``pmax``
and ``pmin``, normal samples for floats (real and imaginary parts for
complex numbers), random bits for integers, coin flips for bool (any value
must arrive intact, any max is exact); for the sums (``psum_scatter``,
``psum``, ``pmean``), integer-valued numbers small enough that every partial
sum is exact in the dtype, so any summation order gives the same bits and
``#wrong`` counts misplaced or lost data, not rounding (across processes
XLA's gloo reductions do not promise jaxccl's rank order; see the
multi-process guide).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jaxccl
from jaxccl.cli.args import UsageError
from jaxccl.cli.bench_schedules import NAMES, load_file, schedules
from jaxccl.cli.bench_sweep import REDOP, SCHEDULE_COLLECTIVE, buffer_elements, bus_factor, input_elements
from jaxccl.distributed.transport import NETWORK_ONLY, ProcessTransport, attach, detach
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.topology import single_node
from jaxccl.util import report

__all__ = ["BenchConfig", "run"]

AXIS = "d"
TRANSPORT_TIMEOUT_S = 60.0
SUMS = ("psum_scatter", "psum", "pmean")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What one ``jaxccl bench`` run measures (the command line's options, checked)."""

    collectives: tuple[str, ...]
    sizes: tuple[int, ...]
    iters: int
    warmup: int
    dtype: str
    backend: str
    schedule: str
    topology: Any = None
    scenario: Any = None
    emulate_links: bool = False
    time_scale: float = 1e-3
    validate: bool = True
    show_progress: bool = True
    network_only: bool = False


@dataclasses.dataclass
class Bench:
    """The communicator and what the header lines say about it (``topology``: the one it has, if any)."""

    comm: Any
    mesh: Any
    num_ranks: int
    schedule_names: dict[str, str]
    topology: Any = None
    skipped: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    transport: Any = None

    def close(self) -> None:
        """Closes the communicator, then detaches and closes the transport between processes (if any)."""
        if self.comm is not None:
            self.comm.close()
        if self.transport is not None:
            detach()
            self.transport.close()
            self.transport = None


def collective_body(lib: Any, collective: str) -> Callable[[Any], Any]:
    """The per-device function calling ``collective`` of ``lib`` (``jaxccl`` or ``jax.lax``) over mesh axis ``AXIS``.

    Example:
        >>> import jax
        >>> collective_body(jax.lax, "pmax").__name__
        '<lambda>'
    """
    if collective == "all_gather":
        return lambda v: lib.all_gather(v, AXIS, tiled=True)
    if collective == "all_to_all":
        return lambda v: lib.all_to_all(v, AXIS, 0, 0, tiled=True)
    if collective == "psum_scatter":
        return lambda v: lib.psum_scatter(v, AXIS, scatter_dimension=0, tiled=True)
    reduce = getattr(lib, collective)  # psum, pmax, pmin, pmean
    return lambda v: reduce(v, AXIS)


def implementation_runner(mesh: Any, collective: str, comm: Any | None) -> Callable[[Any], Any]:
    """A jitted ``collective`` over ``mesh``'s axis ``AXIS``: jax.lax's if ``comm`` is None, else jaxccl's on it.

    The benchmarks time what this returns, one runner per implementation, interleaved.

    Example:
        >>> import jax, numpy as np
        >>> from jax.sharding import Mesh
        >>> mesh = Mesh(np.array(jax.devices()), (AXIS,))
        >>> run = implementation_runner(mesh, "psum", None)
        >>> int(run(jax.numpy.ones(mesh.size))[0])
        8
    """
    import jax
    from jax.sharding import PartitionSpec as P

    lib = jax.lax if comm is None else jaxccl
    f = jax.jit(jax.shard_map(collective_body(lib, collective), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    if comm is None:
        return f

    def run(x: Any) -> Any:
        with comm:
            return f(x)

    return run


def _exact_bound(dt: Any, num_ranks: int) -> int:
    """A bound on |x| that keeps every partial sum of ``num_ranks`` such integers exact in ``dt``."""
    import ml_dtypes
    import numpy as np

    if dt.kind in "iu":
        reach = int(np.iinfo(dt).max)
    else:
        part = np.dtype(np.float32 if dt.itemsize == 8 else np.float64) if dt.kind == "c" else dt
        reach = 1 << (int(ml_dtypes.finfo(part).nmant) + 1)  # the significand's reach
    return max(1, min(1000, reach // (2 * num_ranks)))


def _sample(rng: Any, shape: tuple[int, ...], dtype: str, exact_sum: bool, num_ranks: int) -> Any:
    import jax.numpy as jnp
    import numpy as np

    dt = jnp.dtype(dtype)
    if dt.kind == "b":
        values = rng.random(shape) < 0.5
        values[..., 0] = True  # never all zero
        return values
    if exact_sum:
        bound = _exact_bound(dt, num_ranks)
        values = rng.integers(0 if dt.kind == "u" else -bound, bound + 1, size=shape)
        if dt.kind == "c":
            values = values + 1j * rng.integers(-bound, bound + 1, size=shape)
        values[..., 0] = bound  # never all zero
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        values = rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
        values[..., 0] = info.max
    else:
        values = rng.standard_normal(shape) * 1000
        if dt.kind == "c":
            values = values + 1j * rng.standard_normal(shape) * 1000
    return values.astype(dt)


def _input(mesh: Any, collective: str, elems: int, dtype: str, num_ranks: int, seed: int) -> Any:
    """The global input (``num_ranks * elems``), each shard drawn from its own seed: the same in every process."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def shard(index: tuple[slice, ...]) -> Any:
        start = index[0].start or 0
        stop = index[0].stop if index[0].stop is not None else num_ranks * elems
        rng = np.random.default_rng((seed, start))
        return _sample(rng, (stop - start,), dtype, collective in SUMS, num_ranks)

    return jax.make_array_from_callback((num_ranks * elems,), NamedSharding(mesh, P(AXIS)), shard)


def _differing(a: Any, b: Any) -> int:
    """Elements of this process's shards of ``a`` and ``b`` whose bits differ."""
    import numpy as np

    if a.shape != b.shape:
        return int(np.prod(b.shape))
    wrong = 0
    by_device = {s.device: s for s in b.addressable_shards}
    for s in a.addressable_shards:
        x, y = np.asarray(s.data), np.asarray(by_device[s.device].data)
        if x.dtype != y.dtype:
            return int(np.prod(b.shape))
        xb, yb = (np.ascontiguousarray(v).view(np.uint8).reshape(v.size, v.dtype.itemsize) for v in (x, y))
        wrong += int(np.count_nonzero((xb != yb).any(axis=1)))
    return wrong


def _across_processes(values: list[float]) -> Any:
    """Every process's ``values`` as a (processes, len) array (one process: just them)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return np.asarray([values])
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(values, dtype=np.float64)))


def setup(cfg: BenchConfig) -> Bench:
    """The mesh of all devices and a communicator with the requested backend, links and schedules."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    n = len(devices)
    if n < 2:
        raise UsageError(f"jaxccl bench needs at least 2 devices, found {n}")
    mesh = Mesh(np.array(devices), (AXIS,))
    topo = cfg.topology
    if topo is None and (cfg.emulate_links or cfg.schedule in ("nccl", "synth", "static")):
        topo = single_node(n)
    if topo is not None and topo.num_gpus != n:
        raise UsageError(f"--topology has {topo.num_gpus} GPUs but the job has {n} devices")
    degraded = cfg.scenario(topo) if cfg.scenario is not None else topo
    emulation = LinkEmulation(time_scale=cfg.time_scale, measure=False) if cfg.emulate_links else None
    transport = attached_transport(mesh, cfg.network_only) if cfg.backend == "cpu" and jax.process_count() > 1 else None
    try:
        comm = jaxccl.Communicator(mesh, AXIS, topology=topo, backend=cfg.backend, link_emulation=emulation)
    except BaseException:
        Bench(comm=None, mesh=mesh, num_ranks=n, schedule_names={}, transport=transport).close()
        raise
    bench = Bench(comm=comm, mesh=mesh, num_ranks=n, schedule_names={}, topology=topo, transport=transport)
    try:
        _install(bench, cfg, degraded, topo)
    except BaseException:
        bench.close()
        raise
    return bench


def attached_transport(mesh: Any, network_only: bool) -> Any:
    """The native executor's transport between processes, bootstrapped on ``jax.distributed`` and attached.

    ``network_only``: sockets only (:data:`~jaxccl.distributed.transport.NETWORK_ONLY`), as on a lab's links.
    """
    options = NETWORK_ONLY if network_only else None
    transport = ProcessTransport.bootstrap(timeout_s=TRANSPORT_TIMEOUT_S, options=options)
    try:
        attach(transport, mesh, AXIS)
    except BaseException:
        transport.close()
        raise
    return transport


def _install(bench: Bench, cfg: BenchConfig, degraded: Any, topo: Any) -> None:
    """Installs the schedules ``cfg`` names and records the name each collective runs."""
    comm, n = bench.comm, bench.num_ranks
    if cfg.emulate_links and degraded is not topo:
        comm.inject(degraded)
    if cfg.schedule in NAMES:
        plan = schedules(cfg.schedule, cfg.collectives, degraded if degraded is not None else n, topo)
    else:
        collective, schedule = load_file(cfg.schedule)
        plan = {collective: schedule}
    for schedule in plan.values():
        if cfg.validate:
            comm.install(schedule.collective.value, schedule)
        else:
            # --no-validate exists to test the checker: the file runs as it is, the interpreter skipped.
            comm.stage_validated(schedule.collective.value, schedule, interpreter=False)
    for c in cfg.collectives:
        active = comm.schedule(SCHEDULE_COLLECTIVE[c])
        bench.schedule_names[c] = active.name if active is not None else "reduce_scatter + all_gather"


def _timed(fn: Callable[[Any], Any], x: Any) -> float:
    t0 = time.perf_counter()
    fn(x).block_until_ready()
    return time.perf_counter() - t0


def measure(bench: Bench, cfg: BenchConfig, collective: str, size: int) -> dict[str, Any] | None:
    """One row: medians of the interleaved timings and the bitwise check; ``None`` if ``size`` is too small."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    n = bench.num_ranks
    itemsize = jnp.dtype(cfg.dtype).itemsize
    count = buffer_elements(collective, size, num_ranks=n, itemsize=itemsize)
    if count == 0:
        return None
    x = _input(bench.mesh, collective, input_elements(collective, count, n), cfg.dtype, n, seed=size)

    def compiled(lib: Any) -> Callable[[Any], Any]:
        return jax.jit(
            jax.shard_map(collective_body(lib, collective), mesh=bench.mesh, in_specs=P(AXIS), out_specs=P(AXIS))
        )

    ours, lax = compiled(jaxccl), compiled(jax.lax)
    for _ in range(cfg.warmup):
        ours(x).block_until_ready()
        lax(x).block_until_ready()
    times: dict[str, list[float]] = {"ours": [], "lax": []}
    for i in range(cfg.iters):
        pair = (("ours", ours), ("lax", lax)) if i % 2 == 0 else (("lax", lax), ("ours", ours))
        for name, fn in pair:
            times[name].append(_timed(fn, x))
    local = [report.median(times["ours"]), report.median(times["lax"]), _differing(ours(x), lax(x))]
    everyone = _across_processes(local)  # a row is as slow as its slowest process; #wrong adds up
    t_ours, t_lax, wrong = float(everyone[:, 0].max()), float(everyone[:, 1].max()), int(everyone[:, 2].sum())
    del x
    factor = bus_factor(collective, n)
    nbytes = count * itemsize  # the size column: one rank's larger buffer
    algbw, lax_algbw = nbytes / t_ours / 1e9, nbytes / t_lax / 1e9
    return {
        "collective": collective,
        "size": nbytes,
        "count": count,
        "type": cfg.dtype,
        "redop": REDOP.get(collective, "none"),
        "time_us": t_ours * 1e6,
        "algbw_GBs": algbw,
        "busbw_GBs": algbw * factor,
        "wrong": wrong,
        "lax_time_us": t_lax * 1e6,
        "lax_algbw_GBs": lax_algbw,
        "lax_busbw_GBs": lax_algbw * factor,
        "ratio": t_ours / t_lax,
    }


def run(cfg: BenchConfig) -> tuple[Bench, list[dict[str, Any]]]:
    """Sets up the communicator and measures every (collective, size) of ``cfg``."""
    bench = setup(cfg)
    rows = []
    points = [(c, s) for c in cfg.collectives for s in cfg.sizes]
    walk = report.progress(points, label="jaxccl bench") if cfg.show_progress else points
    try:
        with bench.comm:
            for collective, size in walk:
                row = measure(bench, cfg, collective, size)
                if row is None:
                    bench.skipped.append((collective, size))
                else:
                    rows.append(row)
    finally:
        bench.close()
    return bench, rows
