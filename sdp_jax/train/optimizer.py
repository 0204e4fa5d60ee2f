"""The optimizer of a run: AdamW (or SGD) with its learning-rate schedule, and the optimizer
of a pipelined run (the Stiefel-manifold transform for the boundary projectors).

Clipping is not here: the step clips by the holder-averaged global norm
(:func:`sdp_jax.sync.global_norm`, docs/design.md invariant 6).
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from sdp_jax import fields
from sdp_jax.fields import setting
from sdp_jax.options import StepOptions
from sdp_jax.pipeline import schedules as pl
from sdp_jax.pipeline import stiefel

SCHEDULES = ("cosine", "wsd")
STEP_FIELDS = fields.setting_defaults(StepOptions)   # the config fields the step's options own


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up and a decay schedule (the step clips, at
    ``optim.grad_clip``: :class:`sdp_jax.options.StepOptions`). ``lr`` is the
    peak learning rate; it decays to ``lr * min_lr_ratio``. ``schedule``: ``cosine`` (cosine
    decay over the whole run, Loshchilov & Hutter 2017) or ``wsd`` (warm-up, stable, decay:
    the peak rate held until the last ``cooldown_fraction`` of the steps, then a linear
    cool-down; Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed
    Training Durations", Sec. 3), whose runs can be extended (``steps`` may grow on
    resume)."""

    SECTION = "optim"

    name: str = setting("adamw", "adamw (optax), or sgd for plain SGD",
                        choices=("adamw", "sgd"))
    lr: float = setting(3e-3, "peak learning rate, reached after a linear warm-up of "
                        "warmup_steps steps", kind=float, low=0, high=3.4e38, open_low=True,
                        open_high=True)
    min_lr_ratio: float = setting(0.1, "the floor the rate decays to, as a fraction of lr",
                                  low=0, high=1)
    warmup_steps: int = setting(20, "steps of the linear warm-up", low=0)
    schedule: str = setting("cosine", "cosine (decay over the whole run) or wsd (warm-up, "
                            "stable, decay: the peak rate until the last cooldown_fraction of "
                            "the steps, then linear to the floor; a wsd run may be extended)",
                            choices=SCHEDULES)
    cooldown_fraction: float = setting(0.2, "wsd: the fraction of the steps that cool down",
                                       low=0, high=1, open_low=True)
    weight_decay: float = setting(0.1, "AdamW's decoupled weight decay", low=0)
    b1: float = setting(0.9, "AdamW's first-moment decay rate", low=0, high=1, open_high=True)
    b2: float = setting(0.95, "AdamW's second-moment decay rate", low=0, high=1, open_high=True)
    eps: float = setting(1e-8, "AdamW's epsilon", low=0, open_low=True)

    def __post_init__(self):
        fields.check_settings(self)
        if self.name == "adamw" and self.lr > 1:
            raise ValueError(f"optim.lr={self.lr!r} is not a usable AdamW learning rate: AdamW "
                             "moves every weight by about lr per step (LLaMA-style runs use "
                             "1e-4 .. 1e-2); set --config.optim.lr <= 1.")

    @classmethod
    def from_config(cls, cfg) -> "OptimConfig":
        """The ``optim`` section without the step's settings declared in it
        (:class:`sdp_jax.options.StepOptions`: ``optim.grad_clip``)."""
        return fields.from_section(cls, {k: v for k, v in dict(cfg).items()
                                         if f"optim.{k}" not in STEP_FIELDS}, "optim")


def cooldown_start(optim: OptimConfig, total_steps: int) -> int:
    """The step after which a ``wsd`` schedule of ``total_steps`` leaves its stable phase
    (``total_steps - round(cooldown_fraction * total_steps)``, never inside the warm-up)."""
    warm = min(optim.warmup_steps, max(total_steps - 1, 0))
    return max(total_steps - round(optim.cooldown_fraction * total_steps), warm)


def lr_schedule(optim: OptimConfig, total_steps: int):
    """optax schedule (step -> learning rate): linear warm-up from 0 to ``lr`` over
    ``warmup_steps``, then ``cosine`` decay to ``lr * min_lr_ratio`` at ``total_steps``, or
    (``wsd``) ``lr`` held until :func:`cooldown_start` and a linear cool-down to the floor at
    ``total_steps``. Up to its cool-down a ``wsd`` schedule does not depend on
    ``total_steps``, which is why such a run may be extended."""
    warm = min(optim.warmup_steps, max(total_steps - 1, 0))
    floor = optim.lr * optim.min_lr_ratio
    if optim.schedule == "wsd":
        stable = cooldown_start(optim, total_steps)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, optim.lr, warm) if warm else optax.constant_schedule(
                optim.lr),
             optax.constant_schedule(optim.lr),
             optax.linear_schedule(optim.lr, floor, max(total_steps - stable, 1))],
            [warm, stable])
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim.lr, warmup_steps=warm,
        decay_steps=max(total_steps, warm + 1), end_value=floor)


def _decay_mask(params):
    # No weight decay on norm scales (standard for LLaMA pre-training).
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any("norm" in str(getattr(k, "key", k)) for k in path), params)


def make_optimizer(optim: OptimConfig, total_steps: int,
                   decay_mask=None) -> optax.GradientTransformation:
    """AdamW (or plain SGD with decoupled weight decay) without clipping: clipping is done by the
    step from the holder-averaged gradient norm. ``decay_mask``: params -> bool tree of the
    leaves that get weight decay (default: all but norm scales)."""
    sched = lr_schedule(optim, total_steps)
    mask = _decay_mask if decay_mask is None else decay_mask
    if optim.name == "sgd":
        return optax.chain(optax.add_decayed_weights(optim.weight_decay, mask=mask),
                           optax.sgd(sched))
    return optax.adamw(sched, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                       weight_decay=optim.weight_decay, mask=mask)


def pipeline_optimizer(pipe: pl.PipelineConfig, optim, total_steps: int) -> optax.GradientTransformation:
    """The optimizer of a pipelined run: AdamW (or SGD) from ``optim`` (:class:`OptimConfig`) for
    every weight but the boundary projectors, no weight decay on norm scales and boundary
    parameters; :func:`sdp_jax.pipeline.stiefel.stiefel_sgd` (warm-up and cosine decay to
    ``pipe.proj_lr * optim.min_lr_ratio``) for ``stiefel_A``; no update for ``frozen*`` leaves.
    Leaves are routed by name (:func:`sdp_jax.pipeline.projector_key`)."""
    def names(path):
        return [str(getattr(k, "key", k)) for k in path]

    def label(params):
        def one(path, _):
            keys = names(path)
            if any(pl.FROZEN in k for k in keys):
                return pl.FROZEN
            return stiefel.PROJECTOR if any(stiefel.PROJECTOR in k for k in keys) \
                else stiefel.OTHER
        return jax.tree_util.tree_map_with_path(one, params)

    def decay(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any(n in k for k in names(path) for n in ("norm", "boundary")),
            params)
    adamw = make_optimizer(optim, total_steps, decay_mask=decay)
    sched = lr_schedule(dataclasses.replace(optim, lr=pipe.proj_lr), total_steps)
    proj = stiefel.stiefel_sgd(sched, pipe.proj_momentum, pipe.polar_steps)
    return optax.partition({stiefel.PROJECTOR: proj, pl.FROZEN: optax.set_to_zero(),
                            stiefel.OTHER: adamw}, label)
