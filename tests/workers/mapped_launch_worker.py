"""One process of tests/distributed/test_mapped_launch.py (started by jaxccl.distributed.launch).

Usage: python tests/workers/mapped_launch_worker.py MODE

Every process runs 2 of the 4 ranks of one process group (attached over the UCX transport), and runs
mapped launches through ``jaxccl._native._mapped_launch_run``: each local rank's threadblocks are host
threads that follow the CUDA interpreter's protocol, and the proxy starts through the core API's
``start_mapped_proxy``, as for the CUDA executor (xla_ffi/transport/handshake_harness.h).

- ``checks``: AllGather (direct; ring in tiles over 2 slots), ReduceScatter (rank-ordered), AllReduce
  (rank-ordered; ring in tiles on int32) on random non-zero data, on both wire layouts (``host``: message
  and trailer in one transfer, ``cuda``: apart), each local rank's output compared bitwise with NumPy
  (``CHECK <wire> <case> ok|MISMATCH``); the transport's records of those launches (``CHECK meter``);
  process 1 sends a message of a stale identity, which process 0 refuses (``REFUSED <error>``), and a
  launch whose processes use different wire layouts fails in both (``WIRES <error>``), and a launch that
  process 1 joins late fails at process 0's deadline (``DEADLINE <error>``), each followed by a launch
  checked bitwise (``CHECK after ...``); prints ``ALL OK``.
- ``kill``: one launch checked, then process 1 sleeps (the test kills it) while process 0 prints
  ``START`` and runs a launch, which fails: ``RESULT <seconds> <codes> <error>`` (codes: the local
  ranks' error words).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

N = 4  # ranks of the group: 2 per process
ELEMS = 4096  # per rank block
NUM_SLOTS = 2


def ordered_sum(blocks: list[np.ndarray]) -> np.ndarray:
    """``((0 + x0) + x1) + ...``: the order of the rank-ordered schedules."""
    acc = np.zeros_like(blocks[0])
    for b in blocks:
        acc = acc + b
    return acc


def cases() -> dict[str, tuple]:
    """name -> (schedule, collective, dtype, tiles)."""
    from jaxccl.runtime.default_schedules import direct_allgather
    from jaxccl.synth.baselines import direct_reduce_scatter, ordered_allreduce, ring_allgather, ring_allreduce

    return {
        "all_gather direct": (direct_allgather(N), "all_gather", np.float32, 0),
        "all_gather ring tiled": (ring_allgather(N), "all_gather", np.float32, 4),
        "reduce_scatter ordered": (direct_reduce_scatter(N), "reduce_scatter", np.float32, 0),
        "all_reduce ordered": (ordered_allreduce(N), "all_reduce", np.float32, 0),
        "all_reduce ring tiled": (ring_allreduce(N), "all_reduce", np.int32, 3),
    }


def data(collective: str, dtype, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every rank's input and expected output (the same in every process), never zero."""
    rng = np.random.default_rng(seed)
    size = ELEMS * (N if collective == "reduce_scatter" else 1)
    if dtype == np.int32:
        inputs = [rng.integers(1, 2**20, size, dtype=np.int32) for _ in range(N)]
    else:
        inputs = [(rng.standard_normal(size) * 100 + 0.5).astype(dtype) for _ in range(N)]
    if collective == "all_gather":
        expected = [np.concatenate(inputs)] * N
    elif collective == "reduce_scatter":
        expected = [ordered_sum([x[r * ELEMS : (r + 1) * ELEMS] for x in inputs]) for r in range(N)]
    else:
        expected = [ordered_sum(inputs)] * N
    return inputs, expected


class Group:
    """This process's ranks of the attached group and one slot per schedule."""

    def __init__(self, t) -> None:
        import jax
        from jax.sharding import Mesh

        from jaxccl.distributed.transport import attach
        from jaxccl.runtime import native

        devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
        attach(t, Mesh(devices, ("d",)), "d")
        self.native = native
        self.ranks = [r for r, d in enumerate(devices) if d.process_index == t.process_id]
        self.slots: dict[str, int] = {}

    def slot(self, name: str, schedule) -> int:
        if name not in self.slots:
            self.slots[name] = self.native.new_slot()
            self.native.install(self.slots[name], schedule, num_slots=NUM_SLOTS)
        return self.slots[name]

    def run(self, name: str, wire: str, seed: int) -> tuple[dict, bool]:
        """One mapped launch of case ``name``: its result and whether every local output is bitwise expected."""
        schedule, collective, dtype, tiles = cases()[name]
        inputs, expected = data(collective, dtype, seed)
        outs = [np.zeros_like(expected[r]) for r in self.ranks]
        result = self.native.module()._mapped_launch_run(
            self.slot(name, schedule), 0, self.ranks, [inputs[r] for r in self.ranks], outs, 0, wire, tiles
        )
        same = not result["error"] and all(o.tobytes() == expected[r].tobytes() for o, r in zip(outs, self.ranks))
        return result, same


def barrier(name: str) -> None:
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(f"jaxccl_test_mapped_{name}", 60_000)


def checks(t) -> bool:
    g = Group(t)
    ok = True
    g.native.module().transport_drain()  # only this run's records below
    seed = 0
    for wire in ("host", "cuda"):
        for name in cases():
            seed += 1
            result, same = g.run(name, wire, seed)
            ok &= same
            print(f"CHECK {wire} {name} {'ok' if same else 'MISMATCH ' + result['error']}", flush=True)
    flat, dropped = g.native.module().transport_drain()
    records = np.array(flat, np.int64).reshape(-1, 6)  # src rank, dst rank, bytes, post ns, done ns, layout
    remote = [r for r in range(N) if r not in g.ranks]
    meter = (
        len(records) > 0
        and dropped == 0
        and set(records[:, 0].tolist()) == set(g.ranks)
        and set(records[:, 1].tolist()) <= set(remote)
        and bool((records[:, 2] > 0).all() and (records[:, 4] >= records[:, 3]).all())
    )
    ok &= meter
    print(f"CHECK meter {'ok' if meter else 'BAD'} {len(records)} records", flush=True)

    timeout = g.native.get_timeout()
    # A stale message: process 1's first message to process 0 carries the identity of its previous launch.
    g.native.set_timeout(3.0)
    if t.process_id == 1:
        g.native._inject_stale_message(g.slot("all_gather direct", None), across_processes=True)
    result, _ = g.run("all_gather direct", "cuda", 100)
    if t.process_id == 0:
        print(f"REFUSED {result['rank_errors']} {result['error']}", flush=True)
    barrier("stale")
    g.native.set_timeout(timeout)
    for k in range(2):
        _, same = g.run("all_gather direct", ("host", "cuda")[k], 101 + k)
        ok &= same
        print(f"CHECK after stale {k} {'ok' if same else 'MISMATCH'}", flush=True)

    # The two wire layouts differ on the wire: a launch whose processes disagree on it fails in both.
    g.native.set_timeout(3.0)
    result, _ = g.run("all_gather direct", ("host", "cuda")[t.process_id], 150)
    print(f"WIRES {result['error']}", flush=True)
    barrier("wires")
    g.native.set_timeout(timeout)
    _, same = g.run("all_gather direct", "cuda", 151)
    ok &= same
    print(f"CHECK after wires {'ok' if same else 'MISMATCH'}", flush=True)

    # A deadline: process 1 joins the launch after process 0's deadline.
    g.native.set_timeout(2.0)
    barrier("before deadline")
    if t.process_id == 1:
        time.sleep(3.5)
    result, _ = g.run("reduce_scatter ordered", "host", 200)
    if t.process_id == 0:
        print(f"DEADLINE {result['rank_errors']} {result['error']}", flush=True)
    barrier("deadline")
    g.native.set_timeout(timeout)
    for k in range(2):
        _, same = g.run("reduce_scatter ordered", ("host", "cuda")[k], 201 + k)
        ok &= same
        print(f"CHECK after deadline {k} {'ok' if same else 'MISMATCH'}", flush=True)
    return ok


def kill(t) -> bool:
    g = Group(t)
    _, same = g.run("all_gather direct", "cuda", 1)
    print(f"CHECK before {'ok' if same else 'MISMATCH'}", flush=True)
    barrier("kill")
    if t.process_id == 1:
        time.sleep(600)  # the test kills this process here
        return False
    print("START", flush=True)
    start = time.monotonic()
    result, _ = g.run("all_gather ring tiled", "cuda", 2)
    codes = ",".join(str(code) for code, _, _ in result["rank_errors"])
    print(f"RESULT {time.monotonic() - start:.2f} {codes} {result['error']}", flush=True)
    return same and bool(result["error"])


def main(argv: list[str]) -> int:
    from jaxccl.distributed.launch import initialize_from_env
    from jaxccl.distributed.transport import ProcessTransport

    mode = argv[0]
    initialize_from_env(local_devices=N // 2)
    t = ProcessTransport.bootstrap(timeout_s=60.0)
    ok = checks(t) if mode == "checks" else kill(t)
    print("ALL OK" if ok else "FAILED", flush=True)
    if mode == "kill":
        os._exit(0 if ok else 1)  # the peer is dead: jax.distributed's shutdown barrier would wait for it
    t.close()
    import jax

    jax.distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
