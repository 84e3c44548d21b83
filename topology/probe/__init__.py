"""Cluster probe: discover a cluster's topology instead of describing it by hand.

The NVML half reads what each host's driver reports:

* :mod:`topology.probe.nvml`: GPUs, NVLink, PCIe, as NVML reports them (:func:`probe_host`);
* :mod:`topology.probe.nominal_graph`: probed hosts as a topology graph with nominal link speeds;
* :mod:`topology.probe.nics`: the NICs sysfs shows, and the nearest one to each GPU;
* :mod:`topology.probe.pci`: PCI bus ids in NVML's and sysfs' spellings.

The collective half runs inside a ``torch.distributed`` job:

* :mod:`topology.probe.session`: rendezvous, process group, bounded waits, who each rank is;
* :mod:`topology.probe.timing`: what to time, the point-to-point and collective timers, :func:`measure`;
* :mod:`topology.probe.measurements`: the records (rank identities, config, latency / bandwidth fits,
  measurements);
* :mod:`topology.probe.results`: per-rank links, slow parts, the measured graph, the text report.

Nothing here imports ``pynvml`` until :func:`probe_host` runs, nor ``torch`` until a collective function
runs. Rank / group arithmetic is :class:`core.ranks.RankLayout`; errors are :class:`core.errors.ProbeError`.
"""

from core.errors import ProbeError
from topology.probe.measurements import (
    Fit,
    Measurements,
    ProbeConfig,
    RankInfo,
    fit_latency_bandwidth,
    median_measurements,
)
from topology.probe.nics import NicRecord, discover_nics, nearest_nics
from topology.probe.nominal_graph import host_graph, merge_hosts, real_nic_id
from topology.probe.nvml import GpuRecord, HostProbe, NvLinkRecord, probe_host
from topology.probe.pci import normalize_bus_id
from topology.probe.results import measured_graph, rank_links, restrict_to_job, slow_parts
from topology.probe.results import report as probe_report
from topology.probe.session import all_gather, gather_rank_info, init_probe_group, rendezvous
from topology.probe.timing import measure, sample_pairs, schedule_rounds

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
    "discover_nics",
    "fit_latency_bandwidth",
    "gather_rank_info",
    "host_graph",
    "init_probe_group",
    "measure",
    "measured_graph",
    "median_measurements",
    "merge_hosts",
    "nearest_nics",
    "normalize_bus_id",
    "probe_host",
    "probe_report",
    "rank_links",
    "real_nic_id",
    "rendezvous",
    "restrict_to_job",
    "sample_pairs",
    "schedule_rounds",
    "slow_parts",
]
