"""The training loop of image classification runs (ResNet-18, WideResNet-18, Swin-T).

``train(config, workdir)`` is what ``python train.py --config configs/resnet18_digits.py`` runs.
Like :func:`sdp_jax.trainer.train` it validates everything before compute (model, variant,
coverage realizable for the model's components, data and image shape, a checkpoint from another
config), resumes from the latest checkpoint in ``workdir``, shows progress, never checkpoints a
non-finite state, and writes ``metrics.jsonl`` and ``summary.json``; evaluation reports the full
model's test accuracy and loss.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax

from sdp_jax import checkpoint as ckpt_lib
from sdp_jax import train_step as ts
from sdp_jax import trainer as lm
from sdp_jax import vision_data
from sdp_jax import vision_step as vs
from sdp_jax.models import vision as vm


@dataclasses.dataclass
class VisionRunSpec:
    """What a vision config resolves to before compute."""

    model: vm.VisionConfig
    optim: ts.OptimConfig
    plan: vs.VisionPlan
    workers: int
    total_steps: int
    global_batch: int


def resolve(config, device_count: int) -> VisionRunSpec:
    """Validate a vision run config.

    Raises:
      ValueError: with the bad value and the fix (unknown dataset, classes that do not match
        the dataset, coverage not realizable for the model's components, too many workers, ...).
    """
    ds = config.data.dataset
    if ds not in vision_data.DATASETS:
        raise ValueError(f"unknown data.dataset={ds!r}; choose one of "
                         f"{', '.join(vision_data.DATASETS)} (--config.data.dataset=...).")
    model_cfg = dict(config.model)
    classes = vision_data.CLASSES[ds]
    if model_cfg.get("num_classes", 0) in (0, None):
        model_cfg["num_classes"] = classes
    elif model_cfg["num_classes"] != classes:
        raise ValueError(f"model.num_classes={model_cfg['num_classes']} but {ds} has {classes} "
                         "classes; set --config.model.num_classes=0 (= the dataset's).")
    model = vm.VisionConfig.from_config(model_cfg)
    optim = ts.OptimConfig.from_config(config.optim)
    for name in ("batch_per_worker", "steps", "log_every", "keep_checkpoints",
                 "num_cpu_devices"):
        lm._positive_int(config, name)
    for name in ("eval_every", "eval_limit", "eval_bn_batches", "checkpoint_every",
                 "stop_at_step", "seed"):
        v = config[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"config.{name}={v!r} must be an integer >= 0.")
    wc = config.data.worker_count
    if isinstance(wc, bool) or not isinstance(wc, int) or wc < 0:
        raise ValueError(f"config.data.worker_count={wc!r} must be an integer >= 0.")
    if config.dtype not in ts.DTYPES:
        raise ValueError(f"config.dtype={config.dtype!r}; use float32 or bfloat16.")
    if config.remat not in ("none", "full"):
        raise ValueError(f"config.remat={config.remat!r}; vision models take none or full "
                         "(activation checkpointing of every block).")
    workers = lm.resolve_workers(config, device_count)
    sdp = config.sdp
    stage_blocks = tuple(sdp.get("stage_blocks", ()) or ())
    if stage_blocks and sdp.variant not in ("b-sdp", "bb-sdp"):
        raise ValueError(f"config.sdp.stage_blocks={stage_blocks} applies to block variants "
                         f"(b-sdp, bb-sdp), not {sdp.variant}; leave it empty.")
    plan = vs.VisionPlan(sdp.variant, model, workers, sdp.coverage, sdp.scheme, sdp.mask_seed,
                         sdp.allow_nonuniform, stage_blocks)
    lm.check_mask_graph(plan, config)
    total = config.steps
    if config.flop_matched and sdp.variant != "ddp":
        total = ts.flop_matched_steps(config.steps, plan.coverage)
    if optim.warmup_steps > total:
        raise ValueError(f"optim.warmup_steps={optim.warmup_steps} is longer than the run "
                         f"({total} steps); lower --config.optim.warmup_steps.")
    return VisionRunSpec(model, optim, plan, workers, total, workers * config.batch_per_worker)


def train(config, workdir: str) -> dict[str, Any]:
    """Train (or resume) the vision run ``config`` in ``workdir``.

    Writes ``metrics.jsonl`` (per logged step: ``step``, ``train_loss``, ``train_acc``,
    ``grad_norm``, ``lr``, ``images_per_s``; on eval steps ``test_loss`` nats and ``test_acc``),
    ``checkpoints/`` and ``summary.json`` (``final_test_acc`` among others).

    Raises:
      ValueError: invalid config or data, or a checkpoint in ``workdir`` from another config.
      ImportError: the dataset's optional dependency is missing.
    """
    t_start = time.time()
    lm._canonical_dtype(config)
    spec = resolve(config, jax.device_count())
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir {workdir!r} exists and is not a directory; choose another.")
    W, cfg = spec.workers, spec.model
    devices = jax.devices()[:W]
    mesh = jax.make_mesh((W,), (ts.AXIS,), devices=devices)
    pidx, pcount = jax.process_index(), jax.process_count()
    lm._log(vision_data.describe(config.data))
    train_iter = vision_data.make_train_iterator(
        config.data, image_size=cfg.image_size, channels=cfg.in_channels,
        global_batch=spec.global_batch, seed=config.seed, process_index=pidx,
        process_count=pcount)
    test_batches = vision_data.make_eval_batches(
        config.data, image_size=cfg.image_size, channels=cfg.in_channels,
        global_batch=spec.global_batch, process_index=pidx, process_count=pcount,
        limit=config.eval_limit)

    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create --workdir {workdir!r}: {e}; choose another.") from e
    manager = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                         keep=config.keep_checkpoints)
    meta = {"config": lm.trajectory_config(config), "masks": spec.plan.record()}
    latest = manager.latest_step()
    if latest is not None:
        try:
            manager.check_compatible(latest, meta)
        except ValueError:
            manager.close()
            raise

    builder = vs.VisionStepBuilder(cfg, spec.plan, spec.optim, mesh, spec.total_steps,
                                   dtype=config.dtype, remat=config.remat)
    info = spec.plan.summary()
    n_params = vm.param_count(cfg)
    lm._log(f"devices: {W} x {devices[0].platform} ({pcount} process(es)); "
            f"{spec.plan.describe()}"
            + (f"; compute dtype {config.dtype}" if config.dtype != "float32" else ""))
    lm._log(f"mask graph: spectral gap {info['spectral_gap']:.4f}; params: total {n_params:,}, "
            f"stored per device {builder.per_device_param_count():,}")
    if latest is not None:
        try:
            state = manager.restore(latest, builder.abstract_state(), train_iter)
        except ValueError:
            manager.close()
            raise
        start = int(state["step"])
        lm._log(f"resumed from {manager.directory} at step {start}")
    else:
        state = builder.init_state(config.seed)
        start = 0

    t0 = time.time()
    step_fn = builder.compiled_train_step(config.batch_per_worker)
    mem = ts.memory_stats(step_fn)
    lm._log(f"compiled train step in {time.time() - t0:.1f}s: peak "
            f"{lm._fmt_bytes(mem['peak_bytes_per_device'])} per device")
    eval_fn = builder.eval_step_fn()
    metrics_log = lm._Metrics(os.path.join(workdir, "metrics.jsonl"), start)
    sh = builder.batch_sharding()
    G = spec.global_batch
    img_shape = (G, cfg.image_size, cfg.image_size, cfg.in_channels)

    def put(x, shape):
        return jax.make_array_from_process_local_data(sh, x, shape)

    recal = builder.recalibrate and config.eval_bn_batches > 0
    if builder.recalibrate and not recal:
        lm._log("warning: --config.eval_bn_batches=0: the full model is evaluated with the "
                "running BatchNorm statistics of subnetworks, which do not describe it (expect a "
                "much lower test accuracy than with re-estimated statistics)")
    if recal:
        lm._log(f"evaluation re-estimates the full model's BatchNorm statistics on "
                f"{config.eval_bn_batches} training batches (--config.eval_bn_batches; the "
                "running statistics of subnetworks do not describe the full model)")
        eval_fn = builder.eval_step_fn(recalibrated=True)
        bn_fn = builder.bn_stats_fn()

    def bn_stats():
        it = vision_data.make_train_iterator(
            config.data, image_size=cfg.image_size, channels=cfg.in_channels,
            global_batch=G, seed=config.seed + 7919, process_index=pidx, process_count=pcount)
        total = None
        for _ in range(config.eval_bn_batches):
            s = bn_fn(state["params"], state["stats"], put(next(it)[0], img_shape))
            jax.block_until_ready(s)  # one collective program in flight (DESIGN.md, CPU)
            total = s if total is None else jax.tree.map(lambda a, b: a + b, total, s)
        return jax.tree.map(lambda a: a / config.eval_bn_batches, total)

    def evaluate():
        loss = right = count = 0.0
        extra = (bn_stats(),) if recal else ()
        for x, y, valid in test_batches:
            a, b, c = eval_fn(state["params"], state["stats"], put(x, img_shape), put(y, (G,)),
                              put(valid, (G,)), *extra)
            loss, right, count = loss + float(a), right + float(b), count + float(c)
        return {"test_loss": loss / count, "test_acc": right / count}

    stop = spec.total_steps if config.stop_at_step <= 0 else min(spec.total_steps,
                                                                 config.stop_at_step)
    last: dict[str, float] = {}
    bar = lm._progress(spec.total_steps, start)
    t_window, n_window, step = time.time(), 0, start
    interrupted: list = []
    with lm._StopOnSignal(interrupted):
        try:
            while step < stop and not interrupted:
                x, y = next(train_iter)
                state, m = step_fn(state, put(x, img_shape), put(y, (G,)))
                rec = {k: float(v) for k, v in m.items()}  # one step in flight (DESIGN.md)
                step += 1
                n_window += 1
                lm._check_finite(rec, step, manager)
                is_eval = step == spec.total_steps or (
                    config.eval_every > 0 and step % config.eval_every == 0)
                if step % config.log_every == 0 or is_eval or step == stop or interrupted:
                    rec["images_per_s"] = G * n_window / max(time.time() - t_window, 1e-9)
                    t_window, n_window = time.time(), 0
                    if is_eval:
                        last = evaluate()
                        rec.update(last)
                        lm._check_finite({"val_loss": last["test_loss"]}, step, manager)
                    rec["step"] = step
                    metrics_log.write(rec)
                    post = {"loss": f"{rec['train_loss']:.3f}", "acc": f"{rec['train_acc']:.3f}"}
                    if "test_acc" in rec:
                        post["test_acc"] = f"{rec['test_acc']:.4f}"
                    bar.set_postfix(post, refresh=False)
                bar.update(1)
                every = config.checkpoint_every
                if (every and step % every == 0) or step == stop or interrupted:
                    manager.save(step, state, train_iter, meta)
        finally:
            bar.close()
            manager.close()

    done = step >= spec.total_steps
    path = os.path.join(workdir, "summary.json")
    if start >= spec.total_steps and os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
        lm._log(f"already complete: {step} steps; final test accuracy "
                f"{summary['final_test_acc']:.4f} (from {path})")
        return summary
    prev_wall = lm.previous_wall(path, start)
    if done and not last:
        last = evaluate()
    summary = {
        "model": cfg.name, "dataset": config.data.dataset, "variant": config.sdp.variant,
        "regime": spec.plan.regime, "coverage": spec.plan.coverage, "workers": W,
        "scheme": config.sdp.scheme, "dtype": config.dtype, "steps": step,
        "total_steps": spec.total_steps, "completed": done, "images": step * G,
        "final_test_acc": last.get("test_acc"), "final_test_loss": last.get("test_loss"),
        "wall_s": prev_wall + time.time() - t_start,
        "peak_bytes_per_device": mem["peak_bytes_per_device"], "memory": mem,
        "params_total": n_params, "params_per_device": builder.per_device_param_count(),
        "masks": info, "spectral_gap": info["spectral_gap"], "platform": devices[0].platform,
        "interrupted_by": interrupted[0] if interrupted and not done else None,
    }
    if jax.process_index() == 0:
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
    if done:
        lm._log(f"done: {step} steps in {summary['wall_s']:.0f}s; final test accuracy "
                f"{summary['final_test_acc']:.4f} (loss {summary['final_test_loss']:.4f} nats); "
                f"summary in {path}")
    else:
        lm.log_stopped(step, spec.total_steps, interrupted)
    return summary


def is_vision(config) -> bool:
    """Whether a run config describes a vision model."""
    return config.model.get("name", "llama") in vm.MODELS

