"""The input pipeline's sample placement: which rank trains on which sample of a global batch
(:class:`SamplePlacer`; modes :class:`~core.vocabulary.SamplePlacement`)."""

from core.vocabulary import SamplePlacement
from flexshard.batching.placer import SamplePlacer

__all__ = ["SamplePlacement", "SamplePlacer"]
