"""The benchmark's loss as one autograd node equals autograd's chain of ``0.5 * v.pow(2).sum()``."""

import pytest
import torch

from flexshard.bench.systems import _loss
from flexshard.local_rates import HalfSquareSum


def _chain(values: list[torch.Tensor]) -> torch.Tensor:
    return sum(0.5 * v.pow(2).sum() for v in values)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e3, 1e-19])
@pytest.mark.parametrize("upstream", [1.0, 3.7, -0.1])
def test_half_square_sum_equals_the_autograd_chain_bit_for_bit(scale, upstream):
    gen = torch.Generator().manual_seed(7)
    values = [torch.randn(n, 64, generator=gen) * scale for n in (1200, 333, 1, 0)]
    a = [v.clone().requires_grad_() for v in values]
    b = [v.clone().requires_grad_() for v in values]
    want, got = _chain(a), HalfSquareSum.apply(*b)
    assert torch.equal(want, got)
    (want * upstream).backward()
    (got * upstream).backward()
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.grad, y.grad)
    assert not torch.equal(b[0].grad, torch.zeros_like(b[0]))  # the gradient is not trivially equal


def test_bench_loss_is_the_one_node_and_its_gradient_is_the_value():
    v = torch.tensor([[1.5, -2.0], [0.25, 3.0]], requires_grad=True)
    loss = _loss([v])
    assert loss.item() == 0.5 * (1.5**2 + 2.0**2 + 0.25**2 + 3.0**2)
    assert type(loss.grad_fn).__name__ == "HalfSquareSumBackward"
    loss.backward()
    assert torch.equal(v.grad, v.detach())
