"""Agreeing on an error before anyone acts: a rank that finds a problem tells every rank, so all ranks
raise the same error and none is left waiting in a collective."""

from __future__ import annotations

import torch
import torch.distributed as dist


def agreed_message(message: str, device: torch.device | None = None) -> str:
    """The first non-empty ``message`` over the ranks in rank order, or '' (collective). One all-reduce
    of a flag on ``device`` (this rank's: its GPU under NCCL, the CPU under gloo); the messages
    themselves travel only when some rank has one."""
    flag = torch.tensor([1 if message else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag)
    if not int(flag.item()):
        return ""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, message)
    return next(m for m in everyone if m)


def all_ok(ok: bool, device: torch.device | None = None) -> bool:
    """True when every rank's ``ok`` is True (collective)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(int(flag.item()))
