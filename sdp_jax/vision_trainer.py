"""The training loop of image classification runs (ResNet-18, WideResNet-18, Swin-T).

``train(config, workdir)`` is what ``python train.py --config configs/resnet18_digits.py`` runs.
It validates everything before compute (model, variant, coverage realizable for the model's
components, data and image shape), builds the step and the evaluation (the full model's test
accuracy and loss, with BatchNorm statistics re-estimated when subnetworks trained them), and
hands them to the shared loop :mod:`sdp_jax.loop` (checkpoints, progress, signals, finiteness
checks, ``metrics.jsonl``, ``summary.json``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from sdp_jax import loop
from sdp_jax import spec as spec_lib
from sdp_jax import tasks
from sdp_jax import train_step as ts
from sdp_jax import vision_data
from sdp_jax.models import vision as vm


@dataclasses.dataclass
class VisionRunSpec:
    """What a vision config resolves to before compute."""

    model: vm.VisionConfig
    optim: ts.OptimConfig
    plan: spec_lib.SDPSpec
    workers: int
    total_steps: int
    global_batch: int


# Config fields newer than some vision checkpoints, with the value older runs used.
_ADDED_FIELDS = {"sdp": {"average": "gradients", "sync_every": 1}, "fsdp": False}


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
    loop.check_run_fields(config, ("batch_per_worker", "steps", "log_every", "keep_checkpoints",
                                   "num_cpu_devices"),
                          ("eval_every", "eval_limit", "eval_bn_batches", "checkpoint_every",
                           "stop_at_step", "seed"))
    loop.check_step_fields(config, remat=("none", "full"))
    workers = loop.resolve_workers(config, device_count)
    sdp = config.sdp
    stage_blocks = tuple(sdp.get("stage_blocks", ()) or ())
    if stage_blocks and sdp.variant not in ("b-sdp", "bb-sdp"):
        raise ValueError(f"config.sdp.stage_blocks={stage_blocks} applies to block variants "
                         f"(b-sdp, bb-sdp), not {sdp.variant}; leave it empty.")
    plan = tasks.vision_spec(model, sdp.variant, workers, sdp.coverage, sdp.scheme,
                             sdp.mask_seed, sdp.allow_nonuniform, stage_blocks,
                             sdp.allow_disconnected)
    total = config.steps
    if config.flop_matched and sdp.variant != "ddp":
        total = ts.flop_matched_steps(config.steps, plan.coverage)
    loop.check_warmup(optim, total)
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
    loop.canonical_dtype(config)
    spec = resolve(config, jax.device_count())
    loop.check_workdir_is_dir(workdir)
    W, cfg = spec.workers, spec.model
    devices = jax.devices()[:W]
    mesh = jax.make_mesh((W,), (ts.AXIS,), devices=devices)
    pidx, pcount = jax.process_index(), jax.process_count()
    loop.log(vision_data.describe(config.data))
    train_iter = vision_data.make_train_iterator(
        config.data, image_size=cfg.image_size, channels=cfg.in_channels,
        global_batch=spec.global_batch, seed=config.seed, process_index=pidx,
        process_count=pcount)
    test_batches = vision_data.make_eval_batches(
        config.data, image_size=cfg.image_size, channels=cfg.in_channels,
        global_batch=spec.global_batch, process_index=pidx, process_count=pcount,
        limit=config.eval_limit)

    meta = {"config": loop.trajectory_config(config), "masks": tasks.vision_record(spec.plan)}
    manager, latest = loop.open_checkpoints(config, workdir, meta, defaults=_ADDED_FIELDS)

    builder = tasks.vision_step(cfg, spec.plan, spec.optim, mesh, spec.total_steps,
                                dtype=config.dtype, remat=config.remat, fsdp=config.fsdp,
                                averaging=config.sdp.average, sync_every=config.sdp.sync_every)
    evaluation = tasks.VisionEval(builder)
    info = spec.plan.summary()
    n_params = vm.param_count(cfg)
    loop.log(f"devices: {W} x {devices[0].platform} ({pcount} process(es)); "
             f"{spec.plan.describe()}"
             + (f"; compute dtype {config.dtype}" if config.dtype != "float32" else "")
             + ("; FSDP (ZeRO-3)" if config.fsdp else ""))
    loop.log(f"mask graph: spectral gap {info['spectral_gap']:.4f}; params: total "
             f"{n_params:,}, stored per device {builder.per_device_param_count():,}")
    state, start = loop.restore_or_init(manager, latest, builder, train_iter, config.seed)

    t0 = time.time()
    G = spec.global_batch
    img_shape = (G, cfg.image_size, cfg.image_size, cfg.in_channels)
    batch_shapes = (jax.ShapeDtypeStruct(img_shape, jax.numpy.float32),
                    jax.ShapeDtypeStruct((G,), jax.numpy.int32))
    compiled = builder.compiled_train_step(batch_shapes)
    step_fns = {True: compiled}
    mem = ts.memory_stats(compiled)
    loop.log(f"compiled train step in {time.time() - t0:.1f}s: peak "
             f"{loop.fmt_bytes(mem['peak_bytes_per_device'])} per device")
    eval_fn = evaluation.eval_step_fn()
    sh = builder.batch_sharding()

    def put(x, shape):
        return jax.make_array_from_process_local_data(sh, x, shape)

    recal = evaluation.recalibrate and config.eval_bn_batches > 0
    if evaluation.recalibrate and not recal:
        loop.log("warning: --config.eval_bn_batches=0: the full model is evaluated with the "
                 "running BatchNorm statistics of subnetworks, which do not describe it (expect "
                 "a much lower test accuracy than with re-estimated statistics)")
    if recal:
        loop.log(f"evaluation re-estimates the full model's BatchNorm statistics on "
                 f"{config.eval_bn_batches} training batches (--config.eval_bn_batches; the "
                 "running statistics of subnetworks do not describe the full model)")
        eval_fn = evaluation.eval_step_fn(recalibrated=True)
        bn_fn = evaluation.bn_stats_fn()

    def bn_stats(state):
        it = vision_data.make_train_iterator(
            config.data, image_size=cfg.image_size, channels=cfg.in_channels,
            global_batch=G, seed=config.seed + 7919, process_index=pidx, process_count=pcount)
        total = None
        for _ in range(config.eval_bn_batches):
            s = bn_fn(state["params"], state.get("stats", {}), put(next(it)[0], img_shape))
            jax.block_until_ready(s)  # one collective program in flight (DESIGN.md, CPU)
            total = s if total is None else jax.tree.map(lambda a, b: a + b, total, s)
        return jax.tree.map(lambda a: a / config.eval_bn_batches, total)

    def evaluate(state):
        loss = right = count = 0.0
        extra = (bn_stats(state),) if recal else ()
        for x, y, valid in test_batches:
            a, b, c = eval_fn(state["params"], state.get("stats", {}), put(x, img_shape),
                              put(y, (G,)), put(valid, (G,)), *extra)
            loss, right, count = loss + float(a), right + float(b), count + float(c)
        return {"test_loss": loss / count, "test_acc": right / count}

    def one_step(state, batch, step):
        x, y = batch
        sync_now = builder.is_sync_step(step)   # periodic parameter averaging
        if sync_now not in step_fns:
            step_fns[sync_now] = builder.train_step_fn(sync_now)
        return step_fns[sync_now](state, (put(x, img_shape), put(y, (G,))))

    def postfix(rec):
        post = {"loss": f"{rec['train_loss']:.3f}", "acc": f"{rec['train_acc']:.3f}"}
        if "test_acc" in rec:
            post["test_acc"] = f"{rec['test_acc']:.4f}"
        return post

    def summary(step, last, _rec, wall):
        return {
            "model": cfg.name, "dataset": config.data.dataset, "variant": config.sdp.variant,
            "regime": spec.plan.regime, "coverage": spec.plan.coverage, "workers": W,
            "scheme": config.sdp.scheme, "dtype": config.dtype, "fsdp": config.fsdp,
            "steps": step,
            "average": config.sdp.average, "sync_every": config.sdp.sync_every,
            "total_steps": spec.total_steps, "completed": step >= spec.total_steps,
            "images": step * G, "final_test_acc": last.get("test_acc"),
            "final_test_loss": last.get("test_loss"), "wall_s": wall,
            "peak_bytes_per_device": mem["peak_bytes_per_device"], "memory": mem,
            "params_total": n_params, "params_per_device": builder.per_device_param_count(),
            "masks": info, "spectral_gap": info["spectral_gap"],
            "platform": devices[0].platform,
        }

    def done_line(s):
        return (f"done: {s['steps']} steps in {s['wall_s']:.0f}s; final test accuracy "
                f"{s['final_test_acc']:.4f} (loss {s['final_test_loss']:.4f} nats)")

    def already_line(s):
        return (f"already complete: {s['steps']} steps; final test accuracy "
                f"{s['final_test_acc']:.4f}")

    run = loop.Run(one_step, evaluate, G, "images_per_s", postfix, summary, done_line,
                   already_line)
    return loop.run(config, workdir, run, state=state, start=start, total=spec.total_steps,
                    manager=manager, meta=meta, train_iter=train_iter, t_start=t_start)


def is_vision(config) -> bool:
    """Whether a run config describes a vision model."""
    return config.model.get("name", "llama") in vm.MODELS

