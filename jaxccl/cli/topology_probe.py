"""The JAX half of ``jaxccl topology probe``: every ordered pair of ranks timed through the native executor.

For pair ``(i, j)`` the probe builds an AllGather-shaped schedule whose only op is one send
``i -> j`` (:func:`pair_schedule`), stages it in a communicator of its own on the native ``cpu``
backend (with link emulation of a given topology in one process, or attached to the transport
between processes) and times the jitted collective, as ``jaxccl bench`` does
(:func:`jaxccl.cli.bench_run.implementation_runner`), at a small and a large size, ``runs``
times each after a warm-up; every process waits at a barrier before each timed call and a
call's time is that of the slowest process. From the fastest of the ``runs`` calls (a loaded
machine only ever adds time to a call, so the minimum is the estimate least disturbed by it):

- rate = (large - small) / (t_large - t_small): the fixed cost of a call and the path's
  latency cancel;
- latency = t_small - t_empty - small / rate, where ``t_empty`` is the same call with a
  schedule of no ops (what the call costs without moving anything).

Pairs run one at a time, so no two flows share a link. With link emulation, times are real
and converted back to the emulated fabric's units (rates / ``time_scale``, latencies x it).

The probe schedule is deliberately not a collective (one chunk moves, the other outputs are
never written), so it skips the reference interpreter (``stage_validated(...,
interpreter=False)``): the result is thrown away, only the time counts. Its sends and receives
come from :meth:`~jaxccl.schedule.builder.ScheduleBuilder.transfer`, matched by construction.

Example:
    >>> s = pair_schedule(4, (0, 2))
    >>> [sum(len(tb.ops) for tb in s.ranks[r]) for r in range(4)]
    [1, 0, 1, 0]
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jaxccl.cli.bench_run import AXIS, attached_transport, implementation_runner
from jaxccl.cli.topology_infer import PairTable
from jaxccl.distributed.transport import detach
from jaxccl.errors import ExecutorError
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.schedule.builder import ScheduleBuilder
from jaxccl.schedule.ir import Buffer, Schedule
from jaxccl.util import report

__all__ = ["ProbeConfig", "measure", "pair_schedule"]

ITEMSIZE = 4  # float32 elements


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """What one probe measures (the command line's options, checked).

    Attributes:
        small_bytes: the latency transfer's size.
        large_bytes: the rate transfer's size (larger than ``small_bytes``).
        runs: timed calls per size and pair (the fastest counts).
        warmup: untimed calls per size and pair first.
        emulate: the :class:`~jaxccl.topology.Topology` whose links the executor emulates (one process), or None.
        time_scale: the emulation's time scale.
        network_only: across processes, keep the transport on TCP (a lab's links), no shared memory.
        show_progress: a progress bar on stderr.
    """

    small_bytes: int = 4 << 10
    large_bytes: int = 1 << 20
    runs: int = 3
    warmup: int = 1
    emulate: Any = None
    time_scale: float = 1e-3
    network_only: bool = False
    show_progress: bool = False


def pair_schedule(num_ranks: int, pair: tuple[int, int] | None) -> Schedule:
    """An AllGather-shaped schedule of ``num_ranks`` ranks whose only op is rank ``i``'s send to ``j`` (with
    ``j``'s receive); ``pair=None``: no op at all (the baseline call)."""
    b = ScheduleBuilder("all_gather", num_ranks=num_ranks, chunks_per_period=1)
    if pair is not None:
        i, j = pair
        b.transfer(i, j, (Buffer.INPUT, 0), (Buffer.OUTPUT, i))
    return b.build(name=f"probe {pair[0]}->{pair[1]}" if pair is not None else "probe baseline")


def _input(mesh: Any, nbytes: int) -> Any:
    """A global float32 input of ``nbytes`` per rank (zeros; the content does not matter)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    count = nbytes // ITEMSIZE
    n = mesh.size

    def shard(index: tuple[slice, ...]) -> Any:
        start = index[0].start or 0
        stop = index[0].stop if index[0].stop is not None else n * count
        return np.zeros(stop - start, np.float32)

    return jax.make_array_from_callback((n * count,), NamedSharding(mesh, P(AXIS)), shard)


def _slowest(times: list[float]) -> list[float]:
    """Per call, the slowest process's time (one process: its own)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return times
    from jax.experimental import multihost_utils

    everyone = np.asarray(multihost_utils.process_allgather(np.asarray(times, dtype=np.float64)))
    return everyone.reshape(jax.process_count(), len(times)).max(axis=0).tolist()


def _barrier(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _time_pair(mesh: Any, cfg: ProbeConfig, pair: tuple[int, int] | None, sizes: tuple[int, ...]) -> list[float]:
    """Fastest time of the probe call of ``pair`` at each of ``sizes``, on a communicator of its own."""
    from jaxccl.runtime.communicator import Communicator  # imports JAX

    emulation = LinkEmulation(time_scale=cfg.time_scale, measure=False) if cfg.emulate is not None else None
    comm = Communicator(mesh, AXIS, topology=cfg.emulate, backend="cpu", link_emulation=emulation)
    try:
        # Not a collective on purpose (one send): the interpreter would refuse it; see the module docstring.
        comm.stage_validated("all_gather", pair_schedule(mesh.size, pair), interpreter=False)
        run = implementation_runner(mesh, "all_gather", comm)
        fastest = []
        for nbytes in sizes:
            x = _input(mesh, nbytes)
            for _ in range(cfg.warmup):
                run(x).block_until_ready()
            times = []
            for k in range(cfg.runs):
                _barrier(f"jaxccl-probe-{pair}-{nbytes}-{k}")
                t0 = time.perf_counter()
                run(x).block_until_ready()
                times.append(time.perf_counter() - t0)
            fastest.append(min(_slowest(times)))
            del x
        return fastest
    finally:
        comm.close()


def measure(cfg: ProbeConfig) -> PairTable:
    """Times every ordered pair of the job's devices (JAX started, every process calling this); see the module.

    Returns the rates (bytes/s) and latencies (s), in the emulated fabric's units with
    ``cfg.emulate``, and with several processes each rank's process as its host.

    Raises:
        ExecutorError: a pair's large transfer was not slower than its small one (make ``large_bytes`` larger).
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), (AXIS,))
    transport = attached_transport(mesh, cfg.network_only) if jax.process_count() > 1 else None
    try:
        small, large = cfg.small_bytes, cfg.large_bytes
        (t_empty,) = _time_pair(mesh, cfg, None, (small,))
        rates = [[0.0] * n for _ in range(n)]
        latencies = [[0.0] * n for _ in range(n)]
        pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
        walk = report.progress(pairs, label="jaxccl topology probe") if cfg.show_progress else pairs
        for i, j in walk:
            t_small, t_large = _time_pair(mesh, cfg, (i, j), (small, large))
            if not t_large > t_small:
                raise ExecutorError(
                    f"pair {i} -> {j}: {large} B took no longer than {small} B ({t_large:.3g} s vs {t_small:.3g} s); "
                    "the fabric is too fast for --large-bytes: make it larger"
                )
            rate = (large - small) / (t_large - t_small)
            latency = t_small - t_empty - small / rate
            if cfg.emulate is not None:  # real time back to the emulated fabric's
                rate, latency = rate / cfg.time_scale, latency * cfg.time_scale
            rates[i][j], latencies[i][j] = rate, latency
    finally:
        if transport is not None:
            detach()
            transport.close()
    hosts = [int(d.process_index) for d in devices] if jax.process_count() > 1 else None
    return PairTable(rates, latencies, hosts)
