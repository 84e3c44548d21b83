"""PCI bus ids in the two spellings the probe meets: NVML's and sysfs'.

NVML's ``busId`` is ``"DDDDDDDD:BB:DD.F"`` (8 hex digits of domain, upper case); sysfs names devices
``"dddd:bb:dd.f"`` (at least 4 hex digits of domain, lower case). Both parsers accept either spelling, with
or without a domain. Shared by :mod:`topology.probe.nvml` (GPUs), :mod:`topology.probe.nics` (NICs) and
:mod:`topology.probe.session` (the GPU a rank runs on).
"""

from __future__ import annotations

import re
from typing import Any

_BUS_ID = re.compile(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")


def _parse(text: str) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function) of a bus id, or None when ``text`` is not one."""
    m = _BUS_ID.fullmatch(text)
    if not m:
        return None
    return int(m[1] or "0", 16), int(m[2], 16), int(m[3], 16), int(m[4])


def normalize_bus_id(bus_id: Any) -> str | None:
    """A PCI bus id as NVML's ``busId`` spells it ("00000000:18:00.0"); legacy 4-digit domains widened.
    Bytes are decoded and trailing NULs dropped; text that is not a bus id comes back stripped."""
    if bus_id is None:
        return None
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode(errors="replace")
    text = str(bus_id).strip().rstrip("\x00")
    parts = _parse(text)
    if parts is None:
        return text or None
    domain, bus, dev, fn = parts
    return f"{domain:08X}:{bus:02X}:{dev:02X}.{fn}"


def sysfs_bus_id(bus_id: str | None) -> str | None:
    """The sysfs spelling of a PCI bus id: NVML's "00000000:18:00.0" -> "0000:18:00.0" (lower case, domain
    at least 4 digits, as ``/sys/bus/pci/devices`` names it); None when ``bus_id`` is not one."""
    if not bus_id:
        return None
    parts = _parse(bus_id.strip().rstrip("\x00"))
    if parts is None:
        return None
    domain, bus, dev, fn = parts
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn}"
