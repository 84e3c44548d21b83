"""Checkpoints that cannot be mixed or escaped (issue 22, Deliver 4), in one process: the manifest binds
each rank file (size, sha256, step, run) and names only files in its own folder; a rank file of another
step, a manifest of another folder, and any malformed manifest or rank file are one CheckpointError line,
never another exception (a fuzz test over random, truncated and mutated files)."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from core.errors import CheckpointError
from flexshard import checkpoint
from flexshard.checkpoint_manifest import Manifest, read_manifest, read_rank_file
from flexshard.train import main

SMALL = ["--batch-size", "8", "--quiet", "--dim", "8"]


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A folder of two real checkpoints (steps 1 and 2) of a one-rank run on small tables."""
    root = tmp_path_factory.mktemp("ckpt")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    data = root / "h.txt"  # 40 users over 60 items
    data.write_text("".join(f"{u} {u % 60} {(7 * u + 3) % 60} {(11 * u + 5) % 60}\n" for u in range(40)))
    argv = [
        "--data",
        str(data),
        "--checkpoint-dir",
        str(root / "ckpt"),
        "--checkpoint-every",
        "1",
        "--steps",
        "2",
    ]
    assert main([*argv, *SMALL]) == 0
    return root / "ckpt"


def _copy(saved: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    return ckpt


def _manifest_doc(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _write_manifest(folder: Path, doc) -> None:
    (folder / "manifest.json").write_text(json.dumps(doc) if not isinstance(doc, str) else doc)


def _record(folder: Path, content: bytes) -> None:
    """Write ``content`` as rank0.pt and record its size and hash in the manifest (so it is unpickled)."""
    (folder / "rank0.pt").write_bytes(content)
    doc = _manifest_doc(folder)
    doc["files"][0] = {
        "name": "rank0.pt",
        "bytes": len(content),
        "sha256": hashlib.sha256(content).hexdigest(),
    }
    _write_manifest(folder, doc)


def _refused(folder: Path) -> str:
    """The one line a read of ``folder`` (manifest, then every rank file, then whole tables) raises."""
    with pytest.raises(CheckpointError) as err:
        manifest = read_manifest(folder)
        for r in range(manifest.world_size):
            read_rank_file(manifest, r)
        checkpoint.load_full(folder)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"checkpoint {str(folder)!r}"), text
    return text


def test_a_checkpoint_reads_back_and_records_its_binding(saved):
    manifest = read_manifest(saved)
    assert manifest.path == saved / "step-00000002" and manifest.step == 2
    doc = _manifest_doc(manifest.path)
    content = (manifest.path / "rank0.pt").read_bytes()
    assert doc["schema"] == "flexshard-checkpoint/3"
    assert (doc["optimizer"], doc["optimizer_step"]) == ("rowwise_adagrad", 2)
    assert doc["files"] == [
        {"name": "rank0.pt", "bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    ]
    payload = read_rank_file(manifest, 0)
    assert (payload["format"], payload["rank"], payload["step"], payload["layout"]) == (
        "flexshard-checkpoint/3", 0, 2, manifest.layout,
    )  # fmt: skip
    assert payload["run"] == hashlib.sha256(json.dumps(manifest.run, sort_keys=True).encode()).hexdigest()
    assert manifest.document() == doc  # what was read is what is written
    full = checkpoint.load_full(manifest.path)
    assert sorted(full.weights) == [t.name for t in sorted(manifest.tables, key=lambda t: t.name)]


def test_the_reproductions_of_the_issue(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    step2 = ckpt / "step-00000002"
    real = (step2 / "rank0.pt").read_bytes()
    size = len(real)
    # printf 'hi\n' > rank0.pt: refused by its size before unpickling (was KeyError: 105)
    (step2 / "rank0.pt").write_bytes(b"hi\n")
    assert _refused(step2) == (
        f"checkpoint {str(step2)!r}: rank0.pt: 3 bytes, the manifest records {size} (truncated, damaged, or "
        "a file of another checkpoint)"
    )
    # the same size, other bytes: refused by its hash
    (step2 / "rank0.pt").write_bytes(bytes(size))
    assert _refused(step2) == (
        f"checkpoint {str(step2)!r}: rank0.pt: its sha256 is not the one the manifest records (damaged, or "
        "a file of another checkpoint)"
    )
    # ... and where the manifest records the garbage's own hash, the unpickler's failure is the one line
    _record(step2, b"hi\n")
    assert _refused(step2).startswith(
        f"checkpoint {str(step2)!r}: cannot read rank0.pt (not a FlexShard rank file: "
    )
    # a rank file copied from another step: its hash differs; with the hash patched in, its step does
    (step2 / "rank0.pt").write_bytes(real)
    _record(step2, real)
    shutil.copy(ckpt / "step-00000001" / "rank0.pt", step2 / "rank0.pt")
    assert "its sha256 is not the one the manifest records" in _refused(step2) or "bytes, the manifest" in (
        _refused(step2)
    )
    _record(step2, (ckpt / "step-00000001" / "rank0.pt").read_bytes())
    assert _refused(step2) == f"checkpoint {str(step2)!r}: rank0.pt: records step 1, the manifest 2"
    # a manifest whose step differs from its folder (a checkpoint copied under another step's name)
    shutil.copytree(ckpt / "step-00000001", ckpt / "step-00000005")
    assert _refused(ckpt / "step-00000005") == (
        f"checkpoint {str(ckpt / 'step-00000005')!r}: manifest.json: step 1 differs from its folder's "
        "step-00000005 (a manifest from another checkpoint)"
    )
    # a manifest without world_size (was KeyError)
    step1 = ckpt / "step-00000001"
    doc = _manifest_doc(step1)
    del doc["world_size"]
    _write_manifest(step1, doc)
    assert _refused(step1) == f"checkpoint {str(step1)!r}: manifest.json: field 'world_size' missing"
    # files naming a path outside the folder (read ../../afile before)
    (tmp_path / "afile").write_bytes(real)
    shutil.rmtree(step2)
    shutil.copytree(saved / "step-00000002", step2)
    doc = _manifest_doc(step2)
    doc["files"][0]["name"] = "../../afile"
    _write_manifest(step2, doc)
    assert _refused(step2) == (
        f"checkpoint {str(step2)!r}: manifest.json: field 'files[0].name' = '../../afile'; expected "
        "'rank0.pt' (a file inside the checkpoint folder)"
    )
    # a rank file that is a symlink out of the folder, even to identical bytes
    other = _copy(saved, tmp_path / "other") / "step-00000002"
    (other / "rank0.pt").unlink()
    (other / "rank0.pt").symlink_to(saved / "step-00000002" / "rank0.pt")
    assert _refused(other) == (
        f"checkpoint {str(other)!r}: rank0.pt: not a regular file (a rank file is never a link or a folder)"
    )
    # a checkpoint of the previous schema: one line saying so
    doc = _manifest_doc(saved / "step-00000002")
    doc["schema"] = "flexshard-checkpoint/1"
    _write_manifest(other, doc)
    assert _refused(other) == (
        f"checkpoint {str(other)!r}: manifest.json: schema 'flexshard-checkpoint/1' is from another "
        "FlexShard version (this one reads 'flexshard-checkpoint/3' and 'flexshard-checkpoint/2', whose "
        "manifests record every rank file's hash); start a fresh run (here: --overwrite)"
    )


def _payload_mutations(payload: dict, manifest: Manifest) -> list:
    """Well-pickled payloads that are not this checkpoint's rank 0 file."""
    table = manifest.tables[0].name
    tiers = payload["rows"][table]
    tier = max(tiers, key=lambda t: len(tiers[t]["ids"]))  # one with rows (a mutated empty tier is fine)
    assert len(tiers[tier]["ids"]) > 1
    out = []

    def mutated(change) -> dict:
        p = copy.deepcopy(payload)
        change(p)
        return p

    entry = lambda p: p["rows"][table][tier]  # noqa: E731
    out += [
        [1, 2, 3],
        "rows",
        None,
        {},
        mutated(lambda p: p.pop("format")),
        mutated(lambda p: p.update(format="flexshard-checkpoint/1")),
        mutated(lambda p: p.update(rank=1)),
        mutated(lambda p: p.update(step=7)),
        mutated(lambda p: p.update(layout="0" * 64)),
        mutated(lambda p: p.update(run=None)),
        mutated(lambda p: p.update(rows=[])),
        mutated(lambda p: p["rows"].update(other={})),
        mutated(lambda p: p["rows"].update({5: {}})),
        mutated(lambda p: p["rows"].update({torch.zeros(30, 30): {}})),  # a key whose repr has lines
        mutated(lambda p: p["rows"][table].update({torch.zeros(30, 30): entry(p)})),
        mutated(lambda p: p.update(step=torch.zeros(30, 30))),
        mutated(lambda p: p.update(format=torch.zeros(30, 30))),
        mutated(lambda p: p.update(rank=False)),  # 0 == False: compared by type too
        {torch.zeros(2, 2): 1},
        mutated(lambda p: p["rows"].update({table: []})),
        mutated(lambda p: p["rows"][table].update(lukewarm=entry(p))),
        mutated(lambda p: p["rows"][table].update({tier: []})),
        mutated(lambda p: entry(p).pop("states")),
        mutated(lambda p: entry(p).update(states={})),
        mutated(lambda p: entry(p).update(states=entry(p)["states"]["momentum1"])),
        mutated(lambda p: entry(p)["states"].update(momentum2=entry(p)["states"]["momentum1"])),
        mutated(lambda p: entry(p).update(state=entry(p).pop("states")["momentum1"])),  # schema 2's key
        mutated(lambda p: entry(p).update(extra=torch.zeros(1))),
        mutated(lambda p: entry(p).update(ids=entry(p)["ids"].to(torch.int32))),
        mutated(lambda p: entry(p).update(ids=entry(p)["ids"].reshape(-1, 1))),
        mutated(lambda p: entry(p).update(ids=entry(p)["ids"] + manifest.tables[0].num_rows)),
        mutated(lambda p: entry(p).update(ids=entry(p)["ids"] - 10**6)),
        mutated(lambda p: entry(p).update(ids=entry(p)["ids"][:-1])),
        mutated(lambda p: entry(p).update(ids=entry(p)["ids"].tolist())),
        mutated(lambda p: entry(p).update(weights=entry(p)["weights"].double())),
        mutated(lambda p: entry(p).update(weights=entry(p)["weights"][:, :-1])),
        mutated(lambda p: entry(p).update(weights=entry(p)["weights"][:-1])),
        mutated(lambda p: entry(p).update(weights=entry(p)["weights"].to_sparse())),
        mutated(lambda p: entry(p)["states"].update(momentum1=entry(p)["states"]["momentum1"].half())),
        mutated(lambda p: entry(p)["states"].update(momentum1=entry(p)["states"]["momentum1"][:-1])),
        mutated(lambda p: entry(p)["states"].update(momentum1=entry(p)["weights"])),  # per element
        mutated(lambda p: entry(p)["states"].update(momentum1=np.zeros(3))),
        mutated(lambda p: p.pop("dense")),
        mutated(lambda p: p.update(dense={"w": 1.0})),
        mutated(lambda p: p.update(dense_optimizer=[1])),
        mutated(lambda p: p.update(extra=None)),
        # well formed, but not this model's dense state: refused by the load, as a CheckpointError
        mutated(lambda p: p.update(dense={})),
        mutated(lambda p: p.update(dense={k: v[..., :1] for k, v in p["dense"].items()})),
        mutated(lambda p: p.update(dense_optimizer={"kind": "adagrad"})),
        mutated(lambda p: p.update(dense_optimizer={"kind": "adagrad", "sums": [1] * 99})),
        mutated(lambda p: p.update(dense_optimizer={"kind": "adagrad", "sums": [torch.zeros(1)] * 6})),
    ]
    return out


def _saved_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load_into_model(folder: Path) -> None:
    """What resume does with rank 0's file beyond reading it: the dense model and optimizer's state."""
    from flexshard.model import DenseOptimizer, SequenceRecModel

    manifest = read_manifest(folder)
    dense = SequenceRecModel(8, 20, "next-item")
    checkpoint.load_dense(manifest, lambda r: read_rank_file(manifest, r), dense, DenseOptimizer(
        dense.parameters(), "adagrad", 0.05))  # fmt: skip


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # random bytes' "protocol"
def test_fuzz_every_malformed_file_is_one_checkpoint_error(saved, tmp_path):
    """1,300+ manifests and rank files (random bytes, truncations of real ones, real ones with fields or
    structures changed; rank files both with the manifest's hash and with their own recorded) are each
    refused with one CheckpointError line: never an IndexError, struct.error, KeyError or the like."""
    rng = np.random.default_rng(22)
    ckpt = _copy(saved, tmp_path)
    folder = ckpt / "step-00000002"
    real_rank = (folder / "rank0.pt").read_bytes()
    real_doc = _manifest_doc(folder)
    real_text = (folder / "manifest.json").read_text()
    manifest = read_manifest(folder)
    payload = read_rank_file(manifest, 0)
    cases = 0

    def restore() -> None:
        if (folder / "manifest.json").read_bytes() != real_text.encode():
            _write_manifest(folder, real_text)
        if (folder / "rank0.pt").read_bytes() != real_rank:
            (folder / "rank0.pt").write_bytes(real_rank)

    def check(load_model: bool = False) -> None:
        nonlocal cases
        _refused(folder) if not load_model else None
        if load_model:
            with pytest.raises(CheckpointError) as err:
                _load_into_model(folder)
            assert "\n" not in str(err.value) and str(err.value).startswith(f"checkpoint {str(folder)!r}")
        cases += 1
        restore()

    # rank files: random bytes (with their own hash recorded: unpickled; and without: refused first)
    for k in range(400):
        content = rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes()
        if k % 4 == 1:
            content = b"PK\x03\x04" + content  # a zip's magic, then garbage
        if k % 4 == 2:
            content = real_rank[: int(rng.integers(0, 200))] + content  # a real header, then garbage
        if k % 5 == 0:
            (folder / "rank0.pt").write_bytes(content)
        else:
            _record(folder, content)
        check()
    # rank files: truncations of the real one, hash recorded; and a byte appended to one, not recorded
    for _k in range(300):
        cut = int(rng.integers(0, len(real_rank)))
        _record(folder, real_rank[:cut])
        check()
    for _k in range(100):
        cut = int(rng.integers(0, len(real_rank) + 1))
        (folder / "rank0.pt").write_bytes(real_rank[:cut] + bytes(rng.integers(0, 256, 1, dtype=np.uint8)))
        check()
    # rank files that unpickle fine but are not this checkpoint's rank 0
    for bad in _payload_mutations(payload, manifest):
        _record(folder, _saved_bytes(bad))
        check(load_model=not _fails_to_read(folder))  # read fine: the model's load refuses it
    # manifests: random bytes, truncations, and each field replaced by values of other kinds
    for _k in range(200):
        (folder / "manifest.json").write_bytes(
            rng.integers(0, 256, int(rng.integers(0, 600)), dtype=np.uint8).tobytes()
        )
        check()
    for _k in range(200):
        _write_manifest(folder, real_text[: int(rng.integers(0, len(real_text.rstrip())))])
        check()
    odd = [None, -1, 0, 3, 2.5, True, "", "x", [], {}, [[0, 0]], [[1]], [{}], ["rank0.pt"], {"a": 1}, 10**30]
    for key in real_doc:
        for value in odd:
            doc = copy.deepcopy(real_doc)
            doc[key] = value
            count = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if doc == real_doc or (key == "run" and value is None) or (key == "optimizer_step" and count):
                continue  # the same document; a run of none; another iteration count (a count is valid)
            _write_manifest(folder, doc)
            check()
    for value in odd:  # inside the entries of tables and files
        for part, field in [("tables", "name"), ("tables", "num_rows"), ("tables", "dim"),
                            ("files", "name"), ("files", "bytes"), ("files", "sha256")]:  # fmt: skip
            doc = copy.deepcopy(real_doc)
            doc[part][0][field] = value
            if doc == real_doc:
                continue
            _write_manifest(folder, doc)
            check()
    assert cases >= 1000


def _fails_to_read(folder: Path) -> bool:
    try:
        read_rank_file(read_manifest(folder), 0)
    except CheckpointError:
        return True
    return False
