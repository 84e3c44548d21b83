"""The NVML half of the cluster probe: what one host's driver says about its GPUs.

:func:`probe_host` asks NVML (``pynvml``, imported lazily, or any module-like object with the same API,
e.g. the test double ``FakeNVML`` in ``tests/topology/fake_nvml.py``) for each GPU's memory (bytes), PCI bus
id, NUMA node, CPU affinity, PCIe link, active NVLinks and the common PCIe ancestor of every GPU pair, and
sysfs (:mod:`topology.probe.nics`) for the NICs NVML cannot see and the nearest one to each GPU. Queries the
host does not support (VMs often answer "Not Supported" for NVLink and NUMA) give ``None``. The result is a
:class:`HostProbe`; :mod:`topology.probe.nominal_graph` turns probes into a topology graph.

Bandwidths (GB/s, 1e9 B/s, per direction) are *nominal* figures from the link generation tables below,
not measurements; the collective half of the probe measures the real ones.
"""

# ruff: noqa: N802, N815  (unit suffixes such as _GBps keep their case: B = bytes)

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from core.errors import TopologyError
from topology.probe.nics import SYSFS_ROOT, NicRecord, discover_nics, nearest_nics
from topology.probe.pci import normalize_bus_id

# NVLink bandwidth per link, per direction, GB/s (1e9 B/s), keyed by the NVML version *enum* that
# nvmlDeviceGetNvLinkVersion returns (NVML_NVLINK_VERSION_*: 1 = 1.0, 2 = 2.0, 3 = 2.2, 4 = 3.0, 5 = 3.1,
# 6 = 4.0, 7 = 5.0; it is not the generation number, see hwloc issue open-mpi/hwloc#658: A100 returns 5).
# Source: NVIDIA's NVLink product page (nvidia.com/en-us/data-center/nvlink/) gives the bidirectional
# total per GPU and the link count: gen 2 (V100) 300 GB/s over 6 links, gen 3 (A100) 600 GB/s over 12,
# gen 4 (H100) 900 GB/s over 18, gen 5 (B200) 1800 GB/s over 18; P100 (gen 1) 160 GB/s over 4. Per link
# per direction = total / links / 2: 20, 25, 25, 25, 50. So an H100 SXM with 18 NVLink 4 links has
# 18 x 25 = 450 GB/s per direction. 2.2 and 3.1 are sub-versions with the signalling of 2.0 and 3.0.
# NVLink 6 (enum 8) is left out (no per-link figure we can vouch for); unknown versions use
# UNKNOWN_NVLINK_GBPS in topology.probe.nominal_graph, marked basis="default".
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
