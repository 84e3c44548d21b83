"""KeyedJaggedTensor input: converted to per-table (values, lengths) without importing torchrec."""

from __future__ import annotations

import pytest
import torch

from flexshard.runtime import features_from_kjt


class FakeKJT:
    """The part of torchrec's KeyedJaggedTensor API the runtime reads."""

    def __init__(self, keys, values, lengths, stride):
        self._k, self._v, self._l, self._s = keys, values, lengths, stride

    def keys(self):
        return self._k

    def values(self):
        return self._v

    def lengths(self):
        return self._l

    def stride(self):
        return self._s

    def length_per_key(self):
        return self._l.reshape(len(self._k), self._s).sum(1).tolist()


def test_fake_kjt_splits_per_key():
    # key a: samples of 2 and 1 ids; key b: samples of 0 and 3 ids
    kjt = FakeKJT(["a", "b"], torch.tensor([5, 6, 7, 1, 2, 3]), torch.tensor([2, 1, 0, 3]), 2)
    feats = features_from_kjt(kjt)
    assert list(feats) == ["a", "b"]
    assert feats["a"][0].tolist() == [5, 6, 7] and feats["a"][1].tolist() == [2, 1]
    assert feats["b"][0].tolist() == [1, 2, 3] and feats["b"][1].tolist() == [0, 3]


def test_not_a_kjt():
    with pytest.raises(ValueError, match="KeyedJaggedTensor"):
        features_from_kjt([1, 2, 3])


def test_real_kjt_when_torchrec_is_installed():
    torchrec = pytest.importorskip(
        "torchrec", reason="torchrec is an optional peer (scripts/setup_torchrec.sh)"
    )
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor([5, 6, 7, 1, 2, 3]), lengths=torch.tensor([2, 1, 0, 3])
    )
    feats = features_from_kjt(kjt)
    assert feats["a"][0].tolist() == [5, 6, 7] and feats["b"][1].tolist() == [0, 3]
