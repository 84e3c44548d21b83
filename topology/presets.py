"""Ready-made clusters and the ``name[:size]`` preset registry.

Figures (per direction, GB = 1e9 bytes/s): NVLink 450 GB/s per H100 GPU, 900 GB/s per GB200 GPU in an
NVL72 domain; one 400 Gb/s (50 GB/s) NIC per GPU; PCIe Gen5 x16 GPU<->NIC 64 GB/s. Latencies (one way):
NVLink 3 us, PCIe 1 us, NIC->leaf 2 us, leaf->spine 1 us, so the view's inter-group latency (up to the
spine and back down) is 2 * (1 + 2 + 1) = 8 us; a cluster that fits under one leaf has no spine and gets
2 * (1 + 2) = 6 us.

Collective latencies (``G.graph["collective_latency_us"]``, :mod:`topology.latency`): small-message NCCL
figures per collective kind, scope and participants; where each figure comes from (a published
measurement, or a stated assumption) is in docs/cost_model.md, "Step time".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import networkx as nx

from core.errors import TopologyError
from topology.graph import HostSpec, build_cluster
from topology.latency import LATENCY_KEY, SOURCE_KEY

NIC_400G_GBps = 50.0  # 400 Gb/s
H100_NVLINK_GBps = 450.0
NVL72_NVLINK_GBps = 900.0
H100_MEMORY_BYTES = 80 * 2**30
GB200_MEMORY_BYTES = 186 * 10**9
MAX_PRESET_GPUS = 32_768

# NCCL small-message latency, us, by kind -> scope -> participants (docs/cost_model.md, "Step time").
# Fabric (world, rail): 400G NDR InfiniBand, one NIC per GPU. world all-reduce at 16 GPUs: 47.6 us measured
# on 2 Hopper nodes (NVIDIA/nccl#1244); the rest are stated assumptions: all-to-all 20 us + 1 us per peer
# over the fabric (one message to every peer), NVLink all-to-all 10 us + 0.7 us per peer, all-reduce
# over NVLink 8-20 us.
_FABRIC_A2A = {"2": 21.0, "8": 27.0, "16": 35.0, "64": 83.0, "512": 531.0}
_FABRIC_AR = {"2": 20.0, "16": 47.6, "64": 71.4, "512": 107.1}
H100_NCCL_LATENCY_US = {
    "all_to_all": {"group": {"2": 10.7, "8": 14.9}, "world": _FABRIC_A2A, "rail": _FABRIC_A2A},
    "all_reduce": {"group": {"2": 8.0, "8": 12.0}, "world": _FABRIC_AR, "rail": _FABRIC_AR},
}
NVL72_NCCL_LATENCY_US = {
    "all_to_all": {"group": {"4": 12.1, "72": 59.7}, "world": _FABRIC_A2A, "rail": _FABRIC_A2A},
    "all_reduce": {"group": {"4": 10.0, "72": 20.0}, "world": _FABRIC_AR, "rail": _FABRIC_AR},
}
NCCL_LATENCY_SOURCE = "NCCL figures (docs/cost_model.md, Step time): cited where published, else assumed"


def _with_latency(G: nx.Graph, figures: dict) -> nx.Graph:
    """``G`` with the preset's collective latencies as graph attributes (copies, never shared)."""
    G.graph[LATENCY_KEY] = {kind: {scope: dict(p) for scope, p in s.items()} for kind, s in figures.items()}
    G.graph[SOURCE_KEY] = NCCL_LATENCY_SOURCE
    return G  # the largest cluster a preset spec builds (a graph of every GPU and link)


def _positive(name: str, field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TopologyError(f"{name}: field {field!r} = {value!r}; expected a positive integer")


def h100_cluster(num_nodes: int, gpus_per_node: int = 8, *, hosts_per_leaf: int = 4) -> nx.Graph:
    """``num_nodes`` H100 hosts (80 GiB each GPU): NVSwitch 450 GB/s per GPU, one 50 GB/s NIC per GPU,
    non-blocking leaf/spine (``hosts_per_leaf`` hosts per leaf). Each host is one NVLink group."""
    _positive("h100_cluster", "num_nodes", num_nodes)
    _positive("h100_cluster", "gpus_per_node", gpus_per_node)
    hosts = [
        HostSpec(
            f"node{i}",
            gpus_per_node,
            nvlink_GBps=H100_NVLINK_GBps,
            nic_GBps=NIC_400G_GBps,
            memory_bytes=H100_MEMORY_BYTES,
            model="H100",
        )
        for i in range(num_nodes)
    ]
    G = build_cluster(f"h100:{num_nodes}x{gpus_per_node}", hosts, hosts_per_leaf=hosts_per_leaf)
    return _with_latency(G, H100_NCCL_LATENCY_US)


def nvl72_pod(num_pods: int, *, hosts_per_leaf: int = 8) -> nx.Graph:
    """``num_pods`` GB200 NVL72 pods: 72 GPUs per NVLink domain (900 GB/s per GPU), 18 hosts of 4 GPUs per
    pod (host ``pod{p}-host{h}``, group ``pod{p}``), one 50 GB/s NIC per GPU, non-blocking leaf/spine."""
    _positive("nvl72_pod", "num_pods", num_pods)
    hosts = [
        HostSpec(
            f"pod{p}-host{h}",
            4,
            group=f"pod{p}",
            nvlink_GBps=NVL72_NVLINK_GBps,
            nic_GBps=NIC_400G_GBps,
            memory_bytes=GB200_MEMORY_BYTES,
            model="GB200",
        )
        for p in range(num_pods)
        for h in range(18)
    ]
    return _with_latency(
        build_cluster(f"nvl72:{num_pods}", hosts, hosts_per_leaf=hosts_per_leaf), NVL72_NCCL_LATENCY_US
    )


def skewed_fabric(
    num_nodes: int,
    gpus_per_node: int = 8,
    slow_hosts: Iterable[int] = (0,),
    slow_factor: float = 4.0,
    oversubscription: float = 2.0,
    *,
    hosts_per_leaf: int = 2,
) -> nx.Graph:
    """Like :func:`h100_cluster`, but the NICs of ``slow_hosts`` (host indices) are ``slow_factor`` times
    slower and each leaf->spine uplink carries the sum of the NIC bandwidth under it / ``oversubscription``.

    With the defaults (2 hosts per leaf), ``skewed:8`` has 4 leaves; leaf0 (hosts 0, 1) has uplink
    (8 * 12.5 + 8 * 50) / 2 = 250 GB/s shared by 16 GPUs.
    """
    _positive("skewed_fabric", "num_nodes", num_nodes)
    _positive("skewed_fabric", "gpus_per_node", gpus_per_node)
    slow = set(slow_hosts)
    bad = sorted(h for h in slow if not (isinstance(h, int) and 0 <= h < num_nodes))
    if bad:
        raise TopologyError(f"skewed_fabric: field 'slow_hosts' = {bad}; expected indices 0..{num_nodes - 1}")
    if not slow_factor > 0:
        raise TopologyError(f"skewed_fabric: field 'slow_factor' = {slow_factor!r}; expected > 0")
    hosts = [
        HostSpec(
            f"node{i}",
            gpus_per_node,
            nvlink_GBps=H100_NVLINK_GBps,
            nic_GBps=NIC_400G_GBps / slow_factor if i in slow else NIC_400G_GBps,
            memory_bytes=H100_MEMORY_BYTES,
            model="H100",
        )
        for i in range(num_nodes)
    ]
    return build_cluster(
        f"skewed:{num_nodes}x{gpus_per_node}",
        hosts,
        hosts_per_leaf=hosts_per_leaf,
        oversubscription=oversubscription,
    )


@dataclass(frozen=True)
class Preset:
    """A registry entry: ``build(size)`` or ``build(size, gpus_per_node)`` when ``per_node_gpus``."""

    build: Callable[..., nx.Graph]
    default_size: int
    size_name: str  # what the size counts, for help text
    per_node_gpus: bool  # accepts "NxG"
    gpus_per_size: int  # GPUs in one unit of the size (a node's default, or a pod's)


PRESETS: dict[str, Preset] = {
    "h100": Preset(h100_cluster, 8, "nodes", True, 8),
    "nvl72": Preset(nvl72_pod, 1, "pods", False, 72),
    "skewed": Preset(skewed_fabric, 8, "nodes", True, 8),
}


def preset_help() -> str:
    """One-line list of the valid preset specs, e.g. ``h100[:NODES[xGPUS]] (default 8)``."""
    parts = []
    for name, p in PRESETS.items():
        size = f"{p.size_name.upper()}[xGPUS]" if p.per_node_gpus else p.size_name.upper()
        parts.append(f"{name}[:{size}] (default {p.default_size})")
    return ", ".join(parts)


_SIZE = re.compile(r"^(\d+)(?:x(\d+))?$")


def from_preset(spec: str) -> nx.Graph:
    """Build a preset from ``"name[:size]"``: ``"h100:8"`` (8 nodes), ``"h100:8x4"`` (8 nodes x 4 GPUs),
    ``"nvl72:2"`` (2 pods), ``"skewed:8"``; a bare name uses the preset's default size."""
    text = str(spec).strip()
    name, _, size = text.partition(":")
    name = name.strip().lower()
    if name not in PRESETS:
        raise TopologyError(f"preset {name!r}: unknown name; valid presets: {preset_help()}")
    preset = PRESETS[name]
    if not size:
        return preset.build(preset.default_size)
    match = _SIZE.match(size.strip().lower())
    if not match or (match.group(2) is not None and not preset.per_node_gpus):
        raise TopologyError(f"preset {text!r}: bad size {size!r}; valid presets: {preset_help()}")
    count, gpus = int(match.group(1)), match.group(2)
    if count <= 0 or (gpus is not None and int(gpus) <= 0):
        raise TopologyError(f"preset {text!r}: size {size!r} is not positive; valid presets: {preset_help()}")
    total = count * (int(gpus) if gpus is not None else preset.gpus_per_size)
    if total > MAX_PRESET_GPUS:
        raise TopologyError(
            f"preset {text!r}: {total:,} GPUs, over the {MAX_PRESET_GPUS:,} a preset builds; describe a "
            "larger cluster in a topology file"
        )
    return preset.build(count) if gpus is None else preset.build(count, int(gpus))


def is_preset_name(spec: str) -> bool:
    """Whether ``spec`` names a registered preset (the size part is not checked)."""
    return str(spec).partition(":")[0].strip().lower() in PRESETS
