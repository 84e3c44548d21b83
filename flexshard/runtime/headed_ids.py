"""The ``ids`` stage: one all-to-all that carries both a batch's id columns and what used to travel
before them in a ``meta`` all-to-all of its own (each rank's input check code and the split sizes of
every column), so that ``input_dist`` is one collective, not two.

Every block a rank sends a peer is a *header* followed by the ids, padded to a *capacity* that every rank
agrees on without a collective:

header (int64)
    the sender's error code (``ERROR_WORDS``), the split sizes of the columns that reach that peer (the
    protocol's ``active`` columns), then three words every peer gets: whether
    the sender had more ids for some peer than the capacity holds (*overflow*), and its largest block of
    ids to a peer of its own group and to a peer of another group.
ids
    the sender's ids for that peer (every column's block, in column order), the first ``capacity`` of
    them; the rest of the block is zeros.

Capacities (one for the peers of a rank's own group, one for the others) start at zero (the first batch
sends headers only: the old ``meta``) and grow, never shrink, to ``HEADROOM`` times the largest block any
rank has sent, rounded up to ``QUANTUM_IDS``: every rank reads every sender's header, so every rank
computes the same capacities for the next batch. Only when some header says its sender overflowed does a
second all-to-all (``ids_overflow``, on the same process group) carry the ids past the capacity; again
every rank knows from the headers, so either all ranks issue it or none does. A batch's capacity is
fixed when it is issued, from the headers of every batch issued before it (issuing a batch first reads
the previous one's headers if nothing has yet), so ranks that issue batches in the same order agree.

A batch whose check failed on any rank sends headers only (its rank asks for nothing), no rank issues
its overflow, and every rank raises the same error (:class:`~flexshard.runtime.input_dist.PendingInput`).

Padding is not counted in the protocol's bytes (:mod:`~flexshard.runtime.exchange_bytes` counts the ids
and the split sizes, as the cost model prices them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.arrays import block_positions, exclusive_cumsum
from flexshard.runtime.awaitable import all_to_all
from flexshard.runtime.device_rules import gpu_paths
from flexshard.runtime.features import ERROR_WORDS
from flexshard.runtime.indexing import block_rows

HEADROOM = 1.25  # capacity = HEADROOM x the largest block of ids seen, ...
QUANTUM_IDS = 64  # ... rounded up to a multiple of this many ids
SHARED_WORDS = 3  # header words every peer gets: overflow flag, largest block in the group, outside it
OVERFLOW, LARGEST_SAME, LARGEST_OTHER = range(SHARED_WORDS)


@dataclass
class IdCapacity:
    """Ids a block of the ``ids`` stage holds: to a peer of the sender's own group (``same``) and to a
    peer of another group (``other``). The same on every rank."""

    same: int = 0
    other: int = 0

    def per_peer(self, same_group: np.ndarray) -> np.ndarray:
        """int64[peers]: each peer's capacity (``same_group[p]``: p is in this rank's group)."""
        return np.where(same_group, self.same, self.other).astype(np.int64)

    def grow(self, largest_same: int, largest_other: int) -> None:
        """Grow (never shrink) to hold ``HEADROOM`` times the largest blocks seen, in ``QUANTUM_IDS``."""
        self.same = max(self.same, _room(largest_same))
        self.other = max(self.other, _room(largest_other))


def _room(largest: int) -> int:
    return int(np.ceil(HEADROOM * largest / QUANTUM_IDS)) * QUANTUM_IDS if largest > 0 else 0


@dataclass
class ReceivedIds:
    """What a batch's ``ids`` stage delivered: ``recv_counts[p, c]`` ids of column c from peer p, every
    peer's error code (int64[ERROR_WORDS] each) and the columns (each its blocks in peer order; None when
    some rank's batch failed)."""

    recv_counts: np.ndarray
    codes: list[np.ndarray]
    columns: list[torch.Tensor] | None

    @property
    def failed(self) -> bool:
        """Some rank's batch failed its checks."""
        return any(int(code[0]) for code in self.codes)


class IdStage:
    """The ``ids`` stage of one rank (see the module docstring): the agreed capacities and the batch
    issued last. ``header_mask[p, w]``: the words of the error code and split sizes sent to peer p (and
    received from it); ``same_group[p]``: peer p is in this rank's group."""

    def __init__(self, header_mask: np.ndarray, same_group: np.ndarray, device: torch.device) -> None:
        self.header_mask = np.asarray(header_mask, dtype=bool)
        self.same_group = np.asarray(same_group, dtype=bool)
        self.device = device
        world = self.header_mask.shape[0]
        # every header word, the shared ones last: [peer, word] of the header matrix, and words per peer
        self.word_mask = np.concatenate([self.header_mask, np.ones((world, SHARED_WORDS), bool)], axis=1)
        self.header_words = self.word_mask.sum(axis=1)
        self.capacity = IdCapacity()
        self._last: HeadedIds | None = None
        # int64[peers]: words of the last batch's ``ids`` block to each peer that no byte count prices
        # (the error code, the shared words and the padding)
        self.unpriced_words = np.zeros(self.header_mask.shape[0], dtype=np.int64)

    def issue(
        self, err: torch.Tensor, counts: np.ndarray, columns: list[torch.Tensor] | None, group
    ) -> HeadedIds:
        """Issue a batch's ``ids`` stage on ``group`` (None: the default group): ``err`` this rank's error
        code, ``counts[p, c]`` ids of column c to peer p, ``columns`` each sorted by peer (None: nothing
        sent). The previous batch's headers are read first if they have not been."""
        if self._last is not None:
            self._last.advance()
        self._last = HeadedIds(self, err, counts, columns, group)
        self.unpriced_words = ERROR_WORDS + SHARED_WORDS + self._last.padding
        return self._last


class HeadedIds:
    """One batch's ``ids`` stage in flight: :meth:`advance` reads the headers (and issues the overflow
    when some sender needs it), :meth:`wait` gives the :class:`ReceivedIds`."""

    def __init__(
        self, stage: IdStage, err: torch.Tensor, counts: np.ndarray, columns: list[torch.Tensor] | None, group
    ) -> None:
        mask, same = stage.header_mask, stage.same_group
        world = mask.shape[0]
        counts = np.asarray(counts, dtype=np.int64).reshape(world, -1)
        self._capacity, self._group = stage.capacity, group
        self._cap = stage.capacity.per_peer(same)  # this batch's, fixed now
        self._header_words, self._word_mask = stage.header_words, stage.word_mask  # per peer, both ways
        n = counts.sum(axis=1)
        shared = [int((n > self._cap).any()), _largest(n, same), _largest(n, ~same)]
        words = np.zeros((world, mask.shape[1]), dtype=np.int64)
        words[:, :ERROR_WORDS] = err.cpu().numpy().reshape(-1)
        words[:, ERROR_WORDS:] = counts
        header = np.concatenate(
            [words, np.broadcast_to(np.asarray(shared, np.int64), (world, SHARED_WORDS))], 1
        )
        header = header[self._word_mask]
        # the source of every block: the headers, every column joined, then zeros for the padding
        parts = [torch.as_tensor(header, device=stage.device)]
        if columns:
            parts += [c.reshape(-1) for c in columns]
        zeros = int(self._cap.max(initial=0))
        parts.append(torch.zeros(zeros, dtype=torch.int64, device=stage.device))
        self._source = torch.cat(parts)
        # each (peer, column) block's first element in the joined columns (column-major, peers in order)
        self._column_first = header.size + exclusive_cumsum(counts.T).T
        self._send_main, self._send_past = _split_blocks(counts, self._cap)
        pad = self._cap - np.minimum(n, self._cap)
        self.padding = pad  # int64[peers]: zeros after the ids in each block
        sizes = np.concatenate([self._header_words[:, None], self._send_main, pad[:, None]], axis=1)
        hfirst = exclusive_cumsum(self._header_words)
        firsts = np.concatenate(
            [hfirst[:, None], self._column_first, np.full((world, 1), self._source.numel() - zeros)],
            axis=1,
        )
        send = self._source.index_select(0, block_rows(sizes.reshape(-1), firsts.reshape(-1), stage.device))
        self._block = self._header_words + self._cap  # elements to and from every peer
        self._block_first = exclusive_cumsum(self._block)
        self._recv = send.new_empty(int(self._block.sum()))
        self._works = [_all_to_all("ids", self._recv, send, self._block, self._block, group)]
        self._advanced: ReceivedIds | None = None
        self._result: ReceivedIds | None = None
        self._over_recv: torch.Tensor | None = None
        # per (peer, column): the received ids within the capacity and past it (read from the headers)
        self._recv_main = self._recv_past = None

    def advance(self) -> None:
        """Wait for the headed blocks, read every header, grow the agreed capacities, and issue
        ``ids_overflow`` if some sender overflowed and no rank failed (once)."""
        if self._advanced is not None or self._result is not None:
            return
        for work in self._works:
            if work is not None:
                work.wait()
        hw, width = self._header_words, self._word_mask.shape[1] - SHARED_WORDS
        at = block_positions(hw, self._block_first)
        got = np.zeros(self._word_mask.shape, dtype=np.int64)
        got[self._word_mask] = _host(self._recv, at)
        shared = got[:, width:]
        recv_counts = got[:, ERROR_WORDS:width]
        codes = list(got[:, :ERROR_WORDS])
        self._recv_main, self._recv_past = _split_blocks(recv_counts, self._cap)
        self._capacity.grow(int(shared[:, LARGEST_SAME].max()), int(shared[:, LARGEST_OTHER].max()))
        self._advanced = ReceivedIds(recv_counts, codes, None)
        self._works = []
        if self._advanced.failed or not shared[:, OVERFLOW].any():
            self._source = None
            return
        past = self._send_past  # the ids past the capacity, in (peer, column) order
        send_rows, recv_rows = past.sum(axis=1), self._recv_past.sum(axis=1)
        firsts = self._column_first + self._send_main
        send = self._source.index_select(
            0, block_rows(past.reshape(-1), firsts.reshape(-1), self._source.device)
        )
        self._over_recv = send.new_empty(int(recv_rows.sum()))
        self._works = [_all_to_all("ids_overflow", self._over_recv, send, recv_rows, send_rows, self._group)]
        self._source = None

    def wait(self) -> ReceivedIds:
        """The received counts, codes and columns (waits for the stage, and the overflow if issued)."""
        if self._result is not None:
            return self._result
        self.advance()
        for work in self._works:
            if work is not None:
                work.wait()
        got = self._advanced
        if not got.failed:
            got.columns = self._columns(got.recv_counts)
        self._result, self._advanced, self._recv, self._over_recv, self._works = got, None, None, None, []
        return got

    def _columns(self, recv_counts: np.ndarray) -> list[torch.Tensor]:
        """Each column's received ids in peer order, from the headed blocks and the overflow."""
        main, over = self._recv_main, self._recv_past
        payload = (self._block_first + self._header_words)[:, None]
        within = exclusive_cumsum(recv_counts, axis=1)  # each block's first id within its peer's ids
        main_first = payload + within
        source = self._recv
        over_first = np.zeros_like(main_first)
        if self._over_recv is not None:
            source = torch.cat([self._recv, self._over_recv])
            peer_over = exclusive_cumsum(over.sum(axis=1))[:, None]
            over_first = self._recv.numel() + peer_over + within + main - self._cap[:, None]
        # blocks in (column, peer, main then overflow) order
        sizes = np.stack([main.T, over.T], axis=2)
        firsts = np.stack([main_first.T, over_first.T], axis=2)
        joined = source.index_select(0, block_rows(sizes.reshape(-1), firsts.reshape(-1), source.device))
        return list(joined.split(recv_counts.sum(axis=0).tolist()))


def _largest(n: np.ndarray, where: np.ndarray) -> int:
    return int(n[where].max()) if where.any() else 0


def _split_blocks(counts: np.ndarray, cap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per (peer, column) block of ``counts[p, c]`` ids, laid out column after column in the peer's
    ids: how many fall within the peer's capacity ``cap[p]`` and how many past it."""
    main = np.clip(cap[:, None] - exclusive_cumsum(counts, axis=1), 0, counts)
    return main, counts - main


def _host(x: torch.Tensor, at: np.ndarray) -> np.ndarray:
    """``x[at]`` on the host (a view's fancy index on the CPU; one gather and one copy elsewhere)."""
    if not gpu_paths(x.device):
        return x.numpy()[at]
    return x.index_select(0, torch.as_tensor(at, device=x.device)).cpu().numpy()


def _all_to_all(
    name: str, recv: torch.Tensor, send: torch.Tensor, recv_rows: np.ndarray, send_rows: np.ndarray, group
):
    """One all-to-all of elements (a local copy on a group of one rank)."""
    if recv_rows.size == 1:
        recv.copy_(send)
        return None
    return all_to_all(name, recv, send, recv_rows.tolist(), send_rows.tolist(), group)
