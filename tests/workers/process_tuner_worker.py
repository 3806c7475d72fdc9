"""One process of tests/tune/test_process_tuner.py (started by jaxccl.distributed.launch).

Usage: python tests/workers/process_tuner_worker.py MODE STEPS

Two processes of two CPU devices, the transport attached, a ``cpu`` communicator over the four ranks
(rail of 2 hosts x 2: each process a host). MODE ``run``: a :class:`ProcessTuner` (cold UCB1 over every
arm, its own selector) runs at least STEPS AllGather steps (on until the loop's re-synthesis reached the
tuner), every result compared with ``jax.lax``'s, and follows a
:class:`ProcessLoop` on the same communicator, whose topology overstates one rail so that the loop
re-synthesizes in its first steps (as in multiprocess_loop_worker.py). MODE ``diverge``: process 1's
selector offers the arms in another order, so the processes choose different first arms; the tuner
must refuse to stage them.

Prints ``HISTORY json`` (the tuner's (context, arm, latency) records), ``OWN json`` (this process's own
launch time of each step), ``SWAPS n`` (steps whose prepare changed the schedule), ``RESYNTHESES json``
(what the tuner took from the loop), ``ERRORS json`` (the loop's), ``CHECK step k ok|MISMATCH``,
``REFUSED message`` (diverge) and ``ALL OK``.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def _skewed(topology):
    """Rail 2 x 2 whose rail-0 NICs claim 1000x what rail 1's do: loopback carries far less, so the loop's
    first measurements flag the schedule and process 0's controller re-synthesizes."""
    base = topology.rail(hosts=2, gpus_per_host=2, nic_gbps=8)
    return base.with_edges({e: {"capacity": 1000 * base.capacity(*e)} for e in base.graph.edges if "tor:s0r0" in e})


def main(argv: list[str]) -> int:
    from jaxccl.distributed.launch import initialize_from_env

    mode, steps = argv[0], int(argv[1])
    me, _ = initialize_from_env(local_devices=2)
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl
    from jaxccl.cli.bench_run import AXIS, implementation_runner
    from jaxccl.control.process_loop import ProcessLoop
    from jaxccl.distributed.transport import ProcessTransport, attach, local_shards
    from jaxccl.errors import TuneError
    from jaxccl.runtime import native
    from jaxccl.tune import Selector, arm_catalog
    from jaxccl.tune.process_tuner import ProcessTuner

    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    topo = _skewed(jaxccl.topology)
    transport = ProcessTransport.bootstrap(timeout_s=60)
    attach(transport, mesh, AXIS)
    comm = jaxccl.Communicator(mesh, AXIS, topology=topo, backend="cpu")
    nbytes = 4 * 65536  # AllGather output per rank: 4 shards of 64 KiB (the loop measures sends >= 32 KiB)
    data = np.random.default_rng(5).standard_normal(nbytes // 4).astype(np.float32)
    x = jax.make_array_from_callback(data.shape, NamedSharding(mesh, P(AXIS)), lambda idx: data[idx])
    expected = b"".join(s.tobytes() for s in local_shards(implementation_runner(mesh, "all_gather", None)(x)))
    run = implementation_runner(mesh, "all_gather", comm)
    if mode == "diverge":
        catalog = arm_catalog("all_gather", topo)
        order = [a.name for a in (catalog if me == 0 else catalog[::-1])]
        selector = Selector(order, catalog=lambda ctx: catalog, policy="ucb1")  # no model: the first arm first
        try:
            ProcessTuner(comm, selector, timeout_s=30).prepare("all_gather", nbytes)
        except TuneError as e:
            print(f"REFUSED {e}", flush=True)
            print("ALL OK", flush=True)
        return 0
    # cold UCB1 over every arm (no filter): it tries each in turn, so the steps switch arms
    tuner = ProcessTuner(comm, timeout_s=60, policy={"policy": "ucb1", "pseudo_count": 0}, rho_max=1e9)
    loop = ProcessLoop(comm, margin=0, timeout_s=60, confirm=1)
    tuner.follow(loop)
    own, swaps, ok = [], 0, True
    # STEPS steps, and on until the loop's re-synthesis was agreed (every process sees it at the same step), then
    # one more, whose prepare takes it into the tuner's arms; at most 60 (a loaded machine measures late)
    k, last = 0, None
    while k < steps or last is None or k <= last:
        before = comm.schedule("all_gather").digest
        arm = tuner.prepare("all_gather", nbytes)
        swaps += comm.schedule("all_gather").digest != before
        out = run(x)
        out.block_until_ready()
        own.append(native.last_launch_seconds(comm.slot("all_gather")))
        tuner.record("all_gather", nbytes, arm)
        loop.step()
        same = b"".join(s.tobytes() for s in local_shards(out)) == expected
        ok &= same
        print(f"CHECK step {k} {'ok' if same else 'MISMATCH'}", flush=True)
        if last is None and (any(e.kind == "agreed" for e in loop.events) or k >= 60):
            last = k + 1
        k += 1
    print(f"HISTORY {json.dumps(tuner.history)}", flush=True)
    print(f"OWN {json.dumps(own)}", flush=True)
    print(f"SWAPS {swaps}", flush=True)
    print(f"RESYNTHESES {json.dumps(tuner.tuner.resyntheses)}", flush=True)
    print(f"ERRORS {json.dumps([e.detail for e in loop.errors])}", flush=True)
    comm.close()
    transport.close()
    if ok:
        print("ALL OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
