"""The model families: their hooks for the one step and for the one training loop, and
:func:`family_of`, which picks the built-in family of a run config.

The public face of the wing; ``sdp_jax.train.families.language_model_step``,
``sdp_jax.train.families.vision_spec`` as before. Its members, independent of each other:

* :mod:`sdp_jax.train.families.language_model`: LLaMA (pipelined or not);
* :mod:`sdp_jax.train.families.vision`: ResNet-18, WideResNet-18 and Swin-T.

Each implements the protocol :class:`sdp_jax.train.task.Family`, the one a user's own model
also implements through :class:`sdp_jax.train.task.Task`.
"""

from sdp_jax.models import vision as vm
from sdp_jax.train.families.language_model import (
    LOSS_CHUNKS,
    LanguageModel,
    LanguageModelFamily,
    boundary_bytes,
    language_model_step,
)
from sdp_jax.train.families.vision import (
    VISION_REMAT,
    VisionEval,
    VisionFamily,
    VisionModel,
    vision_record,
    vision_rules,
    vision_spec,
    vision_stats_spec,
    vision_step,
)

__all__ = ["LOSS_CHUNKS", "LanguageModel", "LanguageModelFamily", "boundary_bytes",
           "language_model_step", "VISION_REMAT", "VisionEval", "VisionFamily", "VisionModel",
           "vision_record", "vision_rules", "vision_spec", "vision_stats_spec", "vision_step",
           "family_of"]


def family_of(config):
    """The built-in model family of a run config: :class:`VisionFamily` when ``model.name`` is
    a vision model (:data:`sdp_jax.models.vision.MODELS`), :class:`LanguageModelFamily` for
    ``llama`` (or no name).

    Raises:
      ValueError: another ``model.name`` (a user's model is trained and read back with its
        :class:`sdp_jax.train.task.Task`)."""
    name = config.model.get("name", "llama")
    if name in vm.MODELS:
        return VisionFamily()
    if name == "llama":
        return LanguageModelFamily()
    raise ValueError(f"config.model.name={name!r} is not a built-in model (llama, "
                     f"{', '.join(vm.MODELS)}); a run of your own model is trained and read "
                     "back with its task: loop.train(config, workdir, task=YourTask()), "
                     "trained.load(workdir, task=YourTask()), or python -m "
                     "sdp_jax.tools.evaluate --task your_module:YourTask.")

