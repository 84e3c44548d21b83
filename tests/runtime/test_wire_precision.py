"""Embeddings and gradients in bf16 / fp16 on the wire, on real multi-process gloo runs (4 ranks as 2 groups
of 2; every table's cold rows fetched per group, and a mix of group and flat tables): exchanged rows
arrive rounded exactly once and hot rows untouched, bytes are the independent routing's at 2 bytes per
element, replicas stay bitwise equal, training stays within the ``--verify`` tolerance of the float32
reference; and the hierarchical all-reduce in bf16 equals a step-by-step emulation, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from runtime_workers import (
    COLD_SHARE_4,
    FETCH_VARIANTS,
    SEED,
    TABLES,
    WARM_SHARE_4,
    _train,
    expected_traffic,
    make_orders,
    owners,
    random_batch,
    run_function,
    with_fetch,
    write_test_plan,
)
from training_reference import full_weights, reference_training

from core.errors import ConfigError
from core.ranks import RankLayout
from core.vocabulary import WireDtype
from flexshard.plan_file import read_plan
from flexshard.runtime import ShardedSequenceEmbedding, make_process_groups
from flexshard.runtime.replicas import hierarchical_all_reduce
from flexshard.training.verify import allowed_difference, normwise, tolerance

pytestmark = pytest.mark.slow  # multi-process: spawns gloo ranks

HALF = {WireDtype.BF16: torch.bfloat16, WireDtype.FP16: torch.float16}


def _wire_runs(rank: int, world: int, plan_path: str) -> dict:
    """Per fetch variant and wire dtype: a forward pass (dedup on), and 3 steps of SGD and Adagrad."""
    base = read_plan(plan_path)
    orders = make_orders()
    res = {}
    for variant, fetch in FETCH_VARIANTS.items():
        for wire in (WireDtype.BF16, WireDtype.FP16):
            pf = with_fetch(base, fetch).with_overrides(wire=wire)
            out = {"train": {}}
            model = ShardedSequenceEmbedding(pf, TABLES, orders, init=SEED, wire_dtype=wire)
            with torch.no_grad():
                out["forward"] = {n: o.clone() for n, o in model(random_batch(SEED, 99, rank)).items()}
            for opt in ("sgd", "adagrad"):
                model = ShardedSequenceEmbedding(pf, TABLES, orders, init=SEED, optimizer=opt, lr=0.05)
                traffic = _train(model, world, rank, 3, SEED)
                out["train"][opt] = {"rows": model.shard_rows(), "traffic": traffic}
            res[(variant, wire)] = out
    try:  # a wire dtype other than the plan's is refused on every rank
        ShardedSequenceEmbedding(base, TABLES, orders, init=SEED, wire_dtype="bf16")
        res["refused"] = None
    except ConfigError as e:
        res["refused"] = str(e)
    return res


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    d = tmp_path_factory.mktemp("wire")
    plan = write_test_plan(d / "plan.json", 2, 2, COLD_SHARE_4, WARM_SHARE_4)
    return read_plan(plan), run_function(_wire_runs, 4, str(plan), timeout_s=300.0)


CASES = [(v, w) for v in FETCH_VARIANTS for w in (WireDtype.BF16, WireDtype.FP16)]


@pytest.mark.parametrize(("variant", "wire"), CASES, ids=[f"{v}-{w}" for v, w in CASES])
def test_exchanged_rows_arrive_rounded_once_and_hot_rows_exact(four, variant, wire):
    plan_file, results = four
    routes = owners(with_fetch(plan_file, FETCH_VARIANTS[variant]), make_orders())
    w = full_weights()
    for r, res in enumerate(results):
        feats = random_batch(SEED, 99, r)
        for name, _rows, _dim in TABLES:
            ids = feats[name][0]
            hot = torch.from_numpy(routes[name][0] == 0)[ids]
            want = torch.where(hot[:, None], w[name][ids], w[name][ids].to(HALF[wire]).float())
            got = res[(variant, wire)]["forward"][name]
            assert torch.equal(got, want), (r, name)
            assert not torch.equal(got, w[name][ids])  # something was rounded


@pytest.mark.parametrize(("variant", "wire"), CASES, ids=[f"{v}-{w}" for v, w in CASES])
def test_bytes_are_the_routing_at_two_bytes_per_element(four, variant, wire):
    plan_file, results = four
    pf = with_fetch(plan_file, FETCH_VARIANTS[variant])
    for step in range(3):
        batches = [random_batch(SEED, step, r) for r in range(4)]
        want = expected_traffic(pf, batches, dedup=True, element_bytes=2)
        got = np.stack([res[(variant, wire)]["train"]["sgd"]["traffic"][step] for res in results])
        np.testing.assert_array_equal(got[:, :, :3, :], want[:, :, :3, :])  # lookups: whole bytes
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
        full = expected_traffic(pf, batches, dedup=True)
        assert got[:, :, 0, :].sum() == full[:, :, 0, :].sum()  # ids and split sizes as in float32
        np.testing.assert_allclose(got[:, :, 1:3, :].sum(), full[:, :, 1:3, :].sum() / 2)


@pytest.mark.parametrize(("variant", "wire"), CASES, ids=[f"{v}-{w}" for v, w in CASES])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_training_keeps_replicas_equal_and_stays_within_the_verify_tolerance(four, variant, wire, optimizer):
    plan_file, results = four
    runs = [res[(variant, wire)]["train"][optimizer]["rows"] for res in results]
    positions = {r: p for members in plan_file.groups for p, r in enumerate(members)}
    for r, rows in enumerate(runs):  # hot on every rank, warm on the ranks at the same position
        for (name, tier), (ids, w, s) in rows.items():
            peers = range(4) if tier == "hot" else [q for q in range(4) if positions[q] == positions[r]]
            if tier != "cold":
                for q in peers:
                    ids_q, w_q, s_q = runs[q][(name, tier)]
                    assert np.array_equal(ids, ids_q) and torch.equal(w, w_q)
                    assert s.keys() == s_q.keys() and all(torch.equal(s[k], s_q[k]) for k in s)
    ref_w, ref_s = reference_training(4, 3, optimizer)
    start = full_weights()
    rounded = False
    for name, _rows, _dim in TABLES:
        ref_state = ref_s[name].get("momentum1", torch.zeros(ref_w[name].shape[0]))  # row-wise Adagrad's
        got_w, got_s = ref_w[name].clone(), ref_state.clone()
        for rows in runs:
            for (table, _tier), (ids, w, s) in rows.items():
                if table == name:
                    idx = torch.as_tensor(ids)
                    got_w[idx], got_s[idx] = w, s.get("momentum1", torch.zeros(idx.numel()))
        for got, want, base in ((got_w, ref_w[name], start[name]), (got_s, ref_state, None)):
            if base is None and optimizer == "sgd":
                continue
            base = base if base is not None else torch.zeros_like(want)
            diff, size = normwise(got - base, want - base)  # relative to the update over the 3 steps
            assert diff <= allowed_difference(tolerance(wire), size, float(want.norm())), (name, diff, size)
        rounded |= not torch.equal(got_w, ref_w[name])
    assert rounded  # the gradients did travel rounded


def test_a_wire_dtype_other_than_the_plans_is_refused(four):
    _plan, results = four
    assert {res["refused"] for res in results} == {
        "wire_dtype: bf16 differs from the plan's settings.wire fp32; make the plan with --wire-dtype bf16, "
        "or run it with PlanFile.with_overrides(wire='bf16')"
    }


# --- the hot rows' hierarchical all-reduce in half precision ------------------------------------------


def _half_all_reduce(rank: int, world: int) -> dict:
    out = {}
    for groups in (2, 3):
        for wire in HALF:
            reduce = hierarchical_all_reduce(make_process_groups(RankLayout.consecutive(world, groups)), wire)
            gen = torch.Generator().manual_seed(rank)
            for n in (1, 7, 1000):
                x = torch.randn(n, generator=gen)
                y = x.clone()
                reduce(y, dist.ReduceOp.SUM)
                out[(groups, wire, n)] = (x, y)
    return out


def _slices(n: int, k: int) -> list[int]:
    return [n // k + (1 if p < n % k else 0) for p in range(k)]


def _emulate(given: torch.Tensor, groups: int, half: torch.dtype) -> torch.Tensor:
    """The three stages written out: each group sums its ranks' rounded slices in float32 (group order);
    the ranks at one position split that slice across the groups, each sums the groups' rounded pieces
    (group order) and rounds the sum; everyone gets the rounded pieces."""
    world, n = given.shape
    g = world // groups
    sizes = _slices(n, g)
    bounds = np.cumsum([0, *sizes])
    result = torch.empty(n)
    for p in range(g):
        lo, hi = bounds[p], bounds[p + 1]
        parts = []
        for k in range(groups):
            part = given[k * g, lo:hi].to(half).float()
            for q in range(1, g):
                part = part + given[k * g + q, lo:hi].to(half).float()
            parts.append(part)
        pieces = np.cumsum([0, *_slices(hi - lo, groups)])
        for k in range(groups):
            a, b = pieces[k], pieces[k + 1]
            total = parts[0][a:b].to(half).float()
            for j in range(1, groups):
                total = total + parts[j][a:b].to(half).float()
            result[lo + a : lo + b] = total.to(half).float()
    return result


def test_half_precision_all_reduce_equals_its_emulation_on_every_rank():
    results = run_function(_half_all_reduce, 6)
    for groups, wire, n in results[0]:
        given = torch.stack([res[(groups, wire, n)][0] for res in results])
        got = [res[(groups, wire, n)][1] for res in results]
        want = _emulate(given, groups, HALF[wire])
        for r in range(6):
            assert torch.equal(got[r], want), (groups, wire, n, r)
        exact = given.double().sum(dim=0)
        assert float((want.double() - exact).abs().max()) <= 4 * 2.0**-8 * float(given.abs().sum(0).max())


# --- fp16: gradients scaled out of the subnormal range ------------------------------------------------


def _tiny_gradients(rank: int, world: int) -> dict:
    """Gradients of about 1e-7 sent over fp16 to the other rank, with and without the sender's scale."""
    from flexshard.runtime.transfer import exchange_vectors, gradient_exponent

    gen = torch.Generator().manual_seed(rank)
    grads = torch.randn(64, 4, generator=gen) * 1e-7 * (rank + 1)
    counts = np.array([[0], [64]] if rank == 0 else [[64], [0]])  # each sends the other 64 rows
    out = {"exponent": gradient_exponent([grads]), "sent": grads}
    for scaled in (False, True):
        pending = exchange_vectors("", [grads], counts, counts, np.array([4]), WireDtype.FP16, scaled=scaled)
        (out[scaled],) = pending.wait()
    return out


def test_fp16_gradients_are_scaled_by_a_power_of_two_out_of_the_subnormals():
    """Each sender picks its own power of two (no collective) and sends the exponent with the rows."""
    results = run_function(_tiny_gradients, 2)
    for res in results:  # by hand: the sender's own largest |g| times 2^e just under 2^14
        largest = float(res["sent"].abs().max())
        assert res["exponent"] == np.floor(np.log2(2.0**14 / largest))
    assert results[0]["exponent"] != results[1]["exponent"]  # rank 1 sends twice as large gradients
    for r, res in enumerate(results):
        want = results[1 - r]["sent"]
        scaled = float(((res[True] - want).abs() / want.abs()).max())
        plain = float(((res[False] - want).abs() / want.abs()).max())
        assert scaled <= 2.0**-11  # fp16's unit roundoff: full precision
        assert plain > 2.0**-6  # unscaled, 1e-7 is subnormal in fp16 and loses most of its bits
