"""Training-step models of MCCL's end-to-end workloads (Sec. 6.3, Table 4, App. E).

MCCL simulates one pipeline stage (of 16) of Llama 3.1 405B and DeepSeek-V3
671B training on a batch of 16K tokens, on rail-optimized clusters of 128 to
2048 GPUs in segments of 16 hosts. Table 4 lists, for the 1024-GPU cluster,
every collective of one step: its communicator (group type and size), its size
and how often it is called; collectives are ~34 % (Llama) and ~65 %
(DeepSeek) of a healthy step.

jaxccl's reading (the paper gives no more detail):

* **Sizes** are the nccl-tests "size" of one call: the output buffer of an
  AllGather, the input buffer of a ReduceScatter, the buffer of an AllReduce or
  AllToAll. (Reading them as per-call sizes is what makes a 50 Gbps NIC cost
  Llama ~3x, as Fig. 11 shows; as totals per step they would be latency-bound.)
* **Groups** follow a Megatron layout: TP and EP groups are consecutive ranks,
  DP (over TP) and DP_EP (over EP) groups take one rank of each; DeepSeek's
  "DP (1024)" spans the whole stage. When the cluster grows, TP (16) and EP
  (64) stay fixed and the DP groups grow (``N/16``, ``N/64``, ``N``); sizes and
  call counts stay as in Table 4.
* **Step time** = compute + the sum over collectives of calls x time of one
  call; communication does not overlap compute. Every group of a kind runs at
  once on disjoint GPUs of a non-blocking fabric, so one call takes as long as
  the slowest group: the one holding GPU 0, where every failure scenario
  strikes. Compute is set, per cluster size, so that communication is the
  paper's share of a healthy NCCL step.
"""

from __future__ import annotations

import dataclasses

from jaxccl.errors import ArgumentError
from jaxccl.schedule.ir import Collective
from jaxccl.topology.groups import group_of

__all__ = ["WORKLOADS", "CollectiveCall", "Workload", "group_gpus"]

MB = 1 << 20
GB = 1 << 30
KB = 1 << 10


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    """One collective of a training step (one column of Table 4).

    Attributes:
        collective: which collective.
        group: group type as in Table 4 (``"TP"``, ``"DP"``, ``"EP"``, ``"DP_EP"``).
        size_bytes: nccl-tests size of one call (see the module docstring).
        calls: calls per step.
        paper_share: its share of the training time in Table 4 (1024 GPUs).
        paper_group: the group size in Table 4 (1024 GPUs).
        optimize: whether MCCL re-synthesizes it (AllGather/AllToAll, except
            DeepSeek's 1024-GPU AllGather, MCCL footnote 8).
    """

    collective: Collective
    group: str
    size_bytes: float
    calls: int
    paper_share: float
    paper_group: int
    optimize: bool

    def label(self) -> str:
        return f"{self.collective.value}:{self.group}"

    def bytes_per_rank(self, group_size: int) -> float:
        """Input bytes per rank of one call in a group of ``group_size``."""
        if self.collective is Collective.ALL_GATHER:
            return self.size_bytes / group_size
        return self.size_bytes


@dataclasses.dataclass(frozen=True)
class Workload:
    """A training step: its collectives and the communication share of a healthy step."""

    name: str
    calls: tuple[CollectiveCall, ...]
    comm_share: float
    inner: dict[str, int]  # group type -> fixed size (TP, EP)

    def group_size(self, group: str, num_gpus: int) -> int:
        """Size of a ``group`` communicator on a stage of ``num_gpus`` GPUs."""
        if group in self.inner:
            return self.inner[group]
        if group == "DP" and "EP" in self.inner:  # DeepSeek: dense DP over the whole stage
            return num_gpus
        if group == "DP":
            return num_gpus // self.inner["TP"]
        if group == "DP_EP":
            return num_gpus // self.inner["EP"]
        raise ArgumentError(f"unknown group {group!r}; a workload has {sorted(self.inner)}, 'DP' and 'DP_EP'")


AG, RS, AR, A2A = Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE, Collective.ALL_TO_ALL

LLAMA_405B = Workload(
    name="llama405b",
    calls=(
        CollectiveCall(AG, "DP", 2.6 * GB, 16, 0.167e-2, 64, True),
        CollectiveCall(AG, "TP", 256 * MB, 524 * 1024, 18.0e-2, 16, True),
        CollectiveCall(RS, "DP", 5.3 * GB, 16, 0.555e-2, 64, False),
        CollectiveCall(RS, "TP", 256 * MB, 524 * 1024, 15.6e-2, 16, False),
        CollectiveCall(AR, "TP", 256 * MB, 16 * 1024, 7.36e-6, 16, False),
    ),
    comm_share=0.34,
    inner={"TP": 16},
)

DEEPSEEK_671B = Workload(
    name="deepseek671b",
    calls=(
        CollectiveCall(AG, "DP", 1.2 * GB, 1, 0.136e-2, 1024, False),  # MCCL footnote 8: not re-optimized
        CollectiveCall(AG, "DP_EP", 0.9 * GB, 64, 4.11e-2, 16, True),
        CollectiveCall(AG, "EP", 32 * KB, 768, 0.141e-2, 64, True),
        CollectiveCall(RS, "DP", 2.4 * GB, 1, 0.266e-2, 1024, False),
        CollectiveCall(RS, "DP_EP", 1.9 * GB, 64, 8.22e-2, 16, False),
        CollectiveCall(RS, "EP", 448 * MB, 2304, 44.5e-2, 64, False),
        CollectiveCall(A2A, "EP", 231 * MB, 768, 7.66e-2, 64, True),
    ),
    comm_share=0.65,
    inner={"EP": 64},
)

WORKLOADS = {w.name: w for w in (LLAMA_405B, DEEPSEEK_671B)}

_GROUP_KIND = {"TP": "inner", "EP": "inner", "DP_EP": "outer"}


def group_gpus(workload: Workload, group: str, num_gpus: int, gpu: int = 0) -> list[int]:
    """The cluster GPUs of the ``group`` communicator holding ``gpu``.

    >>> group_gpus(LLAMA_405B, "DP", 128, 0)
    [0, 16, 32, 48, 64, 80, 96, 112]
    """
    size = workload.group_size(group, num_gpus)
    kind = ("all" if size == num_gpus else "outer") if group == "DP" else _GROUP_KIND[group]
    return group_of(kind, gpu, num_gpus, size)
