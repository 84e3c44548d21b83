"""Cluster probe: discover a cluster's topology instead of describing it by hand.

The NVML half (:mod:`topology.probe.nvml`) reads what each host's driver reports (GPUs, NVLink, PCIe),
adds the NICs sysfs shows (:mod:`topology.probe.nics`), and builds the intra-host graph with nominal link
speeds; :mod:`topology.probe.fake_nvml` replays recorded
or synthetic NVML answers for tests. The collective half (:mod:`topology.probe.collective`) times
point-to-point transfers and collectives inside a ``torch.distributed`` job and writes the measured
numbers onto the graph. Nothing here imports ``pynvml`` until :func:`probe_host` runs, nor ``torch`` until
a collective function runs.
"""

from topology.probe.collective import (
    Fit,
    Measurements,
    ProbeConfig,
    ProbeError,
    RankInfo,
    all_gather,
    consecutive_groups,
    fit_latency_bandwidth,
    gather_rank_info,
    host_groups,
    init_probe_group,
    measure,
    measured_graph,
    rank_links,
    rendezvous,
    replica_groups,
    restrict_to_job,
    sample_pairs,
    schedule_rounds,
    slow_parts,
)
from topology.probe.collective import report as probe_report
from topology.probe.nics import NicRecord, discover_nics, nearest_nics
from topology.probe.nvml import (
    GpuRecord,
    HostProbe,
    NvLinkRecord,
    host_graph,
    merge_hosts,
    normalize_bus_id,
    probe_host,
    real_nic_id,
)

__all__ = [
    "Fit",
    "GpuRecord",
    "HostProbe",
    "Measurements",
    "NicRecord",
    "NvLinkRecord",
    "ProbeConfig",
    "ProbeError",
    "RankInfo",
    "all_gather",
    "consecutive_groups",
    "discover_nics",
    "fit_latency_bandwidth",
    "gather_rank_info",
    "host_graph",
    "host_groups",
    "init_probe_group",
    "measure",
    "measured_graph",
    "merge_hosts",
    "nearest_nics",
    "normalize_bus_id",
    "probe_host",
    "probe_report",
    "rank_links",
    "real_nic_id",
    "rendezvous",
    "replica_groups",
    "restrict_to_job",
    "sample_pairs",
    "schedule_rounds",
    "slow_parts",
]
