"""DCP checkpoints shared with TorchRec: a ``DistributedModelParallel`` model whose ``EmbeddingCollection``
(at ``ec``) is sharded row-wise by TorchRec with row-wise Adagrad trains 2 steps on 2 gloo ranks and saves
``{"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}`` with DCP; a FlexShard module on 4
ranks in 2 groups (hot, warm and cold rows) loads it with ``prefix="ec."`` (every row and its ``momentum1``
equal TorchRec's), trains a step and saves; a fresh TorchRec model on 2 ranks loads that and holds
FlexShard's rows and state. The keys are TorchRec's own, so neither side converts anything. TorchRec's
checkpoint also converts to a ``flexshard train`` one (``flexshard convert-checkpoint --prefix ec.``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec", reason="TorchRec (optional peer) is not installed")
pytest.importorskip("fbgemm_gpu", reason="fbgemm-gpu (TorchRec's kernels) is not installed")

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from runtime_workers import SEED, TIERS, make_orders, random_batch  # noqa: E402

from flexshard.checkpoint_dcp import load_dcp, save_dcp  # noqa: E402
from flexshard.plan_file import read_plan, to_dict, write_plan  # noqa: E402
from flexshard.runtime import ShardedSequenceEmbedding  # noqa: E402
from flexshard.runtime.local import run_on_ranks  # noqa: E402
from solvers.cost_model import evaluate  # noqa: E402
from solvers.types import Plan, RowHistogram, TablePlan, TableSpec, Workload  # noqa: E402
from topology.views import uniform_view  # noqa: E402

TABLES = [("a", 120, 8), ("b", 300, 8), ("c", 60, 8)]  # an EmbeddingCollection needs one dim


def _plan(path: Path, groups: int, per_group: int) -> Path:
    """A plan with hot, warm and cold rows of every table (the tiers of ``runtime_workers.TIERS``)."""
    view = uniform_view(groups, per_group, 100e9, 10e9)
    n = groups * per_group
    plans = tuple(
        TablePlan(
            name,
            TIERS[name][0],
            TIERS[name][1],
            rows - sum(TIERS[name]),
            np.full(n, 1.0 / per_group),
            np.full(n, 1.0 / n),
        )  # fmt: skip
        for name, rows, _dim in TABLES
    )
    specs = tuple(
        TableSpec(name, rows, dim, 3.0, RowHistogram.from_counts(np.arange(rows, 0, -1)))
        for name, rows, dim in TABLES
    )
    workload = Workload("dcp-torchrec", specs, batch_size_per_gpu=4)
    plan = Plan(strategy="flexshard", tables=plans, dedup=True, sync="sparse")
    write_plan(path, to_dict(plan, workload, view, evaluate(workload, view, plan), "test", make_orders()))
    return path


def _torchrec(world: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    configs = [
        EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[n]) for n, r, d in TABLES
    ]

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = EmbeddingCollection(tables=configs, device=torch.device("meta"))

        def forward(self, kjt):
            return self.ec(kjt)

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
    sharder = EmbeddingCollectionSharder(fused_params=fused)
    model = Model()
    kernel = EmbeddingComputeKernel.FUSED.value
    plan = construct_module_sharding_plan(
        model.ec, {n: row_wise(compute_kernel=kernel) for n, _r, _d in TABLES}, sharder=sharder,
        local_size=world, world_size=world, device_type="cpu",
    )  # fmt: skip
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return DistributedModelParallel(
        model, env=env, device=torch.device("cpu"), plan=ShardingPlan({"ec": plan}), sharders=[sharder]
    )


def _kjt(step: int, rank: int):
    from torchrec import KeyedJaggedTensor

    b, names = random_batch(SEED, step, rank), [n for n, _r, _d in TABLES]
    return KeyedJaggedTensor(
        keys=names, values=torch.cat([b[k][0] for k in names]), lengths=torch.cat([b[k][1] for k in names])
    )


def _local(dmp) -> dict:
    """This rank's TorchRec shards: ``{(table, "weights" | "state"): [(first row, tensor)]}``."""
    out: dict = {}
    state = dmp.fused_optimizer.state_dict()["state"]
    for name, _r, _d in TABLES:
        key = f"ec.embeddings.{name}.weight"
        for kind, st in (("weights", dmp.state_dict()[key]), ("state", state[key][f"{name}.momentum1"])):
            out[(name, kind)] = [
                (s.metadata.shard_offsets[0], s.tensor.detach().clone()) for s in st.local_shards()
            ]
    return out


def torchrec_main(rank: int, world: int, ckpt: str, load: bool) -> dict:
    """Train 2 steps and save ``ckpt`` (``load`` False), or load ``ckpt`` into a fresh model; its shards."""
    dmp = _torchrec(world)
    if load:
        state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
        dcp.load(state, checkpoint_id=ckpt)
        dmp.fused_optimizer.load_state_dict(state["optim"])
        return _local(dmp)
    for step in range(2):
        out = dmp(_kjt(step, rank))
        sum(out[n].values().sum() for n, _r, _d in TABLES).backward()
    dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=ckpt)
    return _local(dmp)


def _rows(module: ShardedSequenceEmbedding) -> dict:
    return {
        (module.table_names[t], tier.label): (
            torch.as_tensor(s.ids),
            s.weights.clone(),
            s.states["momentum1"].clone(),
        )
        for (t, tier), s in module.shards.items()
    }


def flexshard_main(rank: int, world: int, plan: str, ckpt: str, save_to: str) -> dict:
    """Load TorchRec's ``ckpt``; the rows held; then a step, saved to ``save_to``; the rows held after."""
    module = ShardedSequenceEmbedding(read_plan(plan), TABLES, make_orders(), init=SEED, optimizer="adagrad",
                                      lr=0.05)  # fmt: skip
    load_dcp(module, ckpt, prefix="ec.")
    loaded = _rows(module)
    out = module(random_batch(SEED, 5, rank))
    sum(o.sum() for o in out.values()).backward()
    module.step()
    save_dcp(module, save_to, prefix="ec.")
    return {"loaded": loaded, "trained": _rows(module), "groups": module.pg.groups}


def _tables(ranks: list[dict]) -> dict:
    """Whole tables from TorchRec's shards."""
    out = {}
    for name, rows, dim in TABLES:
        for kind in ("weights", "state"):
            full = torch.full((rows, dim) if kind == "weights" else (rows,), float("nan"))
            for r in ranks:
                for start, t in r[(name, kind)]:
                    full[start : start + t.shape[0]] = t
            assert not full.isnan().any()
            out[(name, kind)] = full
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp-torchrec")
    plan = _plan(root / "plan4.json", 2, 2)
    saved = run_on_ranks(torchrec_main, 2, str(root / "tr"), False, timeout_s=300.0)
    fs = run_on_ranks(flexshard_main, 4, str(plan), str(root / "tr"), str(root / "fs"), timeout_s=300.0)
    back = run_on_ranks(torchrec_main, 2, str(root / "fs"), True, timeout_s=300.0)
    return {"saved": saved, "fs": fs, "back": back, "root": root}


def _held(ranks: list[dict], part: str):
    for r in ranks:
        for (name, tier), (ids, weights, state) in r[part].items():
            yield name, tier, ids, weights, state


@pytest.mark.slow
def test_flexshard_loads_a_torchrec_row_wise_checkpoint_at_another_world(runs):
    saved = _tables(runs["saved"])
    assert saved[("b", "state")].abs().sum() > 0  # TorchRec's Adagrad trained: its state is there to move
    assert [r["groups"] for r in runs["fs"]] == [[[0, 1], [2, 3]]] * 4
    tiers = set()
    for name, tier, ids, weights, state in _held(runs["fs"], "loaded"):
        assert torch.equal(weights, saved[(name, "weights")][ids]), (name, tier)
        assert torch.equal(state, saved[(name, "state")][ids]), (name, tier)
        tiers.add(tier if ids.numel() else None)
    assert {"hot", "warm", "cold"} <= tiers


@pytest.mark.slow
def test_torchrec_loads_what_flexshard_saved(runs):
    back = _tables(runs["back"])
    trained = 0
    for name, tier, ids, weights, state in _held(runs["fs"], "trained"):
        assert torch.equal(back[(name, "weights")][ids], weights), (name, tier)
        assert torch.equal(back[(name, "state")][ids], state), (name, tier)
        trained += int(ids.numel())
    assert trained > 0
    assert not torch.equal(
        back[("b", "weights")], _tables(runs["saved"])[("b", "weights")]
    )  # FlexShard's step


@pytest.mark.slow
def test_a_torchrec_checkpoint_converts_to_a_flexshard_one(runs, tmp_path, capsys):
    from flexshard import checkpoint
    from flexshard.cli import main

    tr = runs["root"] / "tr"
    assert main(["convert-checkpoint", str(tr), str(tmp_path / "out"), "--prefix", "ec."]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'out' / 'step-00000000'} (flexshard checkpoint)\n"
    full, saved = checkpoint.load_full(tmp_path / "out"), _tables(runs["saved"])
    assert (full.manifest.world_size, full.manifest.optimizer, full.manifest.run) == (
        1,
        "rowwise_adagrad",
        None,
    )
    for name, _rows, _dim in TABLES:
        assert torch.equal(full.weights[name], saved[(name, "weights")])
        assert torch.equal(full.states[name]["momentum1"], saved[(name, "state")])
    assert main(["convert-checkpoint", str(tr), str(tmp_path / "other")]) == 2  # the keys need the prefix
    keys = [f"ec.embeddings.{n}.weight" for n, _r, _d in TABLES]
    assert capsys.readouterr().err == (
        f"flexshard convert-checkpoint: error: DCP checkpoint {str(tr)!r}: no "
        f"model.embeddings.<table>.weight tensors (its model keys: {keys})\n"
    )
