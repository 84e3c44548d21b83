"""``torch.distributed.checkpoint`` (DCP) state of a :class:`~flexshard.runtime.ShardedSequenceEmbedding`.

A plan places rows by hotness (hot rows on every rank, warm rows once per group, cold rows once), which DCP
cannot describe. The DCP state is therefore a *canonical layout*: every table, and every optimizer state
tensor of it, as one logical ``[num_rows, ...]`` tensor split in contiguous row blocks over the world, a
``DTensor`` placed ``Shard(0)`` on a 1-D device mesh of every rank (rank ``r`` holds rows
``[min(r*B, n), min((r+1)*B, n))`` with ``B = ceil(n / world)``, as ``torch.chunk`` and DTensor split
them). DCP reshards such tensors between world sizes itself, so a checkpoint saved at world 4 under plan A
loads at world 2 under plan B: the canonical blocks change, and each rank re-deals them by its own plan.
The moves between the plan's placement and the blocks are :mod:`flexshard.runtime.canonical_rows`'s.

Keys (TorchRec's, so that a TorchRec module can expose the same state): the weights of table ``t`` are
``model["embeddings.<t>.weight"]`` (``EmbeddingCollection``'s key); its optimizer state tensors are
``optim["state"]["embeddings.<t>.weight"]["<t>.<name>"]`` as TorchRec's fused optimizer names them
(``KeyedOptimizer.state_dict``: the first state is ``momentum1``, e.g. row-wise Adagrad's accumulator
``[rows]``, later ones keep FBGEMM's name: Adam's ``momentum2`` is ``exp_avg_sq`` ``[rows, dim]``,
:data:`TORCHREC_NAMES`). An optimizer whose update reads the iteration (Adam's ``t``) also has
``optim["state"]["embeddings.<t>.weight"]["<t>.step"]``: the module's ``optimizer_step`` as a 0-d int64
tensor (the same on every rank, so DCP saves it once as a replicated tensor and every rank loads it).
:func:`dcp_state_dict` returns ``{"model": {...}, "optim": {"state": {...}}}``, what a TorchRec user saves
with DCP.

Weights and optimizer state move separately when asked (``names`` of :func:`to_canonical` and
:func:`from_canonical`): TorchRec exposes them from two methods (the module's ``state_dict`` and the fused
optimizer's), each its own collective move.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from core.errors import CheckpointError
from flexshard.runtime.canonical_rows import (  # noqa: F401 - re-exported: the DCP state's one import
    TIERS,
    WEIGHT,
    Canonical,
    _agree,
    _row_shapes,
    _row_states,
    block_bounds,
    block_owner,
    canonical_of,
    check_agreed,
    empty_canonical,
    from_canonical,
    state_names,
    to_canonical,
)

# a flexshard.runtime.ShardedSequenceEmbedding, which imports this module (so not imported here)
ShardedSequenceEmbedding = Any

STEP = "step"  # the per-table key (after "<t>.") of optimizer_step, for optimizers that use it
TORCHREC_NAMES = {"momentum2": "exp_avg_sq"}  # runtime state name -> TorchRec's (fbgemm's Adam) key
RUNTIME_NAMES = {v: k for k, v in TORCHREC_NAMES.items()}


def weight_key(table: str, prefix: str = "") -> str:
    """TorchRec ``EmbeddingCollection``'s state-dict key of a table's weights; ``prefix``: the collection's
    own key in the model, with its dot (e.g. ``"ec."``), as ``Module.state_dict`` prefixes it."""
    return f"{prefix}embeddings.{table}.{WEIGHT}"


def state_key(table: str, name: str) -> str:
    """TorchRec fused optimizer's key of a table's optimizer state ``name`` (the runtime's, e.g.
    ``momentum2``; under its weight key): ``<t>.momentum1``, ``<t>.exp_avg_sq``, ``<t>.step``."""
    return f"{table}.{TORCHREC_NAMES.get(name, name)}"


def state_name(table: str, key: str) -> str:
    """The runtime's state name of a TorchRec state key of ``table`` (inverse of :func:`state_key`)."""
    name = key[len(table) + 1 :] if key.startswith(f"{table}.") else key
    return RUNTIME_NAMES.get(name, name)


def uses_step(module: ShardedSequenceEmbedding) -> bool:
    """Whether ``module``'s optimizer reads the iteration (then its DCP state carries ``<t>.step``)."""
    return bool(getattr(module.row_optimizer, "uses_step", False))


# --- DTensors and the state dict ------------------------------------------------------------------------


def device_mesh(module: ShardedSequenceEmbedding) -> DeviceMesh:
    """A 1-D device mesh of every rank, made once per module (collective the first time)."""
    mesh = module.__dict__.get("_dcp_mesh")
    if mesh is None:
        mesh = init_device_mesh(module.device.type, (module.world_size,))
        module.__dict__["_dcp_mesh"] = mesh
    return mesh


def dtensor(local: torch.Tensor, num_rows: int, mesh: DeviceMesh) -> DTensor:
    """``local`` (this rank's canonical block) as the ``Shard(0)`` DTensor of ``num_rows`` rows."""
    shape = torch.Size((num_rows, *local.shape[1:]))
    stride = tuple(int(np.prod(shape[i + 1 :], dtype=np.int64)) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def dcp_state_dict(module: ShardedSequenceEmbedding, empty: bool = False, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"embeddings.<t>.weight": DTensor}, "optim": {"state": {"embeddings.<t>.weight":
    {"<t>.<state>": DTensor}}}}``: every row once, in the canonical layout (module docstring); what
    ``torch.distributed.checkpoint.save`` saves and ``load`` fills in place. ``empty``: blocks allocated
    but not filled (no move), a template for ``load``. ``prefix``: before every weight key
    (:func:`weight_key`), to match a TorchRec model's keys. Collective."""
    canonical = empty_canonical(module) if empty else to_canonical(module)
    model, state = as_dtensors(canonical, device_mesh(module), prefix)
    if uses_step(module):
        for name in module.table_names:
            state[weight_key(name, prefix)][state_key(name, STEP)] = step_tensor(module)
    return {"model": model, "optim": {"state": state}}


def step_tensor(module: ShardedSequenceEmbedding) -> torch.Tensor:
    """``module.optimizer_step`` as the 0-d int64 tensor the DCP state carries (CPU: DCP saves it as a
    replicated tensor, written once)."""
    return torch.tensor(int(module.optimizer_step), dtype=torch.int64)


def as_dtensors(
    canonical: Canonical, mesh: DeviceMesh, prefix: str = ""
) -> tuple[dict[str, DTensor], dict[str, dict]]:
    """The blocks as DTensors: ``({"embeddings.<t>.weight": ...}, {"embeddings.<t>.weight": {"<t>.<state>":
    ...}})``, a module's state dict and its fused optimizer's ``state`` the way TorchRec keys them (for a
    module that exposes them separately: one :func:`to_canonical` serves both). Shares the blocks' memory."""
    model, state = {}, {}
    for name, n in zip(canonical.tables, canonical.num_rows, strict=True):
        block = canonical.blocks[name]
        model[weight_key(name, prefix)] = dtensor(block[WEIGHT], n, mesh)
        state[weight_key(name, prefix)] = {
            state_key(name, k): dtensor(v, n, mesh) for k, v in block.items() if k != WEIGHT
        }
    return model, state


def load_dcp_state_dict(
    module: ShardedSequenceEmbedding, state_dict: dict[str, Any], prefix: str = ""
) -> None:
    """Set every row ``module`` holds from a state dict of :func:`dcp_state_dict`'s form (as
    ``torch.distributed.checkpoint.load`` filled it, possibly saved at another world size or plan). A
    missing table or state, or one of another shape, is one agreed CheckpointError. Collective."""
    problem, blocks, step = "", {}, None
    try:
        blocks, step = _blocks_of(module, state_dict, prefix)
    except CheckpointError as e:
        problem = str(e)
    _agree(problem, module.device)
    from_canonical(module, canonical_of(module, blocks))
    if step is not None:
        module.optimizer_step = step


def step_of(name: str, value: Any, where: str) -> int:
    """The iteration a ``<t>.step`` entry holds (a 0-d integer tensor or an int); CheckpointError else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.reshape(()).item())
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise CheckpointError(f"DCP state: {where}.{state_key(name, STEP)} is not an integer, got {value!r}")


def _blocks_of(
    module: ShardedSequenceEmbedding, state_dict: Any, prefix: str = ""
) -> tuple[dict[str, dict[str, torch.Tensor]], int | None]:
    """The canonical blocks in ``state_dict`` (local tensors of its DTensors), checked against ``module``,
    and the saved ``optimizer_step`` (None when the optimizer does not use it; a module whose optimizer
    uses it needs it: CheckpointError)."""
    model = state_dict.get("model") if isinstance(state_dict, dict) else None
    optim = state_dict.get("optim") if isinstance(state_dict, dict) else None
    states = optim.get("state") if isinstance(optim, dict) else None
    if not isinstance(model, dict) or not isinstance(states, dict):
        raise CheckpointError("DCP state: expected {'model': {...}, 'optim': {'state': {...}}}")
    blocks: dict[str, dict[str, torch.Tensor]] = {}
    step = None
    for name, r in zip(module.table_names, module.routing, strict=True):
        key = weight_key(name, prefix)
        if key not in model:
            raise CheckpointError(f"DCP state: no key model.{key} (table {name!r}; it has {sorted(model)})")
        per_table = dict(states.get(key, {}))
        saved_step = per_table.pop(state_key(name, STEP), None)
        if uses_step(module):
            if saved_step is None:
                raise CheckpointError(
                    f"DCP state: no optim.state.{key}.{state_key(name, STEP)} (the iteration "
                    f"{module.optimizer!r} needs)"
                )
            step = step_of(name, saved_step, f"optim.state.{key}")
        block = {WEIGHT: model[key]}
        for skey, value in per_table.items():
            block[state_name(name, skey)] = value
        lo, hi = block_bounds(r.num_rows, module.world_size, module.rank)
        for k, v in block.items():
            if tuple(v.shape[:1]) != (r.num_rows,):
                where = f"model.{key}" if k == WEIGHT else f"optim.state.{key}.{state_key(name, k)}"
                raise CheckpointError(
                    f"DCP state: {where} has shape {list(v.shape)}, table {name!r} has {r.num_rows} rows"
                )
            block[k] = v.to_local() if isinstance(v, DTensor) else v[lo:hi]  # a full tensor: this block
        blocks[name] = block
    return blocks, step


class DcpStateful:
    """``module``'s DCP state as a ``torch.distributed.checkpoint.stateful.Stateful``: put it in the state
    dict given to ``dcp.save`` / ``dcp.load`` (e.g. ``{"embedding": DcpStateful(module), ...}``); DCP calls
    :meth:`state_dict` (and on load fills it, then calls :meth:`load_state_dict`)."""

    def __init__(self, module: ShardedSequenceEmbedding) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return dcp_state_dict(self.module)  # also a load's template: DCP gives no way to tell them apart

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_dcp_state_dict(self.module, state_dict)


__all__ = [
    "STEP",
    "TORCHREC_NAMES",
    "Canonical",
    "canonical_of",
    "check_agreed",
    "dtensor",
    "empty_canonical",
    "state_name",
    "state_names",
    "step_of",
    "step_tensor",
    "uses_step",
    "as_dtensors",
    "DcpStateful",
    "block_bounds",
    "block_owner",
    "dcp_state_dict",
    "device_mesh",
    "from_canonical",
    "load_dcp_state_dict",
    "state_key",
    "to_canonical",
    "weight_key",
]
