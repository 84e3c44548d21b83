"""Cluster probe: discover a cluster's topology instead of describing it by hand.

The NVML half (:mod:`topology.probe.nvml`) reads what each host's driver reports (GPUs, NVLink, PCIe)
and builds the intra-host graph with nominal link speeds; :mod:`topology.probe.fake_nvml` replays recorded
or synthetic NVML answers for tests. Nothing here imports ``pynvml`` until :func:`probe_host` runs.
"""

from topology.probe.nvml import (
    GpuRecord,
    HostProbe,
    NvLinkRecord,
    host_graph,
    merge_hosts,
    normalize_bus_id,
    probe_host,
)

__all__ = [
    "GpuRecord",
    "HostProbe",
    "NvLinkRecord",
    "host_graph",
    "merge_hosts",
    "normalize_bus_id",
    "probe_host",
]
