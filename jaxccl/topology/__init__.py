"""Cluster topologies: GPUs, switches and links with capacities (bytes/s) and latencies (s)."""

from jaxccl.topology.graph import Topology, gbps
from jaxccl.topology.presets import fat_tree, mixed_hosts, rail, ring, single_node, torus
from jaxccl.topology.scenarios import SCENARIOS, scenario

__all__ = [
    "SCENARIOS",
    "Topology",
    "fat_tree",
    "gbps",
    "mixed_hosts",
    "rail",
    "ring",
    "scenario",
    "single_node",
    "torus",
]
