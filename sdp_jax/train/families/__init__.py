"""The model families: their hooks for the one step and for the one training loop, and
:func:`family_of`, which picks the built-in family of a run config.

The public face of the wing; ``sdp_jax.train.families.language_model_step``,
``sdp_jax.train.families.vision_spec`` as before. Its members, from the top:

* :mod:`sdp_jax.train.families.registry`: :func:`family_of`, the built-in family of a run config;
* :mod:`sdp_jax.train.families.language_model`: LLaMA (pipelined or not);
* :mod:`sdp_jax.train.families.vision`: ResNet-18, WideResNet-18 and Swin-T (independent of the
  language model).

Each implements the protocol :class:`sdp_jax.train.task.Family`, the one a user's own model
also implements through :class:`sdp_jax.train.task.Task`.
"""

from sdp_jax.train.families.language_model import (LOSS_CHUNKS, LanguageModel, LanguageModelFamily,
                                                   boundary_bytes, language_model_step)
from sdp_jax.train.families.registry import family_of
from sdp_jax.train.families.vision import (VISION_REMAT, VisionEval, VisionFamily, VisionModel,
                                           vision_record, vision_rules, vision_spec,
                                           vision_stats_spec, vision_step)

__all__ = ["LOSS_CHUNKS", "LanguageModel", "LanguageModelFamily", "boundary_bytes",
           "language_model_step", "VISION_REMAT", "VisionEval", "VisionFamily", "VisionModel",
           "vision_record", "vision_rules", "vision_spec", "vision_stats_spec", "vision_step",
           "family_of"]
