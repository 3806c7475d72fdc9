"""One message between two processes over TCP: in pieces (what jaxccl's transport sends) vs whole.

Two processes on this machine connect two transports each over ``tcp/lo`` (``NETWORK_ONLY``): one
as jaxccl opens it, whose messages travel in pieces of one eager fragment each (about 127 KiB)
(docs/guides/multiprocess.md, "Over TCP a message travels in pieces"), and one with
``RNDV_THRESH=auto`` (UCX's default value, which keeps every message whole: a rendezvous from
256 KiB). For each size process 1 times ``--runs`` receives of each variant, interleaved (each run
sends one message of each in turn, the processes meeting at a pipe before and after), and checks
every message bitwise. Reported: median time, algorithm bandwidth and the ratio of pieces to whole
from the same run.

Usage:
    nice -n 10 python -m benchmarks.multiprocess.tcp_pieces [--sizes 262144,1048576] [--runs 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import time
from typing import Any

from jaxccl.util import report

SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)
VARIANTS = ("pieces", "whole")


def _process(me: int, pipe: Any, sizes: list[int], runs: int, results: Any) -> None:
    """One side: process 0 sends, process 1 receives, times and checks."""
    import numpy as np

    from jaxccl.distributed.transport import NETWORK_ONLY, ProcessTransport

    options = {"pieces": dict(NETWORK_ONLY), "whole": dict(NETWORK_ONLY, RNDV_THRESH="auto")}
    transports = {}
    for name in VARIANTS:
        t = ProcessTransport(me, 2, options=options[name])
        pipe.send(t.address())
        t.connect(1 - me, pipe.recv())
        transports[name] = t

    def meet() -> None:
        pipe.send(None)
        pipe.recv()

    times: dict[tuple[int, str], list[float]] = {}
    tag = 0
    for size in sizes:
        expected = np.random.default_rng(size).integers(1, 255, size, dtype=np.uint8)  # never zero
        for _ in range(runs):
            for name, t in transports.items():
                inbox = np.zeros(size, np.uint8)
                tag += 1
                meet()
                start = time.perf_counter()
                request = t.isend(1, tag, expected) if me == 0 else t.irecv(0, tag, inbox)
                t.wait(request, 60.0)
                meet()
                elapsed = time.perf_counter() - start
                if me == 1:
                    if inbox.tobytes() != expected.tobytes():
                        raise AssertionError(f"{name}: a message of {size} bytes arrived different")
                    times.setdefault((size, name), []).append(elapsed)
    for t in transports.values():
        t.close()
    if me == 1:
        results.put(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="comma-separated message sizes in bytes")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ends = ctx.Pipe()
    procs = [ctx.Process(target=_process, args=(i, ends[i], sizes, args.runs, results)) for i in range(2)]
    for p in procs:
        p.start()
    times = None
    while times is None:
        try:
            times = results.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                print(f"a process failed: exit codes {[p.exitcode for p in procs]}")
                for p in procs:
                    p.kill()
                return 1
    for p in procs:
        p.join(60)
    rows = []
    for size in sizes:
        whole = report.median(times[(size, "whole")])
        for name in VARIANTS:
            t = report.median(times[(size, name)])
            rows.append(
                {
                    "size": size,
                    "size_h": report.format_bytes(size),
                    "variant": name,
                    "time_us": t * 1e6,
                    "algbw_GBs": size / t / 1e9,
                    "ratio_vs_whole": t / whole,
                }
            )
    report.print_table(rows, ["size_h", "variant", "time_us", "algbw_GBs", "ratio_vs_whole"])
    if args.json:
        report.write_json(args.json, {"benchmark": "tcp_pieces", "runs": args.runs, "interleaved": True, "rows": rows})
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
