"""flexshard.runtime.op_count: every aten op dispatched inside the block is counted once (views and the
autograd backward's too), nothing outside it, and the values pass through unchanged."""

from __future__ import annotations

import torch

from flexshard.runtime.op_count import OpCount


def test_each_op_inside_the_block_is_counted_once():
    x = torch.arange(6, dtype=torch.float32)
    with OpCount() as one:
        y = x.add(1.0)
    with OpCount() as three:
        z = x.add(1.0).mul(2.0).view(2, 3)  # a view is an op too
    assert (one.ops, three.ops) == (1, 3)
    assert torch.equal(y, x + 1) and torch.equal(z, ((x + 1) * 2).view(2, 3))
    x.add(1.0)  # outside: not counted
    assert one.ops == 1


def test_the_backward_is_counted_where_it_runs():
    w = torch.ones(4, requires_grad=True)
    loss = (w * 3.0).sum()
    with OpCount() as backward:
        loss.backward()
    assert backward.ops > 0 and torch.equal(w.grad, torch.full((4,), 3.0))
