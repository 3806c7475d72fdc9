"""Link emulation for the CPU executor: a Topology's links, paced in real time.

One machine cannot move 400 Gbps per emulated NIC, so every capacity is
multiplied by ``time_scale`` and every latency divided by it: with the default
``time_scale=1e-3`` a 400 Gbps NIC carries 50 MB/s of real memory traffic, a
2880 Gbps NVSwitch port 360 MB/s, and a 0.5 us switch hop takes 0.5 ms. All
times the executor measures are real; :class:`EmulatedNetwork` converts them
back to topology units (``bytes/s`` of the emulated fabric) by dividing by the
scale. Choose the scale so that the aggregate emulated traffic stays well
below what the host's memory system and cores can copy: on the 2-core CI
machine 1e-3 keeps an 8-GPU rail fabric under ~3 GB/s of copies.

A transfer between two GPUs crosses the links of ``topology.path(u, v)``; each
link serves reservations first come, first served (xla_ffi/cpu/link_emulation.h), so
concurrent transfers with equal windows share it equally. :meth:`EmulatedNetwork.inject`
replaces capacities and routes while collectives run: the next message of a
running collective already sees them, nothing recompiles.

Example:
    >>> from jaxccl.topology import rail
    >>> from jaxccl.runtime.emulated import LinkEmulation
    >>> cfg = LinkEmulation(time_scale=1e-3)
    >>> round(cfg.real_rate(rail(hosts=2, gpus_per_host=4).capacity(0, "tor:s0r0")) / 1e6, 1)  # MB/s
    50.0
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import numpy as np

from jaxccl.errors import ArgumentError, ExecutorError, TopologyError
from jaxccl.telemetry.stats import MeasurementStats, from_cpu_stats
from jaxccl.util.options import choose

__all__ = ["TRACE_DTYPE", "EmulatedNetwork", "LinkEmulation"]

# xla_ffi/cpu/link_emulation.h TraceRecord (steady-clock ns, the clock of time.monotonic_ns()).
TRACE_DTYPE = np.dtype(
    [
        ("src", "<i4"),
        ("dst", "<i4"),
        ("src_tb", "<i4"),
        ("src_op", "<i4"),
        ("dst_tb", "<i4"),
        ("dst_op", "<i4"),
        ("bytes", "<i8"),
        ("post_ns", "<i8"),
        ("tx_end_ns", "<i8"),
        ("observed_ns", "<i8"),
    ]
)


# Bounds of the settings (the native network refuses links outside its own: a real capacity of at least
# one byte per 1000 s and a real latency of at most 1e15 ns, so that emulated times never overflow).
MIN_TIME_SCALE = 1e-9
MAX_SLOTS_PER_TB = 1 << 16
MIN_REAL_RATE = 1e-3  # real bytes/s
MAX_REAL_LATENCY = 1e6  # real seconds


@dataclasses.dataclass(frozen=True)
class LinkEmulation:
    """How the CPU executor emulates a Topology's links.

    Attributes:
        time_scale: real seconds per emulated second, inverted: capacities are
            multiplied by it, latencies divided by it (``1e-3``: the emulated
            fabric runs 1000x slower than the real one).
        pace: pace transfers at the (scaled) link capacities. Off: links are
            as fast as memcpy (measurement still works; used to measure the
            measurement overhead).
        measure: run the passive measurement (MCCL Sec. 5) in every collective
            without a reduction.
        timestamps: when a transfer counts as done for the measurement:
            ``"link"`` (default) when the emulated links delivered it, as a
            NIC's completion timestamp would say; ``"observed"`` when the
            receiving rank's thread took it, which adds this host's scheduling
            latency (accurate on an idle machine, biased low on a loaded one:
            2 cores running 8 ranks and the training step).
        trace: record every delivered message (sender/receiver threadblock and
            op, bytes, post / transmission-end / observed times) for offline
            analysis (:meth:`EmulatedNetwork.take_trace`); off by default.
        intra_threshold: channels that must be active to a GPU's intra-node
            peers before a measurement window opens (MCCL Fig. 4's threshold N).
        inter_threshold: the same for one inter-node GPU pair (MCCL Sec. 5.2:
            one channel saturates a NIC).
        min_window_bytes: measurement windows that carried fewer bytes are
            discarded: a few small messages do not saturate anything (e.g. the
            AllGather half of a scalar ``psum``), and queueing behind other
            traffic would dominate their time.
        slots_per_tb: Measurements Buffer slots per threadblock; a record that
            finds its threadblock's slots full is dropped and counted.
        window_noise: spread of log-normal noise multiplied into every measured
            record's rate, each matrix entry its own sequence from
            ``noise_seed``: the emulated windows are exact, real ones scatter
            (across processes on 2 shared cores, ~17 % per pair and step); for
            testing decisions on noisy measurements. 0 (default): exact.
        noise_seed: the seed of ``window_noise``.
    """

    time_scale: float = 1e-3
    pace: bool = True
    measure: bool = True
    timestamps: str = "link"
    trace: bool = False
    intra_threshold: int = 1
    inter_threshold: int = 1
    min_window_bytes: int = 32 << 10
    slots_per_tb: int = 8
    window_noise: float = 0.0
    noise_seed: int = 0

    def __post_init__(self) -> None:
        choose("timestamps", self.timestamps, ("link", "observed"))
        if not 0 <= self.window_noise < 10:
            raise ArgumentError(f"LinkEmulation: window_noise must be in [0, 10), got {self.window_noise}")
        if not (MIN_TIME_SCALE <= self.time_scale <= 1):
            raise ArgumentError(f"LinkEmulation: time_scale must be in [{MIN_TIME_SCALE}, 1], got {self.time_scale}")
        for name in ("intra_threshold", "inter_threshold", "slots_per_tb"):
            if int(getattr(self, name)) < 1:
                raise ArgumentError(f"LinkEmulation: {name} must be >= 1, got {getattr(self, name)}")
        if int(self.slots_per_tb) > MAX_SLOTS_PER_TB:
            raise ArgumentError(f"LinkEmulation: slots_per_tb must be <= {MAX_SLOTS_PER_TB}, got {self.slots_per_tb}")

    def real_rate(self, capacity: float) -> float:
        """Real bytes/s the executor moves for a link of ``capacity`` emulated bytes/s."""
        return capacity * self.time_scale

    def emulated_rate(self, real_rate: float | np.ndarray) -> Any:
        """Emulated bytes/s of a measured real rate."""
        return real_rate / self.time_scale


def _network_arrays(topology: Any, cfg: LinkEmulation) -> dict[str, Any]:
    edges = list(topology.edges())
    for u, v, cap, lat in edges:
        if cfg.real_rate(cap) < MIN_REAL_RATE:
            raise TopologyError(
                f"link emulation: link {u!r} -> {v!r} at {cap:g} bytes/s is {cfg.real_rate(cap):g} real bytes/s at "
                f"time_scale={cfg.time_scale:g}, below the emulator's {MIN_REAL_RATE:g}; treat the link as cut "
                "(Topology.cut) or raise time_scale"
            )
        if lat / cfg.time_scale > MAX_REAL_LATENCY:
            raise TopologyError(
                f"link emulation: link {u!r} -> {v!r} has latency {lat:g} s, {lat / cfg.time_scale:g} real seconds "
                f"at time_scale={cfg.time_scale:g}, above the emulator's {MAX_REAL_LATENCY:g}"
            )
    index = {(u, v): k for k, (u, v, _, _) in enumerate(edges)}
    n = topology.num_gpus
    offsets = [0]
    links: list[int] = []
    for s in range(n):
        for d in range(n):
            if s != d:
                route = topology.path(s, d)
                if not route:
                    raise TopologyError(f"link emulation: no route from GPU {s} to GPU {d}")
                links.extend(index[e] for e in route)
            offsets.append(len(links))
    return {
        "num_ranks": n,
        "host_of_rank": np.array([topology.host_of(r) for r in range(n)], dtype=np.int32),
        "capacity": np.array([cfg.real_rate(c) * 1e-9 for _, _, c, _ in edges], dtype=np.float64),
        "latency_ns": np.array([lat / cfg.time_scale * 1e9 for _, _, _, lat in edges], dtype=np.float64),
        "route_offsets": np.array(offsets, dtype=np.int32),
        "route_links": np.array(links, dtype=np.int32),
        "pace": bool(cfg.pace),
        "measure": bool(cfg.measure),
        "link_timestamps": cfg.timestamps == "link",
        "trace": bool(cfg.trace),
        "intra_threshold": int(cfg.intra_threshold),
        "inter_threshold": int(cfg.inter_threshold),
        "min_window_bytes": int(cfg.min_window_bytes),
        "slots_per_tb": int(cfg.slots_per_tb),
    }


class EmulatedNetwork:
    """A Topology emulated by the native CPU executor (created by a Communicator with ``link_emulation=``).

    Args:
        topology: the fabric to emulate (its GPUs are the ranks).
        config: the :class:`LinkEmulation` settings.
    """

    def __init__(self, topology: Any, config: LinkEmulation | None = None):
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

        self._native = native.module()
        self.config = config or LinkEmulation()
        self.topology = topology
        self.id = int(self._native.network_configure(0, **_network_arrays(topology, self.config)))

    def attach(self, slot: int) -> None:
        """Runs the collectives of registry slot ``slot`` over this network."""
        self._native.network_attach(int(slot), self.id)

    def inject(self, topology: Any) -> None:
        """Makes ``topology`` the emulated fabric from the next message on (live; no recompilation).

        ``topology`` must have the same GPUs on the same hosts (a ``scenario``,
        ``degrade`` or ``cut`` of the original, or a Fail3-style replacement
        that keeps the ranks).

        Raises:
            TopologyError: another GPU count or host assignment, or a pair without route.
        """
        if topology.num_gpus != self.topology.num_gpus:
            raise TopologyError(
                f"inject: topology has {topology.num_gpus} GPUs but the emulated network has {self.topology.num_gpus}"
            )
        if [topology.host_of(r) for r in topology.gpus] != [self.topology.host_of(r) for r in self.topology.gpus]:
            raise TopologyError("inject: the new topology puts GPUs on other hosts; ranks must keep their hosts")
        try:
            self._native.network_configure(self.id, **_network_arrays(topology, self.config))
        except ValueError as e:
            raise TopologyError(f"inject: {e}") from None
        self.topology = topology

    def drain(self) -> bytes:
        """Raw Measurements Buffer records (32 bytes each) written since the last drain.

        :meth:`jaxccl.Communicator.telemetry` drains them into its matrix; records drained here are not in it.
        """
        return bytes(self._native.measure_drain(self.id))

    def take_trace(self) -> np.ndarray:
        """Every message delivered since the last call (``TRACE_DTYPE`` records); needs ``trace=True``.

        Raises:
            ExecutorError: records were dropped (more than 2**20 between calls).
        """
        raw, dropped = self._native.trace_take(self.id)
        if dropped:
            raise ExecutorError(f"take_trace: {dropped} trace records were dropped; take the trace more often")
        return np.frombuffer(bytes(raw), dtype=TRACE_DTYPE).copy()

    def measurement(self, *, dropped_before: int = 0) -> MeasurementStats:
        """This network's measurement counters and footprint as a :class:`~jaxccl.telemetry.MeasurementStats`.

        What :meth:`jaxccl.Communicator.measurement` returns with link emulation (the mapping is
        :func:`jaxccl.telemetry.stats.from_cpu_stats`); ``dropped_before``: the ``dropped_total`` of the
        caller's previous reading.
        """
        return from_cpu_stats(self._native.measure_stats(self.id), dropped_before=dropped_before)

    def stats(self) -> dict[str, int]:
        """Deprecated: use :meth:`jaxccl.Communicator.measurement` (the same fields on the CPU and CUDA backends).

        The native counters of this network as a dict (``windows``, ``records``, ``dropped`` since the
        last reset, ``regions``, ``slots``, ``used`` and the footprint in bytes).
        """
        warnings.warn(
            "EmulatedNetwork.stats() is deprecated and removed in the next release: use "
            "Communicator.measurement() (a MeasurementStats, the same fields on the cpu and cuda backends)",
            DeprecationWarning,
            stacklevel=2,
        )
        return dict(self._native.measure_stats(self.id))

    def reset(self) -> None:
        """Clears accumulators, the buffer and the counters (:meth:`measurement` counts from here)."""
        self._native.measure_reset(self.id)

    def close(self) -> None:
        """Detaches every slot and frees the native network."""
        if self.id:
            try:
                self._native.network_remove(self.id)
            except ValueError as e:  # pragma: no cover - already removed
                raise ExecutorError(str(e)) from None
            self.id = 0

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()
