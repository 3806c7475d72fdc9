"""Cluster topologies: GPUs, switches and links with capacities (bytes/s) and latencies (s)."""

from jaxccl.topology.graph import Topology, gbps
from jaxccl.topology.presets import fat_tree, rail, ring, single_node
from jaxccl.topology.scenarios import SCENARIOS, scenario

__all__ = ["SCENARIOS", "Topology", "fat_tree", "gbps", "rail", "ring", "scenario", "single_node"]
