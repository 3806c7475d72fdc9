"""AllToAll synthesis by column generation on HiGHS (MCCL Sec. 4.2, App. D, F, G).

:func:`alltoall` is the entry point; :func:`cflp_bound` is the compact
arc-based CF-LP of App. G.3, an independent check of the LP optimum;
:func:`decode_paths` reads the chunk routes a schedule stores in
``info["paths"]``.

Modules: :mod:`.network` (the topology as arrays), :mod:`.pricing`
(shortest-path trees on the time-expanded DAG, all sources per sweep),
:mod:`.columns` (the column pool), :mod:`.master` (the RMP on HiGHS),
:mod:`.cg` (the column-generation loop), :mod:`.repair` (warm start by
certified local repair), :mod:`.rounding` (deep-dive
rounding), :mod:`.planning` (messages, class ranges and scratch of the
rounded routes, incremental for warm starts), :mod:`.emission` (the
schedule IR of a plan, incremental for warm starts) with :mod:`.layout`
(where each op goes, computed incrementally),
:mod:`.routes` (the stored routes), :mod:`.state` (what a returned schedule
leaves for the next warm start), :mod:`.cflp` (the check). The benchmark is
:mod:`jaxccl.cli.synth_alltoall`.
"""

from jaxccl.synth.alltoall.cflp import cflp_bound
from jaxccl.synth.alltoall.driver import alltoall
from jaxccl.synth.alltoall.routes import decode_paths

__all__ = ["alltoall", "cflp_bound", "decode_paths"]
