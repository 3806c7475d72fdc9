"""jaxccl's benchmarks, grouped by what they measure; run each as a module from the repository root.

    python -m benchmarks.executor.cpu --quick

``executor`` (one process: the native executors against ``jax.lax``), ``multiprocess`` (jobs of
several processes on the transport), ``control`` (the closed loop and REACT's reaction), ``correctness``
(long randomized campaigns: soak, model-based change, fuzzing), ``synth`` (synthesizer speed and
quality), ``sim`` (the papers' simulated figures) and ``tune`` (NCCL-BOT and REACT's tuning). Each
prints its table and writes raw JSON under :data:`RESULTS` (``benchmarks/results``, not tracked by git:
rerun a benchmark to regenerate its file); the tables worth keeping are in ``docs/``.
"""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
