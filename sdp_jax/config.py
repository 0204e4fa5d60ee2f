"""The run configuration (``ml_collections.ConfigDict``) of every model family, and the one place
that validates it.

:func:`base_config` (language models) and :func:`vision_config` (image classifiers) share one
schema: the ``sdp``, ``optim`` and run-control fields are defined once (:func:`_run_fields`);
a family adds its ``model`` and ``data`` sections and a few fields of its own (language models:
``seq_len``, ``eval_batches``, ``pipeline``; vision: ``eval_limit``, ``eval_bn_batches``,
``sdp.stage_blocks``). :func:`resolve` validates a config of either family before any compute
and derives the run's static facts (:class:`RunSpec`), for ``train.py``, the bench and the study.

Every field can be overridden on the command line: ``--config.sdp.coverage=0.5``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax
import ml_collections

from sdp_jax import data


def _run_fields(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The fields of every run config (set on ``c``; families change some defaults)."""
    c.sdp = ml_collections.ConfigDict(dict(
        variant="ddp",            # ddp | b-sdp | n-sdp | bb-sdp | nb-sdp
        coverage=1.0,             # C: fraction of blocks / neurons / heads each worker holds
        scheme="cyclic",          # cyclic | random | grouped (disconnected: allow_disconnected)
        mask_seed=0,              # seed of the random scheme
        allow_nonuniform=False,   # accept W*C not whole (near-uniform multiplicities)
        allow_disconnected=False, # accept a mask graph with spectral gap 0
        average="gradients",      # gradients (every step) | parameters (every sync_every steps)
        sync_every=1,             # H: steps between parameter averagings (average=parameters)
        method="auto",            # averaging: auto (= alltoall) | alltoall | reference (masked psum)
    ))
    c.optim = ml_collections.ConfigDict(dict(
        name="adamw", lr=3e-3, min_lr_ratio=0.1, warmup_steps=20, weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8,
        grad_clip=1.0,
        schedule="cosine",        # cosine | wsd (warm-up, stable, decay: steps may grow on resume)
        cooldown_fraction=0.2))   # wsd: the last fraction of the steps decays linearly
    c.fsdp = False              # shard params, grads and optimizer state over workers (ZeRO-3)
    c.remat = "none"            # activation checkpointing per block: none | full | dots (vision: none | full)
    c.dtype = "float32"         # compute dtype: float32 | bfloat16 (master params stay float32)
    c.workers = 0               # W data-parallel workers; 0 = every device
    c.num_cpu_devices = 8       # simulated devices when only a CPU is present
    c.batch_per_worker = 8      # examples per worker per step (b); global batch = W * b
    c.steps = 300               # optimizer steps (the DDP budget when flop_matched)
    c.flop_matched = False      # SDP runs ceil(steps / C) steps (the paper's FLOP-matched budget)
    c.eval_every = 100          # steps between full-model evaluations (and at the end)
    c.log_every = 10            # steps between progress updates
    c.checkpoint_every = 100    # steps between checkpoints (and at the end); 0 = only at the end
    c.keep_checkpoints = 2
    c.stop_at_step = 0          # stop (as if preempted) once this step is reached; 0 = off
    c.peak_flops = 0.0          # FLOP/s per device for MFU; 0 = the device's known bf16 peak (none on CPU)
    c.align_every = 0           # steps between gradient-alignment measurements; 0 = off
    c.seed = 0
    return c


def base_config() -> ml_collections.ConfigDict:
    """A language-model run; the ``configs/llama_*.py`` files set the model shape on top.

    Sections: ``model`` (:class:`sdp_jax.models.llama.LlamaConfig` fields), ``data``
    (:func:`sdp_jax.data.default_data_config`), ``sdp`` (variant and mask recipe), ``pipeline``
    (:class:`sdp_jax.pipeline.PipelineConfig` fields), ``optim``
    (:class:`sdp_jax.train_step.OptimConfig` fields), and run control at the top level.
    """
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(
        name="llama", vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=384,
        max_seq_len=256, tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02,
        attention="dot_product",   # dot_product | cudnn (NVIDIA GPU, bf16) | chunked (any)
        attention_chunk=128))      # query rows per chunk of attention=chunked
    c.data = data.default_data_config()
    _run_fields(c)
    # Pipeline stages on the mesh axis `stage` (W * stages devices), with compressed boundaries
    # (MAPL): see sdp_jax.pipeline.PipelineConfig. stages=1: no pipeline.
    c.pipeline = ml_collections.ConfigDict(dict(
        stages=1, microbatches=4,
        schedule="gpipe",         # gpipe | 1f1b (one forward, one backward: less memory)
        method="none",            # none | fixed | unconstrained | mapl
        ratio=4,                  # compression d / r
        anchor_rank=16,           # r_a of the factorized anchor embeddings (0 = none)
        proj_lr=0.01, proj_momentum=0.9, polar_steps=10,  # the Stiefel optimizer (mapl)
        rvq_levels=0,             # residual vector quantization of the payload (0 = off)
        rvq_codebook=256, rvq_beta=0.25))
    c.seq_len = 128             # tokens per sequence (T)
    c.eval_batches = 8          # validation batches of W * b sequences
    return c


def paper_scale_config(*, d_model: int, n_layers: int, n_heads: int, d_ff: int,
                       tie_embeddings: bool, coverage: float) -> ml_collections.ConfigDict:
    """Shared settings of the paper-scale configs (``llama_134m``, ``llama_500m``, ``llama_1b``):
    vocab 32000 (the LLaMA tokenizer's), llm.c token shards, every device a worker (8 on a
    CPU: ``num_cpu_devices``), B-SDP, 1024-token
    sequences, 8 per worker, AdamW peak 6e-4 with 500 warm-up steps. ``W * coverage`` need not
    be whole (the paper's 1B setting): near-uniform masks are allowed."""
    c = base_config()
    c.model.update(vocab_size=32000, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                   n_kv_heads=n_heads, d_ff=d_ff, max_seq_len=2048, tie_embeddings=tie_embeddings)
    c.data.source = "llmc"
    c.sdp.variant = "b-sdp"
    c.sdp.coverage = coverage
    c.sdp.allow_nonuniform = True
    c.workers = 0               # every device (several processes need every device a worker)
    c.seq_len = 1024
    c.batch_per_worker = 8
    c.steps = 10000
    c.eval_every = 500
    c.checkpoint_every = 500
    c.optim.lr = 6e-4
    c.optim.warmup_steps = 500
    return c


def vision_config(name: str, dataset: str) -> ml_collections.ConfigDict:
    """An image-classification run (``configs/resnet18_*.py``, ``wrn18_*``, ``swin_t_*``).

    Sections: ``model`` (:class:`sdp_jax.models.vision.VisionConfig` fields; ``num_classes=0``
    takes the dataset's), ``data`` (:func:`sdp_jax.vision_data.default_vision_data_config`),
    and the ``sdp``, ``optim`` and run-control fields of every run (:func:`_run_fields`, with
    vision defaults: AdamW 2e-3 with warm-up and cosine decay), with ``eval_limit`` (test images per evaluation; 0 =
    the whole test split) instead of ``eval_batches``, ``eval_bn_batches`` (see
    :attr:`sdp_jax.tasks.VisionEval.recalibrate`) and ``sdp.stage_blocks``.
    """
    from sdp_jax import vision_data  # pylint: disable=g-import-not-at-top

    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(name=name, num_classes=0, image_size=32,
                                             in_channels=3, subnet_rescale=True))
    if name in ("resnet18", "wrn18"):
        c.model.update(width=64, widen=2 if name == "wrn18" else 1, depths=(2, 2, 2, 2))
    else:
        c.model.update(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), window=4,
                       patch=2, mlp_ratio=4)
    c.data = vision_data.default_vision_data_config()
    c.data.dataset = dataset
    _run_fields(c)
    # Block variants: blocks per worker in each stage, e.g. (1, 2, 4, 1); () = apportion C.
    c.sdp.stage_blocks = ml_collections.FieldReference((), field_type=tuple)
    c.optim.update(lr=2e-3, min_lr_ratio=0.01, warmup_steps=100, weight_decay=0.05, b2=0.999)
    c.batch_per_worker = 64     # images per worker per step
    c.steps = 8000
    c.eval_every = 1000
    c.eval_limit = 0
    c.eval_bn_batches = 8       # forward-masking SDP with BatchNorm: re-estimate the full
                                # model's BatchNorm statistics on this many training batches
    c.log_every = 50
    c.checkpoint_every = 1000
    return c


# ---------------------------------------------------------------------------- validation

# Fields that do not change the training trajectory: a checkpoint written under other values
# still resumes (remat: same results, may change).
RUN_CONTROL = ("eval_every", "eval_batches", "eval_limit", "eval_bn_batches", "log_every",
               "checkpoint_every", "keep_checkpoints", "stop_at_step", "num_cpu_devices",
               "remat", "peak_flops", "align_every")
# Model fields that choose how the same function is computed (not what is computed): a
# checkpoint resumes under other values.
MODEL_EXECUTION = ("attention", "attention_chunk")


@dataclasses.dataclass
class RunSpec:
    """Everything a run config resolves to before compute (host-side values; no arrays).

    Attributes:
      family: the model family's run hooks (:func:`sdp_jax.tasks.family_of`).
      model: the model's config (:class:`sdp_jax.models.llama.LlamaConfig` or
        :class:`sdp_jax.models.vision.VisionConfig`).
      optim: :class:`sdp_jax.train_step.OptimConfig`.
      plan: the spec (masks) of the run; with a pipeline, of one stage.
      workers: ``W``; total_steps: the run's optimizer steps (FLOP-matched when asked);
      global_batch: ``W * batch_per_worker`` examples per step.
      pipe: :class:`sdp_jax.pipeline.PipelineConfig` (``stages=1``: no pipeline).
    """

    family: Any
    model: Any
    optim: Any
    plan: Any
    workers: int
    total_steps: int
    global_batch: int
    pipe: Any


def _integer(v, name: str, low: int, hint: str = "") -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"config.{name}={v!r} must be "
                         + ("a positive integer" if low == 1 else f"an integer >= {low}")
                         + (f" ({hint})." if hint else "."))


def _check_schema(config, family) -> None:
    """Refuse a config whose fields differ from its family's schema: a ``model`` section of
    another model (e.g. ``model.name`` switched by an override), a missing field, or an
    unknown one (a typo in a hand-written ``get_config``), naming the field."""
    from sdp_jax.models.vision import MODELS  # pylint: disable=g-import-not-at-top
    template, maker = family.template(config)
    name, mine = config.model.get("name", "llama"), set(template.model)
    others = set(base_config().model).union(
        *(vision_config(n, "digits").model for n in MODELS)) - mine
    extra = sorted(set(config.model) - mine)
    if extra and set(extra) <= others:   # (a typo is left to the model's own check)
        raise ValueError(f"config.model.name={name!r} but the model section has fields of "
                         f"another model ({', '.join(extra)}); to train {name} give a {name} "
                         "config file (configs/) rather than overriding model.name.")
    missing, unknown = [], []
    for key, value in template.items():
        if key == "model":
            continue
        if key not in config:
            missing.append((key, value))
        elif isinstance(value, ml_collections.ConfigDict):
            missing += [(f"{key}.{sub}", v) for sub, v in value.items()
                        if sub not in config[key]]
            unknown += [f"{key}.{sub}" for sub in config[key] if sub not in value]
    unknown += [key for key in config if key not in template]
    if missing:
        field, default = missing[0]
        shown = "a section" if isinstance(default, ml_collections.ConfigDict) else repr(default)
        raise ValueError(f"config.{field} is missing; build the run config on "
                         f"sdp_jax.config.{maker}() (default {field}: {shown}) or add the "
                         "field to your get_config().")
    if unknown:
        raise ValueError(f"config.{unknown[0]} is not a field of a {family.kind} run config "
                         f"(sdp_jax.config.{maker}()); correct or remove it in your "
                         "get_config().")


def resolve(config, device_count: int) -> RunSpec:
    """Validate a run config of any model family and derive its static facts: the one
    validation place of ``train.py``, ``python -m sdp_jax.bench`` and ``python -m
    sdp_jax.study``.

    It initializes the JAX backend (``jax.process_count``, the specs' ``jax.eval_shape``): set
    ``jax_num_cpu_devices`` and call ``jax.distributed.initialize`` before it.

    Args:
      config: the run ``ConfigDict`` (:func:`base_config`, :func:`vision_config`); a ``dtype``
        alias (``bf16``, ``fp32``) is replaced by its canonical name (:func:`canonical_dtype`).
      device_count: devices available (``jax.device_count()``).

    Raises:
      ValueError: with the bad value and a fix, for any invalid or missing field (run control,
        step settings, workers, model, data, masks, warm-up longer than the run).
    """
    from sdp_jax import pipeline as pl  # pylint: disable=g-import-not-at-top
    from sdp_jax import tasks  # pylint: disable=g-import-not-at-top
    from sdp_jax import train_step as ts  # pylint: disable=g-import-not-at-top
    canonical_dtype(config)
    family = tasks.family_of(config)
    _check_schema(config, family)
    for name in ("batch_per_worker", "steps", "log_every", "keep_checkpoints",
                 "num_cpu_devices") + family.positive_fields:
        _integer(config[name], name, 1)
    for name in ("eval_every", "checkpoint_every", "stop_at_step", "seed", "align_every") \
            + family.non_negative_fields:
        _integer(config[name], name, 0)
    _integer(config.data.worker_count, "data.worker_count", 0,
             "0 = read data in the training process")
    pf = config.peak_flops
    if isinstance(pf, bool) or not isinstance(pf, (int, float)) or not 0 <= pf < math.inf:
        raise ValueError(f"config.peak_flops={pf!r} must be a number >= 0 (a device's peak "
                         "FLOP/s, e.g. 989e12 for an H100's bf16; 0 = known devices only).")
    if config.seed >= 2**31:   # the data pipelines and initializers derive seeds from it
        raise ValueError(f"config.seed={config.seed} must be below 2**31; pick a smaller seed.")
    cov = config.sdp.coverage
    if isinstance(cov, bool) or not isinstance(cov, (int, float)) or not 0 < cov <= 1:
        raise ValueError(f"config.sdp.coverage={cov!r} must be a number in (0, 1] (the fraction "
                         "of components each worker holds; 1 for ddp).")
    model = family.model_config(config)
    optim = ts.OptimConfig.from_config(config.optim)
    _check_step_fields(config, family.remat)
    pipe = pl.PipelineConfig.from_config(config.get("pipeline", {}))
    if pipe.stages > 1:
        pipe.check(model, config.batch_per_worker, config.fsdp, config.sdp.average)
    if config.align_every and (pipe.stages > 1 or config.fsdp or not family.aligns
                               or config.sdp.average != "gradients"):
        what = ("pipelines" if pipe.stages > 1 else "FSDP" if config.fsdp
                else f"{family.kind} models" if not family.aligns
                else "parameter averaging (sdp.average=parameters)")
        raise ValueError(f"config.align_every={config.align_every}: the gradient alignment "
                         f"is not built for {what} (it needs the full model and its loss on "
                         "every device); set --config.align_every=0.")
    workers = resolve_workers(config, device_count, pipe.stages)
    plan = family.plan(config, model, workers, pipe)
    total = total_steps(config, plan.coverage)
    if optim.warmup_steps > total:
        raise ValueError(f"optim.warmup_steps={optim.warmup_steps} is longer than the run "
                         f"({total} steps); lower --config.optim.warmup_steps.")
    return RunSpec(family, model, optim, plan, workers, total,
                   workers * config.batch_per_worker, pipe)


def resolve_workers(config, device_count: int, stages: int = 1) -> int:
    """``W`` from ``config.workers`` (0 = every device, or devices / ``stages`` with a
    pipeline of ``stages`` stages).

    Raises:
      ValueError: not a positive integer, ``W * stages`` more than the devices, or not every
        device with several processes."""
    zero = "0 = every device" + (" / pipeline.stages" if stages > 1 else "")
    workers = config.workers or max(device_count // stages, 1)
    _integer(workers, "workers", 1, zero)
    need = workers * stages
    if need > device_count:
        hint = (f", or simulate more CPU devices with --config.num_cpu_devices={need}"
                if jax.devices()[0].platform == "cpu" else "")
        what = (f"config.workers={workers}" if stages == 1 else
                f"workers * pipeline.stages = {workers} * {stages}")
        raise ValueError(f"{what} needs {need} devices but only {device_count} devices are "
                         f"available; lower --config.workers ({zero})"
                         + (" or --config.pipeline.stages" if stages > 1 else "") + f"{hint}.")
    if jax.process_count() > 1 and need != device_count:
        if stages == 1:
            raise ValueError(f"with several processes every device is a worker: set "
                             f"--config.workers=0 (got {need} of {device_count} devices).")
        raise ValueError(f"with several processes every device is a worker: workers x "
                         f"pipeline.stages must be the {device_count} devices (got {workers} x "
                         f"{stages} = {need}); set --config.workers=0 and a pipeline.stages "
                         f"that divides {device_count}.")
    return workers


def _check_step_fields(config, remat: tuple | None = None) -> None:
    """Validate the step's settings of a run config (every model family): ``sdp.method``,
    ``sdp.average``, ``sdp.sync_every``, ``fsdp``, ``remat`` (one of ``remat``,
    default :data:`sdp_jax.step.REMAT`) and ``dtype``.

    Raises:
      ValueError: naming the bad value and the choices: an unknown averaging mode or method,
        a bad ``sync_every``, ``sync_every`` without parameter averaging, parameter averaging
        with a backward-masking variant or with FSDP."""
    from sdp_jax import spec as spec_lib  # pylint: disable=g-import-not-at-top
    from sdp_jax import step as step_lib  # pylint: disable=g-import-not-at-top
    from sdp_jax import tasks  # pylint: disable=g-import-not-at-top
    sdp, remat, fsdp = config.sdp, tuple(remat or step_lib.REMAT), config.fsdp
    if not isinstance(fsdp, bool):
        raise ValueError(f"config.fsdp={fsdp!r} must be True or False.")
    if config.remat not in remat:
        raise ValueError(f"config.remat={config.remat!r}; use one of {', '.join(remat)} "
                         "(activation checkpointing of every block).")
    if config.dtype not in step_lib.DTYPES:
        raise ValueError(f"config.dtype={config.dtype!r}; use float32 or bfloat16.")
    tasks.step_method(sdp.method, "config.sdp.method")
    if sdp.average not in step_lib.AVERAGING:
        raise ValueError(f"config.sdp.average={sdp.average!r}; use gradients or parameters.")
    _integer(sdp.sync_every, "sdp.sync_every", 1)
    if sdp.average == "gradients" and sdp.sync_every != 1:
        raise ValueError(f"config.sdp.sync_every={sdp.sync_every} only applies with "
                         "--config.sdp.average=parameters (gradients are averaged every step); "
                         "set both or neither.")
    if sdp.average == "parameters" and sdp.variant in spec_lib.BACKWARD_VARIANTS:
        raise ValueError(f"config.sdp.average=parameters is not available for {sdp.variant} "
                         "(backward masking keeps every worker's full parameters identical); "
                         "use average=gradients or a forward variant (ddp, b-sdp, n-sdp).")
    if fsdp and sdp.average == "parameters":
        raise ValueError("config.sdp.average=parameters needs per-worker parameter copies, but "
                         "--config.fsdp=True stores one sharded copy; use average=gradients "
                         "or fsdp=False.")


def canonical_dtype(config) -> None:
    """``bf16`` / ``fp32`` -> ``bfloat16`` / ``float32``, so that checkpoints record one name."""
    alias = {"bf16": "bfloat16", "fp32": "float32"}
    if config.dtype in alias:
        with config.unlocked():
            config.dtype = alias[config.dtype]


def total_steps(config, coverage: float, steps: int | None = None) -> int:
    """The optimizer steps of a run of ``steps`` (default ``config.steps``): ``steps``, or
    under ``flop_matched`` an SDP run's ``ceil(steps / C)``
    (:func:`sdp_jax.train_step.flop_matched_steps`)."""
    from sdp_jax import train_step as ts  # pylint: disable=g-import-not-at-top
    steps = config.steps if steps is None else steps
    if config.flop_matched and config.sdp.variant != "ddp":
        return ts.flop_matched_steps(steps, coverage)
    return steps


def trajectory_config(config) -> dict[str, Any]:
    """The parts of the config a checkpoint must agree with (plain JSON dict)."""
    d = json.loads(config.to_json())
    for k in RUN_CONTROL:
        d.pop(k, None)
    d.get("data", {}).pop("worker_count", None)
    for k in MODEL_EXECUTION:
        d.get("model", {}).pop(k, None)
    return d
