"""Benchmark of the AllToAll synthesizer (column generation on HiGHS, deep-dive rounding; MCCL Sec. 4.2).

Rail-optimized 1 x H x 8 topologies (MCCL Sec. 6.1) for H = 2..64 (16-512
GPUs) in the states base, fail1, fail2, fail3: cold and warm (previous = the
base schedule) times (solve and total, medians of ``--runs``), iterations,
columns generated and reused, LP bound, rounded algbw, gap and chunk count of
both, and the warm mode; a progress bar, a table and ``--json PATH``. The
same code runs as ``jaxccl synth alltoall``; see :mod:`jaxccl.cli.synth_alltoall`.

Usage:
    PYTHONPATH=. nice -n 10 python benchmarks/synth_alltoall.py [--min-hosts 16] [--max-hosts 64] \
        [--runs 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import sys

from jaxccl.cli.synth_alltoall import add_arguments, main

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.set_defaults(benchmark=True)  # the script is the benchmark
    sys.exit(main(ap.parse_args()))
