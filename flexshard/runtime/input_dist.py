"""A batch's ``input_dist`` in flight, for a step that overlaps it with other work (TorchRec's
``TrainPipelineSparseDist``): :meth:`ShardedSequenceEmbedding.input_dist
<flexshard.runtime.sharded.ShardedSequenceEmbedding.input_dist>` checks the input, routes it locally and
issues ``ids`` (the id columns, each block headed by the sender's error code and split sizes:
:mod:`~flexshard.runtime.headed_ids`); :meth:`PendingInput.advance` waits for it and reads the headers
(issuing ``ids_overflow`` in the rare batch that needs it); :meth:`PendingInput.wait` gives the
:class:`Prepared` batch that ``forward`` takes. None of this reads a row that training changes:
``forward`` reads the hot rows again, and every remote row in its own stages.

A batch that fails its checks is one error on every rank: its code travels in the headers, and
:meth:`PendingInput.wait` raises the same :class:`~core.errors.BatchError` everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flexshard.runtime.awaitable import Pending
from flexshard.runtime.features import raise_input_error
from flexshard.runtime.headed_ids import HeadedIds
from flexshard.runtime.route import Routed


@dataclass
class Prepared:
    """A batch after ``input_dist``: its routed lookups, the split sizes every rank sends this rank
    (``[peer, table, kind]``) and the id columns received (None when no table has remote rows)."""

    routed: Routed
    recv_counts: np.ndarray
    received: list[list[torch.Tensor]] | None


class PendingInput(Pending[Prepared]):
    """``input_dist`` of one batch with ``ids`` issued (see the module docstring). ``tables``: the table
    names and row counts (for the error message). :meth:`wait` gives the :class:`Prepared` batch, or
    raises the batch's input error (every rank the same) on every call."""

    def __init__(
        self,
        routed: Routed | None,
        ids: HeadedIds,
        num_tables: int,
        remote: bool,
        tables: tuple[list[str], list[int]],
    ) -> None:
        super().__init__([], self._finish)
        self._routed, self._ids, self._num_tables = routed, ids, num_tables
        self._remote, self._tables = remote, tables

    def advance(self) -> None:
        """Wait for ``ids`` and read its headers (issuing ``ids_overflow`` where needed; once)."""
        self._ids.advance()

    def _finish(self) -> Prepared:
        got = self._ids.wait()
        if got.failed:
            raise_input_error(got.codes, *self._tables)
        n_t, world = self._num_tables, got.recv_counts.shape[0]
        recv_counts = got.recv_counts.reshape(world, n_t, -1)
        received = None
        if self._remote:
            kinds = recv_counts.shape[2]
            received = [got.columns[t * kinds : (t + 1) * kinds] for t in range(n_t)]
        return Prepared(self._routed, recv_counts, received)
