"""Cluster topologies for FlexShard: GPUs, NVLink groups, NICs and the network fabric.

A topology is a plain :class:`networkx.Graph` following the ``flexshard-topology/1`` schema (see
:mod:`topology.graph`); build one with the presets (:func:`from_preset`, ``"h100:8"``), the builders in
:mod:`topology.graph`, or load it from node-link JSON (:func:`read_json`, :func:`load_topology`). The planner
reads the per-rank arrays of :func:`cluster_view`. Bandwidths are per direction: ``_GBps`` in the graph
(GB = 1e9 bytes), ``_Bps`` (bytes/s) in views; latencies are ``_us`` in the graph and ``_s`` in views.

This package depends only on numpy and networkx.
"""

from topology.graph import (
    SCHEMA,
    HostSpec,
    add_link,
    add_node_group,
    add_switch,
    build_cluster,
    new_topology,
    validate,
)
from topology.io import load_topology, read_json, write_json
from topology.presets import PRESETS, Preset, from_preset, h100_cluster, nvl72_pod, skewed_fabric
from topology.views import ClusterView, TopologyError, cluster_view, groups, slow_links, summary, uniform_view

__all__ = [
    "PRESETS",
    "SCHEMA",
    "ClusterView",
    "HostSpec",
    "Preset",
    "TopologyError",
    "add_link",
    "add_node_group",
    "add_switch",
    "build_cluster",
    "cluster_view",
    "from_preset",
    "groups",
    "h100_cluster",
    "load_topology",
    "new_topology",
    "nvl72_pod",
    "read_json",
    "skewed_fabric",
    "slow_links",
    "summary",
    "uniform_view",
    "validate",
    "write_json",
]
