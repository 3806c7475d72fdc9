"""MCCL Fig. 1 on the simulator: 1x2x8 with GPU 0's NIC degraded, AllGather and AllToAll.

GPU 0's NIC at 400/200/100/50 Gbps; 128 MiB and 1 GiB per source; algbw ratio vs NCCL for the
original (static) and the re-optimized schedules.

Prints progress and a table; writes JSON and a PNG (defaults under
``benchmarks/results/sim/``). The same code runs as ``jaxccl sim fig1``; see
:mod:`jaxccl.sim.experiments` and ``docs/results.md``.

Usage:
    nice -n 10 python -m benchmarks.sim.fig1 [--quick] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import sys

from jaxccl.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--json" not in args:
        args += ["--json", "benchmarks/results/sim/sim_fig1.json"]
    if "--png" not in args:
        args += ["--png", "benchmarks/results/sim/sim_fig1.png"]
    sys.exit(main(["sim", "fig1", *args]))
