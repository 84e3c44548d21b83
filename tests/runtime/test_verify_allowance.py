"""``--verify``'s allowance for a table's update: the first-order condition of the update in the terms of
the gradient's sums, checked against sums written out and against the Jacobian by autograd."""

from __future__ import annotations

import pytest
import torch

from core.vocabulary import WireDtype
from flexshard.training.reference import _abs_sums, _adagrad_scales
from flexshard.training.verify import TOLERANCE_UNITS, UNIT_ROUNDOFF, allowed_difference, update_allowance


def test_abs_sums_add_each_lookups_magnitude_to_its_row_and_count_the_terms():
    rows = torch.tensor([0, 2, 5])  # sorted, as the reference's touched rows
    terms = [
        (torch.tensor([0, 2, 0]), torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])),
        (torch.tensor([5, 0]), torch.tensor([[0.5, 0.25], [1.0, 1.0]])),  # a second rank's batch
    ]
    a, k = _abs_sums(terms, rows, torch.zeros(3, 2))
    assert a.tolist() == [[7.0, 9.0], [3.0, 4.0], [0.5, 0.25]]
    assert k.tolist() == [3.0, 1.0, 1.0]


def test_a_cancelling_sum_gets_the_allowance_of_its_terms_not_of_its_result():
    """+1 and -(1 - 2^-10) sum to 2^-10: one term one ulp off (2 unit roundoffs, as another summation order
    may leave it) moves the result by 2^-23, 2^13 of the result's own size."""
    terms = [(torch.tensor([0, 0]), torch.tensor([[1.0], [1.0 - 2.0**-10]]))]
    g = torch.tensor([[2.0**-10]])
    a, k = _abs_sums(terms, torch.tensor([0]), g)
    assert float(a) == 2.0 - 2.0**-10 and k.tolist() == [2.0]
    sgd_scale = 0.1 * a  # the reference's SGD weights scale: lr x a
    one_order = torch.tensor(1.0, dtype=torch.float64) - torch.tensor(1.0 - 2.0**-10, dtype=torch.float64)
    other = (torch.tensor(1.0) + 2.0**-23) - torch.tensor(1.0 - 2.0**-10)  # one ulp off
    diff = 0.1 * abs(float(other) - float(one_order))
    tol = TOLERANCE_UNITS * UNIT_ROUNDOFF[WireDtype.FP32]
    assert diff > allowed_difference(tol, 0.1 * float(g))  # the result's norm: a false failure
    assert diff <= update_allowance(tol, sgd_scale, k, 0.0)[0]


def test_update_allowance_is_the_wires_tolerance_plus_float32_order_over_sqrt_terms():
    """Hand-computed: rows of 4 and 9 terms with condition [[3, 4], [0, 0.5]] (norm 5.0249), value norm
    2: bf16 tolerance x 5.0249 + 16 x 2^-24 x ||[[6, 8], [0, 1.5]]|| + 2 x 2^-24 x 2."""
    scale, k = torch.tensor([[3.0, 4.0], [0.0, 0.5]]), torch.tensor([4.0, 9.0])
    tol = TOLERANCE_UNITS * UNIT_ROUNDOFF[WireDtype.BF16]
    allowed, size = update_allowance(tol, scale, k, 2.0)
    assert size == pytest.approx(25.25**0.5, rel=1e-12)
    order = (36 + 64 + 2.25) ** 0.5
    assert allowed == pytest.approx(tol * size + 16 * 2.0**-24 * order + 2 * 2.0**-24 * 2.0, rel=1e-12)
    _, state_size = update_allowance(tol, torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]), 0.0)
    assert state_size == pytest.approx(5**0.5, rel=1e-12)  # a [rows] scale (the accumulator) too


def test_adagrad_scales_bound_the_jacobian_applied_to_the_term_magnitudes():
    """state: exactly sum_e |d mean(g^2) / d g_e| a_e; weights: at least sum_e |d dw_d / d g_e| a_e (the
    Jacobian of ``-lr g / (sqrt(s0 + mean(g^2)) + eps)``), and above it by no more than the diagonal's
    two parts taken apart (the triangle inequality)."""
    gen = torch.Generator().manual_seed(3)
    lr, eps, dim = 0.05, 1e-8, 6
    for s0 in (0.0, 0.3):
        g = torch.randn(dim, dtype=torch.float64, generator=gen)
        a = g.abs() + torch.rand(dim, dtype=torch.float64, generator=gen) * 3  # >= |g|

        def state_update(x: torch.Tensor) -> torch.Tensor:
            return x.pow(2).mean().reshape(1)

        def weights_update(x: torch.Tensor, s0: float = s0) -> torch.Tensor:
            return -lr * x / ((s0 + x.pow(2).mean()).sqrt() + eps)

        j_state = torch.autograd.functional.jacobian(state_update, g)  # [1, dim]
        j_weights = torch.autograd.functional.jacobian(weights_update, g)  # [dim, dim]
        s = s0 + g.pow(2).mean()
        w_scale, s_scale = _adagrad_scales(g[None], a[None], s.reshape(1), lr, eps)
        torch.testing.assert_close(s_scale, j_state.abs() @ a, rtol=1e-12, atol=0)
        exact = j_weights.abs() @ a
        rho, root = s.sqrt() + eps, s.sqrt()
        slack = 2 * lr * g.pow(2) * a / (rho**2 * root * dim)
        assert (w_scale[0] >= exact * (1 - 1e-12)).all()
        assert (w_scale[0] <= exact + slack + 1e-15).all()


def test_a_row_whose_gradient_is_zero_moves_by_nothing():
    """A row looked up only where its gradient is exactly zero, accumulator 0 (float32, as the reference
    keeps it): both scales 0. They were NaN on a GPU (0 / 0 under the tiny clamp), and so the allowance."""
    g, a, s = torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2)
    g[1], a[1], s[1] = 0.5, 1.0, 0.25
    w_scale, s_scale = _adagrad_scales(g, a, s, 0.05, 1e-8)
    assert torch.isfinite(w_scale).all() and torch.isfinite(s_scale).all()
    assert w_scale[0].tolist() == [0.0] * 4 and float(s_scale[0]) == 0.0
    assert float(s_scale[1]) == 1.0  # (2 / 4) x 4 x 0.5 x 1
