"""The four collectives checked across the processes of a job, and the loop workers' training step: shared
by the multi-process workers.

:func:`check_collectives` runs jaxccl's collectives (with the communicator given: the ppermute or the
native CPU backend, in tests/workers/multiprocess_native_worker.py) over every device of every
process, on random data of float32 and int32, and compares this process's shards bitwise:

- with ``jax.lax`` on the same inputs (``CHECK <case> lax ok|MISMATCH``);
- for reductions, also with a NumPy fold in jaxccl's default order across processes (``CHECK
  <case> ordered ok|MISMATCH``), which is XLA's there: gloo's ring for ``psum``
  (:func:`gloo_ring_sum`) and gloo's halving-doubling tree for ``psum_scatter`` (:func:`gloo_tree_sum`).

>>> ordered_sum(np.array([[1.0], [2.0]], np.float32)).tolist()
[3.0]
>>> gloo_ring_sum(np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)).tolist()
[9.0, 12.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np


def ordered_sum(blocks: np.ndarray) -> np.ndarray:
    """``((0 + x0) + x1) + ...``: XLA:CPU's order, from the identity (which makes -0 sums +0)."""
    acc = np.zeros_like(blocks[0])
    for b in blocks:
        acc = acc + b  # float32 + float32 in NumPy rounds like XLA's add
    return acc


def gloo_ring_sum(blocks: np.ndarray) -> np.ndarray:
    """Rank ``r``'s rows ``blocks[r]`` summed as gloo's ring does: chunk ``c`` is
    ``x_c + (x_(c+1) + (... + (x_(c-2) + x_(c-1))))`` on chunks of ``gloo_ring_chunk`` elements."""
    from jaxccl.schedule.reduction import gloo_ring_chunk

    n = len(blocks)
    flat = [np.asarray(b).reshape(-1) for b in blocks]
    e = flat[0].size
    chunk = gloo_ring_chunk(e, flat[0].dtype.itemsize, n)
    out = flat[0].copy()
    for c in range(n):
        lo, hi = c * chunk, min((c + 1) * chunk, e)
        if lo >= hi:
            continue
        acc = flat[(c - 1) % n][lo:hi]
        for k in range(2, n + 1):
            acc = flat[(c - k) % n][lo:hi] + acc
        out[lo:hi] = acc
    return out.reshape(np.shape(blocks[0]))


def gloo_tree_sum(blocks: np.ndarray) -> np.ndarray:
    """``blocks`` summed as gloo's halving-doubling ReduceScatter does: pairs of neighbours first,
    ``((x0 + x1) + (x2 + x3)) + ...`` within each power-of-two block (largest first), then the blocks'
    sums folded from the smallest up, ``T0 + (T1 + ...)``."""

    def tree(terms: list) -> np.ndarray:
        while len(terms) > 1:
            terms = [terms[i] + terms[i + 1] for i in range(0, len(terms), 2)]
        return terms[0]

    terms, sums = list(blocks), []
    while terms:
        size = 1 << (len(terms).bit_length() - 1)
        sums.append(tree(terms[:size]))
        terms = terms[size:]
    acc = sums[-1]
    for t in reversed(sums[:-1]):
        acc = t + acc
    return acc


def check_collectives(comm: Any, mesh: Any, axis: str = "d") -> bool:
    """Runs the four collectives over ``axis`` of the 1-D ``mesh`` with ``comm``; prints CHECK lines.

    Returns whether every required check passed (float32 reductions against ``jax.lax`` are reported,
    not required).
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl

    n = mesh.shape[axis]
    sharding = NamedSharding(mesh, P(axis))

    def expect_rs(g: np.ndarray) -> np.ndarray:  # psum_scatter(v, scatter_dimension=1, tiled=True)
        v = g.reshape(n, 2, n, 3)  # [source rank, row, destination block, col]
        return np.concatenate([gloo_tree_sum(v[:, :, r]) for r in range(n)], axis=0)

    def expect_psum(g: np.ndarray) -> np.ndarray:
        return gloo_ring_sum(g.reshape(n, 2, 3 * n))

    cases = {
        "all_gather": (
            lambda v: jaxccl.all_gather(v, axis, axis=1, tiled=True),
            lambda v: jax.lax.all_gather(v, axis, axis=1, tiled=True),
            None,
        ),
        "all_to_all": (
            lambda v: jaxccl.all_to_all(v, axis, 1, 0, tiled=True),
            lambda v: jax.lax.all_to_all(v, axis, 1, 0, tiled=True),
            None,
        ),
        "psum_scatter": (
            lambda v: jaxccl.psum_scatter(v, axis, scatter_dimension=1, tiled=True),
            lambda v: jax.lax.psum_scatter(v, axis, scatter_dimension=1, tiled=True),
            expect_rs,
        ),
        "psum": (lambda v: jaxccl.psum(v, axis), lambda v: jax.lax.psum(v, axis), expect_psum),
    }
    rng = np.random.default_rng(1234)  # the same global data in every process
    ok = True
    for dtype in (np.float32, np.int32):
        raw = (rng.standard_normal((2 * n, 3 * n)) * 1000).astype(dtype)
        assert np.count_nonzero(raw) > raw.size // 2
        x = jax.make_array_from_callback(raw.shape, sharding, lambda idx, raw=raw: raw[idx])
        for name, (mine, ref, expect) in cases.items():
            spec = P() if name == "psum" else P(axis)
            with comm:
                a = jax.jit(jax.shard_map(mine, mesh=mesh, in_specs=P(axis), out_specs=spec))(x)
            b = jax.jit(jax.shard_map(ref, mesh=mesh, in_specs=P(axis), out_specs=spec))(x)
            shards_a = sorted(a.addressable_shards, key=lambda s: s.device.id)
            shards_b = sorted(b.addressable_shards, key=lambda s: s.device.id)
            got = [np.asarray(s.data) for s in shards_a]
            lax_vals = [np.asarray(s.data) for s in shards_b]
            same = a.shape == b.shape and all(u.tobytes() == w.tobytes() for u, w in zip(got, lax_vals))
            label = f"{name} {np.dtype(dtype).name}"
            ok &= same
            print(f"CHECK {label} lax {'ok' if same else 'MISMATCH'}", flush=True)
            if expect is not None:
                want = expect(raw)
                good = all(u.tobytes() == want[s.index].tobytes() for u, s in zip(got, shards_a))
                ok &= good
                print(f"CHECK {label} ordered {'ok' if good else 'MISMATCH'}", flush=True)
    return ok


def gather_programs(mesh: Any, axis: str = "d") -> tuple[Any, Any]:
    """jaxccl's and ``jax.lax``'s tiled AllGather over ``axis`` of ``mesh``, jitted (the loop workers' step)."""
    import jax
    from jax.sharding import PartitionSpec as P

    def gathered(collective: Any) -> Any:
        body = lambda v: collective(v, axis, axis=0, tiled=True)  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))

    import jaxccl

    return gathered(jaxccl.all_gather), gathered(jax.lax.all_gather)


def step_input(mesh: Any, step: int, axis: str = "d") -> Any:
    """Step ``step``'s input: 256 KiB of seeded random float32 per rank, the same in every process."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    raw = np.random.default_rng(step).standard_normal((jax.device_count() * 256, 256)).astype(np.float32)
    return jax.make_array_from_callback(raw.shape, NamedSharding(mesh, P(axis)), lambda idx: raw[idx])


def same_local_shards(a: Any, b: Any) -> bool:
    """Whether this process's shards of ``a`` and ``b`` are bitwise equal."""
    from jaxccl.distributed.transport import local_shards

    return all(u.tobytes() == w.tobytes() for u, w in zip(local_shards(a), local_shards(b)))
