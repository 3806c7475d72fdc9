"""Fig. 8's AllGather under the simulator's execution models: dataflow (the default) against in-order.

For each ``1xHx8`` topology and scenario, the AllGather that Fig. 8 simulates
(healthy schedule for ``none``, the warm-started re-synthesis otherwise) runs
as jaxccl's executors run it (``execution="dataflow"``: no head-of-line
blocking, one pass over the buffer, 8 slots per connection), and in order as
MSCCL's runtime runs it (``execution="in_order"``) with MSCCL's tiling
(:func:`jaxccl.sim.experiments._iterations`), with 16 tiles and with 1.
Prints algbw ratios vs NCCL's rings (simulated in the same run), the
synthesizer's predicted ratio and dataflow's fraction of the prediction;
writes JSON.

Usage:
    nice -n 10 python -m benchmarks.sim.fig8_execution [--hosts 4 8] [--scenario none fail2]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time

import jaxccl.sim as sim
from jaxccl.schedule.ir import Collective
from jaxccl.sim.experiments import Synthesizers, _iterations
from jaxccl.synth.nccl import nccl_schedule
from jaxccl.topology import rail, scenario
from jaxccl.util.report import print_table, progress, write_json

MiB = 1 << 20
MODELS = {
    "dataflow": {},
    "in_order fig8 tiling": None,  # filled per schedule
    "in_order 16 tiles": {"iterations": 16, "execution": "in_order"},
    "in_order 1 tile": {"iterations": 1, "execution": "in_order"},
}


def measure(hosts: int, scen: str, nbytes: int, synth: Synthesizers, base_cache: dict) -> dict:
    healthy = rail(hosts=hosts, gpus_per_host=8)
    topo = healthy if scen == "none" else scenario(healthy, scen)
    if hosts not in base_cache:
        base_cache[hosts] = synth.synth(Collective.ALL_GATHER, healthy)
    base = base_cache[hosts]
    s = base if scen == "none" else synth.synth(Collective.ALL_GATHER, topo, previous=base)
    nccl = sim.run(topo, nccl_schedule(Collective.ALL_GATHER, topo), nbytes, execution="in_order").algbw
    row = {
        "topology": f"1x{hosts}x8",
        "scenario": scen,
        "chunks_per_period": s.chunks_per_period,
        "predicted": s.algbw / nccl,
    }
    for label, kwargs in MODELS.items():
        kw = kwargs if kwargs is not None else {"iterations": _iterations(s, nbytes), "execution": "in_order"}
        t0 = time.perf_counter()
        res = sim.run(topo, s, nbytes, **kw)
        row[label] = res.algbw / nccl
        row[f"{label} iterations"] = res.jobs[0].iterations
        row[f"{label} wall_s"] = time.perf_counter() - t0
    row["dataflow / predicted"] = row["dataflow"] / row["predicted"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--scenario", nargs="+", default=["none", "fail2"], choices=("none", "fail1", "fail2", "fail3"))
    ap.add_argument("--bytes", type=int, default=128 * MiB, help="bytes per source")
    ap.add_argument("--json", default="benchmarks/results/sim/sim_fig8_execution.json")
    args = ap.parse_args(argv)
    synth, cache = Synthesizers(), {}
    work = [(h, sc) for h in args.hosts for sc in args.scenario]
    rows = [measure(h, sc, args.bytes, synth, cache) for h, sc in progress(work, label="fig8-execution")]
    cols = ("topology", "scenario", "chunks_per_period", "predicted", *MODELS, "dataflow / predicted")
    print_table([{c: (f"{r[c]:.2f}x" if isinstance(r[c], float) else r[c]) for c in cols} for r in rows])
    write_json(args.json, {"benchmark": "sim_fig8_execution", "bytes_per_source": args.bytes, "rows": rows})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
