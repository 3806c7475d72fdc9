"""Benchmark of the AllGather synthesizer (ForestColl phases, ForestColl-warm, latency-aware switch removal).

Rail-optimized 1 x H x 8 topologies (MCCL Sec. 6.1) for H = 2..64 (16-512
GPUs) in the states base, fail1, fail2, fail3: cold and warm (previous = the
base schedule) solve times, algbw, bound, trees and max depth for both
methods; a progress bar, a table and ``--json PATH``. The same code runs as
``jaxccl synth allgather``; see :mod:`jaxccl.cli.synth_allgather`.

Usage:
    PYTHONPATH=. nice -n 10 python benchmarks/synth_allgather.py [--max-hosts 8] [--json results.json]
"""

from __future__ import annotations

import argparse
import sys

from jaxccl.cli.synth_allgather import add_arguments, main

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.set_defaults(benchmark=True)  # the script is the benchmark
    sys.exit(main(ap.parse_args()))
