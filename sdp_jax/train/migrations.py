"""Checkpoint migrations: the earlier layouts a run's checkpoint may have been written in, and
their conversions to the current one, which :func:`sdp_jax.train.loop.restore_or_init` tries
in turn when a checkpoint does not restore as it is (docs/checkpoints.md).

* :func:`compact_optimizer`: backward masking (``bb-sdp``, ``nb-sdp``) stored its optimizer
  state compact (each worker's held components ``C``, always-kept leaves ``R``) before the
  sharded update (ZeRO-2, layout ``S``).
* :func:`pipeline_kept`: pipelined runs stored ``{kept: {embed, final_norm, lm_head}, blocks,
  boundary}`` before the pipeline became the loss of the one step.

And the config fields newer than some checkpoints, with the values the older runs used
(:data:`LANGUAGE_MODEL_ADDED`, :data:`VISION_ADDED`, returned by the built-in families'
``added_fields``), with the other rules of :func:`compatibility`.
"""

from __future__ import annotations

from typing import Callable

import jax

from sdp_jax import layout as layout_lib
from sdp_jax import pipeline as pl
from sdp_jax import spec as spec_lib
from sdp_jax import sync
from sdp_jax.regime import Kind
from sdp_jax.state import map_moments, shardings
from sdp_jax.step import SDPStep

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
    """The migrations that apply to ``step``'s run, in the order they are tried: those of the
    earlier layouts of its regime (:attr:`sdp_jax.regime.Regime.earlier_layouts`)."""
    known = {"compact_optimizer": lambda: compact_optimizer(step),
             "pipeline_kept": lambda: (lambda t: pipeline_kept(t, True),
                                       lambda t: pipeline_kept(t, False))}
    return tuple(known[name]() for name in step.regime.earlier_layouts)


def _compact_codes(step: SDPStep) -> dict:
    lay = step.state_layout.layout
    return {p: Kind.COMPACT if lay.stored_compact(p) else Kind.REPLICATED
            for p in lay.stored_shapes}


def compact_optimizer(step: SDPStep) -> Migration:
    """Backward masking: the compact optimizer layout of checkpoints written before the sharded
    update, and its conversion to layout ``S``: every parameter-shaped entry (a moment) goes
    from its holders to the shards as a gradient does (:meth:`sdp_jax.sources.BackwardHeld.
    mean_shards`; holders agree, so the mean is their value, to the last bit with two holders
    and to float32 rounding with more)."""
    st, optimizer, codes = step.state_layout, step.optimizer, _compact_codes(step)
    specs, shapes = st.struct(codes)
    old_specs = layout_lib.opt_state_specs(optimizer, specs, shapes)

    def to_old(abstract: dict) -> dict:
        opt = jax.eval_shape(optimizer.init, shapes)
        sh = shardings(step.mesh, old_specs)
        opt = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                           opt, sh)
        return {**abstract, "opt_state": opt}

    def moment(tree):   # this worker's compact leaves (stored form) -> its shards
        flat = {p: x[0] if codes[p] == Kind.COMPACT else sync.to_varying(x)
                for p, x in _flatten(tree).items()}
        dts = {x.dtype for x in flat.values()}   # the moments' dtype (e.g. mu_dtype)
        flat = st.layout.to_local(flat)
        if step.model.block_fn is None:   # full-size leaves, zero where not held
            flat = st.zero_embedded(flat)
        return _unflatten({p: x.astype(next(iter(dts)) if len(dts) == 1 else
                                       st.layout.dtype(p))
                           for p, x in step.source.mean_shards(flat).items()})

    def convert(opt):
        opt = st.unstage(opt, old_specs)
        opt = map_moments(moment, opt, shapes)
        return st.restage(opt, step.opt_specs)

    def from_old(state: dict) -> dict:
        fn = step.placement.map(convert, (old_specs,), step.opt_specs)
        return {**state, "opt_state": jax.jit(fn)(state["opt_state"])}

    return to_old, from_old


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
