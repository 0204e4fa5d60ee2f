"""Language-model runs (LLaMA, optionally pipelined): config -> validated run -> the loop.

``train(config, workdir)`` is what ``python train.py`` runs for a language model. It validates
everything it can before any compute (variant, coverage, worker count, data files, config
compatibility with an existing checkpoint), builds the mesh and the step
(:class:`sdp_jax.step.SDPStep`; with ``pipeline.stages > 1`` its loss is the GPipe schedule of
:mod:`sdp_jax.pipeline`), and hands them to the shared loop :mod:`sdp_jax.loop` (checkpoints,
progress, ``metrics.jsonl``, signals, ``summary.json``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import jax
import numpy as np

from sdp_jax import checkpoint as ckpt_lib
from sdp_jax import data as data_lib
from sdp_jax import loop
from sdp_jax import pipeline as pl
from sdp_jax import spec as spec_lib
from sdp_jax import step as step_lib
from sdp_jax import tasks
from sdp_jax import train_step as ts
from sdp_jax.models.llama import LlamaConfig


@dataclasses.dataclass
class RunSpec:
    """Everything derived from a config before compute (host-side, no devices touched)."""

    model: LlamaConfig
    optim: ts.OptimConfig
    plan: spec_lib.SDPSpec
    workers: int
    total_steps: int
    global_batch: int
    byte_level: bool
    pipe: pl.PipelineConfig = dataclasses.field(default_factory=pl.PipelineConfig)


def resolve(config, device_count: int) -> RunSpec:
    """Validate a run config and derive the run's static facts.

    Args:
      config: the run ``ConfigDict`` (see :func:`sdp_jax.config.base_config`).
      device_count: devices available (``jax.device_count()``).

    Raises:
      ValueError: with the bad value and a fix, for any invalid field.
    """
    model = LlamaConfig.from_config(config.model)
    optim = ts.OptimConfig.from_config(config.optim)
    loop.check_run_fields(config, ("seq_len", "batch_per_worker", "steps", "eval_batches",
                                   "log_every", "keep_checkpoints", "num_cpu_devices"),
                          ("eval_every", "checkpoint_every", "stop_at_step", "seed"))
    if config.seq_len > model.max_seq_len:
        raise ValueError(f"config.seq_len={config.seq_len} exceeds model.max_seq_len="
                         f"{model.max_seq_len}; lower seq_len or raise model.max_seq_len.")
    loop.check_step_fields(config)
    pipe = pl.PipelineConfig.from_config(config.get("pipeline", {}))
    if pipe.stages > 1:
        pipe.check(model, config.batch_per_worker, config.fsdp, config.sdp.average)
        workers = config.workers or max(device_count // pipe.stages, 1)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"config.workers={config.workers!r} must be a positive integer "
                             "or 0 (= devices / pipeline.stages).")
        if workers * pipe.stages > device_count:
            raise ValueError(f"workers * pipeline.stages = {workers} * {pipe.stages} devices "
                             f"needed, {device_count} present; lower --config.workers or "
                             "--config.pipeline.stages (on a CPU, raise "
                             "--config.num_cpu_devices).")
    else:
        workers = loop.resolve_workers(config, device_count)
    sdp = config.sdp
    if sdp.method not in tasks.METHODS:
        raise ValueError(f"config.sdp.method={sdp.method!r}; use one of "
                         f"{', '.join(tasks.METHODS)}.")
    # With a pipeline the masks are over one stage's L / P blocks (the same in every stage).
    plan = ts.make_plan(sdp.variant, model, workers, sdp.coverage, sdp.scheme,
                        sdp.mask_seed, sdp.allow_nonuniform, sdp.allow_disconnected, pipe=pipe)
    total = config.steps
    if config.flop_matched and sdp.variant != "ddp":
        total = ts.flop_matched_steps(config.steps, plan.coverage)
    loop.check_warmup(optim, total)
    byte_level = config.data.source != "llmc"
    if byte_level and model.vocab_size < data_lib.VOCAB_BYTES:
        raise ValueError(f"byte-level data needs model.vocab_size >= 256, got {model.vocab_size}.")
    return RunSpec(model, optim, plan, workers, total, workers * config.batch_per_worker,
                   byte_level, pipe)


def make_step(config, spec: RunSpec, mesh) -> step_lib.SDPStep:
    """The :class:`sdp_jax.step.SDPStep` of a run config (``spec`` from :func:`resolve`;
    ``mesh`` ``('data',)``, or from :func:`sdp_jax.pipeline.make_mesh` when pipelined)."""
    return tasks.language_model_step(
        spec.model, spec.plan, spec.optim, mesh, spec.total_steps,
        averaging=config.sdp.average, sync_every=config.sdp.sync_every,
        method=config.sdp.method, fsdp=config.fsdp, remat=config.remat, dtype=config.dtype,
        pipe=spec.pipe)


def boundary_bytes(config, spec: RunSpec, compiled) -> dict:
    """Stage-boundary bytes of a pipelined run's compiled train step
    (:func:`sdp_jax.pipeline.boundary_bytes` with the run's tokens per worker, stages and RVQ
    codebook synchronization)."""
    return pl.boundary_bytes(compiled, tokens_per_worker=config.batch_per_worker * config.seq_len,
                             stages=spec.pipe.stages,
                             codebook_bytes=pl.codebook_sync_bytes(spec.model, spec.pipe))


def make_mesh(spec: RunSpec):
    """The run's mesh: ``('data',)`` of ``W`` devices, or ``('data', 'stage')`` of
    ``W x P`` when pipelined."""
    devices = jax.devices()[:spec.workers * spec.pipe.stages]
    if spec.pipe.stages > 1:
        return pl.make_mesh(spec.workers, spec.pipe.stages, devices)
    return jax.make_mesh((spec.workers,), (ts.AXIS,), devices=devices)


def check_workdir(config, workdir: str, spec: RunSpec | None = None) -> None:
    """Refuse, before any compute, a ``workdir`` whose latest checkpoint another config wrote.

    Raises:
      ValueError: listing the differing fields (see
        :meth:`sdp_jax.checkpoint.CheckpointManager.check_compatible`)."""
    path = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(path):
        return
    spec = spec or resolve(config, jax.device_count())
    manager = ckpt_lib.CheckpointManager(path, keep=config.keep_checkpoints)
    try:
        latest = manager.latest_step()
        if latest is not None:
            manager.check_compatible(latest, _meta(config, spec), defaults=_ADDED_FIELDS)
    finally:
        manager.close()


def _meta(config, spec: RunSpec) -> dict:
    return {"config": loop.trajectory_config(config), "masks": spec.plan.record()}


# Config fields added after checkpoints were first written, with the value that older runs used.
_ADDED_FIELDS = {"fsdp": False, "dtype": "float32",
                 "pipeline": dict(pl.PipelineConfig().__dict__)}

def train(config, workdir: str) -> dict[str, Any]:
    """Train (or resume) the language-model run described by ``config`` in ``workdir``.

    Writes ``workdir/metrics.jsonl`` (one record per logged step: ``step``, ``train_loss``,
    ``grad_norm``, ``lr``, ``tokens_per_s``; on eval steps ``val_loss`` nats/token and, for
    byte-level data, ``val_bpb`` bits/byte), ``workdir/checkpoints/`` (orbax) and
    ``workdir/summary.json``.

    Returns:
      the summary dict.

    Raises:
      ValueError: invalid config or data, or a checkpoint in ``workdir`` from another config
        (raised before any training step).
    """
    t_start = time.time()
    loop.canonical_dtype(config)
    spec = resolve(config, jax.device_count())
    loop.check_workdir_is_dir(workdir)
    W, T, pipe = spec.workers, config.seq_len, spec.pipe
    mesh = make_mesh(spec)
    devices = list(mesh.devices.flat)
    mask_info = spec.plan.summary()

    # Data first: a bad path or a split too small fails here, before any compile.
    loop.log(data_lib.describe(config.data))
    pidx, pcount = jax.process_index(), jax.process_count()
    train_iter = data_lib.make_train_iterator(
        config.data, seq_len=T, global_batch=spec.global_batch, seed=config.seed,
        vocab_size=spec.model.vocab_size, process_index=pidx, process_count=pcount)
    val_batches = data_lib.make_val_batches(
        config.data, seq_len=T, global_batch=spec.global_batch, num_batches=config.eval_batches,
        vocab_size=spec.model.vocab_size, process_index=pidx, process_count=pcount)

    meta = _meta(config, spec)
    manager, latest = loop.open_checkpoints(config, workdir, meta, defaults=_ADDED_FIELDS)

    builder = make_step(config, spec, mesh)
    counts = spec.model.param_count()
    loop.log(f"devices: {len(devices)} x {devices[0].platform} ({jax.process_count()} "
             f"process(es)); {spec.plan.describe()}"
             + (f"; parameters averaged over holders every {config.sdp.sync_every} steps"
                if config.sdp.average == "parameters" else "")
             + (f"; FSDP (ZeRO-3) over the {W} workers" if config.fsdp else "")
             + (f"; activation checkpointing: {config.remat}" if config.remat != "none" else "")
             + (f"; compute dtype {config.dtype}" if config.dtype != "float32" else ""))
    if pipe.stages > 1:
        loop.log(f"pipeline: {pipe.stages} stages x {W} workers ({pipe.schedule}, "
                 f"{pipe.microbatches} microbatches); masks are per stage "
                 f"({spec.model.n_layers // pipe.stages} blocks each); boundaries: {pipe.method}"
                 + (f", {pipe.ratio}x (r = {pipe.width(spec.model.d_model)}), anchors of rank "
                    f"{pipe.anchor_rank}" if pipe.compressed else "")
                 + (f", RVQ {pipe.rvq_levels} levels x {pipe.rvq_codebook} codes"
                    if pipe.quantized else "")
                 + (f"; {pl.boundary_param_count(spec.model, pipe):,} boundary parameters "
                    "(not in the total below)" if pipe.compressed else ""))
    mult = ", ".join(f"{k} {v['multiplicity_min']}..{v['multiplicity_max']}"
                     for k, v in mask_info["kinds"].items())
    loop.log(f"mask graph: spectral gap {mask_info['spectral_gap']:.4f}; multiplicity {mult}; "
             f"params: total {counts['total']:,}, stored per device "
             f"{builder.per_device_param_count():,}")

    # Restore before compiling: an unreadable checkpoint is reported before any compute.
    state, start = loop.restore_or_init(manager, latest, builder, train_iter, config.seed)

    batch_shape = (spec.global_batch, T + 1)
    t0 = time.time()
    step_fn = builder.compiled_train_step(jax.ShapeDtypeStruct(batch_shape, np.int32))
    step_fn_local = builder.train_step_fn(sync_now=False)  # = step_fn unless average=parameters
    mem = ts.memory_stats(step_fn)
    loop.log(f"compiled train step in {time.time() - t0:.1f}s: peak "
             f"{loop.fmt_bytes(mem['peak_bytes_per_device'])} per device")
    boundary = None
    if pipe.stages > 1:
        boundary = boundary_bytes(config, spec, step_fn)
        loop.log(f"stage boundaries: {loop.fmt_bytes(boundary['per_boundary'])} per boundary "
                 f"per worker per step ({boundary['per_token']:.1f} bytes/token, forward and "
                 "backward, from the compiled program)")
    eval_fn = builder.eval_step_fn()
    batch_sharding = builder.batch_sharding()

    def device_batch(x):
        return jax.make_array_from_process_local_data(batch_sharding, x, batch_shape)

    def evaluate(state):
        losses = [float(eval_fn(state["params"], device_batch(vb))) for vb in val_batches]
        v = float(np.mean(losses))
        return {"val_loss": v, **({"val_bpb": v / math.log(2)} if spec.byte_level else {})}

    def one_step(state, batch, step):
        fn = step_fn if builder.is_sync_step(step) else step_fn_local
        return fn(state, device_batch(batch))

    def postfix(rec):
        post = {"loss": f"{rec['train_loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
        if "ortho_err" in rec:
            post["|A'A-I|"] = f"{rec['ortho_err']:.1e}"
        if "val_loss" in rec:
            post["val"] = f"{rec['val_loss']:.3f}"
        return post

    tokens_per_step = spec.global_batch * T

    def summary(step, last_val, last_rec, wall):
        return {
            "variant": config.sdp.variant, "regime": spec.plan.regime,
            "coverage": spec.plan.coverage, "workers": W, "scheme": config.sdp.scheme,
            "average": config.sdp.average, "sync_every": config.sdp.sync_every,
            "fsdp": config.fsdp, "remat": config.remat, "dtype": config.dtype,
            "n_layers": spec.model.n_layers, "steps": step, "total_steps": spec.total_steps,
            "completed": step >= spec.total_steps, "tokens": step * tokens_per_step,
            "final_val_loss": last_val.get("val_loss"), "final_val_bpb": last_val.get("val_bpb"),
            "wall_s": wall,
            "peak_bytes_per_device": mem["peak_bytes_per_device"], "memory": mem,
            "params_total": counts["total"],
            "params_per_device": builder.per_device_param_count(),
            "masks": mask_info, "spectral_gap": mask_info["spectral_gap"],
            "platform": devices[0].platform, "pipeline": dict(pipe.__dict__),
            "boundary_bytes_per_token": boundary["per_token"] if boundary else None,
            "boundary_bytes_per_step": boundary["per_boundary"] if boundary else None,
            "final_ortho_err": last_rec.get("ortho_err"),
        }

    def done_line(s):
        bpb = f", {s['final_val_bpb']:.3f} bits/byte" if spec.byte_level else ""
        return (f"done: {s['steps']} steps in {s['wall_s']:.0f}s; final val loss "
                f"{s['final_val_loss']:.4f} nats/token{bpb}")

    def already_line(s):
        return (f"already complete: {s['steps']} steps; final val loss {s['final_val_loss']:.4f} "
                "nats/token")

    run = loop.Run(one_step, evaluate, tokens_per_step, "tokens_per_s", postfix, summary,
                   done_line, already_line)
    return loop.run(config, workdir, run, state=state, start=start, total=spec.total_steps,
                    manager=manager, meta=meta, train_iter=train_iter, t_start=t_start)
