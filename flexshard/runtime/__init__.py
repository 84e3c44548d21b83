"""Runtime: execute a FlexShard plan on torch.distributed (hot / warm / cold sequence embeddings).

* ``sharded``: :class:`ShardedSequenceEmbedding`, the module;
* ``features``: input checks, KeyedJaggedTensor input, jagged-to-padded views;
* ``lookups``: the local part of a lookup (dedup, routing, hot rows);
* ``exchange``: the flat lookup exchange (ids to owners, embeddings back, gradients back);
* ``group_exchange``: cold rows fetched once per group through the rail peers; ``transfer``: what the
  two exchanges share (all-to-alls of per-table columns, split sizes, bytes);
* ``replicas``: gradient sync of replicated rows (hot: hierarchical); ``shards``: the rows a rank holds
  and their optimizer;
* ``routing``: tier, owner and slot of every row id (exact and compact layouts);
* ``groups``: the process groups of a plan; ``initializer``: rows built identically on every rank;
* ``agreement``: errors agreed over the ranks; ``local``: spawn several local ranks (tests, experiments).
"""

from flexshard.runtime.features import features_from_kjt, to_padded
from flexshard.runtime.groups import ProcessGroups, make_process_groups
from flexshard.runtime.initializer import seeded_initializer
from flexshard.runtime.routing import (
    LAYOUTS,
    CompactTableRouting,
    TableRouting,
    build_compact_routing,
    build_routing,
    complete_order,
    deal,
)
from flexshard.runtime.sharded import ShardedSequenceEmbedding
from flexshard.runtime.shards import OPTIMIZERS, Shard

__all__ = [
    "LAYOUTS",
    "OPTIMIZERS",
    "CompactTableRouting",
    "ProcessGroups",
    "Shard",
    "ShardedSequenceEmbedding",
    "TableRouting",
    "build_compact_routing",
    "build_routing",
    "complete_order",
    "deal",
    "features_from_kjt",
    "make_process_groups",
    "seeded_initializer",
    "to_padded",
]
