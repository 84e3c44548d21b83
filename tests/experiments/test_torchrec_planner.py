"""experiments/torchrec_planner.py: the translation to TorchRec's planner inputs and the --quick records.

Skipped when torchrec is not importable (CI installs no torchrec; scripts/setup_torchrec.sh adds it).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchrec", reason="torchrec is not installed: run scripts/setup_torchrec.sh")
pytest.importorskip("matplotlib", reason="the experiment plots with matplotlib (the plots extra)")

from experiment_module import load_experiment  # noqa: E402

tp = load_experiment("torchrec_planner")

from flexshard import workloads  # noqa: E402
from solvers.cost_model import evaluate  # noqa: E402
from solvers.planner import make_plan  # noqa: E402
from topology import cluster_view, from_preset  # noqa: E402


@pytest.fixture(scope="module")
def tr():
    return tp.import_torchrec()


def test_translation_matches_workload_and_view(tr):
    w = workloads.default_workload()
    view = cluster_view(from_preset("h100:2"))
    module = tp.torchrec_module(tr, w)
    configs = {c.name: c for ec in module.values() for c in ec.embedding_configs()}
    assert set(configs) == {t.name for t in w.tables}
    for t in w.tables:
        assert (configs[t.name].num_embeddings, configs[t.name].embedding_dim) == (t.num_rows, t.dim)
    assert all(p.device.type == "meta" for p in module.parameters())
    topo = tp.torchrec_topology(tr, view, 1e9)
    assert (topo.world_size, topo.local_world_size) == (16, 8)
    assert topo.comms_bandwidths.inter_host_bw == pytest.approx(view.inter_bw_Bps[0] / 1e3)
    assert topo.comms_bandwidths.intra_host_bw == pytest.approx(view.intra_bw_Bps[0] / 1e3)
    cons = tp.torchrec_constraints(tr, w, ("row_wise",))
    assert cons["item_id"].pooling_factors == [pytest.approx(w.tables[0].ids_per_sample)]


def test_quick_records_are_consistent(tr):
    s = tp.scenarios(quick=True)[1]  # default on h100:2, row-wise only
    rec = tp.run_scenario(tr, s, quick=True)
    res = rec["torchrec"]
    assert res.ok and {t["sharding_type"] for t in res.tables.values()} == {"row_wise"}
    assert all(t["ranks"] == list(range(16)) for t in res.tables.values())
    # TorchRec's row-wise sequence estimate: B L d 4 bytes forward at the inter-host bandwidth, per table
    w, view = rec["workload"], rec["view"]
    fwd = sum(w.batch_size_per_gpu * t.ids_per_sample * t.dim * 4 for t in w.tables) / (
        view.inter_bw_Bps[0] / 1e3
    )
    np.testing.assert_allclose(res.fwd_comms_ms, fwd, rtol=1e-6)
    # TorchRec's all-row-wise plan priced by our model is exactly our row-wise baseline
    for dedup in (False, True):
        ours = make_plan("row_wise", w, view, rec["budget"], dedup).report
        assert rec[("torchrec_ours", dedup)].modeled_time_s == pytest.approx(ours.modeled_time_s)


def test_mapping_rejects_column_wise():
    w = workloads.default_workload()
    view = cluster_view(from_preset("h100:2"))
    tables = {t.name: {"sharding_type": "row_wise", "ranks": list(range(16))} for t in w.tables}
    assert tp.torchrec_plan_as_ours(w, view, tables, True, 1e12) is not None
    tables["user_geo"] = {"sharding_type": "table_wise", "ranks": [3]}
    plan = tp.torchrec_plan_as_ours(w, view, tables, True, 1e12)
    geo = next(p for p in plan.tables if p.name == "user_geo")
    assert geo.cold_share[3] == 1.0 and geo.cold_share.sum() == 1.0
    assert evaluate(w, view, plan).memory_bytes[3] > evaluate(w, view, plan).memory_bytes[4]
    tables["user_geo"] = {"sharding_type": "column_wise", "ranks": [0, 1]}
    assert tp.torchrec_plan_as_ours(w, view, tables, True, 1e12) is None


def test_rank_ranges():
    assert tp.rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
