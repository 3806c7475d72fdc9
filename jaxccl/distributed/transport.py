"""The transport between the processes of a multi-process JAX job (UCX), bootstrapped on ``jax.distributed``.

Each process creates a :class:`ProcessTransport`, publishes its address in the job's key-value
store (``jax.distributed.initialize`` starts it), reads every peer's and connects. Then
connection slots move with tagged nonblocking sends and receives; every completion reports its
post and completion times (what the meter reads), every wait has a deadline, and a dead peer
fails the waits on it with an error that names the process.

Every install builds it (the ``libucx-cu12`` wheel is a build requirement and a dependency); a source
build with ``JAXCCL_TRANSPORT=OFF`` leaves it out. :func:`unavailable_reason` says why it is missing where
it is.

Example (in every process of a job, after ``jax.distributed.initialize``)::

    with ProcessTransport.bootstrap(timeout_s=60) as t:
        peer = (t.process_id + 1) % t.num_processes
        recv = t.irecv((t.process_id - 1) % t.num_processes, tag=1, data=inbox)
        send = t.isend(peer, tag=1, data=outbox)
        t.wait(send, timeout_s=10), t.wait(recv, timeout_s=10)

>>> reason = unavailable_reason()
>>> reason is None or "transport" in reason
True
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxccl.distributed import kv
from jaxccl.errors import ArgumentError, DeadlineError, ExecutorError, TransportArgumentError

KEY_PREFIX = "jaxccl/transport"
DEFAULT_TIMEOUT_S = 60.0
# Keep every byte on the network links (a lab's veths): no shared memory between processes. Small
# socket buffers make a send complete when its bytes are (nearly) delivered, not when the kernel
# buffered them, so its completion time measures the link (TransportMeter).
NETWORK_ONLY = {"TLS": "tcp,self", "TCP_SNDBUF": "128k", "TCP_RCVBUF": "128k"}


@functools.cache
def _module() -> Any:
    try:
        import libucx

        libucx.load_library()
    except ImportError:
        pass  # the build's rpath may still find UCX
    from jaxccl import _transport  # the transport's native module loads on demand

    return _transport


def unavailable_reason() -> str | None:
    """Why the transport between processes is not available here (``None`` when it is)."""
    try:
        _module()
    except ImportError as e:
        return (
            "jaxccl's transport between processes is not available (built with JAXCCL_TRANSPORT=OFF, or the "
            f"libucx-cu12 package is missing; reinstall jaxccl with pip, which brings and builds it): {e}"
        )
    return None


def ucx_info(options: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The UCX library the transport loaded: its ``version`` and the ``transports`` it would choose from here.

    ``transports`` are ``"transport/device"`` names (``"tcp/eth0"``, ``"posix/memory"``) of a UCX context
    opened as :class:`ProcessTransport` opens its own: this process's ``UCX_*`` variables (``UCX_TLS``)
    and ``options`` (UCX variables without ``UCX_``, e.g. :data:`NETWORK_ONLY`) narrow them.

    >>> info = ucx_info() if unavailable_reason() is None else {"version": "", "transports": []}
    >>> sorted(info)
    ['transports', 'version']

    Raises:
        ExecutorError: the transport is not built here, or UCX could not start.
        TransportArgumentError: an option UCX does not know.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise ExecutorError(reason)
    mod = _module()
    try:
        transports = mod.ucx_transports(dict(options or {}))
    except (RuntimeError, ValueError) as e:
        raise _translate(e) from e
    return {"version": str(mod.ucx_version()), "transports": [str(t) for t in transports]}


@dataclass(frozen=True)
class Completion:
    """A finished send or receive.

    Attributes:
        bytes: bytes moved (a receive: the bytes that arrived).
        post_ns: when it was posted (steady clock, ns).
        done_ns: when the transport reported it complete.
    """

    bytes: int
    post_ns: int
    done_ns: int

    @property
    def seconds(self) -> float:
        """Time from post to completion.

        >>> Completion(bytes=10, post_ns=0, done_ns=2_000_000_000).seconds
        2.0
        """
        return (self.done_ns - self.post_ns) * 1e-9


def _translate(e: Exception) -> Exception:
    mod = _module()
    if isinstance(e, mod.TransportDeadline):
        return DeadlineError(str(e))
    if isinstance(e, ValueError):
        return TransportArgumentError(str(e))
    return ExecutorError(str(e))


class ProcessTransport:
    """This process's transport to the other processes of a job.

    Args:
        process_id: this process's index (``jax.process_index()``).
        num_processes: how many processes the job has.
        options: transport library settings (UCX variables without ``UCX_``), e.g. :data:`NETWORK_ONLY`.

    Raises:
        ExecutorError: the transport is not built here, or could not start.
    """

    def __init__(self, process_id: int, num_processes: int, *, options: Mapping[str, str] | None = None):
        reason = unavailable_reason()
        if reason is not None:
            raise ExecutorError(reason)
        try:
            self._t = _module().Transport("ucx", int(process_id), int(num_processes), dict(options or {}))
        except (TimeoutError, RuntimeError, ValueError) as e:
            raise _translate(e) from e
        self.process_id, self.num_processes = int(process_id), int(num_processes)
        self._pinned: dict[int, np.ndarray] = {}  # buffers of requests in flight stay alive

    @classmethod
    def bootstrap(
        cls,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        options: Mapping[str, str] | None = None,
        key_prefix: str = KEY_PREFIX,
    ) -> ProcessTransport:
        """Creates this process's transport and connects it to every peer through ``jax.distributed``.

        Call it in every process after ``jax.distributed.initialize``; each publishes its address
        under ``key_prefix`` in the job's key-value store and waits up to ``timeout_s`` for the others'.

        Raises:
            ExecutorError: ``jax.distributed`` is not initialized, or the transport failed.
            DeadlineError: a peer did not publish its address within ``timeout_s``.
        """
        client, me, n = kv.job_client("ProcessTransport.bootstrap()")
        t = cls(me, n, options=options)
        try:
            client.key_value_set(f"{key_prefix}/{me}", t._t.address().hex())
            for peer in range(n):
                if peer == me:
                    continue
                missing = f"process {peer} did not publish its transport address"
                t.connect(peer, bytes.fromhex(kv.get(client, f"{key_prefix}/{peer}", timeout_s, missing)))
        except BaseException:
            t.close()
            raise
        return t

    def address(self) -> bytes:
        """This process's address (opaque bytes) to publish for the peers."""
        return self._call("address")

    def connect(self, peer: int, address: bytes) -> None:
        """Connects to process ``peer`` at the address it published."""
        self._call("connect", peer, address)

    def isend(self, peer: int, tag: int, data: np.ndarray) -> int:
        """Posts a send of ``data`` (C-contiguous, unchanged until it completes) to ``peer``; returns a request."""
        request = self._call("isend", peer, tag, data)
        self._pinned[request] = data
        return request

    def irecv(self, peer: int, tag: int, data: np.ndarray) -> int:
        """Posts a receive from ``peer`` into ``data`` (C-contiguous); returns a request."""
        request = self._call("irecv", peer, tag, data)
        self._pinned[request] = data
        return request

    def wait(self, request: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> Completion:
        """Waits for ``request``; its completion, or the error that names the peer process.

        Raises:
            DeadlineError: it did not complete within ``timeout_s`` (it is cancelled).
            ExecutorError: the peer process failed.
        """
        try:
            return Completion(*self._call("wait", request, timeout_s))
        finally:
            self._pinned.pop(request, None)

    def check_peer(self, peer: int) -> None:
        """Raises :class:`ExecutorError` when the connection to ``peer`` has failed."""
        self._call("check_peer", peer)

    def peer_transports(self, peer: int) -> list[str]:
        """UCX's ``"transport/device"`` pairs the connection to ``peer`` uses, once it carried a message.

        A peer on this machine connects over shared memory (``"posix/memory"``, ``"cma/memory"``...) unless
        the transport's options choose UCX's transports (:data:`NETWORK_ONLY`: ``"tcp/..."`` only).

        Raises:
            TransportArgumentError: ``peer`` is not a connected peer.
        """
        return [str(t) for t in self._call("peer_transports", peer)]

    def close(self) -> None:
        """Closes every connection (never waiting for a dead peer); idempotent. Detaches it first if attached."""
        if _attached is self:
            detach()
        if not self._t.closed:
            self._t.close()
        self._pinned.clear()

    def __enter__(self) -> ProcessTransport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, *args):
        try:
            return getattr(self._t, method)(*args)
        except (TimeoutError, RuntimeError, ValueError) as e:
            raise _translate(e) from e


_attached: ProcessTransport | None = None


def local_shards(array: Any) -> list[np.ndarray]:
    """This process's shards of ``array`` as numpy arrays, in device-id order.

    What a process of a multi-process job compares, bitwise, with the same shards of a
    ``jax.lax`` result (it cannot read the other processes' shards).

    Example:
        >>> import jax.numpy as jnp
        >>> [s.tolist() for s in local_shards(jnp.arange(3))]
        [[0, 1, 2]]
    """
    return [np.asarray(s.data) for s in sorted(array.addressable_shards, key=lambda s: s.device.id)]


def process_groups(mesh: Any, axis_name: Any) -> list[list[int]]:
    """The process of every rank of every group of a collective over ``axis_name`` (a name or a tuple) of ``mesh``.

    As the native backend numbers them (:mod:`jaxccl.runtime.axes`): a rank is the linear index
    of a device's coordinates along ``axis_name`` in the order of the tuple, a group the linear
    index of its coordinates along the other mesh axes in mesh order.

    >>> import jax
    >>> from jax.sharding import Mesh
    >>> process_groups(Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y")), "y")
    [[0, 0], [0, 0]]

    Raises:
        ExecutorError: ``axis_name`` names an axis the mesh does not have, or one twice.
    """
    from jaxccl.runtime.axes import names  # imports JAX

    axes, mesh_axes = names(axis_name), tuple(mesh.axis_names)
    if len(set(axes)) != len(axes) or any(a not in mesh_axes for a in axes):
        raise ExecutorError(f"attach(): {axis_name!r} must name distinct axes of a mesh with axes {mesh_axes}")
    others = [a for a in mesh_axes if a not in axes]
    devices = np.asarray(mesh.devices)
    processes = np.vectorize(lambda d: int(d.process_index), otypes=[np.int32])(devices)
    order = [mesh_axes.index(a) for a in (*others, *axes)]
    size = int(np.prod([devices.shape[mesh_axes.index(a)] for a in axes]))
    return np.transpose(processes, order).reshape(-1, size).tolist()


def attach(transport: ProcessTransport, mesh: Any, axis_name: Any) -> int:
    """Makes the native backends run collectives over ``axis_name`` of ``mesh`` across processes.

    ``axis_name`` is one mesh axis or a tuple of them, as the collectives take it; the mesh may
    have more axes (each coordinate of the others is a group of its own, as in one process). Call
    it in every process (the same mesh everywhere, the same calls in the same order) before the
    programs with native collectives over those axes are traced (attaching makes jitted functions
    trace again: the layout's groups are part of the compiled program). From then on
    ``backend="cpu"`` (and ``"cuda"``) collectives over them run this process's ranks in the
    native executor and move the bytes to ranks of other processes through ``transport``; sends of
    the same bytes to several ranks of one other process travel once.

    One program may run collectives over several axes of a mesh (``"model"`` inside a process,
    ``"data"`` across, ``("data", "model")`` over all): attach each, in the same order in every
    process. Attaching a layout that is attached already changes nothing. The transport stays
    attached (and open) until :func:`detach`, which detaches every layout.

    Returns:
        The layout's number (0 for the first attached): the ``layout`` of a :class:`TransportMeter`
        that measures its collectives.

    Raises:
        ExecutorError: ``axis_name`` is not axes of the mesh; this process holds none of its devices;
            another transport is attached; a mesh with the same axis names and shape on other devices
            is attached for these axes (:func:`detach` first); or the layouts' groups that span
            processes are too many.
    """
    from jaxccl.runtime import native, process_layouts  # the native module loads on demand (and imports JAX)

    global _attached
    groups = process_groups(mesh, axis_name)
    if _attached is transport:
        held = process_layouts.find(mesh, axis_name)
        if held is not None:
            return held.number
    try:
        first, number = native.module().set_process_group(transport._t.capsule(), transport.process_id, groups)
    except ValueError as e:
        raise ExecutorError(str(e)) from e
    process_layouts.record(mesh, axis_name, first_group=int(first), number=int(number))
    _attached = transport
    return int(number)


def detach() -> None:
    """Detaches the transport and every attached layout from the native backend (before closing it)."""
    global _attached
    from jaxccl.runtime import native, process_layouts  # the native module loads on demand (and imports JAX)

    native.module().clear_process_group()
    process_layouts.clear()
    with _pending_lock:  # layout numbers start again at 0
        _pending.clear()
        _pending_lost.clear()
    _attached = None


SWAP_KEY_PREFIX = "jaxccl/swap"


def swap_key(slot: int, round_id: Any) -> str:
    """The key directory where the processes publish their swap points of one :func:`stage_agreed` round.

    Every process reads every key of it during that round; afterwards it may be deleted.

    >>> swap_key(3, "loop/7")
    'jaxccl/swap/3/loop/7'
    """
    return f"{SWAP_KEY_PREFIX}/{slot}/{round_id}"


DEFAULT_SWAP_MARGIN = 4
# The backends whose collectives run in jaxccl's executor: a registry slot to hot-swap, a meter to read.
LOOP_BACKENDS = ("cpu", "cuda")


def check_loop_backend(comm: Any, caller: str) -> None:
    """Raises unless ``comm`` runs on a backend the closed loop can drive across processes (``cpu``, ``cuda``).

    Both run jaxccl's executor (the CPU threads or the CUDA kernel, the proxy for ranks of other
    processes): its registry swaps a staged table at an agreed call, the proxy's completion times
    (:class:`TransportMeter`) and the executor's accumulators measure it.

    >>> import jax, numpy as np, jaxccl
    >>> from jax.sharding import Mesh
    >>> comm = jaxccl.Communicator(Mesh(np.array(jax.devices()[:2]), ("d",)), "d", backend="ppermute")
    >>> check_loop_backend(comm, "ProcessLoop")
    Traceback (most recent call last):
    ...
    jaxccl.errors.ArgumentError: ProcessLoop: Communicator(...) runs on the ppermute backend, which lowers ...

    Raises:
        ArgumentError: any other backend, with why: ``ppermute`` lowers the schedule into the program as
            ``jax.lax.ppermute`` rounds, which XLA's own collectives carry (nothing measures them, and a new
            schedule means a retrace and recompile, not a swap at an agreed call); ``auto`` (a default
            communicator) picks its backend only when a program is lowered.
    """
    backend = getattr(comm, "backend", None)
    if backend in LOOP_BACKENDS:
        return
    why = {
        "ppermute": "which lowers the schedule into the program as jax.lax.ppermute rounds: XLA's own "
        "collectives move the bytes, so there is no meter to read, and a new schedule means a retrace and "
        "recompile, not a hot-swap at an agreed call",
        "auto": "chosen only when a program is lowered (a default communicator); build a Communicator with "
        "backend='cpu' or 'cuda'",
    }.get(backend, "which jaxccl's executor does not run")
    raise ArgumentError(
        f"{caller}: {comm!r} runs on the {backend} backend, {why}; the closed loop across processes needs "
        f"backend {' or '.join(map(repr, LOOP_BACKENDS))}"
    )


def stage_agreed(
    comm: Any,
    collective: str,
    schedule: Any,
    *,
    round_id: int | str,
    margin: int = DEFAULT_SWAP_MARGIN,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[int, int]:
    """Stages ``schedule`` in every process to become current at one agreed sequence number.

    MCCL Sec. 6.2.2 across processes: every process calls this with the same schedule (it is
    plain data: synthesize it deterministically in each process or load the same JSON) and the
    same ``round_id`` (unique per swap of the job). Each publishes the largest sequence number
    its ranks issued on the slot;
    the transition point is the largest of them plus ``margin`` (the calls a process may issue
    while the others are still agreeing), so every process runs the old table up to it and the
    new one from the next call. The communicator then reports ``schedule`` as the collective's
    (``comm.schedule(collective)``), as after :meth:`~jaxccl.Communicator.install`.
    Returns ``(version, transition_seq)``.

    ``comm`` runs on the ``cpu`` or the ``cuda`` backend (:func:`check_loop_backend`): both keep
    their tables in one registry, and both executors take a staged table at the agreed call.

    Raises:
        ArgumentError: ``comm`` runs on another backend (:func:`check_loop_backend` says why).
        ScheduleError: ``schedule`` fails the reference interpreter.
        DeadlineError: a process did not publish within ``timeout_s``.
        ExecutorError: this process already issued past the agreed point (raise ``margin``).
    """
    from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

    check_loop_backend(comm, "stage_agreed()")
    client, me, n = kv.job_client("stage_agreed()")
    if not schedule.validated:
        schedule.validate()
    slot = comm.slot(collective)
    key = swap_key(slot, round_id)
    own = str(native.swap_state(slot)["issued"])
    issued = kv.gather(client, key, own, process_id=me, num_processes=n, timeout_s=timeout_s, what="its swap point")
    transition = max(int(i) for i in issued) + int(margin)
    version = native.stage(slot, schedule, transition_seq=transition)
    comm.record_staged(collective, schedule)
    return version, transition


MIN_MEASURED_BYTES = 32 << 10  # smaller sends finish in the transport's buffers: their time is not the link's
MIN_WINDOW_BYTES = 32 << 10  # the executor's default (LinkEmulation.min_window_bytes): smaller windows are dropped
INTER_THRESHOLD = 1  # active connections that open an inter-node window (the executor's default, MCCL Sec. 5.2)


MAX_PENDING_RECORDS = 1 << 16  # per layout, waiting for its meter's drain (the native buffer's size)
_pending: dict[int, collections.deque] = {}
_pending_lost: dict[int, int] = {}
_pending_lock = threading.Lock()


MAX_OVER_CAPACITY = 4.0  # plausible_ceiling's default factor


def plausible_ceiling(topology: Any, ranks: int, factor: float = MAX_OVER_CAPACITY) -> np.ndarray:
    """``factor`` x the capacity of each pair's primary route in ``topology`` (bytes/s; inf on the diagonal):
    the fastest window a :class:`TransportMeter` takes as a measurement of the link. The factor leaves room for
    sends the sockets' buffers absorb in part (about 1.5x the NIC's rate on the netns lab) and for a
    topology that understates its links.

    >>> from jaxccl.topology import rail
    >>> c = plausible_ceiling(rail(hosts=2, gpus_per_host=1, nic_gbps=8), 2)
    >>> float(c[0, 1])
    4000000000.0
    """
    out = np.full((ranks, ranks), np.inf)
    for u in range(ranks):
        for v in range(ranks):
            if u != v:
                out[u, v] = factor * topology.path_capacity(u, v)
    return out


class TransportMeter:
    """Measured rates of this process's connections to ranks in other processes, from the transport.

    Every send of the native executor to another process is recorded by the proxy with its post and
    completion times, on both backends (``cpu``: from host memory; ``cuda``: the kernel's data in
    device memory, which UCX moves). The records are process-wide: every communicator's whose collectives
    run on the meter's ``layout`` (:func:`attach`). :meth:`rates`
    drains them and measures each (sending rank, receiving rank) pair as the executor's meter
    measures an inter-node GPU pair (``xla_ffi/core/meter.h``, run through the native module;
    docs/executor.md, "Measurement"): a *window* opens when a message is posted to the idle
    pair and closes when the pair has nothing in flight any more; its bandwidth is the bytes delivered
    in it over its duration; windows under ``min_window_bytes`` are dropped; a pair's rate is the
    mean of its windows' bandwidths (what the executor's measurement records carry: ``sum_bw /
    count``). The records name no connection, so each message counts as its own: the meter's active
    count is the pair's messages in flight, which opens and closes windows exactly where active
    connections do at the executor's inter-node threshold of 1. Sends under ``min_bytes`` are left
    out: they complete in the transport's buffers. With a ``ceiling`` (bytes/s per pair: what its path
    can carry at most, :func:`plausible_ceiling`), windows above it are dropped too (counted in
    :attr:`implausible`): a window faster than the link is a send that finished in the sockets'
    buffers, and one such window would outweigh many real ones in the pair's mean.

    Two 1 MiB sends that overlap are one window of 2 MiB in 2 ms; a third, later, is a window of its own:

    >>> mib = 1 << 20
    >>> rec = [(0, 2, mib, 0, 1_000_000), (0, 2, mib, 500_000, 2_000_000), (0, 2, mib, 5_000_000, 5_500_000)]
    >>> TransportMeter.pair_windows(rec)
    {(0, 2): [1048576000.0, 2097152000.0]}
    >>> float(TransportMeter.pair_rates(rec, 4)[0, 2])
    1572864000.0

    A ceiling of 1.5 GB/s for the pair leaves the 2 GB/s window out:

    >>> ceiling = np.full((4, 4), 1.5e9)
    >>> float(TransportMeter.pair_rates(rec, 4, ceiling=ceiling)[0, 2])
    1048576000.0
    """

    def __init__(
        self,
        num_ranks: int,
        *,
        layout: int = 0,
        min_bytes: int = MIN_MEASURED_BYTES,
        min_window_bytes: int = MIN_WINDOW_BYTES,
        ceiling: np.ndarray | None = None,
    ):
        self.num_ranks, self.min_bytes, self.min_window_bytes = int(num_ranks), int(min_bytes), int(min_window_bytes)
        self.layout = int(layout)
        self.ceiling = None if ceiling is None else np.asarray(ceiling, dtype=np.float64)
        if self.ceiling is not None and self.ceiling.shape != (self.num_ranks, self.num_ranks):
            raise ArgumentError(
                f"TransportMeter: ceiling must be {self.num_ranks} x {self.num_ranks}, got {self.ceiling.shape}"
            )
        self.dropped = 0
        #: Windows dropped because they were faster than the pair's ``ceiling``.
        self.implausible = 0

    def drain(self) -> list[tuple[int, int, int, int, int]]:
        """The records of its ``layout`` since the last drain: (src rank, dst rank, bytes, post ns, done ns).

        Ranks are those of the layout's collectives (:func:`attach` returns its number). The native
        records of other layouts wait for their meters (the newest :data:`MAX_PENDING_RECORDS` per
        layout; older ones count as dropped there).
        """
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

        flat, dropped = native.module().transport_drain()
        with _pending_lock:
            for i in range(0, len(flat), 6):
                layout = int(flat[i + 5])
                queue = _pending.setdefault(layout, collections.deque(maxlen=MAX_PENDING_RECORDS))
                if len(queue) == MAX_PENDING_RECORDS:
                    _pending_lost[layout] = _pending_lost.get(layout, 0) + 1
                queue.append(tuple(flat[i : i + 5]))
            mine = _pending.pop(self.layout, ())
            lost = _pending_lost.pop(self.layout, 0)
        self.dropped += int(dropped) + lost
        return list(mine)

    def rates(self) -> np.ndarray:
        """Drains and returns the ``num_ranks x num_ranks`` matrix of measured bytes/s (NaN: not measured)."""
        records = [r for r in self.drain() if r[2] >= self.min_bytes]
        windows = self.pair_windows(records, min_window_bytes=self.min_window_bytes)
        out, implausible = self._mean_rates(windows, self.num_ranks, self.ceiling)
        self.implausible += implausible
        return out

    @staticmethod
    def pair_windows(
        records: list[tuple[int, int, int, int, int]], *, min_window_bytes: int = MIN_WINDOW_BYTES
    ) -> dict[tuple[int, int], list[float]]:
        """Per pair with at least one window: the bandwidths (bytes/s) of its windows, in the order they closed.

        ``records``: (src rank, dst rank, bytes, post ns, done ns), in any order. Each is a post at its
        post time and a delivery at its done time, replayed in time order (at equal times posts first,
        so a message posted as another completes keeps the window open) through ``meter.h``'s state
        machine (:func:`jaxccl.runtime.native.meter_windows`).
        """
        from jaxccl.runtime import native

        by_pair: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for src, dst, nbytes, post, done in records:
            by_pair.setdefault((int(src), int(dst)), []).append((int(post), max(int(done), int(post)), int(nbytes)))
        out: dict[tuple[int, int], list[float]] = {}
        for pair, msgs in sorted(by_pair.items()):
            events = sorted([(post, 0, 0) for post, _, _ in msgs] + [(done, 1, nbytes) for _, done, nbytes in msgs])
            rows = [(0, 1, t, -1, 0) if kind == 0 else (1, 1, t, 0, nbytes) for t, kind, nbytes in events]
            bw = native.meter_windows(rows, threshold=INTER_THRESHOLD, min_window_bytes=min_window_bytes)
            if (bw > 0).any():
                out[pair] = bw[bw > 0].tolist()
        return out

    @staticmethod
    def pair_rates(
        records: list[tuple[int, int, int, int, int]],
        num_ranks: int,
        *,
        min_window_bytes: int = MIN_WINDOW_BYTES,
        ceiling: np.ndarray | None = None,
    ) -> np.ndarray:
        """Per pair: the mean bandwidth (bytes/s) of its windows (:meth:`pair_windows`) at most its ``ceiling``;
        NaN where it has none."""
        windows = TransportMeter.pair_windows(records, min_window_bytes=min_window_bytes)
        return TransportMeter._mean_rates(windows, num_ranks, ceiling)[0]

    @staticmethod
    def _mean_rates(
        windows: dict[tuple[int, int], list[float]], num_ranks: int, ceiling: np.ndarray | None
    ) -> tuple[np.ndarray, int]:
        """The pairs' mean window rates, and how many windows were above their pair's ``ceiling`` (left out)."""
        out, implausible = np.full((num_ranks, num_ranks), np.nan), 0
        for (src, dst), rates in windows.items():
            kept = rates if ceiling is None else [w for w in rates if w <= ceiling[src, dst]]
            implausible += len(rates) - len(kept)
            if kept:
                out[src, dst] = sum(kept) / len(kept)
        return out, implausible
