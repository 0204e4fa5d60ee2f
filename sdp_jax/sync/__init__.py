"""Collectives and placement: holder-only averaging inside ``jax.shard_map`` and where the workers
run.

The public face of the wing; ``from sdp_jax import sync`` then ``sync.average``,
``sync.global_norm``, ``sync.to_varying`` as before. Its members, from the top:

* :mod:`sdp_jax.sync.collectives`: the masked ``psum`` divided by the count, its ``all_to_all``
  form over each component's holders, FSDP gathers, holder-correct norms and clipping, and the
  averaging inside the backward loop (docs/design.md invariants 2 and 6);
* :mod:`sdp_jax.sync.placement`: one device per worker, or ``W`` workers emulated on one device.
"""

from sdp_jax.sync.collectives import (AXIS, STEP_BYTES, CompactTables, LayerTables,
                                      all_gather_invariant, average, clip_by_global_norm, clip_to,
                                      component_mean, cotangent_orders, from_order, from_rows,
                                      fsdp_gather, gather_full, global_norm, holder_mean,
                                      holder_shards, layer_value, masked_average, mean_in_backward,
                                      owner_sinks, pad_last, pieces_from_owners, pieces_to_owners,
                                      rows_from_owners, rows_to_owners, shards_sq_norm,
                                      shards_to_compact, sinks_to_mean, sinks_to_shards,
                                      slot_indices, sum_parts, to_order, to_rows, to_varying,
                                      varying, varying_axes, worker_index, zeros_varying)

__all__ = ["AXIS", "to_varying", "zeros_varying", "worker_index", "CompactTables", "component_mean",
           "LayerTables", "layer_value", "to_rows", "from_rows", "pad_last", "pieces_to_owners",
           "pieces_from_owners", "rows_to_owners", "rows_from_owners", "slot_indices", "STEP_BYTES",
           "holder_shards", "shards_to_compact", "holder_mean", "owner_sinks", "sinks_to_shards",
           "sinks_to_mean", "cotangent_orders", "to_order", "from_order", "mean_in_backward",
           "all_gather_invariant", "shards_sq_norm", "sum_parts", "fsdp_gather", "masked_average",
           "average", "varying", "varying_axes", "gather_full", "global_norm", "clip_by_global_norm",
           "clip_to"]
