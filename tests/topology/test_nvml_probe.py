"""The NVML half of the cluster probe, against fake NVML hosts and a snapshot recorded on a real H100 VM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fake_nvml as fk
import numpy as np
import pytest
from fake_nvml import FakeNVML, fake_nvswitch_node, fake_pcie_box, from_snapshot

from topology import TopologyError, cluster_view, read_json, write_json
from topology.probe import HostProbe, host_graph, merge_hosts, normalize_bus_id, probe_host
from topology.probe.nvml import NVLINK_GBPS_PER_LINK, PCIE_GBPS_PER_LANE

FIXTURES = Path(__file__).parent / "fixtures"
VM_SNAPSHOT = FIXTURES / "nvml_h100x1_vm.json"
GB = 1e9


def _bridged_box(
    pairs: list[tuple[int, int]], links: int = 4, version: int = fk.NVML_NVLINK_VERSION_3_0, **kw
):
    """A PCIe box whose GPU ``pairs`` are joined by ``links`` direct NVLinks each (NVLink bridges)."""
    nvml = fake_pcie_box(**kw)
    devices = nvml.snapshot["devices"]
    for a, b in pairs:
        for me, peer in ((a, b), (b, a)):
            for link in range(links):
                devices[me]["nvlink"][link] = {
                    "link": link,
                    "state": {"value": fk.NVML_FEATURE_ENABLED},
                    "remote_pci": {"value": devices[peer]["pci"]["value"]},
                    "remote_type": {"value": fk.NVML_NVLINK_DEVICE_TYPE_GPU},
                    "version": {"value": version},
                }
    return nvml


# --- tables -----------------------------------------------------------------------------------------


def test_link_tables():
    assert NVLINK_GBPS_PER_LINK[fk.NVML_NVLINK_VERSION_3_0] == 25.0
    assert NVLINK_GBPS_PER_LINK[fk.NVML_NVLINK_VERSION_4_0] == 25.0
    assert NVLINK_GBPS_PER_LINK[fk.NVML_NVLINK_VERSION_5_0] == 50.0
    assert PCIE_GBPS_PER_LANE[5] * 16 == pytest.approx(63.0, abs=0.05)
    assert PCIE_GBPS_PER_LANE[4] * 16 == pytest.approx(31.5, abs=0.05)


def test_normalize_bus_id():
    assert normalize_bus_id("0000:1b:00.0") == "00000000:1B:00.0"
    assert normalize_bus_id(b"00000000:00:06.0\x00") == "00000000:00:06.0"
    assert normalize_bus_id(None) is None


# --- NVSwitch node ----------------------------------------------------------------------------------


def test_nvswitch_node_probe_records():
    probe = probe_host(fake_nvswitch_node(), host="hgx")
    assert probe.host == "hgx" and len(probe.gpus) == 8
    gpu = probe.gpus[0]
    assert gpu.memory_bytes == fk.H100_MEMORY_BYTES
    assert len(gpu.nvlinks) == 18
    assert {link.remote_type for link in gpu.nvlinks} == {"switch"}
    assert {link.version_name for link in gpu.nvlinks} == {"4.0"}
    assert gpu.nvlink_GBps == 450.0
    assert (gpu.pcie_gen, gpu.pcie_width) == (5, 16)
    assert gpu.pcie_GBps == pytest.approx(63.0, abs=0.05)
    assert gpu.numa_node == 0 and gpu.cpu_affinity == tuple(range(48))
    assert probe.gpus[7].numa_node == 1 and probe.gpus[7].cpu_affinity == tuple(range(48, 96))
    assert probe.ancestor(0, 1) == "NODE" and probe.ancestor(0, 7) == "SYSTEM"
    assert gpu.common_ancestor == {j: ("NODE" if j < 4 else "SYSTEM") for j in range(1, 8)}


def test_nvswitch_node_is_one_group_of_8_at_450():
    G = host_graph(probe_host(fake_nvswitch_node(8), host="hgx"))
    view = cluster_view(G)
    assert view.groups == (tuple(range(8)),)
    assert np.allclose(view.intra_bw_Bps, 450 * GB)
    assert view.host_of_rank == ("hgx",) * 8
    assert G.nodes["nvswitch/hgx"]["kind"] == "nvswitch"
    edge = G.edges["hgx/gpu0", "nvswitch/hgx"]
    assert edge["kind"] == "nvlink" and edge["measured"] is False and edge["basis"] == "nvml"
    assert G.nodes["hgx/gpu3"]["bus_id"] == "00000000:5D:00.0"
    assert G.nodes["hgx/nic0"]["measured"] is False


def test_merge_two_nvswitch_hosts():
    probes = [probe_host(fake_nvswitch_node(tag=t), host=h) for t, h in (("1", "b"), ("2", "a"))]
    G = merge_hosts(probes)
    view = cluster_view(G)
    assert view.num_ranks == 16
    assert view.groups == (tuple(range(8)), tuple(range(8, 16)))
    assert view.host_of_rank == ("b",) * 8 + ("a",) * 8  # host order as given, not sorted
    assert [G.nodes[f"a/gpu{i}"]["rank"] for i in range(8)] == list(range(8, 16))
    assert np.allclose(view.intra_bw_Bps, 450 * GB)
    assert np.allclose(view.inter_bw_Bps, 50 * GB)  # the placeholder NIC, not measured
    network = [e for e in G.edges(data=True) if e[2]["kind"] == "network"]
    assert len(network) == 16 and all(
        e[2]["measured"] is False and e[2]["basis"] == "default" for e in network
    )


def test_merge_rejects_duplicate_hosts_and_empty():
    probe = probe_host(fake_nvswitch_node(2), host="x")
    with pytest.raises(TopologyError, match="distinct"):
        merge_hosts([probe, probe])
    with pytest.raises(TopologyError, match="empty"):
        merge_hosts([])


def test_merged_graph_round_trips_through_json(tmp_path):
    probes = [probe_host(from_snapshot(VM_SNAPSHOT), host="vm0"), probe_host(fake_pcie_box(2), host="box")]
    G = merge_hosts(probes)
    write_json(G, tmp_path / "probe.json")
    H = read_json(tmp_path / "probe.json")
    assert H.nodes["vm0/gpu0"]["numa_node"] is None
    assert cluster_view(H).groups == cluster_view(G).groups == ((0,), (1, 2))


# --- multi-node NVLink (NVL72-class) -----------------------------------------------------------------


def test_fabric_domain_is_read_from_nvml():
    (gpu, *_) = probe_host(fk.fake_nvl72_tray(clique=7, cluster=0xAB), host="t").gpus
    assert gpu.fabric == "ab" * 16 + "/7"
    assert [link.bandwidth_GBps for link in gpu.nvlinks] == [50.0] * 18  # NVLink 5
    hgx = probe_host(fake_nvswitch_node(), host="h")  # single-node NVLink: not supported, no domain
    assert hgx.gpus[0].fabric is None and "nvmlDeviceGetGpuFabricInfoV: Not Supported" in hgx.unsupported
    pending = probe_host(fk.fake_nvl72_tray(state=fk.NVML_GPU_FABRIC_STATE_IN_PROGRESS), host="t")
    assert pending.gpus[0].fabric is None  # not registered yet: no domain to rely on


def test_trays_of_one_clique_form_one_group_across_hosts(tmp_path):
    """Three 4-GPU trays in clique 1 and one in clique 2: a 12-GPU group at 18 x 50 GB/s per GPU, whose
    ranks span three hosts, and the fourth tray on its own; NICs still carry the inter-group traffic."""
    trays = [
        probe_host(fk.fake_nvl72_tray(clique=1 if k < 3 else 2, tag=str(k)), host=f"tray{k}")
        for k in range(4)
    ]
    G = merge_hosts(trays)
    view = cluster_view(G)
    assert view.groups == (tuple(range(12)), tuple(range(12, 16)))
    assert view.host_of_rank[:12] == ("tray0",) * 4 + ("tray1",) * 4 + ("tray2",) * 4
    assert np.allclose(view.intra_bw_Bps, 900 * GB) and np.allclose(view.inter_bw_Bps, 50 * GB)
    switches = sorted(n for n, kind in G.nodes(data="kind") if kind == "nvswitch")
    assert switches == ["nvswitch/nvl-1-72727272", "nvswitch/tray3"]  # the per-tray switches of clique 1 went
    assert G.nodes["tray1/gpu2"]["group"] == "nvl-1-72727272"
    write_json(G, tmp_path / "nvl.json")
    assert cluster_view(read_json(tmp_path / "nvl.json")).groups == view.groups


def test_fabric_domains_need_a_completed_registration_on_every_tray():
    states = (fk.NVML_GPU_FABRIC_STATE_COMPLETED, fk.NVML_GPU_FABRIC_STATE_NOT_STARTED)
    trays = [
        probe_host(fk.fake_nvl72_tray(tag=str(k), state=st), host=f"t{k}") for k, st in enumerate(states)
    ]
    assert cluster_view(merge_hosts(trays)).groups == ((0, 1, 2, 3), (4, 5, 6, 7))  # one group per host


# --- PCIe box and direct NVLink ---------------------------------------------------------------------


def test_pcie_box_is_one_group_at_pcie_bandwidth():
    probe = probe_host(fake_pcie_box(4), host="box")
    assert all(gpu.nvlinks == () for gpu in probe.gpus)
    assert probe.ancestor(0, 1) == "MULTIPLE" and probe.ancestor(2, 3) == "MULTIPLE"
    assert probe.ancestor(0, 2) == "HOSTBRIDGE" and probe.ancestor(1, 3) == "HOSTBRIDGE"
    G = host_graph(probe)
    view = cluster_view(G)
    assert view.groups == ((0, 1, 2, 3),)
    assert np.allclose(view.intra_bw_Bps, 16 * PCIE_GBPS_PER_LANE[4] * GB)
    edge = G.edges["box/gpu0", "box/gpu1"]
    assert edge["kind"] == "pcie" and edge["ancestor"] == "MULTIPLE"
    assert G.edges["box/gpu0", "box/gpu2"]["ancestor"] == "HOSTBRIDGE"
    assert not [n for n, kind in G.nodes(data="kind") if kind == "nvswitch"]


def test_pcie_box_node_level_beyond_a_quad():
    probe = probe_host(fake_pcie_box(8), host="box")
    assert probe.ancestor(0, 4) == "NODE" and probe.ancestor(4, 5) == "MULTIPLE"


def test_pcie_uses_max_link_when_current_trained_down():
    nvml = fake_pcie_box(2, pcie_gen=5)
    nvml.snapshot["devices"][0]["pcie_link_gen"] = {"value": 1}  # idle GPUs drop to gen1
    gpu = probe_host(nvml, host="box").gpus[0]
    assert gpu.pcie_gen == 1 and gpu.pcie_max_gen == 5
    assert gpu.pcie_GBps == pytest.approx(63.0, abs=0.05)


def test_direct_nvlink_pairs_are_groups():
    probe = probe_host(_bridged_box([(0, 1), (2, 3)]), host="box")
    G = host_graph(probe)
    # the host alone: two NVLink islands with no link between them, refused rather than priced at the
    # NICs' PCIe figure; the job's graph joins them through the NICs' fabric
    with pytest.raises(TopologyError, match=r"^host 'box': gpus 'box/gpu0' and 'box/gpu2' are not joined"):
        cluster_view(G)
    view = cluster_view(merge_hosts([probe]))
    assert view.groups == ((0, 1), (2, 3))
    assert np.allclose(view.intra_bw_Bps, 4 * 25 * GB)
    assert G.nodes["box/gpu0"]["group"] == "box/nvl0" and G.nodes["box/gpu3"]["group"] == "box/nvl1"
    assert G.edges["box/gpu0", "box/gpu1"]["kind"] == "nvlink"
    assert ("box/gpu0", "box/gpu2") not in G.edges


def test_partly_bridged_box_keeps_unbridged_gpus_apart():
    view = cluster_view(merge_hosts([probe_host(_bridged_box([(0, 1)]), host="box")]))
    assert view.groups == ((0, 1), (2, 3))
    assert np.allclose(view.intra_bw_Bps, [100 * GB, 100 * GB, 31.5 * GB, 31.5 * GB], rtol=1e-3)


def test_unknown_nvlink_version_counts_at_default_and_is_marked():
    G = host_graph(probe_host(_bridged_box([(0, 1)], links=2, version=99), host="box"))
    edge = G.edges["box/gpu0", "box/gpu1"]
    assert edge["bandwidth_GBps"] == 50.0 and edge["basis"] == "default"


# --- the real VM snapshot ---------------------------------------------------------------------------


def test_real_vm_snapshot_parses():
    probe = probe_host(from_snapshot(VM_SNAPSHOT), host="vm")
    assert probe.driver_version == "580.159.04"
    (gpu,) = probe.gpus
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.uuid == "GPU-3b1e9323-50c1-e33d-6c31-28613e5471cf"
    assert gpu.memory_bytes == 85520809984
    assert gpu.bus_id == "00000000:00:06.0"
    assert gpu.numa_node is None
    assert gpu.cpu_affinity is None  # recorded as an object repr: unknown
    assert gpu.nvlinks == ()
    assert (gpu.pcie_gen, gpu.pcie_width) == (5, 16)
    assert gpu.common_ancestor == {}
    assert "nvmlDeviceGetNumaNodeId: Not Supported" in probe.unsupported
    assert "nvmlDeviceGetNvLinkState: Not Supported" in probe.unsupported
    view = cluster_view(host_graph(probe))
    assert view.groups == ((0,),)
    assert view.memory_bytes.tolist() == [85520809984]
    assert view.intra_bw_Bps[0] == pytest.approx(63.0 * GB, rel=1e-3)


def test_snapshot_with_plain_affinity_list(tmp_path):
    data = json.loads(VM_SNAPSHOT.read_text())
    data["devices"][0]["cpu_affinity"] = {"value": [0xFFFF, 0, 0, 0]}
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(data))
    assert probe_host(from_snapshot(path), host="vm").gpus[0].cpu_affinity == tuple(range(16))


# --- failures ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [fk.NVML_ERROR_LIBRARY_NOT_FOUND, fk.NVML_ERROR_DRIVER_NOT_LOADED])
def test_missing_library_or_driver_raises_topology_error(code):
    with pytest.raises(TopologyError, match="NVML") as info:
        probe_host(FakeNVML(fk.fake_nvswitch_node(1).snapshot, init_error=code))
    message = str(info.value)
    assert "\n" not in message and "flexshard probe" in message and "GPU host" in message


def test_missing_pynvml_module_raises_topology_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(TopologyError, match="NVML is unavailable"):
        probe_host()


def test_real_pynvml_without_gpu_raises_topology_error():
    pytest.importorskip("pynvml")
    try:
        probe = probe_host()
    except TopologyError as err:
        assert "NVML" in str(err)
    else:  # on a GPU host the probe simply works
        assert isinstance(probe, HostProbe) and probe.gpus


def test_unsupported_queries_do_not_crash():
    unsupported = {
        "nvmlDeviceGetNvLinkRemoteDeviceType",  # older drivers: inferred from the far end's bus id
        "nvmlDeviceGetTopologyCommonAncestor",
        "nvmlDeviceGetNumaNodeId",
        "nvmlDeviceGetCpuAffinity",
        "nvmlDeviceGetMaxPcieLinkGeneration",
        "nvmlDeviceGetUUID",
        "nvmlSystemGetDriverVersion",
    }
    nvml = FakeNVML(fake_nvswitch_node().snapshot, unsupported=unsupported)
    probe = probe_host(nvml, host="hgx")
    gpu = probe.gpus[0]
    assert gpu.numa_node is None and gpu.cpu_affinity is None and gpu.uuid is None
    assert {link.remote_type for link in gpu.nvlinks} == {None}
    assert probe.ancestor(0, 1) is None and probe.driver_version is None
    assert len(probe.unsupported) >= len(unsupported)
    view = cluster_view(host_graph(probe))
    assert view.groups == (tuple(range(8)),) and np.allclose(view.intra_bw_Bps, 450 * GB)
    bridged = _bridged_box([(0, 1)])
    bridged.unsupported = frozenset({"nvmlDeviceGetNvLinkRemoteDeviceType"})
    assert cluster_view(merge_hosts([probe_host(bridged, host="box")])).groups == ((0, 1), (2, 3))


def test_required_query_failure_raises_topology_error():
    nvml = fake_nvswitch_node(2)
    nvml.snapshot["devices"][1]["memory"] = {"error": "GPU is lost", "code": fk.NVML_ERROR_GPU_IS_LOST}
    with pytest.raises(TopologyError, match="gpu 1: NVML query nvmlDeviceGetMemoryInfo failed"):
        probe_host(nvml)
    assert nvml.initialized is False  # shut down even on failure


def test_fake_errors_behave_like_pynvml():
    err = fk.NVMLError(fk.NVML_ERROR_NOT_SUPPORTED)
    assert isinstance(err, fk.NVMLError_NotSupported) and err.value == 3 and str(err) == "Not Supported"
    assert fk.NVMLError_LibraryNotFound().value == fk.NVML_ERROR_LIBRARY_NOT_FOUND
    assert FakeNVML.NVMLError_DriverNotLoaded is fk.NVMLError_DriverNotLoaded
    nvml = fake_pcie_box(1)
    with pytest.raises(fk.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()


def test_probe_package_imports_nothing_heavy():
    modules = ("measurements", "nics", "nvml", "pci", "results", "session", "timing")
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import fake_nvml, topology.probe; "
        + "".join(f"import topology.probe.{name}; " for name in modules)
        + "bad = [m for m in ('pynvml', 'torch', 'solvers', 'flexshard') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_basis_survives_a_json_round_trip(tmp_path):
    from topology.io import read_json, write_json
    from topology.probe import merge_hosts, probe_host

    graph = merge_hosts(
        [probe_host(fake_nvswitch_node(2), host="h0"), probe_host(fake_nvswitch_node(2), host="h1")]
    )
    write_json(graph, tmp_path / "t.json")
    back = read_json(tmp_path / "t.json")
    bases = {d.get("basis") for _, _, d in back.edges(data=True)}
    assert {"nvml", "default"} <= bases
