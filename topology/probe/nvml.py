"""The NVML half of the cluster probe: what one host's driver says about its GPUs, and the topology graph.

:func:`probe_host` asks NVML (``pynvml``, imported lazily, or any module-like object with the same API,
e.g. :class:`topology.probe.fake_nvml.FakeNVML`) for each GPU's memory, PCI bus id, NUMA node, CPU
affinity, PCIe link, active NVLinks and the common PCIe ancestor of every GPU pair, and sysfs
(:mod:`topology.probe.nics`) for the NICs NVML cannot see and the nearest one to each GPU. Queries the host
does not support (VMs often answer "Not Supported" for NVLink and NUMA) give ``None``. :func:`host_graph`
turns one :class:`HostProbe` into the intra-host part of a ``flexshard-topology/1`` graph; :func:`merge_hosts`
joins several hosts (ranks in host order, then NVML index order) behind a placeholder network.

Every bandwidth here is a *nominal* figure from the link generation tables below or a NIC's advertised
rate, not a measurement: the edges carry ``measured=False`` and ``basis`` ("nvml": derived from what NVML
reported; "sysfs": a NIC's port rate or link speed; "default": assumed, e.g. NICs when sysfs shows none,
and the network). The collective half of the probe replaces them with measured values.
"""

# ruff: noqa: N802, N815  (unit suffixes such as _GBps keep their case: B = bytes)

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from core.errors import TopologyError
from topology.graph import add_link, gpu_id, new_topology, nic_id, nvswitch_id, validate
from topology.probe.nics import SYSFS_ROOT, NicRecord, discover_nics, nearest_nics

# NVLink bandwidth per link, per direction, GB/s (1e9 B/s), keyed by the NVML version *enum* that
# nvmlDeviceGetNvLinkVersion returns (NVML_NVLINK_VERSION_*: 1 = 1.0, 2 = 2.0, 3 = 2.2, 4 = 3.0, 5 = 3.1,
# 6 = 4.0, 7 = 5.0; it is not the generation number, see hwloc issue open-mpi/hwloc#658: A100 returns 5).
# Source: NVIDIA's NVLink product page (nvidia.com/en-us/data-center/nvlink/) gives the bidirectional
# total per GPU and the link count: gen 2 (V100) 300 GB/s over 6 links, gen 3 (A100) 600 GB/s over 12,
# gen 4 (H100) 900 GB/s over 18, gen 5 (B200) 1800 GB/s over 18; P100 (gen 1) 160 GB/s over 4. Per link
# per direction = total / links / 2: 20, 25, 25, 25, 50. So an H100 SXM with 18 NVLink 4 links has
# 18 x 25 = 450 GB/s per direction. 2.2 and 3.1 are sub-versions with the signalling of 2.0 and 3.0.
# NVLink 6 (enum 8) is left out (no per-link figure we can vouch for); unknown versions use
# UNKNOWN_NVLINK_GBPS in host_graph, marked basis="default".
NVLINK_GBPS_PER_LINK: dict[int, float] = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 25.0, 6: 25.0, 7: 50.0}
NVLINK_VERSION_NAMES: dict[int, str] = {
    1: "1.0",
    2: "2.0",
    3: "2.2",
    4: "3.0",
    5: "3.1",
    6: "4.0",
    7: "5.0",
    8: "6.0",
}
UNKNOWN_NVLINK_GBPS = 25.0

# PCIe bandwidth per lane, per direction, GB/s, after line encoding (PCI-SIG transfer rates): gen 1/2
# 2.5/5 GT/s with 8b/10b; gen 3/4/5 8/16/32 GT/s with 128b/130b; gen 6 64 GT/s in FLIT mode (242 of 256
# bytes are TLP/DLLP payload). Gen5 x16: 32 * 16 * 128/130 / 8 = 63.0 GB/s per direction.
PCIE_GBPS_PER_LANE: dict[int, float] = {
    1: 2.5 * 8 / 10 / 8,
    2: 5.0 * 8 / 10 / 8,
    3: 8.0 * 128 / 130 / 8,
    4: 16.0 * 128 / 130 / 8,
    5: 32.0 * 128 / 130 / 8,
    6: 64.0 * 242 / 256 / 8,
}
DEFAULT_PCIE_GBPS = 63.0  # when NVML gives no PCIe link: gen5 x16

# Nominal one-way latencies (us), the defaults of topology.graph.add_node_group / HostSpec.
NVLINK_LATENCY_US = 3.0
PCIE_LATENCY_US = 1.0
NIC_GBPS = 50.0  # a 400 Gb/s NIC per GPU, as HostSpec assumes
NIC_LATENCY_US = 2.0

# nvmlDeviceGetTopologyCommonAncestor levels (NVML_TOPOLOGY_*), nearest first.
ANCESTOR_LEVELS: dict[int, str] = {
    0: "INTERNAL",
    10: "SINGLE",
    20: "MULTIPLE",
    30: "HOSTBRIDGE",
    40: "NODE",
    50: "SYSTEM",
}
_REMOTE_TYPES = {0x00: "gpu", 0x01: "npu", 0x02: "switch"}  # NVML_NVLINK_DEVICE_TYPE_*

_UNAVAILABLE_HINT = (
    "run the probe on a GPU host with the NVIDIA driver installed, or use `flexshard probe`, which falls "
    "back to collective measurements"
)


@dataclass(frozen=True)
class NvLinkRecord:
    """One active NVLink of a GPU."""

    link: int
    remote_bus_id: str | None  # PCI bus id of the far end (GPU or NVSwitch), normalized
    remote_type: str | None  # "gpu", "switch", "npu" (IBM CPU), None when NVML does not say
    version: int | None  # NVML_NVLINK_VERSION_* enum value
    bandwidth_GBps: float | None  # per direction, nominal (NVLINK_GBPS_PER_LINK); None: unknown version

    @property
    def version_name(self) -> str | None:
        return None if self.version is None else NVLINK_VERSION_NAMES.get(self.version)


@dataclass(frozen=True)
class GpuRecord:
    """What NVML reports about one GPU; ``None`` where the query is not supported."""

    index: int  # NVML index (PCI bus order; CUDA uses it only with CUDA_DEVICE_ORDER=PCI_BUS_ID)
    name: str | None
    uuid: str | None
    memory_bytes: int
    bus_id: str | None  # normalized "DDDDDDDD:BB:DD.F"
    numa_node: int | None
    cpu_affinity: tuple[int, ...] | None  # CPU ids
    nvlinks: tuple[NvLinkRecord, ...]  # active links only
    pcie_gen: int | None  # current link (it may train down when idle)
    pcie_width: int | None
    pcie_max_gen: int | None  # the best this device and system support
    pcie_max_width: int | None
    common_ancestor: dict[int, str | None] = field(default_factory=dict)  # other NVML index -> level
    fabric: str | None = None  # multi-node NVLink domain "<cluster uuid hex>/<clique id>" (NVL72-class)

    @property
    def pcie_GBps(self) -> float | None:
        """Nominal PCIe bandwidth per direction: the max link when known (the current one may have trained
        down to save power), else the current link."""
        gen = self.pcie_max_gen or self.pcie_gen
        width = self.pcie_max_width or self.pcie_width
        if gen is None or width is None or gen not in PCIE_GBPS_PER_LANE:
            return None
        return PCIE_GBPS_PER_LANE[gen] * width

    @property
    def nvlink_GBps(self) -> float:
        """Sum of the active links' nominal bandwidths (unknown versions counted at UNKNOWN_NVLINK_GBPS)."""
        return sum(
            UNKNOWN_NVLINK_GBPS if k.bandwidth_GBps is None else k.bandwidth_GBps for k in self.nvlinks
        )


@dataclass(frozen=True)
class HostProbe:
    """One host as NVML sees it. ``unsupported``: distinct "query: error" lines NVML answered with.

    ``nics``: the host's NICs as sysfs shows them (:func:`topology.probe.nics.discover_nics`; NVML cannot
    see them); ``nic_of_gpu``: NVML index -> name of the NIC that GPU uses
    (:func:`topology.probe.nics.nearest_nics`). Both empty when no NIC is visible.
    """

    host: str
    gpus: tuple[GpuRecord, ...]
    driver_version: str | None = None
    unsupported: tuple[str, ...] = ()
    nics: tuple[NicRecord, ...] = ()
    nic_of_gpu: dict[int, str] = field(default_factory=dict)

    def ancestor(self, i: int, j: int) -> str | None:
        """Common PCIe ancestor level of GPUs ``i`` and ``j`` (NVML indices), from either side."""
        by_index = {gpu.index: gpu for gpu in self.gpus}
        level = by_index[i].common_ancestor.get(j)
        return level if level is not None else by_index[j].common_ancestor.get(i)


def normalize_bus_id(bus_id: Any) -> str | None:
    """A PCI bus id as NVML's ``busId`` spells it ("00000000:18:00.0"); legacy 4-digit domains widened."""
    if bus_id is None:
        return None
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode(errors="replace")
    text = str(bus_id).strip().rstrip("\x00")
    m = re.fullmatch(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])", text)
    if not m:
        return text or None
    domain, bus, dev, fn = (int(m[1] or "0", 16), int(m[2], 16), int(m[3], 16), int(m[4]))
    return f"{domain:08X}:{bus:02X}:{dev:02X}.{fn}"


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return str(value)


def _unavailable(reason: str) -> TopologyError:
    return TopologyError(f"NVML is unavailable ({reason}); {_UNAVAILABLE_HINT}")


def _load_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as err:
        raise _unavailable(f"cannot import pynvml: {err}; install nvidia-ml-py") from None
    return pynvml


class _Asker:
    """Runs NVML queries: optional ones give None on any NVML error (noted), required ones raise."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.error_type = getattr(nvml, "NVMLError", Exception)
        self.notes: dict[str, None] = {}

    def __call__(self, fn_name: str, *args: Any, what: str, required: bool = False) -> Any:
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:
            if required:
                raise TopologyError(f"{what}: this NVML binding has no {fn_name}; upgrade nvidia-ml-py")
            self.notes[f"{fn_name}: not in this NVML binding"] = None
            return None
        try:
            return fn(*args)
        except self.error_type as err:
            if required:
                raise TopologyError(
                    f"{what}: NVML query {fn_name} failed ({err}); check the GPU with nvidia-smi"
                ) from None
            self.notes[f"{fn_name}: {err}"] = None
            return None


def _affinity_cpus(words: Any) -> tuple[int, ...] | None:
    """CPU ids from NVML's affinity bitmask (an array of 64-bit words, CPU 0 = bit 0 of word 0)."""
    try:
        values = [int(w) for w in words]
    except (TypeError, ValueError):
        return None
    cpus = tuple(w * 64 + bit for w, word in enumerate(values) for bit in range(64) if word >> bit & 1)
    return cpus or None


def _fabric_domain(ask: _Asker, nvml: Any, handle: Any, what: str) -> str | None:
    """The multi-node NVLink domain of a GPU (GB200 NVL72-class systems, where NVSwitch trays join the
    GPUs of several hosts): ``"<cluster uuid hex>/<clique id>"`` once the fabric manager has registered
    the GPU (state COMPLETED, status SUCCESS). None elsewhere: single-node NVLink answers "Not
    Supported", and a binding without ``nvmlDeviceGetGpuFabricInfoV`` is noted by the asker."""
    struct = getattr(nvml, "c_nvmlGpuFabricInfoV_t", None)
    if struct is None:
        ask.notes["nvmlDeviceGetGpuFabricInfoV: not in this NVML binding"] = None
        return None
    info = struct()
    if ask("nvmlDeviceGetGpuFabricInfoV", handle, ctypes.byref(info), what=what) is None:
        return None
    completed = getattr(nvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)
    uuid = bytes(info.clusterUuid)
    if info.state != completed or info.status != 0 or not any(uuid):
        return None
    return f"{uuid.hex()}/{int(info.cliqueId)}"


def _probe_gpu(ask: _Asker, nvml: Any, index: int, handle: Any, handles: Sequence[Any]) -> GpuRecord:
    what = f"gpu {index}"
    name = _text(ask("nvmlDeviceGetName", handle, what=what))
    uuid = _text(ask("nvmlDeviceGetUUID", handle, what=what))
    memory = ask("nvmlDeviceGetMemoryInfo", handle, what=what, required=True)
    pci = ask("nvmlDeviceGetPciInfo", handle, what=what)
    numa = ask("nvmlDeviceGetNumaNodeId", handle, what=what)
    words = max(16, -(-(os.cpu_count() or 0) // 64))  # 64-bit words: at least 1024 CPUs
    affinity = ask("nvmlDeviceGetCpuAffinity", handle, words, what=what)
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    links = []
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        if ask("nvmlDeviceGetNvLinkState", handle, link, what=what) != enabled:
            continue
        remote = ask("nvmlDeviceGetNvLinkRemotePciInfo", handle, link, what=what)
        remote_type = ask("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link, what=what)
        version = ask("nvmlDeviceGetNvLinkVersion", handle, link, what=what)
        links.append(
            NvLinkRecord(
                link=link,
                remote_bus_id=normalize_bus_id(getattr(remote, "busId", None)),
                remote_type=_REMOTE_TYPES.get(remote_type),
                version=version,
                bandwidth_GBps=NVLINK_GBPS_PER_LINK.get(version),
            )
        )
    ancestors: dict[int, str | None] = {}
    for j, other in enumerate(handles):
        if j != index:
            level = ask("nvmlDeviceGetTopologyCommonAncestor", handle, other, what=what)
            ancestors[j] = ANCESTOR_LEVELS.get(level)
    return GpuRecord(
        index=index,
        name=name,
        uuid=uuid,
        memory_bytes=int(memory.total),
        bus_id=normalize_bus_id(getattr(pci, "busId", None)),
        numa_node=numa if isinstance(numa, int) and numa >= 0 else None,
        cpu_affinity=None if affinity is None else _affinity_cpus(affinity),
        nvlinks=tuple(links),
        pcie_gen=ask("nvmlDeviceGetCurrPcieLinkGeneration", handle, what=what),
        pcie_width=ask("nvmlDeviceGetCurrPcieLinkWidth", handle, what=what),
        pcie_max_gen=ask("nvmlDeviceGetMaxPcieLinkGeneration", handle, what=what),
        pcie_max_width=ask("nvmlDeviceGetMaxPcieLinkWidth", handle, what=what),
        common_ancestor=ancestors,
        fabric=_fabric_domain(ask, nvml, handle, what),
    )


def probe_host(
    nvml: Any = None, host: str | None = None, *, sysfs_root: str | os.PathLike[str] | None = None
) -> HostProbe:
    """Ask NVML about every GPU of this host (``host``: its name, default the hostname), and sysfs about its
    NICs.

    ``nvml``: a module-like object with the ``pynvml`` API subset used here (default: ``pynvml``).
    ``sysfs_root``: where to look for NICs (:func:`topology.probe.nics.discover_nics`) and the GPUs' PCI
    paths; default ``/sys`` with the real ``pynvml`` and no NIC discovery with an injected ``nvml`` (a fake
    describes some other machine than this one's ``/sys``).
    Raises :class:`TopologyError` when NVML is unavailable (no library, no driver, no pynvml) or a required
    query (device count, handles, memory) fails; unsupported optional queries give ``None``.
    """
    injected = nvml
    if nvml is None:
        nvml = _load_pynvml()
    error_type = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except error_type as err:
        raise _unavailable(str(err)) from None
    except OSError as err:  # a broken library that pynvml did not wrap
        raise _unavailable(f"cannot load the NVML library: {err}") from None
    try:
        ask = _Asker(nvml)
        driver = _text(ask("nvmlSystemGetDriverVersion", what="system"))
        count = ask("nvmlDeviceGetCount", what="system", required=True)
        handles = [
            ask("nvmlDeviceGetHandleByIndex", i, what=f"gpu {i}", required=True) for i in range(int(count))
        ]
        gpus = tuple(_probe_gpu(ask, nvml, i, handle, handles) for i, handle in enumerate(handles))
    finally:
        with contextlib.suppress(Exception):  # a shutdown problem must not hide the probe's own result
            nvml.nvmlShutdown()
    if sysfs_root is None and injected is None:
        sysfs_root = SYSFS_ROOT
    nics = tuple(discover_nics(sysfs_root)) if sysfs_root is not None else ()
    return HostProbe(
        host=host or socket.gethostname(),
        gpus=gpus,
        driver_version=driver,
        unsupported=tuple(ask.notes),
        nics=nics,
        nic_of_gpu=nearest_nics(gpus, nics, sysfs_root) if nics and sysfs_root is not None else {},
    )


# --- graphs -----------------------------------------------------------------------------------------


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
    """The intra-host topology of one probed host (validated; graph name ``probe:<host>``).

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
    return validate(G)


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
