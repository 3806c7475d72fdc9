"""One process of tests/distributed/test_multiprocess.py: 4 CPU devices of a 2-process JAX job on loopback.

Usage: python tests/workers/multiprocess_worker.py PORT PROCESS_ID NUM_PROCESSES

Runs jaxccl's collectives with the ppermute backend over all 8 devices of both
processes, on random data, and compares this process's shards bitwise with
``jax.lax`` and, for reductions, with a NumPy fold in ascending rank order
(tests/support/multiprocess_checks.py).

Prints ``ALL OK`` and exits 0 when every required check passed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # run as a script
from multiprocess_checks import check_collectives  # noqa: E402

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
    from jax.sharding import Mesh

    n = jax.device_count()
    print(f"process {pid}: {jax.local_device_count()} local of {n} devices", flush=True)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    comm = jaxccl.Communicator(mesh, "d", backend="ppermute")
    ok = check_collectives(comm, mesh)
    print("ALL OK" if ok else "FAILED", flush=True)
    jax.distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
