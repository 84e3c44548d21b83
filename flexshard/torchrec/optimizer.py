"""The fused optimizer of a FlexShard-sharded ``EmbeddingCollection``, as TorchRec's ``CombinedOptimizer``
takes it.

TorchRec's own fused optimizers update rows inside backward and their ``step()`` does nothing. FlexShard
updates in ``step()``: the replica sync (hot and warm gradients summed over their copies) and then the
update of every row that received gradient, so that every copy of a row gets the same update
(:meth:`flexshard.runtime.ShardedSequenceEmbedding.step`). ``step()`` is therefore collective: every rank
calls it once per training step (``CombinedOptimizer.step`` and TorchRec's train pipelines do).

State dict (for ``torch.distributed.checkpoint``): keyed as TorchRec's fused optimizers key theirs,
``{"state": {"embeddings.<t>.weight": {"<t>.momentum1": DTensor, "<t>.exp_avg_sq": DTensor, "<t>.step":
tensor}}}`` (``CombinedOptimizer`` puts the module's path before each key), every row's state once in the
canonical layout of :mod:`flexshard.runtime.dcp_state`. Each state value is a small object with
``state_dict()`` / ``load_state_dict()``, which ``KeyedOptimizer.state_dict`` and ``load_state_dict`` call:
the first ``state_dict()`` of a pass moves every table's state into its canonical blocks (ONE all-to-all)
and the pass's other values read them; ``load_state_dict`` collects the loaded blocks, and
``post_load_state_dict`` (which ``KeyedOptimizer.load_state_dict`` calls last) deals them to the rows
(ONE all-to-all). Both are therefore collective, like TorchRec's own sharded state dicts: every rank calls
``state_dict()`` and ``load_state_dict()`` in the same order. Reading ``state`` alone moves nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchrec.optim.fused import FusedOptimizer

from core.vocabulary import Tier
from flexshard.runtime import ShardedSequenceEmbedding, dcp_state


class _StateValue:
    """One table's optimizer state ``name`` (or the iteration, ``name == dcp_state.STEP``) in the fused
    optimizer's ``state``: :meth:`state_dict` gives it as DCP saves it, :meth:`load_state_dict` takes it
    back (applied in :meth:`FlexShardFusedOptimizer.post_load_state_dict`)."""

    def __init__(self, owner: FlexShardFusedOptimizer, table: str, name: str) -> None:
        self.owner, self.table, self.name = owner, table, name

    def state_dict(self) -> torch.Tensor:
        return self.owner._saved(self)

    def load_state_dict(self, value: Any) -> None:
        self.owner._loaded[(self.table, self.name)] = value

    def __repr__(self) -> str:
        return f"<{self.table}.{self.name}: FlexShard rows, moved on state_dict()>"


class FlexShardFusedOptimizer(FusedOptimizer):
    """``step()`` runs the module's replica sync and update with the hyper-parameters of
    ``param_groups[0]`` (``lr``, ``eps``, ``beta1``, ``beta2``; TorchRec's and torch's schedulers can change
    ``lr``); ``zero_grad`` clears the rows' accumulated gradients. Parameters: per table,
    ``"embeddings.<t>.weight"`` (the tensor standing for it is this rank's hot shard of the table); state:
    per table its optimizer state values (module docstring), none for SGD."""

    def __init__(self, embedding: ShardedSequenceEmbedding) -> None:
        self._embedding = embedding
        self._pending: set[_StateValue] = set()  # values of the current state_dict() pass not yet read
        self._blocks: dcp_state.Canonical | None = None
        self._loaded: dict[tuple[str, str], Any] = {}
        names = sorted(dcp_state.state_names(embedding))
        params, state = {}, {}
        for t, table in enumerate(embedding.table_names):
            key = dcp_state.weight_key(table)
            params[key] = embedding.shards[(t, Tier.HOT)].weights
            values = [_StateValue(self, table, n) for n in names]
            if dcp_state.uses_step(embedding):
                values.append(_StateValue(self, table, dcp_state.STEP))
            state[params[key]] = {dcp_state.state_key(table, v.name): v for v in values}
        group = {
            "params": list(params.values()),
            "lr": embedding.lr,
            "eps": embedding.eps,
            "beta1": embedding.betas[0],
            "beta2": embedding.betas[1],
        }
        super().__init__(params, state, [group])

    def step(self, closure: Any = None) -> None:
        """Replica sync and row update on every rank (collective); ``closure`` is not supported."""
        if closure is not None:
            raise ValueError("closure: FlexShardFusedOptimizer.step takes no closure")
        group = next(iter(self.param_groups))
        self._embedding.lr, self._embedding.eps = float(group["lr"]), float(group["eps"])
        self._embedding.betas = (float(group["beta1"]), float(group["beta2"]))
        self._embedding.step()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._embedding.zero_grad(set_to_none)

    # --- state dict -------------------------------------------------------------------------------

    def _values(self) -> set[_StateValue]:
        return {v for per_table in self.state.values() for v in per_table.values()}

    def _saved(self, value: _StateValue) -> torch.Tensor:
        """``value`` as DCP saves it; the first value of a pass moves every state row (collective)."""
        emb = self._embedding
        if value.name == dcp_state.STEP:
            return dcp_state.step_tensor(emb)
        if self._blocks is None or value not in self._pending:
            self._blocks = dcp_state.to_canonical(emb, dcp_state.state_names(emb))
            self._pending = {v for v in self._values() if v.name != dcp_state.STEP}
        self._pending.discard(value)
        t = emb.table_names.index(value.table)
        block = self._blocks.blocks[value.table][value.name]
        out = dcp_state.dtensor(block, emb.routing[t].num_rows, dcp_state.device_mesh(emb))
        if not self._pending:
            self._blocks = None
        return out

    def post_load_state_dict(self) -> None:
        """Deal the state values :meth:`load_state_dict` collected to every row held here (collective:
        one all-to-all), and the iteration. A value missing is one agreed CheckpointError."""
        loaded, self._loaded = self._loaded, {}
        if not loaded:
            return
        emb = self._embedding
        names = dcp_state.state_names(emb)
        blocks, steps = {}, set()
        problem = ""
        for t, table in enumerate(emb.table_names):
            lo, hi = dcp_state.block_bounds(emb.routing[t].num_rows, emb.world_size, emb.rank)
            blocks[table] = {}
            for n in names:
                v = loaded.get((table, n))
                if v is None:
                    problem = problem or f"fused optimizer state: no {dcp_state.state_key(table, n)} loaded"
                    continue
                blocks[table][n] = v.to_local() if isinstance(v, DTensor) else v[lo:hi]
            if dcp_state.uses_step(emb):
                try:
                    where = f"optim.state.{dcp_state.weight_key(table)}"
                    steps.add(dcp_state.step_of(table, loaded.get((table, dcp_state.STEP)), where))
                except Exception as e:  # noqa: BLE001 - one agreed line below
                    problem = problem or str(e)
        dcp_state.check_agreed(problem, emb.device)
        if names:
            dcp_state.from_canonical(emb, dcp_state.canonical_of(emb, blocks), names)
        if steps:
            emb.optimizer_step = max(steps)
