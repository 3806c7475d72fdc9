"""One process of tests/distributed/test_loop_backends.py (started by jaxccl.distributed.launch).

Usage: python tests/workers/loop_sources_worker.py MODE STEPS

MODE ``transport``: two processes of two CPU devices, the transport attached, a ``cpu`` communicator
over all four ranks (rail of 2 hosts x 2: each process is one host). MODE ``executor``: one process
of four CPU devices, a ``cpu`` communicator with link emulation (rail of 2 hosts x 2 inside the
process). Both first check that ``ProcessLoop`` and ``stage_agreed`` refuse a ``ppermute``
communicator over the same mesh, then run STEPS AllGather steps (bitwise against ``jax.lax``),
each followed by ``ProcessLoop.step()``.

Prints ``REFUSED what: message`` per refusal, ``SOURCES s1,s2``, ``LOCAL r1,r2`` (this process's
ranks), ``ROWS json`` (the rows published each step), ``MEASUREMENT backend scope`` (executor
source), ``EXECUTOR_MATCH ok|MISMATCH`` (executor mode: every published row is the communicator's
own latest telemetry sample), ``GATHERED json`` (process 0: the gathered matrix's measured
entries), ``CHECK step k ok|MISMATCH`` and ``ALL OK``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # run as a script
from multiprocess_checks import gather_programs, same_local_shards, step_input  # noqa: E402


def main(argv: list[str]) -> int:
    from jaxccl.distributed.launch import initialize_from_env

    mode, steps = argv[0], int(argv[1])
    initialize_from_env(local_devices=2 if mode == "transport" else 4)
    import jax
    from jax.sharding import Mesh

    import jaxccl
    from jaxccl.control.process_loop import ProcessLoop
    from jaxccl.distributed.transport import ProcessTransport, attach, stage_agreed
    from jaxccl.errors import ArgumentError
    from jaxccl.runtime.emulated import LinkEmulation

    mesh = Mesh(np.array(jax.devices()), ("d",))
    topo = jaxccl.topology.rail(hosts=2, gpus_per_host=2, nic_gbps=8)
    transport = None
    if mode == "transport":
        transport = ProcessTransport.bootstrap(timeout_s=60)
        attach(transport, mesh, "d")
        comm = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu")
    else:
        emulation = LinkEmulation(time_scale=1e-2)
        comm = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu", link_emulation=emulation)
    comm.install("all_gather", jaxccl.synth.all_gather(topo))

    lowered = jaxccl.Communicator(mesh, "d", topology=topo, backend="ppermute")
    for what, call in [
        ("ProcessLoop", lambda: ProcessLoop(lowered)),
        ("stage_agreed", lambda: stage_agreed(lowered, "all_gather", comm.schedule("all_gather"), round_id="r")),
    ]:
        try:
            call()
            print(f"ACCEPTED {what}", flush=True)
        except ArgumentError as e:
            print(f"REFUSED {what}: {e}", flush=True)

    loop = ProcessLoop(comm, margin=0, timeout_s=60, key_prefix=f"jaxccl/loop-sources-{mode}")
    print(f"SOURCES {','.join(loop.sources)}", flush=True)
    ranks = [r for r, d in enumerate(comm.group_devices()[0]) if d.process_index == jax.process_index()]
    print(f"LOCAL {','.join(map(str, ranks))}", flush=True)

    ours, reference = gather_programs(mesh)
    ok = True
    for k in range(steps):
        x = step_input(mesh, k)
        with comm:
            a = ours(x)
            a.block_until_ready()
        loop.step()
        print(f"ROWS {json.dumps(loop.published)}", flush=True)
        if loop.measurement is not None:
            print(f"MEASUREMENT {loop.measurement.backend} {loop.measurement.scope}", flush=True)
        if mode == "executor":
            last = comm.telemetry().last  # the loop drained it: nothing new, the samples it published
            same = all(last[i, j] == rate for i, j, rate in loop.published) and bool(loop.published)
            print(f"EXECUTOR_MATCH {'ok' if same else 'MISMATCH'}", flush=True)
        same = same_local_shards(a, reference(x))
        ok &= same
        print(f"CHECK step {k} {'ok' if same else 'MISMATCH'}", flush=True)
    for e in loop.errors:
        print(f"EVENT error {e.detail.get('error', '')}", flush=True)
    if jax.process_index() == 0:
        m = loop.telemetry().matrix
        print(f"GATHERED {json.dumps([[int(i), int(j)] for i, j in zip(*np.nonzero(np.isfinite(m)))])}", flush=True)
    print("ALL OK" if ok else "FAILED", flush=True)
    comm.close()
    if transport is not None:
        transport.close()
    jax.distributed.shutdown()  # a barrier: the coordinator (process 0) leaves last
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
