"""Cluster topologies: GPUs, switches and links with capacities (bytes/s) and latencies (s)."""

from jaxccl.topology.discover import Discovery, discover
from jaxccl.topology.graph import Topology, gbps
from jaxccl.topology.nccl_xml import from_nccl_xml, load_nccl_xml
from jaxccl.topology.nvidia_smi import from_nvidia_smi
from jaxccl.topology.presets import fat_tree, mixed_hosts, rail, ring, single_node, torus
from jaxccl.topology.scenarios import SCENARIOS, scenario

__all__ = [
    "SCENARIOS",
    "Discovery",
    "Topology",
    "discover",
    "fat_tree",
    "from_nccl_xml",
    "from_nvidia_smi",
    "gbps",
    "load_nccl_xml",
    "mixed_hosts",
    "rail",
    "ring",
    "scenario",
    "single_node",
    "torus",
]
