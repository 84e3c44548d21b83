"""NIC discovery from sysfs and GPU -> NIC placement, against fake sysfs trees built in tmp_path."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from fake_nvml import fake_nvswitch_node

from topology import cluster_view, read_json, validate, write_json
from topology.probe import (
    NicRecord,
    discover_nics,
    host_graph,
    merge_hosts,
    nearest_nics,
    probe_host,
    real_nic_id,
)
from topology.probe.nics import pci_path, rate_GBps, speed_GBps
from topology.probe.nominal_graph import NIC_GBPS
from topology.probe.nvml import GpuRecord
from topology.probe.pci import sysfs_bus_id

GB = 1e9
# fake_nvswitch_node's GPU buses, two per PCIe switch (HGX H100 baseboard order).
GPU_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
ROOT_BUSES = (0x15, 0x37, 0x97, 0xB7)  # one root complex per PCIe switch
# NIC names deliberately out of switch order: placement must follow the PCI tree, not the names.
NIC_OF_SWITCH = ("mlx5_3", "mlx5_0", "mlx5_2", "mlx5_1")


def _pci(root: Path, *chain: str, numa: int | None = None) -> Path:
    """Create the PCI device at ``devices/<chain...>`` with its ``bus/pci/devices`` link."""
    path = root / "devices" / Path(*chain)
    path.mkdir(parents=True, exist_ok=True)
    if numa is not None:
        (path / "numa_node").write_text(f"{numa}\n")
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    link = links / chain[-1]
    if not link.exists():
        os.symlink(os.path.relpath(path, links), link)
    return path


def _rdma(root: Path, name: str, device: Path, rate: str = "400 Gb/sec (4X NDR)", state: str = "4: ACTIVE"):
    entry = root / "class" / "infiniband" / name
    port = entry / "ports" / "1"
    port.mkdir(parents=True)
    (port / "rate").write_text(rate + "\n")
    (port / "link_layer").write_text("InfiniBand\n")
    (port / "state").write_text(state + "\n")
    os.symlink(os.path.relpath(device, entry), entry / "device")


def _net(root: Path, name: str, device: Path | None, speed: str | None = None, operstate: str = "up"):
    """A network interface; ``device=None``: a virtual one (no ``device`` link)."""
    entry = root / "class" / "net" / name
    entry.mkdir(parents=True)
    (entry / "operstate").write_text(operstate + "\n")
    if speed is not None:
        (entry / "speed").write_text(speed + "\n")
    if device is not None:
        os.symlink(os.path.relpath(device, entry), entry / "device")
    return entry


def hgx_sysfs(root: Path) -> Path:
    """An HGX H100 node: 8 GPUs and 4 RDMA NICs (400 Gb/s) under 4 PCIe switches, 2 GPUs and 1 NIC each;
    switches 0-1 on NUMA node 0, 2-3 on node 1; IPoIB interfaces, a 1 GbE management port and ``lo``."""
    for s, rc in enumerate(ROOT_BUSES):
        numa = s // 2
        upstream = (f"pci0000:{rc:02x}", f"0000:{rc:02x}:01.0", f"0000:{rc + 1:02x}:00.0")
        for k, bus in enumerate(GPU_BUSES[2 * s : 2 * s + 2]):
            _pci(root, *upstream, f"0000:{rc + 2:02x}:{k:02x}.0", f"0000:{bus:02x}:00.0", numa=numa)
        nic = _pci(root, *upstream, f"0000:{rc + 2:02x}:02.0", f"0000:{rc + 3:02x}:00.0", numa=numa)
        _rdma(root, NIC_OF_SWITCH[s], nic)
        _net(root, f"ibp{rc + 3}s0", nic, speed="400000")
    mgmt = _pci(root, "pci0000:00", "0000:00:1c.0", "0000:03:00.0", numa=0)
    _net(root, "eno1", mgmt, speed="1000")
    _net(root, "lo", None)
    return root


def _gpu(index: int, bus_id: str | None, numa: int | None) -> GpuRecord:
    return GpuRecord(index, None, None, 1, bus_id, numa, None, (), None, None, None, None)


# --- discovery --------------------------------------------------------------------------------------


def test_discover_hgx(tmp_path):
    nics = discover_nics(hgx_sysfs(tmp_path))
    assert [(n.name, n.kind) for n in nics] == [
        ("mlx5_0", "rdma"),
        ("mlx5_1", "rdma"),
        ("mlx5_2", "rdma"),
        ("mlx5_3", "rdma"),
        ("eno1", "ethernet"),
    ]  # IPoIB interfaces folded into their RDMA device, lo skipped
    mlx = nics[3]  # under switch 0
    assert mlx.bus_id == f"00000000:{ROOT_BUSES[0] + 3:02X}:00.0"
    assert mlx.bandwidth_GBps == 50.0
    assert mlx.numa_node == 0 and mlx.link_layer == "InfiniBand" and mlx.state == "ACTIVE" and mlx.up
    assert mlx.port == 1 and mlx.netdev == f"ibp{ROOT_BUSES[0] + 3}s0"
    rc = ROOT_BUSES[0]
    assert mlx.pci_path == os.path.realpath(
        tmp_path / "devices" / f"pci0000:{rc:02x}" / f"0000:{rc:02x}:01.0" / f"0000:{rc + 1:02x}:00.0"
        / f"0000:{rc + 2:02x}:02.0" / f"0000:{rc + 3:02x}:00.0"
    )  # fmt: skip
    eno = nics[4]
    assert eno.bus_id == "00000000:03:00.0" and eno.bandwidth_GBps == 0.125 and eno.state == "up"
    assert eno.numa_node == 0 and eno.link_layer is None


def test_virtual_only_box_has_no_nics(tmp_path):
    _net(tmp_path, "lo", None)
    _net(tmp_path, "docker0", None)
    _net(tmp_path, "veth1a2b", None, speed="10000")
    assert discover_nics(tmp_path) == []
    assert discover_nics(tmp_path / "missing") == []
    assert nearest_nics([_gpu(0, "00000000:18:00.0", 0)], [], tmp_path) == {}

    probe = probe_host(fake_nvswitch_node(4), host="box", sysfs_root=tmp_path)
    assert probe.nics == () and probe.nic_of_gpu == {}
    G = merge_hosts([probe, probe_host(fake_nvswitch_node(4, tag="1"), host="box2", sysfs_root=tmp_path)])
    nics = sorted(n for n, a in G.nodes(data=True) if a["kind"] == "nic" and a["host"] == "box")
    assert nics == [f"box/nic{i}" for i in range(4)]  # the default: one assumed NIC per GPU
    assert all(G.nodes[n]["basis"] == "default" for n in nics)
    assert G.edges["box/nic0", "leaf0"]["basis"] == "default"
    assert cluster_view(G).inter_bw_Bps == pytest.approx(np.full(8, NIC_GBPS * GB))


def test_unreadable_speed(tmp_path):
    dev = _pci(tmp_path, "pci0000:00", "0000:00:03.0", numa=-1)
    virtio = dev / "virtio2"
    virtio.mkdir()
    _net(tmp_path, "eth0", virtio, speed="-1")  # a VM's virtio-net: speed unknown
    _net(tmp_path, "eth1", dev, speed="garbage")
    eth2 = _net(tmp_path, "eth2", dev)
    (eth2 / "speed").mkdir()  # reading it fails (a down link answers EINVAL)
    _net(tmp_path, "eth3", dev, speed="4294967295")  # SPEED_UNKNOWN as u32
    nics = discover_nics(tmp_path)
    assert [n.name for n in nics] == ["eth0", "eth1", "eth2", "eth3"]
    assert all(n.bandwidth_GBps is None and n.numa_node is None for n in nics)
    assert nics[0].bus_id == "00000000:00:03.0"  # the PCI function the virtio device hangs off
    assert nics[0].pci_path == os.path.realpath(virtio)


def test_rate_and_speed_parsing():
    assert rate_GBps("400 Gb/sec (4X NDR)") == 50.0
    assert rate_GBps("200 Gb/sec (2X NDR)") == 25.0
    assert rate_GBps("2.5 Gb/sec (1X SDR)") == 0.3125
    assert rate_GBps("0 Gb/sec") is None and rate_GBps("") is None and rate_GBps(None) is None
    assert speed_GBps("100000") == 12.5
    assert speed_GBps("-1") is None and speed_GBps("0") is None and speed_GBps(None) is None


def test_bus_id_spellings(tmp_path):
    assert sysfs_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert sysfs_bus_id("0000:1b:00.1") == "0000:1b:00.1"
    assert sysfs_bus_id("00010000:01:00.0") == "10000:01:00.0"  # VMD domains are 5 digits in sysfs
    assert sysfs_bus_id("nonsense") is None and sysfs_bus_id(None) is None
    gpu = _pci(tmp_path, "pci0000:17", "0000:17:00.0", "0000:18:00.0")
    assert pci_path("00000000:18:00.0", tmp_path) == os.path.realpath(gpu)  # NVML's 8-digit domain
    assert pci_path("0000:18:00.0", tmp_path) == os.path.realpath(gpu)
    assert pci_path("00000000:99:00.0", tmp_path) is None


# --- placement --------------------------------------------------------------------------------------


def test_nearest_nic_follows_pcie_switch(tmp_path):
    root = hgx_sysfs(tmp_path)
    gpus = [_gpu(i, f"00000000:{bus:02X}:00.0", i // 4) for i, bus in enumerate(GPU_BUSES)]
    placed = nearest_nics(gpus, discover_nics(root), root)
    assert placed == {i: NIC_OF_SWITCH[i // 2] for i in range(8)}  # eno1 (not RDMA) is never chosen


def test_nearest_nic_without_gpu_paths_uses_numa_then_load():
    nics = [
        NicRecord("b", "rdma", None, 50.0, 1, None),
        NicRecord("a", "rdma", None, 50.0, 0, None),
        NicRecord("c", "rdma", None, 50.0, 0, None, state="DOWN"),
    ]
    gpus = [_gpu(i, None, i // 2) for i in range(4)]
    assert nearest_nics(gpus, nics, "/nonexistent") == {0: "a", 1: "a", 2: "b", 3: "b"}
    gpus = [_gpu(i, None, None) for i in range(4)]
    assert nearest_nics(gpus, nics, "/nonexistent") == {0: "a", 1: "b", 2: "a", 3: "b"}
    down = [NicRecord("x", "ethernet", None, None, None, None, state="down")]
    assert nearest_nics(gpus, down, "/nonexistent") == dict.fromkeys(range(4), "x")  # better than none


# --- graphs -----------------------------------------------------------------------------------------


def test_hgx_probe_shares_nics(tmp_path):
    root = hgx_sysfs(tmp_path)
    probes = [
        probe_host(fake_nvswitch_node(tag=t), host=h, sysfs_root=root) for t, h in (("1", "a"), ("2", "b"))
    ]
    probe = probes[0]
    assert len(probe.nics) == 5
    assert probe.nic_of_gpu == {i: NIC_OF_SWITCH[i // 2] for i in range(8)}
    assert pickle.loads(pickle.dumps(probe)) == probe  # it travels between ranks by pickle

    H = host_graph(probe)
    nics = sorted(n for n, a in H.nodes(data=True) if a["kind"] == "nic")
    assert nics == [real_nic_id("a", f"mlx5_{k}") for k in range(4)] == [f"a/nic/mlx5_{k}" for k in range(4)]
    nic = H.nodes["a/nic/mlx5_3"]
    assert nic["basis"] == "sysfs" and nic["measured"] is False and nic["rate_GBps"] == 50.0
    assert nic["nic_kind"] == "rdma" and nic["device"] == "mlx5_3" and nic["numa_node"] == 0
    assert sorted(H.neighbors("a/nic/mlx5_3")) == ["a/gpu0", "a/gpu1"]

    G = merge_hosts(probes)
    assert validate(G) is G
    assert G.edges["a/nic/mlx5_0", "leaf0"]["bandwidth_GBps"] == 50.0
    assert G.edges["a/nic/mlx5_0", "leaf0"]["basis"] == "sysfs"
    view = cluster_view(G)
    assert view.groups == (tuple(range(8)), tuple(range(8, 16)))
    assert view.inter_bw_Bps == pytest.approx(np.full(16, 25 * GB))  # 50 GB/s NIC shared by 2 GPUs

    path = tmp_path / "hgx.json"
    write_json(G, path)
    assert cluster_view(read_json(path)).inter_bw_Bps == pytest.approx(view.inter_bw_Bps)


def test_unknown_rate_uses_default_network(tmp_path):
    root = hgx_sysfs(tmp_path)
    for name in NIC_OF_SWITCH:
        (root / "class" / "infiniband" / name / "ports" / "1" / "rate").write_text("\n")
    probes = [
        probe_host(fake_nvswitch_node(tag=t), host=h, sysfs_root=root) for t, h in (("1", "a"), ("2", "b"))
    ]
    G = merge_hosts(probes, nic_GBps=40.0)
    assert G.nodes["a/nic/mlx5_0"]["rate_GBps"] is None
    assert G.edges["a/nic/mlx5_0", "leaf0"]["basis"] == "default"
    assert cluster_view(G).inter_bw_Bps == pytest.approx(np.full(16, 20 * GB))


def test_injected_nvml_skips_local_sysfs():
    assert probe_host(fake_nvswitch_node(2), host="x").nics == ()


def test_this_machine():
    nics = discover_nics()  # whatever this host's /sys shows; it must not raise
    assert all(isinstance(n, NicRecord) and n.kind in ("rdma", "ethernet") for n in nics)


def test_restrict_to_job_keeps_shared_nics(tmp_path):
    from topology.probe import RankInfo, restrict_to_job

    root = hgx_sysfs(tmp_path)
    probes = [
        probe_host(fake_nvswitch_node(tag=t), host=h, sysfs_root=root) for t, h in (("1", "a"), ("2", "b"))
    ]
    infos = []
    for host in "ab":
        for local, index in enumerate((0, 1, 2, 4)):  # GPUs 0 and 1 share a NIC; 2 and 4 have one each
            bus = f"00000000:{GPU_BUSES[index]:02X}:00.0"
            infos.append(RankInfo(len(infos), host, local, f"cuda:{local}", bus, 1, "H100"))
    G = restrict_to_job(merge_hosts(probes), infos)
    assert G is not None
    assert sorted(G.neighbors("a/nic/mlx5_0")) == ["a/gpu2", "leaf0"]  # GPU 3 dropped, its NIC kept for GPU 2
    assert cluster_view(G).inter_bw_Bps / GB == pytest.approx([25, 25, 50, 50] * 2)
