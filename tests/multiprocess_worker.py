"""One process of tests/test_multiprocess.py: 4 CPU devices of a 2-process JAX job on loopback.

Usage: python tests/multiprocess_worker.py PORT PROCESS_ID NUM_PROCESSES

Runs jaxccl's collectives with the ppermute backend over all 8 devices of both
processes, on random data, and compares this process's shards bitwise:

- with ``jax.lax`` on the same inputs (``CHECK <case> lax ok|MISMATCH``);
- for reductions, also with a NumPy left fold in ascending rank order
  (``CHECK <case> ordered ok|MISMATCH``), jaxccl's default reduction order.
  XLA's gloo collectives do not promise that order for float32, so for
  float32 reductions the ``lax`` line reports what was measured (``differs``
  with the largest difference) instead of failing.

Prints ``ALL OK`` and exits 0 when every required check passed.
"""

from __future__ import annotations

import sys

import jaxccl

LOCAL_DEVICES = 4


def main() -> int:
    port, pid, nproc = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    jaxccl.emulate(LOCAL_DEVICES)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        num_processes=nproc,
        process_id=pid,
        initialization_timeout=60,
        heartbeat_timeout_seconds=30,
    )
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    print(f"process {pid}: {jax.local_device_count()} local of {n} devices", flush=True)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    comm = jaxccl.Communicator(mesh, "d", backend="ppermute")
    sharding = NamedSharding(mesh, P("d"))

    def ordered_sum(blocks: np.ndarray) -> np.ndarray:
        # ((0 + x0) + x1) + ...: XLA:CPU's order, starting from the identity (which makes -0 sums +0)
        acc = np.zeros_like(blocks[0])
        for b in blocks:
            acc = acc + b  # float32 + float32 in NumPy rounds like XLA's add
        return acc

    def expect_rs(g: np.ndarray) -> np.ndarray:  # psum_scatter(v, scatter_dimension=1, tiled=True)
        v = g.reshape(n, 2, n, 3)  # [source rank, row, destination block, col]
        return np.concatenate([ordered_sum(v[:, :, r]) for r in range(n)], axis=0)

    def expect_psum(g: np.ndarray) -> np.ndarray:
        return ordered_sum(g.reshape(n, 2, 3 * n))

    cases = {
        "all_gather": (
            lambda v: jaxccl.all_gather(v, "d", axis=1, tiled=True),
            lambda v: jax.lax.all_gather(v, "d", axis=1, tiled=True),
            None,
        ),
        "all_to_all": (
            lambda v: jaxccl.all_to_all(v, "d", 1, 0, tiled=True),
            lambda v: jax.lax.all_to_all(v, "d", 1, 0, tiled=True),
            None,
        ),
        "psum_scatter": (
            lambda v: jaxccl.psum_scatter(v, "d", scatter_dimension=1, tiled=True),
            lambda v: jax.lax.psum_scatter(v, "d", scatter_dimension=1, tiled=True),
            expect_rs,
        ),
        "psum": (lambda v: jaxccl.psum(v, "d"), lambda v: jax.lax.psum(v, "d"), expect_psum),
    }
    rng = np.random.default_rng(1234)  # the same global data in every process
    ok = True
    for dtype in (np.float32, np.int32):
        raw = (rng.standard_normal((2 * n, 3 * n)) * 1000).astype(dtype)
        x = jax.make_array_from_callback(raw.shape, sharding, lambda idx, raw=raw: raw[idx])
        for name, (mine, ref, expect) in cases.items():
            spec = P() if name == "psum" else P("d")
            with comm:
                a = jax.jit(jax.shard_map(mine, mesh=mesh, in_specs=P("d"), out_specs=spec))(x)
            b = jax.jit(jax.shard_map(ref, mesh=mesh, in_specs=P("d"), out_specs=spec))(x)
            shards_a = sorted(a.addressable_shards, key=lambda s: s.device.id)
            shards_b = sorted(b.addressable_shards, key=lambda s: s.device.id)
            got = [np.asarray(s.data) for s in shards_a]
            lax_vals = [np.asarray(s.data) for s in shards_b]
            same = a.shape == b.shape and all(u.tobytes() == w.tobytes() for u, w in zip(got, lax_vals))
            label = f"{name} {np.dtype(dtype).name}"
            if same or expect is None or dtype is not np.float32:
                ok &= same
                print(f"CHECK {label} lax {'ok' if same else 'MISMATCH'}", flush=True)
            else:
                diff = max(float(np.max(np.abs(u - w))) for u, w in zip(got, lax_vals))
                print(f"CHECK {label} lax differs (gloo reduction order; max |diff| {diff:.3g})", flush=True)
            if expect is not None:
                want = expect(raw)
                good = all(u.tobytes() == want[s.index].tobytes() for u, s in zip(got, shards_a))
                ok &= good
                print(f"CHECK {label} ordered {'ok' if good else 'MISMATCH'}", flush=True)
    print("ALL OK" if ok else "FAILED", flush=True)
    jax.distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
