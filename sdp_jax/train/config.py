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
from sdp_jax.models.llama import LlamaConfig
from sdp_jax.models.vision import VisionConfig
from sdp_jax.options import StepOptions
from sdp_jax.pipeline import PipelineConfig
from sdp_jax.train import data, vision_data
from sdp_jax.train.optimizer import OptimConfig


def defaults(cls, drop: tuple = (), **fields) -> ml_collections.ConfigDict:
    """A config section with the defaults of the dataclass ``cls`` (the single place they are
    declared: :class:`sdp_jax.train.optimizer.OptimConfig`,
    :class:`sdp_jax.models.llama.LlamaConfig`, :class:`sdp_jax.pipeline.PipelineConfig`),
    without the fields ``drop``, with ``fields`` added first."""
    values = {k: v for k, v in dataclasses.asdict(cls()).items() if k not in drop}
    return ml_collections.ConfigDict({**fields, **values})


def _run_fields(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The fields of every run config (set on ``c``; families change some defaults)."""
    c.sdp = ml_collections.ConfigDict(dict(
        variant="ddp",            # ddp | b-sdp | n-sdp | bb-sdp | nb-sdp
        # C: fraction of blocks / neurons / heads each worker holds, or "auto": the largest
        # realizable C whose compiled step fits memory_budget_gib (sdp_jax.train.fit)
        coverage=ml_collections.FieldReference(1.0, field_type=object),
        memory_budget_gib=0.0,    # GiB per device for coverage=auto; 0 = the accelerator's x 0.9
        scheme="cyclic",          # cyclic | random | grouped (disconnected: allow_disconnected)
        mask_seed=0,              # seed of the random scheme
        allow_nonuniform=False,   # accept W*C not whole (near-uniform multiplicities)
        allow_disconnected=False, # accept a mask graph with spectral gap 0
    ))
    c.optim = defaults(OptimConfig)   # AdamW (or SGD), schedule cosine | wsd
    c.workers = 0               # W data-parallel workers; 0 = every device
    # The step's settings, declared in sdp_jax.options.StepOptions (sdp.average, sdp.sync_every,
    # sdp.method, fsdp, remat, dtype, emulate_workers, grad_accum, optim.grad_clip)
    for path, default in fields.setting_defaults(StepOptions).items():
        *sections, name = path.split(".")
        node = c
        for section in sections:
            node = node[section]
        node[name] = default
    c.optim.grad_clip = 1.0     # a run clips by default (the library's StepOptions does not)
    c.num_cpu_devices = 8       # simulated devices when only a CPU is present
    c.batch_per_worker = 8      # examples per worker per step (b); global batch = W * b
    c.steps = 300               # optimizer steps (the DDP budget when flop_matched)
    c.flop_matched = False      # SDP runs ceil(steps / C) steps (the paper's FLOP-matched budget)
    c.eval_every = 100          # steps between full-model evaluations (and at the end)
    c.log_every = 10            # steps between progress updates
    c.checkpoint_every = 100    # steps between checkpoints (and at the end); 0 = only at the end
    c.keep_checkpoints = 2
    c.stop_at_step = 0          # stop (as if preempted) once this step is reached; 0 = off
    c.elastic = False           # resume a checkpoint of another W / coverage / variant (re-laid out)
    c.peak_flops = 0.0          # FLOP/s per device for MFU; 0 = the device's known bf16 peak (none on CPU)
    c.align_every = 0           # steps between gradient-alignment measurements; 0 = off
    c.profile_start = 0         # first step of a profiler trace into WORKDIR/profile/; 0 = off
    c.profile_stop = 0          # its last step (inclusive; see sdp_jax.train.profiling)
    c.seed = 0
    return c


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
    (:func:`sdp_jax.train.data.default_data_config`), ``sdp`` (variant and mask recipe), ``pipeline``
    (:class:`sdp_jax.pipeline.PipelineConfig` fields), ``optim``
    (:class:`sdp_jax.train.optimizer.OptimConfig` fields), and run control at the top level.
    """
    c = ml_collections.ConfigDict()
    # (subnet_rescale is a field of the vision models' configs only: LLaMA runs keep the
    # dataclass's default)
    c.model = defaults(LlamaConfig, name="llama", drop=("subnet_rescale",))
    c.data = data.default_data_config()
    _run_fields(c)
    # Pipeline stages on the mesh axis `stage` (W * stages devices), with compressed boundaries
    # (MAPL): see sdp_jax.pipeline.PipelineConfig. stages=1: no pipeline.
    c.pipeline = defaults(PipelineConfig)   # stages, schedule gpipe | 1f1b, method, ratio, ...
    c.seq_len = 128             # tokens per sequence (T)
    c.eval_batches = 8          # validation batches of W * b sequences
    c.init_from = ""            # a Hugging Face LLaMA folder the run starts from ('' = init)
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
    takes the dataset's), ``data`` (:func:`sdp_jax.train.vision_data.default_vision_data_config`),
    and the ``sdp``, ``optim`` and run-control fields of every run (:func:`_run_fields`, with
    vision defaults: AdamW 2e-3 with warm-up and cosine decay), with ``eval_limit`` (test images per evaluation; 0 =
    the whole test split) instead of ``eval_batches``, ``eval_bn_batches`` (see
    :attr:`sdp_jax.train.families.VisionEval.recalibrate`) and ``sdp.stage_blocks``.
    """
    c = ml_collections.ConfigDict()
    # the model's fields and defaults (VisionConfig); num_classes 0: the dataset's
    c.model = ml_collections.ConfigDict({**VisionConfig.section(name), "num_classes": 0})
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
