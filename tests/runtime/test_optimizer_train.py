"""``flexshard train --optimizer`` with the new optimizers (one rank, in process): Adam's resume continues
bitwise as the uninterrupted run (rows, moments, the iteration, the dense Adam); a checkpoint of the
previous schema (one row-wise accumulator, optimizer 'adagrad') resumes as rowwise_adagrad; plans price
each optimizer's state, and a plan priced for less is refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from train_workers import run_main

from flexshard import checkpoint
from flexshard.checkpoint_manifest import SCHEMA_2, run_digest
from flexshard.cli import main as cli
from flexshard.model import DenseOptimizer
from flexshard.plan_file import read_plan
from flexshard.train import main

SMALL = ["--batch-size", "8", "--quiet", "--dim", "8"]


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _train(ckpt: Path, *flags: str) -> int:
    return main(["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", *SMALL, *flags])


def _same(x: checkpoint.FullCheckpoint, y: checkpoint.FullCheckpoint) -> None:
    assert x.weights.keys() == y.weights.keys() and x.states.keys() == y.states.keys()
    for name, w in x.weights.items():
        assert torch.equal(w, y.weights[name]), name
        assert x.states[name].keys() == y.states[name].keys()
        assert all(torch.equal(s, y.states[name][k]) for k, s in x.states[name].items()), name
    assert all(torch.equal(v, y.dense[k]) for k, v in x.dense.items())


def test_adam_resume_continues_as_the_uninterrupted_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _train(a, "--steps", "3", "--optimizer", "adam") == 0
    assert _train(b, "--steps", "2", "--optimizer", "adam") == 0
    assert _train(b, "--steps", "3", "--optimizer", "adam", "--resume") == 0
    x, y = (checkpoint.load_full(checkpoint.step_dir(d, 3)) for d in (a, b))
    _same(x, y)
    assert x.manifest.optimizer == "adam" and x.manifest.optimizer_step == y.manifest.optimizer_step == 3
    assert (
        set(x.states["item"]) == {"momentum1", "momentum2"} and x.states["item"]["momentum2"].abs().sum() > 0
    )
    assert x.dense_optimizer["kind"] == "adam" and x.dense_optimizer["step"] == y.dense_optimizer["step"] == 3
    assert all(
        torch.equal(m, n)
        for m, n in zip(x.dense_optimizer["moments"], y.dense_optimizer["moments"], strict=True)
    )


def _as_schema_2(folder: Path) -> None:
    """Rewrite a rowwise_adagrad checkpoint as the previous version wrote it: schema 2, optimizer
    'adagrad' (also in the run identity), one ``state`` per row, no optimizer_step."""
    doc = json.loads((folder / "manifest.json").read_text())
    doc.update(schema=SCHEMA_2, optimizer="adagrad")
    del doc["optimizer_step"]
    doc["run"]["optimizer"] = doc["run"]["optimizer"].replace("rowwise_adagrad", "adagrad")
    for record in doc["files"]:
        path = folder / record["name"]
        payload = torch.load(path, weights_only=True)
        payload.update(format=SCHEMA_2, run=run_digest(doc["run"]))
        for tiers in payload["rows"].values():
            for entry in tiers.values():
                entry["state"] = entry.pop("states")["momentum1"]
        torch.save(payload, path)
        data = path.read_bytes()
        record.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / "manifest.json").write_text(json.dumps(doc, indent=1) + "\n")


def test_a_schema_2_adagrad_checkpoint_resumes_as_rowwise_adagrad(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _train(a, "--steps", "3") == 0  # the default: rowwise_adagrad
    assert _train(b, "--steps", "2", "--optimizer", "adagrad") == 0  # its older name
    _as_schema_2(checkpoint.step_dir(b, 2))
    old = checkpoint.load_full(checkpoint.step_dir(b, 2))
    assert old.manifest.schema == SCHEMA_2 and old.manifest.optimizer == "adagrad"
    assert set(old.states["item"]) == {"momentum1"} and old.states["item"]["momentum1"].abs().sum() > 0
    (checkpoint.step_dir(b, 1) / "manifest.json").unlink()  # resume must take the rewritten step 2
    assert _train(b, "--steps", "3", "--resume") == 0
    _same(checkpoint.load_full(checkpoint.step_dir(a, 3)), checkpoint.load_full(checkpoint.step_dir(b, 3)))


def test_plans_price_the_optimizer_state_and_train_refuses_an_underpriced_plan(tmp_path, capsys):
    data = tmp_path / "h.txt"  # 40 users over 60 items
    data.write_text("".join(f"{u} {u % 60} {(7 * u + 3) % 60} {(11 * u + 5) % 60}\n" for u in range(40)))
    npz = tmp_path / "h.npz"
    assert cli(["stats", str(data), "--dim", "8", "--out", str(npz)]) == 0
    make = ["plan", "--workload", str(npz), "--topology", "h100:1x1", "--batch-size", "8"]
    priced = {}
    for opt in ("sgd", "adagrad", "elementwise_adagrad", "adam", None):
        out = tmp_path / f"{opt}.json"
        assert cli([*make, "--out", str(out), *(["--optimizer", opt] if opt else [])]) == 0
        priced[opt] = {t.optimizer_bytes_per_row for t in read_plan(out).tables}
    # bytes per row of dim 8: none, one fp32 accumulator, one per element, two per element; the stats' own: 4
    assert priced == {"sgd": {0}, "adagrad": {4}, "elementwise_adagrad": {32}, "adam": {64}, None: {4}}
    capsys.readouterr()
    base = ["--data", str(data), "--steps", "1", "--batch-size", "8", "--quiet", "--optimizer", "adam"]
    assert main([*base, "--plan", str(tmp_path / "adagrad.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith(
        "--plan priced table 'item_id' with 4 optimizer bytes per row, --optimizer adam keeps 64; make the "
        "plan with flexshard plan --optimizer adam (or run it anyway with --override-plan)"
    )
    assert main([*base, "--plan", str(tmp_path / "adam.json")]) == 0


def test_dense_adam_equals_torch_adam():
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(3, 4))
    q.data.copy_(p.data)
    ours = DenseOptimizer([p], "adam", 0.01)
    ref = torch.optim.Adam([q], lr=0.01, foreach=False)
    for _ in range(4):
        g = torch.randn(3, 4)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert ours.state_dict()["step"] == 4


def test_bad_optimizer_flags_are_one_line(capsys):
    assert main(["--optimizer", "lamb", "--steps", "1", *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "argument --optimizer: invalid choice: 'lamb'" in err, err


@pytest.mark.slow
def test_verify_checks_every_optimizer_on_four_ranks(tmp_path):
    """4 ranks in 2 groups: --verify passes Adam (bf16 wire) and element-wise Adagrad, and fails Adam at
    step 3 when the module's iteration count skips one (its update then differs from the reference)."""
    base = ["--groups", "2", "--steps", "4", *SMALL]
    calls = [
        ([*base, "--verify", "--optimizer", "adam", "--wire-dtype", "bf16"], None),
        ([*base, "--verify", "--optimizer", "elementwise_adagrad"], None),
        ([*base, "--verify", "--optimizer", "adam"], "skip_an_iteration"),
    ]
    results = run_main(4, calls, tmp_path / "run", timeout_s=240.0)
    for i in (0, 1):
        ranks = [r[i] for r in results]
        assert [c["rc"] for c in ranks] == [0, 0, 0, 0], [c["err"] for c in ranks]
        assert "verify: OK (4 steps, all rows of all copies match)" in ranks[0]["out"].splitlines()
    skipped = [r[2] for r in results]
    assert [c["rc"] for c in skipped] == [1, 1, 1, 1]
    message = skipped[0]["err"].strip().splitlines()[-1]
    assert message.startswith("verify: FAILED at step 3: table "), message
    assert "update of the touched rows differs from the reference" in message, message
