"""Resuming at another world size or plan (:mod:`flexshard.checkpoint_reshard`): a checkpoint saved by 4 ranks
in 2 groups is resumed by 2 ranks (1 group, 2 groups with the compact layout, a given plan), by 8 ranks in 2
groups and, from the 8 ranks' checkpoint, by 4 ranks in 1 group, and by 4 ranks in 2 groups with another
plan. Right after the load every rank's rows
(any tier), their optimizer state and the dense model equal the saved ones row for row (``load_full`` of
the checkpoint resumed from); the resumed step then trains and verifies against the unsharded reference
and saves a checkpoint of the new world. A plan for the old world, another setting, a row missing from the
rank files or saved twice are refused with one line on every rank. Unit checks of :class:`HeldRows`
(brute force) and of which identity fields may differ on a resume."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from train_workers import run_main

from flexshard import checkpoint
from flexshard.checkpoint_reshard import TIERS, HeldRows
from flexshard.training.resume import identity_mismatch

SMALL = ["--batch-size", "16"]  # not --quiet: the resume lines are logged at info


def _plan(path: Path, groups: int, per_group: int, budget: float) -> Path:
    """A plan file for the synthetic tables (the run's data fingerprint) on ``groups`` x ``per_group``."""
    from flexshard.plan_file import to_dict, write_plan
    from flexshard.training.data import SyntheticSource
    from flexshard.workloads import fingerprint
    from solvers.planner import budget_bytes, make_plan
    from topology.views import uniform_view

    workload = SyntheticSource(16, 20, 4, 16, 0).workload()
    view = uniform_view(groups, per_group, 450e9, 50e9)
    planned = make_plan("flexshard", workload, view, budget_bytes(workload, view, budget))
    write_plan(path, to_dict(planned.plan, workload, view, planned.report, fingerprint(workload)))
    return path


def _rewrite(path: Path, payload: dict) -> None:
    """Save ``payload`` as the rank file ``path`` and record its new size and sha256 in the manifest, as a
    checkpoint that was written that way would (so the re-deal's own checks are what refuses it)."""
    torch.save(payload, path)
    content = path.read_bytes()
    manifest = path.parent / "manifest.json"
    doc = json.loads(manifest.read_text())
    entry = next(f for f in doc["files"] if f["name"] == path.name)
    entry.update(bytes=len(content), sha256=hashlib.sha256(content).hexdigest())
    manifest.write_text(json.dumps(doc))


def _copy(saved: Path, root: Path, name: str) -> Path:
    shutil.copytree(saved, root / name)
    return root / name


def _resume(ckpt: Path, steps: int, *flags: str) -> tuple[list[str], str]:
    argv = ["--checkpoint-dir", str(ckpt), "--resume", "--steps", str(steps), "--verify", *SMALL, *flags]
    return argv, "dump_resharded_load"


@pytest.fixture(scope="module")
def resized(tmp_path_factory):
    """The runs (module docstring); per case the checkpoint folder and every rank's result."""
    root = tmp_path_factory.mktemp("resize")
    saved = root / "saved"
    first = run_main(4, [(["--groups", "2", "--steps", "3", "--checkpoint-dir", str(saved), *SMALL], None)],
                     root / "run4")  # fmt: skip
    assert [r[0]["rc"] for r in first] == [0] * 4, [r[0]["err"] for r in first]
    plan2, plan4 = _plan(root / "plan2.json", 2, 1, 3.0), _plan(root / "plan4.json", 2, 2, 2.0)
    missing, twice = _copy(saved, root, "missing"), _copy(saved, root, "twice")
    step3 = "step-00000003"
    payload = torch.load(missing / step3 / "rank3.pt", weights_only=True)
    lost = payload["rows"]["creator"].pop("cold")  # rank 3's cold creator rows: in no file now
    _rewrite(missing / step3 / "rank3.pt", payload)
    again = torch.load(twice / step3 / "rank0.pt", weights_only=True)["rows"]["item"]["cold"]
    payload = torch.load(twice / step3 / "rank1.pt", weights_only=True)
    mine = payload["rows"]["item"]["cold"]  # rank 0's cold item rows saved a second time, by rank 1
    payload["rows"]["item"]["cold"] = {k: torch.cat([mine[k], again[k]]) for k in ("ids", "weights")}
    payload["rows"]["item"]["cold"]["states"] = {
        k: torch.cat([s, again["states"][k]]) for k, s in mine["states"].items()
    }
    _rewrite(twice / step3 / "rank1.pt", payload)
    cases = {
        "2x1": (_copy(saved, root, "2x1"), ["--groups", "1"]),
        "2x2 compact": (_copy(saved, root, "2x2"), ["--groups", "2", "--layout", "compact"]),
        "2 plan": (_copy(saved, root, "2plan"), ["--plan", str(plan2)]),
    }
    refused = {
        "old plan": (_copy(saved, root, "oldplan"), ["--plan", str(plan4)]),
        "other seed": (_copy(saved, root, "seed"), ["--groups", "1", "--seed", "1"]),
        "missing": (missing, ["--groups", "1"]),
        "twice": (twice, ["--groups", "1"]),
    }
    calls = [_resume(ckpt, 4, *flags) for ckpt, flags in [*cases.values(), *refused.values()]]
    two = run_main(2, calls, root / "run2", timeout_s=180.0)
    eight_dir = _copy(saved, root, "8x2")
    eight = run_main(8, [_resume(eight_dir, 4, "--groups", "2")], root / "run8", timeout_s=240.0)
    replanned_dir = _copy(saved, root, "4plan")  # the same world, another plan
    replan = _plan(root / "plan4b.json", 2, 2, 3.0)
    replanned = run_main(
        4, [_resume(replanned_dir, 4, "--plan", str(replan))], root / "run4p", timeout_s=180.0
    )
    back = root / "8to4"
    if (eight_dir / "step-00000004").is_dir():  # the 8 ranks' checkpoint, resumed by 4
        shutil.copytree(eight_dir / "step-00000004", back / "step-00000004")
        four = run_main(4, [_resume(back, 5, "--groups", "1")], root / "run4b", timeout_s=180.0)
    else:  # the 8-rank run failed (its tests say why)
        four = [[{"rc": None, "out": "", "err": "the 8-rank run saved no step 4"}]] * 4
    results = {name: [r[i] for r in two] for i, name in enumerate([*cases, *refused])}
    results["8x2"] = [r[0] for r in eight]
    results["8 to 4x1"] = [r[0] for r in four]
    results["4 another plan"] = [r[0] for r in replanned]
    folders = {name: c[0] for name, c in {**cases, **refused}.items()}
    folders["8x2"], folders["8 to 4x1"], folders["4 another plan"] = eight_dir, back, replanned_dir
    return {"root": root, "saved": saved, "results": results, "folders": folders, "lost": lost}


RESUMED = {  # case: (world, groups, the checkpoint's step resumed from)
    "2x1": (2, [[0, 1]], 3),
    "2x2 compact": (2, [[0], [1]], 3),
    "2 plan": (2, [[0], [1]], 3),
    "8x2": (8, [[0, 1, 2, 3], [4, 5, 6, 7]], 3),
    "8 to 4x1": (4, [[0, 1, 2, 3]], 4),
    "4 another plan": (4, [[0, 1], [2, 3]], 3),  # the saved world, another plan: re-dealt by id
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESUMED))
def test_every_row_and_its_state_equal_the_saved_ones_after_a_resize(resized, case):
    world, groups, step = RESUMED[case]
    folder = resized["folders"][case]  # the dumps are taken right after the load, whatever came next
    old = checkpoint.load_full(checkpoint.step_dir(folder, step))  # every row saved exactly once (checked)
    dumps = [torch.load(folder.with_name(folder.name + "-loaded") / f"rank{r}.pt") for r in range(world)]
    assert [(d["world"], d["groups"]) for d in dumps] == [(world, groups)] * world
    saved_world = old.manifest.world_size
    assert (saved_world != world or old.manifest.groups != groups) == (case != "4 another plan")
    for table, weights in old.weights.items():
        hot = [d["rows"][table]["hot"]["ids"] for d in dumps]
        assert all(torch.equal(h, hot[0]) for h in hot)  # every rank holds the same hot rows
        count = np.zeros(weights.shape[0], dtype=np.int64)
        for r, d in enumerate(dumps):
            for tier, entry in d["rows"][table].items():
                ids = entry["ids"]
                assert torch.equal(entry["weights"], weights[ids]), (case, table, tier, r)  # row for row
                assert entry["states"].keys() == old.states[table].keys() == {"momentum1"}
                for k, s in entry["states"].items():
                    assert torch.equal(s, old.states[table][k][ids]), (case, table, tier, r, k)
                if tier == "cold" or (tier == "warm" and r in groups[0]) or (tier == "hot" and r == 0):
                    np.add.at(count, ids.numpy(), 1)
        assert (count == 1).all()  # the new world holds every row (once per copy rule)
        assert old.states[table]["momentum1"].abs().sum() > 0  # Adagrad's state is there to compare
    # the rows are really re-dealt: each new rank holds rows that were saved in two or more old rank files
    files = [
        torch.load(f, weights_only=True)["rows"]
        for f in sorted(checkpoint.step_dir(folder, step).glob("rank*.pt"))
    ]
    assert len(files) == saved_world
    for d in dumps:
        held = torch.cat([e["ids"] for e in d["rows"]["item"].values()]).numpy()
        sources = [
            np.isin(held, np.concatenate([e["ids"].numpy() for e in f["item"].values()])).any() for f in files
        ]
        assert sum(sources) >= 2, sources
    for d in dumps:  # the dense model and its optimizer: the saved ones
        assert d["dense"].keys() == old.dense.keys()
        assert all(torch.equal(d["dense"][k], old.dense[k]) for k in old.dense)
        assert d["dense_optimizer"]["kind"] == old.dense_optimizer["kind"] == "adagrad"
        sums, saved_sums = d["dense_optimizer"]["sums"], old.dense_optimizer["sums"]
        assert len(sums) == len(saved_sums) and all(map(torch.equal, sums, saved_sums))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESUMED))
def test_the_resized_run_trains_verifies_and_saves_the_new_world(resized, case):
    world, groups, step = RESUMED[case]
    calls = resized["results"][case]
    assert [c["rc"] for c in calls] == [0] * world, [c["err"] for c in calls]
    folder = resized["folders"][case]
    out = calls[0]["err"].splitlines()  # the log
    old = checkpoint.read_manifest(checkpoint.step_dir(folder, step))
    assert f"resume: {checkpoint.step_dir(folder, step)} (step {step})" in out
    if old.world_size == world:
        assert (
            f"resume: rows re-dealt by id to this run's plan for {world} ranks in groups {groups} (the "
            "checkpoint's plan put rows in other tiers, owners or slots)"
        ) in out
    else:
        assert (
            f"resume: rows re-dealt from {old.world_size} ranks in groups {old.groups} to {world} ranks in "
            f"groups {groups}; global batch {world} x 16 samples (was {old.world_size} x 16)"
        ) in out
    assert "verify: OK (1 steps, all rows of all copies match)" in calls[0]["out"].splitlines()
    new = checkpoint.load_full(checkpoint.latest(folder))  # every row once, at the new world
    assert new.step == step + 1 and new.manifest.world_size == world and new.manifest.groups == groups
    assert new.manifest.layout != old.layout  # another plan's layout (the same world: another plan)
    before = checkpoint.load_full(checkpoint.step_dir(folder, step))
    assert not torch.equal(new.weights["item"], before.weights["item"])  # the step trained


@pytest.mark.slow
def test_a_plan_for_the_old_world_is_refused_on_a_resize(resized):
    calls = resized["results"]["old plan"]
    assert [c["rc"] for c in calls] == [2, 2] and calls[1]["err"] == ""
    assert calls[0]["err"] == (
        "flexshard train: error: --plan: the plan is for 4 ranks, this job has 2: launch 4 ranks, or make "
        "a plan for this run (flexshard stats, then flexshard plan) with a topology of 2 GPUs; --resume "
        "re-deals the checkpoint to a plan for 2 ranks, or to the plan made on the fly without --plan\n"
    )
    assert checkpoint.latest(resized["folders"]["old plan"]).name == "step-00000003"  # nothing written


@pytest.mark.slow
def test_a_resize_still_refuses_another_setting(resized):
    calls = resized["results"]["other seed"]
    assert [c["rc"] for c in calls] == [2, 2] and calls[1]["err"] == ""
    folder = resized["folders"]["other seed"]
    assert calls[0]["err"] == (
        f"flexshard train: error: --resume: {folder / 'step-00000003'} was saved by another run (seed: '0' "
        "there, '1' here); resume with that run's settings, or start this run in another --checkpoint-dir "
        "(or over this one with --overwrite)\n"
    )
    assert checkpoint.latest(folder).name == "step-00000003"


@pytest.mark.slow
def test_a_row_in_no_rank_file_or_in_two_is_one_line_on_every_rank(resized):
    missing = resized["results"]["missing"]
    assert [c["rc"] for c in missing] == [2, 2] and missing[1]["err"] == ""
    lost = resized["lost"]["ids"]
    ckpt = resized["folders"]["missing"] / "step-00000003"
    line = missing[0]["err"].strip()
    prefix = f"flexshard train: error: checkpoint {str(ckpt)!r}: table 'creator' row "
    hint = f" is in no rank file; no older checkpoint in {str(ckpt.parent)} would load either"
    assert line.startswith(prefix) and line.endswith(hint), line
    assert int(line[len(prefix) :].split()[0]) in set(lost.tolist())
    twice = resized["results"]["twice"]
    assert [c["rc"] for c in twice] == [2, 2] and twice[1]["err"] == ""
    ckpt = resized["folders"]["twice"] / "step-00000003"
    line = twice[0]["err"].strip()
    prefix = f"flexshard train: error: checkpoint {str(ckpt)!r}: rank1.pt: table 'item' row "
    hint = f" is saved more than once; no older checkpoint in {str(ckpt.parent)} would load either"
    assert line.startswith(prefix) and line.endswith(hint), line
    cold0 = torch.load(ckpt / "rank0.pt", weights_only=True)["rows"]["item"]["cold"]["ids"]
    assert cold0.numel() and int(line[len(prefix) :].split()[0]) in set(cold0.tolist())


@pytest.mark.slow
def test_one_process_resumes_the_four_ranks_checkpoint(resized, monkeypatch, capsys, tmp_path):
    """4 ranks to 1 (no launcher): every row in the one rank's shards, the step verifies; saved ids looked
    up in chunks of 777 (many chunks per entry, the last one short)."""
    import train_workers

    from flexshard import checkpoint_reshard
    from flexshard.train import main

    monkeypatch.setattr(checkpoint_reshard, "CHUNK_IDS", 777)

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    folder = _copy(resized["saved"], tmp_path, "one")
    argv, patch = _resume(folder, 4)
    with train_workers.PATCHES[patch]():
        rc = main(argv)
    old = checkpoint.load_full(checkpoint.step_dir(folder, 3))
    dump = torch.load(tmp_path / "one-loaded" / "rank0.pt")
    for table, weights in old.weights.items():
        ids = torch.cat([dump["rows"][table][t.label]["ids"] for t in TIERS])
        assert torch.equal(ids.sort().values, torch.arange(weights.shape[0]))  # one rank holds every row
        for entry in dump["rows"][table].values():
            assert torch.equal(entry["weights"], weights[entry["ids"]])
            assert torch.equal(entry["states"]["momentum1"], old.states[table]["momentum1"][entry["ids"]])
    out, err = capsys.readouterr()
    assert rc == 0 and "global batch 1 x 16 samples (was 4 x 16)" in err and "verify: OK (1 steps" in out


def test_held_rows_place_saved_ids_as_brute_force_does():
    rng = np.random.default_rng(7)
    for _ in range(30):
        num_rows = int(rng.integers(1, 300))
        perm = rng.permutation(num_rows)
        cut = np.sort(rng.integers(0, num_rows + 1, 3))
        held_ids = [perm[: cut[0]], perm[cut[0] : cut[1]], perm[cut[1] : cut[2]]]  # the rest: not held
        held = HeldRows.of([a.astype(np.int64) for a in held_ids])
        where = {int(i): (k, s) for k, a in enumerate(held_ids) for s, i in enumerate(a)}
        files = np.array_split(rng.permutation(num_rows).astype(np.int64), int(rng.integers(1, 5)))
        for saved in files:
            src, tier, slot, twice = held.place(saved)
            assert twice == -1
            expected = [(j, *where[int(i)]) for j, i in enumerate(saved) if int(i) in where]
            assert list(zip(src.tolist(), tier.tolist(), slot.tolist(), strict=True)) == expected
        assert held.missing() == -1 and held.found.all()
        if where:
            again = np.array([next(iter(where))], dtype=np.int64)
            assert held.place(again)[3] == again[0]  # found before: saved twice


def test_held_rows_report_a_duplicate_in_one_entry_and_a_missing_row():
    held = HeldRows.of([np.array([5, 2]), np.array([9]), np.array([], dtype=np.int64)])
    assert held.place(np.array([1, 9, 3, 9]))[3] == 9  # twice in one saved entry
    held = HeldRows.of([np.array([5, 2]), np.array([9]), np.array([], dtype=np.int64)])
    src, tier, slot, twice = held.place(np.array([9, 7, 5]))
    assert (src.tolist(), tier.tolist(), slot.tolist(), twice) == ([0, 2], [1, 0], [0, 0], -1)
    assert held.missing() == 2
    with pytest.raises(ValueError, match="held twice"):
        HeldRows.of([np.array([1]), np.array([1])])


IDENTITY = {
    "world": "4 ranks in groups [[0, 1], [2, 3]]",
    "plan": "abc",
    "data": "synthetic (statistics x)",
    "seed": "0",
    "optimizer": "adagrad, lr 0.05, eps 1e-08",
    "model": "dim 16",
    "batch": "16 per rank",
    "exchange": "dedup on",
}


@pytest.mark.parametrize(
    ("changes", "differs"),
    [
        ({"world": "2 ranks in groups [[0, 1]]", "plan": "def"}, None),  # fewer ranks, their plan
        ({"world": "8 ranks in groups [[0, 1, 2, 3], [4, 5, 6, 7]]", "plan": "def"}, None),
        ({"world": "4 ranks in groups [[0, 1, 2, 3]]", "plan": "def"}, None),  # other groups only
        ({"plan": "def"}, None),  # the same world, another plan (or layout): re-dealt by id
        ({"world": "2 ranks in groups [[0, 1]]", "seed": "1"}, "seed: '0' there, '1' here"),
        ({"world": "2 ranks in groups [[0, 1]]", "batch": "8 per rank"}, "batch: '16 per rank' there"),
        ({"world": "2 ranks in groups [[0, 1]]", "optimizer": "sgd, lr 0.05"}, "optimizer: 'adagrad,"),
        ({"world": "2 ranks in groups [[0, 1]]", "data": "other"}, "data: 'synthetic (statistics x)' there"),
        ({"world": "2 ranks in groups [[0, 1]]", "exchange": "dedup off"}, "exchange: 'dedup on' there"),
        ({"world": "2 ranks in groups [[0, 1]]", "model": "dim 32"}, "model: 'dim 16' there"),
    ],
)
def test_which_identity_fields_may_differ_on_a_resume(changes, differs):
    message = identity_mismatch(Path("ck"), IDENTITY, {**IDENTITY, **changes})
    if differs is None:
        assert message == ""
    else:
        assert message.startswith(f"--resume: ck was saved by another run ({differs}"), message
