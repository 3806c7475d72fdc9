"""Property-based fuzzing of compiled tables: what the registry accepts runs bitwise like ``jax.lax``.

A compiled table (:func:`jaxccl.schedule.table.compile_table`) is mutated: one
to three words set to a drawn value (a bit flip, a neighbour, a small integer,
a word copied from elsewhere in the table, any int32). The property: the
native registry refuses the table with :class:`jaxccl.ExecutorError`, or the
table is the compiled one word for word (a no-op mutation) and runs bitwise
equal to ``jax.lax`` on random data. The table's checksum is what makes every
real change a refusal.

Resealed mutations (the checksum recomputed after the change) exercise the
structural checks behind it and the executor itself: such a table is refused
by the registry, or is not what the compiler writes for a valid schedule
(:func:`jaxccl.schedule.table.verify` says so), or runs bitwise like
``jax.lax``.

Runs derandomized with a small budget in CI; ``JAXCCL_FUZZ=long`` runs more.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from jaxccl.errors import ExecutorError, ScheduleError  # noqa: E402
from jaxccl.runtime import native  # noqa: E402
from jaxccl.runtime.native_backend import flat_collective  # noqa: E402
from jaxccl.schedule import Schedule  # noqa: E402
from jaxccl.schedule.table import compile_table, seal, verify  # noqa: E402
from jaxccl.synth import baselines  # noqa: E402

N = 4
ELEMS = 24  # per rank: divisible by N and by every schedule's chunks per period
MUTATIONS = ("flip", "neighbour", "small", "copy", "any")

settings.register_profile(
    "ci-tables", max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.register_profile("long-tables", max_examples=5_000, deadline=None, suppress_health_check=list(HealthCheck))
PROFILE = "long-tables" if os.environ.get("JAXCCL_FUZZ") == "long" else "ci-tables"


def base_schedules() -> list[Schedule]:
    """One schedule of each collective on ``N`` ranks (staged sends, forwards, folds, scratch)."""
    return [
        baselines.ring_allgather(N),
        baselines.direct_alltoall(N),
        baselines.ring_reduce_scatter(N),
        baselines.ordered_allreduce(N),
    ]


def mutate(table: np.ndarray, edits: Sequence[tuple[int, str, int]]) -> np.ndarray:
    """``table`` with each ``(word, how, value)`` edit applied (``how`` one of :data:`MUTATIONS`).

    ``flip``: bit ``value % 32``; ``neighbour``: +1 or -1; ``small``: set to ``value``; ``copy``: the
    word at index ``value`` of the table; ``any``: set to ``value`` as an int32.

    >>> mutate(np.arange(4, dtype=np.int32), [(1, "flip", 3), (2, "copy", 0)]).tolist()
    [0, 9, 0, 3]
    """
    out = np.array(table, dtype=np.int32, copy=True)
    u = out.view(np.uint32)
    for word, how, value in edits:
        w = word % out.size
        if how == "flip":
            u[w] ^= np.uint32(1 << (value % 32))
        elif how == "neighbour":
            u[w] = np.uint32((int(u[w]) + (1 if value % 2 else -1)) & 0xFFFFFFFF)
        elif how == "copy":
            out[w] = out[value % out.size]
        else:
            u[w] = np.uint32(value & 0xFFFFFFFF)
    return out


class Runner:
    """Per base schedule: a registry slot and one compiled program naming it (installs never recompile)."""

    def __init__(self, schedules: Sequence[Schedule], mesh: Mesh):
        self.tables = [compile_table(s) for s in schedules]
        self.slots = [native.new_slot() for _ in schedules]
        self.ours, self.ref = [], []
        for k, s in enumerate(schedules):
            native.install(self.slots[k], self.tables[k])
            self.ours.append(_program(mesh, _ours(s, self.slots[k], site=9100 + k)))
            self.ref.append(_program(mesh, _reference(s.collective.value)))

    def data(self, k: int, seed: int) -> np.ndarray:
        """Random (never all-zero) global input; int32 where the collective sums (any order is exact)."""
        g = np.random.default_rng(seed)
        if self.tables[k][2] in (2, 3):
            return g.integers(-(2**20), 2**20, size=N * ELEMS, dtype=np.int32) | 1
        return (g.standard_normal(N * ELEMS) + 0.25).astype(np.float32)

    def run(self, k: int, table: np.ndarray, seed: int = 0) -> bool:
        """Installs ``table`` in base ``k``'s slot (``ExecutorError`` if refused), runs it: bitwise == lax?"""
        native.install(self.slots[k], table)
        x = self.data(k, seed)
        got, want = np.asarray(self.ours[k](x)), np.asarray(self.ref[k](x))
        return got.shape == want.shape and np.array_equal(got.view(np.uint8), want.view(np.uint8))

    def close(self) -> None:
        for slot in self.slots:
            native.remove(slot)


def _program(mesh: Mesh, body: Callable) -> Callable:
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))


def _ours(s: Schedule, slot: int, site: int) -> Callable:
    return lambda v: flat_collective(s.collective, v, axis_name="d", axis_size=N, group_axes=(), slot=slot, site=site)


def _reference(coll: str) -> Callable:
    return {
        "all_gather": lambda v: jax.lax.all_gather(v, "d", tiled=True),
        "all_to_all": lambda v: jax.lax.all_to_all(v, "d", 0, 0, tiled=True),
        "reduce_scatter": lambda v: jax.lax.psum_scatter(v, "d", scatter_dimension=0, tiled=True),
        "all_reduce": lambda v: jax.lax.psum(v, "d"),
    }[coll]


@pytest.fixture(scope="module")
def runner():
    r = Runner(base_schedules(), Mesh(np.array(jax.devices()[:N]), ("d",)))
    yield r
    r.close()


EDITS = st.lists(
    st.tuples(st.integers(0, 1 << 20), st.sampled_from(MUTATIONS), st.integers(-(2**31), 2**31 - 1)),
    min_size=1,
    max_size=3,
)
SMALL_EDITS = st.lists(
    st.tuples(st.integers(0, 1 << 20), st.just("small"), st.integers(-2, 40)), min_size=1, max_size=3
)


def test_every_base_table_runs_bitwise(runner):
    for k, table in enumerate(runner.tables):
        assert runner.run(k, table, seed=k + 1)


@settings.get_profile(PROFILE)
@given(k=st.integers(0, 3), edits=st.one_of(EDITS, SMALL_EDITS))
@example(k=0, edits=[(3, "small", N)])  # num_ranks set to what it is: a no-op, accepted and run
@example(k=2, edits=[(5, "copy", 5), (0, "neighbour", 0), (0, "neighbour", 1)])  # changed, then changed back
def test_mutated_tables_are_refused_or_unchanged(runner, k, edits):
    table = runner.tables[k]
    mutated = mutate(table, edits)
    try:
        native.validate_table(mutated)
    except ExecutorError:
        assert not np.array_equal(mutated, table)
        return
    assert np.array_equal(mutated, table), "the registry accepted a changed table"
    assert runner.run(k, mutated, seed=len(edits))


@settings.get_profile(PROFILE)
@given(k=st.integers(0, 3), edits=st.one_of(EDITS, SMALL_EDITS))
@example(k=1, edits=[(4, "small", 2)])  # chunks_per_period changed consistently nowhere else: refused
def test_resealed_tables_are_refused_or_run_bitwise(runner, k, edits):
    mutated = seal(mutate(runner.tables[k], edits))
    try:
        native.validate_table(mutated)
        verify(mutated)
    except (ExecutorError, ScheduleError):
        return
    assert runner.run(k, mutated, seed=len(edits)), "a table the compiler writes for a valid schedule ran wrong"
