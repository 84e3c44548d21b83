"""Runtime: execute a FlexShard plan on torch.distributed (hot / warm / cold sequence embeddings)."""

from flexshard.runtime.groups import ProcessGroups, emulated_groups, make_process_groups
from flexshard.runtime.routing import (
    COLD,
    HOT,
    LAYOUTS,
    WARM,
    CompactTableRouting,
    TableRouting,
    build_compact_routing,
    build_routing,
    complete_order,
    deal,
)
from flexshard.runtime.sharded import (
    ShardedSequenceEmbedding,
    features_from_kjt,
    seeded_initializer,
    to_padded,
)

__all__ = [
    "COLD",
    "HOT",
    "LAYOUTS",
    "WARM",
    "ProcessGroups",
    "CompactTableRouting",
    "ShardedSequenceEmbedding",
    "TableRouting",
    "build_compact_routing",
    "build_routing",
    "complete_order",
    "deal",
    "emulated_groups",
    "features_from_kjt",
    "make_process_groups",
    "seeded_initializer",
    "to_padded",
]
