"""The job's process group, and the dense model's gradient all-reduce."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed() -> tuple[bool, torch.device]:
    """Init the default process group from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT; gloo on CPU, NCCL when CUDA is available), or a world of one without a launcher.
    Returns (whether this call created it, this rank's device)."""
    cuda = torch.cuda.is_available()
    created = False
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, init_method="env://")
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        created = True
    return created, device()


def device() -> torch.device:
    """This rank's device: its current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def allreduce_dense_grads(model: torch.nn.Module, world: int) -> None:
    """Sum the dense parameters' gradients over the ranks (one flat all-reduce; missing ones are zero)."""
    params = list(model.parameters())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if world == 1:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    for p, part in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad.copy_(part.view_as(p.grad))
