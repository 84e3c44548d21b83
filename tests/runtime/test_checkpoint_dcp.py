"""Conversion between ``flexshard train`` checkpoints and DCP ones (:mod:`flexshard.checkpoint_dcp`): a
checkpoint of 4 ranks in 2 groups (Adagrad, 3 steps) converted to DCP holds the logical tables and their
state; converted back it equals the original (``load_full``: rows, state, dense model and optimizer, extra,
step, run identity, world, groups), and that again to DCP equals the first DCP checkpoint. ``flexshard
train --resume`` from the converted-back checkpoint (rows in blocks) re-deals it at 2 ranks and at the
saved 4 ranks: every row each rank holds equals the saved one, and the run trains and verifies. The CLI
subcommand and its one-line errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from train_workers import run_main

from core.errors import CheckpointError
from flexshard import checkpoint
from flexshard.checkpoint_dcp import dcp_mismatch, dcp_to_flexshard, flexshard_to_dcp, read_dcp
from flexshard.checkpoint_manifest import BLOCKS_LAYOUT
from flexshard.cli import main as cli_main

SMALL = ["--batch-size", "16"]
TAKEN = "exists and is not an empty folder; give a new one"


def _resume(ckpt: Path, steps: int, *flags: str):
    argv = ["--checkpoint-dir", str(ckpt), "--resume", "--steps", str(steps), "--verify", *SMALL, *flags]
    return argv, "dump_resharded_load"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    saved = root / "saved"
    first = run_main(4, [(["--groups", "2", "--steps", "3", "--checkpoint-dir", str(saved), *SMALL], None)],
                     root / "run4", timeout_s=180.0)  # fmt: skip
    assert [r[0]["rc"] for r in first] == [0] * 4, [r[0]["err"] for r in first]
    original = checkpoint.latest(saved)
    to_dcp = flexshard_to_dcp(original, root / "dcp")
    back = dcp_to_flexshard(to_dcp, root / "back")
    again = flexshard_to_dcp(back, root / "dcp2")
    resumed = {}
    for world, groups in ((2, "1"), (4, "2")):
        folder = root / f"resume{world}"
        shutil.copytree(back, folder / back.name)
        calls = run_main(
            world, [_resume(folder, 4, "--groups", groups)], root / f"run{world}b", timeout_s=180.0
        )
        resumed[world] = (folder, [c[0] for c in calls])
    return {
        "root": root,
        "original": original,
        "dcp": to_dcp,
        "back": back,
        "again": again,
        "resumed": resumed,
    }


@pytest.mark.slow
def test_flexshard_to_dcp_holds_the_logical_tables(converted):
    full = checkpoint.load_full(converted["original"])
    whole = read_dcp(converted["dcp"])
    assert sorted(whole) == ["flexshard", "model", "optim"]
    for name, weights in full.weights.items():
        key = f"embeddings.{name}.weight"
        assert torch.equal(whole["model"][key], weights)
        assert list(whole["optim"]["state"][key]) == [f"{name}.momentum1"]
        momentum1 = full.states[name]["momentum1"]
        assert torch.equal(whole["optim"]["state"][key][f"{name}.momentum1"], momentum1)
        assert momentum1.abs().sum() > 0


@pytest.mark.slow
def test_the_round_trips_give_back_what_was_saved(converted):
    old, new = checkpoint.load_full(converted["original"]), checkpoint.load_full(converted["back"])
    assert new.manifest.layout == BLOCKS_LAYOUT != old.manifest.layout
    for field in ("step", "world_size", "groups", "tables", "optimizer", "optimizer_step", "run"):
        assert getattr(new.manifest, field) == getattr(old.manifest, field), field
    assert new.manifest.run is not None and new.step == 3
    for name in old.weights:
        assert torch.equal(new.weights[name], old.weights[name])
        assert new.states[name].keys() == old.states[name].keys() == {"momentum1"}
        assert torch.equal(new.states[name]["momentum1"], old.states[name]["momentum1"])
    assert new.dense.keys() == old.dense.keys() and all(
        torch.equal(new.dense[k], old.dense[k]) for k in old.dense
    )
    assert new.dense_optimizer["kind"] == old.dense_optimizer["kind"]
    assert all(map(torch.equal, new.dense_optimizer["sums"], old.dense_optimizer["sums"]))
    assert new.extra == old.extra
    first, second = read_dcp(converted["dcp"]), read_dcp(converted["again"])  # DCP -> flexshard -> DCP
    for part in ("model", "optim"):
        flat1, flat2 = _flatten(first[part]), _flatten(second[part])
        assert flat1.keys() == flat2.keys() and all(torch.equal(flat1[k], flat2[k]) for k in flat1)
    meta1, meta2 = (torch.load(w["flexshard"], weights_only=False) for w in (first, second))
    for key in ("step", "world_size", "groups", "tables", "optimizer", "run"):
        assert meta1["manifest"][key] == meta2["manifest"][key]
    assert meta1["extra"] == meta2["extra"]


def _flatten(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_train_resumes_from_a_converted_checkpoint_row_for_row(converted, world):
    folder, calls = converted["resumed"][world]
    assert [c["rc"] for c in calls] == [0] * world, [c["err"] for c in calls]
    assert "verify: OK (1 steps, all rows of all copies match)" in calls[0]["out"].splitlines()
    saved = checkpoint.load_full(converted["original"])
    dumps = [torch.load(folder.with_name(folder.name + "-loaded") / f"rank{r}.pt") for r in range(world)]
    for table, weights in saved.weights.items():
        held = torch.zeros(weights.shape[0], dtype=torch.bool)
        for d in dumps:
            for entry in d["rows"][table].values():
                assert torch.equal(entry["weights"], weights[entry["ids"]])
                for n, s in entry["states"].items():
                    assert torch.equal(s, saved.states[table][n][entry["ids"]])
                held[entry["ids"]] = True
        assert held.all()
    new = checkpoint.load_full(checkpoint.latest(folder))  # the run saved step 4 in its own layout
    assert new.step == 4 and new.manifest.layout != BLOCKS_LAYOUT


@pytest.mark.slow
def test_the_cli_converts_and_refuses_bad_input_with_one_line(converted, tmp_path, capsys):
    assert cli_main(["convert-checkpoint", str(converted["original"]), str(tmp_path / "d")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'd'} (DCP checkpoint)\n"
    assert cli_main(["convert-checkpoint", str(tmp_path / "d"), str(tmp_path / "f")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'f' / 'step-00000003'} (flexshard checkpoint)\n"
    cases = {
        "no checkpoint": ([str(tmp_path / "none"), str(tmp_path / "x")],
                          f"checkpoint {str(tmp_path / 'none')!r}: no complete checkpoint (step-* with "
                          "manifest.json)"),
        "dst not empty": ([str(converted["original"]), str(tmp_path / "f")],
                          f"{str(tmp_path / 'f')!r}: {TAKEN}"),
        "step exists": ([str(tmp_path / "d"), str(tmp_path / "f")],
                        f"{str(tmp_path / 'f' / 'step-00000003')!r}: {TAKEN}"),
    }  # fmt: skip
    for case, (argv, message) in cases.items():
        assert cli_main(["convert-checkpoint", *argv]) == 2, case
        assert capsys.readouterr().err == f"flexshard convert-checkpoint: error: {message}\n", case


# TorchRec's state keys of each optimizer of the registry (table 'a' of 5 x 4) and what each infers
STATES = {
    "sgd": {},
    "rowwise_adagrad": {"a.momentum1": (5,)},
    "elementwise_adagrad": {"a.momentum1": (5, 4)},
    "adam": {"a.momentum1": (5, 4), "a.exp_avg_sq": (5, 4)},
}


@pytest.mark.parametrize("optimizer", sorted(STATES))
def test_every_optimizer_converts_both_ways_inferred_from_its_state(tmp_path, optimizer):
    gen = torch.Generator().manual_seed(3)
    weights = torch.randn(5, 4, generator=gen)
    states = {k: torch.rand(*shape, generator=gen) for k, shape in STATES[optimizer].items()}
    if optimizer == "adam":
        states["a.step"] = torch.tensor(7)  # the iteration t, a 0-d tensor
    saved = {"model": {"embeddings.a.weight": weights}, "optim": {"state": {"embeddings.a.weight": states}}}
    dcp.save(saved, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    full = checkpoint.load_full(dcp_to_flexshard(tmp_path / "dcp", tmp_path / "out"))
    assert (full.manifest.optimizer, full.manifest.optimizer_step) == (
        optimizer,
        7 if optimizer == "adam" else 0,
    )
    assert torch.equal(full.weights["a"], weights)
    names = {"a.momentum1": "momentum1", "a.exp_avg_sq": "momentum2"}
    assert full.states["a"].keys() == {names[k] for k in STATES[optimizer]}
    for key, name in names.items():
        if key in states:
            assert torch.equal(full.states["a"][name], states[key])
    back = read_dcp(flexshard_to_dcp(checkpoint.latest(tmp_path / "out"), tmp_path / "again"))
    assert _flatten(back["model"]).keys() == _flatten(saved["model"]).keys()
    again, first = _flatten(back.get("optim", {})), _flatten(saved["optim"])  # SGD: none (DCP drops {})
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


def test_an_optimizer_state_of_no_optimizer_is_refused(tmp_path):
    states = {"a.momentum1": torch.ones(5), "a.exp_avg_sq": torch.ones(5, 4)}  # row-wise m1 and Adam's v
    state = {
        "model": {"embeddings.a.weight": torch.ones(5, 4)},
        "optim": {"state": {"embeddings.a.weight": states}},
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "odd"), no_dist=True)
    with pytest.raises(CheckpointError) as err:
        dcp_to_flexshard(tmp_path / "odd", tmp_path / "out")
    assert str(err.value) == (
        f"DCP checkpoint {str(tmp_path / 'odd')!r}: table 'a' has optimizer state {{'a.exp_avg_sq': [5, 4], "
        "'a.momentum1': [5]}, the state of none of ['adam', 'elementwise_adagrad', 'rowwise_adagrad', 'sgd']"
    )


def test_a_dcp_checkpoint_without_flexshard_entries_converts_at_one_rank(tmp_path):
    weights, state = torch.randn(7, 3), torch.rand(7)
    states = {"embeddings.t.weight": {"t.momentum1": state}}
    saved = {"model": {"embeddings.t.weight": weights}, "optim": {"state": states}}
    dcp.save(saved, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    folder = dcp_to_flexshard(tmp_path / "plain", tmp_path / "out")
    full = checkpoint.load_full(folder)
    assert (full.step, full.manifest.world_size, full.manifest.groups, full.manifest.optimizer) == (
        0,
        1,
        [[0]],
        "rowwise_adagrad",
    )
    assert torch.equal(full.weights["t"], weights) and torch.equal(full.states["t"]["momentum1"], state)
    assert full.manifest.run is None and full.dense == {} and full.extra == {}


def _stub(tables: list[tuple[str, int, int]], states: dict[str, tuple[int, ...]]):
    """What :func:`dcp_mismatch` reads of a module: names, rows, dims and the hot shards' state shapes."""
    from types import SimpleNamespace

    from core.vocabulary import Tier
    from flexshard.runtime.optimizers import row_optimizer
    from flexshard.runtime.shards import Shard

    shards = {}
    for t, (_name, _rows, dim) in enumerate(tables):
        shard = Shard.of(np.zeros(2, dtype=np.int64), torch.zeros(2, dim), row_optimizer("sgd"))
        shard.states = {n: torch.zeros(2, *shape) for n, shape in states.items()}
        shards[(t, Tier.HOT)] = shard
    return SimpleNamespace(
        table_names=[n for n, _r, _d in tables],
        routing=[SimpleNamespace(num_rows=r) for _n, r, _d in tables],
        dims=[d for _n, _r, d in tables],
        shards=shards,
        row_optimizer=row_optimizer("rowwise_adagrad"),
    )


def test_dcp_mismatch_names_the_first_difference_in_one_line(tmp_path):
    saved = {
        "model": {"embeddings.a.weight": torch.zeros(5, 4), "embeddings.b.weight": torch.zeros(7, 2)},
        "optim": {"state": {
            "embeddings.a.weight": {"a.momentum1": torch.zeros(5)},
            "embeddings.b.weight": {"b.momentum1": torch.zeros(7)},
        }},
    }  # fmt: skip
    dcp.save(saved, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    where = f"DCP checkpoint {str(tmp_path / 'c')!r}"
    cases = {
        "same": ([("a", 5, 4), ("b", 7, 2)], ""),
        "a subset of the tables": ([("b", 7, 2)], ""),
        "another table": ([("a", 5, 4), ("z", 7, 2)], f"{where}: no model.embeddings.z.weight (table 'z'; it "
                          "has tables ['a', 'b'])"),
        "more rows": ([("a", 5, 4), ("b", 8, 2)], f"{where}: model.embeddings.b.weight is [7, 2], this "
                      "module's is [8, 2]"),
        "another dim": ([("a", 5, 3), ("b", 7, 2)], f"{where}: model.embeddings.a.weight is [5, 4], this "
                        "module's is [5, 3]"),
    }  # fmt: skip
    for case, (tables, message) in cases.items():
        assert dcp_mismatch(tmp_path / "c", _stub(tables, {"momentum1": ()})) == message, case
    rows_by_dim = _stub([("a", 5, 4), ("b", 7, 2)], {"momentum1": (4,)})  # Adagrad's [rows, dim] state
    assert dcp_mismatch(tmp_path / "c", rows_by_dim) == (
        f"{where}: optim.state.embeddings.a.weight.a.momentum1 is [5], this module's is [5, 4]"
    )
    assert dcp_mismatch(tmp_path / "none", rows_by_dim) == (
        f"DCP checkpoint {str(tmp_path / 'none')!r}: not a DCP checkpoint (no readable .metadata: "
        "FileNotFoundError)"
    )
