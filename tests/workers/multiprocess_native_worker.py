"""One process of tests/distributed/test_multiprocess_native.py (started by jaxccl.distributed.launch).

Usage: python tests/workers/multiprocess_native_worker.py MODE [ARGS]

- ``exchange``: every process sends random data of several sizes to every other through the
  transport (bootstrapped on jax.distributed) and checks what it receives bitwise against the
  sender's generator; prints ``CHECK ...`` lines, ``RATE src dst bytes/s`` for the largest size (from the
  send's completion times),
  ``VIA peer transport/device,...`` (UCX's transports to each peer) and ``ALL OK``.
- ``stream NBYTES ROUNDS``: process 0 sends ROUNDS messages of NBYTES to process 1, which prints
  the throughput of each receive from the transport's completion times (``RATE bytes/s``).
- ``collectives LOCAL_DEVICES``: the four collectives on the native CPU backend over every device
  of every process (LOCAL_DEVICES per process), float32 and int32, each process's shards compared
  bitwise with ``jax.lax`` (gloo) and, for reductions, with a NumPy fold in ascending rank order
  (jaxccl's order; gloo's float sums need not follow it); prints ``CHECK ...`` lines and ``ALL OK``.
- ``mesh LOCAL_DEVICES``: a 2-D mesh ``("x", "y")`` whose rows are the processes; the four
  collectives over ``"x"`` (groups that span the processes), ``"y"`` (groups inside one process) and
  ``("y", "x")`` (one group of every device, ``y`` major) on the native CPU backend, each attached
  in turn, compared bitwise with ``jax.lax`` (gloo) on random integer-valued data of float32 and
  int32, whose sums are exact in any order; prints ``CHECK ...`` lines and ``ALL OK``.
- ``layouts LOCAL_DEVICES``: the hybrid layout of large jobs in one program: a 2-D mesh
  ``("data", "model")`` whose rows are the processes, with ``"model"`` (inside a process), ``"data"``
  (across) and ``("data", "model")`` (every device) all attached at once; a gather over ``model``,
  a sum over both axes, a ReduceScatter and a max over ``data`` and an AllToAll over ``model`` run
  natively in one jitted step, compared bitwise with ``jax.lax`` on integer-valued data; each
  layout's meter sees only its own ranks (``CHECK meter ...``).
- ``sums LOCAL_DEVICES BACKEND [AXES]``: float sums across processes bitwise equal to ``jax.lax`` (gloo's
  orders): ``psum``, ``pmean`` and ``psum_scatter`` over a 1-D axis of every device and over ``"data"``, ``"model"``,
  ``("data", "model")`` and ``("model", "data")`` of a 2-D mesh whose rows are the processes, on
  float32, bfloat16 and float16 data whose magnitudes span decades, 1 to 300,001 elements per rank
  (odd sizes, several gloo segments); BACKEND ``cpu`` (each layout attached) or ``ppermute`` (the 1-D
  axis and ``("model", "data")``: the same schedules, lowered to ppermute rounds). AXES, comma-separated,
  takes some of ``d``, ``data``, ``model``, ``data/model`` and ``model/data`` only (a part: ``sums:BACKEND:AXES``).
- ``swap LOCAL_DEVICES STEPS``: native AllGather steps across processes, each checked bitwise
  against ``jax.lax``; at a step drawn from a seed every process shares, a ring schedule is
  staged everywhere at one agreed sequence number (``stage_agreed``); prints ``SWAP version seq``
  from the registry after the run.
- ``meter LOCAL_DEVICES STEPS``: native AllGather steps of 1 MiB per rank; after each, this
  process's measured send rates to the other process's ranks (``METER k bytes/s``, the median
  over pairs, from the transport's completion times).
- ``kill [sending|receiving]``: the last process sends one message to process 0, prints ``SENT`` and sleeps (the
  test kills it); process 0 waits for a second message and prints ``ERROR <type> after <s> s: <message>``.
  ``sending`` / ``receiving``: the last process sends 64 MiB messages to process 0 (receives them from it) without
  pause (``SENT`` after the third), so that the kill lands inside a transfer (over shared memory: while process 0
  reads the victim's memory, or while the victim reads process 0's).
- ``killnative LOCAL_DEVICES [ring]``: native AllGather steps in a loop (``STEP k``) until one fails; the
  test kills the last process mid-run, and the others print ``ERROR ...`` as above (``ring``: a ring
  schedule, whose local ranks wait for local ranks).
- ``hanginplace LOCAL_DEVICES``: AllToAll steps of 8 MiB per rank (1 MiB messages, which land in place) until one
  fails (``STEP k``, then ``ERROR ...``); the test stops the last process mid-run and resumes it later. Process 0
  then fills canaries of the outputs' size, waits ``JAXCCL_TEST_RESUME_WAIT_S`` while the resumed process sends
  what it had left, and prints ``CANARY ok|CORRUPTED landed N disconnects M`` (native.stats()).
- ``stale LOCAL_DEVICES``: process 1 sends one message with a stale identity; process 0 prints
  ``REFUSED <error>``, then both check three more AllGathers (``CHECK after k ok``).
- ``inplace`` (a part only): an AllToAll of 8 MiB per rank and a ring AllGather of 1 MiB per rank, whose 1 MiB
  messages from other processes land in the receiver's output: bitwise against ``jax.lax`` and counted
  (``CHECK in place ...``).
- ``parts LOCAL_DEVICES PART+PART+...``: several of ``exchange``, ``collectives`` (``collectives:ppermute``:
  the same checks on the ppermute backend), ``mesh``, ``layouts``, ``sums:BACKEND``, ``swap:STEPS`` and ``inplace`` in
  one job, in turn, each after a line ``PART <part>``; ``ALL OK`` when every part's checks passed.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # run as a script
from multiprocess_checks import check_collectives  # noqa: E402

SIZES = (4 << 10, 1 << 20, 8 << 20)
TIMEOUT_S = 60.0
STREAM_KILL_BYTES = 64 << 20


def payload(src: int, dst: int, nbytes: int) -> np.ndarray:
    # Never all zeros: random bits from a generator both sides can seed.
    return np.random.default_rng([src, dst, nbytes]).integers(1, 2**31 - 1, nbytes // 4, dtype=np.int32)


def transport_options() -> dict[str, str]:
    from jaxccl.distributed.transport import NETWORK_ONLY

    return dict(NETWORK_ONLY) if os.environ.get("JAXCCL_TEST_NETWORK_ONLY") == "1" else {}


def exchange(t) -> bool:
    ok = True
    me, n = t.process_id, t.num_processes
    for k, nbytes in enumerate(SIZES):
        inbox = {p: np.zeros(nbytes // 4, np.int32) for p in range(n) if p != me}
        outbox = {p: payload(me, p, nbytes) for p in range(n) if p != me}
        recvs = {p: t.irecv(p, k, inbox[p]) for p in inbox}
        sends = {p: t.isend(p, k, outbox[p]) for p in outbox}
        done = {p: t.wait(r, TIMEOUT_S) for p, r in recvs.items()}
        sent = {p: t.wait(r, TIMEOUT_S) for p, r in sends.items()}
        for p, got in inbox.items():
            same = got.tobytes() == payload(p, me, nbytes).tobytes() and done[p].bytes == nbytes
            ok &= same
            print(f"CHECK {nbytes} from {p} {'ok' if same else 'MISMATCH'}", flush=True)
            if nbytes == SIZES[-1]:
                # From the send: a receive posted after part of its message arrived (over TCP a message travels
                # in eager pieces, which arrive unasked) completes sooner than the bytes took.
                print(f"RATE {me} {p} {nbytes / max(sent[p].seconds, 1e-9):.0f}", flush=True)
    for p in range(n):
        if p != me:
            print(f"VIA {p} {','.join(t.peer_transports(p))}", flush=True)
    return ok


def stream(t, nbytes: int, rounds: int) -> bool:
    buf = payload(0, 1, nbytes) if t.process_id == 0 else np.zeros(nbytes // 4, np.int32)
    for k in range(rounds):
        if t.process_id == 0:
            t.wait(t.isend(1, k, buf), TIMEOUT_S)
        elif t.process_id == 1:
            c = t.wait(t.irecv(0, k, buf), TIMEOUT_S)
            print(f"RATE {c.bytes / max(c.seconds, 1e-9):.0f}", flush=True)
    return t.process_id != 1 or buf.tobytes() == payload(0, 1, nbytes).tobytes()


def collectives(t, backend: str = "cpu") -> bool:
    import jax
    from jax.sharding import Mesh

    import jaxccl
    from jaxccl.distributed.transport import attach

    mesh = Mesh(np.array(jax.devices()), ("d",))
    if backend == "ppermute":  # rounds of jax.lax.ppermute (gloo): no transport, no native launch
        comm = jaxccl.Communicator(mesh, "d", backend="ppermute")
        ok = check_collectives(comm, mesh)
        comm.close()
        return ok
    attach(t, mesh, "d")
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    ok = check_collectives(comm, mesh)
    from jaxccl.runtime import native

    launches = {c: native.launch_count(comm.slot(c)) for c in ("all_gather", "all_to_all")}
    ran_native = all(v >= 2 for v in launches.values())  # float32 and int32: the native executor ran them
    ok &= ran_native
    print(f"CHECK native launches {'ok' if ran_native else 'MISSING'} {launches}", flush=True)
    comm.close()
    return ok


def one_collective(lib, name: str, axis, v):
    """``name`` of ``lib`` (jaxccl or jax.lax) over ``axis`` on a rank's block ``v``."""
    if name == "all_gather":
        return lib.all_gather(v, axis, axis=1, tiled=True)
    if name == "all_to_all":
        return lib.all_to_all(v, axis, 1, 0, tiled=True)
    if name == "psum_scatter":
        return lib.psum_scatter(v, axis, scatter_dimension=1, tiled=True)
    return lib.psum(v, axis)


def mesh_axes(t) -> bool:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl
    from jaxccl.distributed.transport import attach, local_shards
    from jaxccl.runtime import native

    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    mesh = Mesh(devices.reshape(t.num_processes, -1), ("x", "y"))
    spec = P("x", "y")
    sharding = NamedSharding(mesh, spec)
    rng = np.random.default_rng(77)  # the same global data in every process
    ok = True
    for axis in ("x", "y", ("y", "x")):
        attach(t, mesh, axis)
        comm = jaxccl.Communicator(mesh, axis, backend="cpu")
        n = comm.axis_size
        for dtype in (np.float32, np.int32):
            # integers up to 2**20: float32 sums of up to 8 of them are exact, so every order agrees
            raw = rng.integers(-(2**20), 2**20, (2 * n * mesh.shape["x"], 3 * n * mesh.shape["y"])).astype(dtype)
            assert np.count_nonzero(raw) > raw.size // 2
            x = jax.make_array_from_callback(raw.shape, sharding, lambda idx, raw=raw: raw[idx])
            for name in ("all_gather", "all_to_all", "psum_scatter", "psum"):
                f = {
                    lib: jax.jit(
                        jax.shard_map(
                            functools.partial(one_collective, lib, name, axis), mesh=mesh, in_specs=spec, out_specs=spec
                        )
                    )
                    for lib in (jaxccl, jax.lax)
                }
                with comm:
                    a = f[jaxccl](x)
                b = f[jax.lax](x)
                got = [s.tobytes() for s in local_shards(a)]
                want = [s.tobytes() for s in local_shards(b)]
                same = a.shape == b.shape and got == want
                ok &= same
                print(f"CHECK {axis} {name} {np.dtype(dtype).name} lax {'ok' if same else 'MISMATCH'}", flush=True)
        launches = native.launch_count(comm.slot("all_gather"))
        ok &= launches >= 2
        print(f"CHECK {axis} native launches {'ok' if launches >= 2 else 'MISSING'} {launches}", flush=True)
        comm.close()
    return ok


def layouts(t) -> bool:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl
    from jaxccl.distributed.transport import TransportMeter, attach, local_shards
    from jaxccl.runtime import native

    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    mesh = Mesh(devices.reshape(t.num_processes, -1), ("data", "model"))
    axes = ("model", "data", ("data", "model"))
    numbers = {axis: attach(t, mesh, axis) for axis in axes}
    ok = sorted(numbers.values()) == [0, 1, 2] and attach(t, mesh, "data") == numbers["data"]
    print(f"CHECK attached {'ok' if ok else 'BAD'} {numbers}", flush=True)
    meters = {
        axis: TransportMeter(int(np.prod([mesh.shape[a] for a in native_axes(axis)])), layout=n)
        for axis, n in numbers.items()
    }
    for m in meters.values():
        m.drain()

    def step(lib, v):
        gathered = lib.all_gather(v, "model", axis=1, tiled=True)
        return {
            "gather model": gathered,
            "sum data model": lib.psum(gathered, ("data", "model")),
            "scatter data": lib.psum_scatter(v, "data", scatter_dimension=1, tiled=True),
            "max data": lib.pmax(v, "data"),
            "a2a model": lib.all_to_all(v, "model", 1, 0, tiled=True),
        }

    spec = P("data", "model")
    comms = [jaxccl.Communicator(mesh, axis, backend="cpu") for axis in axes]
    rng = np.random.default_rng(5)  # the same global data in every process
    n_model, n_data = mesh.shape["model"], mesh.shape["data"]
    raw = rng.integers(-(2**16), 2**16, (4 * n_data, 64 * n_model * n_data)).astype(np.float32)
    x = jax.make_array_from_callback(raw.shape, NamedSharding(mesh, spec), lambda idx: raw[idx])
    f = {
        lib: jax.jit(jax.shard_map(functools.partial(step, lib), mesh=mesh, in_specs=spec, out_specs=spec))
        for lib in (jaxccl, jax.lax)
    }
    with comms[0], comms[1], comms[2]:
        got = f[jaxccl](x)
    want = f[jax.lax](x)
    for name in want:
        same = [s.tobytes() for s in local_shards(got[name])] == [s.tobytes() for s in local_shards(want[name])]
        ok &= same
        print(f"CHECK {name} lax {'ok' if same else 'MISMATCH'}", flush=True)
    slots = [c.slot(coll) for c, coll in zip(comms, ("all_gather", "reduce_scatter", "all_reduce"))]
    launches = [native.launch_count(slot) for slot in slots]
    ran = all(k >= 1 for k in launches)
    ok &= ran
    print(f"CHECK native launches {'ok' if ran else 'MISSING'} {launches}", flush=True)
    # Each layout's meter sees its own ranks: none inside a process, the data axis's 2, or all 8.
    seen = {axis: sorted({r[0] for r in m.drain()} | set()) for axis, m in meters.items()}
    good = seen["model"] == [] and seen["data"] != [] and max(seen["data"]) < n_data and seen[("data", "model")] != []
    ok &= good
    print(f"CHECK meter {'ok' if good else 'BAD'} {seen}", flush=True)
    for c in comms:
        c.close()
    return ok


def sums(t, backend: str, axes: str = "") -> bool:
    import jax
    import ml_dtypes
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl
    from jaxccl.distributed.transport import attach, local_shards

    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    meshes = {"1d": Mesh(devices, ("d",)), "2d": Mesh(devices.reshape(t.num_processes, -1), ("data", "model"))}
    cases = [("1d", "d"), ("2d", "data"), ("2d", "model"), ("2d", ("data", "model")), ("2d", ("model", "data"))]
    if backend == "ppermute":  # the same schedules as on cpu: two axes show the lowering runs them
        cases = [cases[0], cases[4]]
    if axes:
        cases = [c for c in cases if "/".join(native_axes(c[1])) in axes.split(",")]
    rng = np.random.default_rng(9)  # the same global data in every process
    sizes = (1, 7, 65537, 300001)
    dtypes = (np.float32, ml_dtypes.bfloat16, np.float16)
    ok = True
    for mesh_name, axis in cases:
        mesh = meshes[mesh_name]
        spec = P(tuple(mesh.axis_names))
        n = int(np.prod([mesh.shape[a] for a in native_axes(axis)]))
        if backend == "cpu":
            attach(t, mesh, axis)
        data = {}
        for dtype in dtypes:
            decades = 3 if dtype is np.float16 else 6  # float16: ordinary magnitudes (gloo's float16 quirk aside)
            for e in sizes:
                shape = (mesh.devices.size, e)
                raw = rng.standard_normal(shape) * 10.0 ** rng.uniform(-decades / 2, decades / 2, shape)
                data[f"{np.dtype(dtype).name} {e}"] = raw.astype(dtype)
        arrays = {
            k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec), lambda idx, v=v: v[idx])
            for k, v in data.items()
        }

        def step(lib, xs, axis=axis, n=n):
            out = {f"psum {k}": lib.psum(v, axis) for k, v in xs.items()}
            out["pmean float32 65537"] = lib.pmean(xs["float32 65537"], axis)
            for k in ("float32 65537", "bfloat16 65537", "float16 65537"):  # shards below gloo's race (512 KiB)
                out[f"psum_scatter {k}"] = lib.psum_scatter(
                    xs[k][:, : xs[k].shape[1] // n * n], axis, scatter_dimension=1, tiled=True
                )
            return out

        f = {
            lib: jax.jit(jax.shard_map(functools.partial(step, lib), mesh=mesh, in_specs=spec, out_specs=spec))
            for lib in (jaxccl, jax.lax)
        }
        with jaxccl.Communicator(mesh, axis, backend=backend):
            got = f[jaxccl](arrays)
        want = f[jax.lax](arrays)
        bad = [
            k
            for k in want
            if [s.tobytes() for s in local_shards(got[k])] != [s.tobytes() for s in local_shards(want[k])]
        ]
        ok &= not bad
        print(f"CHECK sums {mesh_name} {axis} {'ok' if not bad else 'MISMATCH ' + ', '.join(bad)}", flush=True)
    return ok


def native_axes(axis) -> tuple:
    return tuple(axis) if isinstance(axis, tuple) else (axis,)


def swap(t, steps: int) -> bool:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl
    from jaxccl.distributed.transport import attach, local_shards, stage_agreed
    from jaxccl.runtime import native

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    attach(t, mesh, "d")
    topo = jaxccl.topology.rail(hosts=t.num_processes, gpus_per_host=n // t.num_processes)
    comm = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu")
    comm.install("all_gather", jaxccl.synth.all_gather(topo))
    sharding = NamedSharding(mesh, P("d"))

    def step(collective):
        body = lambda v: collective(v, "d", axis=0, tiled=True)  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    ours, reference = step(jaxccl.all_gather), step(jax.lax.all_gather)
    swap_at = int(np.random.default_rng(99).integers(1, steps - 6))  # the same in every process
    ok = True
    for k in range(steps):
        raw = np.random.default_rng(k).standard_normal((n * 64, 33)).astype(np.float32)
        x = jax.make_array_from_callback(raw.shape, sharding, lambda idx, raw=raw: raw[idx])
        if k == swap_at:
            version, seq = stage_agreed(comm, "all_gather", jaxccl.synth.ring_allgather(topo), round_id=1)
            print(f"STAGED version {version} at seq {seq} (step {k})", flush=True)
        with comm:
            a = ours(x)
        b = reference(x)
        same = all(u.tobytes() == w.tobytes() for u, w in zip(local_shards(a), local_shards(b)))
        ok &= same
        print(f"CHECK step {k} lax {'ok' if same else 'MISMATCH'}", flush=True)
    state = native.swap_state(comm.slot("all_gather"))
    print(f"SWAP {state['current_version']} {state['last_swap_seq']}", flush=True)
    comm.close()
    return ok


def stale(t) -> bool:
    """Process 1 sends one message with the identity of its previous launch; process 0's proxy must refuse it.

    Prints ``REFUSED <error>`` where the error names the stale message, then checks that both processes run
    correct collectives again once the failed launch is over.
    """
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl
    from jaxccl.distributed.transport import attach, local_shards
    from jaxccl.errors import ExecutorError
    from jaxccl.runtime import native
    from jaxccl.runtime.failures import executor_errors

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    attach(t, mesh, "d")
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    sharding = NamedSharding(mesh, P("d"))

    def step(collective):
        body = lambda v: collective(v, "d", axis=0, tiled=True)  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    ours, reference = step(jaxccl.all_gather), step(jax.lax.all_gather)

    def run(k: int, check: bool = True) -> bool:
        raw = np.random.default_rng(k).standard_normal((n * 64, 5)).astype(np.float32)
        x = jax.make_array_from_callback(raw.shape, sharding, lambda idx, raw=raw: raw[idx])
        with executor_errors(), comm:  # the launch's error surfaces when its result is read
            a = local_shards(ours(x))
        if not check:
            return True
        b = local_shards(reference(x))
        return all(u.tobytes() == w.tobytes() for u, w in zip(a, b))

    ok = run(0)
    if t.process_id == 1:
        native._inject_stale_message(comm.slot("all_gather"), across_processes=True)
    try:
        run(1, check=False)  # only the receiver fails: the processes must not go on to gloo out of step
        print("NO ERROR" if t.process_id == 0 else "SENT", flush=True)
        ok &= t.process_id == 1
    except ExecutorError as e:
        print(f"REFUSED {type(e).__name__}: {e}", flush=True)
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier("jaxccl_test_stale", 60_000)
    for k in range(2, 5):
        same = run(k)
        ok &= same
        print(f"CHECK after {k} {'ok' if same else 'MISMATCH'}", flush=True)
    comm.close()
    return ok


def meter(t, steps: int) -> bool:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl
    from jaxccl.distributed.transport import TransportMeter, attach

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    attach(t, mesh, "d")
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    body = lambda v: jaxccl.all_gather(v, "d", axis=0, tiled=True)  # noqa: E731
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    raw = np.random.default_rng(5).standard_normal((n * 256, 1024)).astype(np.float32)  # 1 MiB per rank
    x = jax.make_array_from_callback(raw.shape, NamedSharding(mesh, P("d")), lambda idx: raw[idx])
    m = TransportMeter(n)
    with comm:
        for k in range(steps):
            step(x).block_until_ready()
            rates = m.rates()
            mine = [i for i, d in enumerate(jax.devices()) if d.process_index == jax.process_index()]
            remote = [rates[s, d] for s in mine for d in range(n) if d not in mine and np.isfinite(rates[s, d])]
            print(f"METER {k} {float(np.median(remote)) if remote else float('nan'):.0f}", flush=True)
    comm.close()
    return True


def kill(t, streaming: str = "") -> bool:
    from jaxccl.errors import ExecutorError

    if streaming:
        return kill_streaming(t, victim_sends=streaming == "sending")
    buf = np.zeros(1 << 18, np.int32)
    victim = t.num_processes - 1  # never process 0: it runs jax.distributed's coordinator
    if t.process_id == victim:
        t.wait(t.isend(0, 1, payload(victim, 0, buf.nbytes)), TIMEOUT_S)
        print("SENT", flush=True)
        time.sleep(600)  # the test kills this process here
        return False
    if t.process_id != 0:
        return True
    t.wait(t.irecv(victim, 1, buf), TIMEOUT_S)
    start = time.monotonic()
    try:
        t.wait(t.irecv(victim, 2, buf), float(os.environ.get("JAXCCL_TEST_DEADLINE_S", "20")))
    except ExecutorError as e:
        print(f"ERROR {type(e).__name__} after {time.monotonic() - start:.2f} s: {e}", flush=True)
        return True
    print("NO ERROR", flush=True)
    return False


def kill_streaming(t, victim_sends: bool) -> bool:
    from jaxccl.errors import ExecutorError

    buf = np.ones(STREAM_KILL_BYTES // 4, np.int32)
    victim = t.num_processes - 1
    k = 0
    if t.process_id == victim:
        while True:
            if victim_sends:
                t.wait(t.isend(0, k, buf), TIMEOUT_S)
            else:
                t.wait(t.irecv(0, k, buf), TIMEOUT_S)
            k += 1
            if k == 3:
                print("SENT", flush=True)  # the test kills this process during one of the next transfers
    if t.process_id != 0:
        return True
    start = time.monotonic()
    deadline_s = float(os.environ.get("JAXCCL_TEST_DEADLINE_S", "20"))
    try:
        while True:
            if victim_sends:
                t.wait(t.irecv(victim, k, buf), deadline_s)
            else:
                t.wait(t.isend(victim, k, buf), deadline_s)
            k += 1
            start = time.monotonic()
    except ExecutorError as e:
        print(f"ERROR {type(e).__name__} after {time.monotonic() - start:.2f} s: {e}", flush=True)
        return True


def kill_native(t, schedule: str = "direct") -> bool:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl
    from jaxccl.distributed.transport import attach
    from jaxccl.errors import ExecutorError

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    attach(t, mesh, "d")
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    if schedule == "ring":  # local ranks wait for local ranks that wait for the hung process
        from jaxccl.synth.baselines import ring_allgather

        comm.install("all_gather", ring_allgather(n))
    body = lambda v: jaxccl.all_gather(v, "d", axis=0, tiled=True)  # noqa: E731
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    raw = np.random.default_rng(5).standard_normal((n * 256, 1024)).astype(np.float32)  # 1 MiB per rank
    x = jax.make_array_from_callback(raw.shape, NamedSharding(mesh, P("d")), lambda idx: raw[idx])
    last = time.monotonic()
    try:
        with comm:
            for k in range(100_000):
                step(x).block_until_ready()
                last = time.monotonic()
                print(f"STEP {k}", flush=True)
    except ExecutorError as e:
        print(f"ERROR {type(e).__name__} after {time.monotonic() - last:.2f} s: {e}", flush=True)
        return True
    return False


def _large_steps(mesh):
    """AllToAll of 8 MiB per rank (1 MiB messages between 8 ranks) and a ring AllGather of 1 MiB per rank, jaxccl's
    and jax.lax's, on random data: the sizes whose messages from another process land in place."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxccl

    n = mesh.shape["d"]
    bodies = {
        "all_to_all": lambda lib: lambda v: lib.all_to_all(v, "d", 0, 0, tiled=True),
        "all_gather": lambda lib: lambda v: lib.all_gather(v, "d", axis=0, tiled=True),
    }
    rows = {"all_to_all": 8 << 20, "all_gather": 1 << 20}
    steps = {}
    for name, body in bodies.items():
        raw = np.random.default_rng(len(name)).standard_normal((n * rows[name] // 4096, 1024)).astype(np.float32)
        x = jax.make_array_from_callback(raw.shape, NamedSharding(mesh, P("d")), lambda idx, raw=raw: raw[idx])
        steps[name] = (
            x,
            {
                lib: jax.jit(jax.shard_map(body(lib), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
                for lib in (jaxccl, jax.lax)
            },
        )
    return steps


def in_place(t) -> bool:
    """Messages of 1 MiB from other processes land in the receiver's output, bitwise as through staging."""
    import jax
    from jax.sharding import Mesh

    import jaxccl
    from jaxccl.distributed.transport import attach, local_shards
    from jaxccl.runtime import native
    from jaxccl.synth.baselines import ring_allgather

    mesh = Mesh(np.array(jax.devices()), ("d",))
    attach(t, mesh, "d")
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    comm.install("all_gather", ring_allgather(mesh.shape["d"]))
    ok = True
    with comm:
        for name, (x, fns) in _large_steps(mesh).items():
            before = native.stats()["in_place_receives"]
            for _ in range(2):
                got, want = fns[jaxccl](x), fns[jax.lax](x)
                same = all(a.tobytes() == b.tobytes() for a, b in zip(local_shards(got), local_shards(want)))
                ok &= same
            landed = native.stats()["in_place_receives"] - before
            ok &= landed > 0
            print(f"CHECK in place {name} {'ok' if same and landed > 0 else 'MISMATCH'} ({landed} landed)", flush=True)
    comm.close()
    return ok


def hang_in_place(t) -> bool:
    """AllToAll steps whose messages land in place until one fails (the test stops the last process mid-run and
    resumes it after the others failed); process 0 then checks that nothing wrote into freed outputs: canaries
    of the outputs' size stay intact while the resumed process sends what it had left."""
    import jax
    from jax.sharding import Mesh

    import jaxccl
    from jaxccl.distributed.transport import attach
    from jaxccl.errors import ExecutorError
    from jaxccl.runtime import native

    mesh = Mesh(np.array(jax.devices()), ("d",))
    attach(t, mesh, "d")
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    x, fns = _large_steps(mesh)["all_to_all"]
    last = time.monotonic()
    try:
        with comm:
            for k in range(100_000):
                fns[jaxccl](x).block_until_ready()
                last = time.monotonic()
                print(f"STEP {k}", flush=True)
    except ExecutorError as e:
        print(f"ERROR {type(e).__name__} after {time.monotonic() - last:.2f} s: {e}", flush=True)
    if t.process_id != 0:
        return True
    pattern = np.uint32(0xA5C3E1F7)
    canaries = [np.full((8 << 20) // 4, pattern, np.uint32) for _ in range(4 * mesh.shape["d"])]
    time.sleep(float(os.environ.get("JAXCCL_TEST_RESUME_WAIT_S", "8")))  # the test resumes the stopped process
    intact = all(bool(np.all(c == pattern)) for c in canaries)
    stats = native.stats()
    print(
        f"CANARY {'ok' if intact else 'CORRUPTED'} landed {stats['in_place_receives']} "
        f"disconnects {stats['in_place_disconnects']}",
        flush=True,
    )
    return intact


def run_part(t, part: str) -> bool:
    """One part of a ``parts`` job: ``MODE`` or ``MODE:ARG``."""
    mode, _, arg = part.partition(":")
    if mode == "exchange":
        return exchange(t)
    if mode == "collectives":
        return collectives(t, arg or "cpu")
    if mode == "mesh":
        return mesh_axes(t)
    if mode == "layouts":
        return layouts(t)
    if mode == "sums":
        return sums(t, *arg.split(":", 1))
    if mode == "swap":
        return swap(t, int(arg))
    if mode == "inplace":
        return in_place(t)
    raise SystemExit(f"unknown part {part!r}")


def main(argv: list[str]) -> int:
    from jaxccl.distributed.launch import initialize_from_env
    from jaxccl.distributed.transport import ProcessTransport

    mode = argv[0]
    with_devices = (
        "collectives",
        "mesh",
        "layouts",
        "sums",
        "swap",
        "killnative",
        "hanginplace",
        "meter",
        "stale",
        "parts",
    )
    initialize_from_env(local_devices=int(argv[1]) if mode in with_devices else 1)
    t = ProcessTransport.bootstrap(timeout_s=TIMEOUT_S, options=transport_options())
    if mode == "exchange":
        ok = exchange(t)
    elif mode == "stream":
        ok = stream(t, int(argv[1]), int(argv[2]))
    elif mode == "kill":
        ok = kill(t, streaming=argv[1] if len(argv) > 1 else "")
    elif mode == "collectives":
        ok = collectives(t)
    elif mode == "mesh":
        ok = mesh_axes(t)
    elif mode == "layouts":
        ok = layouts(t)
    elif mode == "sums":
        ok = sums(t, *argv[2:4])
    elif mode == "meter":
        ok = meter(t, int(argv[2]))
    elif mode == "killnative":
        ok = kill_native(t, *argv[2:3])
    elif mode == "hanginplace":
        ok = hang_in_place(t)
    elif mode == "swap":
        ok = swap(t, int(argv[2]))
    elif mode == "stale":
        ok = stale(t)
    elif mode == "parts":
        ok = True
        for part in argv[2].split("+"):
            print(f"PART {part}", flush=True)
            ok &= run_part(t, part)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("ALL OK" if ok else "FAILED", flush=True)
    if mode in ("kill", "killnative", "hanginplace"):
        os._exit(0 if ok else 1)  # the peer is dead: jax.distributed's shutdown barrier would wait for it
    t.close()
    import jax

    jax.distributed.shutdown()  # a barrier: the coordinator (process 0) leaves last
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
