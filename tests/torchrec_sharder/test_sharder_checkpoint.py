"""A DMP model with FlexShardSharder checkpointed through ``torch.distributed.checkpoint`` the TorchRec way
(``dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()})``; ``dcp.load`` into
the same templates, then ``dmp.load_state_dict`` and ``dmp.fused_optimizer.load_state_dict``), on spawned
gloo ranks. The model: users in an EmbeddingBagCollection by TorchRec's own sharder (row-wise Adagrad),
the sequence tables in an EmbeddingCollection by FlexShardSharder (Adam, plans with hot, warm and cold
rows), a dense layer (DDP, SGD).

* ``dmp.state_dict()`` and ``dmp.fused_optimizer.state_dict()`` have the keys and global shapes of the
  same model with the collection row-wise by TorchRec (row-wise Adagrad);
* saved at 4 ranks (2 groups) and loaded at 2 (2 groups of 1), then trained, saved and loaded at 4: every
  row of every table, its optimizer state (Adagrad's ``momentum1``; Adam's ``momentum1``, ``momentum2``),
  Adam's iteration and the dense layer equal the saved ones exactly;
* a checkpoint of the FlexShard model (row-wise Adagrad) saved at 4 ranks loads into the same model with
  its collection row-wise by TorchRec's own sharder at 2 ranks, and the TorchRec model's checkpoint back
  into FlexShard at 4: every row and its ``momentum1`` equal the saved ones exactly;
* issue 24's Done-when: under TorchRec's TrainPipelineSparseDist at 4 ranks, 3 steps, a DCP save with the
  pipeline holding the next batch, 3 steps more (the reference: it did not stop); a job of 2 ranks loads
  the checkpoint and trains the last 3 steps under the pipeline. The global batch is the same at both
  world sizes (4 quarter batches per step: one per rank at 4 ranks, two at 2) and the loss is the mean
  over a rank's samples, so each step's gradient is the mean over the global batch at either size; the
  global loss of a step (the mean of the ranks' losses) of the resumed run equals the reference's within
  1e-5 relative and the tables within 1e-5 (float32 summation order: the sums over ranks and dedup
  differ between 2 and 4 ranks).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec", reason="torchrec is an optional peer (scripts/setup_torchrec.sh)")

import checkpoint_workers as cw  # noqa: E402
import numpy as np  # noqa: E402
import sharder_workers as w  # noqa: E402
import torch  # noqa: E402

from flexshard.runtime.local import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks

SHAPES = {2: (2, 1), 4: (2, 2)}  # ranks -> (groups, ranks per group)


def _plans(tmp_path) -> dict[int, str]:
    return {n: str(w.write_test_plan(tmp_path / f"plan{n}.json", *SHAPES[n])) for n in SHAPES}


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    assert got["step"] == want["step"]
    for key, v in want.items():
        if key == "step":
            continue
        if key == "dense":
            assert all(torch.equal(got[key][k], v[k]) for k in v)
            continue
        assert not torch.isnan(v).any(), key  # every row saved
        assert torch.equal(got[key], v), key


def test_dcp_saved_at_4_ranks_loads_at_2_and_back_row_for_row(tmp_path):
    plans = _plans(tmp_path)
    ck4, ck2 = str(tmp_path / "ck4"), str(tmp_path / "ck2")
    at4 = run_on_ranks(cw.round_trip, 4, plans[4], "", 2, ck4, timeout_s=300)
    at2 = run_on_ranks(cw.round_trip, 2, plans[2], ck4, 1, ck2, timeout_s=300)
    back = run_on_ranks(cw.round_trip, 4, plans[4], ck2, 0, "", timeout_s=300)
    saved4, loaded2, saved2, loaded4 = at4[0]["saved"], at2[0]["loaded"], at2[0]["saved"], back[0]["loaded"]
    assert saved4["step"] == 2 and saved2["step"] == 3  # Adam's t
    assert set(saved4) >= {("item", "momentum1"), ("item", "momentum2"), ("users", "momentum1")}
    _assert_same(loaded2, saved4)
    _assert_same(loaded4, saved2)
    assert not torch.equal(saved2[("item", "weight")], saved4[("item", "weight")])  # it trained between
    assert saved4[("item", "momentum2")].abs().sum() > 0 and saved4[("users", "momentum1")].abs().sum() > 0
    assert all(r["keys"] == ([], []) for r in at2 + back)  # dmp.load_state_dict: no missing, no unexpected


def test_dcp_moves_between_flexshard_and_torchrecs_own_row_wise_sharding(tmp_path):
    """A user can switch a model between FlexShardSharder and TorchRec's row-wise sharding, either way and
    at another world size, through the same ``dcp.save`` / ``dcp.load`` code."""
    plans = _plans(tmp_path)
    ck_fs, ck_tr = str(tmp_path / "flexshard"), str(tmp_path / "torchrec")
    fs = run_on_ranks(cw.cross_load, 4, "flexshard", plans[4], "", 2, ck_fs, timeout_s=300)
    tr = run_on_ranks(cw.cross_load, 2, "torchrec", plans[2], ck_fs, 1, ck_tr, timeout_s=300)
    back = run_on_ranks(cw.cross_load, 4, "flexshard", plans[4], ck_tr, 0, "", timeout_s=300)
    saved_fs, loaded_tr, saved_tr, loaded_fs = (
        fs[0]["saved"],
        tr[0]["loaded"],
        tr[0]["saved"],
        back[0]["loaded"],
    )
    assert set(saved_fs) == set(loaded_tr) >= {("item", "momentum1"), ("tag", "momentum1")}
    _assert_same({**loaded_tr, "step": 0}, {**saved_fs, "step": 0})
    _assert_same({**loaded_fs, "step": 0}, {**saved_tr, "step": 0})
    assert not torch.equal(saved_tr[("item", "weight")], saved_fs[("item", "weight")])  # it trained between
    assert saved_fs[("item", "momentum1")].abs().sum() > 0
    assert all(r["keys"] == ([], []) for r in tr + back)  # dmp.load_state_dict: no missing, no unexpected


def test_a_pipelined_dmp_job_resumes_from_dcp_at_another_world_size(tmp_path):
    plans = _plans(tmp_path)
    ckpt = str(tmp_path / "ckpt")
    reference = run_on_ranks(cw.pipelined, 4, plans[4], "", 0, 6, 3, ckpt, timeout_s=300)
    resumed = run_on_ranks(cw.pipelined, 2, plans[2], ckpt, 3, 6, 0, "", timeout_s=300)
    assert [r["step0"] for r in resumed] == [3, 3]  # Adam's t came with the checkpoint
    want = np.mean([r["losses"] for r in reference], axis=0)  # the global batch's mean loss per step
    got = np.mean([r["losses"] for r in resumed], axis=0)
    assert len(want) == 6 and len(got) == 3
    np.testing.assert_allclose(got, want[3:], rtol=1e-5)
    assert abs(want[5] - want[3]) > 1e-4  # the steps after the save moved the loss
    ref, res = reference[0]["state"], resumed[0]["state"]
    assert ref["step"] == res["step"] == 6
    for name in ("item", "tag", "users"):
        diff = (ref[(name, "weight")] - res[(name, "weight")]).abs().max()
        assert diff <= 1e-5, (name, diff)


def test_the_state_dicts_have_torchrecs_keys_and_shapes(tmp_path):
    """What a user saves is keyed and shaped as with TorchRec's own row-wise collection, so the same
    ``dcp.save`` / ``dcp.load`` code serves both (weights ``[rows, dim]``, ``momentum1 [rows]``)."""
    results = run_on_ranks(cw.state_keys, 2, _plans(tmp_path)[2], timeout_s=300)
    for r in results:
        assert r["flexshard"] == r["torchrec"]
        model, optim = r["flexshard"]
        assert model["ec.embeddings.item.weight"] == (240, w.DIM)
        assert optim[("ec.embeddings.tag.weight", "tag.momentum1")] == (60,)
