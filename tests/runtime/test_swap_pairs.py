"""Hot-swap A -> B -> A on one communicator, for every ordered pair of schedules of each collective.

A bug on the native CPU executor made the third call of ``install(A)``, call,
``install(B)``, call, ``install(A)``, call return a wrong result (A = recursive
doubling, B = ring AllGather, 64 float32 per rank). This file runs that
sequence for every ordered pair ``(A, B)``, ``A != B``, of the schedules jaxccl
has for 8 ranks -- the baselines of :mod:`jaxccl.synth.baselines`, the
synthesizers of :mod:`jaxccl.synth` on a 2 x 4 rail fabric and the
communicator's defaults (:mod:`jaxccl.runtime.default_schedules`) -- for
AllGather, AllToAll, ReduceScatter and AllReduce at three sizes each, with
fresh random non-zero data on every call, and compares each result bitwise
with ``jax.lax``.

Float sums are bitwise equal to ``jax.lax`` only for schedules that fold in
ascending rank order (``info["ordered_reduction"]``); a reduction pair in which
either schedule sums in another order runs on int32 data (exact in any order).

Cost: one communicator for the whole module, one jitted program per
(collective, size, dtype) traced once (installs swap the table under the
compiled program), the schedule pool built once.
"""

from __future__ import annotations

import functools
import itertools
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl
from jaxccl.runtime import default_schedules
from jaxccl.schedule import Schedule
from jaxccl.synth import baselines
from jaxccl.synth.ordered_reduce_scatter import ordered_reduce_scatter

pytest.importorskip("jaxccl.runtime.native", reason="jaxccl._native is not built (pip install -e .)")

N = 8
AXIS = "swap"

Builder = Callable[[], Schedule]


def _topo() -> jaxccl.topology.Topology:
    return jaxccl.topology.rail(hosts=2, gpus_per_host=4)


# Per collective (as `Communicator.install` names it): schedule id -> builder.
BUILDERS: dict[str, dict[str, Builder]] = {
    "all_gather": {
        "ring": lambda: baselines.ring_allgather(N),
        "ring2": lambda: baselines.ring_allgather(N, channels=2),
        "recursive_doubling": lambda: baselines.recursive_doubling_allgather(N),
        "synth": lambda: jaxccl.synth.all_gather(_topo()),
        "default_direct": lambda: default_schedules.direct_allgather(N),
    },
    "all_to_all": {
        "direct": lambda: baselines.direct_alltoall(N),  # also the default
        "synth": lambda: jaxccl.synth.all_to_all(_topo()),
    },
    "psum_scatter": {
        "ring": lambda: baselines.ring_reduce_scatter(N),
        "direct": lambda: baselines.direct_reduce_scatter(N),  # also the default
        "synth_trees": lambda: jaxccl.synth.reduce_scatter(_topo()),
        "synth_ordered": lambda: ordered_reduce_scatter(_topo()),
    },
    "psum": {
        "ring": lambda: baselines.ring_allreduce(N),
        "ordered": lambda: baselines.ordered_allreduce(N),
        "binary_tree": lambda: baselines.binary_tree_allreduce(N),
        "double_binary_tree": lambda: baselines.double_binary_tree_allreduce(N),
        "default_direct": lambda: default_schedules.direct_allreduce(N),
    },
}

# Elements per rank of each collective's input: tiny, not a multiple of the chunk counts
# (AllToAll and ReduceScatter need a multiple of N; their blocks of 13 are odd), 16-32 KiB.
SIZES: dict[str, tuple[int, ...]] = {
    "all_gather": (8, 31, 4096),
    "all_to_all": (8, N * 13, 8192),
    "psum_scatter": (8, N * 13, 8192),
    "psum": (8, 37, 8192),
}

CASES = [
    pytest.param(coll, size, a, b, id=f"{coll}-{size}-{a}-{b}")
    for coll, pool in BUILDERS.items()
    for size in SIZES[coll]
    for a, b in itertools.permutations(pool, 2)
]


@functools.cache
def _pool() -> dict[str, dict[str, Schedule]]:
    """Every schedule of :data:`BUILDERS`, built (and validated) once per module."""
    return {coll: {name: build().validate() for name, build in pool.items()} for coll, pool in BUILDERS.items()}


@functools.cache
def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:N]), (AXIS,))


def _body(coll: str, lib: str) -> Callable[[jax.Array], jax.Array]:
    """The collective ``coll`` of ``jaxccl`` or ``jax.lax`` (``lib``) on one shard."""
    mod = jaxccl if lib == "jaxccl" else jax.lax
    if coll == "all_gather":
        return lambda v: mod.all_gather(v, AXIS, axis=0, tiled=True)
    if coll == "all_to_all":
        return lambda v: mod.all_to_all(v, AXIS, 0, 0, tiled=True)
    if coll == "psum_scatter":
        return lambda v: mod.psum_scatter(v, AXIS, scatter_dimension=0, tiled=True)
    return lambda v: mod.psum(v, AXIS)


@functools.cache
def _program(coll: str, lib: str) -> Any:
    """One jitted program per collective and library; jax traces it once per input shape and dtype.

    A ``jaxccl`` program is traced under the communicator in scope at its first call and keeps
    launching on it: installs swap the table under the compiled program.
    """
    out_specs = P() if coll == "psum" else P(AXIS)
    return jax.jit(jax.shard_map(_body(coll, lib), mesh=_mesh(), in_specs=P(AXIS), out_specs=out_specs))


@pytest.fixture(scope="module")
def comm() -> Iterator[jaxccl.Communicator]:
    """The one communicator every pair swaps schedules on (defaults: no topology)."""
    c = jaxccl.Communicator(_mesh(), AXIS, backend="cpu")
    yield c
    c.close()
    _program.cache_clear()  # the jaxccl traces launch on the closed communicator's slots


def _data(rng: np.random.Generator, size: int, dtype: type[np.generic]) -> np.ndarray:
    """Fresh random non-zero data, ``size`` elements per rank."""
    if dtype is np.int32:
        x = rng.integers(1, 1 << 20, N * size, dtype=np.int32) * rng.choice(np.array([-1, 1], np.int32), N * size)
    else:
        x = rng.standard_normal(N * size).astype(np.float32)
        x[x == 0] = 1.0
    return x


def _dtype(coll: str, a: Schedule, b: Schedule) -> type[np.generic]:
    if coll in ("all_gather", "all_to_all"):
        return np.float32
    ordered = all(s.info.get("ordered_reduction") for s in (a, b))
    return np.float32 if ordered else np.int32


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


@pytest.mark.parametrize(("coll", "size", "a", "b"), CASES)
def test_swap_a_b_a(comm: jaxccl.Communicator, coll: str, size: int, a: str, b: str) -> None:
    """install(A), call, install(B), call, install(A), call: every result bitwise equal to ``jax.lax``."""
    pool = _pool()[coll]
    sa, sb = pool[a], pool[b]
    dtype = _dtype(coll, sa, sb)
    f, ref = _program(coll, "jaxccl"), _program(coll, "lax")
    rng = np.random.default_rng(_seed(coll, size, a, b))
    before = comm.schedule(coll).name
    wrong: list[str] = []
    traces: int | None = None
    for step, (name, schedule) in enumerate([(a, sa), (b, sb), (a, sa)]):
        comm.install(coll, schedule)
        x = _data(rng, size, dtype)
        want = np.asarray(ref(x))
        try:
            with comm:
                got = np.asarray(f(x))
        except jax.errors.JaxRuntimeError as e:  # the executor refused the table it was handed
            wrong.append(f"call {step + 1} ({name}) raised: {str(e).splitlines()[0]}")
            continue
        assert got.shape == want.shape and got.dtype == want.dtype
        if got.tobytes() != want.tobytes():
            bad = int(np.count_nonzero(got != want))
            wrong.append(f"call {step + 1} ({name}): {bad}/{got.size} elements differ")
        if traces is None:
            traces = f._cache_size()
    assert not wrong, f"{coll} {size}/rank {np.dtype(dtype).name}, swapping from {before}: " + "; ".join(wrong)
    assert f._cache_size() == traces, "installs must not retrace"
