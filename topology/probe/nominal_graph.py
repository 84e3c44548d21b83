"""The nominal topology graph of probed hosts: NVML's and sysfs' reports as a ``flexshard-topology/1`` graph.

:func:`host_graph` turns one :class:`topology.probe.nvml.HostProbe` into the intra-host part of a graph;
:func:`merge_hosts` joins several hosts (ranks in host order, then NVML index order) behind a placeholder
network, and the GPUs of one multi-node NVLink domain into one group.

Every bandwidth (GB/s, 1e9 B/s, per direction) and latency (us, one way) here is *nominal*: a link
generation's figure (:data:`topology.probe.nvml.NVLINK_GBPS_PER_LINK`,
:data:`~topology.probe.nvml.PCIE_GBPS_PER_LANE`), a NIC's advertised rate, or a default below, not a
measurement. The edges carry ``measured=False`` and ``basis`` ("nvml": derived from what NVML reported;
"sysfs": a NIC's port rate or link speed; "default": assumed, e.g. NICs when sysfs shows none, and the
network). The collective half of the probe (:func:`topology.probe.results.measured_graph`) replaces them
with measured values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import networkx as nx

from core.errors import TopologyError
from topology.graph import add_link, gpu_id, new_topology, nic_id, nvswitch_id, validate
from topology.probe.nvml import UNKNOWN_NVLINK_GBPS, HostProbe

DEFAULT_PCIE_GBPS = 63.0  # when NVML gives no PCIe link: gen5 x16

# Nominal one-way latencies (us), the defaults of topology.graph.add_node_group / HostSpec.
NVLINK_LATENCY_US = 3.0
PCIE_LATENCY_US = 1.0
NIC_GBPS = 50.0  # a 400 Gb/s NIC per GPU, as HostSpec assumes
NIC_LATENCY_US = 2.0


def _mark(G: nx.Graph, u: str, v: str, source: str, **attrs: Any) -> None:
    G.edges[u, v].update(measured=False, basis=source, **attrs)


def _nvlink_groups(
    probe: HostProbe,
) -> tuple[list[list[int]], dict[int, float], dict[tuple[int, int], float], bool]:
    """NVLink domains of a host: (components as GPU positions, switch bandwidth per GPU position, direct
    GPU-GPU bandwidth per position pair, whether any link had an unknown version)."""
    gpus = probe.gpus
    by_bus = {gpu.bus_id: pos for pos, gpu in enumerate(gpus) if gpu.bus_id}
    parent = list(range(len(gpus)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    switch_bw: dict[int, float] = {}
    peer_bw: dict[tuple[int, int], float] = {}
    estimated = False
    for pos, gpu in enumerate(gpus):
        sides: dict[int, float] = {}
        for link in gpu.nvlinks:
            bw = link.bandwidth_GBps
            if bw is None:
                bw, estimated = UNKNOWN_NVLINK_GBPS, True
            peer = by_bus.get(link.remote_bus_id) if link.remote_bus_id else None
            kind = link.remote_type
            if kind is None:  # older drivers: infer from the far end's bus id
                kind = "gpu" if peer is not None else "switch"
            if kind == "switch":
                switch_bw[pos] = switch_bw.get(pos, 0.0) + bw
            elif kind == "gpu" and peer is not None and peer != pos:
                sides[peer] = sides.get(peer, 0.0) + bw
        for peer, bw in sides.items():
            key = (min(pos, peer), max(pos, peer))
            peer_bw[key] = max(peer_bw.get(key, 0.0), bw)  # both ends report the same links
    switched = sorted(switch_bw)
    for pos in switched[1:]:
        parent[find(pos)] = find(switched[0])
    for a, b in peer_bw:
        parent[find(a)] = find(b)
    linked = set(switch_bw) | {p for pair in peer_bw for p in pair}
    components: dict[int, list[int]] = {}
    for pos in sorted(linked):
        components.setdefault(find(pos), []).append(pos)
    return sorted(components.values()), switch_bw, peer_bw, estimated


def _add_host(G: nx.Graph, probe: HostProbe, nics: bool) -> list[str]:
    host = probe.host
    if not probe.gpus:
        raise TopologyError(f"host {host!r}: NVML reports no GPU; nothing to place on this host")
    if host in G:
        raise TopologyError(f"host {host!r}: appears twice; give every probed host a distinct name")
    probe = dataclasses.replace(probe, gpus=tuple(sorted(probe.gpus, key=lambda g: g.index)))
    gpus = probe.gpus
    first_rank = sum(1 for _, kind in G.nodes(data="kind") if kind == "gpu")
    components, switch_bw, peer_bw, estimated = _nvlink_groups(probe)
    nvlink_source = "default" if estimated else "nvml"
    single = len(components) == 1 and len(components[0]) == len(gpus)
    group_of = {pos: host for pos in range(len(gpus))}  # without NVLink: grouped by host
    for k, members in enumerate(components):
        for pos in members:
            group_of[pos] = host if single else f"{host}/nvl{k}"

    G.add_node(host, kind="host", name=host, driver_version=probe.driver_version)
    nodes = []
    for pos, gpu in enumerate(gpus):
        node = gpu_id(host, pos)
        if node in G:
            raise TopologyError(
                f"gpu {node!r}: already in the topology; give every probed host a distinct name"
            )
        G.add_node(
            node,
            kind="gpu",
            rank=first_rank + pos,
            host=host,
            group=group_of[pos],
            local_rank=pos,
            memory_bytes=int(gpu.memory_bytes),
            model=gpu.name or "unknown",
            nvml_index=gpu.index,
            bus_id=gpu.bus_id,
            uuid=gpu.uuid,
            numa_node=gpu.numa_node,
            fabric=gpu.fabric,
        )
        nodes.append(node)
    for members in components:
        on_switch = [pos for pos in members if pos in switch_bw]
        if on_switch:
            switch = nvswitch_id(group_of[members[0]])
            G.add_node(switch, kind="nvswitch", group=group_of[members[0]])
            for pos in on_switch:
                add_link(G, nodes[pos], switch, "nvlink", switch_bw[pos], NVLINK_LATENCY_US)
                _mark(G, nodes[pos], switch, nvlink_source)
    for (a, b), bw in sorted(peer_bw.items()):
        add_link(G, nodes[a], nodes[b], "nvlink", bw, NVLINK_LATENCY_US)
        _mark(G, nodes[a], nodes[b], nvlink_source)

    def pcie(pos: int) -> tuple[float, str]:
        bw = gpus[pos].pcie_GBps
        return (DEFAULT_PCIE_GBPS, "default") if bw is None else (bw, "nvml")

    in_nvlink = {pos for members in components for pos in members}
    plain = [pos for pos in range(len(gpus)) if pos not in in_nvlink]
    for i, a in enumerate(plain):
        for b in plain[i + 1 :]:
            (bw_a, src_a), (bw_b, src_b) = pcie(a), pcie(b)
            add_link(G, nodes[a], nodes[b], "pcie", min(bw_a, bw_b), PCIE_LATENCY_US)
            source = "nvml" if src_a == src_b == "nvml" else "default"
            _mark(G, nodes[a], nodes[b], source, ancestor=probe.ancestor(gpus[a].index, gpus[b].index))
    if nics:
        found = {nic.name: nic for nic in probe.nics}
        for pos, node in enumerate(nodes):
            record = found.get(probe.nic_of_gpu.get(gpus[pos].index, ""))
            if record is None:  # no NIC visible: one assumed NIC per GPU
                nic = nic_id(host, pos)
                G.add_node(nic, kind="nic", host=host, measured=False, basis="default")
            else:  # a real NIC, shared by the GPUs nearest to it
                nic = real_nic_id(host, record.name)
                if nic not in G:
                    G.add_node(
                        nic,
                        kind="nic",
                        host=host,
                        measured=False,
                        basis="sysfs",
                        device=record.name,
                        nic_kind=record.kind,
                        bus_id=record.bus_id,
                        numa_node=record.numa_node,
                        rate_GBps=record.bandwidth_GBps,
                    )
            bw, source = pcie(pos)
            add_link(G, node, nic, "pcie", bw, PCIE_LATENCY_US)
            _mark(G, node, nic, source)
    return nodes


def real_nic_id(host: str, device: str) -> str:
    """Node id of the NIC that sysfs names ``device`` on ``host`` ("h0/nic/mlx5_0"). Distinct from
    :func:`topology.graph.nic_id` ("h0/nic3", one assumed NIC per GPU) on purpose: a real NIC may serve
    several GPUs, so it must not be taken for the private NIC of one local rank."""
    return f"{host}/nic/{device}"


def host_graph(probe: HostProbe, *, nics: bool = True) -> nx.Graph:
    """The intra-host topology of one probed host (validated as a part of a cluster: GPUs of separate
    NVLink islands are joined only by :func:`merge_hosts`' fabric; graph name ``probe:<host>``).

    * GPUs whose NVLinks go to NVSwitches form one group with an ``nvswitch`` node; each GPU's edge to it
      has the sum of its links' nominal bandwidth (H100 SXM: 18 x 25 = 450 GB/s per direction).
    * GPUs with direct GPU-GPU NVLinks get ``nvlink`` edges (bandwidth = the links between the pair); each
      connected component is a group. A host with one NVLink component holding all its GPUs names the group
      after the host, otherwise ``<host>/nvl<k>``.
    * GPUs without NVLink are grouped by host and joined pairwise by ``pcie`` edges at the smaller PCIe
      bandwidth of the two (edge attribute ``ancestor``: their common PCIe ancestor level).
    * ``nics``: NICs linked to GPUs by PCIe (at the GPU's PCIe bandwidth). When the probe found NICs in
      sysfs (``probe.nic_of_gpu``), each GPU links to its nearest real NIC, node :func:`real_nic_id`
      (``measured=False``, ``basis="sysfs"``, attributes ``device``, ``nic_kind``, ``bus_id``,
      ``numa_node``, ``rate_GBps``); GPUs under one NIC share it. Otherwise one default NIC per GPU
      (``basis="default"``), as :func:`topology.graph.add_node_group` does.
    """
    G = new_topology(f"probe:{probe.host}")
    _add_host(G, probe, nics)
    return validate(G, connected=False)  # a part: NVLink islands join only once the NICs reach a fabric


def _join_fabric_domains(G: nx.Graph) -> None:
    """Make each multi-node NVLink domain (GPUs of several hosts with one ``fabric`` key) one group with
    one ``nvswitch`` node: the GPUs' NVSwitch edges (their NVLink bandwidth) move to it, their ``group``
    becomes ``nvl-<clique id>-<cluster uuid prefix>``, and the per-host switch nodes left empty go."""
    domains: dict[str, list[str]] = {}
    for node, attrs in G.nodes(data=True):
        if attrs.get("kind") == "gpu" and attrs.get("fabric"):
            domains.setdefault(attrs["fabric"], []).append(node)
    for key, gpus in sorted(domains.items()):
        if len({G.nodes[g]["host"] for g in gpus}) < 2:
            continue  # one host's GPUs: already one group by their NVSwitch
        uuid, clique = key.split("/")
        group = f"nvl-{clique}-{uuid[:8]}"
        switch = nvswitch_id(group)
        G.add_node(switch, kind="nvswitch", group=group)
        old_switches = set()
        for gpu in gpus:
            for other in [n for n in G.neighbors(gpu) if G.nodes[n].get("kind") == "nvswitch"]:
                attrs = dict(G.edges[gpu, other])
                G.remove_edge(gpu, other)
                G.add_edge(gpu, switch, **attrs)
                old_switches.add(other)
            G.nodes[gpu]["group"] = group
        G.remove_nodes_from([s for s in old_switches if G.degree(s) == 0])


def merge_hosts(
    probes: Sequence[HostProbe],
    *,
    name: str = "probe",
    nic_GBps: float = NIC_GBPS,
    nic_latency_us: float = NIC_LATENCY_US,
) -> nx.Graph:
    """A cluster of probed hosts: ranks in (host order, NVML index) order, NICs as in :func:`host_graph`,
    GPUs that NVML puts in one multi-node NVLink domain (``GpuRecord.fabric``, NVL72-class) joined into one
    group across their hosts,
    and all NICs on one placeholder leaf switch (``measured=False``): a NIC whose rate sysfs gave links at
    that rate (``basis="sysfs"``), any other at ``nic_GBps`` (``basis="default"``). Neither NVML nor sysfs
    sees the fabric; the collective half of the probe measures it. A NIC shared by several GPUs is one
    edge, which :func:`topology.views.cluster_view` divides among them. Host names must be distinct.
    """
    if not probes:
        raise TopologyError(f"cluster {name!r}: field 'probes' is empty; probe at least one host")
    G = new_topology(name)
    for probe in probes:
        _add_host(G, probe, nics=True)
    _join_fabric_domains(G)
    G.add_node("leaf0", kind="switch", level="leaf", measured=False, basis="default")
    for nic in [node for node, kind in G.nodes(data="kind") if kind == "nic"]:
        rate = G.nodes[nic].get("rate_GBps")
        add_link(G, nic, "leaf0", "network", rate or nic_GBps, nic_latency_us)
        _mark(G, nic, "leaf0", "sysfs" if rate else "default")
    return validate(G)
