"""One process of tests/distributed/test_multiprocess_loop.py (started by jaxccl.distributed.launch).

Usage: python tests/workers/multiprocess_loop_worker.py SYNTHESIZER STEPS

Two processes of two CPU devices each run STEPS native AllGather steps across all four ranks,
each checked bitwise against ``jax.lax.all_gather``, with a
:class:`~jaxccl.control.process_loop.ProcessLoop` step after each. The communicator's
topology says rail 0's NICs carry 1000x what rail 1's do, so the healthy schedule sends (almost)
everything between the processes over rail 0; what loopback really carries is far below that, so
the first measurements flag the schedule (Algorithm 1) and the controller re-synthesizes.
SYNTHESIZER is ``default`` (the controller's own) or ``raise`` (a synthesizer that fails).

Prints ``INSTALLED version`` (the registry's before the loop), ``CHECK step k ok|MISMATCH``,
``SWAP current_version last_swap_seq`` from the registry,
``EVENT kind`` per loop event of this process, and ``ALL OK``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # run as a script
from multiprocess_checks import gather_programs, same_local_shards, step_input  # noqa: E402


def failing_synthesizer(topology, running):
    raise RuntimeError("synthesizer failed on purpose")


def main(argv: list[str]) -> int:
    from jaxccl.distributed.launch import initialize_from_env

    synthesizer, steps = argv[0], int(argv[1])
    initialize_from_env(local_devices=2)
    import jax
    from jax.sharding import Mesh

    import jaxccl
    from jaxccl.control.process_loop import ProcessLoop
    from jaxccl.distributed.transport import ProcessTransport, attach
    from jaxccl.runtime import native

    transport = ProcessTransport.bootstrap(timeout_s=60)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    attach(transport, mesh, "d")
    base = jaxccl.topology.rail(hosts=2, gpus_per_host=2, nic_gbps=8)  # 1 GB/s per NIC
    fast_rail = {e: {"capacity": 1000 * base.capacity(*e)} for e in base.graph.edges if "tor:s0r0" in e}
    topo = base.with_edges(fast_rail)
    comm = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu")
    comm.install("all_gather", jaxccl.synth.all_gather(topo))
    slot = comm.slot("all_gather")
    state = native.swap_state(slot)  # the installed schedule is current from the first call
    print(f"INSTALLED {max(state['current_version'], state['staged_version'])}", flush=True)
    options = {"synthesizers": {"all_gather": failing_synthesizer}} if synthesizer == "raise" else {}
    loop = ProcessLoop(comm, margin=0, timeout_s=60, confirm=1, **options)

    ours, reference = gather_programs(mesh)
    ok = True
    for k in range(steps):
        x = step_input(mesh, k)
        with comm:
            a = ours(x)
            a.block_until_ready()
        loop.step()
        same = same_local_shards(a, reference(x))
        ok &= same
        print(f"CHECK step {k} {'ok' if same else 'MISMATCH'}", flush=True)
    state = native.swap_state(slot)
    print(f"SWAP {state['current_version']} {state['last_swap_seq']}", flush=True)
    for e in loop.events:
        print(f"EVENT {e.kind} {e.detail.get('error', '')}", flush=True)
    if jax.process_index() == 0:  # what the loop leaves in the coordinator's key-value store
        from jax._src import distributed

        from jaxccl.distributed.transport import SWAP_KEY_PREFIX

        client = distributed.global_state.client
        keys = [key for key, _ in client.key_value_dir_get(loop.key_prefix)]  # <prefix>/<round>/...
        rounds = {key[len(loop.key_prefix) + 1 :].split("/")[0] for key in keys}
        swaps = client.key_value_dir_get(SWAP_KEY_PREFIX)
        print(f"KEY_ROUNDS {len(rounds)} SWAP_KEYS {len(swaps)}", flush=True)
    print("ALL OK" if ok else "FAILED", flush=True)
    comm.close()
    transport.close()
    jax.distributed.shutdown()  # a barrier: the coordinator (process 0) leaves last
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
