"""Optimizer, schedule and the LLaMA spec of a language-model run; figures of compiled programs.

The training step itself is :class:`sdp_jax.step.SDPStep` (one builder for every variant and
model family); :func:`sdp_jax.tasks.language_model_step` builds it for a LLaMA run.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import optax
from flax import nnx

from sdp_jax import fields, sync
from sdp_jax import spec as spec_lib
from sdp_jax import step as step_lib
from sdp_jax.models.llama import SDP_NAMES, Llama, LlamaConfig, sdp_rules
from sdp_jax.spec import VARIANTS, SDPSpec  # noqa: F401  (VARIANTS re-exported)

AXIS = sync.AXIS
DTYPES = step_lib.DTYPES
SCHEDULES = ("cosine", "wsd")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, a decay schedule and global-norm clipping. ``lr`` is the
    peak learning rate; it decays to ``lr * min_lr_ratio``. ``schedule``: ``cosine`` (cosine
    decay over the whole run, Loshchilov & Hutter 2017) or ``wsd`` (warm-up, stable, decay:
    the peak rate held until the last ``cooldown_fraction`` of the steps, then a linear
    cool-down; Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed
    Training Durations", Sec. 3), whose runs can be extended (``steps`` may grow on
    resume)."""

    name: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"
    cooldown_fraction: float = 0.2
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self):
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"optim.name={self.name!r}; choose adamw or sgd.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule={self.schedule!r}; choose "
                             f"{' or '.join(SCHEDULES)} (--config.optim.schedule=...).")

        def check(name, ok, rule):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not ok(v):
                raise ValueError(f"optim.{name}={v!r} must be {rule} "
                                 f"(--config.optim.{name}=...).")
        check("lr", lambda v: 0 < v < 3.4e38, "a finite number > 0 (in float32)")
        if self.name == "adamw" and self.lr > 1:
            raise ValueError(f"optim.lr={self.lr!r} is not a usable AdamW learning rate: AdamW "
                             "moves every weight by about lr per step (LLaMA-style runs use "
                             "1e-4 .. 1e-2); set --config.optim.lr <= 1.")
        check("min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]")
        check("warmup_steps", lambda v: v >= 0 and float(v).is_integer(), "an integer >= 0")
        check("weight_decay", lambda v: v >= 0, ">= 0")
        check("b1", lambda v: 0 <= v < 1, "in [0, 1)")
        check("b2", lambda v: 0 <= v < 1, "in [0, 1)")
        check("eps", lambda v: v > 0, "> 0")
        check("grad_clip", lambda v: v >= 0, ">= 0 (0 = no clipping)")
        check("cooldown_fraction", lambda v: 0 < v <= 1, "in (0, 1]")

    @classmethod
    def from_config(cls, cfg) -> "OptimConfig":
        return fields.from_section(cls, cfg, "optim")


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


def make_plan(variant: str, cfg: LlamaConfig, workers: int, coverage: float,
              scheme: str = "cyclic", seed: int = 0, allow_nonuniform: bool = False,
              allow_disconnected: bool = False, pipe=None) -> SDPSpec:
    """The :class:`sdp_jax.spec.SDPSpec` of a LLaMA model for a variant (DDP: all-ones block
    mask), from the model's declared rules (:func:`sdp_jax.models.llama.sdp_rules`).

    With ``pipe`` (:class:`sdp_jax.pipeline.PipelineConfig`, ``stages = P > 1``): the spec of
    one pipeline stage, whose ``L / P`` blocks carry the same masks in every stage, and the
    always-kept boundary parameters (:func:`sdp_jax.pipeline.init_boundary`).

    Raises:
      ValueError: unknown variant, a coverage not realizable for a component kind, or a
        disconnected mask graph (unless ``allow_disconnected``); ``P`` not dividing ``L``.
    """
    tree = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))
    if pipe is not None and pipe.stages > 1:
        from sdp_jax import pipeline as pl  # pylint: disable=g-import-not-at-top
        if cfg.n_layers % pipe.stages:
            raise ValueError(f"pipeline.stages={pipe.stages} does not divide "
                             f"model.n_layers={cfg.n_layers}; choose a divisor of it.")
        stage = dataclasses.replace(cfg, n_layers=cfg.n_layers // pipe.stages)
        tree = {**nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Llama(stage, nnx.Rngs(0))),
                                             nnx.Param)),
                "boundary": jax.eval_shape(lambda: pl.init_boundary(jax.random.key(0), cfg,
                                                                    pipe))}
    return spec_lib.build(tree, sdp_rules(cfg), variant, workers, coverage, scheme=scheme,
                          seed=seed, allow_nonuniform=allow_nonuniform, names=SDP_NAMES,
                          allow_disconnected=allow_disconnected)


def memory_stats(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled program from ``compiled.memory_analysis()``.

    peak ~ argument + temp + output - alias (donated state aliases its output).
    Returns dict with ``argument_bytes``, ``output_bytes``, ``alias_bytes``, ``temp_bytes``,
    ``peak_bytes_per_device`` (all bytes, ints).
    """
    ma = compiled.memory_analysis()
    arg = int(ma.argument_size_in_bytes)
    out = int(ma.output_size_in_bytes)
    alias = int(ma.alias_size_in_bytes)
    temp = int(ma.temp_size_in_bytes)
    return {"argument_bytes": arg, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp,
            "peak_bytes_per_device": arg + temp + out - alias}


def flops_per_device(compiled) -> float:
    """FLOPs of one per-device step from ``compiled.cost_analysis()`` (0.0 if unavailable).

    XLA counts a loop body once, whatever its trip count: compile with ``unroll=True`` (see
    :class:`sdp_jax.step.SDPStep`) for a count that includes every block."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return float((ca or {}).get("flops", 0.0))


def model_flops_per_token(cfg: LlamaConfig, seq_len: int, blocks: int | None = None,
                          width: float = 1.0) -> float:
    """Training FLOPs per token, ``6 * N + 12 * L * T * d`` (Kaplan et al. 2020, Sec. 2.1, with the
    attention term of PaLM, Chowdhery et al. 2022, App. B); ``blocks`` defaults to ``L``;
    ``width``: the fraction of each block's neurons and heads that runs (N-SDP's coverage)."""
    blocks = cfg.n_layers if blocks is None else blocks
    c = cfg.param_count()
    n = c["per_block"] * blocks * width + c["always_kept"] - cfg.vocab_size * cfg.d_model * (
        0 if cfg.tie_embeddings else 1)  # the input embedding lookup is no matmul
    return 6.0 * n + 12.0 * blocks * seq_len * cfg.d_model * width


# Dense bf16 peak FLOP/s per chip by ``device_kind`` (vendors' data sheets; SXM parts for
# NVIDIA), the denominator of MFU; the first matching entry wins.
PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("TPU v6", 918e12),
              ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5", 459e12),
              ("TPU v4", 275e12))


def peak_flops(device_kind: str, given: float = 0.0) -> float | None:
    """A device's peak FLOP/s for MFU: ``given`` if positive (``config.peak_flops``), else
    :data:`PEAK_FLOPS`'s entry for ``device_kind`` (e.g. ``"NVIDIA H100 80GB HBM3"``), else
    None (a CPU: no MFU)."""
    if given > 0:
        return float(given)
    return next((f for name, f in PEAK_FLOPS if name in device_kind), None)


def flop_matched_steps(ddp_steps: int, coverage: float) -> int:
    """FLOP-matched budget (Singh et al., Sec. 5): an SDP run at coverage C takes ``1/C`` times
    the optimizer steps of the DDP budget, rounded up."""
    return int(math.ceil(ddp_steps / coverage - 1e-9))


def fmt_bytes(n: float) -> str:
    """Bytes as ``12.3 MiB`` (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
