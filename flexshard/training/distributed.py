"""The job's process group, the dense model's gradient all-reduce, and naming a failed collective."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from core.errors import CollectiveError, ConfigError, agreed
from core.ranks import BACKEND_ENV, launcher_gpu, pick_backend
from flexshard.runtime.host_memory import keep_freed_memory

DEFAULT_TIMEOUT_S = 600.0  # how long a collective waits for a peer (train --timeout)
_PEER_FAILURES = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[bool, torch.device]:
    """Init the default process group from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT; gloo on CPU, NCCL when CUDA is available, or as ``FLEXSHARD_BACKEND`` says), or a world
    of one without a launcher; its collectives fail after ``timeout_s`` seconds without a peer. Returns
    (whether this call created it, this rank's device)."""
    end_with_agent()
    created = False
    timeout = timedelta(seconds=float(timeout_s))
    if not dist.is_initialized():
        try:  # the same environment on every process of the host: the same answer
            backend = pick_backend(os.environ.get(BACKEND_ENV), torch.cuda.is_available())
            gpu = launcher_gpu(torch.cuda.device_count()) if backend == "nccl" else None
        except ConfigError as e:
            raise agreed(e) from None
        if gpu is not None:
            torch.cuda.set_device(gpu)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            # every restart attempt under torchrun gets its own keys: a restarted mesh must not meet the
            # addresses the failed attempt left in the agent's store (gloo then fails to connect or hangs)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"flexshard/attempt-{attempt}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        created = True
    if device().type == "cpu":  # the step's tensors live in host memory: keep it between steps
        keep_freed_memory()
    return created, device()


_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): a signal for this process when its parent dies


def end_with_agent() -> bool:
    """Under torchrun (Linux), have the kernel SIGKILL this worker when its agent dies.

    torchrun starts its workers in sessions of their own, so a killed agent leaves them training as
    orphans; a relaunched job would then share the checkpoint folder with them. Returns whether it was
    armed (a worker of torchelastic on Linux); a worker whose agent is already gone exits at once.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() == 1:  # the agent died before the line above: no signal will come
        os._exit(3)
    return True


def device() -> torch.device:
    """This rank's device: its current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


CUBLAS_WORKSPACE = ":4096:8"  # CUBLAS_WORKSPACE_CONFIG that makes cuBLAS deterministic (CUDA 10.2+)


def use_deterministic_algorithms() -> None:
    """``train --deterministic``: torch's deterministic algorithms from here on, and on CUDA the cuBLAS
    workspace setting they need (read when this process first uses cuBLAS: call it before any matrix
    product on the GPU; a value already set is kept)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)


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


class Phase:
    """Where a rank is in a step, so that a collective that fails (a peer stopped, died or is late) ends
    with one line naming the rank and the phase (:class:`~core.errors.CollectiveError`)."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank, self.timeout_s, self.now = rank, timeout_s, "start-up"
        self.step = 0  # the training step under way (1-based); 0 before the first

    def at(self, where: str) -> None:
        self.now = where

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a collective's peer failure inside the block into a CollectiveError; other errors pass."""
        try:
            yield
        except RuntimeError as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if not any(word in text.lower() for word in _PEER_FAILURES):
                raise
            raise CollectiveError(
                f"rank {self.rank}: a collective failed in {self.now} ({text.split('] ')[-1]}); another rank "
                f"stopped, died, or did not arrive within --timeout {self.timeout_s:g} s"
            ) from None
