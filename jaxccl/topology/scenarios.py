"""Fault scenarios: MCCL's Fail1-3 (Sec. 6.1) applied to a rail topology."""

from __future__ import annotations

from jaxccl.errors import TopologyError
from jaxccl.topology.graph import Topology, gbps
from jaxccl.topology.presets import NVSWITCH_LATENCY, SWITCH_HOP_LATENCY, nvswitch, tor

SCENARIOS = ("fail1", "fail2", "fail3")
FAIL1_NVLINK_GBPS = 800  # 13 of GPU 0's 18 NVLink lanes fail: 2880 -> 800 Gbps
FAIL2_NIC_GBPS = 50  # GPU 0's NIC link to its ToR: 400 -> 50 Gbps
FAIL3_BACKUP_TO_HOST_GBPS = 50  # dedicated link from the backup GPU to the faulty host
FAIL3_BACKUP_TO_FABRIC_GBPS = 100  # the backup's share towards the rest of the data center
FAIL3_EXTRA_LATENCY = 1e-6  # extra ToR switch latency of the remote rack


def scenario(topo: Topology, name: str, *, gpu: int = 0) -> Topology:
    """Applies one of MCCL's failure scenarios (Sec. 6.1) to a rail topology.

    - ``"fail1"``: the NVSwitch of GPU ``gpu``'s host loses 13 of the 18 lanes
      to that GPU: its NVLink drops from 2880 to 800 Gbps (both directions).
    - ``"fail2"``: the link from GPU ``gpu`` to its ToR drops from 400 to 50 Gbps.
    - ``"fail3"``: GPU ``gpu`` fails and is replaced by a backup GPU in another
      rack. The backup keeps the rank; it reaches its original host through a
      dedicated 50 Gbps link (attached at that host's NVSwitch) and the rest of
      the data center through a shared 100 Gbps link to its rail's ToR; both
      links carry an extra 1 us of ToR switch latency. The paper does not say
      where the dedicated link lands; attaching it to the host's NVSwitch is
      jaxccl's reading.

    >>> from jaxccl.topology import rail
    >>> t = scenario(rail(hosts=2), "fail2")
    >>> t.capacity(0, "tor:s0r0") * 8 / 1e9
    50.0
    """
    if name not in SCENARIOS:
        raise TopologyError(f"unknown scenario {name!r}; expected one of {SCENARIOS}")
    meta = topo.meta
    if meta.get("preset") not in ("rail", "single_node"):
        raise TopologyError(f"scenario {name!r} needs a rail topology, got {topo.name or 'a custom topology'}")
    topo._check_gpu(gpu)  # noqa: SLF001 - shared validation helper
    node = topo.graph.nodes[gpu]
    host, rail_idx, seg = node["host"], node["rail"], node["segment"]
    nvs, t = nvswitch(host), tor(seg, rail_idx)
    if name == "fail1":
        out = topo.degrade(gpu, nvs, gbps=FAIL1_NVLINK_GBPS)
    elif name == "fail2":
        if not topo.has_edge(gpu, t):
            raise TopologyError(f"scenario 'fail2' needs GPU {gpu}'s NIC link to {t!r}")
        out = topo.degrade(gpu, t, gbps=FAIL2_NIC_GBPS)
    else:
        if not topo.has_edge(gpu, t):
            raise TopologyError(f"scenario 'fail3' needs GPU {gpu}'s NIC link to {t!r}")
        host_lat = NVSWITCH_LATENCY + SWITCH_HOP_LATENCY + FAIL3_EXTRA_LATENCY
        fabric_lat = SWITCH_HOP_LATENCY + FAIL3_EXTRA_LATENCY
        changes = {}
        for a, b in ((gpu, nvs), (nvs, gpu)):
            changes[(a, b)] = {"capacity": gbps(FAIL3_BACKUP_TO_HOST_GBPS), "latency": host_lat, "kind": "backup"}
        for a, b in ((gpu, t), (t, gpu)):
            changes[(a, b)] = {"capacity": gbps(FAIL3_BACKUP_TO_FABRIC_GBPS), "latency": fabric_lat, "kind": "backup"}
        out = topo.with_edges(changes)
    return out.with_edges({}, name=f"{topo.name} {name}")
