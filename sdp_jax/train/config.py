"""The run configuration (``ml_collections.ConfigDict``) of every model family: its fields and
defaults. The one place that validates it is :func:`sdp_jax.train.run.resolve`.

:func:`base_config` (language models) and :func:`vision_config` (image classifiers) share one
schema: the ``sdp``, ``optim`` and run-control fields are defined once (:func:`_run_fields`);
a family adds its ``model`` and ``data`` sections and a few fields of its own (language models:
``seq_len``, ``eval_batches``, ``pipeline``; vision: ``eval_limit``, ``eval_bn_batches``,
``sdp.stage_blocks``). A user's model (:class:`sdp_jax.train.task.Task`) adds only its ``model``
section (:func:`task_config`).

Every field can be overridden on the command line: ``--config.sdp.coverage=0.5``.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from sdp_jax import fields
from sdp_jax.fields import setting
from sdp_jax.models.llama import LlamaConfig
from sdp_jax.models.vision import VisionConfig
from sdp_jax.options import MeshShape, StepOptions
from sdp_jax.pipeline.schedules import PipelineConfig
from sdp_jax.spec.masks import SCHEMES
from sdp_jax.spec.sdp_spec import VARIANTS
from sdp_jax.train.data import tokens as data
from sdp_jax.train.data import vision as vision_data
from sdp_jax.train.optimizer import OptimConfig


@dataclasses.dataclass(frozen=True)
class SdpConfig:
    """The ``sdp`` section's mask recipe (the averaging fields of the section are the step's:
    :class:`sdp_jax.options.StepOptions`).

    Raises:
      ValueError: a field of the wrong type, out of bounds or not one of its choices, naming
        ``config.sdp.FIELD``; a coverage that is neither a number in (0, 1] nor ``auto``."""

    SECTION = "sdp"

    variant: str = setting("ddp", "ddp, b-sdp, n-sdp (forward masking: the subnetwork alone "
                           "runs), bb-sdp, nb-sdp (backward masking: full forward, sparse "
                           "gradients); ddp ignores coverage", choices=VARIANTS)
    coverage: object = setting(1.0, "C, the fraction of blocks (or of each block's neurons and "
                               "head groups) each worker holds, in (0, 1]; C·G and W·C must be "
                               "whole; or auto: the largest realizable C whose compiled train "
                               "step fits sdp.memory_budget_gib", kind=object,
                               rule="a number in (0, 1], or auto")
    memory_budget_gib: float = setting(0.0, "GiB per device the compiled train step must fit "
                                       "(coverage=auto, and every run when > 0); 0 = the "
                                       "accelerator's memory x 0.9", kind=float, low=0,
                                       control=True)
    scheme: str = setting("cyclic", "cyclic (sliding windows, connected), random (balanced, "
                          "seeded by mask_seed) or grouped (groups that share nothing: needs "
                          "allow_disconnected)", choices=SCHEMES)
    mask_seed: int = setting(0, "seed of the random scheme's masks", low=0)
    allow_nonuniform: bool = setting(False, "accept W·C not whole: each component held by "
                                     "floor(W·C) or ceil(W·C) workers")
    allow_disconnected: bool = setting(False, "accept a mask graph with spectral gap 0")

    def __post_init__(self):
        fields.check_settings(self)
        check_coverage(self.coverage)


def check_coverage(cov) -> None:
    """``sdp.coverage``: a number in (0, 1], or ``auto``.

    Raises:
      ValueError: naming the value and the fix."""
    if cov != "auto" and (isinstance(cov, bool) or not isinstance(cov, (int, float))
                          or not 0 < cov <= 1):
        raise ValueError(f"config.sdp.coverage={cov!r} must be a number in (0, 1] (the fraction "
                         "of components each worker holds; 1 for ddp), or auto (the largest "
                         "that fits --config.sdp.memory_budget_gib).")


@dataclasses.dataclass(frozen=True)
class RunControl:
    """The top-level fields of every run: devices, batch, length, logging, checkpoints.

    Raises:
      ValueError: a field of the wrong type or out of bounds, naming ``config.FIELD``."""

    workers: int = setting(0, "W data-parallel workers; 0 = every device (/ pipeline.stages)",
                           low=0)
    num_cpu_devices: int = setting(8, "devices simulated when only a CPU is present", low=1,
                                   control=True)
    batch_per_worker: int = setting(8, "b, examples per worker per step; the global batch is "
                                    "W·b", low=1)
    steps: int = setting(300, "optimizer steps (the DDP budget when flop_matched); 0 = train "
                         "nothing: the initial state is saved as step 0 and evaluated", low=0)
    flop_matched: bool = setting(False, "an SDP run takes ceil(steps / C) steps (the paper's "
                                 "FLOP-matched budget)")
    eval_every: int = setting(100, "steps between full-model evaluations (and at the end; 0 = "
                              "only at the end)", low=0, control=True)
    log_every: int = setting(10, "steps between progress lines and metrics.jsonl records",
                             low=1, control=True)
    checkpoint_every: int = setting(100, "steps between orbax checkpoints (and at the end; 0 = "
                                    "only at the end)", low=0, control=True)
    keep_checkpoints: int = setting(2, "the last this many checkpoints are kept", low=1,
                                    control=True)
    stop_at_step: int = setting(0, "stop (saving a checkpoint) once this step is reached, as a "
                                "preemption would; 0 = off", low=0, control=True)
    elastic: bool = setting(False, "resume a checkpoint written under another W, coverage, "
                            "scheme, variant, fsdp or batch_per_worker, re-laid out "
                            "(docs/checkpoints.md); False refuses it", control=True)
    peak_flops: float = setting(0.0, "a device's peak FLOP/s for mfu (e.g. 989e12 for an "
                                "H100's bf16); 0 = known GPUs and TPUs only", kind=float, low=0,
                                    control=True)
    align_every: int = setting(0, "steps between gradient-alignment measurements "
                               "(grad_alignment, update_alignment in metrics.jsonl); 0 = off",
                               low=0, control=True)
    profile_start: int = setting(0, "first optimizer step traced by JAX's profiler into "
                                 "WORKDIR/profile/ (with profile_stop; both 0 = off)", low=0,
                                     control=True)
    profile_stop: int = setting(0, "last step traced (inclusive)", low=0, control=True)
    seed: int = setting(0, "seed of the parameters' initialization and of the data order",
                        low=0, high=2**31, open_high=True)

    def __post_init__(self):
        fields.check_settings(self)


@dataclasses.dataclass(frozen=True)
class LanguageModelRun:
    """The fields of a language-model run besides every run's (:class:`RunControl`) and its
    sections.

    Raises:
      ValueError: a field of the wrong type or out of bounds, naming ``config.FIELD``."""

    name: str = setting("llama", "the model family (llama; the vision models' names under "
                        "Vision models)", path="model.name", choices=("llama",))
    seq_len: int = setting(128, "T, tokens per sequence", low=1)
    eval_batches: int = setting(8, "validation batches of W·b sequences per evaluation", low=1,
                                control=True)
    init_from: str = setting("", "a Hugging Face LLaMA folder (LlamaForCausalLM, safetensors) "
                             "the run starts from when it has no checkpoint ('' = init)",
                                 control=True)

    def __post_init__(self):
        fields.check_settings(self)


@dataclasses.dataclass(frozen=True)
class VisionRun:
    """The fields of a vision run besides every run's (:class:`RunControl`) and its sections.

    Raises:
      ValueError: a field of the wrong type or out of bounds, naming ``config.FIELD``."""

    eval_limit: int = setting(0, "test images per evaluation (0 = the whole test split)", low=0,
                              control=True)
    eval_bn_batches: int = setting(8, "forward-masking SDP with BatchNorm: training batches on "
                                   "which the full model's BatchNorm statistics are "
                                   "re-estimated before each evaluation", low=0, control=True)
    stage_blocks: tuple = setting((), "B-SDP: blocks per worker in each stage, e.g. "
                                  "(1, 2, 4, 1); () = apportion C over the stages",
                                  path="sdp.stage_blocks")

    def __post_init__(self):
        fields.check_settings(self)


# The declarations every run config is built from, in the order of its fields.
EVERY_RUN = (SdpConfig, StepOptions, OptimConfig, RunControl, MeshShape)
# Every declaration of a family's run config, in the order docs/configuration.md lists them.
LANGUAGE_MODEL_DECLARED = (SdpConfig, StepOptions, RunControl, MeshShape, LanguageModelRun,
                           OptimConfig, LlamaConfig, PipelineConfig, data.DataConfig)
VISION_DECLARED = (VisionRun, VisionConfig, vision_data.VisionDataConfig)


def _leaves(config, prefix: str = "") -> dict:
    """``{dotted path: value}`` of a config's leaves."""
    out = {}
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def declared_rows(classes: tuple, configs: list) -> list[tuple[str, object, str, str]]:
    """``(path, default, rule, doc)`` of every field the declarations ``classes`` give a run
    config, the default read from the first of ``configs`` (``ConfigDict``) that has the field;
    declared fields none of them has are left out (e.g. LLaMA's ``model.subnet_rescale``)."""
    leaves = [_leaves(c) for c in configs]
    rows = []
    for cls in classes:
        for path, rule, doc in fields.setting_rows(cls):
            have = [c[path] for c in leaves if path in c]
            if have:
                rows.append((path, have[0], rule, doc))
    return rows


def control_paths() -> tuple[str, ...]:
    """The fields of every built-in run config declared ``control=True``: a checkpoint written
    under other values still resumes (:func:`sdp_jax.fields.control_paths`)."""
    return fields.control_paths(*dict.fromkeys(EVERY_RUN + LANGUAGE_MODEL_DECLARED
                                               + VISION_DECLARED))


def undeclared(config, classes: tuple) -> list[str]:
    """The fields of ``config`` that none of ``classes`` declares (none, for a built-in
    family's config: every field is declared once)."""
    declared = {fields.config_path(cls, f) for cls in classes for f in fields.settings(cls)}
    return sorted(set(_leaves(config)) - declared)


def declare(c: ml_collections.ConfigDict, *classes, drop: tuple = ()) -> ml_collections.ConfigDict:
    """Set on ``c`` the fields of the declared ``classes`` (:func:`sdp_jax.fields.setting`) at
    their paths with their defaults, sections created as needed, except the paths in ``drop``;
    a field declared ``object`` or ``tuple`` is typed so that ``--config.X=V`` can give
    another type (``sdp.coverage=auto``, a tuple)."""
    for cls in classes:
        for f in fields.settings(cls):
            path = fields.config_path(cls, f)
            if path is None or path in drop:
                continue
            *sections, name = path.split(".")
            node = c
            for section in sections:
                if section not in node:
                    node[section] = ml_collections.ConfigDict()
                node = node[section]
            default, kind = f.metadata["run_default"], f.metadata["kind"]
            node[name] = (ml_collections.FieldReference(default, field_type=kind)
                          if kind in (object, tuple) else default)
    return c


def _run_fields(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The fields of every run config (set on ``c``; families change some defaults)."""
    return declare(c, *EVERY_RUN)


def task_config(model: dict) -> ml_collections.ConfigDict:
    """The run config of a user's model (:meth:`sdp_jax.train.task.Task.config`): the ``sdp``,
    ``optim`` and run-control fields of every run (:func:`_run_fields`) and the section
    ``model`` with the fields of ``model`` (``name`` and the model's own, with their
    defaults)."""
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(model))
    return _run_fields(c)


def base_config() -> ml_collections.ConfigDict:
    """A language-model run; the ``configs/llama_*.py`` files set the model shape on top.

    Sections: ``model`` (:class:`sdp_jax.models.llama.LlamaConfig` fields), ``data``
    (:class:`sdp_jax.train.data.DataConfig`), ``sdp`` (variant and mask recipe), ``pipeline``
    (:class:`sdp_jax.pipeline.PipelineConfig` fields), ``optim``
    (:class:`sdp_jax.train.optimizer.OptimConfig` fields), and run control at the top level.
    """
    c = ml_collections.ConfigDict()
    # (subnet_rescale is a field of the vision models' configs only: LLaMA runs keep the
    # dataclass's default)
    declare(c, LanguageModelRun, LlamaConfig, data.DataConfig, drop=("model.subnet_rescale",))
    _run_fields(c)
    # Pipeline stages on the mesh axis `stage` (W * stages devices), with compressed boundaries
    # (MAPL): see sdp_jax.pipeline.PipelineConfig. stages=1: no pipeline.
    return declare(c, PipelineConfig)


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
    takes the dataset's), ``data`` (:class:`sdp_jax.train.data.vision.VisionDataConfig`),
    and the ``sdp``, ``optim`` and run-control fields of every run (:func:`_run_fields`, with
    vision defaults: AdamW 2e-3 with warm-up and cosine decay), with ``eval_limit`` (test images per evaluation; 0 =
    the whole test split) instead of ``eval_batches``, ``eval_bn_batches`` (see
    :attr:`sdp_jax.train.families.VisionEval.recalibrate`) and ``sdp.stage_blocks``.
    """
    c = ml_collections.ConfigDict()
    # the model's fields and defaults (VisionConfig); num_classes 0: the dataset's
    c.model = ml_collections.ConfigDict(VisionConfig.section(name))
    declare(c, vision_data.VisionDataConfig)
    c.data.dataset = dataset
    declare(_run_fields(c), VisionRun)
    # vision defaults
    c.optim.update(lr=2e-3, min_lr_ratio=0.01, warmup_steps=100, weight_decay=0.05, b2=0.999)
    c.update(batch_per_worker=64, steps=8000, eval_every=1000, log_every=50,
             checkpoint_every=1000)
    return c
