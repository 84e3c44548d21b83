"""NICs where visible: the host's network adapters as sysfs describes them, and the nearest one per GPU.

NVML cannot see NICs, so :mod:`topology.probe.nvml` asks Linux sysfs instead:

* RDMA devices (InfiniBand, RoCE): ``<root>/class/infiniband/<dev>``; the PCI function is the name of the
  ``device`` link's target, the rate ``ports/<n>/rate`` ("400 Gb/sec (4X NDR)" is 50 GB/s per direction),
  ``ports/<n>/link_layer`` and ``ports/<n>/state`` ("4: ACTIVE") describe the port (the first active
  port, else the first port).
* Network interfaces: ``<root>/class/net/<if>`` with a ``device`` link (virtual interfaces such as ``lo``,
  ``docker0``, ``veth*``, bridges and bonds have none; wireless ones are skipped), the speed from
  ``speed`` in Mb/s (-1, 0 or unreadable: unknown). An interface on the PCI function of an RDMA device
  (IPoIB, the netdev of a RoCE port) is not listed again: the RDMA record names it in ``netdev``.

:func:`nearest_nics` gives each GPU the NIC whose sysfs device path shares the longest prefix with the
GPU's (the same PCIe switch before the same root complex), ties broken by NUMA node and then by load.
Every reader here tolerates missing or unreadable files (containers and VMs show partial trees); nothing
raises for what sysfs does not say.
"""

# ruff: noqa: N802, N815  (unit suffixes such as _GBps keep their case: B = bytes)

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from topology.probe.pci import normalize_bus_id, sysfs_bus_id

SYSFS_ROOT = "/sys"

_PCI_ADDRESS = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")
_SPEED_UNKNOWN = (0xFFFFFFFF, 0xFFFF)  # SPEED_UNKNOWN as u32 / u16 in some drivers


@dataclass(frozen=True)
class NicRecord:
    """One network adapter as sysfs shows it; ``None`` where sysfs does not say."""

    name: str  # RDMA device ("mlx5_0") or interface ("eth0")
    kind: str  # "rdma" or "ethernet"
    bus_id: str | None  # PCI function, normalized like NVML's ("00000000:18:00.0")
    bandwidth_GBps: float | None  # port rate / link speed, per direction, GB = 1e9 B
    numa_node: int | None
    pci_path: str | None  # resolved sysfs device path, e.g. /sys/devices/pci0000:17/0000:17:00.0/...
    link_layer: str | None = None  # RDMA: "InfiniBand" or "Ethernet" (RoCE)
    state: str | None = None  # RDMA port state ("ACTIVE", "DOWN", ...) or interface operstate ("up", ...)
    port: int | None = None  # RDMA: the port described
    netdev: str | None = None  # RDMA: a network interface on the same PCI function

    @property
    def up(self) -> bool | None:
        """Whether the link is up; None when sysfs does not say."""
        if self.state is None:
            return None
        return self.state.upper() in ("ACTIVE", "UP")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except (OSError, ValueError):  # missing file, EINVAL (speed of a down link), not a file
        return None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text, 0)
    except ValueError:
        return None


def rate_GBps(text: str | None) -> float | None:
    """GB/s per direction from an RDMA port rate ("400 Gb/sec (4X NDR)" -> 50.0); None when unknown."""
    m = _RATE.search(text or "")
    if not m or float(m[1]) <= 0:
        return None
    return float(m[1]) / 8


def speed_GBps(text: str | None) -> float | None:
    """GB/s per direction from a ``class/net/<if>/speed`` value in Mb/s; None for -1, 0 or garbage."""
    value = _int(text)
    if value is None or value <= 0 or value in _SPEED_UNKNOWN:
        return None
    return value / 8000


def _pci_function(path: str | None) -> str | None:
    """The PCI address of the nearest PCI device on a resolved sysfs path (the device, or the PCI function
    it hangs off: a virtio-net device sits under its virtio PCI function)."""
    if not path:
        return None
    for part in reversed(path.split(os.sep)):
        if _PCI_ADDRESS.fullmatch(part):
            return part
    return None


def _numa(path: str | None) -> int | None:
    """``numa_node`` of the device at ``path`` or, failing that, of its PCI function; -1 -> None."""
    if not path:
        return None
    node = _int(_read(os.path.join(path, "numa_node")))
    if node is None:
        address = _pci_function(path)
        if address and address in path:
            pci = path[: path.rindex(address) + len(address)]
            node = _int(_read(os.path.join(pci, "numa_node")))
    return node if node is not None and node >= 0 else None


def _device_path(entry: str) -> str | None:
    """Resolved target of ``<entry>/device``; None when there is no such link (virtual devices)."""
    link = os.path.join(entry, "device")
    if not os.path.islink(link):
        return None
    try:
        path = os.path.realpath(link)
    except OSError:
        return None
    return path if os.path.isdir(path) else None


def _record(
    name: str, kind: str, path: str | None, bandwidth_GBps: float | None, **details: Any
) -> NicRecord:
    """The record of NIC ``name`` whose device sysfs resolves to ``path``: its PCI function's bus id and
    NUMA node read from there; ``details``: the remaining :class:`NicRecord` fields."""
    address = _pci_function(path)
    return NicRecord(
        name=name,
        kind=kind,
        bus_id=normalize_bus_id(address) if address else None,
        bandwidth_GBps=bandwidth_GBps,
        numa_node=_numa(path),
        pci_path=path,
        **details,
    )


def _entries(root: str, cls: str) -> list[tuple[str, str, str | None]]:
    """(name, sysfs entry, resolved device path or None) of each device in ``<root>/class/<cls>``, by name."""
    base = os.path.join(root, "class", cls)
    return [
        (name, os.path.join(base, name), _device_path(os.path.join(base, name))) for name in _listdir(base)
    ]


def _rdma(root: str) -> list[NicRecord]:
    out = []
    for name, entry, path in _entries(root, "infiniband"):
        ports = []
        for port in _listdir(os.path.join(entry, "ports")):
            number = _int(port)
            if number is None:
                continue
            where = os.path.join(entry, "ports", port)
            state = _read(os.path.join(where, "state"))
            state = state.split(":", 1)[-1].strip() if state else None  # "4: ACTIVE" -> "ACTIVE"
            ports.append(
                (number, state, rate_GBps(_read(os.path.join(where, "rate"))), _read(f"{where}/link_layer"))
            )
        active = [p for p in ports if p[1] and p[1].upper() == "ACTIVE"]
        number, state, bw, layer = (active or ports or [(None, None, None, None)])[0]
        out.append(
            _record(name, "rdma", path, bw, link_layer=layer or None, state=state or None, port=number)
        )
    return out


def _ethernet(root: str) -> list[NicRecord]:
    out = []
    for name, entry, path in _entries(root, "net"):
        if path is None:  # lo, docker0, veth*, bridges, bonds, tunnels
            continue
        if os.path.isdir(os.path.join(entry, "wireless")) or os.path.isdir(os.path.join(entry, "phy80211")):
            continue
        bw = speed_GBps(_read(os.path.join(entry, "speed")))
        out.append(_record(name, "ethernet", path, bw, state=_read(os.path.join(entry, "operstate")) or None))
    return out


def discover_nics(sysfs_root: str | os.PathLike[str] = SYSFS_ROOT) -> list[NicRecord]:
    """The RDMA devices, then the PCI network interfaces, each sorted by name, under ``sysfs_root``.

    An interface on the PCI function of an RDMA device is folded into that device's record (``netdev``).
    An absent or unreadable tree gives ``[]``; this never raises for what sysfs lacks.
    """
    root = os.fspath(sysfs_root)
    rdma = _rdma(root)
    by_path = {nic.pci_path: i for i, nic in enumerate(rdma) if nic.pci_path}
    by_bus = {nic.bus_id: i for i, nic in enumerate(rdma) if nic.bus_id}
    ethernet = []
    for nic in _ethernet(root):
        i = by_path.get(nic.pci_path)
        if (
            i is None
            and nic.bus_id is not None
            and nic.pci_path
            and _PCI_ADDRESS.fullmatch(os.path.basename(nic.pci_path))
        ):
            i = by_bus.get(nic.bus_id)
        if i is None:
            ethernet.append(nic)
        elif rdma[i].netdev is None:
            rdma[i] = dataclasses.replace(rdma[i], netdev=nic.name)
    return rdma + ethernet


# --- GPU -> NIC ---------------------------------------------------------------------------------------


def pci_path(bus_id: str | None, sysfs_root: str | os.PathLike[str] = SYSFS_ROOT) -> str | None:
    """Resolved sysfs path of PCI device ``bus_id`` (any domain width); None when sysfs does not list it."""
    name = sysfs_bus_id(bus_id)
    if name is None:
        return None
    link = os.path.join(os.fspath(sysfs_root), "bus", "pci", "devices", name)
    try:
        path = os.path.realpath(link)
    except OSError:
        return None
    return path if os.path.isdir(path) else None


def _parts(path: str | None, devices: str) -> list[str]:
    """Components of ``path`` below ``<root>/devices`` (the PCI hierarchy), or all of them."""
    if not path:
        return []
    rel = os.path.relpath(path, devices) if path.startswith(devices + os.sep) else path
    return [p for p in rel.split(os.sep) if p]


def _shared(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _candidates(nics: Sequence[NicRecord]) -> list[NicRecord]:
    """The NICs GPUs should use: RDMA devices when there are any, else the interfaces; within those, the ones
    known to be up when any are."""
    pool = [n for n in nics if n.kind == "rdma"] or list(nics)
    return [n for n in pool if n.up is not False] or pool


def nearest_nics(
    gpus: Sequence[Any],
    nics: Sequence[NicRecord],
    sysfs_root: str | os.PathLike[str] = SYSFS_ROOT,
) -> dict[int, str]:
    """NVML index -> name of the NIC each GPU should use; ``{}`` when there is no NIC.

    ``gpus``: records with ``index``, ``bus_id`` and ``numa_node`` (:class:`topology.probe.nvml.GpuRecord`);
    their sysfs paths come from ``<sysfs_root>/bus/pci/devices/<bus id>``. Candidates are the RDMA devices
    when there are any, else all NICs (those known to be down only when no other is left). Each GPU, in
    index order, gets the candidate sharing the longest sysfs path prefix with it; ties go to the same NUMA
    node, then to the NIC with the fewest GPUs so far, then by name. Several GPUs may share a NIC.
    """
    pool = _candidates(nics)
    if not pool:
        return {}
    root = os.fspath(sysfs_root)
    devices = os.path.realpath(os.path.join(root, "devices"))
    nic_parts = {nic.name: _parts(nic.pci_path, devices) for nic in pool}
    load = {nic.name: 0 for nic in pool}
    out: dict[int, str] = {}
    for gpu in sorted(gpus, key=lambda g: g.index):
        parts = _parts(pci_path(gpu.bus_id, root), devices)
        numa = gpu.numa_node

        def score(nic: NicRecord, parts: list[str] = parts, numa: int | None = numa) -> tuple:
            same_numa = numa is not None and nic.numa_node == numa
            return (-_shared(parts, nic_parts[nic.name]), not same_numa, load[nic.name], nic.name)

        best = min(pool, key=score)
        out[gpu.index] = best.name
        load[best.name] += 1
    return out
