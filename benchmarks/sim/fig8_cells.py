"""MCCL Fig. 8 on the simulator, one cell at a time: for the large topologies that one run cannot hold.

Each (topology, scenario, schedule) cell is simulated on its own and written at once as one JSON line
(appended to ``--log``), so a long run keeps every finished cell. The schedules are those of
``jaxccl sim fig8`` (:mod:`jaxccl.sim.experiments`): ``nccl`` (NCCL's rings), ``orig`` (synthesized
for the healthy topology) and ``reopt`` (re-synthesized for the degraded one, warm-started from
``orig``; on the healthy topology it is ``orig``). A line carries the simulated and the predicted
algbw, their ratio, the flows, the simulator's wall and CPU time and its engine counters.

Usage:
    nice -n 10 python -m benchmarks.sim.fig8_cells --hosts 32 --scenarios none fail2 \\
        --schedules reopt nccl --log benchmarks/results/sim/sim_fig8_all_gather_32.log
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jaxccl.schedule.ir import Collective
from jaxccl.sim.experiments import Synthesizers, _compared, _sim
from jaxccl.topology import rail, scenario

MiB = 1 << 20


def cells(args: argparse.Namespace):
    """Yields one JSON-ready dict per simulated cell."""
    synth = Synthesizers()
    col = Collective(args.collective)
    for h in args.hosts:
        healthy = rail(hosts=h, gpus_per_host=8)
        t0, c0 = time.perf_counter(), time.process_time()
        base = synth.synth(col, healthy)
        yield {
            "topology": f"1x{h}x8",
            "what": "synth healthy",
            "wall_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0,
        }
        for sc in args.scenarios:
            topo = healthy if sc == "none" else scenario(healthy, sc)
            t0 = time.perf_counter()
            compared = dict(_compared(synth, col, topo, base, degraded=sc != "none"))
            synth_s = time.perf_counter() - t0
            for label in args.schedules:
                s = compared.get(label)
                if s is None:
                    yield {"topology": f"1x{h}x8", "scenario": sc, "schedule": label, "missing": dict(synth.missing)}
                    continue
                t0, c0 = time.perf_counter(), time.process_time()
                res = _sim(topo, s, args.size)  # synthesized: dataflow, per tile; NCCL: in order, as Fig. 8
                row = {
                    "topology": f"1x{h}x8",
                    "collective": args.collective,
                    "scenario": sc,
                    "schedule": label,
                    "size_bytes": args.size,
                    "algbw": res.algbw,
                    "flows": res.num_flows,
                    "sim_wall_s": time.perf_counter() - t0,
                    "cpu_s": time.process_time() - c0,
                    "stats": dict(res.stats),
                }
                if label != "nccl":
                    row["predicted_algbw"] = s.algbw
                    row["sim_over_pred"] = res.algbw / s.algbw
                    row["synth_s"] = synth_s if label == "reopt" else 0.0
                yield row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collective", default="all_gather", choices=("all_gather", "all_to_all"))
    p.add_argument("--hosts", type=int, nargs="+", default=[32])
    p.add_argument("--scenarios", nargs="+", default=["none", "fail1", "fail2", "fail3"])
    p.add_argument("--schedules", nargs="+", default=["reopt", "nccl"], choices=("nccl", "orig", "reopt"))
    p.add_argument("--size", type=int, default=128 * MiB, help="bytes per source")
    p.add_argument("--log", default=None, help="append one JSON line per cell here")
    args = p.parse_args(argv)
    for row in cells(args):
        line = json.dumps(row)
        print(line, flush=True)
        if args.log:
            with open(args.log, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
