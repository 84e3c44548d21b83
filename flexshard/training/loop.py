"""One training run: the source's batches through the sharded embeddings and the dense model, step by
step, with verification, metrics and checkpoints (``flexshard train``; see :mod:`flexshard.train`).

Gradients: each rank's loss is its batch mean divided by the world size; embedding rows get the sum
over ranks (the module's semantics) and dense gradients are all-reduced with SUM, so both follow the
mean loss over the global batch. Dense parameters use element-wise SGD / Adagrad
(:class:`flexshard.model.DenseOptimizer`, ``torch.optim``'s math) with the same learning rate as the
row-wise embedding optimizer.

Resuming (``--resume``) starts at the checkpoint's step. Rank ``r``'s batch at step ``s`` is a function of
``(seed, s, r)`` alone, so a run resumed at its own world size continues as if never stopped. At another
world size or with other groups the rows are re-dealt (:mod:`flexshard.checkpoint_reshard`, under the plan
remade for the new world or given) and the steps continue with the new ranks: ranks below both world sizes
draw the batches they would have drawn, the batch per rank stays (it is part of the run's identity), so
the global batch becomes the new world size times it, and the learning rate is not rescaled.

What the run does goes to the ``flexshard.training.loop`` logger (rank 0 only: the run, the plan, one
line per step, checkpoints; see :mod:`flexshard.logs`); its results go to stdout (rank 0): the
verification's verdict and the end-of-run summary (:mod:`flexshard.training.summary`), also under
``--quiet``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from core.errors import CheckpointError, FlexShardError, InputError, agreed
from core.osutil import check_writable
from core.ranks import RankLayout
from core.vocabulary import Component, FetchMode, LinkClass
from flexshard import checkpoint, checkpoint_reshard
from flexshard.batching import SamplePlacer
from flexshard.cli_common import first_line
from flexshard.model import DenseOptimizer, SequenceRecModel, batch_logits
from flexshard.plan_file import PlanFile, read_plan
from flexshard.progress import duration
from flexshard.runtime import ShardedSequenceEmbedding, seeded_initializer
from flexshard.runtime.agreement import agreed_message
from flexshard.training import metrics
from flexshard.training.config import TrainConfig
from flexshard.training.data import data_options, make_source, table_shape
from flexshard.training.distributed import Phase, allreduce_dense_grads, device, use_deterministic_algorithms
from flexshard.training.garbage import StepGarbageCollection
from flexshard.training.limits import check_step_memory
from flexshard.training.pipeline import InputPipeline
from flexshard.training.planning import batch_size, check_plan, check_vocabulary, model_dim, plan_on_the_fly
from flexshard.training.reference import Reference, pack
from flexshard.training.resume import claim_directory, fallback_hint, identity_mismatch, prune, run_identity
from flexshard.training.summary import RunSummary
from flexshard.training.verify import Verifier, describe_tolerance

log = logging.getLogger(__name__)


def _say(rank: int):
    """Rank 0's INFO lines (the other ranks say nothing)."""
    return log.info if rank == 0 else (lambda *a, **k: None)


def _result(rank: int):
    """Rank 0's result lines on stdout, whatever the log level."""
    return print if rank == 0 else (lambda *a, **k: None)


def _prepare(config: TrainConfig, world: int, rank: int, dev: torch.device) -> tuple:
    """The config with its dim resolved (``--dim``, else the plan's: :func:`model_dim`), the source, the
    plan (checked or made) and the log lines, before any training state exists. Collective: an error on
    any rank (an output path, the data, the plan) ends every rank alike."""
    problem, source, given, plan_file, notes = "", None, None, None, []
    try:
        if config.metrics_out:
            check_writable(config.metrics_out, "--metrics-out", config.inputs())
        given = read_plan(config.plan) if config.plan else None
        config = dataclasses.replace(config, dim=model_dim(config, given))
        batch = batch_size(config, given)
        check_step_memory(
            batch, config.max_len, config.dim, config.negatives, *table_shape(config.data), dev,
            replicas=1 + world if config.verify else 1,
        )  # fmt: skip
        options = data_options(config)
        source = make_source(
            config.data, config.dim, config.max_len, config.negatives, batch, config.seed, options
        )
        if given is not None:
            names = [name for name, _rows, _dim in source.tables]
            check_vocabulary(given, source.vocabulary)
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
    return config, source, plan_file, notes


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
        f"sample placement {config.sample_placement}, pipeline {config.pipeline}",
    ]


def run(config: TrainConfig, phase: Phase | None = None) -> int:
    """Train as ``config`` says (collective: every rank of the default process group calls it). A
    collective whose peer fails ends the run with a :class:`~core.errors.CollectiveError` naming the
    rank and the phase. ``phase`` (made here when None) tells the caller where the run was when it
    ended (its ``step``)."""
    phase = phase or Phase(dist.get_rank(), config.timeout)
    with phase.guard(), contextlib.ExitStack() as held:  # held: the checkpoint folder's lock, released last
        return TrainingRun(config, phase, held).train()


class TrainingRun:
    """One run on this rank: the source, the plan, the models and the run's helpers (sample placement,
    verification, metrics, the phase), built by the constructor (collective) and trained by
    :meth:`train`. ``held``: where the checkpoint folder's lock (rank 0's) is registered for release when
    the run ends, however it ends."""

    def __init__(self, config: TrainConfig, phase: Phase, held: contextlib.ExitStack) -> None:
        self.config, self.phase = config, phase
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.dev = dev = device()
        self.say = say = _say(self.rank)
        config, self.source, self.plan_file, notes = _prepare(config, self.world, self.rank, dev)
        self.config = config
        problem, self.lock = "", None
        if self.rank == 0:  # the folder taken (locked, checked, --overwrite) before any work
            try:
                self.lock = claim_directory(config)
            except CheckpointError as e:
                problem = first_line(e)
            if self.lock is not None:
                held.callback(self.lock.release)
        problem = agreed_message(problem, dev)
        if problem:
            raise agreed(CheckpointError(problem))

        if config.deterministic:
            use_deterministic_algorithms()
        torch.manual_seed(config.seed)
        self.dense = SequenceRecModel(config.dim, config.max_len, config.objective).to(dev)
        for p in self.dense.parameters():  # same initial weights everywhere (already equal by seed)
            dist.broadcast(p.data, src=0)
        self.dense_opt = DenseOptimizer(self.dense.parameters(), config.optimizer, config.lr)
        self.module = ShardedSequenceEmbedding(
            self.plan_file,
            self.source.tables,
            self.source.orders,
            init=config.seed,
            optimizer=config.optimizer,
            lr=config.lr,
            device=dev,
            layout=config.layout,
            timeout_s=config.timeout,
        )
        self.placer = SamplePlacer(config.sample_placement, self.module, self.source.user_table)
        self.inputs = InputPipeline(
            self.module, self.placer, self.source, dev, config.pipeline == "on", config.timeout
        )
        self.identity = run_identity(config, self.source, self.plan_file, self.module)
        self.start, resumed_from = self._resume()
        for line in [*_describe(config, self.world, dev, self.source, self.plan_file), *notes]:
            say(line)
        self.summary = RunSummary(self.world, self.source.batch_size, self.start)
        self.log = metrics.MetricsLog(config.metrics_out, self.rank, append=resumed_from is not None)
        if config.metrics_out:
            self.log.write(
                metrics.header_record(
                    config, self.world, self.source.describe(), self.plan_file, dev, self.start
                )
            )
        self.verifier = None
        if config.verify:
            reference = _reference(config, self.source, self.module, self.dense, resumed_from, dev)
            self.verifier = Verifier(self.module, reference, self.rank)
            say(
                "verify: each step against an unsharded reference from the same state; normwise tolerance "
                + describe_tolerance(self.plan_file.plan.wire)
            )

    def _resume(self) -> tuple[int, Path | None]:
        """With ``--resume``, the latest checkpoint of this run loaded (its identity checked): the step to
        start from and the checkpoint; else ``(0, None)``. Collective."""
        config = self.config
        if not config.resume:
            return 0, None
        found = checkpoint.latest(config.checkpoint_dir)
        if found is None:
            self.say(f"resume: no checkpoint in {config.checkpoint_dir}, starting at step 0")
            return 0, None
        problem, manifest, saved, other_run = "", None, None, False
        try:
            manifest = checkpoint.read_manifest(found)
            saved = manifest.run
            problem = identity_mismatch(found, saved, self.identity)
            other_run = bool(problem)
        except CheckpointError as e:
            problem = first_line(e)
        resized = False
        try:
            problem = agreed_message(problem, self.dev)
            if problem:
                raise agreed(CheckpointError(problem))
            resized = checkpoint_reshard.needs_redeal(manifest, self.module)  # the same on every rank
            load = checkpoint_reshard.load_resharded if resized else checkpoint.load
            start = load(found, self.module, self.dense, self.dense_opt)
        except CheckpointError as e:  # every rank here alike: rank 0 names an older one that would load
            hint = fallback_hint(found, self._would_load, other_run) if self.rank == 0 else ""
            hint = agreed_message(hint, self.dev)
            raise agreed(CheckpointError(first_line(e) + (f"; {hint}" if hint else ""))) from None
        self.say(f"resume: {found} (step {start})" + ("" if saved else "; it records no run identity"))
        if resized:
            self.say(
                "resume: " + checkpoint_reshard.describe_resize(manifest, self.module, self.source.batch_size)
            )
        return start, found

    def _would_load(self, manifest: checkpoint.Manifest) -> str:
        """'' when this run could resume from ``manifest``'s checkpoint (its run and layout), else why not."""
        mismatch = identity_mismatch(manifest.path, manifest.run, self.identity)
        if checkpoint_reshard.needs_redeal(manifest, self.module):
            return mismatch or checkpoint_reshard.compatibility(manifest, self.module)
        return mismatch or checkpoint.check_compatible(manifest, self.module)

    def train(self) -> int:
        """Every step from the start to ``--steps``, then the last check and the end of the log."""
        config, start, done = self.config, self.start, self.start
        try:
            with StepGarbageCollection(config.gc_every) as collector:
                for step in range(start, config.steps):
                    self.step(step)
                    collector.after_step(step)
                    done = step + 1
            if self.verifier is not None:
                _result(self.rank)(f"verify: {self.verifier.finish()}")
                _result(self.rank)(f"verify: OK ({config.steps - start} steps, all rows of all copies match)")
        except FlexShardError as e:  # the steps done stay in the log, with what ended the run
            self.log.write({"kind": "end", "steps": done - start, "error": first_line(e)})
            self.log.close()
            raise
        except KeyboardInterrupt:  # Ctrl-C (flexshard.training.interrupt): the log says so
            self.log.write({"kind": "end", "steps": done - start, "error": "interrupted"})
            self.log.close()
            raise
        if config.metrics_out:
            self.log.write(
                {"kind": "end", "steps": config.steps - start, "verify": "OK" if config.verify else None}
            )
            self.log.close()
            self.say(f"metrics: wrote {config.metrics_out} ({config.steps - start} steps)")
        for line in self.summary.lines(self.plan_file, config.sample_placement):
            _result(self.rank)(line)
        return 0

    def step(self, step: int) -> None:
        """One training step (collective), with its log line, metrics, check and checkpoint."""
        config, phase, module, dense, dev, world = (
            self.config, self.phase, self.module, self.dense, self.dev, self.world
        )  # fmt: skip
        t0 = time.perf_counter()
        phase.step = step + 1
        phase.at(f"step {step + 1}: sample placement and input_dist")
        batch, placement, prepared = self.inputs.take(step)
        phase.at(f"step {step + 1}: forward")
        emb = module(prepared)
        module.traffic += placement  # the samples' move is part of the step's ids
        phase.at(f"step {step + 1}: input_dist of the next batch")
        self.inputs.prefetch(step + 1, config.steps)  # runs during the dense forward and backward
        phase.at(f"step {step + 1}: forward")
        logits = batch_logits(dense, emb, batch, self.source.user_table)
        loss = dense.loss(logits) / world
        self.dense_opt.zero_grad()
        phase.at(f"step {step + 1}: backward")
        loss.backward()
        allreduce_dense_grads(dense, world)
        dense_grads = [p.grad.detach().clone() for p in dense.parameters()] if self.verifier else []
        self.dense_opt.step()
        phase.at(f"step {step + 1}: input_dist of the next batch")
        self.inputs.advance()  # its ids run during the replica sync
        phase.at(f"step {step + 1}: replica sync")
        module.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - t0
        phase.at(f"step {step + 1}: step figures")
        self._report(step, float(loss.detach()), elapsed)
        if self.verifier is not None:
            phase.at(f"step {step + 1}: verify")
            batches: list = [None] * world
            dist.all_gather_object(batches, batch)
            self.verifier.check_step(step + 1, batches, logits.detach(), dense, dense_grads)
        if config.checkpoint_dir and (
            (config.checkpoint_every and (step + 1) % config.checkpoint_every == 0)
            or step + 1 == config.steps
        ):
            phase.at(f"step {step + 1}: checkpoint")
            self._checkpoint(step + 1)

    def _report(self, step: int, loss: float, elapsed: float) -> None:
        """The step's figures over the ranks (collective): its metrics record and its log line."""
        config, world, dev = self.config, self.world, self.dev
        link = self.module.link_bytes()
        stats = torch.tensor(  # float64: bytes past 2^24 stay exact
            [loss, link["intra_group"], link["inter_group"], elapsed], dtype=torch.float64, device=dev
        )
        loss_sum = stats[:1].clone()
        dist.all_reduce(loss_sum)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        if config.metrics_out:  # collective: every rank gathers, rank 0 writes
            self.log.write(metrics.step_record(step + 1, float(loss_sum), elapsed, self.module.traffic, dev))
        self.summary.add(
            float(loss_sum), float(stats[3]), {"intra_group": float(stats[1]), "inter_group": float(stats[2])}
        )
        self.say(
            f"step {step + 1}/{config.steps} loss {float(loss_sum):.6f} "
            f"samples/s {world * self.source.batch_size / max(float(stats[3]), 1e-9):,.0f} "
            f"intra_group {float(stats[1]):,.0f} B inter_group {float(stats[2]):,.0f} B (max over ranks), "
            f"{duration((config.steps - step - 1) * self.summary.step_s / self.summary.steps)} left"
        )
        if self.rank == 0 and log.isEnabledFor(logging.DEBUG):
            log.debug(f"step {step + 1}: rank 0 bytes by component: {_by_component(self.module.traffic)}")

    def _checkpoint(self, step: int) -> None:
        """Save the checkpoint of ``step`` (collective), then prune to ``--keep``; refused on every rank
        when the folder's lock is no longer this run's (removed, or taken by another job)."""
        config = self.config
        lost = self.lock is not None and not self.lock.held()
        problem = agreed_message(
            f"--checkpoint-dir: {config.checkpoint_dir}: this run's lock {self.lock.path} was removed or "
            "taken by another job; stopping before writing" if lost else "",
            self.dev,
        )  # fmt: skip
        if problem:
            raise agreed(CheckpointError(problem))
        path = checkpoint.save(
            self.module, self.dense, self.dense_opt, step, config.checkpoint_dir, {"seed": config.seed},
            self.identity,
        )  # fmt: skip
        removed = prune(config.checkpoint_dir, config.keep) if self.rank == 0 else []
        self.say(
            f"checkpoint: saved {path}"
            + (f" (removed {len(removed)} older, --keep {config.keep})" if removed else "")
        )


def _by_component(traffic) -> str:
    """One rank's bytes per link class and component, ``max(send, recv)``, for the debug log."""
    return "; ".join(
        f"{link.label} "
        + ", ".join(f"{c.label} {float(traffic.component_bytes(link, c)):,.0f} B" for c in Component)
        for link in LinkClass
    )


def _reference(config, source, module, dense, resumed_from, dev) -> Reference:
    """The unsharded reference, from the checkpoint resumed from or from the same initializer."""
    if resumed_from is not None:
        full = checkpoint.load_full(resumed_from)
        weights, states = full.weights, full.states
    else:
        init = seeded_initializer(config.seed)
        weights = {n: init(n, np.arange(r), d) for n, r, d in source.tables}
        states = {n: module.row_optimizer.new_states(r, d, "cpu") for n, r, d in source.tables}
    opt = module.row_optimizer
    state = {n: pack(opt, s, weights[n].shape[0]) for n, s in states.items()}  # one tensor per table
    return Reference(
        weights, state, dense, config.optimizer, config.lr, module.eps, source.user_table, dev, module.betas
    )
