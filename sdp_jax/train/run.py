"""The one place that validates a run config (:mod:`sdp_jax.train.config`) of any model family,
before any compute: :func:`resolve` checks every field and derives the run's static facts
(:class:`RunSpec`) for ``train.py``, the bench, the studies and the tools.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax
import ml_collections

from sdp_jax import fields
from sdp_jax import mesh as mesh_lib
from sdp_jax.models.vision import MODELS
from sdp_jax.options import DTYPE_ALIASES, MeshShape, StepOptions
from sdp_jax.pipeline import schedules as pl
from sdp_jax.step import alignment
from sdp_jax.step.inner import InnerLayout, check_rows
from sdp_jax.sync import placement
from sdp_jax.train import config as config_lib
from sdp_jax.train import families
from sdp_jax.train import optimizer as optim_lib
from sdp_jax.train import task as task_lib
from sdp_jax.train.config import base_config, vision_config

# The settings that do not change the training trajectory (declared control=True: how often to
# log or save, how the same function is computed, coverage=auto's budget): a checkpoint written
# under other values still resumes.
CONTROL = config_lib.control_paths()


@dataclasses.dataclass
class RunSpec:
    """Everything a run config resolves to before compute (host-side values; no arrays).

    Attributes:
      family: the run's model family, a :class:`sdp_jax.train.task.Family` (a built-in one,
        :func:`sdp_jax.train.families.family_of`, or the user's :class:`sdp_jax.train.task.Task`).
      model: the model's config (:class:`sdp_jax.models.llama.LlamaConfig`,
        :class:`sdp_jax.models.vision.VisionConfig`, or a task's frozen model section).
      optim: :class:`sdp_jax.train.optimizer.OptimConfig`.
      plan: the spec (masks) of the run; with a pipeline, of one stage.
      workers: ``W``; total_steps: the run's optimizer steps (FLOP-matched when asked);
      global_batch: ``W * batch_per_worker`` examples per step.
      pipe: :class:`sdp_jax.pipeline.PipelineConfig` (``stages=1``: no pipeline).
      options: the step's settings, :class:`sdp_jax.options.StepOptions` (with the run's
        ``total_steps``).
      mesh_shape: the devices of one worker, :class:`sdp_jax.options.MeshShape` (``F x T``).
      config: the run's config, checked (the family's hooks read their own fields from it,
        e.g. ``seq_len`` or ``data``).
    """

    family: Any
    model: Any
    optim: Any
    plan: Any
    workers: int
    total_steps: int
    global_batch: int
    pipe: Any
    options: StepOptions
    config: Any
    mesh_shape: MeshShape = MeshShape()

    @property
    def worker_devices(self) -> int:
        """The devices the ``W`` workers run on: ``W x F x T``, or 1 when emulated
        (``config.emulate_workers``); a compiled step's per-device FLOPs times this is the
        step's FLOPs."""
        return 1 if self.options.emulate_workers else self.workers * self.mesh_shape.devices


def _check_schema(config, family) -> None:
    """Refuse a config whose fields differ from its family's schema: a ``model`` section of
    another built-in model (e.g. ``model.name`` switched by an override), a missing field, or
    an unknown one (a typo in a hand-written ``get_config``), naming the field. The ``model``
    section is checked here only when the family's template lists all its fields
    (``family.fixed_model_fields``); otherwise by ``family.model_config``."""
    template, maker = family.template(config)
    if not family.fixed_model_fields:
        name, mine = config.model.get("name", "llama"), set(template.model)
        others = set(base_config().model).union(
            *(vision_config(n, "digits").model for n in MODELS)) - mine
        extra = sorted(set(config.model) - mine)
        if extra and set(extra) <= others:   # (a typo is left to the model's own check)
            raise ValueError(f"config.model.name={name!r} but the model section has fields of "
                             f"another model ({', '.join(extra)}); to train {name} give a "
                             f"{name} config file (configs/) rather than overriding "
                             "model.name.")
    missing, unknown = [], []
    for key, value in template.items():
        if key == "model" and not family.fixed_model_fields:
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
        raise ValueError(f"config.{field} is missing; build the run config on {maker} "
                         f"(default {field}: {shown}) or add the field to your config.")
    if unknown:
        raise ValueError(f"config.{unknown[0]} is not a field of a {family.kind} run config "
                         f"({maker}); correct or remove it in your config.")


def resolve(config, device_count: int, task: task_lib.Family | None = None, *,
            processes: int | None = None) -> RunSpec:
    """Validate a run config of any model family and derive its static facts: the one
    validation place of ``train.py``, ``python -m sdp_jax.bench`` and ``python -m
    sdp_jax.study``.

    It initializes the JAX backend (``jax.process_count``, the specs' ``jax.eval_shape``): set
    ``jax_num_cpu_devices`` and call ``jax.distributed.initialize`` before it.

    Args:
      config: the run ``ConfigDict`` (:func:`base_config`, :func:`vision_config`, a task's
        :meth:`sdp_jax.train.task.Task.config`); a ``dtype`` alias (``bf16``, ``fp32``) is
        replaced by its canonical name (:func:`canonical_dtype`).
      device_count: devices available (``jax.device_count()``).
      task: the run's model family, a :class:`sdp_jax.train.task.Family` (e.g. a user's
        :class:`sdp_jax.train.task.Task`); default: the built-in family of ``model.name``
        (:func:`sdp_jax.train.families.family_of`).
      processes: the processes the run spans (default ``jax.process_count()``; 1 resolves
        the layout of a checkpoint emulated on one local device, :mod:`sdp_jax.train.elastic`).

    Raises:
      ValueError: with the bad value and a fix, for any invalid or missing field (run control,
        step settings, workers, model, data, masks, warm-up longer than the run); a ``task``
        that is not a :class:`~sdp_jax.train.task.Family`, or a :class:`~sdp_jax.train.task.Task`
        that lacks one of its model functions.
    """
    if task is not None and not isinstance(task, task_lib.Family):
        raise ValueError(f"task={task!r} is not a sdp_jax.train.task.Family; pass an instance "
                         "of your subclass of sdp_jax.train.task.Task (e.g. task=MyTask()).")
    canonical_dtype(config)
    family = families.family_of(config) if task is None else task
    _check_schema(config, family)
    _check_declared(config, family)
    model = family.model_config(config)
    optim = optim_lib.OptimConfig.from_config(config.optim)
    options = StepOptions.from_config(config)
    shape = MeshShape.from_config(config)
    pipe = pl.PipelineConfig.from_config(config.get("pipeline", {}))
    _check_microbatches(config, pipe)
    _check_mesh_shape(config, shape, pipe, family)
    if pipe.stages > 1:
        pipe.check(model, config.batch_per_worker // options.grad_accum, options.fsdp,
                   options.average)
    workers = resolve_workers(config, device_count, pipe.stages, processes, shape.devices)
    plan = _plan(family, config, model, workers, pipe, shape)
    options.check_for(plan, family.remat)
    if config.align_every:
        no_full_loss = "" if family.aligns(model, plan) else f"{family.kind} models"
        alignment.check(options, pipelined=pipe.stages > 1, no_full_loss=no_full_loss,
                        asked=f"config.align_every={config.align_every}",
                        fix="set --config.align_every=0")
    total = total_steps(config, plan.coverage)
    _check_profile(config.profile_start, config.profile_stop, total)
    if optim.warmup_steps > total > 0:   # (0 steps: the initial state saved, no schedule)
        raise ValueError(f"optim.warmup_steps={optim.warmup_steps} is longer than the run "
                         f"({total} steps); lower --config.optim.warmup_steps.")
    return RunSpec(family, model, optim, plan, workers, total,
                   workers * config.batch_per_worker, pipe,
                   dataclasses.replace(options, total_steps=total), config, shape)


def _plan(family, config, model, workers: int, pipe, shape: MeshShape):
    """The run's spec (``family.plan``), with what workers of ``F x T`` devices need of the
    run checked (:func:`sdp_jax.mesh.check_worker_shape`; ``T`` against the model's components,
    :meth:`sdp_jax.step.inner.InnerLayout.check`).

    Raises:
      ValueError: the family's, or naming the mesh sizes and the fix."""
    mesh_lib.check_worker_shape(workers, pipe.stages, shape.fsdp, shape.tensor)
    plan = family.plan(config, model, workers, pipe)
    InnerLayout(plan, shape.fsdp, shape.tensor).check()
    return plan


def _check_mesh_shape(config, shape: MeshShape, pipe, family) -> None:
    """A worker of ``F x T`` devices (:class:`sdp_jax.options.MeshShape`) against the rest of
    the run: not with emulated workers (a pipeline: :func:`sdp_jax.mesh.check_worker_shape`,
    in :func:`_plan`); ``tensor`` only for a family
    that splits over it; ``F`` dividing the rows of a worker's microbatch
    (:func:`sdp_jax.step.inner.check_rows`).

    Raises:
      ValueError: naming the fields and the fix."""
    if shape.devices == 1:
        return
    sizes = f"mesh.fsdp x mesh.tensor = {shape.fsdp} x {shape.tensor}"
    if config.emulate_workers:
        raise ValueError(f"emulated workers run on one device, but {sizes} gives each worker "
                         f"{shape.devices}; set --config.emulate_workers=False, or "
                         "--config.mesh.fsdp=1 --config.mesh.tensor=1.")
    if shape.tensor > 1 and not family.tensor_parallel:
        raise ValueError(f"config.mesh.tensor={shape.tensor}: tensor parallelism is not built "
                         f"for {family.kind} models; set --config.mesh.tensor=1 (mesh.fsdp "
                         "shards them inside a worker).")
    check_rows(shape.fsdp, config.batch_per_worker // config.grad_accum)


def _check_microbatches(config, pipe) -> None:
    """``config.grad_accum`` (a positive integer, :class:`sdp_jax.options.StepOptions`) divides
    ``batch_per_worker``, and a pipeline's microbatches divide the rows of an accumulation
    microbatch.

    Raises:
      ValueError: naming both values and the fix."""
    b, k = config.batch_per_worker, config.grad_accum
    if b % k:
        raise ValueError(f"config.grad_accum={k} does not divide config.batch_per_worker={b}; "
                         "the per-worker batch is cut into grad_accum equal microbatches: "
                         "choose a divisor.")
    if k > 1 and pipe.stages > 1 and (b // k) % pipe.microbatches:
        raise ValueError(f"pipeline.microbatches={pipe.microbatches} does not divide the rows "
                         f"of a gradient-accumulation microbatch, batch_per_worker / grad_accum "
                         f"= {b} / {k}; choose a divisor of it, or a smaller config.grad_accum.")


def _check_declared(config, family) -> None:
    """Every declared field of every run and of ``family``'s own (``family.declared``) against
    its type, bounds and choices (:func:`sdp_jax.fields.check_settings`); a coverage given as
    ``auto``, which only a command that compiles can pick.

    Raises:
      ValueError: naming the field, its value and what it must be."""
    for cls in (config_lib.SdpConfig, config_lib.RunControl) + tuple(family.declared):
        cls(**fields.read_settings(cls, config))
    if config.sdp.coverage == "auto":
        raise ValueError("config.sdp.coverage='auto' is picked by compiling the run (python "
                         "train.py, or python -m sdp_jax.bench --fit for the table); this "
                         "command needs a number: give --config.sdp.coverage=C.")


def _check_profile(first: int, last: int, total: int) -> None:
    """The profiler's window (``profile_start`` .. ``profile_stop``, integers >= 0 already):
    both 0 (off), or ``1 <= profile_start <= profile_stop`` with ``profile_start`` one of the
    run's ``total`` steps (a window past the end of the run is traced up to it).

    Raises:
      ValueError: one of the two without the other, a reversed window, or a start past the
        run's last step."""
    if not first and not last:
        return
    if not first or not last:
        raise ValueError(f"config.profile_start={first} with config.profile_stop={last}: give "
                         "both, the first and last step traced (e.g. --config.profile_start=5 "
                         "--config.profile_stop=7), or neither.")
    if last < first:
        raise ValueError(f"config.profile_stop={last} is before config.profile_start={first}; "
                         "give profile_start <= profile_stop (both steps are traced).")
    if first > total:
        raise ValueError(f"config.profile_start={first} is past the run's last step ({total}); "
                         f"choose a step in 1..{total}.")


def resolve_workers(config, device_count: int, stages: int = 1,
                    processes: int | None = None, inner: int = 1) -> int:
    """``W`` from ``config.workers`` (0 = every device, or devices / ``stages`` with a
    pipeline of ``stages`` stages, or devices / ``inner`` with workers of ``inner = F x T``
    devices); with ``config.emulate_workers`` any ``W`` (on one device).

    Raises:
      ValueError: not a positive integer, ``W * stages * inner`` more than the devices, or
        not every device with several processes, or processes holding unequal numbers of
        devices (:func:`sdp_jax.mesh.check_devices_per_process`); emulation refused (a
        pipeline, several processes, ``workers=0``)."""
    processes = jax.process_count() if processes is None else processes
    if processes > 1:
        mesh_lib.check_devices_per_process()
    per, lower = (("pipeline.stages", "pipeline.stages") if stages > 1 else
                  ("(mesh.fsdp x mesh.tensor)", "mesh.fsdp or --config.mesh.tensor") if inner > 1
                  else ("", ""))
    zero = "0 = every device" + (f" / {per}" if per else "")
    config_lib.RunControl(**fields.read_settings(config_lib.RunControl, config))
    workers = config.workers or max(device_count // (stages * inner), 1)
    if _emulated(config, stages, processes):
        return workers
    need = workers * stages * inner
    if need > device_count:
        hint = (f", or simulate more CPU devices with --config.num_cpu_devices={need}"
                if jax.devices()[0].platform == "cpu" else "")
        what = (f"config.workers={workers}" if not per else
                f"workers * {per} = {workers} * {stages * inner}")
        raise ValueError(f"{what} needs {need} devices but only {device_count} devices are "
                         f"available; lower --config.workers ({zero})"
                         + (f" or --config.{lower}" if per else "") + f"{hint}.")
    if processes > 1 and need != device_count:
        if not per:
            raise ValueError(f"with several processes every device is a worker: set "
                             f"--config.workers=0 (got {need} of {device_count} devices).")
        raise ValueError(f"with several processes every device belongs to a worker: workers x "
                         f"{per} must be the {device_count} devices (got {workers} x "
                         f"{stages * inner} = {need}); set --config.workers=0 and a {per} "
                         f"that divides {device_count}"
                         + (" (under the elastic launcher, give --processes-per-worker so that "
                            "it restarts whole workers)." if inner > 1 else "."))
    return workers


def _emulated(config, stages: int, processes: int) -> bool:
    """``config.emulate_workers`` (a bool, :class:`sdp_jax.options.StepOptions`), with emulation's
    refusals (:func:`sdp_jax.sync.placement.check_emulation`)."""
    emulate = config.emulate_workers
    if emulate:
        placement.check_emulation(stages, processes,
                                  fix="set --config.emulate_workers=False")
        if not config.workers:   # (a config-only rule: SDPStep takes W from its spec)
            raise ValueError("config.workers=0 (every device) with config.emulate_workers=True: "
                             "give the number of workers to emulate, e.g. "
                             "--config.workers=8.")
    return emulate


def canonical_dtype(config) -> None:
    """``bf16`` / ``fp32`` -> ``bfloat16`` / ``float32``, so that checkpoints record one name."""
    if config.dtype in DTYPE_ALIASES:
        with config.unlocked():
            config.dtype = DTYPE_ALIASES[config.dtype]


def total_steps(config, coverage: float, steps: int | None = None) -> int:
    """The optimizer steps of a run of ``steps`` (default ``config.steps``): ``steps``, or
    under ``flop_matched`` an SDP run's ``ceil(steps / C)``
    (:func:`flop_matched_steps`)."""
    steps = config.steps if steps is None else steps
    if config.flop_matched and config.sdp.variant != "ddp":
        return flop_matched_steps(steps, coverage)
    return steps


def make_mesh(run: RunSpec):
    """The run's mesh (:func:`sdp_jax.mesh.make_mesh`): ``('data',)`` of ``W`` devices,
    ``('data', 'stage')`` of ``W x P`` when pipelined, or ``('data', 'fsdp', 'tensor')`` of
    ``W x F x T`` with workers of several devices (grouped by TPU slice and host,
    :func:`sdp_jax.mesh.worker_grid`), else devices in process order; one device with
    ``config.emulate_workers``."""
    return mesh_lib.make_mesh(run.workers, run.pipe.stages,
                              emulated=run.options.emulate_workers,
                              fsdp=run.mesh_shape.fsdp, tensor=run.mesh_shape.tensor)


def trajectory_config(config) -> dict[str, Any]:
    """The parts of the config a checkpoint must agree with (plain JSON dict)."""
    d = json.loads(config.to_json())
    for path in CONTROL:
        *sections, key = path.split(".")
        node = d
        for section in sections:
            node = node.get(section, {})
        node.pop(key, None)
    return d


def flop_matched_steps(ddp_steps: int, coverage: float) -> int:
    """FLOP-matched budget (Singh et al., Sec. 5): an SDP run at coverage C takes ``1/C`` times
    the optimizer steps of the DDP budget, rounded up."""
    return int(math.ceil(ddp_steps / coverage - 1e-9))
