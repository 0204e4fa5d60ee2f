"""Pipelines and projectors: GPipe and 1F1B over the mesh axis ``stage``, the activations that cross
a stage boundary sent whole or compressed (a fixed random projector, an unconstrained one trained
by AdamW, or MAPL's projector kept on the Stiefel manifold).

The public face of the wing; ``from sdp_jax import pipeline`` then ``pipeline.Pipeline``,
``pipeline.PipelineConfig`` as before. Its members, independent of each other:

* :mod:`sdp_jax.pipeline.schedules`: the schedules, the boundaries and their bytes;
* :mod:`sdp_jax.pipeline.stiefel`: the Stiefel-manifold optax transform that trains the
  projectors (:func:`sdp_jax.pipeline.stiefel.stiefel_sgd`).
"""

from sdp_jax.pipeline.schedules import (FROZEN, METHODS, SCHEDULES, Boundary, Pipeline,
                                        PipelineConfig, boundary_bytes, boundary_param_count,
                                        codebook_sync_bytes, init_boundary, projector_key,
                                        token_id_dtype)

__all__ = ["METHODS", "SCHEDULES", "FROZEN", "PipelineConfig", "projector_key", "init_boundary",
           "Boundary", "Pipeline", "boundary_param_count", "codebook_sync_bytes", "token_id_dtype",
           "boundary_bytes"]
