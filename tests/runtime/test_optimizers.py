"""The row optimizers (flexshard.runtime.optimizers) on one Shard: each equals a reference.

SGD and both Adagrads against fbgemm's own CPU kernels (SplitTableBatchedEmbeddingBagsCodegen with
EXACT_SGD / EXACT_ROWWISE_ADAGRAD / EXACT_ADAGRAD, the arithmetic TorchRec's fused optimizers run), Adam
(fbgemm has no CPU kernel for it) against torch.optim.Adam on the touched rows with the module's step
count, and hand-computed figures for what the step count means.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.errors import ConfigError
from flexshard.runtime import OPTIMIZERS, Hyper, Shard, row_optimizer
from flexshard.runtime.optimizers import ALIASES, FBGEMM_NAMES, canonical, state_bytes_per_row

ROWS, DIM, STEPS = 12, 8, 4
HYPER = Hyper(lr=0.05, eps=1e-8, beta1=0.9, beta2=0.999)


def _batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: looked-up ids (repeats included, some rows never or only later) and their gradients."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, ROWS - 2 + step // 2, (10,), generator=gen)  # rows 10, 11 join late
        ids[0] = ids[1]  # a repeated id: its gradients add up
        out.append((ids, torch.randn(ids.numel(), DIM, generator=gen)))
    return out


def _initial(seed: int = 1) -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))


def _run_shard(name: str, batches) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Our Shard through ``batches``: weights and states after every step."""
    opt = row_optimizer(name)
    shard = Shard.of(np.arange(ROWS), _initial().clone(), opt)
    out = []
    for step, (ids, grads) in enumerate(batches, start=1):
        shard.add_gradient(ids, grads)
        shard.apply(opt, HYPER, step)
        out.append((shard.weights.clone(), {n: s.clone() for n, s in shard.states.items()}))
    return out


def _fbgemm_tbe(optim: str):
    tbe_mod = pytest.importorskip(
        "fbgemm_gpu.split_table_batched_embeddings_ops_training",
        reason="fbgemm_gpu (TorchRec's extra) not installed",
    )
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode

    return tbe_mod.SplitTableBatchedEmbeddingBagsCodegen(
        [(ROWS, DIM, EmbeddingLocation.HOST, tbe_mod.ComputeDevice.CPU)],
        optimizer=getattr(EmbOptimType, optim),
        learning_rate=HYPER.lr,
        eps=HYPER.eps,
        pooling_mode=PoolingMode.NONE,
    )


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "elementwise_adagrad"])
def test_equals_fbgemm_cpu_kernel(name):
    opt = row_optimizer(name)
    tbe = _fbgemm_tbe(opt.fbgemm)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(_initial())
    batches = _batches()
    ours = _run_shard(name, batches)
    for step, (ids, grads) in enumerate(batches):
        out = tbe(ids, torch.arange(ids.numel() + 1))  # one id per bag: one output row per lookup
        out.backward(grads)
        w_ref = tbe.split_embedding_weights()[0]
        w, states = ours[step]
        torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=1e-7, msg=f"{name} step {step + 1}")
        ref_states = (
            [s.reshape(ROWS, -1).squeeze(1) for s in tbe.split_optimizer_states()[0]] if states else []
        )
        for (n, s), ref in zip(states.items(), ref_states, strict=True):
            torch.testing.assert_close(s, ref, rtol=2e-6, atol=1e-7, msg=f"{name} {n} step {step + 1}")
    assert not torch.equal(ours[-1][0], _initial())  # the rows did move


def test_adam_equals_torch_adam_on_touched_rows():
    """fbgemm's Adam (GPU only) is torch's Adam on the rows of the batch, with t the module's iteration:
    each step, torch.optim.Adam runs on the touched rows with their moments and state step t - 1."""
    batches = _batches()
    ours = _run_shard("adam", batches)
    w, m, v = _initial().clone(), torch.zeros(ROWS, DIM), torch.zeros(ROWS, DIM)
    for t, (ids, grads) in enumerate(batches, start=1):
        g = torch.zeros(ROWS, DIM).index_add_(0, ids, grads)
        rows = torch.unique(ids)
        p = torch.nn.Parameter(w[rows].clone())
        adam = torch.optim.Adam(
            [p], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps, foreach=False
        )
        adam.state[p] = {
            "step": torch.tensor(float(t - 1)),
            "exp_avg": m[rows].clone(),
            "exp_avg_sq": v[rows].clone(),
        }
        p.grad = g[rows]
        adam.step()
        w[rows], m[rows], v[rows] = p.detach(), adam.state[p]["exp_avg"], adam.state[p]["exp_avg_sq"]
        got_w, got = ours[t - 1]
        torch.testing.assert_close(got_w, w, rtol=1e-5, atol=1e-6, msg=f"adam weights step {t}")
        torch.testing.assert_close(got["momentum1"], m, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["momentum2"], v, rtol=1e-6, atol=1e-8)
    untouched = sorted(set(range(ROWS)) - {int(i) for ids, _ in batches for i in ids})
    assert untouched and torch.equal(ours[-1][0][untouched], _initial()[untouched])  # never moved


def test_adam_step_is_the_module_iteration_not_the_row_count():
    """Hand-computed: a row first touched at step 2 uses t = 2. With gradient g (any sign, |g| >> eps):
    m = 0.1 g, v = 0.001 g^2, m / (1 - 0.9^2) = 0.1 g / 0.19, v / (1 - 0.999^2) = 0.001 g^2 / 0.001999,
    so the row moves by lr * (0.1 / 0.19) / sqrt(0.001 / 0.001999) = 0.74413 lr against g; at t = 1 it
    moves by lr (1 / (1 + eps / |g|))."""
    opt = row_optimizer("adam")
    shard = Shard.of(np.arange(2), torch.zeros(2, 4), opt)
    g = torch.tensor([[2.0, -3.0, 0.5, 1.0]])
    shard.add_gradient(torch.tensor([0]), g)
    shard.apply(opt, HYPER, 1)  # row 0 at t = 1
    torch.testing.assert_close(shard.weights[0], -HYPER.lr * g[0].sign(), rtol=2e-5, atol=0)  # fp32
    w0 = shard.weights[0].clone()
    shard.add_gradient(torch.tensor([1]), g)
    shard.apply(opt, HYPER, 2)  # row 1's first update, at t = 2
    want = (0.1 / 0.19) / np.sqrt(0.001 / 0.001999)
    assert abs(want - 0.74413) < 1e-5
    torch.testing.assert_close(shard.weights[1], -HYPER.lr * want * g[0].sign(), rtol=2e-5, atol=0)
    # row 0, not in step 2's batch, keeps its moment (no decay) and its weights
    assert shard.states["momentum1"][0].tolist() == pytest.approx((0.1 * g[0]).tolist(), rel=1e-6)
    assert torch.equal(shard.weights[0], w0)


def test_rowwise_adagrad_hand_computed():
    """g = [3, 4]: momentum1 = (9 + 16) / 2 = 12.5; the row moves by g * lr / (sqrt(12.5) + eps)."""
    opt = row_optimizer("adagrad")  # the alias: today's row-wise Adagrad
    shard = Shard.of(np.arange(1), torch.ones(1, 2), opt)
    shard.add_gradient(torch.tensor([0]), torch.tensor([[3.0, 4.0]]))
    shard.apply(opt, Hyper(lr=0.5, eps=0.0), 1)
    assert shard.states["momentum1"].tolist() == [12.5]
    torch.testing.assert_close(shard.weights[0], 1 - torch.tensor([3.0, 4.0]) * 0.5 / 12.5**0.5)


def test_names_state_shapes_and_bytes():
    assert OPTIMIZERS == ("sgd", "rowwise_adagrad", "elementwise_adagrad", "adam")
    assert ALIASES == {"adagrad": "rowwise_adagrad"} and canonical("adagrad") == "rowwise_adagrad"
    assert [row_optimizer(n).fbgemm for n in OPTIMIZERS] == [
        "EXACT_SGD",
        "EXACT_ROWWISE_ADAGRAD",
        "EXACT_ADAGRAD",
        "ADAM",
    ]
    assert FBGEMM_NAMES == {
        "EXACT_SGD": "sgd",
        "EXACT_ROWWISE_ADAGRAD": "rowwise_adagrad",
        "EXACT_ADAGRAD": "elementwise_adagrad",
        "ADAM": "adam",
    }
    assert row_optimizer("adam").state_shapes(16) == {"momentum1": (16,), "momentum2": (16,)}
    assert row_optimizer("rowwise_adagrad").state_shapes(16) == {"momentum1": ()}
    assert [state_bytes_per_row(n, 16) for n in OPTIMIZERS] == [0, 4, 64, 128]
    shard = Shard.of(np.arange(3), torch.zeros(3, 16), row_optimizer("adam"))
    assert {n: tuple(s.shape) for n, s in shard.states.items()} == {
        "momentum1": (3, 16),
        "momentum2": (3, 16),
    }
    with pytest.raises(ConfigError, match=r"^optimizer: must be one of sgd, rowwise_adagrad, .*got 'lamb'$"):
        canonical("lamb")
    assert Hyper(lr=0.1, beta1=1.0).problem() == "beta1: must be in [0, 1), got 1.0"
    assert Hyper(lr=float("nan")).problem() == "lr: must be a finite number >= 0, got nan"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_verify_condition_bounds_the_update_to_first_order(name):
    """--verify's allowance per optimizer (reference.update_scales): moving each gradient element g_d by
    at most a_d moves every updated weight and state by at most its scale x the step (finite differences
    in float64, 20 sign patterns), and for the element-wise optimizers the bound is nearly reached
    somewhere (it is not vacuous)."""
    from flexshard.training.reference import pack, unpack, update_scales

    opt = row_optimizer(name)
    gen = torch.Generator().manual_seed(3)
    rows, dim, t = 6, 4, 3
    w = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    before = {n: s.double().abs() + 0.1 for n, s in opt.new_states(rows, dim, "cpu").items()}
    g = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    a = torch.rand(rows, dim, generator=gen, dtype=torch.float64) + 0.1
    w1, after = opt.update(w, before, g, HYPER, t)
    w_scale, s_scale = update_scales(opt, g, a, after, HYPER, t)
    h = 1e-6
    for sign_seed in range(20):
        signs = torch.randint(0, 2, (rows, dim), generator=torch.Generator().manual_seed(sign_seed)) * 2 - 1
        w2, after2 = opt.update(w, before, g + h * signs * a, HYPER, t)
        assert ((w2 - w1).abs() <= h * w_scale * (1 + 1e-4) + 1e-15).all()
        moved = (pack(opt, after2, rows) - pack(opt, after, rows)).abs()
        assert (moved <= h * s_scale * (1 + 1e-4) + 1e-15).all()
    if name == "rowwise_adagrad":
        return  # its weights' condition sums the whole row's effect on the accumulator: checked above
    # each weight depends on its own gradient element only: the bound adds its terms' magnitudes (they
    # may cancel), so it is reached where one term dominates
    w2, _ = opt.update(w, before, g + h * a, HYPER, t)
    assert ((w2 - w1).abs() / (h * w_scale)).max() > 0.9
    assert unpack(opt, pack(opt, after, rows), dim).keys() == after.keys()
