"""Device check of the row optimizers (:mod:`flexshard.runtime.optimizers`) on a CUDA GPU.

1. Each optimizer's update on a :class:`~flexshard.runtime.Shard` on the GPU against the same on the CPU
   (64 rows x dim 32, 5 steps of 100 lookups with repeats): the largest difference of the weights,
   relative to how far they moved, and of the state.
2. One rank over NCCL: :class:`~flexshard.runtime.ShardedSequenceEmbedding` on the GPU (the runtime
   tests' plan with hot, warm and cold rows) trains Adam for 3 steps; its rows and moments against the
   single-process CPU reference of ``tests/runtime/runtime_workers.py``; a checkpoint saved and loaded on
   the GPU gives back the rows, moments and ``optimizer_step``.

Run: ``PYTHONPATH=. python3 experiments/optimizers_on_gpu.py`` on a machine with a GPU. Prints one line
per figure and ``GPU CHECK OK``; an assertion fails otherwise.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))
from runtime_workers import (  # noqa: E402  (the runtime tests' plan and batches)
    SEED,
    TABLES,
    loss_weights,
    make_orders,
    random_batch,
    write_test_plan,
)
from training_reference import reference_training  # noqa: E402  (their single-process reference)

from flexshard import checkpoint  # noqa: E402
from flexshard.plan_file import read_plan  # noqa: E402
from flexshard.runtime import OPTIMIZERS, Hyper, Shard, ShardedSequenceEmbedding, row_optimizer  # noqa: E402


def shard_cpu_vs_gpu() -> None:
    hyper = Hyper(lr=0.05)
    for name in OPTIMIZERS:
        opt = row_optimizer(name)
        gen = torch.Generator().manual_seed(0)
        w0 = torch.randn(64, 32, generator=gen)
        cpu, gpu = Shard.of(np.arange(64), w0.clone(), opt), Shard.of(np.arange(64), w0.cuda(), opt)
        for t in range(1, 6):
            ids = torch.randint(0, 48, (100,), generator=gen)  # rows 48-63 never looked up
            g = torch.randn(100, 32, generator=gen)
            cpu.add_gradient(ids, g)
            gpu.add_gradient(ids.cuda(), g.cuda())
            cpu.apply(opt, hyper, t)
            gpu.apply(opt, hyper, t)
        dw = (gpu.weights.cpu() - cpu.weights).abs().max().item()
        ds = max([(gpu.states[k].cpu() - s).abs().max().item() for k, s in cpu.states.items()] or [0.0])
        rel = dw / (cpu.weights - w0).abs().max().item()
        print(
            f"{name}: GPU vs CPU after 5 steps: max |dw| {dw:.3g} ({rel:.3g} of the move), "
            f"max |dstate| {ds:.3g}"
        )
        assert rel < 1e-5 and ds < 1e-4, name
        assert torch.equal(gpu.weights[48:].cpu(), w0[48:])  # untouched rows stay


def _module(plan_file, init: int) -> ShardedSequenceEmbedding:
    return ShardedSequenceEmbedding(plan_file, TABLES, make_orders(), init=init, optimizer="adam", lr=0.05)


def adam_over_nccl(folder: Path) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    plan_file = read_plan(write_test_plan(folder / "plan1.json", 1, 1))
    module = _module(plan_file, SEED)
    assert module.device.type == "cuda", module.device
    t0 = time.perf_counter()
    for step in range(3):
        feats = random_batch(SEED, step, 0)
        out = module(feats)
        lw = loss_weights(SEED, step, 0, feats)
        sum((out[n] * lw[n].to(out[n].device)).sum() for n in out).backward()
        module.step()
    torch.cuda.synchronize()
    print(f"NCCL, one rank, Adam, 3 steps on {module.device}: {time.perf_counter() - t0:.2f} s")
    ref_w, ref_s = reference_training(1, 3, "adam")
    worst_w = worst_s = 0.0
    for (name, _tier), (ids, w, states) in module.shard_rows().items():
        idx = torch.as_tensor(ids, dtype=torch.int64)
        if idx.numel():
            worst_w = max(worst_w, (w - ref_w[name][idx]).abs().max().item())
            worst_s = max(worst_s, *[(s - ref_s[name][k][idx]).abs().max().item() for k, s in states.items()])
    print(f"Adam on the GPU vs the CPU reference: max |dw| {worst_w:.3g}, max |dmoment| {worst_s:.3g}")
    assert worst_w < 1e-5 and worst_s < 1e-5
    checkpoint.save(module, torch.nn.Linear(2, 2), None, 3, folder / "ckpt")
    again = _module(plan_file, SEED + 1)
    checkpoint.load(folder / "ckpt", again)
    assert again.optimizer_step == 3
    loaded = again.shard_rows()
    for key, (_ids, w, states) in module.shard_rows().items():
        w2, s2 = loaded[key][1], loaded[key][2]
        assert torch.equal(w, w2) and all(torch.equal(states[k], s2[k]) for k in states), key
    print("checkpoint saved and loaded on the GPU: rows, moments and optimizer_step 3 equal")
    dist.destroy_process_group()


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs one")
        return 1
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    shard_cpu_vs_gpu()
    adam_over_nccl(Path(tempfile.mkdtemp()))
    print("GPU CHECK OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
