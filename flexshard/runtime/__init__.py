"""Runtime: execute a FlexShard plan on torch.distributed (hot / warm / cold sequence embeddings).

* ``sharded``: :class:`ShardedSequenceEmbedding`, the module;
* ``features``: input checks, KeyedJaggedTensor input, jagged-to-padded views;
* ``lookups``: the local part of a lookup (dedup, routing, hot rows);
* ``exchange_protocol``: the lookup exchange's phases (input_dist: ids, its blocks headed by the
  error codes and split sizes (``headed_ids``); compute; output_dist:
  rows, scatter; backward: grads, rail_grads), every table, tier and fetch mode in the same
  collectives; ``exchange_bytes``: their bytes; ``transfer``: all-to-alls of per-table columns and the
  wire dtype; ``awaitable``: the stages' awaitable results; ``collective_count``: counting a step's
  collectives;
* ``replicas``: the sync phase (touched mask, hot and warm gradients bucketed per level); ``shards``: the
  rows a rank holds and their optimizer state; ``optimizers``: the row optimizers (sgd, rowwise_adagrad,
  elementwise_adagrad, adam: fbgemm's arithmetic) and their state per row;
* ``routing``: tier, owner and slot of every row id (exact and compact layouts);
* ``groups``: the process groups of a plan; ``initializer``: rows built identically on every rank;
* ``agreement``: errors agreed over the ranks; ``local``: spawn several local ranks (tests, experiments).
"""

from flexshard.runtime.features import features_from_kjt, to_padded
from flexshard.runtime.groups import ProcessGroups, make_process_groups
from flexshard.runtime.initializer import seeded_initializer
from flexshard.runtime.optimizers import OPTIMIZER_CHOICES, OPTIMIZERS, Hyper, RowOptimizer, row_optimizer
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
from flexshard.runtime.shards import Shard

__all__ = [
    "LAYOUTS",
    "OPTIMIZERS",
    "OPTIMIZER_CHOICES",
    "Hyper",
    "RowOptimizer",
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
    "row_optimizer",
    "seeded_initializer",
    "to_padded",
]
