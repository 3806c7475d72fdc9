"""MCCL Fig. 11 / App. E on the simulator: training time per batch, NCCL vs jaxccl.

One pipeline stage of Llama 405B and DeepSeek 671B (MCCL Table 4) on 128-2048 GPUs, no failure and
Fail1-3. jaxccl's AllGathers and ReduceScatters of groups that share their hosts with other groups
(Llama's DP, DeepSeek's DP_EP) relay through the other GPUs of those hosts, every group on them at
once (their link loads added; ``jaxccl.sim.shared_links``).

Prints progress and a table; writes JSON and a PNG (defaults under
``benchmarks/results/sim/``). The same code runs as ``jaxccl sim fig11``; see
:mod:`jaxccl.sim.experiments` and ``docs/results.md``.

Usage:
    nice -n 10 python -m benchmarks.sim.fig11 [--quick] [--gpus 128 256] [--workload llama405b]
        [--json PATH] [--png PATH]
"""

from __future__ import annotations

import sys

from jaxccl.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--json" not in args:
        args += ["--json", "benchmarks/results/sim/sim_fig11.json"]
    if "--png" not in args:
        args += ["--png", "benchmarks/results/sim/sim_fig11.png"]
    sys.exit(main(["sim", "fig11", *args]))
