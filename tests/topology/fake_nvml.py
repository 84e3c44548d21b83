"""A fake NVML module for the probe's tests: replays a snapshot of what NVML answered on a host.

The snapshot format is the one ``experiments/nvml_snapshot.py`` records: every query holds
``{"value": ...}`` or ``{"error": "Not Supported", "code": 3}``. That script writes NVML structures as
``repr`` strings of dicts (``"{'total': 85520809984, ...}"``) and ctypes arrays as object reprs
(``"<pynvml.c_ulong_Array_4 object at 0x...>"``); :class:`FakeNVML` parses the former with
:func:`ast.literal_eval` and answers the latter (and every query the snapshot lacks) with "Not Supported",
as a host without that feature would. Values may also be given as plain dicts and lists, as the factories
:func:`fake_nvswitch_node` and :func:`fake_pcie_box` do.

:class:`FakeNVML` offers the subset of the ``pynvml`` API that :func:`topology.probe.nvml.probe_host` uses:
the same function names and arguments, error classes (``NVMLError(code)`` gives the matching
``NVMLError_*`` subclass, ``err.value`` is the code) and constants.

A test double, not part of the package: tests in this folder import it as ``fake_nvml`` (pytest puts the
folder on ``sys.path``).
"""

# ruff: noqa: N802, N803  (method and argument names follow pynvml)

from __future__ import annotations

import ast
import ctypes
import json
import os
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

# --- constants (values as in pynvml / nvml.h) -------------------------------------------------------

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 36

NVML_NVLINK_DEVICE_TYPE_GPU = 0x00
NVML_NVLINK_DEVICE_TYPE_IBMNPU = 0x01
NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02
NVML_NVLINK_DEVICE_TYPE_UNKNOWN = 0xFF

NVML_NVLINK_VERSION_INVALID = 0
NVML_NVLINK_VERSION_1_0 = 1
NVML_NVLINK_VERSION_2_0 = 2
NVML_NVLINK_VERSION_2_2 = 3
NVML_NVLINK_VERSION_3_0 = 4
NVML_NVLINK_VERSION_3_1 = 5
NVML_NVLINK_VERSION_4_0 = 6
NVML_NVLINK_VERSION_5_0 = 7
NVML_NVLINK_VERSION_6_0 = 8

NVML_GPU_FABRIC_UUID_LEN = 16
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = 0
NVML_GPU_FABRIC_STATE_NOT_STARTED = 1
NVML_GPU_FABRIC_STATE_IN_PROGRESS = 2
NVML_GPU_FABRIC_STATE_COMPLETED = 3

NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_SYSTEM = 50

# code -> (class name suffix, message), as pynvml names them
_ERRORS = {
    NVML_ERROR_UNINITIALIZED: ("Uninitialized", "Uninitialized"),
    NVML_ERROR_INVALID_ARGUMENT: ("InvalidArgument", "Invalid Argument"),
    NVML_ERROR_NOT_SUPPORTED: ("NotSupported", "Not Supported"),
    NVML_ERROR_NO_PERMISSION: ("NoPermission", "Insufficient Permissions"),
    NVML_ERROR_NOT_FOUND: ("NotFound", "Not Found"),
    NVML_ERROR_DRIVER_NOT_LOADED: ("DriverNotLoaded", "Driver Not Loaded"),
    NVML_ERROR_LIBRARY_NOT_FOUND: ("LibraryNotFound", "NVML Shared Library Not Found"),
    NVML_ERROR_FUNCTION_NOT_FOUND: ("FunctionNotFound", "Function Not Found"),
    NVML_ERROR_GPU_IS_LOST: ("GpuIsLost", "GPU is lost"),
    NVML_ERROR_UNKNOWN: ("Unknown", "Unknown Error"),
}
_CODE_OF_MESSAGE = {message: code for code, (_, message) in _ERRORS.items()}


class NVMLError(Exception):
    """Like ``pynvml.NVMLError``: ``NVMLError(code)`` is an instance of the code's subclass; ``.value``."""

    _classes: dict[int, type[NVMLError]] = {}
    value: int

    def __new__(cls, value: int | None = None):
        if cls is NVMLError:
            cls = NVMLError._classes.get(value, NVMLError)  # type: ignore[arg-type]
        obj = Exception.__new__(cls)
        obj.value = getattr(cls, "_code", value)
        return obj

    def __init__(self, value: int | None = None) -> None:
        super().__init__(self.value)

    def __str__(self) -> str:
        return _ERRORS.get(self.value, ("", f"NVML Error with code {self.value}"))[1]


def _make_error_classes() -> dict[str, type[NVMLError]]:
    classes = {}
    for code, (suffix, _) in _ERRORS.items():
        cls = type(f"NVMLError_{suffix}", (NVMLError,), {"_code": code, "__module__": __name__})
        NVMLError._classes[code] = cls
        classes[cls.__name__] = cls
    return classes


_ERROR_CLASSES = _make_error_classes()
globals().update(_ERROR_CLASSES)
NVMLError_NotSupported = _ERROR_CLASSES["NVMLError_NotSupported"]
NVMLError_LibraryNotFound = _ERROR_CLASSES["NVMLError_LibraryNotFound"]
NVMLError_DriverNotLoaded = _ERROR_CLASSES["NVMLError_DriverNotLoaded"]

_CONSTANTS = {name: value for name, value in dict(globals()).items() if name.startswith("NVML_")}

# --- snapshot parsing -------------------------------------------------------------------------------

_UNKNOWN = object()  # a recorded value that cannot be read back (an object repr)


def _parse_value(value: Any) -> Any:
    """A recorded value as data: dict-like repr strings are parsed, object reprs are unknown."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("<") and text.endswith(">"):
            return _UNKNOWN
        if text[:1] in "{[(":
            try:
                return ast.literal_eval(text)
            except (ValueError, SyntaxError):
                return _UNKNOWN
    return value


def _answer(entry: Any) -> tuple[str, Any]:
    """``("value", v)`` or ``("error", code)`` for one recorded query; missing -> Not Supported."""
    if not isinstance(entry, dict):
        return ("error", NVML_ERROR_NOT_SUPPORTED)
    if "error" in entry:
        code = entry.get("code")
        if not isinstance(code, int):
            code = _CODE_OF_MESSAGE.get(str(entry["error"]), NVML_ERROR_UNKNOWN)
        return ("error", code)
    if "value" not in entry:
        return ("error", NVML_ERROR_NOT_SUPPORTED)
    value = _parse_value(entry["value"])
    if value is _UNKNOWN or value is None:
        return ("error", NVML_ERROR_NOT_SUPPORTED)
    return ("value", value)


class _Handle:
    """A device handle of the fake (the real one is an opaque ctypes pointer)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<fake nvmlDevice {self.index}>"


class c_nvmlGpuFabricInfoV_t(ctypes.Structure):  # noqa: N801  (pynvml's name and layout, v2)
    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * NVML_GPU_FABRIC_UUID_LEN),
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
        ("healthMask", ctypes.c_uint32),
    ]


class FakeNVML:
    """A module-like stand-in for ``pynvml`` answering from ``snapshot`` (see the module docstring).

    ``init_error``: an NVML error code that :meth:`nvmlInit` raises (e.g. ``NVML_ERROR_LIBRARY_NOT_FOUND``
    to play a host without the driver). ``unsupported``: names of query functions that answer
    "Not Supported" whatever the snapshot says.
    """

    NVMLError = NVMLError  # the error classes and NVML_* constants are set below the class
    c_nvmlGpuFabricInfoV_t = c_nvmlGpuFabricInfoV_t

    def __init__(
        self, snapshot: dict, *, init_error: int | None = None, unsupported: Iterable[str] = ()
    ) -> None:
        self.snapshot = snapshot
        self.init_error = init_error
        self.unsupported = frozenset(unsupported)
        self.initialized = False
        devices = snapshot.get("devices", [])
        self._count = int(snapshot.get("count", len(devices)))
        self._devices = list(devices)

    @classmethod
    def from_snapshot(cls, path: str | os.PathLike, **kwargs: Any) -> FakeNVML:
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f), **kwargs)

    # --- plumbing -----------------------------------------------------------------------------------

    def _check(self, fn: str) -> None:
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if fn in self.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)

    def _device(self, handle: Any) -> dict:
        if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self._devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._devices[handle.index]

    def _reply(self, fn: str, entry: Any) -> Any:
        self._check(fn)
        kind, value = _answer(entry)
        if kind == "error":
            raise NVMLError(value)
        return value

    def _link(self, handle: Any, link: int) -> dict:
        if not 0 <= link < NVML_NVLINK_MAX_LINKS:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        for entry in self._device(handle).get("nvlink", []):
            if entry.get("link") == link:
                return entry
        return {}

    # --- system -------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._reply("nvmlSystemGetDriverVersion", self.snapshot.get("driver"))

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return self._count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < min(self._count, len(self._devices)):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    # --- device -------------------------------------------------------------------------------------

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._reply("nvmlDeviceGetName", self._device(handle).get("name"))

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._reply("nvmlDeviceGetUUID", self._device(handle).get("uuid"))

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> SimpleNamespace:
        value = self._reply("nvmlDeviceGetMemoryInfo", self._device(handle).get("memory"))
        return SimpleNamespace(**value)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> SimpleNamespace:
        value = self._reply("nvmlDeviceGetPciInfo", self._device(handle).get("pci"))
        return SimpleNamespace(**value)

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        return self._reply("nvmlDeviceGetNumaNodeId", self._device(handle).get("numa_node"))

    def nvmlDeviceGetCpuAffinity(self, handle: Any, cpuSetSize: int) -> list[int]:
        words = self._reply("nvmlDeviceGetCpuAffinity", self._device(handle).get("cpu_affinity"))
        if not isinstance(words, Sequence) or not all(isinstance(w, int) for w in words):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return (list(words) + [0] * cpuSetSize)[:cpuSetSize]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return self._reply("nvmlDeviceGetCurrPcieLinkGeneration", self._device(handle).get("pcie_link_gen"))

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self._reply("nvmlDeviceGetCurrPcieLinkWidth", self._device(handle).get("pcie_link_width"))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        entry = self._device(handle).get("pcie_max_link_gen")
        return self._reply("nvmlDeviceGetMaxPcieLinkGeneration", entry)

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        entry = self._device(handle).get("pcie_max_link_width")
        return self._reply("nvmlDeviceGetMaxPcieLinkWidth", entry)

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        return self._reply("nvmlDeviceGetNvLinkState", self._link(handle, link).get("state"))

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> SimpleNamespace:
        value = self._reply("nvmlDeviceGetNvLinkRemotePciInfo", self._link(handle, link).get("remote_pci"))
        return SimpleNamespace(**value)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        entry = self._link(handle, link).get("remote_type")
        return self._reply("nvmlDeviceGetNvLinkRemoteDeviceType", entry)

    def nvmlDeviceGetNvLinkVersion(self, handle: Any, link: int) -> int:
        return self._reply("nvmlDeviceGetNvLinkVersion", self._link(handle, link).get("version"))

    def nvmlDeviceGetGpuFabricInfoV(self, handle: Any, gpuFabricInfo: Any) -> int:
        """Fills the ``c_nvmlGpuFabricInfoV_t`` passed by ``ctypes.byref``, as pynvml does; the snapshot's
        ``fabric`` entry holds its fields (``clusterUuid`` as 16 ints)."""
        value = self._reply("nvmlDeviceGetGpuFabricInfoV", self._device(handle).get("fabric"))
        info = getattr(gpuFabricInfo, "_obj", gpuFabricInfo)
        info.clusterUuid[:] = list(value["clusterUuid"])
        info.status, info.cliqueId, info.state = value["status"], value["cliqueId"], value["state"]
        return NVML_SUCCESS

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        self._device(device2)
        entry = self._device(device1).get("common_ancestor", {}).get(str(device2.index))
        return self._reply("nvmlDeviceGetTopologyCommonAncestor", entry)


for _name, _value in {**_ERROR_CLASSES, **_CONSTANTS}.items():
    setattr(FakeNVML, _name, _value)
del _name, _value


# --- factories --------------------------------------------------------------------------------------

_NOT_SUPPORTED = {"error": "Not Supported", "code": NVML_ERROR_NOT_SUPPORTED}
# Real H100 80GB HBM3 total memory, as the recorded VM snapshot reports it.
H100_MEMORY_BYTES = 85520809984
# PCI bus ids of the eight GPUs and four NVSwitches of an HGX H100 baseboard (illustrative).
_HGX_GPU_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
_HGX_SWITCH_BUSES = (0x05, 0x06, 0x07, 0x08)


def _bus_id(bus: int) -> str:
    return f"00000000:{bus:02X}:00.0"


def _pci(bus: int) -> dict:
    return {
        "busIdLegacy": f"0000:{bus:02X}:00.0",
        "domain": 0,
        "bus": bus,
        "device": 0,
        "busId": _bus_id(bus),
    }


def _affinity_words(cpus: Iterable[int], words: int = 4) -> list[int]:
    out = [0] * words
    for cpu in cpus:
        out[cpu // 64] |= 1 << (cpu % 64)
    return out


def _device(
    index: int,
    name: str,
    uuid: str,
    memory: int,
    bus: int,
    numa: int,
    cpus: Iterable[int],
    pcie_gen: int,
    pcie_width: int,
) -> dict:
    return {
        "index": index,
        "name": {"value": name},
        "uuid": {"value": uuid},
        "memory": {"value": {"total": memory, "free": memory, "used": 0}},
        "pci": {"value": _pci(bus)},
        "numa_node": {"value": numa},
        "cpu_affinity": {"value": _affinity_words(cpus)},
        "pcie_link_gen": {"value": pcie_gen},
        "pcie_link_width": {"value": pcie_width},
        "pcie_max_link_gen": {"value": pcie_gen},
        "pcie_max_link_width": {"value": pcie_width},
        "nvlink": [{"link": link, "state": dict(_NOT_SUPPORTED)} for link in range(NVML_NVLINK_MAX_LINKS)],
        "common_ancestor": {},
    }


def _snapshot(devices: list[dict]) -> dict:
    return {
        "driver": {"value": "fake"},
        "nvml": {"value": "fake"},
        "count": len(devices),
        "devices": devices,
    }


def fake_nvswitch_node(num_gpus: int = 8, *, tag: str = "0") -> FakeNVML:
    """An HGX H100 SXM node: ``num_gpus`` H100 80 GB, each with 18 NVLink 4 links to the NVSwitches.

    PCIe gen5 x16; two NUMA nodes (first half / second half of the GPUs, 48 CPUs each); common ancestor
    NODE within a NUMA node, SYSTEM across. ``tag`` makes the UUIDs differ between fake hosts.
    """
    half = max(1, num_gpus // 2)
    devices = []
    for i in range(num_gpus):
        numa = min(i // half, 1)
        bus = _HGX_GPU_BUSES[i] if i < len(_HGX_GPU_BUSES) else 0xE0 + i
        dev = _device(
            i,
            "NVIDIA H100 80GB HBM3",
            f"GPU-fake{tag}-nvsw-{i:04d}",
            H100_MEMORY_BYTES,
            bus,
            numa,
            range(48 * numa, 48 * numa + 48),
            5,
            16,
        )
        for link in range(18):
            switch = _HGX_SWITCH_BUSES[(link * len(_HGX_SWITCH_BUSES)) // 18]
            dev["nvlink"][link] = {
                "link": link,
                "state": {"value": NVML_FEATURE_ENABLED},
                "remote_pci": {"value": _pci(switch)},
                "remote_type": {"value": NVML_NVLINK_DEVICE_TYPE_SWITCH},
                "version": {"value": NVML_NVLINK_VERSION_4_0},
            }
        for j in range(num_gpus):
            if j != i:
                same = min(j // half, 1) == numa
                level = NVML_TOPOLOGY_NODE if same else NVML_TOPOLOGY_SYSTEM
                dev["common_ancestor"][str(j)] = {"value": level}
        devices.append(dev)
    return FakeNVML(_snapshot(devices))


def fake_nvl72_tray(
    num_gpus: int = 4,
    *,
    clique: int = 1,
    cluster: int = 0x72,
    state: int = NVML_GPU_FABRIC_STATE_COMPLETED,
    tag: str = "0",
) -> FakeNVML:
    """A GB200 NVL72-class compute tray: ``num_gpus`` GPUs (186 GB), each with 18 NVLink 5 links to the
    rack's NVSwitch trays, registered by the fabric manager in clique ``clique`` of cluster ``cluster``
    (the cluster UUID's bytes are ``cluster`` repeated). ``state``: the fabric registration state."""
    devices = []
    for i in range(num_gpus):
        numa = i // 2  # two Grace CPUs per tray, 72 cores each
        cpus = range(72 * numa, 72 * numa + 72)
        dev = _device(
            i, "NVIDIA GB200", f"GPU-fake{tag}-nvl72-{i:04d}", 186 * 2**30, 0x08 + i, numa, cpus, 5, 16
        )
        for link in range(18):
            dev["nvlink"][link] = {
                "link": link,
                "state": {"value": NVML_FEATURE_ENABLED},
                "remote_pci": {"value": _pci(0xC0 + link % 2)},
                "remote_type": {"value": NVML_NVLINK_DEVICE_TYPE_SWITCH},
                "version": {"value": NVML_NVLINK_VERSION_5_0},
            }
        uuid = [cluster & 0xFF] * NVML_GPU_FABRIC_UUID_LEN
        dev["fabric"] = {
            "value": {"clusterUuid": uuid, "status": NVML_SUCCESS, "cliqueId": clique, "state": state}
        }
        devices.append(dev)
    return FakeNVML(_snapshot(devices))


def fake_pcie_box(num_gpus: int = 4, *, pcie_gen: int = 4, tag: str = "0") -> FakeNVML:
    """A PCIe-only box: ``num_gpus`` L40S 48 GB without NVLink, PCIe gen ``pcie_gen`` x16, one NUMA node.

    GPUs sit in pairs under PCIe switches: common ancestor MULTIPLE within a pair, HOSTBRIDGE between the
    pairs of a quad, NODE beyond.
    """
    devices = []
    for i in range(num_gpus):
        dev = _device(
            i, "NVIDIA L40S", f"GPU-fake{tag}-pcie-{i:04d}", 46068 * 2**20, 0x41 + 0x10 * i, 0, range(32),
            pcie_gen, 16,
        )  # fmt: skip
        for j in range(num_gpus):
            if j != i:
                if i // 2 == j // 2:
                    level = NVML_TOPOLOGY_MULTIPLE
                elif i // 4 == j // 4:
                    level = NVML_TOPOLOGY_HOSTBRIDGE
                else:
                    level = NVML_TOPOLOGY_NODE
                dev["common_ancestor"][str(j)] = {"value": level}
        devices.append(dev)
    return FakeNVML(_snapshot(devices))


def from_snapshot(path: str | os.PathLike, **kwargs: Any) -> FakeNVML:
    """A :class:`FakeNVML` replaying a snapshot file written by ``experiments/nvml_snapshot.py``."""
    return FakeNVML.from_snapshot(path, **kwargs)
