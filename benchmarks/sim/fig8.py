"""MCCL Fig. 8 on the simulator: 1x{2,4,8,16,32}x8 under no failure and Fail1-3.

128 MiB per source; AllGather and AllToAll; algbw ratio vs NCCL, static (no reopt) vs re-optimized.

Prints progress and a table; writes JSON and a PNG (defaults under
``benchmarks/results/sim/``). The same code runs as ``jaxccl sim fig8``; see
:mod:`jaxccl.sim.experiments` and ``docs/results.md``.

Usage:
    nice -n 10 python -m benchmarks.sim.fig8 [--quick] [--hosts 2 4 8] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import sys

from jaxccl.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--json" not in args:
        args += ["--json", "benchmarks/results/sim/sim_fig8.json"]
    if "--png" not in args:
        args += ["--png", "benchmarks/results/sim/sim_fig8.png"]
    sys.exit(main(["sim", "fig8", *args]))
