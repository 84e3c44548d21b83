"""Bytes of the exchange protocol (:mod:`~flexshard.runtime.exchange_protocol`) per link class, counted
from the realised counts with :mod:`solvers.wire`'s formulas (what :mod:`solvers.cost_model` prices):

* ids (``INDEX_BYTES`` each): every entry of every id column sent to another rank (warm and flat slots,
  group-fetch ids to the rail peer, group-fetch slots to owners in other groups), and the split sizes
  in the blocks' headers (:func:`solvers.wire.split_bytes`: one int64 per table per column a peer is
  reached by; the error code, the capacity words and the padding past the ids
  (:mod:`~flexshard.runtime.headed_ids`) are not counted);
* embeddings forward and gradients backward (``vector_bytes`` each): warm and flat lookups between
  requester and owner, group-fetch ids between requester and rail peer (``scatter`` / ``grads``), and
  each distinct row once per group between the owner and the rail peer (``rows`` / ``rail_grads``).

A rank's own blocks are local copies and never counted. The fp16 gradient exponent (one element per peer
block) is not counted. Ids and forward bytes are added at ``rows``, backward bytes at ``rail_grads``.
"""

from __future__ import annotations

import numpy as np

from core.ranks import RankLayout
from core.traffic import Traffic
from core.vocabulary import FLOAT32_BYTES, INDEX_BYTES, Component, LinkClass, WireDtype
from solvers import wire

ROW_COLUMNS = [0, 1, 2]  # WARM, FLAT, GIDS: the id columns whose entries get a vector back


class ProtocolBytes:
    """One rank's byte counter for the exchange protocol. ``active[p, k]``: id column k reaches rank p."""

    def __init__(
        self, layout: RankLayout, me: int, dims: np.ndarray, wire_dtype: WireDtype, active: np.ndarray
    ) -> None:
        world = layout.num_ranks
        self.link_of_peer = layout.link_class(me, np.arange(world))
        self.others = np.arange(world) != me
        self.vector_bytes = np.asarray(wire.vector_bytes(dims, FLOAT32_BYTES, wire_dtype), dtype=np.float64)
        self.active, self.num_tables = active, int(np.size(dims))
        self._backward = Traffic.zeros()
        # [link, peer]: 1 for the other ranks reached over that link class; the split sizes' bytes per link
        self._peers = np.stack([self.others & (self.link_of_peer == link) for link in LinkClass]).astype(
            float
        )
        self._split = [
            wire.split_bytes(float(self.active[p > 0].sum()), self.num_tables) for p in self._peers
        ]

    def forward(self, sent: np.ndarray, asked, traffic: Traffic) -> None:
        """Add one batch's ids and forward bytes to ``traffic`` (``sent``: int64[world, tables, kinds]
        entries sent; ``asked``: the :class:`~flexshard.runtime.exchange_protocol.Asked` of the batch)
        and keep its backward bytes. Every link class at once (integer sums, exact in float64)."""
        self._backward = Traffic.zeros()
        recv = asked.recv_counts
        ids_send = self._peers @ sent.sum(axis=(1, 2)) * INDEX_BYTES
        ids_recv = self._peers @ recv.sum(axis=(1, 2)) * INDEX_BYTES
        asked_b = self._peers @ (sent[:, :, ROW_COLUMNS].sum(axis=2) + asked.fetch_counts) @ self.vector_bytes
        served_b = (
            self._peers @ (recv[:, :, ROW_COLUMNS].sum(axis=2) + asked.owner_counts) @ self.vector_bytes
        )
        for i, link in enumerate(LinkClass):
            split = self._split[i]
            traffic.add(link, Component.IDS, float(ids_send[i]) + split, float(ids_recv[i]) + split)
            traffic.add(link, Component.FORWARD, float(served_b[i]), float(asked_b[i]))
            self._backward.add(link, Component.BACKWARD, float(asked_b[i]), float(served_b[i]))

    def per_link(self, per_peer_bytes: np.ndarray) -> np.ndarray:
        """float64[link classes]: ``per_peer_bytes`` (to each rank) summed over the other ranks of each
        link class."""
        return self._peers @ np.asarray(per_peer_bytes, dtype=np.float64)

    def backward(self, traffic: Traffic) -> None:
        """Add the kept backward bytes of the batch to ``traffic``."""
        traffic += self._backward
        self._backward = Traffic.zeros()
