"""The training loop: config -> validated run -> resumable training with metrics and summary.

``train(config, workdir)`` is what ``python train.py`` runs. It validates everything it can
before any compute (variant, coverage, worker count, data files, config compatibility with an
existing checkpoint), builds the mesh and :class:`sdp_jax.train_step.StepBuilder`, restores the
latest checkpoint in ``workdir`` if one exists, and trains with a progress bar, writing
``metrics.jsonl`` and ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import threading
import time
from typing import Any

import jax
import numpy as np

from sdp_jax import checkpoint as ckpt_lib
from sdp_jax import data as data_lib
from sdp_jax import pipeline as pl
from sdp_jax import plan as plan_lib
from sdp_jax import train_step as ts
from sdp_jax.models.llama import LlamaConfig


@dataclasses.dataclass
class RunSpec:
    """Everything derived from a config before compute (host-side, no devices touched)."""

    model: LlamaConfig
    optim: ts.OptimConfig
    plan: plan_lib.SDPPlan
    workers: int
    total_steps: int
    global_batch: int
    byte_level: bool
    pipe: pl.PipelineConfig = dataclasses.field(default_factory=pl.PipelineConfig)


def _positive_int(config, name):
    v = config[name]
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"config.{name}={v!r} must be a positive integer.")
    return v


def resolve_workers(config, device_count: int) -> int:
    """``W`` from ``config.workers`` (0 = every device).

    Raises:
      ValueError: not a positive integer, more than the devices, or not every device with
        several processes."""
    workers = config.workers or device_count
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"config.workers={config.workers!r} must be a positive integer or 0 "
                         "(= every device).")
    if workers > device_count:
        hint = (f", or simulate more CPU devices with --config.num_cpu_devices={workers}"
                if jax.devices()[0].platform == "cpu" else "")
        raise ValueError(f"config.workers={workers} but only {device_count} devices are "
                         f"available; lower --config.workers (0 = every device){hint}.")
    if jax.process_count() > 1 and workers != device_count:
        raise ValueError(f"with several processes every device is a worker: set "
                         f"--config.workers=0 (got {workers} of {device_count}).")
    return workers


def check_mask_graph(plan, config) -> None:
    """Refuse masks whose mask graph is disconnected (spectral gap 0) unless allowed.

    Raises:
      ValueError: naming the scheme, variant, W and C, and the fixes."""
    sdp = config.sdp
    if plan.workers > 1 and plan.coverage < 1 and plan.summary()["spectral_gap"] < 1e-9 \
            and not sdp.allow_disconnected:
        raise ValueError(
            f"the mask graph of {sdp.scheme} {sdp.variant} masks for W={plan.workers}, "
            f"C={plan.coverage} is disconnected (spectral gap 0): some groups of workers share "
            "no component, so their copies never mix. Choose a larger coverage, another scheme, "
            "or set --config.sdp.allow_disconnected=True.")


def previous_wall(summary_path: str, start: int) -> float:
    """Wall seconds of the invocations before a resumed one (0 for a fresh run)."""
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            prev = json.load(f)
        if prev.get("steps") == start:
            return float(prev.get("wall_s", 0.0))
    return 0.0


def log_stopped(step: int, total: int, interrupted: list) -> None:
    """The last line of a run that stopped before its end (it resumes from its checkpoint)."""
    why = f"interrupted by {interrupted[0]}" if interrupted else "stopped"
    how = ("rerun the same command" if interrupted else
           "rerun without --config.stop_at_step (or with a later step)")
    _log(f"{why} at step {step} of {total} (checkpoint saved); {how} to resume.")


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
    for name in ("seq_len", "batch_per_worker", "steps", "eval_batches", "log_every",
                 "keep_checkpoints", "num_cpu_devices"):
        _positive_int(config, name)
    for name in ("eval_every", "checkpoint_every", "stop_at_step", "seed"):
        v = config[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"config.{name}={v!r} must be an integer >= 0.")
    wc = config.data.worker_count
    if isinstance(wc, bool) or not isinstance(wc, int) or wc < 0:
        raise ValueError(f"config.data.worker_count={wc!r} must be an integer >= 0 "
                         "(0 = read data in the training process).")
    if config.seq_len > model.max_seq_len:
        raise ValueError(f"config.seq_len={config.seq_len} exceeds model.max_seq_len="
                         f"{model.max_seq_len}; lower seq_len or raise model.max_seq_len.")
    pipe = pl.PipelineConfig.from_config(config.get("pipeline", {}))
    if pipe.stages > 1:
        _check_pipeline(config, pipe, model, device_count)
        workers = config.workers or max(device_count // pipe.stages, 1)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"config.workers={config.workers!r} must be a positive integer "
                             "or 0 (= devices / pipeline.stages).")
        if workers * pipe.stages > device_count:
            raise ValueError(f"workers * pipeline.stages = {workers} * {pipe.stages} devices "
                             f"needed, {device_count} present; lower --config.workers or "
                             "--config.pipeline.stages (on a CPU, raise "
                             "--config.num_cpu_devices).")
        plan_model = dataclasses.replace(model, n_layers=model.n_layers // pipe.stages)
    else:
        workers = resolve_workers(config, device_count)
        plan_model = model
    sdp = config.sdp
    if sdp.method not in ts.METHODS:
        raise ValueError(f"config.sdp.method={sdp.method!r}; use one of {', '.join(ts.METHODS)}.")
    if not isinstance(config.fsdp, bool):
        raise ValueError(f"config.fsdp={config.fsdp!r} must be True or False.")
    if config.remat not in ts.REMAT:
        raise ValueError(f"config.remat={config.remat!r}; use one of {', '.join(ts.REMAT)}.")
    if config.dtype not in ts.DTYPES:
        raise ValueError(f"config.dtype={config.dtype!r}; use float32 or bfloat16.")
    if config.fsdp and sdp.average == "parameters":
        raise ValueError("config.sdp.average=parameters needs per-worker parameter copies, but "
                         "--config.fsdp=True stores one sharded copy; use average=gradients "
                         "or fsdp=False.")
    if sdp.average not in ts.AVERAGING:
        raise ValueError(f"config.sdp.average={sdp.average!r}; use gradients or parameters.")
    if isinstance(sdp.sync_every, bool) or not isinstance(sdp.sync_every, int) \
            or sdp.sync_every < 1:
        raise ValueError(f"config.sdp.sync_every={sdp.sync_every!r} must be a positive integer.")
    if sdp.average == "gradients" and sdp.sync_every != 1:
        raise ValueError(f"config.sdp.sync_every={sdp.sync_every} only applies with "
                         "--config.sdp.average=parameters (gradients are averaged every step); "
                         "set both or neither.")
    if sdp.average == "parameters" and sdp.variant in plan_lib.BACKWARD_VARIANTS:
        raise ValueError(f"config.sdp.average=parameters is not available for {sdp.variant} "
                         "(backward masking keeps every worker's full parameters identical); "
                         "use average=gradients or a forward variant (ddp, b-sdp, n-sdp).")
    # With a pipeline the masks are over one stage's L / P blocks (the same in every stage).
    plan = ts.make_plan(sdp.variant, plan_model, workers, sdp.coverage, sdp.scheme,
                        sdp.mask_seed, sdp.allow_nonuniform)
    check_mask_graph(plan, config)
    total = config.steps
    if config.flop_matched and sdp.variant != "ddp":
        total = ts.flop_matched_steps(config.steps, plan.coverage)
    if optim.warmup_steps > total:
        raise ValueError(f"optim.warmup_steps={optim.warmup_steps} is longer than the run "
                         f"({total} steps); lower --config.optim.warmup_steps.")
    byte_level = config.data.source != "llmc"
    if byte_level and model.vocab_size < data_lib.VOCAB_BYTES:
        raise ValueError(f"byte-level data needs model.vocab_size >= 256, got {model.vocab_size}.")
    return RunSpec(model, optim, plan, workers, total, workers * config.batch_per_worker,
                   byte_level, pipe)


def pipeline_step(config, spec: RunSpec, mesh) -> pl.PipelineStep:
    """The :class:`sdp_jax.pipeline.PipelineStep` of a pipelined run config (``spec`` from
    :func:`resolve`, ``mesh`` from :func:`sdp_jax.pipeline.make_mesh`)."""
    sdp = config.sdp
    return pl.PipelineStep(spec.model, spec.pipe, spec.optim, mesh, spec.total_steps,
                           variant=sdp.variant, coverage=spec.plan.coverage, scheme=sdp.scheme,
                           mask_seed=sdp.mask_seed, allow_nonuniform=sdp.allow_nonuniform,
                           batch_per_worker=config.batch_per_worker)


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
    return {"config": trajectory_config(config), "masks": spec.plan.record()}


def _check_pipeline(config, pipe: pl.PipelineConfig, model: LlamaConfig,
                    device_count: int) -> None:
    """What a pipelined run (``pipeline.stages > 1``) cannot combine with, refused up front."""
    pipe.check(model, config.batch_per_worker)
    if config.sdp.variant not in pl.PIPE_VARIANTS:
        raise ValueError(f"config.sdp.variant={config.sdp.variant!r} is not built with a "
                         f"pipeline; use {' or '.join(pl.PIPE_VARIANTS)}, or "
                         "--config.pipeline.stages=1.")
    for name, ok, want in (("fsdp", False, "False"), ("remat", "none", "none"),
                           ("dtype", "float32", "float32")):
        if config[name] != ok:
            raise ValueError(f"config.{name}={config[name]!r} is not built with a pipeline "
                             f"(pipeline.stages={pipe.stages}); set --config.{name}={want}.")
    if config.sdp.average != "gradients":
        raise ValueError("config.sdp.average=parameters is not built with a pipeline; use "
                         "--config.sdp.average=gradients.")
    if config.sdp.method not in ("auto", "reference"):
        raise ValueError(f"config.sdp.method={config.sdp.method!r}: a pipeline averages with "
                         "the masked sum over data (reference); use auto.")


# Config fields added after checkpoints were first written, with the value that older runs used.
_ADDED_FIELDS = {"fsdp": False, "dtype": "float32",
                 "pipeline": dict(pl.PipelineConfig().__dict__)}

# Fields that change the training trajectory: a checkpoint written under other values is refused.
_RUN_CONTROL = ("eval_every", "eval_batches", "eval_limit", "eval_bn_batches", "log_every",
                "checkpoint_every", "keep_checkpoints", "stop_at_step", "num_cpu_devices",
                "remat")  # remat: same results, may change


def trajectory_config(config) -> dict[str, Any]:
    """The parts of the config a checkpoint must agree with (plain JSON dict)."""
    d = json.loads(config.to_json())
    for k in _RUN_CONTROL:
        d.pop(k, None)
    d.get("data", {}).pop("worker_count", None)
    return d


class _Metrics:
    """Append-only JSONL writer (process 0), truncated to the restored step on resume."""

    def __init__(self, path: str, resume_step: int):
        self.path = path
        self.on = jax.process_index() == 0
        if not self.on:
            return
        kept = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if rec.get("step", 0) <= resume_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
        with open(path, "w") as f:
            f.writelines(kept)

    def write(self, rec: dict):
        if self.on:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")


class _StopOnSignal:
    """While active, SIGINT (Ctrl-C) and SIGTERM (preemption) ask the loop to stop after the
    current step; the loop then saves a checkpoint and returns. A second signal aborts at once.
    Only installed in the main thread."""

    def __init__(self, flag: list):
        self.flag, self.old = flag, {}

    def _handler(self, signum, frame):
        if self.flag:
            raise KeyboardInterrupt
        self.flag.append(signal.Signals(signum).name)
        _log(f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
             "(send again to abort without saving)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)
        return False


def _progress(total: int, initial: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                disable=jax.process_index() != 0, mininterval=1.0)


def _log(msg: str):
    if jax.process_index() == 0:
        print(msg, flush=True)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _check_finite(rec: dict, step: int, manager) -> None:
    """Stop before a non-finite state is checkpointed.

    Raises:
      FloatingPointError: naming the value, the step and the last checkpoint (which is kept).
    """
    bad = {k: v for k, v in rec.items() if k in ("train_loss", "grad_norm", "val_loss")
           and not math.isfinite(v)}
    if bad:
        last = manager.latest_step()
        kept = (f"the last checkpoint (step {last}) is kept" if last is not None
                else "no checkpoint was written")
        what = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise FloatingPointError(
            f"non-finite {what} at step {step}: stopped without saving this state; {kept}. "
            "Lower --config.optim.lr (or keep --config.optim.grad_clip > 0) and start in a new "
            "--workdir: a changed optimizer is another trajectory.")


def _canonical_dtype(config) -> None:
    """``bf16`` / ``fp32`` -> ``bfloat16`` / ``float32``, so that checkpoints record one name."""
    alias = {"bf16": "bfloat16", "fp32": "float32"}
    if config.dtype in alias:
        with config.unlocked():
            config.dtype = alias[config.dtype]


def train(config, workdir: str) -> dict[str, Any]:
    """Train (or resume) the run described by ``config`` in ``workdir``.

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
    _canonical_dtype(config)
    spec = resolve(config, jax.device_count())
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir {workdir!r} exists and is not a directory; choose another.")
    W, T, pipe = spec.workers, config.seq_len, spec.pipe
    devices = jax.devices()[:W * pipe.stages]
    if pipe.stages > 1:
        mesh = pl.make_mesh(W, pipe.stages, devices)
    else:
        mesh = jax.make_mesh((W,), (ts.AXIS,), devices=devices)
    mask_info = spec.plan.summary()

    # Data first: a bad path or a split too small fails here, before any compile.
    _log(data_lib.describe(config.data))
    pidx, pcount = jax.process_index(), jax.process_count()
    train_iter = data_lib.make_train_iterator(
        config.data, seq_len=T, global_batch=spec.global_batch, seed=config.seed,
        vocab_size=spec.model.vocab_size, process_index=pidx, process_count=pcount)
    val_batches = data_lib.make_val_batches(
        config.data, seq_len=T, global_batch=spec.global_batch, num_batches=config.eval_batches,
        vocab_size=spec.model.vocab_size, process_index=pidx, process_count=pcount)

    try:  # only now: a run refused above leaves no empty workdir behind
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create --workdir {workdir!r}: {e}; choose another.") from e
    manager = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                         keep=config.keep_checkpoints)
    meta = _meta(config, spec)
    latest = manager.latest_step()
    if latest is not None:
        try:
            manager.check_compatible(latest, meta, defaults=_ADDED_FIELDS)  # before compute
        except ValueError:
            manager.close()
            raise

    if pipe.stages > 1:
        builder = pipeline_step(config, spec, mesh)
    else:
        builder = ts.StepBuilder(spec.model, spec.plan, spec.optim, mesh, spec.total_steps,
                                 averaging=config.sdp.average, sync_every=config.sdp.sync_every,
                                 method=config.sdp.method, fsdp=config.fsdp,
                                 remat=config.remat, dtype=config.dtype)
    counts = spec.model.param_count()
    _log(f"devices: {len(devices)} x {devices[0].platform} ({jax.process_count()} process(es)); "
         f"{spec.plan.describe()}"
         + (f"; parameters averaged over holders every {config.sdp.sync_every} steps"
            if config.sdp.average == "parameters" else "")
         + (f"; FSDP (ZeRO-3) over the {W} workers" if config.fsdp else "")
         + (f"; activation checkpointing: {config.remat}" if config.remat != "none" else "")
         + (f"; compute dtype {config.dtype}" if config.dtype not in ("float32", "fp32")
            else ""))
    if pipe.stages > 1:
        _log(f"pipeline: {pipe.stages} stages x {W} workers ({pipe.schedule}, "
             f"{pipe.microbatches} microbatches); masks are per stage "
             f"({spec.model.n_layers // pipe.stages} blocks each); boundaries: {pipe.method}"
             + (f", {pipe.ratio}x (r = {pipe.width(spec.model.d_model)}), anchors of rank "
                f"{pipe.anchor_rank}" if pipe.compressed else "")
             + (f", RVQ {pipe.rvq_levels} levels x {pipe.rvq_codebook} codes"
                if pipe.quantized else "")
             + (f"; {builder.boundary_param_count():,} boundary parameters (not in the total "
                "below)" if pipe.compressed else ""))
    mult = ", ".join(f"{k} {v['multiplicity_min']}..{v['multiplicity_max']}"
                     for k, v in mask_info["kinds"].items())
    _log(f"mask graph: spectral gap {mask_info['spectral_gap']:.4f}; multiplicity {mult}; "
         f"params: total {counts['total']:,}, stored per device "
         f"{builder.per_device_param_count():,}")

    # Restore before compiling: an unreadable checkpoint is reported before any compute.
    if latest is not None:
        try:
            state = manager.restore(latest, builder.abstract_state(), train_iter)
        except ValueError:
            manager.close()
            raise
        start = int(state["step"])
        _log(f"resumed from {manager.directory} at step {start}")
    else:
        state = builder.init_state(config.seed)
        start = 0

    batch_shape = (spec.global_batch, T + 1)
    t0 = time.time()
    step_fn = builder.compiled_train_step(batch_shape)
    step_fn_local = builder.train_step_fn(sync_now=False)  # = step_fn unless average=parameters
    mem = ts.memory_stats(step_fn)
    _log(f"compiled train step in {time.time() - t0:.1f}s: peak "
         f"{_fmt_bytes(mem['peak_bytes_per_device'])} per device")
    boundary = None
    if pipe.stages > 1:
        boundary = builder.boundary_bytes(step_fn, config.batch_per_worker, T)
        _log(f"stage boundaries: {_fmt_bytes(boundary['per_boundary'])} per boundary per worker "
             f"per step ({boundary['per_token']:.1f} bytes/token, forward and backward, "
             "from the compiled program)")
    eval_fn = builder.eval_step_fn()
    metrics_log = _Metrics(os.path.join(workdir, "metrics.jsonl"), start)
    batch_sharding = builder.batch_sharding()

    def device_batch(x: np.ndarray):
        return jax.make_array_from_process_local_data(batch_sharding, x, batch_shape)

    def evaluate():
        losses = [float(eval_fn(state["params"], device_batch(vb))) for vb in val_batches]
        v = float(np.mean(losses))
        out = {"val_loss": v}
        if spec.byte_level:
            out["val_bpb"] = v / math.log(2)
        return out

    stop = spec.total_steps
    if config.stop_at_step > 0:
        stop = min(stop, config.stop_at_step)
    tokens_per_step = spec.global_batch * T
    last_val: dict[str, float] = {}
    last_ortho = None
    bar = _progress(spec.total_steps, start)
    t_window, n_window = time.time(), 0
    step = start
    interrupted = []
    with _StopOnSignal(interrupted):
        try:
            while step < stop and not interrupted:
                batch = device_batch(next(train_iter))
                sync_now = builder.is_sync_step(step + 1)
                state, m = (step_fn if sync_now else step_fn_local)(state, batch)
                # Waiting for each step keeps one step in flight (CPU collectives, DESIGN.md).
                rec = {k: float(v) for k, v in m.items()}
                last_ortho = rec.get("ortho_err", last_ortho)
                step += 1
                n_window += 1
                _check_finite(rec, step, manager)
                is_eval = step == spec.total_steps or (
                    config.eval_every > 0 and step % config.eval_every == 0)
                if step % config.log_every == 0 or is_eval or step == stop or interrupted:
                    dt = time.time() - t_window
                    rec["tokens_per_s"] = tokens_per_step * n_window / max(dt, 1e-9)
                    t_window, n_window = time.time(), 0
                    if is_eval:
                        last_val = evaluate()
                        rec.update(last_val)
                        _check_finite(rec, step, manager)
                    rec["step"] = step
                    metrics_log.write(rec)
                    post = {"loss": f"{rec['train_loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
                    if "ortho_err" in rec:
                        post["|A'A-I|"] = f"{rec['ortho_err']:.1e}"
                    if "val_loss" in rec:
                        post["val"] = f"{rec['val_loss']:.3f}"
                    bar.set_postfix(post, refresh=False)
                bar.update(1)
                every = config.checkpoint_every
                if (every and step % every == 0) or step == stop or interrupted:
                    manager.save(step, state, train_iter, meta)
        finally:
            bar.close()
            manager.close()  # waits for the last save

    done = step >= spec.total_steps
    summary_path = os.path.join(workdir, "summary.json")
    if start >= spec.total_steps and os.path.exists(summary_path):
        with open(summary_path) as f:  # nothing trained now: keep the run's own figures
            summary = json.load(f)
        _log(f"already complete: {step} steps; final val loss {summary['final_val_loss']:.4f} "
             f"nats/token (from {summary_path})")
        return summary
    prev_wall = previous_wall(summary_path, start)  # a resumed run adds the earlier time
    if done and not last_val:
        last_val = evaluate()
    summary = {
        "variant": config.sdp.variant, "regime": spec.plan.regime,
        "coverage": spec.plan.coverage, "workers": W, "scheme": config.sdp.scheme,
        "average": config.sdp.average, "sync_every": config.sdp.sync_every,
        "fsdp": config.fsdp, "remat": config.remat, "dtype": config.dtype,
        "n_layers": spec.model.n_layers, "steps": step, "total_steps": spec.total_steps,
        "completed": done, "tokens": step * tokens_per_step,
        "final_val_loss": last_val.get("val_loss"), "final_val_bpb": last_val.get("val_bpb"),
        "wall_s": prev_wall + time.time() - t_start,
        "peak_bytes_per_device": mem["peak_bytes_per_device"], "memory": mem,
        "params_total": counts["total"], "params_per_device": builder.per_device_param_count(),
        "masks": mask_info, "spectral_gap": mask_info["spectral_gap"],
        "platform": devices[0].platform, "pipeline": dict(pipe.__dict__),
        "boundary_bytes_per_token": boundary["per_token"] if boundary else None,
        "boundary_bytes_per_step": boundary["per_boundary"] if boundary else None,
        "final_ortho_err": last_ortho,
        "interrupted_by": interrupted[0] if interrupted and not done else None,
    }
    if jax.process_index() == 0:
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=2)
    if done:
        bpb = f", {summary['final_val_bpb']:.3f} bits/byte" if spec.byte_level else ""
        _log(f"done: {step} steps in {summary['wall_s']:.0f}s; final val loss "
             f"{summary['final_val_loss']:.4f} nats/token{bpb}; summary in "
             f"{os.path.join(workdir, 'summary.json')}")
    else:
        log_stopped(step, spec.total_steps, interrupted)
    return summary
