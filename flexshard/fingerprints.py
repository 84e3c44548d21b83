"""Fingerprints of what a plan depends on beyond its workload statistics: each table's hotness order and
the cluster it was priced on (the workload's own fingerprint is :func:`flexshard.workloads.fingerprint`)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from topology.views import ClusterView

IDENTITY_ORDER = "identity"  # fingerprint prefix of a table numbered hottest first (no order given)


def order_fingerprint(order: np.ndarray | None, num_rows: int) -> str:
    """sha256 (hex) of a table's hotness order as given (touched row ids, hottest first; the rest follow
    in id order) and its size. ``None``, rows numbered hottest first, has its own fingerprint."""
    h = hashlib.sha256(b"flexshard-order-v1")
    h.update(struct.pack("<q", int(num_rows)))
    if order is None:
        h.update(IDENTITY_ORDER.encode())
    else:
        h.update(np.ascontiguousarray(np.asarray(order).reshape(-1), dtype="<i8").tobytes())
    return h.hexdigest()


def topology_fingerprint(view: ClusterView) -> str:
    """sha256 (hex) over the ranks' groups, link speeds and latencies: the cluster a plan was priced on."""
    h = hashlib.sha256()
    for arr in (
        view.group_of_rank,
        view.intra_bw_Bps,
        view.inter_bw_Bps,
        view.intra_latency_s,
        view.inter_latency_s,
    ):
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()
