"""One process of the multi-process GPU check (tests/gpu/run_all.py starts it through tests/gpu/mp_job.py).

Every process holds one device (``--platform cuda``: the GPU that ``CUDA_VISIBLE_DEVICES`` leaves it,
the same one for every process; ``--platform cpu``: one CPU device), the mesh is one axis ``"d"``
over every process's device, and the UCX transport is attached to it. The communicator is
``Communicator(mesh, "d", backend=<cuda|cpu>, topology=rail(hosts=P, gpus_per_host=1))``. Parts
(``--parts``, in this order; each prints one ``RESULT {json}`` line per result):

- ``cases``: the four collectives (and a ring AllGather installed on a second communicator) on
  random non-zero data of several dtypes and sizes; each result is compared bitwise with a NumPy
  model of the collective (reductions: a left fold in ascending rank order, jaxccl's order) and
  reported with a SHA-256 of this process's shards, which run_all.py compares between a cuda job
  and a cpu job of the same processes: the CUDA executor against the CPU executor on the same tables.
- ``swap``: AllGather steps; at one step a ring schedule is staged at an agreed call
  (``stage_agreed``); per step the table version the launch ran, its time and the model check.
- ``meter``: AllGather steps of 1 MiB per rank, then ``Communicator.measurement()`` (where it
  exists) and the transport's measured rates of this process's ranks to the others.
- ``overhead``: the same steps with the kernel's measurement on and off, interleaved (cuda only).
- ``timing``: a 16 MiB per rank AllGather, the median of ``--runs`` timed calls.
- ``lax``: the same inputs through ``jax.lax`` (NCCL on GPUs, gloo on CPUs) compared with the
  jaxccl results kept from ``cases``, and the 16 MiB ``jax.lax`` AllGather timed. Last, under a
  watchdog: NCCL may refuse (or hang on) two processes on one GPU; then the record says so and
  the model comparison of ``cases`` stands alone.

A part that raises prints ``RESULT {"kind": "error", "part": ...}`` and the next part runs (the
processes meet at a barrier after every part); an error in the setup ends the process. The last line
of a process that finished is ``RESULT {"kind": "done", "ok": ...}``.

Usage (in every process of a job started by ``jaxccl.distributed.launch``):
    python tests/gpu/mp_worker.py --platform cuda --parts cases,swap,meter,overhead,timing,lax
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

PARTS = ("cases", "swap", "meter", "overhead", "timing", "lax")
TIMEOUT_S = 60.0
LAX_WATCHDOG_S = 60.0  # NCCL with two ranks on one GPU may hang instead of refusing
EXIT_WATCHDOG_S = 30.0  # jax.distributed.shutdown() waits for every process
BARRIER_S = 150.0  # after a part: longer than the executor's deadline (JAXCCL_TIMEOUT_S: 30 or 60 s in run_all.py)
SWAP_STEPS, SWAP_AT = 11, 3
METER_STEPS = 8
OVERHEAD_PAIRS, WARMUP = 15, 3
BIG_BYTES = 16 << 20
COPY_DTYPES = ("float32", "bfloat16", "int8")
SUM_DTYPES = ("float32", "bfloat16", "int32")
COLLECTIVES = ("all_gather", "all_to_all", "psum_scatter", "psum")
REDUCING = ("psum_scatter", "psum")
_print_lock = threading.Lock()


def jsonable(x: Any) -> Any:
    """What ``json`` cannot write itself, as plain values (arrays as lists, anything else as its text).

    >>> json.dumps({"a": np.arange(2), "b": np.float32(0.5), "c": range(2)}, default=jsonable)
    '{"a": [0, 1], "b": 0.5, "c": "range(0, 2)"}'
    """
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return str(x)


def emit(kind: str, **fields: Any) -> None:
    """Prints one ``RESULT {json}`` line (what run_all.py reads)."""
    line = "RESULT " + json.dumps({"kind": kind, **fields}, default=jsonable)
    with _print_lock:
        print(line, flush=True)


def np_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def random_nonzero(shape: tuple[int, int], dtype_name: str, seed: int) -> np.ndarray:
    """Random data with no zero element, the same in every process for a seed.

    >>> x = random_nonzero((4, 5), "int8", 1)
    >>> x.dtype.name, bool((x != 0).all())
    ('int8', True)
    """
    rng = np.random.default_rng(seed)
    dtype = np_dtype(dtype_name)
    if np.issubdtype(dtype, np.integer):
        high = 100 if dtype.itemsize == 1 else 2**20  # int8 copies; int32 sums of up to 8 ranks stay exact
        values = rng.integers(1, high, size=shape) * rng.choice([-1, 1], size=shape)
    else:
        values = rng.standard_normal(shape)
        values[values == 0] = 1.0
    out = values.astype(dtype)
    out[out == 0] = 1  # a float too small for float16/bfloat16
    return out


def ordered_sum(blocks: np.ndarray) -> np.ndarray:
    """jaxccl's sum of ``blocks[0], blocks[1], ...`` in rank order, in the dtype the collective reduces in.

    The reference rule of :mod:`jaxccl.schedule.reduction` (bfloat16 is summed in float32, rounded once):

    >>> import ml_dtypes
    >>> terms = np.array([[1.0], [2.0**-8], [2.0**-8]], ml_dtypes.bfloat16)
    >>> ordered_sum(terms).astype(np.float32).tolist()  # bfloat16 steps would round 1 + 2**-8 back to 1
    [1.0078125]
    """
    from jaxccl.schedule.reduction import ReduceOp, reduce_terms, wire_dtype

    wide = wire_dtype(ReduceOp.SUM, blocks.dtype)
    return reduce_terms(ReduceOp.SUM, blocks.astype(wide)).astype(blocks.dtype)


def model(name: str, raw: np.ndarray, n: int) -> np.ndarray:
    """The global output (``out_specs=P("d")``) of collective ``name`` over ``n`` ranks of ``raw``'s row blocks.

    >>> raw = np.arange(8, dtype=np.int32).reshape(4, 2)  # 2 ranks, 2 rows each
    >>> model("all_to_all", raw, 2)[:, 0].tolist(), model("psum", raw, 2)[:2].tolist()
    ([0, 4, 2, 6], [[4, 6], [8, 10]])
    """
    blocks = raw.reshape(n, raw.shape[0] // n, *raw.shape[1:])  # [rank, rows, cols]
    q = blocks.shape[1] // n
    if name == "all_gather":
        return np.concatenate([raw] * n)
    if name == "all_to_all":
        return np.concatenate([blocks[j, r * q : (r + 1) * q] for r in range(n) for j in range(n)])
    if name == "psum_scatter":
        return np.concatenate([ordered_sum(blocks[:, r * q : (r + 1) * q]) for r in range(n)])
    if name == "psum":
        return np.concatenate([ordered_sum(blocks)] * n)
    raise SystemExit(f"unknown collective {name!r}")


def body(lib: Any, name: str) -> Callable:
    """``name`` of ``lib`` (jaxccl or jax.lax) on one rank's block, over axis ``"d"``, along dimension 0."""
    if name == "all_gather":
        return lambda v: lib.all_gather(v, "d", axis=0, tiled=True)
    if name == "all_to_all":
        return lambda v: lib.all_to_all(v, "d", 0, 0, tiled=True)
    if name == "psum_scatter":
        return lambda v: lib.psum_scatter(v, "d", scatter_dimension=0, tiled=True)
    return lambda v: lib.psum(v, "d")


@dataclass
class Case:
    """One collective call: what it runs, on which data, and through which communicator."""

    name: str
    collective: str
    dtype: str
    rows: int  # per rank (a multiple of the number of ranks)
    cols: int
    seed: int
    ring: bool = False  # run with the communicator whose AllGather is a ring

    def raw(self, n: int) -> np.ndarray:
        return random_nonzero((n * self.rows, self.cols), self.dtype, self.seed)


def cases(n: int) -> list[Case]:
    """The collectives compared: small inputs of every dtype, a larger one of each collective, a ring AllGather."""
    out: list[Case] = []
    small, medium = (2 * n, 129), (16 * n, 4096)
    for coll in COLLECTIVES:
        for dtype in SUM_DTYPES if coll in REDUCING else COPY_DTYPES:
            out.append(Case("", coll, dtype, *small, seed=len(out)))
        out.append(Case("", coll, "float32", *medium, seed=len(out)))
    out.append(Case("", "psum", "float16", *small, seed=len(out)))
    out.append(Case("", "all_gather", "float32", *medium, seed=len(out), ring=True))
    for c in out:
        c.name = f"{'ring ' if c.ring else ''}{c.collective} {c.dtype} {n * c.rows}x{c.cols}"
    return out


def digest(shards: list[np.ndarray]) -> str:
    """SHA-256 of this process's shards (dtype, shape and bytes, in device-id order).

    >>> digest([np.zeros(2, np.int32)]) == digest([np.zeros(2, np.int32)]) != digest([np.zeros(2, np.int8)])
    True
    """
    h = hashlib.sha256()
    for s in shards:
        h.update(f"{s.dtype.name}{s.shape}".encode())
        h.update(np.ascontiguousarray(s).tobytes())
    return h.hexdigest()


def median_ms(seconds: list[float]) -> float:
    return float(np.median(seconds)) * 1e3


class Job:
    """This process's view of the job: mesh, transport, communicators and the results kept for ``lax``."""

    def __init__(self, platform: str, runs: int):
        import jax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        import jaxccl
        from jaxccl.distributed.launch import initialize_from_env
        from jaxccl.distributed.transport import ProcessTransport, attach

        initialize_from_env(local_devices=1 if platform == "cpu" else None)
        self.jax, self.jaxccl, self.P = jax, jaxccl, P
        self.platform, self.runs = platform, runs
        self.backend = "cuda" if platform == "cuda" else "cpu"
        self.transport = ProcessTransport.bootstrap(timeout_s=TIMEOUT_S)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        self.n, self.me = len(devices), jax.process_index()
        self.mesh = Mesh(np.array(devices), ("d",))
        self.sharding = NamedSharding(self.mesh, P("d"))
        self.mine = [r for r, d in enumerate(devices) if d.process_index == self.me]
        attach(self.transport, self.mesh, "d")
        self.topology = jaxccl.topology.rail(hosts=jax.process_count(), gpus_per_host=len(self.mine))
        self.comm = self.communicator()
        self.kept: dict[str, list[bytes]] = {}  # case -> this process's jaxccl shards, for the lax part
        self.big_ms: float | None = None
        emit(
            "info",
            process=self.me,
            processes=jax.process_count(),
            ranks=self.n,
            my_ranks=self.mine,
            platform=platform,
            backend=self.backend,
            devices=[str(d) for d in devices],
            device_kind=devices[self.mine[0]].device_kind,
            jax=jax.__version__,
            ucx_tls=os.environ.get("UCX_TLS", ""),
        )

    def communicator(self) -> Any:
        return self.jaxccl.Communicator(self.mesh, "d", backend=self.backend, topology=self.topology)

    def array(self, raw: np.ndarray) -> Any:
        return self.jax.make_array_from_callback(raw.shape, self.sharding, lambda idx: raw[idx])

    def jitted(self, lib: Any, name: str) -> Callable:
        jax, P = self.jax, self.P
        return jax.jit(jax.shard_map(body(lib, name), mesh=self.mesh, in_specs=P("d"), out_specs=P("d")))

    def call(self, comm: Any, fn: Callable, x: Any) -> Any:
        with comm:
            return fn(x).block_until_ready()

    @staticmethod
    def matches(out: Any, want: np.ndarray) -> bool:
        """Every shard of this process bitwise equal to its block of the global ``want``."""
        return out.shape == want.shape and all(
            np.asarray(s.data).tobytes() == want[s.index].tobytes() for s in out.addressable_shards
        )

    def local(self, out: Any) -> list[np.ndarray]:
        from jaxccl.distributed.transport import local_shards

        return local_shards(out)

    # ------------------------------------------------------------------ parts
    def cases(self) -> bool:
        ring = self.communicator()
        ring.install("all_gather", self.jaxccl.synth.ring_allgather(self.topology))
        ok = True
        for case in cases(self.n):
            raw = case.raw(self.n)
            out = self.call(
                ring if case.ring else self.comm, self.jitted(self.jaxccl, case.collective), self.array(raw)
            )
            shards = self.local(out)
            good = self.matches(out, model(case.collective, raw, self.n))
            ok &= good
            self.kept[case.name] = [s.tobytes() for s in shards]
            emit("case", name=case.name, model=good, digest=digest(shards), bytes_per_rank=raw.nbytes // self.n)
        ring.close()
        return ok

    def swap(self) -> bool:
        from jaxccl.distributed.transport import stage_agreed
        from jaxccl.runtime import native

        comm = self.communicator()
        slot = comm.slot("all_gather")
        fn = self.jitted(self.jaxccl, "all_gather")
        staged = transition = -1
        stage_ms = 0.0
        steps = []
        for k in range(SWAP_STEPS):
            raw = random_nonzero((self.n * 64, 1024), "float32", 1000 + k)
            x = self.array(raw)
            if k == SWAP_AT:
                t0 = time.perf_counter()
                staged, transition = stage_agreed(
                    comm, "all_gather", self.jaxccl.synth.ring_allgather(self.topology), round_id="gpu-check-swap"
                )
                stage_ms = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            out = self.call(comm, fn, x)
            ms = (time.perf_counter() - t0) * 1e3
            steps.append([k, native.last_launch_version(slot), self.matches(out, model("all_gather", raw, self.n)), ms])
        state = comm.swap_state("all_gather")
        comm.close()
        emit("swap", version=staged, transition=transition, stage_ms=stage_ms, steps=steps, state=state)
        return all(s[2] for s in steps)

    def _meter_input(self) -> tuple[np.ndarray, Any]:
        raw = random_nonzero((self.n * 256, 1024), "float32", 77)  # 1 MiB per rank
        return raw, self.array(raw)

    def _measurement(self) -> tuple[dict[str, Any] | None, str | None]:
        """``Communicator.measurement()`` as a dict, or why there is none (no such API yet, or it raised)."""
        measure = getattr(self.comm, "measurement", None)
        if measure is None:
            return None, "no measurement API"
        try:
            return plain(measure()), None
        except Exception as e:  # reported: a backend may have nothing to measure (cpu without link emulation)
            return None, f"{type(e).__name__}: {e}"

    def meter(self) -> bool:
        from jaxccl.distributed.transport import TransportMeter

        raw, x = self._meter_input()
        want = model("all_gather", raw, self.n)
        fn = self.jitted(self.jaxccl, "all_gather")
        before, _ = self._measurement()  # measurement() counts since its previous call
        m = TransportMeter(self.n)
        m.drain()
        ok = True
        for _ in range(METER_STEPS):
            ok &= self.matches(self.call(self.comm, fn, x), want)
        after, error = self._measurement()
        rates = m.rates()
        pairs = [[s, d, float(rates[s, d])] for s in self.mine for d in range(self.n) if d not in self.mine]
        emit(
            "meter",
            measurement_api=hasattr(self.comm, "measurement"),
            measurement_before=before,
            measurement=after,
            measurement_error=error,
            rates=pairs,
            transport_dropped=m.dropped,
            bitwise=ok,
        )
        return ok

    def overhead(self) -> bool:
        if self.backend != "cuda":
            emit("overhead", skipped=f"backend {self.backend} has no kernel measurement to switch")
            return True
        from jaxccl.distributed.transport import TransportMeter
        from jaxccl.runtime import native

        hosts = [self.topology.host_of(r) for r in range(self.n)]
        raw, x = self._meter_input()
        want = model("all_gather", raw, self.n)
        fn = self.jitted(self.jaxccl, "all_gather")
        m = TransportMeter(self.n)
        times: dict[bool, list[float]] = {False: [], True: []}
        ok = True
        try:
            for k in range(WARMUP + OVERHEAD_PAIRS):
                for on in (False, True):
                    native.configure_cuda_measurement(hosts, enabled=on)
                    t0 = time.perf_counter()
                    out = self.call(self.comm, fn, x)
                    if k >= WARMUP:
                        times[on].append(time.perf_counter() - t0)
                    ok &= self.matches(out, want)
                native.drain_cuda_measurement()  # outside the timed calls, so the buffer never fills
                m.drain()
        finally:
            native.configure_cuda_measurement(hosts, enabled=True)
        on_ms, off_ms = median_ms(times[True]), median_ms(times[False])
        emit("overhead", on_ms=on_ms, off_ms=off_ms, ratio=on_ms / off_ms, pairs=OVERHEAD_PAIRS, bitwise=ok)
        return ok

    def _big_input(self) -> tuple[np.ndarray, Any]:
        raw = random_nonzero((self.n * (BIG_BYTES // 4 // 1024), 1024), "float32", 16)
        return raw, self.array(raw)

    def _time(self, comm: Any, fn: Callable, x: Any) -> tuple[float, Any]:
        out = None
        for _ in range(2):
            out = self.call(comm, fn, x)
        seconds = []
        for _ in range(self.runs):
            t0 = time.perf_counter()
            self.call(comm, fn, x)
            seconds.append(time.perf_counter() - t0)
        return median_ms(seconds), out

    def timing(self) -> bool:
        raw, x = self._big_input()
        ms, out = self._time(self.comm, self.jitted(self.jaxccl, "all_gather"), x)
        good = self.matches(out, model("all_gather", raw, self.n))
        self.big_ms = ms
        emit("timing", bytes_per_rank=BIG_BYTES, runs=self.runs, jaxccl_ms=ms, bitwise=good)
        return good

    def lax(self) -> bool:
        """jax.lax on the inputs of ``cases`` (and ``timing``), under a watchdog; never fails the job."""

        def fire() -> None:
            emit("lax", status="timeout", error=f"jax.lax did not finish within {LAX_WATCHDOG_S:.0f} s")
            os._exit(3)

        dog = threading.Timer(LAX_WATCHDOG_S, fire)
        dog.daemon = True
        dog.start()
        results: dict[str, str] = {}
        lax_ms = None
        nullcomm = _NoComm()
        try:
            for case in cases(self.n):
                if case.name not in self.kept:
                    continue
                out = self.call(nullcomm, self.jitted(self.jax.lax, case.collective), self.array(case.raw(self.n)))
                same = [s.tobytes() for s in self.local(out)] == self.kept[case.name]
                # jax.lax float sums need not follow jaxccl's rank order (NCCL rings, gloo): reported, not required
                exact = case.collective not in REDUCING or np.issubdtype(np_dtype(case.dtype), np.integer)
                results[case.name] = "ok" if same else ("MISMATCH" if exact else "differs")
            if self.big_ms is not None:
                _, x = self._big_input()
                lax_ms, _ = self._time(nullcomm, self.jitted(self.jax.lax, "all_gather"), x)
        except Exception as e:  # NCCL refusing two ranks on one GPU lands here
            dog.cancel()
            emit("lax", status="refused", error=f"{type(e).__name__}: {str(e)[:500]}", cases=results)
            return True
        dog.cancel()
        emit("lax", status="ok", cases=results, lax_ms=lax_ms)
        return True


class _NoComm:
    """A context manager that does nothing (jax.lax needs no communicator)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def plain(stats: Any) -> dict[str, Any]:
    """``Communicator.measurement()``'s result as a dict of plain values (a dataclass, a mapping or an object).

    >>> plain({"windows": np.int64(3)})
    {'windows': 3}
    """
    import dataclasses

    if dataclasses.is_dataclass(stats):
        stats = dataclasses.asdict(stats)
    elif not isinstance(stats, dict):
        stats = {k: v for k, v in vars(stats).items() if not k.startswith("_")}
    return {str(k): v.item() if isinstance(v, np.generic) else v for k, v in stats.items()}


def report_error(part: str, e: BaseException) -> None:
    emit("error", part=part, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])


def barrier(part: str) -> None:
    """Every process waits here for the others after ``part``, failed or not (a failed collective fails
    everywhere, at the latest at the executor's deadline), so the next part starts in step."""
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(f"jaxccl_gpu_check_{part}", int(BARRIER_S * 1000))


def run(platform: str, parts: list[str], runs: int) -> bool:
    """Runs the parts; one that raises is reported (naming it) and the next one runs after a barrier.

    An error outside the parts (setup, a barrier, closing) ends the process at once.
    """
    part = "setup"
    try:
        job = Job(platform, runs)
        ok = True
        for part in parts:
            try:
                ok &= getattr(job, part)()
            except Exception as e:
                ok = False
                report_error(part, e)
            if part != "lax":  # lax is last: its watchdog may have ended a process
                barrier(part)
        part = "close"
        job.comm.close()
        job.transport.close()  # detaches it first
        return ok
    except Exception as e:
        report_error(part, e)
        sys.stdout.flush()
        os._exit(1)  # the other processes may be inside a collective: no shutdown barrier


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    ap.add_argument("--runs", type=int, default=10, help="timed calls of the 16 MiB AllGather")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {PARTS}")
    parts = [p for p in PARTS if p in parts]  # the documented order: lax runs last
    ok = run(args.platform, parts, args.runs)
    emit("done", ok=ok)
    dog = threading.Timer(EXIT_WATCHDOG_S, functools.partial(os._exit, 0 if ok else 1))
    dog.daemon = True
    dog.start()
    import jax

    jax.distributed.shutdown()  # a barrier: the coordinator (process 0) leaves last
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
