"""Clusters the simulator knows, built from the hardware tables.

* ``gpu_cluster("h100" | "h200")``: roofline costs from the GPU table (stated efficiencies), NVLink
  inside a node, one 400 Gb/s NIC per GPU between nodes.
* ``a2_cluster()``: Atlas 800T A2 nodes: the chip from the ``a2`` table (cube cores, MACs per
  cycle, clock, GM bandwidth, HBM capacity), the node and network from ``cluster_a2``. Per-launch
  times (e.g. the A2 kernel timeline's records) plug in with ``launch_records``.
* ``cpu_cluster(costs, links)``: this machine, with costs fitted to its microbenchmarks.
"""

from __future__ import annotations

from typing import Mapping, Optional

from ..hardware import HardwareTable, load_table
from .costs import CostProvider, LinkModel, RooflineCosts, memory_bandwidth
from .step import Cluster

__all__ = ["gpu_cluster", "a2_cluster", "cpu_cluster", "cluster_by_name"]

#: stated assumptions of the roofline providers (printed with every result)
GPU_EFF = dict(eff_compute=0.6, eff_memory=0.7, launch_s=5e-6)
A2_EFF = dict(eff_compute=0.6, eff_memory=0.7, launch_s=10e-6)
#: the entries gpu_cluster() reads (besides a peak_<dtype>_flops per dtype simulated)
GPU_KEYS = ("hbm_capacity", "hbm_bandwidth", "host_bandwidth", "devices_per_node", "intra_node_bandwidth",
            "inter_node_bandwidth", "intra_node_latency", "inter_node_latency")
#: the entries a2_cluster() reads from its chip and node tables
CHIP_KEYS = ("cube_cores", "cube_macs_per_cycle_fp16", "clock_hz", "gm_bandwidth", "hbm_capacity")
NODE_KEYS = ("devices_per_node", "intra_node_bandwidth", "intra_node_links", "inter_node_bandwidth",
             "intra_node_latency", "inter_node_latency", "host_bandwidth")


def gpu_cluster(name: str = "h100", **eff) -> Cluster:
    t = load_table(name).require(GPU_KEYS, "a GPU cluster")
    costs = RooflineCosts(t, **{**GPU_EFF, **eff})
    return Cluster(t.title, costs, LinkModel.from_table(t), t["hbm_capacity"], t["hbm_bandwidth"],
                   t["host_bandwidth"])


def a2_cluster(chip: Optional[HardwareTable] = None, node: Optional[HardwareTable] = None,
               launch_records: Optional[Mapping[str, float]] = None, **eff) -> Cluster:
    """``chip`` defaults to ``load_table("a2")`` (keys ``cube_cores``, ``cube_macs_per_cycle_fp16``,
    ``clock_hz``, ``gm_bandwidth``, ``hbm_capacity``), ``node`` to ``load_table("cluster_a2")``
    (:data:`NODE_KEYS`). ``launch_records``: seconds per op name (finite, >= 0), every name one the
    simulator prices (:func:`~.layers.op_names`; a misspelt one is an error, not silently unused)."""
    chip = (chip or load_table("a2")).require(CHIP_KEYS, "the A2 cluster's chip")
    node = (node or load_table("cluster_a2")).require(NODE_KEYS, "the A2 cluster's node")
    costs = RooflineCosts(chip, **{**A2_EFF, **eff})
    if launch_records is not None:  # seconds per op name, each name one the simulator prices
        from .layers import op_names
        costs = costs.with_launch_records(launch_records, known=op_names())
    links = LinkModel(intra_bw=node["intra_node_bandwidth"] * node["intra_node_links"],
                      inter_bw=node["inter_node_bandwidth"], intra_latency=node["intra_node_latency"],
                      inter_latency=node["inter_node_latency"], devices_per_node=int(node["devices_per_node"]))
    return Cluster(f"{node.title}; chip: {chip.label}", costs, links, chip["hbm_capacity"],
                   memory_bandwidth(chip), node["host_bandwidth"])


def cpu_cluster(costs: CostProvider, links: LinkModel, memory_bytes: float, memory_bw: float) -> Cluster:
    return Cluster("this CPU (fitted to its microbenchmarks)", costs, links, memory_bytes, memory_bw, 0.0)


def cluster_by_name(name: str) -> Cluster:
    if name in ("h100", "h200"):
        return gpu_cluster(name)
    if name == "a2":
        return a2_cluster()
    raise ValueError(f"cluster must be one of h100, h200, a2, got {name!r}")
