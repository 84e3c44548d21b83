"""One training run: the source's batches through the sharded embeddings and the dense model, step by
step, with verification, metrics and checkpoints (``flexshard train``; see :mod:`flexshard.train`).

Gradients: each rank's loss is its batch mean divided by the world size; embedding rows get the sum
over ranks (the module's semantics) and dense gradients are all-reduced with SUM, so both follow the
mean loss over the global batch. Dense parameters use element-wise SGD / Adagrad
(:class:`flexshard.model.DenseOptimizer`, ``torch.optim``'s math) with the same learning rate as the
row-wise embedding optimizer.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from core.errors import CheckpointError, FlexShardError, InputError, agreed
from core.osutil import check_writable
from core.ranks import RankLayout
from core.vocabulary import FetchMode
from flexshard import checkpoint
from flexshard.batching import SamplePlacer
from flexshard.cli_common import first_line
from flexshard.model import DenseOptimizer, SequenceRecModel, batch_logits, lookup_features
from flexshard.plan_file import PlanFile, read_plan
from flexshard.runtime import ShardedSequenceEmbedding, seeded_initializer
from flexshard.runtime.agreement import agreed_message
from flexshard.training import metrics
from flexshard.training.config import TrainConfig
from flexshard.training.data import make_source
from flexshard.training.distributed import Phase, allreduce_dense_grads, device
from flexshard.training.planning import batch_size, check_plan, plan_on_the_fly
from flexshard.training.reference import Reference
from flexshard.training.resume import directory_problem, identity_mismatch, prune, run_identity
from flexshard.training.verify import Verifier, describe_tolerance


def _say(rank: int):
    return print if rank == 0 else (lambda *a, **k: None)


def _prepare(config: TrainConfig, world: int, rank: int, dev: torch.device) -> tuple:
    """The source, the plan (checked or made) and the log lines, before any training state exists.
    Collective: an error on any rank (an output path, the data, the plan) ends every rank alike."""
    problem, source, given, plan_file, notes = "", None, None, None, []
    try:
        if config.metrics_out:
            check_writable(config.metrics_out, "--metrics-out")
        given = read_plan(config.plan) if config.plan else None
        source = make_source(
            config.data, config.dim, config.max_len, config.negatives, batch_size(config, given), config.seed
        )
        if given is not None:
            names = [name for name, _rows, _dim in source.tables]
            plan_file, notes = check_plan(config, given, names, world, source.touch_sampling)
        else:
            RankLayout.consecutive(world, config.groups or 1, "--groups")  # planned below, checked here
    except InputError as e:
        problem = first_line(e)
    problem = agreed_message(problem, dev)
    if problem:
        raise agreed(InputError(problem))
    if given is None:
        plan_file = plan_on_the_fly(config, source, world, rank)
    return source, plan_file, notes


def _describe(config: TrainConfig, world: int, dev: torch.device, source, plan_file: PlanFile) -> list[str]:
    plan = plan_file.plan
    groups = plan_file.layout
    return [
        f"train: world {world} ({groups.num_groups} groups of {world // groups.num_groups}), "
        f"backend {dist.get_backend()}, device {dev}, data {source.describe()}",
        f"plan ({plan.strategy}): "
        + ", ".join(
            f"{t.name} hot/warm/cold {t.hot_rows}/{t.warm_rows}/{t.cold_rows}"
            + (" (group fetch)" if t.cold_rows and t.fetch is FetchMode.GROUP else "")
            for t in plan.tables
        )
        + f"; optimizer {config.optimizer}, lr {config.lr}, dedup {'on' if plan.dedup else 'off'}, "
        f"{plan.sync.value} sync, batch {plan_file.batch_size_per_gpu} per rank, "
        f"objective {config.objective}, layout {config.layout}, wire {plan.wire}, "
        f"sample placement {config.sample_placement}",
    ]


def run(config: TrainConfig) -> int:
    """Train as ``config`` says (collective: every rank of the default process group calls it). A
    collective whose peer fails ends the run with a :class:`~core.errors.CollectiveError` naming the
    rank and the phase."""
    phase = Phase(dist.get_rank(), config.timeout)
    with phase.guard():
        return _run(config, phase)


def _run(config: TrainConfig, phase: Phase) -> int:
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = device()
    say = _say(rank)
    source, plan_file, notes = _prepare(config, world, rank, dev)
    problem = agreed_message(directory_problem(config) if rank == 0 else "", dev)  # before any work
    if problem:
        raise agreed(CheckpointError(problem))

    torch.manual_seed(config.seed)
    dense = SequenceRecModel(config.dim, config.max_len, config.objective).to(dev)
    for p in dense.parameters():  # same initial weights everywhere (already equal by seed)
        dist.broadcast(p.data, src=0)
    dense_opt = DenseOptimizer(dense.parameters(), config.optimizer, config.lr)
    module = ShardedSequenceEmbedding(
        plan_file,
        source.tables,
        source.orders,
        init=config.seed,
        optimizer=config.optimizer,
        lr=config.lr,
        device=dev,
        layout=config.layout,
        timeout_s=config.timeout,
    )
    placer = SamplePlacer(config.sample_placement, module, source.user_table)
    identity = run_identity(config, source, plan_file, module)
    start, resumed_from = 0, None
    if config.resume:
        resumed_from = checkpoint.latest(config.checkpoint_dir)
        if resumed_from is not None:
            saved = checkpoint.read_manifest(resumed_from).get("run")
            problem = agreed_message(identity_mismatch(resumed_from, saved, identity), dev)
            if problem:
                raise agreed(CheckpointError(problem))
            start = checkpoint.load(resumed_from, module, dense, dense_opt)
            say(f"resume: {resumed_from} (step {start})" + ("" if saved else "; it records no run identity"))
        else:
            say(f"resume: no checkpoint in {config.checkpoint_dir}, starting at step 0")
    for line in [*_describe(config, world, dev, source, plan_file), *notes]:
        say(line)

    log = metrics.MetricsLog(config.metrics_out, rank, append=resumed_from is not None)
    if config.metrics_out:
        log.write(metrics.header_record(config, world, source.describe(), plan_file, dev, start))
    verifier = (
        Verifier(module, _reference(config, source, module, dense, resumed_from, dev), rank)
        if config.verify
        else None
    )
    if verifier is not None:
        say(
            "verify: each step against an unsharded reference from the same state; normwise tolerance "
            + describe_tolerance(plan_file.plan.wire)
        )

    def _step(step: int) -> None:
        """One training step (collective), with its log line, metrics, check and checkpoint."""
        t0 = time.perf_counter()
        phase.at(f"step {step + 1}: sample placement")
        batch = placer.place(source.batch(step, rank))
        phase.at(f"step {step + 1}: forward")
        emb = module(lookup_features(batch, source.user_table, dev))
        module.traffic += placer.traffic  # the samples' move is part of the step's ids
        logits = batch_logits(dense, emb, batch, source.user_table)
        loss = dense.loss(logits) / world
        dense_opt.zero_grad()
        phase.at(f"step {step + 1}: backward")
        loss.backward()
        allreduce_dense_grads(dense, world)
        dense_grads = [p.grad.detach().clone() for p in dense.parameters()] if verifier else []
        dense_opt.step()
        phase.at(f"step {step + 1}: replica sync")
        module.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - t0
        link = module.link_bytes()
        stats = torch.tensor(
            [float(loss.detach()), link["intra_group"], link["inter_group"], elapsed], device=dev
        )
        phase.at(f"step {step + 1}: step figures")
        loss_sum = stats[:1].clone()
        dist.all_reduce(loss_sum)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        if config.metrics_out:  # collective: every rank gathers, rank 0 writes
            log.write(metrics.step_record(step + 1, float(loss_sum), elapsed, module.traffic, dev))
        if not config.quiet:
            say(
                f"step {step + 1}/{config.steps} loss {float(loss_sum):.6f} "
                f"samples/s {world * source.batch_size / max(float(stats[3]), 1e-9):,.0f} "
                f"intra_group {float(stats[1]):,.0f} B inter_group {float(stats[2]):,.0f} B (max over ranks)"
            )
        if verifier is not None:
            phase.at(f"step {step + 1}: verify")
            batches: list = [None] * world
            dist.all_gather_object(batches, batch)
            verifier.check_step(step + 1, batches, logits.detach(), dense, dense_grads)
        if config.checkpoint_dir and (
            (config.checkpoint_every and (step + 1) % config.checkpoint_every == 0)
            or step + 1 == config.steps
        ):
            phase.at(f"step {step + 1}: checkpoint")
            path = checkpoint.save(
                module, dense, dense_opt, step + 1, config.checkpoint_dir, {"seed": config.seed}, identity
            )
            removed = prune(config.checkpoint_dir, config.keep) if rank == 0 else []
            say(
                f"checkpoint: saved {path}"
                + (f" (removed {len(removed)} older, --keep {config.keep})" if removed else "")
            )

    done = start
    try:
        for step in range(start, config.steps):
            _step(step)
            done = step + 1
        if verifier is not None:
            verifier.finish()
            say(f"verify: OK ({config.steps - start} steps, all rows of all copies match)")
    except FlexShardError as e:  # the steps done stay in the log, with what ended the run
        log.write({"kind": "end", "steps": done - start, "error": first_line(e)})
        log.close()
        raise
    if config.metrics_out:
        log.write({"kind": "end", "steps": config.steps - start, "verify": "OK" if config.verify else None})
        log.close()
        say(f"metrics: wrote {config.metrics_out} ({config.steps - start} steps)")
    return 0


def _reference(config, source, module, dense, resumed_from, dev) -> Reference:
    """The unsharded reference, from the checkpoint resumed from or from the same initializer."""
    if resumed_from is not None:
        full = checkpoint.load_full(resumed_from)
        weights, state = full.weights, full.state
    else:
        init = seeded_initializer(config.seed)
        weights = {n: init(n, np.arange(r), d) for n, r, d in source.tables}
        state = {n: torch.zeros(r) for n, r, _d in source.tables}
    return Reference(weights, state, dense, config.optimizer, config.lr, module.eps, source.user_table, dev)
