"""Passive measurement in the CPU executor: overhead, accuracy and memory (MCCL Fig. 9a, 9b, Table 2).

(a) Overhead: a 2-rank AllGather ring with ``channels`` rings, one message of
    ``chunk`` bytes per channel and direction (MCCL's point-to-point stress test:
    data is always ready), with link pacing off so the executor runs as fast as
    memcpy; median time per collective with measurement on vs off, interleaved
    in the same run; overhead = on / off - 1; ``aa_control_pct`` is the same
    ratio for a second, identical measurement-off communicator (an A/A test:
    what noise alone gives). ``hook_estimate_pct`` is the isolated cost:
    the nanoseconds of measurement work per message (``_bench_measurement_hooks``:
    OnPost + OnDelivered + a share of window close and flush, timed in a tight
    loop) times the messages of one collective, over its measurement-off time.
    Beside the wall time, the CPU
    time the process spent per collective (all threads): on a shared machine it
    is far less sensitive to other jobs than wall time.
(b) Accuracy: the same pattern with pacing on; measured throughput (median of
    the per-collective records) vs the configured capacity of the emulated
    link, 1-5 concurrent flows (channels), intra-node (one GPU's NVSwitch port)
    and inter-node (the NIC path between two hosts).
(c) Memory: the footprint of the three structures in the form of MCCL Table 2
    (NGPU = 128, 8 servers, 1024 threadblocks) from the structure sizes, beside
    the footprint of this run.

Usage:
    nice -n 10 python -m benchmarks.executor.measurement [--quick] [--json results.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import jaxccl
from jaxccl.util import report

CHANNELS = [1, 2, 4, 8, 16, 32]
CHUNKS = [128 << 10, 1 << 20]
FLOWS = [1, 2, 3, 4, 5]


def _setup(topo, emulation, channels):
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jaxccl.synth import baselines

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    comm = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu", link_emulation=emulation)
    comm.install("all_gather", baselines.ring_allgather(2, channels=channels))
    f = jax.jit(
        jax.shard_map(lambda x: jaxccl.all_gather(x, "d", tiled=True), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    )
    return comm, f


def _input(elems):
    import numpy as np

    return np.random.default_rng(0).standard_normal(2 * elems).astype(np.float32) + 0.5


def overhead(channels_list, chunks, runs):
    from jaxccl.runtime import native
    from jaxccl.runtime.emulated import LinkEmulation
    from jaxccl.topology import rail

    topo = rail(hosts=2, gpus_per_host=1)
    hook_ns = report.median([native.module()._bench_measurement_hooks(200_000) for _ in range(5)])
    rows = []
    for chunk in chunks:
        for ch in report.progress(channels_list, label=f"overhead {report.format_bytes(chunk)}"):
            x = _input(ch * chunk // 4)
            on, f_on = _setup(topo, LinkEmulation(pace=False, measure=True), ch)
            off, f_off = _setup(topo, LinkEmulation(pace=False, measure=False), ch)
            ctl, f_ctl = _setup(topo, LinkEmulation(pace=False, measure=False), ch)  # A/A control: the noise floor
            times = {"on": [], "off": [], "ctl": []}
            cpu = {"on": [], "off": [], "ctl": []}
            for comm, f in ((on, f_on), (off, f_off), (ctl, f_ctl)):
                with comm:
                    for _ in range(2):
                        f(x).block_until_ready()
            order = [("on", on, f_on), ("off", off, f_off), ("ctl", ctl, f_ctl)]
            for r in range(runs):
                for key, comm, f in order if r % 2 == 0 else order[::-1]:  # alternate who runs first
                    with comm:
                        c, t = time.process_time(), time.perf_counter()
                        f(x).block_until_ready()
                        times[key].append(time.perf_counter() - t)
                        cpu[key].append(time.process_time() - c)
                on.telemetry()  # drain so the buffer never fills
            t_on, t_off = report.median(times["on"]), report.median(times["off"])
            c_on, c_off = report.median(cpu["on"]), report.median(cpu["off"])
            t_ctl = report.median(times["ctl"])
            size = 2 * ch * chunk  # bytes of one rank's output
            rows.append(
                {
                    "chunk": report.format_bytes(chunk),
                    "channels": ch,
                    "time_off_ms": t_off * 1e3,
                    "time_on_ms": t_on * 1e3,
                    "algbw_off_GBs": size / t_off / 1e9,
                    "algbw_on_GBs": size / t_on / 1e9,
                    "ratio_on_off": t_on / t_off,
                    "overhead_pct": (t_on / t_off - 1) * 100,
                    "cpu_off_ms": c_off * 1e3,
                    "cpu_on_ms": c_on * 1e3,
                    "cpu_overhead_pct": (c_on / c_off - 1) * 100,
                    "aa_control_pct": (t_ctl / t_off - 1) * 100,
                    # isolated cost: hook work per message x messages per collective (2 ranks x channels), / time
                    "hook_estimate_pct": hook_ns * 1e-9 * 2 * ch / t_off * 100,
                    "windows": on.measurement().windows,
                }
            )
            for comm in (on, off, ctl):
                comm.network.close()
    return rows


def accuracy(flows, runs, chunk_bytes):
    import numpy as np

    from jaxccl.runtime.emulated import LinkEmulation
    from jaxccl.topology import rail, single_node

    cases = [
        (f"{kind}/{stamps}", topo, LinkEmulation(time_scale=scale, timestamps=stamps), entry)
        for stamps in ("link", "observed")
        for kind, topo, scale, entry in (
            ("intra", single_node(2), 5e-5, (0, 0)),
            ("inter", rail(hosts=2, gpus_per_host=1), 4e-4, (0, 1)),
        )
    ]
    rows = []
    for kind, topo, emu, (i, j) in cases:
        link = topo.path(0, 1)[0]
        capacity = topo.capacity(*link)
        for k in report.progress(flows, label=f"accuracy {kind}"):
            comm, f = _setup(topo, emu, k)
            x = _input(chunk_bytes // 4)
            samples = []
            with comm:
                f(x).block_until_ready()
                comm.telemetry()
                for _ in range(runs):
                    f(x).block_until_ready()
                    t = comm.telemetry()
                    if not np.isnan(t.last[i, j]):
                        samples.append(float(t.last[i, j]))
            measured = report.median(samples)
            rows.append(
                {
                    "kind": kind,
                    "flows": k,
                    "configured_Gbps": capacity * 8 / 1e9,
                    "measured_Gbps": measured * 8 / 1e9,
                    "error_pct": abs(measured - capacity) / capacity * 100,
                    "samples": len(samples),
                }
            )
            comm.network.close()
    return rows


def memory(run_stats):
    from jaxccl.runtime.emulated import LinkEmulation

    s_acc, s_cache, s_buf = 32, 24, 32
    ngpu, tbs = 128, 1024
    slots = LinkEmulation().slots_per_tb
    return [
        {
            "structure": "Accumulator (per GPU)",
            "formula": "S_acc x (NGPU+1)",
            "bytes": s_acc * (ngpu + 1),
            "mccl_bytes": 4 << 10,
        },
        {"structure": "Cache (per GPU)", "formula": "S_cache x TB", "bytes": s_cache * tbs, "mccl_bytes": 24 << 10},
        {
            "structure": "Buffer (per server)",
            "formula": f"S_buf x TB x slots ({slots})",
            "bytes": s_buf * tbs * slots,
            "mccl_bytes": 256 << 10,
        },
        {
            "structure": "this run: accumulators",
            "formula": "all GPUs",
            "bytes": run_stats.accumulator_bytes,
            "mccl_bytes": None,
        },
        {
            "structure": "this run: buffer",
            "formula": f"{run_stats.regions} TB regions",
            "bytes": run_stats.buffer_bytes,
            "mccl_bytes": None,
        },
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer channel counts and runs")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per point (default 15; --quick 5)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    jaxccl.emulate(2)
    runs = args.runs or (5 if args.quick else 15)
    channels = [1, 4, 16] if args.quick else CHANNELS
    chunks = [128 << 10] if args.quick else CHUNKS
    flows = [1, 3] if args.quick else FLOWS

    print("(a) measurement overhead, pacing off (MCCL Fig. 9a)")
    over = overhead(channels, chunks, runs)
    report.print_table(over)
    print("\n(b) measurement accuracy, pacing on (MCCL Fig. 9b; goal < 1.2 %, stretch < 0.5 %)")
    acc = accuracy(flows, max(3, runs // 3), 2 << 20)
    report.print_table(acc)
    from jaxccl.runtime.emulated import LinkEmulation
    from jaxccl.topology import rail

    comm, f = _setup(rail(hosts=2, gpus_per_host=1), LinkEmulation(time_scale=1e-2), 8)
    with comm:
        f(_input(1 << 16)).block_until_ready()
    print("\n(c) memory footprint (MCCL Table 2: NGPU=128, SRV=8, TB=1024)")
    mem = memory(comm.measurement())
    report.print_table(mem)
    big = [r for r in over if r["channels"] >= 16]
    print(
        f"\nsummary: max accuracy error {max(r['error_pct'] for r in acc):.3f} %; "
        f"max overhead at >= 16 channels {max((r['overhead_pct'] for r in big), default=float('nan')):.2f} %"
    )
    if args.json:
        report.write_json(args.json, {"overhead": over, "accuracy": acc, "memory": mem, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
