"""The order the benchmark runs its strategies in, round by round: a Williams design.

A strategy's first steps after a switch pay for what the previous strategy left behind (its caches, its heap),
so the order is balanced for that as well as for position: over the rounds :func:`williams_orders` gives,
every strategy runs once at every position and follows every other strategy equally often (once for an even
number of strategies, twice for an odd number, over twice the rounds). The rotation it replaces (A B C D, B C
D A, ...) put each strategy after the same one in every round.
"""

from __future__ import annotations


def williams_orders(n: int) -> list[list[int]]:
    """The rounds of a Williams design for ``n`` strategies (indices ``0..n-1``), each a permutation:
    ``n`` rounds for even ``n``, ``2n`` for odd ``n`` above 1 (the square and its reversed rows)."""
    if n < 1:
        raise ValueError(f"williams_orders: n must be positive, got {n}")
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...: every difference between neighbours once
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 and n > 1 else rows


def round_order(round_index: int, n: int) -> list[int]:
    """The strategies' order (indices ``0..n-1``) in round ``round_index`` (from 0), cycling through
    :func:`williams_orders`."""
    orders = williams_orders(n)
    return orders[round_index % len(orders)]
