"""The plan file as a contract: its format, its validation, and the checks that refuse a run it does not
fit (flexshard.plan_file, flexshard.contract). The multi-rank refusals are in tests/runtime."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from core.errors import DataError, PlanMismatchError
from core.ranks import RankLayout
from core.vocabulary import SyncMode, WireDtype
from flexshard.contract import require, sampling_mismatch, settings_mismatch, tables_mismatch, world_mismatch
from flexshard.fingerprints import order_fingerprint
from flexshard.plan_file import SCHEMA, read_plan, to_dict, write_plan
from solvers.planner import budget_bytes, make_plan
from solvers.types import RowHistogram, TableSpec, TouchProfile, Workload
from topology.views import uniform_view

ORDERS = {"items": np.array([5, 3, 9, 0]), "tags": None}


def _workload(batch: int = 32) -> Workload:
    items = TableSpec("items", 12, 4, 3.0, RowHistogram.from_counts(np.arange(12, 0, -1)))
    tags = TableSpec("tags", 6, 8, 1.0, RowHistogram.from_counts(np.array([6, 5, 4, 3, 2, 1])))
    return Workload("contract", (items, tags), batch)


@pytest.fixture
def plan_path(tmp_path) -> Path:
    workload, view = _workload(), uniform_view(2, 2, 100e9, 10e9)
    planned = make_plan("row_wise", workload, view, budget_bytes(workload, view, 2.0), dedup=True)
    orders = {k: v for k, v in ORDERS.items() if v is not None}
    path = tmp_path / "plan.json"
    write_plan(path, to_dict(planned.plan, workload, view, planned.report, "wfp", orders))
    return path


def test_round_trip_records_what_the_plan_was_made_for(plan_path):
    doc = json.loads(plan_path.read_text())
    assert doc["schema"] == SCHEMA == "flexshard-plan/2"
    assert doc["settings"] == {"dedup": True, "sync": "sparse", "wire": "fp32", "batch_size_per_gpu": 32}
    assert doc["world"] == {"size": 4, "groups": [[0, 1], [2, 3]]}
    assert doc["fingerprints"]["world"] == RankLayout.consecutive(4, 2).fingerprint()
    pf = read_plan(plan_path)
    assert pf.world_size == 4 and pf.groups == [[0, 1], [2, 3]] and pf.batch_size_per_gpu == 32
    assert [t.order_fingerprint for t in pf.tables] == [
        order_fingerprint(ORDERS["items"], 12),
        order_fingerprint(None, 6),
    ]
    assert [(t.name, t.num_rows, t.dim) for t in pf.tables] == [("items", 12, 4), ("tags", 6, 8)]


def test_order_fingerprint_tells_orders_apart():
    a = order_fingerprint(np.array([1, 0, 2]), 3)
    assert a == order_fingerprint([1, 0, 2], 3)  # the array type does not matter
    assert a != order_fingerprint(np.array([0, 1, 2]), 3)  # another order
    assert a != order_fingerprint(np.array([1, 0, 2]), 4)  # another table size
    assert order_fingerprint(None, 3) != order_fingerprint(np.array([], dtype=np.int64), 3)


def test_world_mismatch_names_both_sides_and_what_to_do(plan_path):
    pf = read_plan(plan_path)
    assert world_mismatch(pf, 4) == ""
    assert world_mismatch(pf, 4, RankLayout.consecutive(4, 2)) == ""
    assert world_mismatch(pf, 8).startswith("the plan is for 4 ranks, this job has 8: launch 4 ranks")
    other = world_mismatch(pf, 4, RankLayout.consecutive(4, 4))
    assert other.startswith("the plan's groups are [[0, 1], [2, 3]], this job's are [[0], [1], [2], [3]]")


def test_tables_mismatch_covers_names_rows_dim_and_data(plan_path):
    pf = read_plan(plan_path)
    tables = [("items", 12, 4), ("tags", 6, 8)]
    assert tables_mismatch(pf, tables, {"items": ORDERS["items"]}) == ""
    assert "the plan's tables are ['items', 'tags'], the model's are ['tags', 'items']" in tables_mismatch(
        pf, tables[::-1], {"items": ORDERS["items"]}
    )
    assert tables_mismatch(pf, [("items", 13, 4), tables[1]], {"items": ORDERS["items"]}).startswith(
        "table 'items': the plan covers 12 rows, the model has 13"
    )
    assert tables_mismatch(pf, [("items", 12, 16), tables[1]], {"items": ORDERS["items"]}).startswith(
        "table 'items': the plan was made for dim 4, the model has dim 16"
    )
    other_data = tables_mismatch(pf, tables, {"items": np.array([3, 5, 9, 0])})
    assert other_data.startswith("table 'items': the plan was made from other data (hotness order ")
    assert "\n" not in other_data
    # an order the plan did not have (its table numbered hottest first) is other data too
    assert tables_mismatch(pf, tables, {"items": ORDERS["items"], "tags": np.arange(6)}).startswith(
        "table 'tags': the plan was made from other data"
    )
    assert tables_mismatch(pf, tables, {"genre": np.arange(3)}).startswith("orders: no table named 'genre'")
    with pytest.raises(PlanMismatchError, match="other data"):
        require(other_data)


def test_settings_mismatch_and_explicit_overrides(plan_path):
    pf = read_plan(plan_path)
    assert settings_mismatch(pf, {"dedup": None, "sync": None, "batch_size_per_gpu": None}) == ""
    assert settings_mismatch(pf, {"dedup": True, "sync": "sparse", "batch_size_per_gpu": 32}) == ""
    message = settings_mismatch(pf, {"dedup": False})
    assert message.startswith("dedup: the plan was made with dedup on, this run asks for off;")
    assert "--override-plan" in message
    assert settings_mismatch(pf, {"batch_size_per_gpu": 64}).startswith(
        "batch_size_per_gpu: the plan was made with batch_size_per_gpu 32, this run asks for 64"
    )
    assert settings_mismatch(pf, {"sync": SyncMode.DENSE}).startswith(
        "sync: the plan was made with sync sparse"
    )
    assert settings_mismatch(pf, {"wire": "fp32"}) == ""
    assert settings_mismatch(pf, {"wire": WireDtype.BF16}).startswith(
        "wire: the plan was made with wire fp32, this run asks for bf16;"
    )
    run = pf.with_overrides(dedup=False, sync="dense", batch_size_per_gpu=64, wire="bf16")
    assert run.overrides == {
        "dedup": [True, False],
        "sync": ["sparse", "dense"],
        "wire": ["fp32", "bf16"],
        "batch_size_per_gpu": [32, 64],
    }
    assert run.plan.dedup is False and run.plan.sync is SyncMode.DENSE and run.batch_size_per_gpu == 64
    assert run.plan.wire is WireDtype.BF16
    assert pf.plan.dedup is True and pf.overrides == {}  # the plan as made is untouched
    assert pf.with_overrides(dedup=True) == pf  # asking for the plan's own value overrides nothing


def _edit(path: Path, change) -> Path:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(schema="flexshard-plan/1"), "format flexshard-plan/1 was written by an older"),
        (lambda d: d.update(schema="other"), "schema must be 'flexshard-plan/2', got 'other'"),
        (lambda d: d["tables"][0].update(cold_share=[float("nan")] * 4), "cold_share: every share must be"),
        (lambda d: d["tables"][0].update(cold_share=[1.5, -0.5, 0.0, 0.0]), "every share must be a finite"),
        (lambda d: d["tables"][0].update(cold_share=[0.5, 0.5, 0.5, 0.5]), "cold_share: shares sum to 2"),
        (lambda d: d["tables"][0].update(cold_share=[1.0]), "cold_share has 1 entries, expected 4"),
        (lambda d: d["world"].update(groups=[[0, 1], [3]]), "must cover ranks 0..3 exactly once"),
        (lambda d: d["world"].update(size=0), "world.size must be a positive integer, got 0"),
        (lambda d: d["world"].update(size="4"), "world.size must be a positive integer, got '4'"),
        (lambda d: d["settings"].update(sync="lazy"), "settings.sync: unknown 'lazy'"),
        (
            lambda d: d["settings"].update(batch_size_per_gpu=0),
            "batch_size_per_gpu must be a positive integer",
        ),
        (lambda d: d["tables"][1].update(dim=0), "tables[1] ('tags').dim must be a positive integer, got 0"),
        (lambda d: d["tables"][0].update(hot_rows=100), "do not add up to num_rows 12"),
        # issue 22: every tier count an integer >= 0 (was int() of anything, and "-5+0+206 do not add up")
        (
            lambda d: d["tables"][0].update(hot_rows="0"),
            "tables[0] ('items').hot_rows must be an integer >= 0, got '0'",
        ),
        (
            lambda d: d["tables"][0].update(hot_rows=0.0),
            "tables[0] ('items').hot_rows must be an integer >= 0, got 0.0",
        ),
        (
            lambda d: d["tables"][0].update(warm_rows=None),
            "tables[0] ('items').warm_rows must be an integer >= 0, got None",
        ),
        (
            lambda d: d["tables"][0].update(warm_rows=True),
            "tables[0] ('items').warm_rows must be an integer >= 0, got True",
        ),
        (
            lambda d: d["tables"][0].update(hot_rows=-5, cold_rows=d["tables"][0]["cold_rows"] + 5),
            "tables[0] ('items').hot_rows must be an integer >= 0, got -5",
        ),
        (
            lambda d: d["tables"][1].update(cold_rows=-1),
            "tables[1] ('tags').cold_rows must be an integer >= 0, got -1",
        ),
        (
            lambda d: d["tables"][0].update(optimizer_bytes_per_row="4"),
            "tables[0] ('items').optimizer_bytes_per_row must be an integer >= 0, got '4'",
        ),
        (
            lambda d: d["tables"].append(dict(d["tables"][0])),
            "tables[2].name: table 'items' is listed twice (also tables[0])",
        ),
        (lambda d: d["tables"][1].update(name=7), "tables[1].name must be a non-empty string, got 7"),
        (lambda d: d["tables"][1].update(name=""), "tables[1].name must be a non-empty string, got ''"),
        (lambda d: d["settings"].update(dedup="no"), "settings.dedup must be true or false, got 'no'"),
        (
            lambda d: d.update(owner_pattern_period=1.5),
            "owner_pattern_period must be a positive integer, got 1.5",
        ),
        (
            lambda d: (d["world"].update(groups=[[0, 1, 2], [3]]), d["tables"][0].update(fetch="group")),
            "tables[0] ('items'): a group fetch needs groups of equal size, got [[0, 1, 2], [3]]",
        ),
        (lambda d: d.pop("settings"), "missing field 'settings'"),
        (lambda d: d["tables"][0].update(deal="hashed"), "tables[0] ('items').deal: unknown 'hashed'"),
        (lambda d: d["tables"][0].update(cold_start=4096), "cold_start: must be an integer in [0, 4096)"),
        (lambda d: d["tables"][1].update(warm_start=-1), "warm_start: must be an integer in [0, 4096)"),
        (
            lambda d: d["tables"][0].update(deal="ranges", hot_rows=1, cold_rows=11),
            "the ranges deal needs every row cold, got 1 hot and 0 warm",
        ),
    ],
)
def test_bad_plan_files_give_one_line(plan_path, change, message):
    with pytest.raises(DataError) as err:
        read_plan(_edit(plan_path, change))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"plan file {str(plan_path)!r}")


def test_unreadable_plan_files(tmp_path):
    binary = tmp_path / "binary.json"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(DataError, match="not a text file"):
        read_plan(binary)
    broken = tmp_path / "broken.json"
    broken.write_text("[1, 2")
    with pytest.raises(DataError, match="malformed JSON at line 1"):
        read_plan(broken)
    with pytest.raises(DataError, match="cannot read"):
        read_plan(tmp_path / "missing.json")


def test_plans_priced_on_measured_rates_name_the_sampling(tmp_path):
    """A plan made from measured touch rates records how samples were formed; a run that forms them
    another way is refused with one line naming both (flexshard.contract.sampling_mismatch)."""
    workload, view = _workload(), uniform_view(2, 2, 100e9, 10e9)
    items = workload.tables[0]
    profile = TouchProfile(
        lookups=items.hist.prob * items.hist.rows * items.ids_per_sample,
        entry_bucket=np.arange(items.hist.num_buckets),
        entry_prob=np.full(items.hist.num_buckets, 0.1),
        entry_rows=items.hist.rows,
        quantization=0.01,
        bucket_error=0.0,
        sampling="next-item, window 20, negatives 4",
    )
    workload = dataclasses.replace(
        workload, tables=(dataclasses.replace(items, touch=profile), workload.tables[1])
    )
    planned = make_plan("flexshard", workload, view, budget_bytes(workload, view, 2.0), dedup=True)
    path = tmp_path / "measured.json"
    write_plan(path, to_dict(planned.plan, workload, view, planned.report, "wfp", {}))
    plan_file = read_plan(path)
    assert [t.touch_rates for t in plan_file.tables] == ["next-item, window 20, negatives 4", None]
    assert sampling_mismatch(plan_file, {"items": "next-item, window 20, negatives 4"}) == ""
    assert sampling_mismatch(plan_file, {"tags": "next-item, window 50, negatives 4"}) == ""  # not measured
    message = sampling_mismatch(plan_file, {"items": "next-item, window 50, negatives 4"})
    assert message.startswith(
        "table 'items': the plan was priced on samples formed as 'next-item, window 20, negatives 4', "
        "this run forms 'next-item, window 50, negatives 4'"
    )
    assert "\n" not in message and "--override-plan" in message


def test_deal_and_start_positions_round_trip(tmp_path):
    """Row-wise is TorchRec's layout (``ranges``); FlexShard's deal starts each table at its
    own position. Files written before either existed read as ``interleave`` from position 0."""
    workload, view = _workload(), uniform_view(2, 2, 100e9, 10e9)
    workload = workload.with_orders({"items": ORDERS["items"]})
    budget = budget_bytes(workload, view, 2.0)
    row_wise = make_plan("row_wise", workload, view, budget, dedup=False)
    path = tmp_path / "row_wise.json"
    write_plan(
        path, to_dict(row_wise.plan, workload, view, row_wise.report, "wfp", {"items": ORDERS["items"]})
    )
    # a table without an id order (tags) is TorchRec's layout too, priced over random id orders
    assert [t["deal"] for t in json.loads(path.read_text())["tables"]] == ["ranges", "ranges"]
    assert [t.deal.value for t in read_plan(path).plan.tables] == ["ranges", "ranges"]
    plan = dataclasses.replace(
        row_wise.plan,
        tables=tuple(
            dataclasses.replace(tp, deal="interleave", cold_start=3 + i)
            for i, tp in enumerate(row_wise.plan.tables)
        ),
    )
    write_plan(path, to_dict(plan, workload, view, row_wise.report, "wfp"))
    assert [(t.cold_start, t.warm_start) for t in read_plan(path).plan.tables] == [(3, 0), (4, 0)]
    old = _edit(path, lambda d: [t.pop(k) for t in d["tables"] for k in ("deal", "warm_start", "cold_start")])
    assert [(t.deal.value, t.cold_start) for t in read_plan(old).plan.tables] == [("interleave", 0)] * 2
