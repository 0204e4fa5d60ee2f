"""The built-in model families by name: :func:`family_of` picks the family of a run config."""

from sdp_jax.models import vision as vm
from sdp_jax.train.families.language_model import LanguageModelFamily
from sdp_jax.train.families.vision import VisionFamily


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
