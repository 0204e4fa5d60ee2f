"""Masks and specs: which parameters a model's subnetworks hold (Singh et al., arXiv 2507.09029,
Sec. 3).

The public face of the wing; ``from sdp_jax import spec`` then ``spec.Blocks``, ``spec.build``,
``spec.SDPSpec`` as before. Its members, from the top (the last two independent of each
other):

* :mod:`sdp_jax.spec.layout`: the full, compact (pruned) and shard forms of the parameters and the
  holder tables the collectives read;
* :mod:`sdp_jax.spec.sdp_spec`: :func:`build` -> :class:`SDPSpec` (rules, variant, W, C ->
  masks, mask pytrees, multiplicities, compact shapes);
* :mod:`sdp_jax.spec.rules`: the rules a model declares (:class:`Blocks`, :class:`Neurons`) and
  their resolution against a parameter tree;
* :mod:`sdp_jax.spec.masks`: host-side mask matrices ``[W, n]`` (numpy only).
"""

from sdp_jax.spec.sdp_spec import (BACKWARD_VARIANTS, BLOCK, BLOCK_VARIANTS, VARIANTS, Blocks,
                                   KindTables, Neurons, Rule, SDPSpec, Stack, build, flat_shapes,
                                   flatten, layer_masks, match_neurons, neuron_layers, path_keys,
                                   path_str, pure_tree, resolve_stack, stage_balance, unflatten)

__all__ = ["BLOCK", "Blocks", "Neurons", "Rule", "Stack", "flat_shapes", "flatten", "match_neurons",
           "neuron_layers", "path_keys", "path_str", "pure_tree", "resolve_stack", "unflatten",
           "VARIANTS", "BLOCK_VARIANTS", "BACKWARD_VARIANTS", "KindTables", "layer_masks",
           "SDPSpec", "stage_balance", "build"]
