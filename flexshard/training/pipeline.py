"""The train loop's batches through ``input_dist``, pipelined or not (``train --pipeline on|off``).

Pipelined, the idea of TorchRec's ``TrainPipelineSparseDist``: step ``s`` issues batch ``s+1``'s
``input_dist`` (input check, dedup, local routing and the ``ids`` all-to-all, its blocks headed by the
error codes and split sizes) right after its own embedding forward, so ``ids`` runs while step ``s``'s
dense forward and backward run; after the backward it reads the headers (and issues ``ids_overflow`` in a
batch that needs it, which runs while step ``s``'s replica sync and optimizer run); step ``s+1`` starts by
waiting for the ids. Rows (``rows``, ``scatter``) are read in step ``s+1`` itself,
after step ``s``'s update, and the hot rows are read again there: the pipelined step computes exactly
what the unpipelined one does (bit for bit; tests/runtime/test_pipeline.py).

The next batch's stages go on a second process group of every rank (:func:`torch.distributed.new_group`),
so they never interleave with the current step's stages on the default group; on gloo they progress on
the group's own threads, on NCCL on its own communicator and stream. Every rank issues them at the same
points of the step, from the main thread (no side thread: nothing in the chain needs to progress without
the main thread, and Ctrl-C stays where it is). Sample placement (``--sample-placement``), when on,
moves the next batch's samples on the default group when it is prefetched.

A checkpoint of step ``s`` holds nothing of batch ``s+1``: ``input_dist`` reads no state that a
checkpoint saves (the hot rows it reads are read again by ``forward``), and a resumed run starts with
no prefetch, so it computes what the uninterrupted run did.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from core.traffic import Traffic
from flexshard.batching import SamplePlacer
from flexshard.model import Batch, lookup_features
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.runtime.input_dist import PendingInput, Prepared


@dataclass
class _Next:
    step: int
    batch: Batch
    placement: Traffic
    pending: PendingInput


class InputPipeline:
    """Batches of a run (``source.batch(step, rank)``, placed by ``placer``) through
    ``module.input_dist``. ``enabled``: prefetch the next batch on a side process group (collective:
    every rank builds it with the same ``enabled``); else each batch is prepared in its own step."""

    def __init__(
        self,
        module: ShardedSequenceEmbedding,
        placer: SamplePlacer,
        source,
        device: torch.device,
        enabled: bool,
        timeout_s: float | None = None,
    ) -> None:
        self.module, self.placer, self.source, self.device = module, placer, source, device
        self.enabled = enabled
        self.rank = dist.get_rank()
        self.group = None
        if enabled:
            timeout = None if timeout_s is None else timedelta(seconds=float(timeout_s))
            self.group = dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timeout)
        self._next: _Next | None = None

    def _issue(self, step: int, group) -> _Next:
        batch = self.placer.place(self.source.batch(step, self.rank))
        features = lookup_features(batch, self.source.user_table, self.device)
        return _Next(step, batch, self.placer.traffic, self.module.input_dist(features, group))

    def take(self, step: int) -> tuple[Batch, Traffic, Prepared]:
        """Step ``step``'s batch, its sample placement's bytes and its prepared input (the prefetched one
        when the pipeline issued it, else prepared now). Raises the batch's input error on every rank."""
        ahead, self._next = self._next, None
        if ahead is None or ahead.step != step:
            ahead = self._issue(step, None)
        return ahead.batch, ahead.placement, ahead.pending.wait()

    def prefetch(self, step: int, last: int) -> None:
        """Issue batch ``step``'s ``input_dist`` on the side group (pipelined, and ``step < last``)."""
        if self.enabled and step < last:
            self._next = self._issue(step, self.group)

    def advance(self) -> None:
        """Read the prefetched batch's ``ids`` headers (and issue its overflow where needed; pipelined
        only)."""
        if self._next is not None:
            self._next.pending.advance()
