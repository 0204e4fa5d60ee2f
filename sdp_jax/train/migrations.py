"""Checkpoint migrations: the earlier layouts a run's checkpoint may have been written in, and
their conversions to the current one, which :func:`sdp_jax.train.loop.restore_or_init` tries
in turn when a checkpoint does not restore as it is (docs/checkpoints.md).

* the regime's own (:meth:`sdp_jax.step.SDPStep.earlier_layouts`): backward masking
  (``bb-sdp``, ``nb-sdp``) stored its optimizer state compact (each worker's held components
  ``C``, always-kept leaves ``R``) before the sharded update (ZeRO-2, layout ``S``):
  :meth:`sdp_jax.step.sources.BackwardHeld.compact_optimizer`.
* :func:`pipeline_kept`: pipelined runs stored ``{kept: {embed, final_norm, lm_head}, blocks,
  boundary}`` before the pipeline became the loss of the one step.

And the config fields newer than some checkpoints, with the values the older runs used
(:data:`LANGUAGE_MODEL_ADDED`, :data:`VISION_ADDED`, returned by the built-in families'
``added_fields``), with the other rules of :func:`compatibility`.
"""

from __future__ import annotations

from typing import Callable

from sdp_jax.pipeline import schedules as pl
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step.sdp_step import SDPStep

_flatten, _unflatten = spec_lib.flatten, spec_lib.unflatten
_KEPT = ("embed", "final_norm", "lm_head")

Migration = tuple[Callable, Callable]   # (current abstract state -> old, restored old -> current)

# optim fields newer than the first checkpoints, with the values those runs used (every family)
OPTIM_ADDED = {"optim": {"schedule": "cosine", "cooldown_fraction": 0.2}}
# Config fields added after language-model checkpoints were first written (older runs' values).
LANGUAGE_MODEL_ADDED = {"fsdp": False, "dtype": "float32",
                        "pipeline": dict(pl.PipelineConfig().__dict__),
                        "data": {"tokenizer": "", "eot_token": "", "text_field": "text"},
                        **OPTIM_ADDED}
# Config fields newer than some vision checkpoints (older runs' values).
VISION_ADDED = {"sdp": {"average": "gradients", "sync_every": 1, "method": "auto"},
                "fsdp": False, **OPTIM_ADDED}


def compatibility(run) -> dict:
    """Keyword arguments of :meth:`sdp_jax.train.checkpoint.CheckpointManager.check_compatible`
    for a run (``run``: :class:`sdp_jax.train.run.RunSpec`): the family's added fields
    (``added_fields``), and ``steps`` allowed to grow under the ``wsd`` schedule (extending a
    run; under ``cosine`` the refusal names that option)."""
    wsd = run.optim.schedule == "wsd"
    return {"defaults": run.family.added_fields(), "may_grow": ("steps",) if wsd else (),
            "hints": {} if wsd else {"steps": "the cosine schedule is fitted to steps: a run "
                                              "trained with --config.optim.schedule=wsd may be "
                                              "extended"}}


def layouts(step: SDPStep) -> tuple[Migration, ...]:
    """The migrations that apply to ``step``'s run, in the order they are tried: its regime's
    (:meth:`sdp_jax.step.SDPStep.earlier_layouts`), then a pipeline's kept leaves."""
    kept = ((lambda t: pipeline_kept(t, True), lambda t: pipeline_kept(t, False)),)
    return step.earlier_layouts() + (kept if step.staged else ())


def pipeline_kept(tree, to_old: bool):
    """A train state (or its abstract form) in the layout that pipelined checkpoints had before
    the pipeline became the loss of the one step (``to_old``: parameters
    ``{kept: {embed, final_norm, lm_head}, blocks, boundary}``, in the optimizer state too), or
    back (``to_old=False``). Block and boundary leaves are unchanged."""
    if isinstance(tree, dict):
        tree = {k: pipeline_kept(v, to_old) for k, v in tree.items()}
        if to_old and "blocks" in tree and "embed" in tree:
            tree["kept"] = {k: tree.pop(k) for k in _KEPT if k in tree}
            tree.setdefault("boundary", {})   # method none stored an empty boundary
        elif not to_old and "blocks" in tree and isinstance(tree.get("kept"), dict):
            tree.update(tree.pop("kept"))
            if tree.get("boundary") == {}:
                del tree["boundary"]
        return tree
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*[pipeline_kept(v, to_old) for v in tree])
    if isinstance(tree, (list, tuple)):
        return type(tree)(pipeline_kept(v, to_old) for v in tree)
    return tree
