"""GPU check of the executor core: every rank of a table on one GPU, against the CPU core and jax.lax.

The CUDA module's test entry (``jaxccl._native_cuda.test_run``) runs all N ranks'
programs in one kernel on one GPU (grid y = rank), through the same core the CPU
executor runs (xla_ffi/core). JAX runs on CPU here (``JAX_PLATFORMS=cpu``, 8
emulated devices) for the references.

1. correctness: schedules that together use every op kind (s, r, rcs, rrc, rrs,
   rrcs, cpy, re, nop), every collective, copies of 1/2/4/8-byte dtypes and sums
   of f32/bf16/f16/s32; the GPU result is compared bitwise with the CPU executor's
   on the same table and, for rank-ordered reductions and all copies, with
   ``jax.lax`` (random inputs, never all zero); a synthesized AllGather runs in
   tiles and an MSCCL XML import runs as is;
2. hot-swap: a staged table becomes current exactly at the sequence number the
   registry agreed on (the launch acquires the table for the largest sequence
   number its ranks issued, as the FFI handler does);
3. meter: a measured AllGather on two pretend hosts yields intra- and inter-node
   windows with finite positive bandwidths;
4. timing: a 16 MiB-per-rank synthesized AllGather on the GPU against the CPU
   executor on the same table (the GPU must be faster); algbw printed.

Without a CUDA device (or without a CUDA module: jaxccl's own or the cuda12 plugin's) it prints
``skipped: ...`` and exits 0.
Exit status 1 means a check failed. Runs in about a minute; the budget is 8.

Usage:
    PYTHONPATH=. python tests/gpu/check_core.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time
from typing import Any

import numpy as np

N = 8
TESTS = pathlib.Path(__file__).resolve().parents[1] / "executor"  # test_native_executor.py
SUM_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int32": 3}
KIND_NAMES = dict(enumerate(("s", "r", "rcs", "rrc", "rrs", "rrcs", "cpy", "re", "nop")))  # table op codes


def _setup() -> tuple[Any, str | None]:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jaxccl

    jaxccl.emulate(N)
    from jaxccl.runtime import native

    cu = native._cuda_module()  # jaxccl's own build or the cuda12 plugin's, attached to the registry
    if cu is None:
        return None, f"no CUDA module: {native.cuda_status()[1]}"
    if cu.device_count() == 0:
        return None, "no CUDA device"
    if not hasattr(cu, "test_run"):
        return None, "jaxccl._native_cuda predates the test entry (rebuild it)"
    return cu, None


def _gpu(cu: Any, schedule: Any, x: np.ndarray, *, measure: bool = False, hosts: list[int] | None = None) -> dict:
    from jaxccl.runtime import native
    from jaxccl.schedule.table import compile_table

    slot = native.new_slot()
    try:
        native.install(slot, compile_table(schedule))
        return _run_slot(cu, slot, schedule, x, measure=measure, hosts=hosts)
    finally:
        native.remove(slot)


def _run_slot(cu: Any, slot: int, schedule: Any, x: np.ndarray, *, measure: bool = False, hosts=None) -> dict:
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)

    reduces = schedule.collective.value in ("reduce_scatter", "all_reduce")
    sum_code = SUM_CODES[x.dtype.name] if reduces else -1
    res = cu.test_run(slot, x.tobytes(), N, x.dtype.itemsize, sum_code, 0, measure, hosts or [])
    res["array"] = np.frombuffer(res["outputs"], x.dtype).copy()
    return res


def _random(elems: int, dtype: Any, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-(2**20), 2**20, size=elems).astype(dtype)
    return rng.standard_normal(elems).astype(dtype)


def _cases() -> list[tuple[str, Any, list[Any], Any]]:
    """(name, schedule, dtypes, jax.lax body or None for orders jax.lax does not use)."""
    import ml_dtypes
    import test_native_executor as t
    from jax import lax

    import jaxccl
    from jaxccl.runtime.default_schedules import direct_allgather, direct_allreduce
    from jaxccl.schedule import from_msccl_xml
    from jaxccl.synth import baselines
    from jaxccl.topology import rail

    ax = t.AXIS
    ag = lambda v: lax.all_gather(v, ax, tiled=True)  # noqa: E731
    a2a = lambda v: lax.all_to_all(v, ax, 0, 0, tiled=True)  # noqa: E731
    rs = lambda v: lax.psum_scatter(v, ax, scatter_dimension=0, tiled=True)  # noqa: E731
    ar = lambda v: lax.psum(v, ax)  # noqa: E731
    copies = [np.float32, np.int8, ml_dtypes.bfloat16, np.float64]
    sums = [np.float32, ml_dtypes.bfloat16, np.float16, np.int32]
    ring = baselines.ring_allgather(N, channels=2)
    return [
        ("direct_allgather", direct_allgather(N), copies, ag),
        ("ring_allgather (rcs)", ring, [np.float32], ag),
        ("relay_all_gather (staged relays)", t.relay_all_gather(N, 2), [np.float32], ag),
        ("msccl xml import", from_msccl_xml(ring.to_msccl_xml()), [np.float32], ag),
        (
            "synthesized allgather rail 2x4 (tiles)",
            jaxccl.synth.all_gather(rail(hosts=2, gpus_per_host=4)),
            [np.float32],
            ag,
        ),
        ("direct_alltoall", baselines.direct_alltoall(N), copies, a2a),
        ("forwarding_all_to_all (scratch relay)", t.forwarding_all_to_all(N, 2), [np.float32], a2a),
        ("direct_reduce_scatter (r, rrc, re)", baselines.direct_reduce_scatter(N), sums, rs),
        ("ordered_reduce_scatter (rrc chain)", t.ordered_reduce_scatter(N), [np.float32, np.float16], rs),
        ("ring_reduce_scatter (rrs)", t.ring_reduce_scatter(N), [np.float32, ml_dtypes.bfloat16], None),
        ("chain_all_reduce (rrs, rrcs, rcs)", t.chain_all_reduce(N), sums, ar),
        ("gather_reduce_all_reduce (cpy, re, nop)", t.gather_reduce_all_reduce(N), [np.float32], ar),
        ("direct_allreduce", direct_allreduce(N), sums, ar),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--elems", type=int, default=N * 4099, help="elements of one rank's input (correctness)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(TESTS))
    t0 = time.perf_counter()
    cu, why = _setup()
    if cu is None:
        print(f"skipped: {why}")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps({"skipped": True, "reason": why}))
        return 0
    import test_native_executor as t

    from jaxccl.runtime import native
    from jaxccl.schedule.table import compile_table
    from jaxccl.schedule.table import decode as decode_table

    checks: list[dict] = []

    def check(name: str, ok: bool, **detail: Any) -> None:
        checks.append({"check": name, "ok": bool(ok), **detail})
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail if detail else ''}")

    # 1. correctness against the CPU core and jax.lax
    kinds: set[str] = set()
    for k, (name, s, dtypes, body) in enumerate(_cases()):
        s.validate(ordered_reduction=bool(s.info.get("ordered_reduction")))
        kinds |= {KIND_NAMES[op["kind"]] for op in decode_table(compile_table(s))["ops"]}  # nops come from tables
        for dtype in dtypes:
            x = _random(N * args.elems, dtype, seed=k)
            try:
                gpu = _gpu(cu, s, x)
            except RuntimeError as e:
                check(f"{name} {np.dtype(dtype).name}", False, error=str(e))
                continue
            cpu = t.run(s, x)
            same_cpu = np.array_equal(gpu["array"].view(np.uint8), cpu.reshape(-1).view(np.uint8))
            detail = {"tiles": gpu["tiles"], "kernel_ms": round(gpu["kernel_ms"], 3)}
            if body is not None:
                ref = t.lax_ref(body, N, x).reshape(-1)
                detail["bitwise_vs_lax"] = bool(np.array_equal(gpu["array"].view(np.uint8), ref.view(np.uint8)))
            ok = same_cpu and detail.get("bitwise_vs_lax", True)
            check(f"{name} {np.dtype(dtype).name}", ok, bitwise_vs_cpu=same_cpu, **detail)
    want = set(KIND_NAMES.values())
    check("every op kind ran", want <= kinds, missing=sorted(want - kinds))

    # 2. hot-swap at the agreed sequence number
    from jaxccl.runtime.default_schedules import direct_allgather
    from jaxccl.synth import baselines

    a, b = direct_allgather(N), baselines.ring_allgather(N)
    x = _random(N * 1024, np.float32, seed=99)
    want_out = t.lax_ref(lambda v: __import__("jax").lax.all_gather(v, t.AXIS, tiled=True), N, x).reshape(-1)
    slot = native.new_slot()
    try:
        v_a = native.install(slot, compile_table(a))
        _run_slot(cu, slot, a, x)
        v_b = native.stage(slot, compile_table(b))
        state = native.swap_state(slot)
        seen = []
        for _ in range(4):
            res = _run_slot(cu, slot, a, x)
            seen.append((res["seq"], res["version"], bool(np.array_equal(res["array"], want_out))))
        transition = state["transition_seq"]
        ok = all(v == (v_a if q <= transition else v_b) and good for q, v, good in seen) and seen[-1][1] == v_b
        check("hot-swap at the agreed sequence number", ok, transition_seq=transition, calls=seen)
    finally:
        native.remove(slot)

    # 3. the meter
    import jaxccl
    from jaxccl.telemetry.records import INTER, INTRA, decode
    from jaxccl.topology import rail

    s = jaxccl.synth.all_gather(rail(hosts=2, gpus_per_host=4))
    res = _gpu(cu, s, _random(N * (1 << 18), np.float32, seed=5), measure=True, hosts=[0] * 4 + [1] * 4)
    recs = decode(res["records"])
    kinds_seen = {int(k) for k in recs["kind"]} if len(recs) else set()
    bws = recs["sum_bw"] / np.maximum(recs["count"], 1) if len(recs) else np.array([])
    check(
        "meter: intra- and inter-node windows, finite positive bandwidths",
        {INTRA, INTER} <= kinds_seen and bool(np.all(np.isfinite(bws))) and bool(np.all(bws > 0)),
        records=len(recs),
        median_GBps=float(np.median(bws) / 1e9) if len(bws) else math.nan,
    )

    # 4. timing: GPU core vs CPU core on the same table
    x = _random(N * (4 << 20), np.float32, seed=7)  # 16 MiB per rank
    gpu = [_gpu(cu, s, x)["kernel_ms"] for _ in range(3)]
    cpu = []
    for _ in range(3):
        c0 = time.perf_counter()
        t.run(s, x)
        cpu.append((time.perf_counter() - c0) * 1e3)
    g_ms, c_ms = float(np.median(gpu)), float(np.median(cpu))
    out_bytes = N * x.nbytes // N
    check(
        "timing: 16 MiB per rank AllGather, GPU core faster than the CPU core",
        g_ms < c_ms,
        gpu_ms=round(g_ms, 3),
        cpu_ms=round(c_ms, 3),
        gpu_algbw_GBps=round(out_bytes / (g_ms * 1e-3) / 1e9, 2),
    )

    all_ok = all(c["ok"] for c in checks)
    print(f"\n{'all checks passed' if all_ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s")
    if args.json:
        result = {"skipped": False, "all_ok": all_ok, "checks": checks}
        pathlib.Path(args.json).write_text(json.dumps(result, default=str))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
