"""Communicators: one mesh axis bound to a backend and its active schedules.

A :class:`Communicator` owns one schedule per collective (``all_gather``,
``all_to_all``, ``reduce_scatter``, ``all_reduce``). ``with comm:`` makes the
jaxccl collectives over ``comm.axis_name`` use it; outside any ``with``, a
default communicator per ``(axis name, axis size)`` is used (direct AllGather,
direct AllToAll, rank-ordered direct ReduceScatter, rank-ordered direct AllReduce).
With a topology and no ``all_reduce`` schedule installed, ``psum`` runs the
``reduce_scatter`` and ``all_gather`` schedules fused into one AllReduce
(:meth:`Communicator.launched_schedule`), which follows every install of either.

Hot-swap. On the native backends (``cpu``, ``cuda``) every collective of a
communicator has a registry *slot* in the native module; the compiled program
carries only the slot number (an FFI attribute), and :meth:`Communicator.install`
replaces the table in the slot. The next call runs the new schedule without
recompiling anything, even when its chunk count differs. The ``ppermute``
backend lowers the schedule into the program itself, so an install there
makes the next call of a jitted function retrace and recompile (it bumps a
generation counter that is part of JAX's jit cache key).

Scope and caching. The communicators in scope are kept in a JAX config state
that is part of the jit cache key and the trace context (the same mechanism
as ``jax.default_matmul_precision``), so a jitted function called under
another communicator is retraced instead of silently reusing the old one.
This uses ``jax._src.config`` (no public hook exists in jax 0.10.2).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import weakref
from collections.abc import Hashable
from typing import Any

import numpy as np

from jaxccl.errors import (
    ArgumentError,
    CommunicatorClosedError,
    ExecutorError,
    ScheduleError,
    TopologyError,
    UnsupportedError,
    UnsupportedTypeError,
)
from jaxccl.runtime import default_schedules
from jaxccl.runtime.emulated import EmulatedNetwork, LinkEmulation
from jaxccl.runtime.failures import as_executor_error, note_closed_slots
from jaxccl.schedule.fusion import fuse_all_reduce
from jaxccl.schedule.ir import Collective, Schedule
from jaxccl.schedule.table import check_table, compiled_table, header
from jaxccl.synth import baselines
from jaxccl.telemetry import MeasurementStats, TelemetryCollector
from jaxccl.topology.discover import discover
from jaxccl.util.options import choose

__all__ = [
    "BACKENDS",
    "COLLECTIVES",
    "Communicator",
    "current",
    "default_communicator",
    "message_bytes",
    "resolve",
    "size_bucket",
]

BACKENDS = ("cpu", "cuda", "ppermute", "auto")
COLLECTIVES = tuple(c.value for c in Collective)
_ALIASES = {"psum_scatter": "reduce_scatter", "psum": "all_reduce"}
_HALVES = (Collective.REDUCE_SCATTER, Collective.ALL_GATHER)  # what psum runs on a communicator with a topology

_log = logging.getLogger("jaxccl.runtime")
_uids = itertools.count(1)
_LIVE: weakref.WeakValueDictionary[int, Communicator] = weakref.WeakValueDictionary()
_DEFAULTS: dict[tuple[Hashable, int], Communicator] = {}
_LOCK = threading.Lock()


def _make_states() -> tuple[Any, Any]:
    """(scope, generation): config states that are part of JAX's jit cache key and trace context."""
    from jax._src import config as jax_config

    scope = jax_config.string_or_object_state(
        "jaxccl_communicators",
        (),
        "jaxccl communicators in scope: ((axis name, communicator id), ...)",
        include_in_jit_key=True,
        include_in_trace_context=True,
    )
    gen = jax_config.string_or_object_state(
        "jaxccl_trace_generation",
        0,
        "bumped when a schedule that is lowered into programs (ppermute backend) changes",
        include_in_jit_key=True,
        include_in_trace_context=True,
    )
    return scope, gen


# Created at import (before any jaxccl trace), once per process.
_STATES = _make_states()


def _states() -> tuple[Any, Any]:
    return _STATES


def _canonical(collective: str | Collective) -> Collective:
    name = collective.value if isinstance(collective, Collective) else str(collective)
    name = _ALIASES.get(name, name)
    try:
        return Collective(name)
    except ValueError:
        raise ArgumentError(
            f"unknown collective {collective!r}; expected one of {COLLECTIVES} (or 'psum_scatter', 'psum')"
        ) from None


def size_bucket(nbytes: int) -> int:
    """The size bucket of a message of ``nbytes`` bytes: the smallest power of two ``>= nbytes``.

    Bucket ``2**k`` holds the sizes ``(2**(k-1), 2**k]`` (bucket 1 holds 1 byte).

    Example:
        >>> size_bucket(1), size_bucket(1000), size_bucket(1024), size_bucket(1025)
        (1, 1024, 1024, 2048)

    Raises:
        ArgumentError: ``nbytes`` is not a positive integer.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or int(nbytes) < 1:
        raise ArgumentError(f"size bucket: nbytes must be a positive integer, got {nbytes!r}")
    return 1 << (int(nbytes) - 1).bit_length()


def message_bytes(collective: str | Collective, elems: int, itemsize: int, num_ranks: int) -> int:
    """The message size of one call (nccl-tests' convention, the larger per-rank buffer), what size buckets use.

    ``elems`` is the flat per-rank input the executor receives: AllGather's output is ``num_ranks`` times it;
    ReduceScatter, AllReduce and AllToAll move their input's size.

    Example:
        >>> message_bytes("all_gather", 1024, 4, 8), message_bytes("reduce_scatter", 8192, 4, 8)
        (32768, 32768)
    """
    coll = _canonical(collective)
    n = int(elems) * int(itemsize)
    return n * int(num_ranks) if coll is Collective.ALL_GATHER else n


def _native():
    try:
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)
    except ImportError as e:  # the extension is not built
        raise ExecutorError(
            f"the jaxccl native module is not available ({e}); build it (pip install -e .) or use backend='ppermute'"
        ) from e
    return native


def native_available() -> bool:
    """Whether the native module (CPU executor) can be imported."""
    try:
        _native()
    except ExecutorError:
        return False
    return True


def _default_schedule(
    collective: Collective, n: int, with_all_reduce: bool, *, across_processes: bool = False
) -> Schedule | None:
    """A communicator's schedule of ``collective`` until one is installed.

    The reductions sum as XLA:CPU does, so they are bitwise ``jax.lax``'s: in one process in ascending
    rank order; in a job of several processes in gloo's orders (its ring for AllReduce, with a topology
    too: the synthesized ReduceScatter would sum in another order; its halving-doubling tree for ReduceScatter).
    """
    if collective is Collective.ALL_GATHER:
        return default_schedules.direct_allgather(n)
    if collective is Collective.ALL_TO_ALL:
        return baselines.direct_alltoall(n)
    if collective is Collective.REDUCE_SCATTER:
        if across_processes:
            return default_schedules.gloo_tree_reduce_scatter(n)
        return baselines.direct_reduce_scatter(n)
    if not with_all_reduce:
        return None
    return default_schedules.gloo_ring_allreduce(n) if across_processes else default_schedules.direct_allreduce(n)


class Communicator:
    """Binds mesh axis ``axis_name`` to a backend, a topology and one schedule per collective.

    Args:
        mesh: the ``jax.sharding.Mesh`` the collectives run over (inside ``jax.shard_map``).
        axis_name: the mesh axis this communicator serves, or a tuple of axes:
            it then serves collectives over exactly that tuple (``psum(x,
            ("data", "fsdp"))``), whose groups span those axes
            (:meth:`group_devices`).
        topology: optional :class:`jaxccl.topology.Topology` with ``num_gpus``
            equal to the axis size. Without one, ``psum`` runs the rank-ordered
            AllReduce schedule; with one, ``psum`` is ReduceScatter + AllGather
            (MCCL Sec. 3: the AllGather half is the adaptive one), fused into one
            launch (:meth:`launched_schedule`), until an ``all_reduce`` schedule is
            installed. ``"auto"`` takes the machine's
            topology from :func:`jaxccl.topology.discover` (``NCCL_TOPO_FILE``, else
            ``nvidia-smi topo -m``, else none), logs the choice on the
            ``jaxccl.runtime`` logger and keeps where it came from in
            :attr:`topology_source`; a discovered topology with another number of
            GPUs than the axis raises ``TopologyError``.
        backend: ``"cpu"`` (the native CPU executor through XLA FFI),
            ``"cuda"`` (native CUDA executor), ``"ppermute"`` (the schedule
            lowered to ``jax.lax.ppermute`` rounds; works everywhere, also
            multi-process) or ``"auto"`` (``cuda`` if the native module has CUDA
            support, else ``cpu``).
        link_emulation: on the ``cpu`` backend, a
            :class:`jaxccl.runtime.emulated.LinkEmulation`: the executor paces
            every transfer over the links of ``topology`` (capacities scaled by
            its ``time_scale``) and measures them passively (MCCL Sec. 5);
            :meth:`inject` changes the links live, :meth:`telemetry` reads the
            measurements, :meth:`measurement` their counters. Needs ``topology``.
            On the ``cuda`` backend a ``topology`` alone turns on the kernel's
            measurement (per-threadblock accumulators), read the same way.
        telemetry_alpha: EWMA smoothing factor of :meth:`telemetry` (MCCL's alpha).
        fuse_all_reduce: with a topology, run ``psum`` as one launch of the fused
            ReduceScatter + AllGather (default) rather than as two launches. The
            executor measures no collective that reduces, so only the two launches
            let link emulation and the CUDA kernel measure ``psum``'s AllGather half
            (for a closed loop over a program whose only collective is ``psum``).
            The halves are fused when a program first traces ``psum``. Across
            processes ``psum`` is never fused: it runs gloo's ring (its sums are gloo's).
        size_buckets: give every message size bucket (:func:`size_bucket`: powers of two) its own registry
            slot, so that one compiled program that calls a collective at several sizes can run a different
            schedule per size (``install(collective, schedule, nbytes=...)``, what
            :class:`jaxccl.tune.OnlineTuner` does). The size of a call is static, so its bucket, and with it the
            slot, is chosen when the program is lowered (:meth:`slot` with ``nbytes``), not by the executor at
            launch: equivalent for static shapes. The first bucket that needs a slot shares the collective's
            own slot (``slot(collective)``, :meth:`swap_state`), so a program with one size per collective runs
            exactly as without buckets. One process only (a bucket's swap is not agreed across processes).

    Example:
        >>> import jax, numpy as np, jaxccl
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()), ("data",))
        >>> comm = jaxccl.Communicator(mesh, "data", backend="ppermute")
        >>> f = jax.jit(jax.shard_map(lambda x: jaxccl.all_gather(x, "data", tiled=True),
        ...                           mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        >>> with comm:
        ...     y = f(np.arange(2.0 * len(jax.devices()), dtype=np.float32))
        >>> comm.schedule("all_gather").name
        'direct_allgather'
    """

    def __init__(
        self,
        mesh: Any,
        axis_name: Hashable,
        *,
        topology: Any = None,
        backend: str = "auto",
        link_emulation: Any = None,
        telemetry_alpha: float = 0.5,
        fuse_all_reduce: bool = True,
        size_buckets: bool = False,
    ):
        # --- several mesh axes (a tuple, in jax.lax's order: the first is the major one)
        axis_names = tuple(getattr(mesh, "axis_names", ()))
        spanned = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
        if not spanned or len(set(spanned)) != len(spanned):
            raise ArgumentError(f"Communicator: axis_name {axis_name!r} must name one or more distinct mesh axes")
        for name in spanned:
            if name not in axis_names:
                raise ArgumentError(f"Communicator: mesh has no axis {name!r}; its axes are {axis_names}")
        axis_name = spanned[0] if len(spanned) == 1 else spanned
        # ---
        self._init(
            axis_name,
            int(np.prod([mesh.shape[name] for name in spanned])),
            mesh=mesh,
            topology=topology,
            backend=backend,
            link_emulation=link_emulation,
            telemetry_alpha=telemetry_alpha,
            fuse_all_reduce=fuse_all_reduce,
            size_buckets=size_buckets,
        )

    def _init(
        self,
        axis_name: Hashable,
        axis_size: int,
        *,
        mesh: Any,
        topology: Any,
        backend: str,
        link_emulation: Any = None,
        telemetry_alpha: float = 0.5,
        fuse_all_reduce: bool = True,
        size_buckets: bool = False,
    ) -> None:
        choose("backend", backend, BACKENDS)
        if not isinstance(size_buckets, bool):
            raise ArgumentError(f"Communicator: size_buckets must be True or False, got {size_buckets!r}")
        #: Where :attr:`topology` came from: ``"given"``, ``"none"``, or a :func:`jaxccl.topology.discover` source.
        self.topology_source = "none" if topology is None else "given"
        if isinstance(topology, str):
            choose("topology", topology, ("auto",))
            found = discover()
            _log.info("Communicator(%r, topology='auto'): %s (%s)", axis_name, found.source, found.detail)
            if found.topology is not None and found.topology.num_gpus != axis_size:
                raise TopologyError(
                    f"Communicator(topology='auto'): {found.source} ({found.detail}) describes "
                    f"{found.topology.num_gpus} GPUs but mesh axis {axis_name!r} has {axis_size} devices; "
                    "pass topology= explicitly or point NCCL_TOPO_FILE at this job's topology"
                )
            topology, self.topology_source = found.topology, found.source
        if topology is not None and getattr(topology, "num_gpus", None) != axis_size:
            raise TopologyError(
                f"Communicator: topology has {getattr(topology, 'num_gpus', None)} GPUs but mesh axis "
                f"{axis_name!r} has {axis_size} devices"
            )
        self.mesh = mesh
        self.axis_name = axis_name
        self.axis_size = axis_size
        self.topology = topology
        self.uid = next(_uids)
        self._is_default = mesh is None
        self._lock = threading.Lock()
        self._stage_lock = threading.RLock()  # one install at a time: a half and psum's fusion of the halves
        # A collective's slot under its Collective; a size bucket's own slot under (collective, bucket). The
        # first bucket that needs a slot shares the collective's (_base_bucket); close() releases them all.
        self._slots: dict[Collective | tuple[Collective, int], int] = {}
        self._size_buckets = size_buckets
        self._base_bucket: dict[Collective, int] = {}
        self._bucket_own: dict[tuple[Collective, int], Schedule] = {}  # buckets with a schedule of their own
        if backend == "auto" and not self._is_default:
            backend = "cuda" if native_available() and _native().has_cuda_support() else "cpu"
        self.backend = backend
        self.network = None
        self._collector = None
        self._measure_lock = threading.Lock()
        self._dropped_seen = 0  # measurement(): dropped_total at its previous call
        if link_emulation is not None:
            self._start_emulation(link_emulation, telemetry_alpha)
        elif backend == "cuda" and topology is not None:
            self._start_cuda_measurement(telemetry_alpha)
        # The native slots and the emulated network are freed by close(), or once neither this communicator
        # nor any program traced with it (JAX's caches hold their CommunicatorRef) is left; registered before
        # the first slot exists, so that a constructor failing half-way frees what it made.
        self._lease = _Lease()
        self._finalizer = weakref.finalize(self._lease, _release, self._slots, self.network)
        import jax

        across = jax.process_count() > 1
        if size_buckets and across:
            raise UnsupportedError(
                "Communicator(size_buckets=True) runs in one process only: a size bucket's swap is not agreed "
                "across processes"
            )
        self._schedules: dict[Collective, Schedule | None] = {
            c: _default_schedule(c, axis_size, with_all_reduce=topology is None or across, across_processes=across)
            for c in Collective
        }
        # psum follows the halves (fused into one launch) in one process; across processes the halves are swapped
        # at calls the processes agree on per slot (stage_agreed), which a third table would need too. The halves
        # are first fused when a program traces psum (launched_schedule): a communicator whose programs never sum
        # pays no fusion, at construction nor at a swap of a half (the closed loop's AllGather swaps).
        self._fusing = bool(fuse_all_reduce) and topology is not None and not across
        self._fused: Schedule | None = None
        self._psum_deferred = False  # a half was staged with defer_psum: psum runs an earlier fusion
        if backend in ("cpu", "cuda"):
            native = _native()
            if backend == "cuda" and not native.has_cuda_support():
                raise ExecutorError("Communicator(backend='cuda'): the native module was built without CUDA")
            for c, s in self._schedules.items():
                if s is not None:
                    self._install_native(c, s)
        _LIVE[self.uid] = self

    # ------------------------------------------------------------------ link emulation
    def _start_emulation(self, config: Any, alpha: float) -> None:
        if not isinstance(config, LinkEmulation):
            raise UnsupportedTypeError(
                f"Communicator: link_emulation must be a LinkEmulation, got {type(config).__name__}"
            )
        if self.backend != "cpu":
            raise ExecutorError(f"Communicator: link emulation needs backend='cpu', not {self.backend!r}")
        if self.topology is None:
            raise ArgumentError("Communicator: link emulation needs a topology (the links to emulate)")
        self.network = EmulatedNetwork(self.topology, config)
        self._collector = TelemetryCollector(
            self.axis_size,
            alpha=alpha,
            scale=1.0 / config.time_scale,
            noise=config.window_noise,
            seed=config.noise_seed,
        )

    def _start_cuda_measurement(self, alpha: float) -> None:
        """CUDA backend: turn on the kernel's passive measurement (process-wide settings of jaxccl._native_cuda).

        Not exercised in CI (no GPU); tests/gpu/check_measurement.py covers the raw API on a GPU.
        """
        import numpy as np

        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

        hosts = np.array([self.topology.host_of(r) for r in range(self.axis_size)], dtype=np.int32)
        native.configure_cuda_measurement(hosts.tolist())  # the documented defaults (CUDA_MEASURE_*)
        self._collector = TelemetryCollector(self.axis_size, alpha=alpha, scale=1.0)

    def inject(self, topology: Any) -> None:
        """Makes ``topology`` the emulated fabric, live (e.g. ``jaxccl.topology.scenario(topo, "fail2")``).

        Collectives already running see the new capacities from their next
        message on; nothing recompiles. The communicator's own ``topology``
        (what synthesis assumes) is unchanged: the controller has to notice.

        Raises:
            CommunicatorClosedError: the communicator is closed.
            ExecutorError: the communicator has no link emulation.
            TopologyError: ``topology`` has other GPUs or hosts.
        """
        self._check_open()
        if self.network is None:
            raise ExecutorError(f"{self!r}: inject() needs link emulation (Communicator(..., link_emulation=...))")
        self.network.inject(topology)

    @property
    def measuring(self) -> bool:
        """Whether the executor measures this communicator's collectives inside the process.

        True with link emulation (``cpu``) and on the ``cuda`` backend with a topology (the kernel's
        per-threadblock accumulators): then :meth:`measurement` and :meth:`telemetry` read them.
        """
        return self._collector is not None

    def measurement(self) -> MeasurementStats:
        """The passive measurement's counters and memory footprint: the same fields on ``cpu`` and ``cuda``.

        With link emulation, the counters of this communicator's emulated network; on the ``cuda``
        backend, those of every CUDA collective of the process (the kernel's settings are
        process-wide). ``dropped`` counts the records dropped since this communicator's previous
        ``measurement()`` on both backends (``dropped_total``: since the counters' reset).

        Example:
            >>> import jax, numpy as np, jaxccl
            >>> from jax.sharding import Mesh
            >>> from jaxccl.runtime.emulated import LinkEmulation
            >>> mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
            >>> comm = jaxccl.Communicator(mesh, "d", topology=jaxccl.topology.rail(hosts=2, gpus_per_host=1),
            ...                            backend="cpu", link_emulation=LinkEmulation())
            >>> m = comm.measurement()
            >>> m.backend, m.scope, m.windows, m.dropped
            ('cpu', 'network', 0, 0)

        Raises:
            CommunicatorClosedError: the communicator is closed.
            ExecutorError: the executor does not measure this communicator (:attr:`measuring`).
        """
        self._check_measuring("measurement()")
        with self._measure_lock:
            stats = self._measurement(dropped_before=self._dropped_seen)
            self._dropped_seen = stats.dropped_total
        return stats

    def telemetry(self) -> Any:
        """Drains the executor's measurements (CPU link emulation or the CUDA kernel) into the EWMA matrix.

        Raises:
            CommunicatorClosedError: the communicator is closed.
            ExecutorError: the executor does not measure this communicator (:attr:`measuring`).
        """
        self._check_measuring("telemetry()")
        if self.network is not None:
            raw = self.network.drain()
        else:
            from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

            raw, _ = native.drain_cuda_measurement()
        self._collector.fold(raw, dropped=self._measurement(dropped_before=0).dropped_total)
        return self._collector.snapshot()

    def _check_measuring(self, caller: str) -> None:
        self._check_open()
        if self._collector is None:
            raise ExecutorError(
                f"{self!r}: {caller} needs link emulation (Communicator(..., link_emulation=...)) or the cuda "
                "backend with a topology"
            )

    def _measurement(self, *, dropped_before: int) -> MeasurementStats:
        if self.network is not None:
            return self.network.measurement(dropped_before=dropped_before)
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

        return native.cuda_measurement(dropped_before=dropped_before)

    # ------------------------------------------------------------------ schedules
    def schedule(self, collective: str | Collective, *, nbytes: int | None = None) -> Schedule | None:
        """The schedule installed for ``collective``; ``None`` for ``all_reduce`` on a communicator with a topology
        until one is installed (``psum`` then runs its ReduceScatter and AllGather: :meth:`launched_schedule`).
        With ``nbytes`` (``size_buckets=True``): the schedule of that size's bucket, its own or the collective's."""
        self._check_open()
        coll = _canonical(collective)
        own = self._bucket_own.get((coll, self._bucket(nbytes)))
        return own if own is not None else self._schedules[coll]

    def buckets(self, collective: str | Collective) -> dict[int, Schedule | None]:
        """The size buckets of ``collective`` that have a registry slot (or, on ``ppermute``, a schedule of their
        own): bucket (bytes, a power of two) -> its own schedule, or ``None`` where it runs the collective's.

        Example:
            >>> import jax, numpy as np, jaxccl
            >>> from jax.sharding import Mesh
            >>> mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
            >>> comm = jaxccl.Communicator(mesh, "d", backend="cpu", size_buckets=True)
            >>> comm.install("all_gather", jaxccl.synth.ring_allgather(4), nbytes=3000)
            >>> {b: s.name for b, s in comm.buckets("all_gather").items()}
            {4096: 'ring_allgather'}
            >>> comm.schedule("all_gather", nbytes=4096).name, comm.schedule("all_gather", nbytes=8192).name
            ('ring_allgather', 'direct_allgather')
        """
        self._check_open()
        coll = _canonical(collective)
        with self._lock:
            found = {b: None for c, b in self._base_bucket.items() if c is coll}
            found |= {k[1]: None for k in self._slots if isinstance(k, tuple) and k[0] is coll}
            found |= {b: s for (c, b), s in self._bucket_own.items() if c is coll}
        return dict(sorted(found.items()))

    def _bucket(self, nbytes: int | None) -> int | None:
        """``nbytes``' size bucket where this communicator has buckets, else ``None``."""
        if nbytes is None:
            return None
        b = size_bucket(nbytes)
        return b if self._size_buckets else None

    def launched_schedule(self, collective: str | Collective, *, nbytes: int | None = None) -> Schedule | None:
        """The schedule one launch of ``collective`` runs: the installed one, or for ``all_reduce`` without one
        on a communicator with a topology, the fusion of the ``reduce_scatter`` and ``all_gather`` schedules
        (:func:`jaxccl.schedule.fusion.fuse_all_reduce`), re-fused whenever either is installed. ``None`` where
        ``psum`` runs them as two launches (``fuse_all_reduce=False``, or across processes).

        Example:
            >>> import jax, numpy as np, jaxccl
            >>> from jax.sharding import Mesh
            >>> mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
            >>> comm = jaxccl.Communicator(mesh, "d", topology=jaxccl.topology.single_node(4), backend="cpu")
            >>> comm.schedule("all_reduce") is None, comm.launched_schedule("all_reduce").name
            (True, 'direct_reduce_scatter+direct_allgather')
            >>> comm.install("all_gather", jaxccl.synth.ring_allgather(4))
            >>> comm.launched_schedule("psum").name
            'direct_reduce_scatter+ring_allgather'

        With ``nbytes`` (``size_buckets=True``): what a launch of that size runs, its bucket's own schedule or
        the collective's.
        """
        self._check_open()
        coll = _canonical(collective)
        return self._launched(coll, self._bucket(nbytes))

    def _launched(self, coll: Collective, bucket: int | None = None) -> Schedule | None:
        own = self._bucket_own.get((coll, bucket)) if bucket is not None else None
        if own is not None:
            return own
        installed = self._schedules[coll]
        if installed is not None or coll is not Collective.ALL_REDUCE or not self._fusing:
            return installed
        if self._fused is None:  # the first psum: fuse the halves now (slot() stages it in a new slot)
            with self._stage_lock:  # never under self._lock: _stage takes the two in this order
                if self._fused is None and self._schedules[Collective.ALL_REDUCE] is None:
                    self._fused = fuse_all_reduce(
                        self._schedules[Collective.REDUCE_SCATTER], self._schedules[Collective.ALL_GATHER]
                    )
        return self._fused if self._schedules[coll] is None else self._schedules[coll]

    def _psum_follows(self, coll: Collective) -> bool:
        """Whether installing ``coll`` re-fuses psum: a half, psum fuses them and a program traced it already."""
        fusing = self._fusing and coll in _HALVES and self._schedules[Collective.ALL_REDUCE] is None
        return fusing and self._fused is not None

    def _fusion_with(self, coll: Collective, schedule: Schedule) -> Schedule | None:
        """psum's fused AllReduce once ``schedule`` is ``coll``'s (``None``: psum does not follow the halves, or
        no program traced psum yet: :meth:`_launched` fuses them then)."""
        if not self._psum_follows(coll):
            return None
        halves = {c: self._schedules[c] for c in _HALVES} | {coll: schedule}
        return fuse_all_reduce(halves[Collective.REDUCE_SCATTER], halves[Collective.ALL_GATHER])

    def install(self, collective: str | Collective, schedule: Schedule, *, nbytes: int | None = None) -> None:
        """Makes ``schedule`` the active schedule of ``collective``, from the next call on.

        Checks it with the reference interpreter (``schedule.validate()``) first.
        Native backends compile it to a table and *stage* it in the
        collective's registry slot (MCCL Sec. 6.2.2): collectives any rank has
        already issued finish on the old schedule, the first later one on
        every rank runs the new one (see :meth:`swap_state`); already-compiled
        programs pick it up without recompiling. With a topology and no ``all_reduce`` schedule
        installed, ``psum`` runs the fusion of the ``reduce_scatter`` and ``all_gather`` schedules in one
        launch (:meth:`launched_schedule`): installing either half fuses them anew and stages the result in
        ``all_reduce``'s slot too, so the next ``psum`` runs the new pair, again without recompiling; an
        installed ``all_reduce`` schedule replaces the fusion in that slot (programs traced before follow it
        as well). On the ``ppermute`` backend the next call of a jitted function retraces. Float reductions are
        bitwise equal to ``jax.lax`` only with schedules that sum in ascending rank order
        (``info["ordered_reduction"]``); a fused ``psum`` sums as its ReduceScatter does.

        Size buckets (``Communicator(..., size_buckets=True)``): with ``nbytes``, ``schedule`` becomes the
        schedule of that size's bucket (:func:`size_bucket`) only, staged in the bucket's own slot, which
        programs lowered before or after run at their next call of that size. Without ``nbytes`` it is the
        schedule of every size: every bucket's own schedule is dropped and all the collective's slots are
        staged with ``schedule`` (what the closed loop's swaps do; as without buckets, every later call runs
        it). ``psum``'s fusion follows the halves installed without ``nbytes`` only.

        Raises:
            ScheduleError: ``schedule`` is for another collective or another
                number of ranks, or fails the interpreter (it or psum's fusion of it with the other half).
            ArgumentError: ``nbytes`` is not a positive integer, or the communicator has no size buckets.
            CommunicatorClosedError: the communicator is closed.
            ExecutorError: the native registry refused it.
        """
        coll = _canonical(collective)
        self._check_open()
        self._check_fits(coll, schedule, "install")
        bucket = self._bucket_required(nbytes, "install")
        if bucket is None:
            self._stage(coll, schedule.validate())
        else:
            self._stage_bucket(coll, bucket, schedule.validate())

    def _bucket_required(self, nbytes: int | None, caller: str) -> int | None:
        if nbytes is not None and not self._size_buckets:
            raise ArgumentError(
                f"{caller}(nbytes={nbytes!r}): {self!r} has no size buckets (Communicator(..., size_buckets=True))"
            )
        return self._bucket(nbytes)

    def _stage_bucket(self, coll: Collective, bucket: int, schedule: Schedule, table: Any = None) -> int:
        """Stages ``schedule`` as size bucket ``bucket``'s own schedule (its slot allocated first if need be)."""
        version = 0
        with self._stage_lock:  # the slot is allocated and staged before any other install (same order as _stage)
            native_backend = self.backend in ("cpu", "cuda")
            slot = self.slot(coll, bucket) if native_backend else None
            with self._lock:
                self._check_open()
                if native_backend:
                    if table is None:
                        table = compiled_table(schedule, num_slots=8)
                    else:
                        table = check_table(schedule, table, what=f"the table staged for {coll.value!r}")
                    version = int(_native().stage(slot, table))
                self._bucket_own[(coll, bucket)] = schedule
        if self.backend in ("ppermute", "auto"):
            _bump_generation()
        return version

    def stage_validated(
        self,
        collective: str | Collective,
        schedule: Schedule,
        *,
        table: Any = None,
        interpreter: bool = True,
        defer_psum: bool = False,
        nbytes: int | None = None,
    ) -> int:
        """:meth:`install` for callers that validated ``schedule`` already (the controller).

        Still refuses a schedule for another collective or rank count, and
        runs the interpreter unless :meth:`Schedule.validate` already passed on
        this very object: whatever path a schedule takes, a training step never
        sees one that does not fit or does not check.
        ``table`` is its compiled table (:func:`jaxccl.schedule.table.compile_table`) if the caller has it;
        it must be exactly the compilation of ``schedule`` (:func:`jaxccl.schedule.table.check_table`), so
        the table of another schedule, collective or rank count, or one changed after it was compiled, is
        refused here, before it reaches the registry.
        ``interpreter=False`` skips the interpreter: only for testing a result checker with a deliberately
        wrong schedule (``jaxccl bench --no-validate``), never in training. A ``reduce_scatter`` or
        ``all_gather`` schedule that ``psum`` fuses (:meth:`launched_schedule`) goes through the interpreter
        all the same: the fusion follows its data. ``defer_psum=True`` stages the half alone and leaves ``psum``
        on its current fusion (a correct AllReduce of the halves installed before) until :meth:`fuse_psum` (the
        controller: fusing a synthesized pair takes tens of milliseconds, which would delay the swap of the half).
        ``nbytes`` stages it for that size's bucket only, as :meth:`install` does.
        Returns the staged version (native backends; 0 on ``ppermute``): without ``nbytes``, that of the
        collective's own slot (:meth:`swap_state`).

        Raises:
            ScheduleError: ``schedule`` does not fit or fails the interpreter, or ``table`` is not its compilation.
            ArgumentError: ``nbytes`` is not a positive integer, or the communicator has no size buckets.
            CommunicatorClosedError: the communicator is closed.
        """
        coll = _canonical(collective)
        self._check_open()
        self._check_fits(coll, schedule, "stage_validated")
        bucket = self._bucket_required(nbytes, "stage_validated")
        if interpreter and not schedule.validated:
            schedule.validate()
        if bucket is not None:
            return self._stage_bucket(coll, bucket, schedule, table)
        return self._stage(coll, schedule, table, defer_psum=defer_psum)

    def fuse_psum(self) -> bool:
        """Fuses ``psum``'s halves as installed now and stages the result in ``all_reduce``'s slot, after
        :meth:`stage_validated` with ``defer_psum=True``; returns whether it staged one (False: ``psum`` already
        runs the current halves, or does not fuse them).

        Raises:
            CommunicatorClosedError: the communicator is closed.
        """
        self._check_open()
        with self._stage_lock:
            if not self._psum_deferred:
                return False
            gather = self._schedules[Collective.ALL_GATHER]
            fused = self._fusion_with(Collective.ALL_GATHER, gather)
            with self._lock:
                self._record(Collective.ALL_GATHER, gather, fused)
        if self.backend in ("ppermute", "auto"):
            _bump_generation()
        return True

    def record_staged(self, collective: str | Collective, schedule: Schedule) -> None:
        """Records ``schedule`` as ``collective``'s schedule after the caller staged its table itself.

        For staging paths that talk to the native registry directly, such as a hot-swap agreed
        across processes (:func:`jaxccl.distributed.transport.stage_agreed`): :meth:`schedule` and
        the controller's profiles then describe what runs. The schedule must have passed the
        interpreter. Where ``psum`` fuses the halves (:meth:`launched_schedule`, one process), a
        ``reduce_scatter`` or ``all_gather`` schedule recorded here is fused with the other half and staged in
        ``all_reduce``'s slot at once: the next ``psum`` runs the new pair. With size buckets, it becomes the
        schedule of every size, as :meth:`install` without ``nbytes``: the buckets' own slots are staged here.

        Raises:
            ScheduleError: ``schedule`` does not fit this communicator, was not validated, or is not what
                the collective's registry slot holds (its staged or current table is another schedule's).
            CommunicatorClosedError: the communicator is closed.
        """
        coll = _canonical(collective)
        self._check_open()
        self._check_fits(coll, schedule, "record_staged")
        if not schedule.validated:
            raise ScheduleError(f"record_staged({coll.value!r}): the schedule has not passed validate()")
        with self._stage_lock:
            fused = self._fusion_with(coll, schedule)
            with self._lock:
                if self.backend in ("cpu", "cuda") and coll in self._slots:
                    self._check_registry_holds(coll, schedule)
                    self._stage_buckets(coll, compiled_table(schedule, num_slots=8), every=True)
                self._drop_own(coll)
                self._record(coll, schedule, fused)
        if fused is not None and self.backend in ("ppermute", "auto"):
            _bump_generation()

    def _check_registry_holds(self, coll: Collective, schedule: Schedule) -> None:
        """Raises unless the slot's staged table (or, with none staged, its current one) is ``schedule``'s."""
        state = _native().swap_state(self._slots[coll])
        held = state["staged_checksum"] if state["staged_version"] else state["current_checksum"]
        expected = header(compiled_table(schedule, num_slots=8))["checksum"]
        if held != expected:
            raise ScheduleError(
                f"record_staged({coll.value!r}): the registry slot holds a table with checksum 0x{held:08x}, "
                f"not the compilation of {schedule.name or schedule.digest[:12]} (0x{expected:08x})"
            )

    def _stage(self, coll: Collective, schedule: Schedule, table: Any = None, *, defer_psum: bool = False) -> int:
        version = 0
        with self._stage_lock:
            fused = None if defer_psum else self._fusion_with(coll, schedule)  # before anything is staged
            with self._lock:
                if self.backend in ("cpu", "cuda"):
                    version = self._install_native(coll, schedule, table, every_bucket=True)
                self._drop_own(coll)
                self._record(coll, schedule, fused)
                if defer_psum and self._psum_follows(coll):
                    self._psum_deferred = True
        if self.backend in ("ppermute", "auto"):
            _bump_generation()
        return version

    def _record(self, coll: Collective, schedule: Schedule, fused: Schedule | None) -> None:
        """``schedule`` is ``coll``'s from now on, ``fused`` (if any) psum's fusion of the halves, staged in
        ``all_reduce``'s slot here on native backends; under the lock, after ``coll``'s own table is staged."""
        if fused is not None and self.backend in ("cpu", "cuda"):
            self._install_native(Collective.ALL_REDUCE, fused)
        self._schedules[coll] = schedule
        if coll is Collective.ALL_REDUCE:
            self._fused = None  # psum runs the installed schedule
            self._psum_deferred = False
        elif fused is not None:
            self._fused = fused
            self._psum_deferred = False

    def _check_fits(self, coll: Collective, schedule: Any, caller: str) -> None:
        if not isinstance(schedule, Schedule):
            raise ScheduleError(f"{caller}({coll.value!r}): expected a Schedule, got {type(schedule).__name__}")
        if schedule.collective is not coll:
            raise ScheduleError(
                f"{caller}({coll.value!r}): the schedule implements {schedule.collective.value}, not {coll.value}"
            )
        if schedule.num_ranks != self.axis_size:
            raise ScheduleError(
                f"{caller}({coll.value!r}): schedule {schedule.name or schedule.digest[:12]} is for "
                f"N={schedule.num_ranks} ranks but axis {self.axis_name!r} has {self.axis_size} devices"
            )

    def _install_native(
        self, coll: Collective, schedule: Schedule, table: Any = None, *, every_bucket: bool = False
    ) -> int:
        """Stages ``schedule`` in ``coll``'s slot: its compilation, or ``table`` once checked to be exactly that;
        also in the slot of every size bucket that follows the collective (``every_bucket``: of every bucket,
        whose own schedules the caller drops). Returns the version staged in the collective's slot (0: its
        bucket keeps a schedule of its own)."""
        self._check_open()
        if table is None:
            table = compiled_table(schedule, num_slots=8)
        else:
            table = check_table(schedule, table, what=f"the table staged for {coll.value!r}")
        native = _native()
        version = 0
        base = self._base_bucket.get(coll)
        if every_bucket or base is None or (coll, base) not in self._bucket_own:
            version = int(native.stage(self._new_slot(coll), table))
        self._stage_buckets(coll, table, every=every_bucket)
        return version

    def _new_slot(self, key: Collective | tuple[Collective, int]) -> int:
        """``key``'s slot, allocated (and attached to the emulated network) if it has none; under the lock."""
        slot = self._slots.get(key)
        if slot is None:
            slot = int(_native().new_slot())
            self._slots[key] = slot
            if self.network is not None:
                self.network.attach(slot)
        return slot

    def _stage_buckets(self, coll: Collective, table: Any, *, every: bool) -> None:
        """Stages ``table`` in the own slots of ``coll``'s size buckets that follow it (``every``: all of them)."""
        native = _native()
        for key, slot in list(self._slots.items()):
            if isinstance(key, tuple) and key[0] is coll and (every or key not in self._bucket_own):
                native.stage(slot, table)

    def _drop_own(self, coll: Collective) -> None:
        """``coll``'s size buckets follow the collective's schedule again (their slots were staged with it)."""
        for key in [k for k in self._bucket_own if k[0] is coll]:
            del self._bucket_own[key]

    def swap_state(self, collective: str | Collective, *, nbytes: int | None = None) -> dict[str, int]:
        """Hot-swap bookkeeping of ``collective``'s slot (native backends): versions and sequence numbers.
        With ``nbytes`` (``size_buckets=True``): of that size's bucket's slot."""
        return _native().swap_state(self.slot(collective, nbytes))

    def slot(self, collective: str | Collective, nbytes: int | None = None) -> int:
        """The native registry slot of ``collective`` (allocated and filled on first use).

        With ``nbytes`` on a communicator with ``size_buckets=True``, the slot of that message size's bucket
        (:func:`size_bucket`), what the lowering of a call of that size bakes into the program: the first bucket
        shares the collective's slot, each later one gets its own, filled with the collective's schedule until
        one is installed for it. Without size buckets ``nbytes`` is ignored (one slot per collective).
        """
        coll = _canonical(collective)
        bucket = self._bucket(nbytes)
        key = coll if bucket is None else (coll, bucket)
        fresh = coll not in self._slots or (key not in self._slots and self._base_bucket.get(coll, bucket) != bucket)
        launched = self._launched(coll) if fresh else None  # may fuse psum's halves: unlocked
        with self._lock:
            self._check_open()
            if coll not in self._slots:
                s = launched if launched is not None else self._launched(coll)
                if s is None:
                    raise ExecutorError(f"{self!r}: no {coll.value} schedule installed")
                self._install_native(coll, s)
            if bucket is None:
                return self._slots[coll]
            if self._base_bucket.setdefault(coll, bucket) == bucket:  # the first bucket shares the collective's
                return self._slots[coll]
            if key not in self._slots:
                # what the collective runs now (an install may have come between: it staged the slots it saw)
                s = self._schedules[coll]
                if s is None and coll is Collective.ALL_REDUCE and self._fusing:
                    s = self._fused
                table = compiled_table(s if s is not None else launched, num_slots=8)
                _native().stage(self._new_slot(key), table)
            return self._slots[key]

    def group_devices(self) -> np.ndarray:
        """The devices of every group the collectives of this communicator run over, as a 2-D array.

        Row ``g`` is one group (the other mesh axes' coordinates, linearized in
        mesh order); column ``r`` is its rank ``r``, which is GPU ``r`` of
        :attr:`topology`. With several axes the rank is the linear index along
        them in the order of :attr:`axis_name`, as in ``jax.lax``.

        Example:
            >>> import jax, numpy as np, jaxccl
            >>> from jax.sharding import Mesh
            >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("a", "b", "c"))
            >>> comm = jaxccl.Communicator(mesh, ("c", "a"), backend="ppermute")
            >>> [[d.id for d in row] for row in comm.group_devices()]
            [[0, 4, 1, 5], [2, 6, 3, 7]]
        """
        if self.mesh is None:
            raise ArgumentError(f"{self!r} has no mesh (a default communicator serves any mesh with its axis)")
        self._check_open()
        names = tuple(self.mesh.axis_names)
        inside = self.axis_name if isinstance(self.axis_name, tuple) else (self.axis_name,)
        order = [names.index(a) for a in names if a not in inside] + [names.index(a) for a in inside]
        return np.transpose(np.asarray(self.mesh.devices), order).reshape(-1, self.axis_size)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Frees what the communicator holds in the executor: its registry slots and its emulated network.

        Idempotent. Afterwards installing schedules or running collectives
        with it raises :class:`~jaxccl.ExecutorError`; collectives already
        running finish on their tables. A communicator that is dropped is
        freed the same way once it is garbage-collected and no program traced
        with it remains in JAX's caches (those programs may still be running:
        their slots stay until then; ``jax.clear_caches()`` drops them). Call
        ``close()`` only once the results of its collectives are ready.
        (``with comm:`` scopes collectives to the communicator and does not
        close it; use ``contextlib.closing(comm)`` for both.)
        """
        with self._lock:
            if self._finalizer.alive:
                note_closed_slots(list(self._slots.values()), repr(self))
            self._finalizer()
        self.network = None

    @property
    def ref(self) -> CommunicatorRef:
        """A weak reference to this communicator, what the collective primitives carry as a parameter."""
        return CommunicatorRef(self)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if self.closed:
            raise CommunicatorClosedError(f"communicator {self!r} is closed")

    # ---------------------------------------------------------------------- scope
    def __enter__(self) -> Communicator:
        self._check_open()
        scope, _ = _states()
        entries = tuple(e for e in scope.value if e[0] != self.axis_name) + ((self.axis_name, self.uid),)
        cm = scope(entries)
        cm.__enter__()
        self._cms = getattr(self, "_cms", [])
        self._cms.append(cm)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._cms.pop().__exit__(exc_type, exc, tb)
        if exc is not None:
            converted = as_executor_error(exc)
            if converted is not None and converted is not exc:
                raise converted from exc

    def __repr__(self) -> str:
        kind = "default " if self._is_default else ""
        return f"Communicator({kind}axis={self.axis_name!r}, N={self.axis_size}, backend={self.backend!r})"


class CommunicatorRef:
    """A hashable, weak reference to a :class:`Communicator` that stands in for it (attribute access delegates).

    Traced programs keep their primitives' parameters for as long as they stay
    in JAX's caches; carrying this instead of the communicator itself lets a
    communicator that nothing else references be garbage-collected. The
    reference keeps the communicator's native slots (its lease) alive, since a
    cached or already dispatched program reads its tables from them. Two
    references are equal when they name the same communicator.
    """

    __slots__ = ("_desc", "_lease", "_ref", "uid")

    def __init__(self, comm: Communicator):
        self.uid = comm.uid
        self._ref = weakref.ref(comm)
        self._lease = comm._lease  # keeps the native slots of programs in flight or cached
        self._desc = repr(comm)

    def get(self) -> Communicator:
        """The communicator, or ``ExecutorError`` if it was garbage-collected."""
        comm = self._ref()
        if comm is None:
            raise ExecutorError(
                f"{self._desc} (#{self.uid}) was garbage-collected; a program traced with it cannot run any more "
                "(keep a reference to the communicator while its programs are in use)"
            )
        return comm

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.get(), name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CommunicatorRef) and other.uid == self.uid

    def __hash__(self) -> int:
        return hash(("jaxccl.Communicator", self.uid))

    def __repr__(self) -> str:
        return f"ref({self._desc})"


class _Lease:
    """Stands for a communicator's native resources: they are released when it is closed or collected."""

    __slots__ = ("__weakref__",)


def _release(slots: dict[Collective, int], network: Any) -> None:
    """Removes ``slots`` from the native registry and closes ``network`` (a communicator's close/finalizer)."""
    from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

    for slot in list(slots.values()):
        with contextlib.suppress(ExecutorError):  # already gone
            native.remove(slot)
    slots.clear()
    if network is not None:
        network.close()


def _bump_generation() -> None:
    _, gen = _states()
    with _LOCK:
        gen.set_global(gen.get_global() + 1)


def default_communicator(axis_name: Hashable, axis_size: int) -> Communicator:
    """The communicator used for ``axis_name`` when none is in scope (backend chosen at lowering).

    A collective over ``axis_name`` traced outside any ``with comm:`` for that
    axis runs here. There is one per ``(axis_name, axis_size)`` in the
    process, created on first use and shared by every later call. It has no
    topology, link emulation or telemetry, and runs the direct AllGather and
    the rank-ordered direct AllReduce (``psum``) of
    :mod:`jaxccl.runtime.default_schedules`, and the direct AllToAll and the
    rank-ordered direct ReduceScatter of :mod:`jaxccl.synth.baselines`;
    :meth:`Communicator.install` on it changes what those later calls run.

    Its backend is ``"auto"`` in a wider sense than :class:`Communicator`'s:
    on the CPU platform the native executor when the module is built and the
    program runs in one process, else ``ppermute``; on GPUs the CUDA executor
    when available, else ``ppermute``.

    Example:
        >>> comm = default_communicator("data", 8)
        >>> comm is default_communicator("data", 8), comm.topology, comm.schedule("all_gather").name
        (True, None, 'direct_allgather')
    """
    key = (axis_name, int(axis_size))
    with _LOCK:
        comm = _DEFAULTS.get(key)
        if comm is None:
            comm = Communicator.__new__(Communicator)
            comm._init(axis_name, int(axis_size), mesh=None, topology=None, backend="auto")
            _DEFAULTS[key] = comm
    return comm


def current(axis_name: Hashable) -> Communicator | None:
    """The communicator in scope for ``axis_name`` (innermost ``with``), or ``None``."""
    scope, _ = _states()
    for name, uid in reversed(scope.value):
        if name == axis_name:
            comm = _LIVE.get(uid)
            if comm is not None:
                return comm
    return None


def resolve(axis_name: Hashable, axis_size: int) -> Communicator:
    """The communicator a collective over ``axis_name`` (of ``axis_size`` devices) uses now."""
    comm = current(axis_name)
    if comm is None:
        return default_communicator(axis_name, axis_size)
    if comm.axis_size != axis_size:
        raise ArgumentError(
            f"{comm!r} is in scope for axis {axis_name!r}, but that axis has {axis_size} devices here "
            f"(the communicator was built for {comm.axis_size})"
        )
    return comm


def lowering_backend(comm: Communicator, platform: str) -> str:
    """The backend ``comm`` runs on ``platform`` ("cpu", "cuda", "rocm", ...): its own, or for ``"auto"``
    :func:`~jaxccl.runtime.native_backend.auto_backend` (across processes a native backend only where a
    transport is attached)."""
    if comm.backend != "auto":
        if comm.backend == "cpu" and platform != "cpu":
            raise ExecutorError(f"{comm!r}: the cpu backend cannot run on platform {platform!r}")
        if comm.backend == "cuda" and platform != "cuda":
            raise ExecutorError(f"{comm!r}: the cuda backend cannot run on platform {platform!r}")
        return comm.backend
    import jax

    from jaxccl.runtime.native_backend import auto_backend  # imports JAX

    native = _native() if native_available() else None
    return auto_backend(
        platform,
        process_count=jax.process_count(),
        native=native is not None,
        cuda=native is not None and platform == "cuda" and native.has_cuda_support(),
        transport=native is not None and native.process_groups_attached(),
    )
