"""Euler–Maclaurin generalized harmonic sums against brute-force summation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.errors import ConfigError
from flexshard.workloads.harmonic import EXACT_TERMS, generalized_harmonic, harmonic_range

ALPHAS = [0.0, 0.3, 0.55, 0.9, 0.99, 1.0, 1.01, 1.3, 2.0, 3.0]


def brute(a: int, b: int, alpha: float) -> float:
    return math.fsum((np.arange(a, b + 1, dtype=np.float64) ** -alpha).tolist())


@pytest.mark.parametrize("alpha", ALPHAS)
def test_partial_sums_match_brute_force(alpha: float) -> None:
    ns = [0, 1, 2, 10, EXACT_TERMS - 1, EXACT_TERMS, EXACT_TERMS + 1, 100, 1000, 54_321, 1_000_000]
    got = generalized_harmonic(np.array(ns), alpha)
    for n, g in zip(ns, got, strict=True):
        want = brute(1, n, alpha) if n else 0.0
        assert g == pytest.approx(want, rel=1e-12, abs=0.0), (n, alpha)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_range_sums_match_brute_force(alpha: float) -> None:
    a = np.array([1, 5, 60, 63, 64, 65, 100, 1000, 5000, 70_000, 999_000])
    b = np.array([1, 70, 64, 64, 64, 66, 101, 1010, 600_000, 70_000, 1_000_000])
    got = harmonic_range(a, b, alpha)
    for lo, hi, g in zip(a, b, got, strict=True):
        assert g == pytest.approx(brute(int(lo), int(hi), alpha), rel=1e-10, abs=0.0), (lo, hi, alpha)


def test_empty_ranges_are_zero_and_bad_input_raises() -> None:
    assert harmonic_range(10, 9, 1.0) == 0.0
    assert harmonic_range(np.array([100]), np.array([50]), 0.7)[0] == 0.0
    with pytest.raises(ConfigError, match="alpha"):
        harmonic_range(1, 10, -0.5)
    with pytest.raises(ConfigError, match="ranks start at 1"):
        harmonic_range(0, 10, 1.0)
    with pytest.raises(ConfigError, match="n must be"):
        generalized_harmonic(-1, 1.0)


def test_large_n_is_consistent_with_asymptotics() -> None:
    # H(n, 1) = ln n + gamma + 1/(2n) - 1/(12 n^2) + ...
    n = 10**9
    euler_gamma = 0.57721566490153286
    want = math.log(n) + euler_gamma + 1 / (2 * n) - 1 / (12 * n**2)
    assert generalized_harmonic(n, 1.0) == pytest.approx(want, rel=1e-14)
    # zeta(2) - H(n, 2) ~ 1/n
    assert math.pi**2 / 6 - float(generalized_harmonic(n, 2.0)) == pytest.approx(1 / n, rel=1e-5)
