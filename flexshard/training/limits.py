"""Limits checked before any training state exists: whether one step's batch fits this rank's memory.

A step's tensors grow with the batch, the history length, the dim, the tables and the candidates per
sample (the target plus ``--negatives``); a batch or a negative count far past the machine is refused
here with one line, instead of a ``MemoryError`` traceback on every rank or a kill by the kernel once
overcommitted pages are touched (:func:`core.osutil.physical_memory_bytes`).
"""

from __future__ import annotations

import os

import torch

from core.errors import ConfigError
from core.osutil import physical_memory_bytes
from flexshard.workloads import DEFAULT_BATCH_SIZE_PER_GPU, DEFAULT_NEGATIVES, DEFAULT_WINDOW

ID_COPIES = 6  # int64 copies of every id: the batch, the lookup values, dedup, routing, owner/slot, exchange
VECTOR_COPIES = 2  # float32 vectors per id alive at once: the looked-up ones and their exchange or gradient


def step_bytes(
    batch: int, max_len: int, dim: int, negatives: int, sequence_tables: int, user_table: bool = True
) -> int:
    """Bytes one training step allocates on one rank, roughly (an upper estimate: every history at
    ``max_len``). With ``B`` = ``batch``, ``L`` = ``max_len``, ``D`` = ``dim``, ``C`` = ``1 + negatives``
    candidates, ``T`` = ``sequence_tables`` and ``I = T (L + C) + [user_table]`` ids per sample::

        B x [ 8 B x ID_COPIES x I                                    (ids and their routing)
            + 4 B x D x VECTOR_COPIES x I                            (the ids' embedding vectors)
            + 4 B x (5 L D + 5 C D + 3 C L) ]                        (the attention model)

    where ``5 L D`` is the summed, padded, position-added history and its keys and values, ``5 C D``
    the candidates, their queries, the pooled vectors, the output layer and the scores' products, and
    ``3 C L`` the attention scores, masked and normalised. Calibrated on CPU (batch 512, 2 tables):
    the peak RSS above an idle run's was 0.78 of this at dim 16 / 5,000 negatives, 0.86 at dim 64 /
    2,000 negatives and 0.97 at max_len 200 / 200 negatives."""
    c = 1 + negatives
    ids = sequence_tables * (max_len + c) + int(user_table)
    dense = 5 * max_len * dim + 5 * c * dim + 3 * c * max_len
    per_sample = 8 * ID_COPIES * ids + 4 * dim * VECTOR_COPIES * ids + 4 * dense
    return int(batch) * per_sample


def memory_per_rank(dev: torch.device) -> tuple[int | None, str]:
    """The memory one rank may use and where it comes from: the GPU's total memory under CUDA, else the
    machine's physical memory divided among the local ranks (``LOCAL_WORLD_SIZE``, default 1); None
    where the system does not say."""
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory), f"GPU {dev}'s memory"
    have = physical_memory_bytes()
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    if have is None:
        return None, ""
    if local == 1:
        return have, "this machine's memory"
    return have // local, f"this machine's {_gib(have)} shared by {local} local ranks"


def check_step_memory(
    batch: int,
    max_len: int,
    dim: int,
    negatives: int,
    sequence_tables: int,
    user_table: bool,
    dev: torch.device,
    replicas: int = 1,
) -> None:
    """ConfigError (one line: the flags, their values, the estimate and the memory) when
    ``replicas`` x :func:`step_bytes` is over :func:`memory_per_rank` (``replicas``: how many batches a
    rank computes per step, ``1 + world`` under ``--verify``, whose reference runs the global batch)."""
    have, what = memory_per_rank(dev)
    if have is None:
        return
    values = {"batch_size": batch, "negatives": negatives, "max_len": max_len, "dim": dim}

    def need(**changed: int) -> int:
        v = {**values, **changed}
        per_batch = step_bytes(
            v["batch_size"], v["max_len"], v["dim"], v["negatives"], sequence_tables, user_table
        )
        return replicas * per_batch

    total = need()
    if total <= have:
        return
    defaults = {
        "negatives": DEFAULT_NEGATIVES,
        "batch_size": DEFAULT_BATCH_SIZE_PER_GPU,
        "max_len": DEFAULT_WINDOW,
    }
    culprits = [f for f, d in defaults.items() if values[f] > d and need(**{f: d}) <= have] or ["batch_size"]
    flag = _flag(culprits[0])
    others = ", ".join(f"{_flag(f)} {v:,}" for f, v in values.items() if f != culprits[0])
    raise ConfigError(
        f"{flag}: {values[culprits[0]]:,} (with {others}) needs about {_gib(total)} per rank for one "
        f"step{' and its --verify reference' if replicas > 1 else ''}, over {what} ({_gib(have)}); "
        f"lower {' or '.join(_flag(f) for f in culprits)}"
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"
