"""Model-based testing of change: a Hypothesis state machine that hot-swaps schedules under running collectives.

jaxccl promises results bitwise equal to ``jax.lax`` while schedules change under a
running job. :class:`ChangeMachine` (a :class:`hypothesis.stateful.RuleBasedStateMachine`)
drives a :class:`Harness` of communicators on 8 emulated CPU devices through the
changes a job sees, in any order:

* installing a schedule (``comm.install`` or ``comm.stage_validated`` with a
  precompiled table), reinstalling one used before, bouncing ``A -> B -> A``
  with a call after each install (four times per step), and sweeping
  ``A -> B -> A`` over every ``B`` of a collective's pool in one step;
* staging a table at an agreed call (``native.stage(slot, table,
  transition_seq=issued + ahead)``): the model predicts which table version
  every later launch runs and checks it (``last_launch_version``);
* hot-swapping from another thread (installs, and link faults on the emulated
  fabric) while the main thread runs collectives;
* changing the per-rank size (1 element to 64 KiB, sizes that no chunk count
  divides) and dtype (float32, int32, bfloat16);
* injecting link faults (MCCL's Fail1-3 on any GPU, degraded NICs and NVLinks,
  healing) on a communicator with link emulation;
* closing a communicator and opening a new one in its place.

Schedules come from one pool per process (:func:`schedule_pool`): every baseline
(direct, rings, rail rings, recursive doubling, NCCL-like rings and trees,
ordered folds, binary and double binary trees) and synthesized ones
(``jaxccl.synth.all_gather``, ``all_to_all``, ``reduce_scatter`` and the ordered
ReduceScatter) for the rail topology ``rail(hosts=2, gpus_per_host=4)``, healthy
and under faults. Every collective's result is compared bitwise with ``jax.lax``
on random non-zero data. Float reductions are bitwise only when every schedule
that may run sums in ascending rank order (``info["ordered_reduction"]``); a
reduction that may run any other schedule gets int32 data, whose sums are exact
in any order (as ``benchmarks/correctness/soak.py`` does).

Two ways to check, one machine:

* ``mode="host"`` (the CI test, ``tests/runtime/test_stateful_change.py``): one jitted
  program per (communicator, collective, size, dtype) runs one collective; the
  ``jax.lax`` reference runs in its own program (outside any ``with comm:``, so
  it is compiled once per size and dtype) and the results are compared on the
  host, naming the ranks and blocks that differ.
* ``mode="batched"`` (the long profile, ``benchmarks/correctness/stateful_change.py``): one
  jitted program runs ``K`` collectives in a ``lax.scan``, each on fresh
  pseudo-random data made inside the program from a seed, and returns per rank
  and collective a 64-bit digest of the result's bits (two position-dependent
  32-bit hashes); a ``jax.lax`` program makes the same data from the same seed
  and the digests are compared on the host. The reference is a program of its
  own, not part of the jaxccl one: when a jaxccl collective fails on some ranks
  only, XLA's own collectives in the same program would wait for the missing
  ranks and XLA aborts the whole process after 40 s.

A mismatch or error never stops the steps: the harness records it (errors by
type), opens a fresh communicator in place of one that raised, and goes on. The
test's machine raises :class:`CheckFailure` listing every failure at the end of
the example (its teardown). Failures of this kind are often timing-dependent
(a race in the executor shows on some runs of a sequence, not all): stopping at
the first one would make Hypothesis see a different number of steps drawn from
run to run (``FlakyStrategyDefinition``) instead of shrinking; drawing the same
steps whatever happens keeps the shrinker working, and a replay that happens
not to fail is reported as ``Flaky`` with the failing steps. The long profile
(``benchmarks/correctness/stateful_change.py``) only counts. :meth:`Harness.call` and the
other methods raise at once when the harness is ``strict`` (for direct use).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl
from jaxccl.cli.bench_run import AXIS, collective_body
from jaxccl.errors import ExecutorError
from jaxccl.runtime import native
from jaxccl.schedule.fusion import fuse_all_reduce
from jaxccl.schedule.ir import Schedule
from jaxccl.schedule.table import compiled_table, header

__all__ = [
    "COLLECTIVES",
    "COMMS",
    "DTYPES",
    "FAULTS",
    "SIZE_LEVELS",
    "TARGETS",
    "ChangeMachine",
    "Entry",
    "Harness",
    "Mismatch",
    "schedule_pool",
]

NUM_RANKS = 8  # on the mesh axis AXIS ("d"), the one jaxccl bench's collective bodies use
COLLECTIVES = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce")
REDUCTIONS = ("reduce_scatter", "all_reduce")
DTYPES = ("float32", "int32", "bfloat16")
_NP_DTYPES: dict[str, Any] = {"float32": np.float32, "int32": np.int32, "bfloat16": jnp.bfloat16}
_UINT_OF: dict[str, Any] = {"float32": jnp.uint32, "int32": jnp.uint32, "bfloat16": jnp.uint16}

# Per-rank sizes, from tiny to 64 KiB of float32: (elements per rank of all_gather / all_reduce,
# period of all_to_all / reduce_scatter, whose per-rank input is NUM_RANKS times the period).
# 7 and 4099 are primes, 125 and 513 odd: most chunk counts of the pool (2, 3, 4, 8, 16, 25, 32) divide none of them.
SIZE_LEVELS: tuple[tuple[int, int], ...] = ((1, 1), (7, 7), (64, 8), (1000, 125), (4099, 513), (16384, 2048))

# "plain": Communicator(mesh, "d", backend="cpu") without a topology (psum runs the all_reduce schedule).
# "rail": the rail topology with link emulation (faults; psum is the ReduceScatter and AllGather fused into one
# launch until an all_reduce schedule is installed).
COMMS = ("plain", "rail")

# Fabrics injected into the "rail" communicator: (name, gpu) -> Topology, see Harness.fabric.
FAULTS = ("healthy", "fail1", "fail2", "fail3", "slow_nic", "slow_nvlink")


# --------------------------------------------------------------------------------------------- pool
@dataclasses.dataclass(frozen=True)
class Entry:
    """One schedule of the pool, validated, with its compiled table.

    Attributes:
        collective: ``all_gather``, ``all_to_all``, ``reduce_scatter`` or ``all_reduce``.
        key: its name in the pool (unique per collective).
        schedule: the validated schedule.
        table: its compiled table (``compile_table(schedule, num_slots=8)``), for staging without compiling.
        ordered: whether it sums in ascending rank order (float reductions bitwise equal to ``jax.lax``).
    """

    collective: str
    key: str
    schedule: Schedule
    table: np.ndarray
    ordered: bool


def _recipes() -> dict[str, dict[str, Callable[[Any], Schedule]]]:
    """How to build every schedule of the pool from the rail topology (keys are the pool's names)."""
    from jaxccl.runtime import default_schedules
    from jaxccl.synth import baselines, nccl
    from jaxccl.synth.ordered_reduce_scatter import ordered_reduce_scatter
    from jaxccl.topology import scenario

    synth = jaxccl.synth
    n = NUM_RANKS
    return {
        "all_gather": {
            "direct": lambda t: default_schedules.direct_allgather(n),
            "ring": lambda t: baselines.ring_allgather(n),
            "ring_bidir_4ch": lambda t: baselines.ring_allgather(n, channels=4, bidirectional=True),
            "rail_ring_2ch": lambda t: baselines.ring_allgather(t, channels=2),
            "recursive_doubling": lambda t: baselines.recursive_doubling_allgather(n),
            "nccl": lambda t: nccl.nccl_allgather(t),
            "synth": lambda t: synth.all_gather(t),
            "synth_latency": lambda t: synth.all_gather(t, method="latency"),
            "synth_fail1": lambda t: synth.all_gather(scenario(t, "fail1")),
            "synth_fail2": lambda t: synth.all_gather(scenario(t, "fail2")),
            "synth_fail3_gpu5": lambda t: synth.all_gather(scenario(t, "fail3", gpu=5)),
        },
        "all_to_all": {
            "direct": lambda t: baselines.direct_alltoall(n),
            "nccl": lambda t: nccl.nccl_alltoall(t),
            "synth": lambda t: synth.all_to_all(t),
            "synth_fail1": lambda t: synth.all_to_all(scenario(t, "fail1")),
            "synth_fail2": lambda t: synth.all_to_all(scenario(t, "fail2")),
            "synth_fail3_gpu5": lambda t: synth.all_to_all(scenario(t, "fail3", gpu=5)),
        },
        "reduce_scatter": {
            "direct": lambda t: baselines.direct_reduce_scatter(n),
            "ring": lambda t: baselines.ring_reduce_scatter(n),
            "ring_bidir_4ch": lambda t: baselines.ring_reduce_scatter(n, channels=4, bidirectional=True),
            "rail_ring_2ch": lambda t: baselines.ring_reduce_scatter(t, channels=2),
            "nccl": lambda t: nccl.nccl_reduce_scatter(t),
            "synth": lambda t: synth.reduce_scatter(t),
            "synth_fail2": lambda t: synth.reduce_scatter(scenario(t, "fail2")),
            "ordered": lambda t: ordered_reduce_scatter(t),
            "ordered_fail2": lambda t: ordered_reduce_scatter(scenario(t, "fail2")),
        },
        "all_reduce": {
            "direct": lambda t: default_schedules.direct_allreduce(n),
            "ordered": lambda t: baselines.ordered_allreduce(n),
            "ordered_rail": lambda t: baselines.ordered_allreduce(t),
            "ring": lambda t: baselines.ring_allreduce(n),
            "rail_ring_2ch": lambda t: baselines.ring_allreduce(t, channels=2),
            "binary_tree": lambda t: baselines.binary_tree_allreduce(n),
            "double_binary_tree": lambda t: baselines.double_binary_tree_allreduce(n),
            "nccl_ring": lambda t: nccl.nccl_allreduce(t),
            "nccl_tree": lambda t: nccl.nccl_allreduce(t, method="tree"),
        },
    }


# The keys, without building anything: what the strategies draw from.
POOL_KEYS: dict[str, tuple[str, ...]] = {
    "all_gather": (
        "direct",
        "ring",
        "ring_bidir_4ch",
        "rail_ring_2ch",
        "recursive_doubling",
        "nccl",
        "synth",
        "synth_latency",
        "synth_fail1",
        "synth_fail2",
        "synth_fail3_gpu5",
    ),
    "all_to_all": ("direct", "nccl", "synth", "synth_fail1", "synth_fail2", "synth_fail3_gpu5"),
    "reduce_scatter": (
        "direct",
        "ring",
        "ring_bidir_4ch",
        "rail_ring_2ch",
        "nccl",
        "synth",
        "synth_fail2",
        "ordered",
        "ordered_fail2",
    ),
    "all_reduce": (
        "direct",
        "ordered",
        "ordered_rail",
        "ring",
        "rail_ring_2ch",
        "binary_tree",
        "double_binary_tree",
        "nccl_ring",
        "nccl_tree",
    ),
}
TARGETS: tuple[tuple[str, str], ...] = tuple((c, k) for c in COLLECTIVES for k in POOL_KEYS[c])
DEFAULT_KEY = "direct"  # what a new communicator runs (its all_reduce only without a topology)


def rail_topology() -> Any:
    """The rail fabric of the machine: 2 hosts x 4 GPUs (MCCL's rail-optimized HPN)."""
    return jaxccl.topology.rail(hosts=2, gpus_per_host=4)


@functools.cache
def schedule_pool() -> dict[str, dict[str, Entry]]:
    """Every schedule the machine installs, built, validated and compiled once per process.

    Returns:
        ``{collective: {key: Entry}}`` with the keys of :data:`POOL_KEYS`.
    """
    from jaxccl.schedule.table import compile_table

    topo = rail_topology()
    pool: dict[str, dict[str, Entry]] = {}
    recipes = _recipes()
    for coll in COLLECTIVES:
        if tuple(recipes[coll]) != POOL_KEYS[coll]:
            raise AssertionError(f"POOL_KEYS[{coll!r}] is out of date")
        pool[coll] = {}
        for key, build in recipes[coll].items():
            s = build(topo).validate()
            if s.collective.value != coll or s.num_ranks != NUM_RANKS:
                raise AssertionError(f"{coll}/{key}: built {s.collective.value} for {s.num_ranks} ranks")
            ordered = bool(s.info.get("ordered_reduction", False))
            pool[coll][key] = Entry(coll, key, s, compile_table(s, num_slots=8), ordered)
    return pool


# ------------------------------------------------------------------------------------------ model
@dataclasses.dataclass
class CommModel:
    """What the harness knows about one communicator: what it runs, ran and will run.

    Attributes:
        name: ``"plain"`` or ``"rail"``.
        comm: the communicator.
        current: per collective, the pool key of the schedule of the slot's current table (the one
            launches run until a staged table's transition passes); ``"none"`` for all_reduce on a
            topology communicator before one is installed (psum then runs the fusion of the halves).
        version: per collective, the registry version of the current table.
        staged: per collective, the staged table: ``(key, transition_seq, version)``; it becomes
            current at the first launch numbered above ``transition_seq`` (an install stages at the
            largest call issued so far: the next launch runs it).
        history: per collective, the keys installed since the communicator was opened, in order.
        fabric: the injected fabric (``"healthy"`` or ``"<fault>@<gpu>"``).
        level: index into :data:`SIZE_LEVELS` of the size calls use now.
        dtype: the dtype calls use now (reductions that may run an unordered schedule use int32).
        opened: how many communicators this name has had (1 for the first).
    """

    name: str
    comm: Any
    current: dict[str, str]
    version: dict[str, int]
    staged: dict[str, tuple[str, int, int]]
    history: dict[str, list[str]]
    fabric: str = "healthy"
    level: int = 2
    dtype: str = "float32"
    opened: int = 1


@dataclasses.dataclass
class Mismatch:
    """A collective whose result differed from ``jax.lax`` (or a launch that ran an unexpected table).

    Attributes:
        what: a one-line description: communicator, collective, size, dtype, schedules, what differed.
        collectives: how many collectives of the call differed.
        elements: how many elements differed, summed over ranks (host mode; batched mode compares digests).
    """

    what: str
    collectives: int
    elements: int


class CheckFailure(AssertionError):
    """A result differed from ``jax.lax``, or a launch ran a table the model did not predict."""


@dataclasses.dataclass
class Stats:
    """Counters of a harness (summed over every communicator it opened)."""

    collectives: int = 0
    calls: int = 0
    swaps: int = 0
    thread_swaps: int = 0
    staged_at_seq: int = 0
    faults: int = 0
    reopens: int = 0
    version_checks: int = 0
    mismatching_collectives: int = 0
    mismatching_elements: int = 0
    per_collective: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    per_dtype: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    per_level: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    error_samples: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    mismatches: list[Mismatch] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The counters as plain JSON-able values (at most 50 mismatch descriptions)."""
        return {
            "collectives": self.collectives,
            "calls": self.calls,
            "swaps": self.swaps,
            "thread_swaps": self.thread_swaps,
            "staged_at_seq": self.staged_at_seq,
            "faults": self.faults,
            "reopens": self.reopens,
            "version_checks": self.version_checks,
            "mismatches": self.mismatching_collectives,
            "mismatching_elements": self.mismatching_elements,
            "per_collective": dict(self.per_collective),
            "per_dtype": dict(self.per_dtype),
            "per_size": {str(SIZE_LEVELS[k][0]): v for k, v in sorted(self.per_level.items())},
            "errors": dict(self.errors),
            "error_samples": self.error_samples,
            "mismatch_samples": [dataclasses.asdict(m) for m in self.mismatches[:50]],
        }


# ---------------------------------------------------------------------------------------- harness
def _body(lib: Any, coll: str) -> Callable[[Any], Any]:
    """The collective ``coll`` through ``lib`` (``jaxccl`` or ``jax.lax``) on a 1-D block (``jaxccl bench``'s body)."""
    return collective_body(lib, {"reduce_scatter": "psum_scatter", "all_reduce": "psum"}.get(coll, coll))


def per_rank_elements(coll: str, level: int) -> int:
    """Input elements per rank of ``coll`` at size ``level``."""
    gather, period = SIZE_LEVELS[level]
    return gather if coll in ("all_gather", "all_reduce") else NUM_RANKS * period


def _blocks(coll: str) -> int:
    """Blocks per rank of the result (AllGather/AllToAll: one per source rank)."""
    return NUM_RANKS if coll in ("all_gather", "all_to_all") else 1


def _mix(u: Any) -> Any:
    """A 32-bit integer hash (lowbias32), elementwise on uint32."""
    u = u ^ (u >> 16)
    u = u * jnp.uint32(0x7FEB352D)
    u = u ^ (u >> 15)
    u = u * jnp.uint32(0x846CA68B)
    return u ^ (u >> 16)


def _device_data(seed: Any, step: Any, elems: int, dtype: str) -> Any:
    """Pseudo-random, non-zero data of one rank for collective ``step`` (inside shard_map)."""
    rank = jax.lax.axis_index(AXIS).astype(jnp.uint32)
    u = jax.lax.iota(jnp.uint32, elems) * jnp.uint32(0x9E3779B1)
    u = _mix(u ^ _mix(seed.astype(jnp.uint32) ^ (step.astype(jnp.uint32) * jnp.uint32(0x85EBCA77)) ^ (rank << 24)))
    if dtype == "int32":
        x = (u >> 11).astype(jnp.int32) - (1 << 20)  # |x| <= 2**20: int32 sums of 8 terms never wrap
        return jnp.where(x == 0, 1, x)
    f = jax.lax.bitcast_convert_type((u >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.5  # [-0.5, 0.5)
    f = jnp.where(f == 0, 0.25, f) * 8.0
    return f.astype(_NP_DTYPES[dtype])


def _digest(y: Any, dtype: str) -> Any:
    """Two 32-bit hashes of one rank's result (position-dependent, so a misplaced block changes them)."""
    bits = jax.lax.bitcast_convert_type(y, _UINT_OF[dtype]).astype(jnp.uint32).reshape(-1)
    idx = jax.lax.iota(jnp.uint32, bits.shape[0])
    h1 = jnp.sum(_mix(bits ^ (idx * jnp.uint32(0x9E3779B1))), dtype=jnp.uint32)
    h2 = jnp.sum(_mix(_mix(bits + jnp.uint32(0x632BE5AB)) ^ (idx * jnp.uint32(0x85EBCA77))), dtype=jnp.uint32)
    return jnp.stack([h1, h2])


def _digest_program(mesh: Mesh, collective: Callable[[Any], Any], elems: int, dtype: str, k: int) -> Callable:
    """A jitted program: ``k`` collectives on fresh data from a seed; per rank, the digest of each result.

    Takes a ``uint32[1]`` seed; returns ``uint32[ranks * k, 2]`` (rank-major).
    """

    def body(seed: Any) -> Any:
        def one(carry: Any, step: Any) -> tuple[Any, Any]:
            return carry, _digest(collective(_device_data(seed[0], step, elems, dtype)), dtype)

        _, digests = jax.lax.scan(one, jnp.int32(0), jnp.arange(k, dtype=jnp.int32))
        return digests

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(AXIS)))


def host_data(rng: np.random.Generator, coll: str, level: int, dtype: str) -> np.ndarray:
    """Random, non-zero global input of ``coll`` (all ranks' blocks, concatenated) at size ``level``."""
    n = NUM_RANKS * per_rank_elements(coll, level)
    if dtype == "int32":
        x = rng.integers(-(2**20), 2**20, size=n, dtype=np.int32)
        return np.where(x == 0, 1, x).astype(np.int32)
    x = rng.standard_normal(n) + 0.25
    return np.where(x == 0, 0.25, x).astype(_NP_DTYPES[dtype])


class Harness:
    """The system under test and its model: communicators on 8 CPU devices, their schedules, the checks.

    Args:
        mode: ``"host"`` (one collective per jitted call, compared on the host) or ``"batched"``
            (``batch[level]`` collectives per jitted call, compared inside the program).
        strict: raise :class:`CheckFailure` at once at a mismatch (direct use); otherwise record it in
            :attr:`failures` and go on (the state machine, the long profile).
        batch: collectives per jitted call in batched mode, per size level.
        time_scale: link emulation time scale of the ``"rail"`` communicator.
        seed: seed of the host data.
        reopen_interval_s: at least this many seconds between two reopens (reopening recompiles
            every program of the communicator; the long profile spaces them out).

    Attributes:
        stats: the counters.
        failures: one line per mismatch, wrong version or error, prefixed with :attr:`where`.
        where: what the machine is doing (its step and rule), for :attr:`failures`.
        busy: ``(start time, description)`` of the blocking call in progress, else ``None`` (the watchdog's view).
        stop: set to make every later rule return at once (the long profile's time limit).
    """

    def __init__(
        self,
        *,
        mode: str = "host",
        strict: bool = True,
        batch: Sequence[int] = (64, 64, 64, 64, 32, 16),
        time_scale: float = 1e-2,
        seed: int = 0,
        reopen_interval_s: float = 0.0,
    ) -> None:
        if mode not in ("host", "batched"):
            raise ValueError(f"mode must be 'host' or 'batched', got {mode!r}")
        if len(batch) != len(SIZE_LEVELS):
            raise ValueError(f"batch needs one count per size level ({len(SIZE_LEVELS)})")
        self.mode = mode
        self.strict = strict
        self.batch = tuple(int(k) for k in batch)
        self.time_scale = time_scale
        self.reopen_interval_s = reopen_interval_s
        self.pool = schedule_pool()
        self.topo = rail_topology()
        self.mesh = Mesh(np.array(jax.devices()[:NUM_RANKS]), (AXIS,))
        self.rng = np.random.default_rng(seed)
        self.seq = 0  # data seeds of batched programs
        self.stats = Stats()
        self.busy: tuple[float, str] | None = None
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.where = ""
        self.calling = ""  # the call in progress, named in errors it raises
        self.comms: dict[str, CommModel] = {}
        self._programs: dict[tuple, Callable[..., Any]] = {}
        self._fused_checksums: dict[tuple[str, str], int] = {}  # psum on a topology communicator (_check_fused)
        self._last_reopen = time.monotonic()
        self._fabrics: dict[tuple[str, int], Any] = {}

    # ------------------------------------------------------------------ communicators
    def _open(self, name: str, *, level: int = 2, dtype: str = "float32", opened: int = 1) -> CommModel:
        from jaxccl.runtime.emulated import LinkEmulation

        if name == "plain":
            comm = jaxccl.Communicator(self.mesh, AXIS, backend="cpu")
        elif name == "rail":
            comm = jaxccl.Communicator(
                self.mesh,
                AXIS,
                topology=self.topo,
                backend="cpu",
                link_emulation=LinkEmulation(time_scale=self.time_scale),
            )
        else:
            raise ValueError(f"unknown communicator {name!r}; expected one of {COMMS}")
        colls = [c for c in COLLECTIVES if comm.schedule(c) is not None]
        cm = CommModel(
            name=name,
            comm=comm,
            current={c: DEFAULT_KEY if c in colls else "none" for c in COLLECTIVES},
            version={c: native.current_version(comm.slot(c)) for c in colls},
            staged={},
            history={c: [DEFAULT_KEY] if c in colls else [] for c in COLLECTIVES},
            level=level,
            dtype=dtype,
            opened=opened,
        )
        self.comms[name] = cm
        return cm

    def model(self, name: str) -> CommModel:
        """The model of communicator ``name``, opening it on first use."""
        cm = self.comms.get(name)
        return cm if cm is not None else self._open(name)

    def reopen(self, name: str, *, check: bool = True) -> None:
        """Closes communicator ``name`` and opens a new one in its place (defaults, healthy fabric).

        Args:
            name: the communicator.
            check: verify that the closed one refuses installs and that its registry slots are gone.
        """
        old = self.model(name)
        slots = dict(old.comm._slots)  # noqa: SLF001 - checked to be freed below
        old.comm.close()
        self._programs = {k: v for k, v in self._programs.items() if k[0] != old.comm.uid}
        self.stats.reopens += 1
        self._last_reopen = time.monotonic()
        if check:
            try:
                old.comm.install("all_gather", self.pool["all_gather"]["ring"].schedule)
            except ExecutorError:
                pass
            else:
                self._fail(f"{name}: install on a closed communicator was accepted")
            for coll, slot in slots.items():
                try:
                    native.swap_state(slot)
                except ExecutorError:
                    continue
                self._fail(f"{name}: slot {slot} ({coll.value}) outlived close()")
        self._open(name, level=old.level, dtype=old.dtype, opened=old.opened + 1)

    def may_reopen(self) -> bool:
        """Whether ``reopen_interval_s`` passed since the last reopen."""
        return time.monotonic() - self._last_reopen >= self.reopen_interval_s

    def close(self) -> None:
        """Closes every communicator and forgets their programs."""
        for cm in self.comms.values():
            cm.comm.close()
        self.comms.clear()
        self._programs.clear()

    # ------------------------------------------------------------------ changes
    @staticmethod
    def runs_all_reduce(cm: CommModel) -> bool:
        """Whether psum on ``cm`` runs an all_reduce schedule from its next call (else the fused halves)."""
        return cm.current["all_reduce"] != "none" or "all_reduce" in cm.staged

    def install(self, name: str, coll: str, key: str, *, via: str = "install") -> int:
        """Makes pool schedule ``coll``/``key`` the next one of ``name`` (``comm.install`` or ``stage_validated``).

        Returns:
            The staged table version.
        """
        cm = self.model(name)
        entry = self.pool[coll][key]
        if via == "install":
            cm.comm.install(coll, entry.schedule)
            st = cm.comm.swap_state(coll)
            version = st["staged_version"] or st["current_version"]
        else:
            version = cm.comm.stage_validated(coll, entry.schedule, table=entry.table)
        self._note_staged(cm, coll, key, int(version), next_call=True)
        cm.history[coll].append(key)
        self.stats.swaps += 1
        return int(version)

    def _note_staged(self, cm: CommModel, coll: str, key: str, version: int, *, next_call: bool) -> None:
        """Records that ``version`` (``coll``/``key``) was staged; ``next_call``: check the next launch runs it."""
        st = cm.comm.swap_state(coll)
        if st["staged_version"] == version:
            cm.staged[coll] = (key, st["transition_seq"], version)
            if next_call and st["transition_seq"] != st["issued"]:
                self._fail(
                    f"{cm.name}: {coll} version {version} was staged for after call {st['transition_seq']}, "
                    f"not the next call ({st['issued'] + 1})"
                )
        elif st["current_version"] == version:  # a slot's first table, or the thread's calls made it current
            cm.current[coll], cm.version[coll] = key, version
            cm.staged.pop(coll, None)
        else:
            self._fail(f"{cm.name}: {coll} version {version} is neither staged nor current ({st})")

    def stage_at(self, name: str, coll: str, key: str, ahead: int) -> tuple[int, int]:
        """Stages ``coll``/``key`` to become current after ``ahead`` more launches of its slot.

        Returns:
            ``(transition_seq, staged version)``.
        """
        cm = self.model(name)
        entry = self.pool[coll][key]
        if cm.current[coll] == "none":  # the first all_reduce schedule of a topology communicator: no slot yet
            return 0, self.install(name, coll, key, via="stage_validated")
        slot = cm.comm.slot(coll)
        transition = native.swap_state(slot)["issued"] + ahead
        version = native.stage(slot, entry.table, transition_seq=transition)
        cm.comm.record_staged(coll, entry.schedule)
        cm.staged[coll] = (key, transition, int(version))
        cm.history[coll].append(key)
        self.stats.swaps += 1
        self.stats.staged_at_seq += 1
        return transition, int(version)

    def fabric(self, fault: str, gpu: int) -> Any:
        """The rail topology with ``fault`` on ``gpu`` (one of :data:`FAULTS`)."""
        key = (fault, gpu if fault != "healthy" else 0)
        if key not in self._fabrics:
            from jaxccl.topology import presets, scenario

            node = self.topo.graph.nodes[gpu]
            if fault == "healthy":
                t = self.topo
            elif fault in ("fail1", "fail2", "fail3"):
                t = scenario(self.topo, fault, gpu=gpu)
            elif fault == "slow_nic":
                t = self.topo.degrade(gpu, presets.tor(node["segment"], node["rail"]), gbps=25)
            elif fault == "slow_nvlink":
                t = self.topo.degrade(gpu, presets.nvswitch(node["host"]), gbps=200)
            else:
                raise ValueError(f"unknown fault {fault!r}; expected one of {FAULTS}")
            self._fabrics[key] = t
        return self._fabrics[key]

    def inject(self, fault: str, gpu: int) -> None:
        """Injects ``fault`` on ``gpu`` into the emulated fabric of the ``"rail"`` communicator, live."""
        cm = self.model("rail")
        cm.comm.inject(self.fabric(fault, gpu))
        cm.fabric = "healthy" if fault == "healthy" else f"{fault}@{gpu}"
        self.stats.faults += 1

    # ------------------------------------------------------------------ calls
    def psum_paths(self, cm: CommModel, extra: Sequence[tuple[str, str]] = ()) -> list[str]:
        """What a psum may run: ``["all_reduce"]`` (an all_reduce schedule), ``["fused"]`` or both.

        Every psum is one launch of the all_reduce slot: the installed schedule, or on a topology
        communicator without one the fusion of its ReduceScatter and AllGather (summing as the
        ReduceScatter), which follows every install of either half; both while another thread
        installs the first all_reduce schedule.
        """
        if self.runs_all_reduce(cm):
            return ["all_reduce"]
        return ["fused", "all_reduce"] if any(c == "all_reduce" for c, _ in extra) else ["fused"]

    def relevant(self, cm: CommModel, coll: str, extra: Sequence[tuple[str, str]] = ()) -> list[Entry]:
        """Every pool schedule whose summation order a call of ``coll`` may run (current, staged, ``extra``)."""
        colls = [coll]
        if coll == "all_reduce":
            paths = self.psum_paths(cm, extra)
            colls = (["all_reduce"] if "all_reduce" in paths else []) + (["reduce_scatter"] if "fused" in paths else [])
        out = []
        for c in colls:
            keys = {cm.current[c]}
            if c in cm.staged:
                key, transition, _ = cm.staged[c]
                if cm.comm.swap_state(c)["issued"] >= transition:
                    keys = set()  # the next launch runs the staged table
                keys.add(key)
            keys.update(k for cc, k in extra if cc == c)
            out.extend(self.pool[c][k] for k in keys if k in self.pool[c])
        return out

    def dtype_for(self, cm: CommModel, coll: str, extra: Sequence[tuple[str, str]] = ()) -> str:
        """The dtype of a call: the communicator's, or int32 for a reduction that may run an unordered schedule."""
        if coll not in REDUCTIONS or cm.dtype == "int32":
            return cm.dtype
        schedules = self.relevant(cm, coll, extra)
        return cm.dtype if all(e.ordered for e in schedules) else "int32"

    def _launches(self, cm: CommModel) -> dict[str, int]:
        """Launch counts of the communicator's slots (all_reduce only once it has one, maybe from another thread)."""
        slots = dict(cm.comm._slots)  # noqa: SLF001 - includes a slot the swapping thread just made
        return {c.value: native.launch_count(slot) for c, slot in slots.items()}

    def _host_programs(self, cm: CommModel, coll: str, level: int, dtype: str) -> tuple[Callable, Callable]:
        key = (cm.comm.uid, coll, level, dtype, "host")
        ref_key = (0, coll, level, dtype, "ref")
        for k, lib in ((key, jaxccl), (ref_key, jax.lax)):
            if k not in self._programs:
                self._programs[k] = jax.jit(
                    jax.shard_map(_body(lib, coll), mesh=self.mesh, in_specs=P(AXIS), out_specs=P(AXIS))
                )
        return self._programs[key], self._programs[ref_key]

    def _batched_programs(self, cm: CommModel, coll: str, level: int, dtype: str) -> tuple[Callable, Callable]:
        """(jaxccl, jax.lax) programs of ``batch[level]`` collectives each, returning per-rank digests.

        The reference runs in a program of its own, outside ``with comm:`` (one per size, dtype and
        batch for the whole run): a jaxccl collective that fails on some ranks must not leave XLA's own
        collectives of the same program waiting for them (XLA aborts the process after 40 s).
        """
        k = self.batch[level]
        keys = ((cm.comm.uid, coll, level, dtype, k), (0, coll, level, dtype, k, "ref"))
        for key, lib in zip(keys, (jaxccl, jax.lax)):
            if key not in self._programs:
                self._programs[key] = _digest_program(
                    self.mesh, _body(lib, coll), per_rank_elements(coll, level), dtype, k
                )
        return self._programs[keys[0]], self._programs[keys[1]]

    @contextlib.contextmanager
    def _busy(self, what: str) -> Iterator[None]:
        self.busy = (time.monotonic(), what)
        try:
            yield
        finally:
            self.busy = None

    def call(self, name: str, coll: str, *, extra: Sequence[tuple[str, str]] = (), settle: bool = True) -> int:
        """Runs ``coll`` on communicator ``name`` once (host mode) or ``batch`` times (batched mode), checked.

        Args:
            name: the communicator.
            coll: the collective.
            extra: schedules another thread may make current meanwhile (their order decides the dtype).
            settle: afterwards, resolve staged tables and check that the launches ran the table
                versions the model predicts (not while another thread swaps).

        Returns:
            How many collectives ran.
        """
        cm = self.model(name)
        level, dtype = cm.level, self.dtype_for(cm, coll, extra)
        what = f"{name}#{cm.opened} {coll} x{per_rank_elements(coll, level)} {dtype}"
        before = self._launches(cm) if coll == "all_reduce" else {}
        self.calling = f"{what}; {self._describe(cm, coll)}"
        if self.mode == "host":
            ours, ref = self._host_programs(cm, coll, level, dtype)
            x = host_data(self.rng, coll, level, dtype)
            want = np.asarray(ref(x))  # outside `with comm:`: compiled once per size and dtype
            with self._busy(what), cm.comm:
                got = np.asarray(ours(x))
            count = 1
            bad = self._compare_host(got, want, coll)
            if bad is not None:
                self._mismatch(cm, coll, what, 1, bad[0], bad[1])
        else:
            ours, ref = self._batched_programs(cm, coll, level, dtype)
            self.seq += 1
            seed = np.array([self.seq & 0xFFFFFFFF], dtype=np.uint32)
            want = np.asarray(ref(seed))
            with self._busy(what), cm.comm:
                got = np.asarray(ours(seed))
            count = self.batch[level]
            bad = (got != want).any(axis=-1).reshape(NUM_RANKS, count)  # [rank, collective]
            if bad.any():
                n_bad = int(bad.any(axis=0).sum())
                ranks = ", ".join(f"rank {r}" for r in np.nonzero(bad.any(axis=1))[0])
                self._mismatch(cm, coll, what, n_bad, 0, f"{n_bad} of {count} collectives differ on {ranks}")
        self.stats.collectives += count
        self.stats.calls += 1
        self.stats.per_collective[coll] += count
        self.stats.per_dtype[dtype] += count
        self.stats.per_level[level] += count
        if coll == "all_reduce":  # one launch of the all_reduce slot per psum, a fused pair's too
            after = self._launches(cm)
            grew = {c: after[c] - before.get(c, 0) for c in after if after[c] != before.get(c, 0)}
            if grew != {"all_reduce": count}:
                self._fail(f"{what}: {count} psum(s) launched {grew}, not once each on all_reduce's slot")
        if settle:
            self._settle(cm, [coll])
        self.calling = ""
        return count

    @staticmethod
    def _compare_host(got: np.ndarray, want: np.ndarray, coll: str) -> tuple[int, str] | None:
        if got.shape == want.shape and got.dtype == want.dtype and got.tobytes() == want.tobytes():
            return None
        if got.shape != want.shape or got.dtype != want.dtype:
            return got.size, f"got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
        g = got.view(np.uint16 if got.dtype.itemsize == 2 else np.uint32).reshape(NUM_RANKS, _blocks(coll), -1)
        w = want.view(g.dtype).reshape(g.shape)
        diff = (g != w).any(axis=2)
        by_rank = {int(r): [int(b) for b in np.nonzero(diff[r])[0]] for r in range(NUM_RANKS) if diff[r].any()}
        where = ", ".join(f"rank {r} blocks {b}" if _blocks(coll) > 1 else f"rank {r}" for r, b in by_rank.items())
        return int((g != w).sum()), f"wrong: {where}"

    def _settle(self, cm: CommModel, used: Sequence[str]) -> None:
        """After a call: resolves staged tables whose transition passed; checks the versions launches ran."""
        for coll in list(cm.staged):
            key, transition, version = cm.staged[coll]
            st = cm.comm.swap_state(coll)
            if st["issued"] > transition:
                if st["current_version"] != version:
                    self._fail(
                        f"{cm.name}: {coll} staged version {version} at call {transition}, but call {st['issued']} "
                        f"left version {st['current_version']} current"
                    )
                cm.current[coll], cm.version[coll] = key, version
                del cm.staged[coll]
        for coll in used:
            if cm.current[coll] == "none":  # a topology communicator's psum: the fusion of its halves
                self._check_fused(cm)
                continue
            ran = native.last_launch_version(cm.comm.slot(coll))
            self.stats.version_checks += 1
            if ran != cm.version[coll]:
                self._fail(
                    f"{cm.name}: a {coll} launch ran table version {ran}, the model expects {cm.version[coll]} "
                    f"({cm.current[coll]}; history {cm.history[coll][-4:]}, swap state {cm.comm.swap_state(coll)})"
                )
            latest = cm.staged[coll][0] if coll in cm.staged else cm.current[coll]
            if latest != DEFAULT_KEY and cm.comm.schedule(coll) is not self.pool[coll][latest].schedule:
                self._fail(f"{cm.name}: comm.schedule({coll!r}) is not {latest}, the schedule installed last")

    def _check_fused(self, cm: CommModel) -> None:
        """The last psum ran the current table of all_reduce's slot, the fusion of the halves installed last."""
        halves = (cm.comm.schedule("reduce_scatter"), cm.comm.schedule("all_gather"))
        key = tuple(h.digest for h in halves)
        if key not in self._fused_checksums:
            self._fused_checksums[key] = header(compiled_table(fuse_all_reduce(*halves), num_slots=8))["checksum"]
        st = cm.comm.swap_state("all_reduce")
        ran = native.last_launch_version(cm.comm.slot("all_reduce"))
        self.stats.version_checks += 1
        if ran != st["current_version"] or st["current_checksum"] != self._fused_checksums[key]:
            self._fail(
                f"{cm.name}: psum ran table version {ran}, not the fusion of {halves[0].name} and {halves[1].name} "
                f"(swap state {st})"
            )

    def _describe(self, cm: CommModel, coll: str) -> str:
        colls = [c for c in (coll, "reduce_scatter") if cm.history[c]] if coll == "all_reduce" else [coll]
        hist = "; ".join(f"{c}: {' -> '.join(cm.history[c][-4:])}" for c in colls)
        return f"fabric {cm.fabric}; schedules {hist}"

    def _mismatch(self, cm: CommModel, coll: str, what: str, collectives: int, elements: int, detail: str) -> None:
        msg = f"{what} differs from jax.lax ({detail}); {self._describe(cm, coll)}"
        self.stats.mismatching_collectives += collectives
        self.stats.mismatching_elements += elements
        if len(self.stats.mismatches) < 1000:
            self.stats.mismatches.append(Mismatch(msg, collectives, elements))
        self._record(msg)

    def _fail(self, msg: str) -> None:
        if len(self.stats.mismatches) < 1000:
            self.stats.mismatches.append(Mismatch(msg, 0, 0))
        self.stats.errors["CheckFailure"] += 1
        self._record(msg)

    def _record(self, msg: str) -> None:
        if len(self.failures) < 100:
            self.failures.append(f"{self.where}: {msg}" if self.where else msg)
        if self.strict:
            raise CheckFailure(msg)

    def record_error(self, name: str | None, exc: BaseException) -> None:
        """Counts ``exc`` by type, records it and opens a fresh communicator in place of ``name``."""
        kind = type(exc).__name__
        first = str(exc).splitlines()[0][:300] if str(exc) else kind
        if self.calling:
            first, self.calling = f"{first} (in {self.calling})", ""
        self.stats.errors[kind] += 1
        samples = self.stats.error_samples.setdefault(kind, [])
        if len(samples) < 5:
            samples.append(first)
        if len(self.failures) < 100:
            self.failures.append(f"{self.where}: {kind}: {first}")
        if name is not None and name in self.comms:
            try:
                self.reopen(name, check=False)
            except Exception as e:  # noqa: BLE001 - recorded; the next use opens a fresh one
                self.stats.errors[f"reopen:{type(e).__name__}"] += 1
                self.comms.pop(name, None)

    # ------------------------------------------------------------------ composite changes
    def swap_under_load(
        self, name: str, changes: Sequence[tuple[str, str]], calls: int, fault: tuple[str, int] | None
    ) -> None:
        """Another thread installs ``changes`` (and injects ``fault``) while this one runs ``calls`` collectives.

        The main thread calls the collectives being changed, round-robin, so the swaps land between and
        during its launches; every result is checked. Which of the thread's tables the launches picked up
        depends on the interleaving: afterwards the model takes the current and staged versions from the
        registry, checking that each is one the model knows (one of the thread's, or what was current or
        staged before).
        """
        cm = self.model(name)
        colls = list(dict.fromkeys(c for c, _ in changes))
        errors: list[BaseException] = []
        log: list[tuple[str, str, int]] = []  # (collective, key, version) in the order the thread staged them
        started = threading.Event()
        rng = np.random.default_rng(int(self.rng.integers(2**31)))

        def swapper() -> None:
            try:
                started.wait()
                for i, (coll, key) in enumerate(changes):
                    time.sleep(float(rng.uniform(0.0, 0.004)))
                    entry = self.pool[coll][key]
                    log.append((coll, key, cm.comm.stage_validated(coll, entry.schedule, table=entry.table)))
                    self.stats.thread_swaps += 1
                    if fault is not None and i == len(changes) // 2 and name == "rail":
                        cm.comm.inject(self.fabric(*fault))
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                errors.append(e)

        thread = threading.Thread(target=swapper, name="jaxccl-swapper", daemon=True)
        thread.start()
        try:
            for i in range(calls):
                if i == 0:
                    started.set()
                self.call(name, colls[i % len(colls)], extra=changes, settle=False)
        finally:
            started.set()
            thread.join(timeout=60)
        if thread.is_alive():
            self._fail(f"{name}: the swapping thread did not finish")
        if errors:
            raise errors[0]
        for coll in dict.fromkeys(c for c, _, _ in log):
            known = {v: k for c, k, v in log if c == coll}
            st = cm.comm.swap_state(coll)
            if cm.current[coll] != "none":
                known.setdefault(cm.version[coll], cm.current[coll])
            else:  # all_reduce on a topology communicator, no psum since the thread's install: still a fusion
                known.setdefault(st["current_version"], "none")
            if coll in cm.staged:
                known.setdefault(cm.staged[coll][2], cm.staged[coll][0])
            if st["current_version"] not in known or (st["staged_version"] and st["staged_version"] not in known):
                self._fail(f"{name}: {coll} registry state {st} names a version the model never staged ({known})")
                continue
            cm.current[coll], cm.version[coll] = known[st["current_version"]], st["current_version"]
            cm.staged.pop(coll, None)
            if st["staged_version"]:
                cm.staged[coll] = (known[st["staged_version"]], st["transition_seq"], st["staged_version"])
        for coll, key in changes:
            cm.history[coll].append(key)
        self.stats.swaps += len(changes)
        if fault is not None and name == "rail":
            cm.fabric = "healthy" if fault[0] == "healthy" else f"{fault[0]}@{fault[1]}"
            self.stats.faults += 1
        self._settle(cm, [])  # tables staged at an agreed call on collectives the thread left alone

    def bounce(self, name: str, coll: str, key: str, reps: int) -> None:
        """``A -> B -> A`` ``reps`` times, one checked call after every install (``A`` is what runs now)."""
        cm = self.model(name)
        back = cm.staged[coll][0] if coll in cm.staged else cm.current[coll]
        if back == "none":  # no all_reduce schedule yet on a topology communicator
            back = DEFAULT_KEY
        for _ in range(reps):
            self.install(name, coll, key)
            self.call(name, coll)
            self.install(name, coll, back)
            self.call(name, coll)


# ---------------------------------------------------------------------------------- state machine
comm_names = st.sampled_from(COMMS)
install_via = st.sampled_from(("install", "stage_validated"))
targets = st.sampled_from(TARGETS)
collectives = st.sampled_from(COLLECTIVES)


class ChangeMachine(RuleBasedStateMachine):
    """Rules that change what runs under a job, each followed by checked collectives.

    Every step draws its arguments and runs whatever happens; failures are recorded by the harness
    and, when :attr:`raise_at_teardown`, raised together at the end of the example (see the module
    docstring for why). Subclasses set :attr:`harness_factory` (called once per example when
    :attr:`owns_harness`, else once for the class) and, to bound a run in time, set ``harness.stop``.
    """

    harness_factory: Callable[[], Harness] = Harness
    owns_harness: bool = True
    raise_at_teardown: bool = True
    bounces: int = 4
    _shared: Harness | None = None

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        if cls.owns_harness:
            self.h = cls.harness_factory()
        else:
            if cls._shared is None:
                cls._shared = cls.harness_factory()
            self.h = cls._shared
        self.steps = 0
        self.h.failures.clear()

    def teardown(self) -> None:
        """Closes the harness's communicators when it belongs to this example; raises what failed."""
        failures = list(self.h.failures)
        if type(self).owns_harness:
            self.h.close()
        if failures and type(self).raise_at_teardown:
            raise CheckFailure(f"{len(failures)} failure(s), the first at {failures[0]}\n" + "\n".join(failures))

    def _run(self, name: str | None, fn: Callable[[], Any], rule_call: str = "") -> None:
        """Runs one rule's work; records an exception (and replaces the communicator) instead of raising."""
        if self.h.stop.is_set():
            return
        self.steps += 1
        self.h.where = f"step {self.steps} {rule_call}"
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded; raised at teardown (tests) or counted (long profile)
            self.h.record_error(name, e)

    def _calls(self, name: str, coll: str, calls: int) -> None:
        for _ in range(calls):
            self.h.call(name, coll)

    # ------------------------------------------------------------------ rules
    @rule(comm=comm_names, schedule=targets, via=install_via, calls=st.integers(0, 2))
    def install(self, comm: str, schedule: tuple[str, str], via: str, calls: int) -> None:
        """Installs a pool schedule, then runs ``calls`` collectives of its kind."""

        def go() -> None:
            self.h.install(comm, *schedule, via=via)
            self._calls(comm, schedule[0], calls)

        self._run(comm, go, f"install({comm}, {schedule}, {via}, calls={calls})")

    @rule(pick=st.integers(0, 2**16), back=st.integers(0, 2), calls=st.integers(1, 2))
    def reinstall_previous(self, pick: int, back: int, calls: int) -> None:
        """Reinstalls a schedule that ran before the current one (``A -> B -> A``), then calls it.

        Picks among the (communicator, collective) pairs that had two schedules or more (no
        precondition: what is drawn must not depend on what happened, see the module docstring).
        """
        choices = [(n, c) for n, cm in sorted(self.h.comms.items()) for c, h in cm.history.items() if len(h) >= 2]
        if not choices:
            return
        name, coll = choices[pick % len(choices)]
        hist = self.h.comms[name].history[coll]
        key = hist[max(0, len(hist) - 2 - back)]

        def go() -> None:
            self.h.install(name, coll, key)
            self._calls(name, coll, calls)

        self._run(name, go, f"reinstall_previous -> {name} {coll} {key}")

    @rule(comm=comm_names, schedule=targets)
    def bounce(self, comm: str, schedule: tuple[str, str]) -> None:
        """``A -> B -> A`` with a call after each install, :attr:`bounces` times (``A``: what runs now).

        A fixed count, not a drawn one: a race that shows on some transitions only is then caught by
        most runs of the step, so the shrinker can tell which steps matter.
        """
        reps = self.bounces
        self._run(comm, lambda: self.h.bounce(comm, *schedule, reps), f"bounce({comm}, {schedule}, reps={reps})")

    @rule(comm=comm_names, coll=collectives)
    def sweep_back_and_forth(self, comm: str, coll: str) -> None:
        """``A -> B -> A`` for every ``B`` of the collective's pool, a checked call after each install.

        Which pairs expose a bug depends on the layouts of both tables (and on what ran before), so
        one step tries them all; it costs two dozen small calls.
        """

        def go() -> None:
            for key in POOL_KEYS[coll]:
                self.h.bounce(comm, coll, key, 1)

        self._run(comm, go, f"sweep_back_and_forth({comm}, {coll})")

    @rule(comm=comm_names, schedule=targets, ahead=st.integers(0, 3), calls=st.integers(0, 5))
    def stage_at_agreed_call(self, comm: str, schedule: tuple[str, str], ahead: int, calls: int) -> None:
        """Stages a table to become current after ``ahead`` more launches; the model checks every launch."""

        def go() -> None:
            self.h.stage_at(comm, *schedule, ahead)
            self._calls(comm, schedule[0], calls)

        self._run(comm, go, f"stage_at_agreed_call({comm}, {schedule}, ahead={ahead}, calls={calls})")

    @rule(
        comm=comm_names,
        changes=st.lists(targets, min_size=1, max_size=5),
        calls=st.integers(1, 6),
        fault=st.none() | st.tuples(st.sampled_from(FAULTS), st.integers(0, NUM_RANKS - 1)),
    )
    def swap_from_another_thread(
        self, comm: str, changes: list[tuple[str, str]], calls: int, fault: tuple[str, int] | None
    ) -> None:
        """Another thread hot-swaps (and injects a fault) while this one runs collectives."""
        label = f"swap_from_another_thread({comm}, {changes}, calls={calls}, fault={fault})"
        self._run(comm, lambda: self.h.swap_under_load(comm, changes, calls, fault), label)

    @rule(comm=comm_names, level=st.integers(0, len(SIZE_LEVELS) - 1), dtype=st.sampled_from(DTYPES))
    def resize(self, comm: str, level: int, dtype: str) -> None:
        """Changes the per-rank size and dtype of the communicator's later calls."""

        def go() -> None:
            cm = self.h.model(comm)
            cm.level, cm.dtype = level, dtype

        self._run(comm, go, f"resize({comm}, {SIZE_LEVELS[level][0]}, {dtype})")

    @rule(comm=comm_names, coll=collectives, reps=st.integers(1, 3))
    def call(self, comm: str, coll: str, reps: int) -> None:
        """Runs checked collectives with whatever is current."""
        self._run(comm, lambda: self._calls(comm, coll, reps), f"call({comm}, {coll}, reps={reps})")

    @rule(fault=st.sampled_from(FAULTS), gpu=st.integers(0, NUM_RANKS - 1), coll=collectives)
    def inject_fault(self, fault: str, gpu: int, coll: str) -> None:
        """Changes the emulated fabric of the ``rail`` communicator live, then runs a collective on it."""

        def go() -> None:
            self.h.inject(fault, gpu)
            self.h.call("rail", coll)

        self._run("rail", go, f"inject_fault({fault}@{gpu}, {coll})")

    @precondition(lambda self: self.h.may_reopen())
    @rule(comm=comm_names, coll=collectives)
    def close_and_reopen(self, comm: str, coll: str) -> None:
        """Closes a communicator, checks it is gone, opens a new one in its place and calls it."""

        def go() -> None:
            self.h.reopen(comm)
            self.h.call(comm, coll)

        self._run(comm, go, f"close_and_reopen({comm}, {coll})")
