"""The cost model (solvers.cost_model.evaluate) against hand-computed figures.

Every expected number below is written out as a literal with its derivation in a comment; none is
computed by calling the model's own helpers. Notation (docs/cost_model.md): N ranks in G groups of
g, n lookups per GPU per table per iteration, vec = dim * element_bytes, idx = 8 bytes per id.

Reference setting used throughout:

* cluster 2 groups x 2 GPUs (N = 4, G = 2, g = 2), intra 100 B/s, inter 10 B/s, zero latency;
* table "a": 4 rows with p = 0.4, 0.3, 0.2, 0.1; dim 2, element_bytes 4 -> vec = 8 B;
  optimizer_bytes_per_row 4 -> row_bytes = 12 B;
* batch_size_per_gpu 3, ids_per_sample 1 -> n = 3 lookups per GPU.

Per-row figures used below (n = 3, N n = 12):

* dedup volume 1 - (1-p)^3: 0.784, 0.657, 0.488, 0.271 (1-0.216, 1-0.343, 1-0.512, 1-0.729); sum 2.2;
* touched 1 - (1-p)^12: 0.6^12 = 0.002176782336, 0.7^12 = 0.013841287201, so rows 0 and 1 are
  touched with probability 0.997823217664 and 0.986158712799.

A lookup of a requester r to owner o moves idx (r -> o), vec (o -> r, forward) and vec (r -> o,
backward). With even cold shares 1/4, a rank sends a quarter of its cold lookups to its group peer
(intra) and half to the other group (inter); as an owner it serves the same amounts, so send = recv.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from core.errors import ConfigError, PlannerError
from core.vocabulary import COMPONENTS, INDEX_BYTES, LINK_CLASSES, FetchMode, WireDtype
from solvers import cost_model
from solvers.cost_model import Exchanges, split_bytes, table_plan
from solvers.types import Plan, RowHistogram, TablePlan, TableSpec, Workload
from solvers.volumes import table_mass
from topology.views import uniform_view

REL = 1e-12


def evaluate(workload: Workload, view, plan: Plan):
    """The model with every owner's share of the accesses equal to its share of the rows
    (``dealt=False``), which the hand figures below assume; tests/solvers/test_dealing.py checks the
    rows dealt to their owners."""
    return cost_model.evaluate(workload, view, plan, dealt=False)


def _table_a() -> TableSpec:
    hist = RowHistogram(rows=np.ones(4, dtype=np.int64), prob=np.array([0.4, 0.3, 0.2, 0.1]))
    return TableSpec("a", num_rows=4, dim=2, ids_per_sample=1.0, hist=hist, element_bytes=4)


def _table_b() -> TableSpec:
    # 3 rows, p = 0.5, 0.3, 0.2; dim 4 x 2 bytes -> vec = 8; no optimizer state -> row_bytes = 8
    hist = RowHistogram(rows=np.ones(3, dtype=np.int64), prob=np.array([0.5, 0.3, 0.2]))
    return TableSpec(
        "b", num_rows=3, dim=4, ids_per_sample=1.0, hist=hist, element_bytes=2, optimizer_bytes_per_row=0
    )


VIEW = uniform_view(2, 2, 100.0, 10.0)  # N = 4, zero latency
TABLE = _table_a()
WORKLOAD = Workload("hand", (TABLE,), batch_size_per_gpu=3)  # n = 3


def _plan(hot: int, warm: int, dedup: bool, sync: str = "sparse", view=VIEW) -> Plan:
    return Plan("hand", (table_plan(TABLE, view, hot, warm),), dedup=dedup, sync=sync)


def _rank_bytes(intra: dict, inter: dict) -> np.ndarray:
    """[2 links, 4 components, 2 directions] from {component: (send, recv)} per link class."""
    out = np.zeros((2, 4, 2))
    for li, spec in enumerate((intra, inter)):
        for comp, (send, recv) in spec.items():
            out[li, COMPONENTS.index(comp)] = (send, recv)
    return out


def _assert_every_rank(report, expected_rank: np.ndarray) -> None:
    for r in range(report.traffic.bytes.shape[0]):
        np.testing.assert_allclose(report.traffic.bytes[r], expected_rank, rtol=REL, atol=1e-12)


# --- per-row statistics -------------------------------------------------------------------------


def test_table_mass_dedup_and_touched_literals():
    mass = table_mass(TABLE, 3.0, 4)
    # lookups: n * cumulative p = 3 * (0.4, 0.7, 0.9, 1.0)
    np.testing.assert_allclose(mass.lookups, [0, 1.2, 2.1, 2.7, 3.0], rtol=REL, atol=1e-15)
    # unique: cumulative 0.784, 0.657, 0.488, 0.271
    np.testing.assert_allclose(mass.unique, [0, 0.784, 1.441, 1.929, 2.2], rtol=1e-12)
    # touched: 1 - 0.6^12, 1 - 0.7^12, 1 - 0.8^12 (= 1 - 0.068719476736), 1 - 0.9^12 (= 1 - 0.282429536481)
    per_row = [0.997823217664, 0.986158712799, 0.931280523264, 0.717570463519]
    np.testing.assert_allclose(mass.touched, np.concatenate([[0], np.cumsum(per_row)]), rtol=1e-12)


# --- all cold (row-wise) ------------------------------------------------------------------------


def test_all_cold_no_dedup():
    report = evaluate(WORKLOAD, VIEW, _plan(0, 0, dedup=False))
    # cold volume V = n = 3 lookups. As requester: intra V/4 = 0.75 lookups, inter V/2 = 1.5.
    # As owner: V * 1/4 * (g-1 = 1 peer) = 0.75 intra, V * 1/4 * (N-g = 2) = 1.5 inter.
    # ids: 0.75*8 = 6 intra, 1.5*8 = 12 inter; plus split sizes 1 table * 8 B * (g-1 = 1) = 8 intra,
    #      * (N-g = 2) = 16 inter -> 14 and 28. forward / backward: 0.75*8 = 6, 1.5*8 = 12.
    expected = _rank_bytes(
        {"ids": (14, 14), "forward": (6, 6), "backward": (6, 6)},
        {"ids": (28, 28), "forward": (12, 12), "backward": (12, 12)},
    )
    _assert_every_rank(report, expected)
    # time = (14+6+6)/100 + (28+12+12)/10 = 0.26 + 5.2
    np.testing.assert_allclose(report.time_s, 5.46, rtol=REL)
    assert report.latency_s == 0.0
    # memory: 4 rows * 12 B / 4 ranks, no replicated rows -> no routing metadata
    np.testing.assert_allclose(report.memory_bytes, 12.0, rtol=REL)
    assert report.sync_bytes == 0.0
    assert report.intra_group_bytes == pytest.approx(26.0, rel=REL)
    assert report.inter_group_bytes == pytest.approx(52.0, rel=REL)


def test_all_cold_dedup():
    report = evaluate(WORKLOAD, VIEW, _plan(0, 0, dedup=True))
    # V = 2.2 unique rows; intra asked 0.55 -> 4.4 B per component, inter 1.1 -> 8.8 B
    # ids: 4.4 + 8 = 12.4 intra, 8.8 + 16 = 24.8 inter
    expected = _rank_bytes(
        {"ids": (12.4, 12.4), "forward": (4.4, 4.4), "backward": (4.4, 4.4)},
        {"ids": (24.8, 24.8), "forward": (8.8, 8.8), "backward": (8.8, 8.8)},
    )
    _assert_every_rank(report, expected)
    # (12.4+4.4+4.4)/100 + (24.8+8.8+8.8)/10 = 0.212 + 4.24
    np.testing.assert_allclose(report.time_s, 4.452, rtol=REL)
    np.testing.assert_allclose(report.memory_bytes, 12.0, rtol=REL)


# --- one hot row --------------------------------------------------------------------------------


def test_one_hot_row_sparse_sync_no_dedup():
    report = evaluate(WORKLOAD, VIEW, _plan(1, 0, dedup=False, sync="sparse"))
    # cold V = 3 * (0.3+0.2+0.1) = 1.8: intra asked 0.45 -> 3.6 B, inter 0.9 -> 7.2 B
    # sparse hot payload S = touched(row 0) * vec + 1 row * 1 mask byte
    #   = 0.997823217664 * 8 + 1 = 8.982585741312
    # hierarchical all-reduce: intra 2 (g-1)/g S = S; inter 2 (G-1)/G * S/g = S/2 = 4.491292870656
    expected = _rank_bytes(
        {
            "ids": (3.6 + 8, 3.6 + 8),
            "forward": (3.6, 3.6),
            "backward": (3.6, 3.6),
            "sync": (8.982585741312, 8.982585741312),
        },
        {
            "ids": (7.2 + 16, 7.2 + 16),
            "forward": (7.2, 7.2),
            "backward": (7.2, 7.2),
            "sync": (4.491292870656, 4.491292870656),
        },
    )
    _assert_every_rank(report, expected)
    # (11.6+3.6+3.6+8.982585741312)/100 + (23.2+7.2+7.2+4.491292870656)/10
    #   = 0.27782585741312 + 4.2091292870656
    np.testing.assert_allclose(report.time_s, 4.48695514447872, rtol=1e-12)
    # memory: hot row 12 + 3 cold rows * 12 / 4 = 9 + routing 12 B * 1 replicated row
    np.testing.assert_allclose(report.memory_bytes, 33.0, rtol=REL)
    # sync bytes: intra + inter of the bottleneck rank = 8.982585741312 + 4.491292870656
    assert report.sync_bytes == pytest.approx(13.473878611968, rel=1e-12)


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_half_precision_wire_halves_vectors_not_ids(wire):
    """The case above with vectors sent in 2-byte elements: vec = 2 x 2 = 4 B. ids and split sizes keep
    their bytes; forward and backward halve; the sparse payload S = 0.997823217664 x 4 + 1 mask byte."""
    plan = dataclasses.replace(_plan(1, 0, dedup=False, sync="sparse"), wire=wire)
    report = evaluate(WORKLOAD, VIEW, plan)
    payload = 0.997823217664 * 4 + 1
    expected = _rank_bytes(
        {
            "ids": (3.6 + 8, 3.6 + 8),
            "forward": (1.8, 1.8),
            "backward": (1.8, 1.8),
            "sync": (payload, payload),
        },
        {
            "ids": (7.2 + 16, 7.2 + 16),
            "forward": (3.6, 3.6),
            "backward": (3.6, 3.6),
            "sync": (payload / 2, payload / 2),
        },
    )
    _assert_every_rank(report, expected)
    np.testing.assert_allclose(report.memory_bytes, 33.0, rtol=REL)  # rows stay float32
    # table b is stored in 2-byte elements: never sent wider, so fp32 on the wire costs the same as bf16
    assert _table_b().wire_bytes(WireDtype.FP32) == _table_b().wire_bytes(WireDtype.BF16) == 8
    assert TABLE.wire_bytes(WireDtype.FP32) == 8 and TABLE.wire_bytes(WireDtype.FP16) == 4
    with pytest.raises(ConfigError, match="wiredtype: unknown 'int8'; choose one of fp32, bf16, fp16"):
        dataclasses.replace(plan, wire="int8")


def test_one_hot_row_dense_sync_no_dedup():
    report = evaluate(WORKLOAD, VIEW, _plan(1, 0, dedup=False, sync="dense"))
    # dense payload S = 1 row * 8 B: intra 8, inter 4
    expected = _rank_bytes(
        {"ids": (11.6, 11.6), "forward": (3.6, 3.6), "backward": (3.6, 3.6), "sync": (8, 8)},
        {"ids": (23.2, 23.2), "forward": (7.2, 7.2), "backward": (7.2, 7.2), "sync": (4, 4)},
    )
    _assert_every_rank(report, expected)
    # (18.8+8)/100 + (37.6+4)/10 = 0.268 + 4.16
    np.testing.assert_allclose(report.time_s, 4.428, rtol=REL)
    assert report.sync_bytes == pytest.approx(12.0, rel=REL)
    np.testing.assert_allclose(report.memory_bytes, 33.0, rtol=REL)


def test_one_hot_row_dedup():
    report = evaluate(WORKLOAD, VIEW, _plan(1, 0, dedup=True, sync="dense"))
    # cold V = 0.657 + 0.488 + 0.271 = 1.416: intra asked 0.354 -> 2.832 B; inter 0.708 -> 5.664 B
    expected = _rank_bytes(
        {"ids": (10.832, 10.832), "forward": (2.832, 2.832), "backward": (2.832, 2.832), "sync": (8, 8)},
        {"ids": (21.664, 21.664), "forward": (5.664, 5.664), "backward": (5.664, 5.664), "sync": (4, 4)},
    )
    _assert_every_rank(report, expected)
    # (10.832+2*2.832+8)/100 + (21.664+2*5.664+4)/10 = 0.24496 + 3.6992
    np.testing.assert_allclose(report.time_s, 3.94416, rtol=1e-12)


# --- warm rows ----------------------------------------------------------------------------------


def test_warm_rows_dense_no_dedup():
    report = evaluate(WORKLOAD, VIEW, _plan(0, 2, dedup=False, sync="dense"))
    # warm rows 0,1: V_w = 3 * 0.7 = 2.1, owner share 1/2 in the group: asked from the peer 1.05 -> 8.4 B
    # cold rows 2,3: V_c = 3 * 0.3 = 0.9: intra asked 0.225 -> 1.8 B; inter 0.45 -> 3.6 B
    # split sizes: warm 8 (intra) + cold 8 (intra) + cold 16 (inter)
    # warm sync (dense): payload 2 rows * 8 = 16, a rank holds 1/2 -> 8, ring over G=2 copies:
    #   2 (G-1)/G * 8 = 8 inter-group bytes each way
    expected = _rank_bytes(
        {"ids": (8.4 + 1.8 + 16, 8.4 + 1.8 + 16), "forward": (10.2, 10.2), "backward": (10.2, 10.2)},
        {"ids": (3.6 + 16, 3.6 + 16), "forward": (3.6, 3.6), "backward": (3.6, 3.6), "sync": (8, 8)},
    )
    _assert_every_rank(report, expected)
    # (26.2+10.2+10.2)/100 + (19.6+3.6+3.6+8)/10 = 0.466 + 3.48
    np.testing.assert_allclose(report.time_s, 3.946, rtol=REL)
    # memory: warm 2 rows * 12 / 2 = 12, cold 2 * 12 / 4 = 6, routing 12 * 2 = 24
    np.testing.assert_allclose(report.memory_bytes, 42.0, rtol=REL)
    assert report.sync_bytes == pytest.approx(8.0, rel=REL)


def test_warm_rows_sparse_no_dedup():
    report = evaluate(WORKLOAD, VIEW, _plan(0, 2, dedup=False, sync="sparse"))
    # touched rows 0,1: 0.997823217664 + 0.986158712799 = 1.983981930463
    # vectors = 1.983981930463 * 8 = 15.871855443704; a rank's half: 7.935927721852; ring factor
    # 2 (G-1)/G = 1. The 2 mask bytes (the whole warm tier) are all-reduced over every rank, priced
    # hierarchically: inter 2 (G-1)/G * 2 / g = 1 (total 8.935927721852), intra 2 (g-1)/g * 2 = 2
    sync = report.traffic.bytes[:, LINK_CLASSES.index("inter_group"), COMPONENTS.index("sync")]
    np.testing.assert_allclose(sync, 8.935927721852, rtol=1e-12)
    intra = report.traffic.bytes[:, LINK_CLASSES.index("intra_group"), COMPONENTS.index("sync")]
    np.testing.assert_allclose(intra, 2.0, rtol=1e-12)
    # (46.6 + 2 mask)/100 + (26.8 + 8.935927721852)/10
    np.testing.assert_allclose(report.time_s, 4.0595927721852, rtol=1e-12)


def test_warm_rows_dedup():
    report = evaluate(WORKLOAD, VIEW, _plan(0, 2, dedup=True, sync="dense"))
    # V_w = 0.784 + 0.657 = 1.441 -> asked 0.7205 -> 5.764 B; V_c = 0.488 + 0.271 = 0.759:
    # intra asked 0.18975 -> 1.518 B, inter 0.3795 -> 3.036 B
    expected = _rank_bytes(
        {
            "ids": (5.764 + 1.518 + 16, 5.764 + 1.518 + 16),
            "forward": (7.282, 7.282),
            "backward": (7.282, 7.282),
        },
        {
            "ids": (3.036 + 16, 3.036 + 16),
            "forward": (3.036, 3.036),
            "backward": (3.036, 3.036),
            "sync": (8, 8),
        },
    )
    _assert_every_rank(report, expected)


# --- table-wise (one owner) ---------------------------------------------------------------------


def _table_wise_plan(dedup: bool) -> Plan:
    tp = TablePlan("a", 0, 0, 4, warm_share=np.full(4, 0.5), cold_share=np.array([1.0, 0, 0, 0]))
    return Plan("table_wise", (tp,), dedup=dedup, sync="sparse")


def test_table_wise_owner_rank0_no_dedup():
    report = evaluate(WORKLOAD, VIEW, _table_wise_plan(dedup=False))
    # V = 3. Rank 0 owns everything: it serves 3 lookups to rank 1 (intra) and 3 each to ranks 2, 3
    # (inter, 6). Rank 1 asks 3 intra; ranks 2, 3 ask 3 inter. Splits 8 intra / 16 inter everywhere.
    expected = [
        _rank_bytes(  # rank 0: receives ids and gradients, sends embeddings
            {"ids": (8, 8 + 24), "forward": (24, 0), "backward": (0, 24)},
            {"ids": (16, 16 + 48), "forward": (48, 0), "backward": (0, 48)},
        ),
        _rank_bytes(  # rank 1: requester inside the owner's group
            {"ids": (8 + 24, 8), "forward": (0, 24), "backward": (24, 0)},
            {"ids": (16, 16)},
        ),
        _rank_bytes(  # ranks 2, 3: requesters in the other group
            {"ids": (8, 8)},
            {"ids": (16 + 24, 16), "forward": (0, 24), "backward": (24, 0)},
        ),
    ]
    for r, exp in zip(range(4), (expected[0], expected[1], expected[2], expected[2]), strict=True):
        np.testing.assert_allclose(report.traffic.bytes[r], exp, rtol=REL, atol=1e-12)
    # rank 0: intra max(8+24, 32+24) = 56 -> 0.56; inter max(16+48, 64+48) = 112 -> 11.2
    # rank 1: intra max(32+24, 8+24) = 56 -> 0.56; inter 16 -> 1.6
    # ranks 2,3: intra 8 -> 0.08; inter max(40+24, 16+24) = 64 -> 6.4
    np.testing.assert_allclose(report.time_s, [11.76, 2.16, 6.48, 6.48], rtol=REL)
    assert report.modeled_time_s == pytest.approx(11.76, rel=REL)
    np.testing.assert_allclose(report.memory_bytes, [48.0, 0, 0, 0], rtol=REL)


def test_table_wise_owner_rank0_dedup():
    report = evaluate(WORKLOAD, VIEW, _table_wise_plan(dedup=True))
    # V = 2.2: rank 0 serves 2.2 intra (17.6 B) and 4.4 inter (35.2 B)
    # rank 0: intra recv 8 + 17.6 + 17.6 = 43.2 -> 0.432; inter recv 16 + 35.2 + 35.2 = 86.4 -> 8.64
    assert report.time_s[0] == pytest.approx(9.072, rel=REL)
    rank0 = _rank_bytes(
        {"ids": (8, 8 + 17.6), "forward": (17.6, 0), "backward": (0, 17.6)},
        {"ids": (16, 16 + 35.2), "forward": (35.2, 0), "backward": (0, 35.2)},
    )
    np.testing.assert_allclose(report.traffic.bytes[0], rank0, rtol=REL, atol=1e-12)


# --- latency ------------------------------------------------------------------------------------


def test_latency_terms():
    """The step's collectives (solvers.schedule) priced by the link model of a view without measured
    figures: an all-to-all takes one link latency (a world one crosses the fabric), an all-reduce over k
    ranks 2 ceil(log2 k) of them."""
    view = uniform_view(2, 2, 100.0, 10.0, intra_latency_s=0.5, inter_latency_s=2.0)
    # all cold: ids, rows, grads, world all-to-alls: 3 * 2 = 6
    r = evaluate(WORKLOAD, view, _plan(0, 0, dedup=False, view=view))
    assert r.latency_s == pytest.approx(6.0)
    np.testing.assert_allclose(r.time_s, 5.46, rtol=REL)  # latency is reported, not added
    assert r.time_with_latency_s == pytest.approx(5.46 + 6.0)
    # one hot row, sparse: 6 + the mask's world all-reduce (2 ceil(log2 4) * 2 = 8) + the group
    # reduce-scatter (0.5) + the rail all-reduce (2 ceil(log2 2) * 2 = 4) + the group all-gather (0.5)
    r = evaluate(WORKLOAD, view, _plan(1, 0, dedup=False, sync="sparse", view=view))
    assert r.latency_s == pytest.approx(19.0)
    np.testing.assert_allclose(r.time_s, 4.48695514447872, rtol=1e-12)
    # dense: no mask -> 6 + 0.5 + 4 + 0.5
    r = evaluate(WORKLOAD, view, _plan(1, 0, dedup=False, sync="dense", view=view))
    assert r.latency_s == pytest.approx(11.0)
    np.testing.assert_allclose(r.time_s, 4.428, rtol=REL)
    # warm + cold, sparse: 6 + mask 8 + rail all-reduce 4 (no hot rows: no group stages)
    r = evaluate(WORKLOAD, view, _plan(0, 2, dedup=False, sync="sparse", view=view))
    assert r.latency_s == pytest.approx(18.0)
    r = evaluate(WORKLOAD, view, _plan(0, 2, dedup=False, sync="dense", view=view))
    assert r.latency_s == pytest.approx(10.0)
    # every row hot, dense: the ids all-to-all, headers alone (2), and the hot sync, 0.5 + 4 + 0.5; no
    # split sizes
    r = evaluate(WORKLOAD, view, _plan(4, 0, dedup=False, sync="dense", view=view))
    assert r.latency_s == pytest.approx(7.0)
    assert (r.traffic.bytes[:, :, COMPONENTS.index("ids")] == 0).all()


def test_latency_tree_hops_round_up():
    # G = 3 -> the rail all-reduce takes 2 ceil(log2 3) = 4 inter-group hops
    view = uniform_view(3, 4, 100.0, 10.0, intra_latency_s=0.5, inter_latency_s=2.0)
    r = evaluate(WORKLOAD, view, _plan(4, 0, dedup=False, sync="dense", view=view))
    assert r.latency_s == pytest.approx(2.0 + 0.5 + 4 * 2.0 + 0.5)


# --- group fetch (FetchMode.GROUP) ------------------------------------------------------------------
#
# A requester sends each cold id to the GPU of its group at the owner's position (its rail peer): with
# even shares 1/N the ids at other positions are (g-1)/g of its volume u; the rail peer serves its g-1
# peers u/g each. Across the fabric the rail peer asks, once per group, for the group's distinct rows
# owned at its position in other groups: U (G-1)/N, with U = sum 1 - (1-p)^(g n); as an owner a rank
# serves the G-1 other groups U/N each. Every hop moves idx, then vec back, then vec forward again.
#
# 2 x 2, n = 3: U = sum 1 - (1-p)^6 = (1-0.046656) + (1-0.117649) + (1-0.262144) + (1-0.531441)
#   = 4 - 0.95789 = 3.04211.
# 2 x 4, n = 3: U = sum 1 - (1-p)^12 = 4 - (0.002176782336 + 0.013841287201 + 0.068719476736
#   + 0.282429536481) = 3.632832917246.

U_2X2 = 3.04211
U_2X4 = 3.632832917246


def _group_plan(view, dedup: bool) -> Plan:
    return Plan("hand", (table_plan(TABLE, view, 0, 0, FetchMode.GROUP),), dedup=dedup)


def test_group_fetch_all_cold_2x2_no_dedup():
    # u = n = 3 lookups per GPU. NVLink, per direction: ids 3 * 1/2 * 8 = 12, embeddings 12 (served
    # (g-1) * u/g * vec = 1 * 1.5 * 8), gradients 12; plus the split sizes to the g-1 = 1 peer, 8 B.
    # Fabric: embeddings and gradients U (G-1)/N * 8 = 3.04211 / 4 * 8 = 6.08422 with vec = 8 (once per
    # group); ids, every rank's own lookups owned in the other group, u * 1/2 * 8 = 12 each way (served:
    # u * 1/4 from each of the N - g = 2 ranks there), plus the split sizes to those 2 ranks, 16 B.
    r = evaluate(WORKLOAD, VIEW, _group_plan(VIEW, dedup=False))
    fab = U_2X2 / 4 * 8
    expected = _rank_bytes(
        {"ids": (12 + 8, 12 + 8), "forward": (12, 12), "backward": (12, 12)},
        {"ids": (12 + 16, 12 + 16), "forward": (fab, fab), "backward": (fab, fab)},
    )
    _assert_every_rank(r, expected)
    # time: NVLink (20 + 12 + 12) / 100 + fabric (28 + 2 * 6.08422) / 10
    assert r.modeled_time_s == pytest.approx(44 / 100 + (28 + 2 * fab) / 10, rel=REL)
    # against the flat fetch of the same rows: fabric 3 * 1/2 * 24 + 16 = 52 B per direction
    flat = evaluate(WORKLOAD, VIEW, _plan(0, 0, dedup=False))
    assert flat.inter_group_bytes == pytest.approx(52.0, rel=REL)
    assert r.inter_group_bytes == pytest.approx(28 + 2 * fab, rel=REL) and r.inter_group_bytes < 52.0


def test_group_fetch_all_cold_2x2_dedup():
    # with per-rank dedup u = 2.2 (module docstring): NVLink 2.2 / 2 * 8 = 8.8 per component (+ 8 split
    # bytes on the ids); the fabric's ids are the rank's deduplicated lookups, 8.8 (+ 16 split bytes);
    # its rows are unchanged (the group deduplicates either way)
    r = evaluate(WORKLOAD, VIEW, _group_plan(VIEW, dedup=True))
    fab = U_2X2 / 4 * 8
    expected = _rank_bytes(
        {"ids": (8.8 + 8, 8.8 + 8), "forward": (8.8, 8.8), "backward": (8.8, 8.8)},
        {"ids": (8.8 + 16, 8.8 + 16), "forward": (fab, fab), "backward": (fab, fab)},
    )
    _assert_every_rank(r, expected)


def test_group_fetch_all_cold_2x4_no_dedup():
    # N = 8, G = 2, g = 4, u = 3: NVLink 3 * 3/4 * 8 = 18 per component, split sizes (g-1) * 8 = 24;
    # fabric rows U (G-1)/N * 8 = 3.632832917246 / 8 * 8 = 3.632832917246 per component; ids u * 1/2 * 8
    # = 12 each way (served: u / 8 from each of the N - g = 4 ranks of the other group), split sizes 4 * 8
    view = uniform_view(2, 4, 100.0, 10.0)
    r = evaluate(WORKLOAD, view, _group_plan(view, dedup=False))
    fab = U_2X4
    expected = _rank_bytes(
        {"ids": (18 + 24, 18 + 24), "forward": (18, 18), "backward": (18, 18)},
        {"ids": (12 + 32, 12 + 32), "forward": (fab, fab), "backward": (fab, fab)},
    )
    _assert_every_rank(r, expected)


def test_group_fetch_uneven_shares_2x2():
    # cold shares 0.4, 0.1 (group 0) and 0.3, 0.2 (group 1): position shares S_0 = 0.4 + 0.3 = 0.7,
    # S_1 = 0.1 + 0.2 = 0.3. Rank 0 (position 0, share 0.4), u = 3, vec 8, idx 8:
    #   NVLink asked u (1 - S_0) = 0.9, served (g-1) u S_0 = 2.1
    #     send: ids 0.9 * 8 + 8 = 15.2, forward 2.1 * 8 = 16.8, backward 0.9 * 8 = 7.2
    #     recv: ids 2.1 * 8 + 8 = 24.8, forward 7.2, backward 16.8
    #   fabric rows asked U (S_0 - 0.4) = 0.3 U, served (G-1) U 0.4 = 0.4 U; ids (its group holds
    #   0.4 + 0.1 = 0.5) asked u (1 - 0.5) = 1.5, served (N - g) u 0.4 = 2.4, split sizes to 2 ranks
    #     send: ids 1.5 * 8 + 16 = 28, forward 3.2 U, backward 2.4 U
    #     recv: ids 2.4 * 8 + 16 = 35.2, forward 2.4 U, backward 3.2 U
    shares = np.array([0.4, 0.1, 0.3, 0.2])
    tp = TablePlan("a", 0, 0, 4, np.full(4, 0.5), shares, FetchMode.GROUP)
    r = evaluate(WORKLOAD, VIEW, Plan("hand", (tp,), dedup=False))
    u = U_2X2
    rank0 = _rank_bytes(
        {"ids": (15.2, 24.8), "forward": (16.8, 7.2), "backward": (7.2, 16.8)},
        {"ids": (28, 35.2), "forward": (3.2 * u, 2.4 * u), "backward": (2.4 * u, 3.2 * u)},
    )
    np.testing.assert_allclose(r.traffic.bytes[0], rank0, rtol=1e-5)  # U rounded to 6 digits above
    totals = r.traffic.bytes.sum(axis=0)  # every byte sent is received somewhere
    np.testing.assert_allclose(totals[..., 0], totals[..., 1], rtol=1e-12)


def test_group_fetch_matches_a_monte_carlo_of_the_exchange():
    """The expected bytes against a simulation of the exchange itself: 16 rows of equal probability,
    two per rank (so a rank's share of rows is its share of accesses, as the model assumes); draw every
    GPU's ids, deduplicate per GPU, route each to its rail peer (NVLink) and, owned in the other group,
    as a slot to its owner (the fabric), and count the ids that cross each link."""
    n_gpu, g, big_g, rows, n = 8, 4, 2, 16, 3
    view = uniform_view(big_g, g, 100.0, 10.0)
    table = TableSpec("u", rows, 2, 1.0, RowHistogram(rows=np.array([rows]), prob=np.array([1 / rows])))
    workload = Workload("mc", (table,), batch_size_per_gpu=n)
    owner = np.arange(rows) % n_gpu
    tp = TablePlan("u", 0, 0, rows, np.full(n_gpu, 1 / g), np.full(n_gpu, 1 / n_gpu), FetchMode.GROUP)
    want = evaluate(workload, view, Plan("mc", (tp,), dedup=True)).traffic.bytes
    rng = np.random.default_rng(0)
    trials = 4000
    sent = np.zeros((n_gpu, 2))  # ids sent per rank over NVLink and over the fabric
    for _ in range(trials):
        ids = rng.integers(0, rows, size=(n_gpu, n))
        for grp in range(big_g):
            for r in range(grp * g, (grp + 1) * g):
                for row in np.unique(ids[r]):
                    proxy = grp * g + owner[row] % g  # this group's rank at the owner's position
                    sent[r, 0] += proxy != r
                    sent[r, 1] += owner[row] // g != grp
    got = sent / trials * INDEX_BYTES
    split = np.array([(g - 1) * INDEX_BYTES, (n_gpu - g) * INDEX_BYTES])
    model = want[:, :, COMPONENTS.index("ids"), 0] - split  # ids sent, without the split sizes
    np.testing.assert_allclose(got, model, rtol=0.03)


# --- split sizes, memory, two tables -------------------------------------------------------------


def test_split_bytes_literals():
    # 2 tables, 8 B per table and peer: warm -> (g-1) * 16 intra; cold -> (g-1) * 16 intra + (N-g) * 16 inter
    both, warm, cold = Exchanges(True, True), Exchanges(warm=True), Exchanges(cold_flat=True)
    np.testing.assert_allclose(split_bytes(VIEW, 2, both), np.tile([32.0, 32.0], (4, 1)))
    np.testing.assert_allclose(split_bytes(VIEW, 2, warm), np.tile([16.0, 0.0], (4, 1)))
    np.testing.assert_allclose(split_bytes(VIEW, 2, cold), np.tile([16.0, 32.0], (4, 1)))
    np.testing.assert_allclose(split_bytes(VIEW, 2, Exchanges()), 0.0)
    # 2 x 4 cluster, 1 table, cold: (4-1) * 8 = 24 intra, (8-4) * 8 = 32 inter
    np.testing.assert_allclose(
        split_bytes(uniform_view(2, 4, 1.0, 1.0), 1, cold), np.tile([24.0, 32.0], (8, 1))
    )
    # group fetch, 2 x 4, 1 table: (g-1) * 8 = 24 to the group's peers, (G-1) * 8 = 8 to the rail peers
    np.testing.assert_allclose(
        split_bytes(uniform_view(2, 4, 1.0, 1.0), 1, Exchanges(cold_group=True)),
        np.tile([24.0, 32.0], (8, 1)),
    )


def test_two_tables_memory_and_splits():
    a, b = TABLE, _table_b()
    workload = Workload("two", (a, b), batch_size_per_gpu=3)
    plan = Plan("two", (table_plan(a, VIEW, 1, 2), table_plan(b, VIEW, 0, 1)), dedup=False, sync="dense")
    report = evaluate(workload, VIEW, plan)
    # a: 12 * (1 hot + 2 warm * 1/2 + 1 cold * 1/4) = 27, routing 12 * 3 = 36
    # b: 8 * (1 warm * 1/2 + 2 cold * 1/4) = 8, routing 12 * 1 = 12      -> 83
    np.testing.assert_allclose(report.memory_bytes, 83.0, rtol=REL)
    # a table held whole by one tier needs no routing list: b all warm -> 8 * 3 * 1/2 = 12 B
    whole = Plan("two", (table_plan(a, VIEW, 1, 2), table_plan(b, VIEW, 0, 3)), dedup=False, sync="dense")
    np.testing.assert_allclose(evaluate(workload, VIEW, whole).memory_bytes, 27.0 + 36.0 + 12.0, rtol=REL)
    # splits with 2 tables, warm and cold in use: 32 intra, 32 inter on the ids component.
    # Rest of ids: a: V_w = 3 * 0.5 (rows 1,2) -> asked 0.75 -> 6 B; V_c = 0.3 -> intra 0.075 -> 0.6 B,
    # inter 0.15 -> 1.2 B. b: V_w = 1.5 -> asked 0.75 -> 6 B; V_c = 1.5 -> intra 0.375 -> 3 B, inter 6 B.
    ids = report.traffic.bytes[0, :, COMPONENTS.index("ids"), 0]
    np.testing.assert_allclose(ids, [32 + 6 + 0.6 + 6 + 3, 32 + 1.2 + 6], rtol=1e-12)


# --- invariants ---------------------------------------------------------------------------------


def _random_shares(rng: np.random.Generator, view) -> tuple[np.ndarray, np.ndarray]:
    cold = rng.random(view.num_ranks) + 0.05
    cold /= cold.sum()
    warm = rng.random(view.num_ranks) + 0.05
    for members in view.groups:
        warm[list(members)] /= warm[list(members)].sum()
    return warm, cold


@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (3, 2)])
@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("sync", ["sparse", "dense"])
def test_bytes_sent_equal_bytes_received(shape, dedup, sync):
    rng = np.random.default_rng(7)
    view = uniform_view(*shape, 1e9, 1e8)
    a, b = TABLE, _table_b()
    workload = Workload("two", (a, b), batch_size_per_gpu=5)
    for hot_a, warm_a, hot_b, warm_b in [(0, 0, 0, 0), (1, 2, 0, 1), (0, 3, 2, 0), (2, 0, 1, 1)]:
        wa, ca = _random_shares(rng, view)
        wb, cb = _random_shares(rng, view)
        plan = Plan(
            "random",
            (
                TablePlan("a", hot_a, warm_a, 4 - hot_a - warm_a, wa, ca),
                TablePlan("b", hot_b, warm_b, 3 - hot_b - warm_b, wb, cb),
            ),
            dedup=dedup,
            sync=sync,
        )
        report = evaluate(workload, view, plan)
        totals = report.traffic.bytes.sum(axis=0)  # [link, component, direction] over the cluster
        np.testing.assert_allclose(totals[..., 0], totals[..., 1], rtol=1e-12, atol=1e-12)
        assert (report.traffic.bytes >= 0).all()


@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (4, 2)])
def test_uniform_shares_every_rank_identical(shape):
    view = uniform_view(*shape, 1e9, 1e8, 1e-6, 5e-6)
    workload = Workload("two", (TABLE, _table_b()), batch_size_per_gpu=5)
    for hot_a, warm_a, hot_b, warm_b in [(0, 0, 0, 0), (1, 2, 0, 1), (0, 3, 2, 0), (4, 0, 3, 0)]:
        for dedup in (False, True):
            plan = Plan(
                "u",
                (table_plan(TABLE, view, hot_a, warm_a), table_plan(_table_b(), view, hot_b, warm_b)),
                dedup=dedup,
            )
            report = evaluate(workload, view, plan)
            np.testing.assert_allclose(
                report.traffic.bytes, np.broadcast_to(report.traffic.bytes[0], report.traffic.bytes.shape)
            )
            np.testing.assert_allclose(report.traffic.bytes[..., 0], report.traffic.bytes[..., 1], rtol=1e-12)
            np.testing.assert_allclose(report.time_s, report.time_s[0], rtol=1e-12)
            np.testing.assert_allclose(report.memory_bytes, report.memory_bytes[0], rtol=1e-12)


def test_bad_plans_rejected():
    with pytest.raises(ConfigError, match="sync: unknown 'lazy'"):
        _plan(0, 0, dedup=False, sync="lazy")  # a plan cannot even be made with an unknown mode
    bad = TablePlan("a", 1, 1, 1, np.full(4, 0.5), np.full(4, 0.25))  # 3 rows of 4
    with pytest.raises(PlannerError, match="do not cover"):
        evaluate(WORKLOAD, VIEW, Plan("bad", (bad,), dedup=False))
    bad = TablePlan("a", 0, 0, 4, np.full(4, 0.5), np.full(4, 0.2))
    with pytest.raises(PlannerError, match="cold_share"):
        evaluate(WORKLOAD, VIEW, Plan("bad", (bad,), dedup=False))
