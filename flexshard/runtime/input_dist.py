"""A batch's ``input_dist`` in flight, for a step that overlaps it with other work (TorchRec's
``TrainPipelineSparseDist``): :meth:`ShardedSequenceEmbedding.input_dist
<flexshard.runtime.sharded.ShardedSequenceEmbedding.input_dist>` checks the input, routes it locally and
issues ``meta``; :meth:`PendingInput.advance` waits for ``meta`` and issues ``ids``; :meth:`PendingInput.wait`
waits for ``ids`` and gives the :class:`Prepared` batch that ``forward`` takes. None of this reads a row
that training changes: ``forward`` reads the hot rows again, and every remote row in its own stages.

A batch that fails its checks is one error on every rank: its code travels in ``meta``, no rank issues
its ``ids``, and :meth:`PendingInput.wait` raises the same :class:`~core.errors.BatchError` everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flexshard.runtime.awaitable import Pending
from flexshard.runtime.exchange_protocol import ExchangeProtocol
from flexshard.runtime.features import raise_input_error
from flexshard.runtime.route import Routed


@dataclass
class Prepared:
    """A batch after ``input_dist``: its routed lookups, the split sizes every rank sends this rank
    (``[peer, table, kind]``) and the id columns received (None when no table has remote rows)."""

    routed: Routed
    recv_counts: np.ndarray
    received: list[list[torch.Tensor]] | None


class PendingInput(Pending[Prepared]):
    """``input_dist`` of one batch with ``meta`` issued (see the module docstring). ``group``: the
    process group its stages go on (None: the default group); ``tables``: the table names and row counts
    (for the error message). :meth:`wait` gives the :class:`Prepared` batch, or raises the batch's
    input error (every rank the same) on every call."""

    def __init__(
        self,
        protocol: ExchangeProtocol,
        routed: Routed | None,
        meta: Pending,
        group,
        remote: bool,
        tables: tuple[list[str], list[int]],
    ) -> None:
        super().__init__([], self._finish)
        self._protocol, self._routed, self._meta, self._group = protocol, routed, meta, group
        self._remote, self._tables = remote, tables
        self._ids: Pending | None = None
        self._recv_counts: np.ndarray | None = None
        self._codes: list[np.ndarray] | None = None

    def advance(self) -> None:
        """Wait for ``meta`` and issue ``ids`` (once; nothing on a batch that failed on any rank)."""
        if self._codes is not None:
            return
        self._recv_counts, self._codes = self._meta.wait()
        if self._failed() or not self._remote:
            return
        self._ids = self._protocol.ids(self._routed, self._recv_counts, self._group)

    def _failed(self) -> bool:
        return any(int(code[0]) for code in self._codes or [])

    def _finish(self) -> Prepared:
        self.advance()
        if self._failed():
            raise_input_error(self._codes, *self._tables)
        received = self._ids.wait() if self._ids is not None else None
        return Prepared(self._routed, self._recv_counts, received)
