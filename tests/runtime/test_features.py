"""A rank's input check (flexshard.runtime.features.check_features): the first problem in table order is
the one reported, with every table's values read back once, and count_per_peer (the exchange's split
sizes without a read back to the host) against torch.bincount."""

from __future__ import annotations

import pytest
import torch

from flexshard.runtime.features import ERROR_WORDS, InputFault, check_features
from flexshard.runtime.transfer import count_per_peer

NAMES, ROWS = ["a", "b", "c"], [10, 20, 30]
CPU = torch.device("cpu")


def good() -> dict:
    return {
        "a": (torch.tensor([1, 2, 3]), torch.tensor([2, 1])),
        "b": (torch.tensor([19, 0]), torch.tensor([1, 1])),
        "c": (torch.tensor([], dtype=torch.int64), torch.tensor([0, 0])),  # samples with no ids
    }


def code(features: dict) -> list[int]:
    parsed, err = check_features(features, NAMES, ROWS, CPU)
    assert err.shape == (ERROR_WORDS,)
    return err.tolist()


def test_good_input_is_parsed_as_int64_in_table_order():
    features = good()
    features["a"] = (torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int16))
    parsed, err = check_features(features, NAMES, ROWS, CPU)
    assert err.tolist() == [0, 0, 0, 0]
    assert [(v.tolist(), n.tolist()) for v, n in parsed] == [
        ([1, 2, 3], [2, 1]),
        ([19, 0], [1, 1]),
        ([], [0, 0]),
    ]
    assert all(v.dtype == n.dtype == torch.int64 for v, n in parsed)


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"b": (torch.tensor([5, 20]), torch.tensor([1, 1]))}, [InputFault.RANGE, 1, 20, 0]),
        ({"b": (torch.tensor([-3, 2]), torch.tensor([1, 1]))}, [InputFault.RANGE, 1, -3, 0]),
        ({"a": (torch.tensor([1, 2, 3]), torch.tensor([4, -1]))}, [InputFault.NEGATIVE_LENGTH, 0, -1, 0]),
        ({"c": (torch.tensor([1]), torch.tensor([0, 0]))}, [InputFault.LENGTH_SUM, 2, 0, 1]),
        ({"b": (torch.tensor([1.0, 2.0]), torch.tensor([1, 1]))}, [InputFault.TYPE, 1, 0, 0]),
        ({"a": (torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.int64))}, [InputFault.EMPTY, 0, 0, 0]),
        # a value fault in an earlier table comes before a type or size fault in a later one
        (
            {"a": (torch.tensor([1, 2, 3]), torch.tensor([4, -1])), "b": ("not", "tensors")},
            [InputFault.NEGATIVE_LENGTH, 0, -1, 0],
        ),
        (
            {"b": (torch.tensor([5, 25]), torch.tensor([1, 1])), "c": (torch.tensor([1]), torch.tensor([]))},
            [InputFault.RANGE, 1, 25, 0],
        ),
        # ... and a type fault in an earlier table before a value fault in a later one
        (
            {"a": (torch.ones(2, 2, dtype=torch.int64), torch.tensor([2])), "b": (torch.tensor([99]), [1])},
            [InputFault.TYPE, 0, 0, 0],
        ),
    ],
)
def test_the_first_problem_in_table_order_is_reported(change, expected):
    assert code({**good(), **change}) == [int(x) for x in expected]


def test_a_missing_table_is_reported_before_anything_is_read():
    features = good()
    del features["b"]
    assert code(features) == [InputFault.TABLES, 1, 0, 0]


def test_count_per_peer_is_bincount_with_minlength():
    gen = torch.Generator().manual_seed(0)
    for peers in (1, 4, 9):
        for n in (0, 1, 7, 1000):
            dest = torch.randint(0, peers, (n,), generator=gen)
            got = count_per_peer(dest, peers)
            assert got.dtype == torch.int64
            assert torch.equal(got, torch.bincount(dest, minlength=peers))
