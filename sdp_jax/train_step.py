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


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay (Loshchilov & Hutter 2019) and global-norm
    clipping. ``lr`` is the peak learning rate; it decays to ``lr * min_lr_ratio``."""

    name: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self):
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"optim.name={self.name!r}; choose adamw or sgd.")

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

    @classmethod
    def from_config(cls, cfg) -> "OptimConfig":
        return fields.from_section(cls, cfg, "optim")


def lr_schedule(optim: OptimConfig, total_steps: int):
    """optax schedule: linear warm-up to ``lr`` over ``warmup_steps``, cosine to the floor."""
    warm = min(optim.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim.lr, warmup_steps=warm,
        decay_steps=max(total_steps, warm + 1), end_value=optim.lr * optim.min_lr_ratio)


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


def model_flops_per_token(cfg: LlamaConfig, seq_len: int, blocks: int | None = None) -> float:
    """Training FLOPs per token, ``6 * N + 12 * L * T * d`` (Kaplan et al. 2020, Sec. 2.1, with the
    attention term of PaLM, Chowdhery et al. 2022, App. B); ``blocks`` defaults to ``L``."""
    blocks = cfg.n_layers if blocks is None else blocks
    c = cfg.param_count()
    n = c["per_block"] * blocks + c["always_kept"] - cfg.vocab_size * cfg.d_model * (
        0 if cfg.tie_embeddings else 1)  # the input embedding lookup is no matmul
    return 6.0 * n + 12.0 * blocks * seq_len * cfg.d_model


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
