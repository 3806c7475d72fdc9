"""The compiled executor: loads ``jaxccl._native``, registers its FFI targets, wraps its registry.

Importing this module registers the CPU targets ``jaxccl_cpu_collective`` and
``jaxccl_cpu_mp_collective`` with XLA (once per process) and, when a CUDA module
is installed and a GPU is visible, ``jaxccl_cuda_collective`` and
``jaxccl_cuda_mp_collective``. The CUDA module is the ``jaxccl-cuda12-plugin``
package's when installed (``pip install "jaxccl[cuda12]"``), else jaxccl's own
(:mod:`jaxccl.runtime.cuda_plugin`). The registry holds compiled tables
(:func:`jaxccl.schedule.table.compile_table`) in numbered slots; a compiled JAX
program names only the slot, so :func:`install` swaps schedules without
recompiling.

Example:
    >>> from jaxccl.runtime import native  # doctest: +SKIP
    >>> slot = native.new_slot()  # doctest: +SKIP
    >>> native.install(slot, schedule)  # a Schedule or a compiled table  # doctest: +SKIP
    1
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxccl.errors import ExecutorError, ScheduleError
from jaxccl.runtime import cuda_plugin
from jaxccl.schedule.ir import Schedule
from jaxccl.schedule.table import check_table, compile_table, compiled_table
from jaxccl.telemetry.stats import MeasurementStats, from_cuda_stats

try:
    from jaxccl import _native
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        f"jaxccl's native module is missing: pip install -e . (builds jaxccl._native with CMake; original error: {e})"
    ) from e

CPU_TARGET = "jaxccl_cpu_collective"
CUDA_TARGET = "jaxccl_cuda_collective"
TIMEOUT_ENV = "JAXCCL_TIMEOUT_S"

# The CUDA kernel's passive measurement (MCCL Sec. 5) as a Communicator turns it on
# (:func:`configure_cuda_measurement`): the values of LinkEmulation's defaults on the CPU executor.
CUDA_MEASURE_INTRA_THRESHOLD = 1  # active connections to the same host before a window opens (MCCL Fig. 4's N)
CUDA_MEASURE_INTER_THRESHOLD = 1  # active connections to other hosts before a window opens
CUDA_MEASURE_SLOTS_PER_TB = 8  # Measurements Buffer slots each threadblock owns (records it can hold undrained)
CUDA_MEASURE_MIN_WINDOW_BYTES = 32 << 10  # windows that carried fewer bytes are dropped as noise

_registered = False
_cuda: Any = None
_cuda_name: str | None = None  # the CUDA module loaded (one of cuda_plugin.CUDA_MODULES)
_cuda_checked = False
_cuda_error: str | None = None  # why an installed CUDA module did not load (None: one did, or none is installed)


def _register() -> None:
    global _registered
    if _registered:
        return
    import jax

    for name, capsule in _native.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    if has_cuda_support():
        for name, capsule in _cuda.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    _registered = True


def _load_cuda() -> tuple[Any, str | None, str | None]:
    """The first CUDA module of :data:`~jaxccl.runtime.cuda_plugin.CUDA_MODULES` that loads and attaches to
    ``jaxccl._native``, its name, and why the first installed one did not (``None``: it did, or none is)."""
    error = None
    for name in cuda_plugin.CUDA_MODULES:
        try:
            mod = importlib.import_module(name)
            mod.attach(_native._core_api())
        except ModuleNotFoundError as e:
            if e.name is not None and (name == e.name or name.startswith(f"{e.name}.")):
                continue  # not installed
            why = f"{name} is installed but does not load: {e}"
        except ImportError as e:  # a missing CUDA library
            why = f"{name} is installed but does not load: {e}"
        except ValueError as e:  # built from another tree than jaxccl._native
            why = f"{name} does not fit this jaxccl._native: {e}"
        else:
            if error is not None:
                logging.getLogger(__name__).warning("jaxccl uses %s: %s", name, error)
            return mod, name, None
        error = error or why
    return None, None, error


def _cuda_module() -> Any:
    """The attached CUDA module, or None when none is installed or it cannot load."""
    global _cuda, _cuda_name, _cuda_checked, _cuda_error
    if not _cuda_checked:
        _cuda_checked = True
        _cuda, _cuda_name, _cuda_error = _load_cuda()  # the CUDA module is optional: loaded on demand
    return _cuda


def cuda_module_name() -> str | None:
    """The CUDA module in use: ``"jaxccl_cuda12_plugin._native_cuda"`` (the plugin package),
    ``"jaxccl._native_cuda"`` (jaxccl's own build), or ``None`` (none loads).

    >>> cuda_module_name() in (*cuda_plugin.CUDA_MODULES, None)
    True
    """
    _cuda_module()
    return _cuda_name


def has_cuda_support() -> bool:
    """True if the CUDA executor was built and at least one CUDA device is visible."""
    mod = _cuda_module()
    return mod is not None and mod.device_count() > 0


def cuda_status() -> tuple[bool, str | None]:
    """Whether a CUDA module loads (:func:`cuda_module_name`), and why the CUDA executor cannot run here
    (``None``: it can).

    The reason says which: no CUDA module is installed (neither the plugin package nor jaxccl's own
    build), one is but does not load (a missing CUDA library, or built from another jaxccl), or it
    loads but no CUDA device is visible.

    >>> loads, reason = cuda_status()
    >>> has_cuda_support() == (reason is None) and (loads or reason is not None)
    True
    """
    mod = _cuda_module()
    if mod is None:
        return False, _cuda_error or cuda_plugin.NOT_INSTALLED
    if mod.device_count() <= 0:
        return True, f"{_cuda_name} loads, but no CUDA device is visible"
    return True, None


def process_groups_attached() -> bool:
    """Whether a transport's process groups are attached (:func:`jaxccl.distributed.transport.attach`): only
    then do the native backends run collectives whose ranks span processes.

    >>> process_groups_attached()
    False
    """
    return bool(_native.process_groups_attached())


def _wrap(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except ValueError as e:
        raise ExecutorError(str(e)) from None


def module() -> Any:
    """The ``jaxccl._native`` extension module itself (link emulation and measurement live there)."""
    return _native


def new_slot() -> int:
    """Creates an empty schedule slot and returns its id."""
    return int(_native.new_slot())


def as_table(table_or_schedule: Any, *, num_slots: int = 8) -> np.ndarray:
    """A compiled table from a :class:`~jaxccl.schedule.Schedule` (compiled here) or an int32 array."""
    if isinstance(table_or_schedule, Schedule):
        return compile_table(table_or_schedule, num_slots=num_slots)
    arr = np.asarray(table_or_schedule)
    if arr.ndim != 1 or arr.dtype != np.int32:
        raise ScheduleError(f"a compiled table is a 1-D int32 array, got {arr.dtype}{list(arr.shape)}")
    return np.ascontiguousarray(arr)


def _checked_table(table_or_schedule: Any, num_slots: int, schedule: Any) -> np.ndarray:
    """The table to hand the registry: a Schedule's (memoized) compilation, or a table checked against
    ``schedule`` when one is given (:func:`jaxccl.schedule.table.check_table`)."""
    if isinstance(table_or_schedule, Schedule):
        if schedule is not None and schedule is not table_or_schedule:
            raise ScheduleError("pass either a schedule or a table with schedule=, not two schedules")
        return compiled_table(table_or_schedule, num_slots=num_slots)
    table = as_table(table_or_schedule, num_slots=num_slots)
    return table if schedule is None else check_table(schedule, table)


def install(slot: int, table_or_schedule: Any, *, num_slots: int = 8, schedule: Any = None) -> int:
    """Validates a table (or compiles a Schedule) and makes it the slot's current version.

    Launches that have already picked a table keep theirs; the next launch runs
    the new one. Returns the new version number (1, 2, ...). With ``schedule=``, a
    table must be exactly that schedule's compilation. A raw table without it is
    only checked for integrity: the executor's own tests feed it malformed tables;
    a :class:`~jaxccl.Communicator` always stages the schedule with its table.

    Raises:
        ScheduleError: the table is not the compilation of ``schedule``.
        ExecutorError: the table is malformed (the message names the bad word),
            changed after :func:`~jaxccl.schedule.table.compile_table` sealed it
            ("checksum mismatch"), or the slot does not exist.
    """
    table = _checked_table(table_or_schedule, num_slots, schedule)
    return int(_wrap(_native.install, int(slot), table))


def stage(
    slot: int,
    table_or_schedule: Any,
    *,
    num_slots: int = 8,
    transition_seq: int | None = None,
    schedule: Any = None,
) -> int:
    """Stages a table (MCCL Sec. 6.2.2 hot-swap): it becomes current at the first launch after the
    transition point, the largest collective sequence number any rank has issued on the slot so far.

    Collectives already issued by some rank finish on the old table, so all
    ranks switch at the same call. The slot's first table is current at once.
    ``transition_seq`` sets the transition point instead (one agreed by several
    processes, :func:`jaxccl.distributed.transport.stage_agreed`); it is refused
    when a rank already issued a later call. Returns the staged version.

    ``schedule=`` checks a table as in :func:`install`.

    Raises:
        ScheduleError: the table is not the compilation of ``schedule``.
        ExecutorError: the table is malformed or the slot does not exist.
    """
    transition = -1 if transition_seq is None else int(transition_seq)
    table = _checked_table(table_or_schedule, num_slots, schedule)
    return int(_wrap(_native.stage, int(slot), table, transition))


def swap_state(slot: int) -> dict[str, int]:
    """``current_version``, ``staged_version`` (0: none), ``transition_seq``, ``issued`` (largest sequence
    number issued by any rank), ``last_swap_seq`` and ``last_swap_ns`` of a slot, and the checksum words of
    its current and staged tables (``current_checksum``, ``staged_checksum``; 0: none)."""
    return {k: int(v) for k, v in _wrap(_native.swap_state, int(slot)).items()}


def validate_table(table: np.ndarray) -> None:
    """Runs the native word-by-word check of a compiled table; raises ``ExecutorError``."""
    _wrap(_native.validate, as_table(table))


def current_version(slot: int) -> int:
    """The slot's current table version (0 before the first install)."""
    return int(_wrap(_native.current_version, int(slot)))


def remove(slot: int) -> None:
    """Deletes a slot; launches already running keep their table."""
    _wrap(_native.remove, int(slot))


def launch_count(slot: int) -> int:
    """How many launches have picked a table from this slot."""
    return int(_wrap(_native.launch_count, int(slot)))


def last_launch_seconds(slot: int) -> float:
    """Executor time of the slot's most recently finished launch (start to last threadblock), in seconds."""
    return float(_wrap(_native.last_launch_seconds, int(slot)))


def last_launch_version(slot: int) -> int:
    """The table version the slot's most recent launch ran (0 if none)."""
    return int(_wrap(_native.last_launch_version, int(slot)))


def set_timeout(seconds: float) -> None:
    """Sets the deadline (seconds) of every rendezvous and executor wait; default 60 or ``$JAXCCL_TIMEOUT_S``."""
    _wrap(_native.set_timeout, float(seconds))


def set_program_order(on: bool) -> None:
    """For comparisons: run every threadblock in program order, untiled (the executor before dataflow order).

    Off by default (docs/executor.md, "No head-of-line blocking"); launches that start afterwards use it.

    >>> set_program_order(False)
    """
    _native.set_program_order(bool(on))


def set_tile_cap(max_tiles: int | None) -> None:
    """For comparisons: the CPU executor cuts a launch into at most ``max_tiles`` tiles (``None``: the default).

    The default is the executor core's ``MAX_TILES`` (docs/executor.md, "Tiles"); launches that start
    afterwards use the cap.

    >>> set_tile_cap(None)

    Raises:
        ValueError: ``max_tiles`` is outside ``1..MAX_TILES``.
    """
    _native.set_tile_cap(int(_native.MAX_TILES if max_tiles is None else max_tiles))


def set_huge_pages(on: bool) -> None:
    """Whether the CPU executor asks for transparent huge pages for large fresh outputs (default on).

    XLA allocates a fresh output buffer for every call; one of ``HUGE_PAGES_MIN_BYTES`` (32 MiB) or more
    is a fresh mapping whose first write would fault in every 4 KiB page. Each rank advises huge pages
    for its output before writing it, where :func:`huge_pages_usable` (docs/executor.md, "Output
    memory"). Off is for comparisons; launches that start afterwards use the setting.

    >>> set_huge_pages(True); huge_pages()
    True
    """
    _native.set_huge_pages(bool(on))


def huge_pages() -> bool:
    """Whether large output buffers are advised into transparent huge pages (:func:`set_huge_pages`)."""
    return bool(_native.huge_pages())


def huge_pages_usable() -> bool:
    """False in a virtual machine whose host takes back free 2 MiB blocks (then no buffer is advised).

    A virtio balloon device with free page reporting at 2 MiB hands such blocks back to the hypervisor,
    and the first touch of a huge page made of one waits for the host (docs/executor.md).
    """
    return bool(_native.huge_pages_usable())


def set_prefault(on: bool) -> None:
    """Whether each rank faults in its fresh output of ``PREFAULT_MIN_BYTES`` (8 MiB) or more at once (default on).

    One ``madvise(MADV_POPULATE_WRITE)`` while the rank waits for the others to arrive, instead of one
    page fault per 4 KiB during the copies (docs/executor.md, "Output memory"). Off is for comparisons.

    >>> set_prefault(True); prefault()
    True
    """
    _native.set_prefault(bool(on))


def prefault() -> bool:
    """Whether fresh outputs are faulted in at once (:func:`set_prefault`)."""
    return bool(_native.prefault())


def set_identity_checks(on: bool) -> None:
    """Whether receivers check that each message belongs to their own table and launch (default on).

    Every message carries the identity of the launch that posted it (table checksum, launch number), and a
    receiver refuses any other with an :class:`~jaxccl.ExecutorError` naming both (docs/executor.md,
    "Message identity"). Off is for measuring what the check costs, never for training.

    >>> set_identity_checks(True); identity_checks()
    True
    """
    _native.set_identity_checks(bool(on))


def identity_checks() -> bool:
    """Whether receivers check message identities (:func:`set_identity_checks`)."""
    return bool(_native.identity_checks())


def _inject_stale_message(slot: int, *, across_processes: bool = False) -> None:
    """Tests only: the next message posted on ``slot`` carries the identity of the slot's previous launch.

    With ``across_processes``, the next message to a rank in another process (its trailer on the wire).
    Its receiver must refuse it: the launch fails with an :class:`~jaxccl.ExecutorError` that names the
    stale identity and its own, and the communicator stays usable.
    """
    _native._inject_stale_message(int(slot), bool(across_processes))


def configure_cuda_measurement(
    host_of_rank: Sequence[int],
    *,
    enabled: bool = True,
    intra_threshold: int = CUDA_MEASURE_INTRA_THRESHOLD,
    inter_threshold: int = CUDA_MEASURE_INTER_THRESHOLD,
    slots_per_tb: int = CUDA_MEASURE_SLOTS_PER_TB,
    min_window_bytes: int = CUDA_MEASURE_MIN_WINDOW_BYTES,
) -> None:
    """Turns the CUDA kernel's passive measurement on (or off) for the launches that start from now on.

    The settings are process-wide (one set for every CUDA collective). A
    :class:`~jaxccl.Communicator` with ``backend="cuda"`` and a topology calls
    this with its ranks' hosts and the defaults; :func:`drain_cuda_measurement`
    collects the records, :func:`cuda_measurement` the counters.

    Args:
        host_of_rank: the host id of each rank of the axis (empty: all on one host).
        enabled: measure (else launches from now on do not).
        intra_threshold: active connections of an accumulator to its own host before a window opens.
        inter_threshold: the same for connections to other hosts.
        slots_per_tb: Measurements Buffer slots each threadblock owns.
        min_window_bytes: windows that carried fewer bytes are dropped.

    Raises:
        ExecutorError: the CUDA module is not built, or it refused a setting (a negative host id,
            more ranks than it supports, a threshold or slot count out of range).
    """
    mod = _cuda_module()
    if mod is None:
        raise ExecutorError(f"configure_cuda_measurement: {cuda_plugin.NOT_INSTALLED}")
    settings = (int(intra_threshold), int(inter_threshold), int(slots_per_tb), int(min_window_bytes))
    _wrap(mod.measure_configure, bool(enabled), [int(h) for h in host_of_rank], *settings)


def drain_cuda_measurement() -> tuple[bytes, int]:
    """The CUDA kernel's measurement records (32 bytes each, freed) and how many were dropped since the last drain.

    Process-wide: the records of every CUDA collective of this process. :meth:`jaxccl.Communicator.telemetry`
    calls it on the ``cuda`` backend.

    Raises:
        ExecutorError: no CUDA module is installed.
    """
    raw, dropped = _cuda_measure("drain_cuda_measurement", "measure_drain")
    return bytes(raw), int(dropped)


def cuda_measurement(*, dropped_before: int = 0) -> MeasurementStats:
    """The CUDA kernel's measurement counters and footprint (process-wide) as a :class:`MeasurementStats`.

    What :meth:`jaxccl.Communicator.measurement` returns on the ``cuda`` backend; the mapping of the
    module's ``measure_stats()`` is :func:`jaxccl.telemetry.stats.from_cuda_stats`. ``dropped_before``:
    the ``dropped_total`` of the caller's previous reading.

    Raises:
        ExecutorError: the CUDA module is not built.
    """
    return from_cuda_stats(_cuda_measure("cuda_measurement", "measure_stats"), dropped_before=dropped_before)


def _cuda_measure(caller: str, function: str) -> Any:
    mod = _cuda_module()
    if mod is None:
        raise ExecutorError(f"{caller}: {cuda_plugin.NOT_INSTALLED}")
    return _wrap(getattr(mod, function))


def _stable_sources(table: np.ndarray) -> list[tuple[int, bool, bool]]:
    """Tests only: the core's stable-source rules (``xla_ffi/core/stable_source.h``) for a compiled table.

    One ``(op, final at its dependency, stable in flight)`` per op that sends a range of its buffers
    (every sending op but ``rrs``), ops numbered in table order. Stable in flight is the rule of the
    table's direct flag (``jaxccl.schedule.table._direct_sends``); raises ``ExecutorError`` for a table
    the registry would refuse.
    """
    return [(int(o), bool(f), bool(s)) for o, f, s in _wrap(_native._stable_sources, as_table(table))]


def get_timeout() -> float:
    """The current deadline of rendezvous and executor waits, in seconds."""
    return float(_native.get_timeout())


def stats() -> dict[str, int]:
    """Executor bookkeeping: pending rendezvous entries, occurrence counters, slots, and across processes the
    messages received straight into their receiver's output (``in_place_receives``) and the connections closed
    because a failed launch left such a message in flight (``in_place_disconnects``)."""
    return {k: int(v) for k, v in _native.stats().items()}


LOOKAHEAD = int(_native.LOOKAHEAD)  # units a threadblock considers at once (kLookahead, core/protocol.h)
ALL_DONE = int(_native.ALL_DONE)
NONE_READY = int(_native.NONE_READY)


def parse_table(table_or_schedule: Any, *, num_slots: int = 8) -> Any:
    """The native parser's table and the per-rank programs it builds, kept for :func:`program_rows` and
    :func:`next_ready_unit` (a Schedule is compiled with ``num_slots`` first).

    Raises:
        ExecutorError: the table is not valid (the parser's message).
    """
    if isinstance(table_or_schedule, _native.ParsedTable):
        return table_or_schedule
    return _wrap(_native.ParsedTable, _checked_table(table_or_schedule, num_slots, None))


def program_rows(table_or_schedule: Any, *, num_slots: int = 8) -> dict[str, Any]:
    """The per-rank programs the executor builds of a table (``core/program_builder.h``), for models of its order.

    Returns ``in_order`` (the table deadlocks in program order, so every op waits for its predecessor),
    ``num_slots``, ``conn_msgs`` (messages per connection and tile) and ``ranks``: per rank ``tbs`` (first op,
    ops, send and receive connection; -1: none) and per op (rank-local) ``kind`` (its code), ``dep`` (-1:
    none), ``waits`` (the ops it waits for besides its dependency), ``send_msg`` and ``recv_msg``.
    :mod:`jaxccl.sim.ordering` is the simulator's port of the rule; ``tests/sim/test_ordering_agreement.py``
    compares the two.

    >>> from jaxccl.synth.baselines import ring_allgather
    >>> rank0 = program_rows(ring_allgather(3))["ranks"][0]  # s, cpy, rcs, r: messages 0, 1 out and 0, 1 in
    >>> rank0["tbs"], rank0["send_msg"], rank0["recv_msg"], rank0["waits"]
    ([(0, 4, 0, 2)], [0, -1, 1, -1], [-1, -1, 0, 1], [[], [], [], []])

    Raises:
        ExecutorError: the table is not valid (the parser's message).
    """
    d = _native.program_rows(parse_table(table_or_schedule, num_slots=num_slots))
    return {
        "in_order": bool(d["in_order"]),
        "num_slots": int(d["num_slots"]),
        "conn_msgs": [int(m) for m in d["conn_msgs"]],
        "ranks": [{k: [list(w) for w in v] if k == "waits" else [tuple(x) for x in v] if k == "tbs" else list(v)
                   for k, v in r.items()} for r in d["ranks"]],
    }  # fmt: skip


def next_ready_unit(
    table: Any,
    rank: int,
    tb: int,
    tiles: int,
    first: int,
    done: np.ndarray,
    posted: np.ndarray,
    consumed: np.ndarray,
    *,
    lookahead: int = LOOKAHEAD,
) -> tuple[int, int]:
    """``NextReadyUnit`` (``core/protocol.h``) of threadblock ``tb`` of ``rank`` over flag arrays.

    ``table``: a compiled table, or (cheaper when asked many times) its :func:`parse_table`.
    ``done[tile * num_ops + op]``: the rank's units done; ``posted[k * stride + m]`` / ``consumed[k * stride + m]``:
    message ``m`` of connection ``k`` posted / consumed (``stride``: the array's size over the connections).
    Returns ``(unit, first)``: the unit to run (or :data:`ALL_DONE`, :data:`NONE_READY`) and the threadblock's
    first unfinished unit.

    Raises:
        ExecutorError: the table is not valid, or an argument does not fit it.
    """
    i32 = [np.ascontiguousarray(a, dtype=np.int32) for a in (done, posted, consumed)]
    unit, nfirst = _wrap(
        _native.next_ready_unit, parse_table(table), int(rank), int(tb), int(tiles), int(first), *i32, int(lookahead)
    )
    return int(unit), int(nfirst)


def meter_windows(events: Any, *, threshold: int, min_window_bytes: int) -> np.ndarray:
    """Replays events through one accumulator of the executor's meter (``MeterOnPost`` / ``MeterOnDelivered``).

    ``events``: rows ``(0, became_busy, tx_start_ns, tx_end_ns, 0)`` for a post (``tx_end_ns < 0``: no
    transmission interval is known) and ``(1, now_idle, done_ns, 0, bytes)`` for a delivery, in the order
    they happened. Returns, per event, the bandwidth (bytes/s) of the window it closed, or -1.

    >>> meter_windows([[0, 1, 0, -1, 0], [1, 1, 2_000_000, 0, 1 << 20]], threshold=1, min_window_bytes=0).tolist()
    [-1.0, 524288000.0]

    Raises:
        ExecutorError: a row is neither a post nor a delivery, or ``threshold < 1``.
    """
    flat = np.ascontiguousarray(np.asarray(events, dtype=np.int64).reshape(-1))
    return np.asarray(_wrap(_native.meter_windows, flat, int(threshold), int(min_window_bytes)), dtype=np.float64)


def _timeout_from_env() -> None:
    value = os.environ.get(TIMEOUT_ENV)
    if value is None or not value.strip():
        return
    try:
        seconds = float(value)
    except ValueError:
        raise ExecutorError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from None
    try:
        set_timeout(seconds)
    except ExecutorError as e:
        raise ExecutorError(f"{TIMEOUT_ENV}={value!r}: {e}") from None


_timeout_from_env()
_register()
