"""The protocol between a model and the one training loop, and a user's own model through it.

:class:`Family` is the protocol: the hooks that :func:`sdp_jax.train.run.resolve` (the config's
validation) and :func:`sdp_jax.train.loop.train` (the resumable loop) call, with defaults. Both
built-in families, :class:`sdp_jax.train.families.LanguageModelFamily` and
:class:`sdp_jax.train.families.VisionFamily`, implement it; everything else about a run
(checkpoints, resume on another process layout, SIGINT / SIGTERM, ``metrics.jsonl`` and
TensorBoard, finiteness checks, ``summary.json``) is written once, in the loop.

:class:`Task` is a :class:`Family` for a model that is not part of this package: subclass it and
write the model's few functions (its parameters from a seed, its SDP rules, its loss, the global
batch of step ``s``), and the loop trains it as it trains the built-in models::

    class MyTask(Task):
        name = "my-mlp"
        def model_fields(self):             return {"depth": 8}
        def init(self, model, seed):        return Net(model.depth, nnx.Rngs(seed))
        def rules(self, model):             return [sdp.Blocks("blocks")]
        def loss(self, model, plan):        return loss_fn   # (params, batch) -> float32
        def batch(self, config, step, size): return x, y     # host arrays [size, ...]

    task = MyTask()
    config = task.config()                  # sdp, optim, run control, and the model section
    config.sdp.variant, config.sdp.coverage = "b-sdp", 0.5
    sdp_jax.train.loop.train(config, "runs/mine", task=task)   # rerun: resumes

See docs/custom_models.md, "Training your own model through the loop", and
``examples/custom_loop.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np

from sdp_jax import fields as fields_lib
from sdp_jax.costs import program as costs
from sdp_jax.options import REMAT, ModelHooks, StepOptions
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step import sdp_step as step_lib
from sdp_jax.train import config as config_lib
from sdp_jax.train import optimizer as optim_lib


def schedule_steps(options: StepOptions) -> int:
    """``options.total_steps``, which a family's step needs for its learning-rate schedule.

    Raises:
      ValueError: None."""
    if not isinstance(options, StepOptions) or options.total_steps is None:
        raise ValueError(f"options={options!r}: a family's step needs StepOptions with "
                         "total_steps (the run's optimizer steps, for the learning-rate "
                         "schedule), e.g. StepOptions(total_steps=1000).")
    return options.total_steps


def compiled_flops(compiled, devices: int, counted: bool) -> dict:
    """``{"model_flops_per_step": XLA's FLOP count of the compiled train step times the
    ``devices`` that run the W workers}`` (``RunSpec.worker_devices``: W x F x T, or 1 when
    emulated), or None when not ``counted`` (a block scan or activation checkpointing: XLA
    counts a loop body once, whatever its trip count) or when XLA gives no count."""
    if not counted:
        return {"model_flops_per_step": None}
    return {"model_flops_per_step": costs.flops_per_device(compiled) * devices or None}


def mean_loss(eval_fn: Callable, params, batches: list, put: Callable, shapes) -> float:
    """The mean over ``batches`` (host global batches, this process's rows) of the full model's
    loss ``eval_fn(params, batch)`` (:meth:`sdp_jax.step.SDPStep.eval_step_fn`), each batch
    placed by ``put(rows, ShapeDtypeStruct)``; each value is read before the next batch is
    sent, so that one collective program is in flight (docs/design.md, CPU)."""
    return float(np.mean([float(eval_fn(params, jax.tree.map(put, b, shapes)))
                          for b in batches]))


class Family:
    """The hooks a model family gives :func:`sdp_jax.train.run.resolve` and
    :func:`sdp_jax.train.loop.train`: everything else about a run is written once in those two.

    The hooks before the run is resolved (:meth:`template`, :meth:`model_config`,
    :meth:`plan`) read the run's ``ml_collections.ConfigDict``; every later hook takes the one
    resolved run, ``run``, a :class:`sdp_jax.train.run.RunSpec` (``run.model``: what
    :meth:`model_config` returned, ``run.plan``: what :meth:`plan` returned, ``run.workers``,
    ``run.global_batch``, ``run.total_steps``, ``run.optim``, ``run.pipe``,
    ``run.options``: the step's :class:`sdp_jax.options.StepOptions`, and ``run.config``: the
    checked config, for the family's own fields such as ``seq_len`` or ``data``). The hooks
    that raise ``NotImplementedError`` here are the ones a family must define; :class:`Task`
    defines all of them from a user's few model functions.

    Attributes:
      kind: what the messages call the family's runs (``language-model``, ``vision``, a
        task's ``name``).
      rate_key: the throughput field of ``metrics.jsonl`` (``tokens_per_s``,
        ``images_per_s``, ``examples_per_s``); its prefix is what :meth:`items_per_step` counts.
      declared: the classes that declare the family's own fields
        (:func:`sdp_jax.fields.setting`, e.g. :class:`sdp_jax.train.config.LanguageModelRun`),
        checked by :func:`sdp_jax.train.run.resolve`.
      remat: the activation checkpointing modes the family supports.
      fixed_model_fields: True when :meth:`template`'s ``model`` section lists every field of
        the model section (then ``resolve`` names a missing or unknown one like any other
        field); False when :meth:`model_config` checks the model section itself (the vision
        models' fields differ per ``model.name``).
      tensor_parallel: the family's models split over the mesh axis ``tensor`` (``mesh.tensor
        > 1``; the axes of its ``Neurons`` rules, :mod:`sdp_jax.step.inner`).
    """

    kind: str = "model"
    rate_key: str = "examples_per_s"
    declared: tuple = ()
    remat: tuple = REMAT
    fixed_model_fields: bool = False
    tensor_parallel: bool = True

    def _undefined(self, hook: str):
        return NotImplementedError(f"{type(self).__name__} does not define the hook {hook} "
                                   "(see sdp_jax.train.task.Family).")

    # ------------------------------------------------------------ the config
    def template(self, config) -> tuple[ml_collections.ConfigDict, str]:
        """``(the family's default run config, the call that builds it)``: the schema that
        ``config`` must have (e.g. ``sdp_jax.train.config.base_config()``)."""
        raise self._undefined("template")

    def model_config(self, config) -> Any:
        """The model's config (``run.model``) from the config, after checking the model (and
        data) fields.

        Raises:
          ValueError: a bad model or data field, naming it and the fix."""
        raise self._undefined("model_config")

    def plan(self, config, model, workers: int, pipe) -> spec_lib.SDPSpec:
        """The run's :class:`sdp_jax.spec.SDPSpec` (its masks) for ``W = workers``; ``pipe``:
        :class:`sdp_jax.pipeline.PipelineConfig` (``stages=1``: no pipeline).

        Raises:
          ValueError: what :func:`sdp_jax.spec.build` refuses (a coverage not realizable, ...)."""
        raise self._undefined("plan")

    def aligns(self, model, plan: spec_lib.SDPSpec) -> bool:
        """Whether ``config.align_every`` can measure the run's gradient alignment
        (:meth:`sdp_jax.step.SDPStep.alignment_fn`: the model's own loss on the full model);
        False by default."""
        return False

    def record(self, plan: spec_lib.SDPSpec) -> dict:
        """What a checkpoint stores to recognise the masks (docs/design.md invariant 7): by
        default :meth:`sdp_jax.spec.SDPSpec.record`."""
        return plan.record()

    def added_fields(self) -> dict:
        """Config fields newer than some of the family's checkpoints, with the value older runs
        used (nested dict; none by default)."""
        return {}

    # ------------------------------------------------------------ data and step
    def data(self, run, rows: tuple[int, int], log: Callable,
             train: bool = True) -> tuple[Callable | None, Any]:
        """``(train, evaluation data)`` of this process: ``train(s)`` is the iterator over the
        training batches from step ``s + 1`` on (batch ``s`` first: the data position is the
        step, whatever the process layout), each batch the ``rows = (first, count)`` rows of
        the global batch that this process loads (:func:`sdp_jax.train.data.sharding_rows`),
        a pytree like :meth:`batch_shapes`; ``train=False``: ``(None, evaluation data)``.
        Logs the data's description first (``log(line)``) and raises for bad data before
        returning (before any compile).

        Raises:
          ValueError: bad data (a missing file, batches of the wrong shape)."""
        raise self._undefined("data")

    def step(self, run, mesh) -> step_lib.SDPStep:
        """The run's :class:`sdp_jax.step.SDPStep` on ``mesh`` (from
        :func:`sdp_jax.train.loop.make_mesh`), with ``init_fn(seed)``."""
        raise self._undefined("step")

    def check_start(self, run) -> dict | None:
        """Check, before the workdir is created, the files a run without a checkpoint starts
        from (those :meth:`initial_state` reads; none by default) and return what its
        checkpoints record of them (``meta["init_from"]``, which the tools read back), or
        None.

        Raises:
          ValueError: one line naming the file and what is wrong with it."""
        return None

    def initial_state(self, run, builder: step_lib.SDPStep, log: Callable) -> dict:
        """The train state a run without a checkpoint starts from: by default
        ``builder.init_state(config.seed)`` (the model's initializer)."""
        return builder.init_state(run.config.seed)

    def batch_shapes(self, run) -> Any:
        """The global batch as ``jax.ShapeDtypeStruct`` (a pytree, as :meth:`data`'s iterator
        yields it, with the leading axis ``run.global_batch``)."""
        raise self._undefined("batch_shapes")

    def items_per_step(self, run) -> int:
        """Tokens, images or examples per optimizer step (the unit of :attr:`rate_key`)."""
        raise self._undefined("items_per_step")

    def param_count(self, run) -> int:
        """The full model's parameters (elements, every component counted once)."""
        raise self._undefined("param_count")

    def model_flops_per_item(self, run) -> float | None:
        """Training FLOPs per item of a worker's subnetwork (None, the default: unknown, no
        FLOP/s or MFU in the metrics)."""
        return None

    def compiled(self, run, compiled) -> tuple[list[str], dict]:
        """``(log lines, summary fields)`` read from the compiled train step (none by
        default)."""
        return [], {}

    def evaluator(self, run, builder: step_lib.SDPStep, data, put: Callable,
                  log: Callable) -> Callable[[dict], dict[str, float]]:
        """``state -> {name: float}``: the full model's evaluation on ``data`` (:meth:`data`'s
        evaluation data); ``put(host rows, ShapeDtypeStruct)`` places a batch on the mesh.
        ``val_loss`` and ``test_loss`` are checked finite by the loop."""
        raise self._undefined("evaluator")

    # ------------------------------------------------------------ what a run reports
    def describe(self, run) -> list[str]:
        """Extra log lines of the family's settings (none by default)."""
        return []

    def postfix(self, rec: dict) -> dict[str, str]:
        """The progress bar's fields of a metrics record (with the last evaluation's values):
        by default the training loss and, once evaluated, ``val_loss``."""
        post = {"loss": f"{rec['train_loss']:.3f}"}
        if "val_loss" in rec:
            post["val"] = f"{rec['val_loss']:.3f}"
        return post

    def summary(self, run, step: int, last_eval: dict, last_rec: dict) -> dict:
        """The family's fields of ``summary.json`` (the loop adds the run's own)."""
        raise self._undefined("summary")

    def done_line(self, summary: dict) -> str:
        """The end of the run's last log line, from its summary (e.g. the final loss)."""
        raise self._undefined("done_line")


# The model functions a Task must define; the rest are optional.
REQUIRED = ("init", "rules", "loss", "batch")
def _check_hooks(name: str, hooks: dict) -> None:
    """Refuse a task's :meth:`Task.model_hooks` that names something other than a model hook.

    Raises:
      ValueError: naming the key, and the config field when it is a run setting."""
    allowed = sorted({f.name for f in dataclasses.fields(ModelHooks)} - {"loss_fn", "init_fn"})
    set_by_run = {f.name: fields_lib.config_path(StepOptions, f)
                  for f in fields_lib.settings(StepOptions)}
    for key in hooks:
        if key in ("loss_fn", "init_fn"):
            raise ValueError(f"{name}.model_hooks gives {key}, which the Task's "
                             f"{key[:-3]}() gives; leave it out of model_hooks.")
        if set_by_run.get(key):
            raise ValueError(f"{name}.model_hooks gives {key}, which the run sets "
                             f"(--config.{set_by_run[key]}); set it there and leave it out "
                             "of model_hooks (or override Task.step).")
        if key not in allowed:
            raise ValueError(f"{name}.model_hooks gives {key!r}, which is not a model hook; "
                             f"give only {', '.join(allowed)} (sdp_jax.options.ModelHooks), "
                             "or override Task.step.")


def _signature(batch) -> tuple:
    """(tree structure, (shape, dtype) of every leaf) of a host batch."""
    leaves, tree = jax.tree.flatten(batch)
    return tree, tuple((a.shape, a.dtype) for a in leaves)


class Task(Family):
    """A model that is not part of this package, trained by the one loop: subclass it and
    define :meth:`init`, :meth:`rules`, :meth:`loss` and :meth:`batch` (and, if the model has
    any, :meth:`model_fields`); :meth:`val_batches` and :meth:`model_hooks` are optional.

    Every :class:`Family` hook then has a default: the config is :meth:`config` (the ``sdp``,
    ``optim`` and run-control fields of every run and the model section), the spec is
    :func:`sdp_jax.spec.build` of the parameters and rules, the step an
    :class:`sdp_jax.step.SDPStep` of the loss with the run's optimizer (AdamW or SGD from
    ``config.optim``, warm-up and decay, clipping by the holder-averaged norm), the data the
    batches of :meth:`batch` (this process's rows of them), the evaluation the full model's
    loss on :meth:`val_batches` (``val_loss``), the throughput ``examples_per_s``, and
    ``summary.json`` gains ``model`` (the task's name), ``examples``, ``final_train_loss`` and
    ``final_<name>`` of every evaluated value. A subclass may override any hook.

    Attributes:
      name: ``model.name`` of the task's configs and its name in messages (default: the
        class's name). A checkpoint records it: a run of another task is refused.
    """

    name: str = ""
    fixed_model_fields = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.name:
            cls.name = cls.__name__

    @property
    def kind(self) -> str:
        return self.name

    # ------------------------------------------------------------ what a user writes
    def model_fields(self) -> dict[str, Any]:
        """The model section's fields and their defaults (``config.model``, besides ``name``),
        e.g. ``{"depth": 8, "width": 32}``; none by default. Each can be overridden like any
        config field (``config.model.depth = 4``, ``--config.model.depth=4``)."""
        return {}

    def init(self, model: ml_collections.FrozenConfigDict, seed: int) -> Any:
        """The full model's parameters from ``seed`` (int): an ``nnx.Module`` (its
        ``nnx.Param`` variables), an ``nnx.State`` or a nested dict of float arrays. Called
        under ``jax.jit`` and ``jax.eval_shape``, so it must be traceable (``nnx.Rngs(seed)``
        is). ``model``: the config's model section (``model.depth``...)."""
        raise self._undefined("init")

    def rules(self, model: ml_collections.FrozenConfigDict) -> list:
        """The model's SDP rules: a list of :class:`sdp_jax.spec.Blocks` and
        :class:`sdp_jax.spec.Neurons` (docs/custom_models.md)."""
        raise self._undefined("rules")

    def loss(self, model: ml_collections.FrozenConfigDict,
             plan: spec_lib.SDPSpec) -> Callable:
        """The loss as :class:`sdp_jax.step.SDPStep` takes it: ``loss_fn(params, batch) ->
        float32 scalar``, the mean loss of a worker's slice of the global batch (every leaf's
        leading axis ``batch_per_worker``) for its *local* parameters (under forward masking
        the compact subnetwork: ``plan.local_blocks`` blocks in depth order, narrowed neuron
        leaves; under backward masking the full model). The default evaluation
        (:meth:`sdp_jax.step.SDPStep.eval_step_fn`) calls it on the full model, so it takes
        the depth from ``params`` (e.g. ``len(params["blocks"])`` for an ``nnx.List``), not
        from ``plan``. With ``model_hooks`` giving ``block_fn`` or ``has_aux``, the forms
        :class:`SDPStep` documents for them."""
        raise self._undefined("loss")

    def batch(self, config, step: int, size: int) -> Any:
        """The global batch of step ``step`` (0-based: the batch the state with ``step``
        optimizer steps behind it trains on next): a pytree of host arrays (numpy, or
        anything ``np.asarray`` takes) each with the leading axis ``size`` (``W *
        batch_per_worker`` examples), the same shapes and dtypes at every step (float64 is
        stored as JAX's default float, float32).

        It must be a pure function of ``(config, step)``: a resumed run asks for the batches
        from its checkpoint's step on, and every process computes the same global batch and
        keeps its own rows, so the trajectory does not depend on the process layout
        (docs/design.md invariant 8). Seed any randomness from ``config.seed`` and ``step``,
        e.g. ``np.random.default_rng([config.seed, step])``."""
        raise self._undefined("batch")

    def val_batches(self, config, size: int) -> list:
        """Global batches (as :meth:`batch` returns them) on which the full model's loss is
        evaluated every ``config.eval_every`` steps and at the end (``val_loss``, the mean of
        the batches' losses); none by default (no evaluation)."""
        return []

    def model_hooks(self, model: ml_collections.FrozenConfigDict,
                    plan: spec_lib.SDPSpec) -> dict[str, Any]:
        """Further model functions of the step, as fields of
        :class:`sdp_jax.options.ModelHooks` besides the loss and ``init_fn``, e.g.
        ``block_fn`` (the block runner, which ``remat`` needs), ``has_aux`` (the loss returns
        ``(loss, {name: scalar})``, reported as metrics) or ``param_metrics``; none by
        default. (With ``state_spec`` or ``stacked_slots`` the default evaluation does not
        apply: override :meth:`evaluator`.) The step's settings are the config's
        (:class:`sdp_jax.options.StepOptions`), not given here."""
        return {}

    # ------------------------------------------------------------ the run config
    def config(self) -> ml_collections.ConfigDict:
        """The task's run config with its defaults (:func:`sdp_jax.train.config.task_config`
        with ``model.name = name`` and :meth:`model_fields`); change fields on it before
        :func:`sdp_jax.train.loop.train`."""
        return config_lib.task_config({"name": self.name, **self.model_fields()})

    def template(self, config):
        """:meth:`config`; refuses first a task that lacks one of its model functions.

        Raises:
          ValueError: :meth:`init`, :meth:`rules`, :meth:`loss` or :meth:`batch` not defined."""
        if hasattr(self, "step_options"):
            raise ValueError(f"{type(self).__name__} defines step_options, which is now "
                             "model_hooks (the same dict of sdp_jax.options.ModelHooks fields: "
                             "block_fn, has_aux, ...); rename the method.")
        missing = [m for m in REQUIRED if getattr(type(self), m) is getattr(Task, m)]
        if missing:
            raise ValueError(f"{type(self).__name__} does not define {', '.join(missing)}; a "
                             "Task defines init(model, seed), rules(model), loss(model, plan) "
                             "and batch(config, step, size) (sdp_jax.train.task.Task).")
        return self.config(), f"{type(self).__name__}().config()"

    def model_config(self, config) -> ml_collections.FrozenConfigDict:
        """The model section, frozen (its fields are checked against :meth:`model_fields` by
        :func:`sdp_jax.train.run.resolve`).

        Raises:
          ValueError: ``model.name`` is not the task's."""
        if config.model.name != self.name:
            raise ValueError(f"config.model.name={config.model.name!r} but the task is "
                             f"{self.name!r}; build the run config with "
                             f"{type(self).__name__}().config().")
        return ml_collections.FrozenConfigDict(config.model)

    # ------------------------------------------------------------ the Family hooks
    def aligns(self, model, plan) -> bool:
        """True unless :meth:`model_hooks` gives ``stacked_slots`` (a model that runs its
        own block slots has no full-model loss of its own here)."""
        return not self.model_hooks(model, plan).get("stacked_slots")

    def plan(self, config, model, workers: int, pipe) -> spec_lib.SDPSpec:
        """:func:`sdp_jax.spec.build` of the parameters' shapes (:meth:`init` traced, no
        compute) and :meth:`rules`, with the config's variant, coverage and mask recipe.

        Raises:
          ValueError: what :func:`sdp_jax.spec.build` refuses, prefixed with the task's name."""
        s = config.sdp
        shapes = jax.eval_shape(lambda: spec_lib.pure_tree(self.init(model, config.seed)))
        try:
            return spec_lib.build(shapes, self.rules(model), s.variant, workers, s.coverage,
                                  scheme=s.scheme, seed=s.mask_seed,
                                  allow_nonuniform=s.allow_nonuniform,
                                  allow_disconnected=s.allow_disconnected)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None

    def _global(self, batch, size: int, call: str):
        """A batch as numpy arrays in JAX's dtypes, each with the leading axis ``size``.

        Raises:
          ValueError: no arrays, or a leaf of another leading axis (naming ``call``)."""
        leaves, tree = jax.tree.flatten(batch)
        if not leaves:
            raise ValueError(f"{call} returned no arrays ({batch!r}); return the global batch, "
                             "e.g. a tuple (inputs [size, ...], targets [size, ...]).")
        out = []
        for leaf in leaves:
            a = np.asarray(leaf)
            if a.ndim == 0 or a.shape[0] != size:
                raise ValueError(f"{call} returned a leaf of shape {a.shape}; every leaf of a "
                                 f"global batch needs the leading axis size={size} "
                                 "(W * batch_per_worker examples).")
            out.append(a.astype(jax.dtypes.canonicalize_dtype(a.dtype), copy=False))
        return jax.tree.unflatten(tree, out)

    def data(self, run, rows, log, train: bool = True):
        """``(step -> iterator over this process's rows of batch(config, step, size), ...),
        this process's rows of the validation batches)``; step 0's batch and the validation
        batches are checked here, before any compile.

        Raises:
          ValueError: a batch without arrays, of another leading axis than the global batch,
            or (validation, later steps) of other shapes or dtypes than step 0's."""
        config, size, (first, count) = run.config, run.global_batch, rows
        name = type(self).__name__
        want = _signature(self._global(self.batch(config, 0, size), size,
                                       f"{name}.batch(config, 0, {size})"))

        def mine(batch, call):
            if _signature(batch) != want:
                raise ValueError(f"{call} returned {_signature(batch)[1]} but step 0's batch "
                                 f"is {want[1]}; return the same structure, shapes and dtypes "
                                 "every time.")
            return jax.tree.map(lambda a: a[first:first + count], batch)

        def train_at(start: int):
            step = start
            while True:
                call = f"{name}.batch(config, {step}, {size})"
                yield mine(self._global(self.batch(config, step, size), size, call), call)
                step += 1

        call = f"{name}.val_batches(config, {size})"
        val = [mine(self._global(b, size, call), call) for b in self.val_batches(config, size)]
        log(f"data: {name}.batch, {size} examples per step"
            + f"; {len(val)} validation batch{'es' if len(val) != 1 else ''}")
        return (train_at if train else None), val

    def step(self, run, mesh) -> step_lib.SDPStep:
        """The :class:`sdp_jax.step.SDPStep` of :meth:`loss` with the run's options
        (``run.options``), the optimizer of ``config.optim`` and its schedule, ``init_fn``
        from :meth:`init`, and :meth:`model_hooks`.

        Raises:
          ValueError: :meth:`model_hooks` gives a name that is no model hook (naming the
            config field when the run sets it); everything :class:`SDPStep` refuses."""
        model, plan = run.model, run.plan
        hooks = dict(self.model_hooks(model, plan))
        _check_hooks(type(self).__name__, hooks)
        return step_lib.SDPStep(
            plan, ModelHooks(self.loss(model, plan), init_fn=lambda seed: self.init(model, seed),
                             **hooks),
            optim_lib.make_optimizer(run.optim, run.total_steps), mesh, run.options,
            schedule=optim_lib.lr_schedule(run.optim, run.total_steps))

    def batch_shapes(self, run):
        """Step 0's global batch as ``jax.ShapeDtypeStruct``."""
        size = run.global_batch
        batch = self._global(self.batch(run.config, 0, size), size,
                             f"{type(self).__name__}.batch(config, 0, {size})")
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)

    def items_per_step(self, run) -> int:
        """Examples per step: the global batch."""
        return run.global_batch

    def param_count(self, run) -> int:
        """The elements of every parameter leaf of the full model."""
        return int(sum(np.prod(s, dtype=np.int64) for s in run.plan.shapes.values()))

    def compiled(self, run, compiled) -> tuple[list[str], dict]:
        """``model_flops_per_step`` from XLA's count of the compiled step
        (:func:`compiled_flops`; None with a block runner or activation checkpointing)."""
        runner = "block_fn" in self.model_hooks(run.model, run.plan)   # (a block scan)
        return [], compiled_flops(compiled, run.worker_devices,
                                  run.options.flops_counted and not runner)

    def evaluator(self, run, builder, val_batches, put, log):
        """``state -> {"val_loss": float}``: the full model's loss
        (:meth:`sdp_jax.step.SDPStep.eval_step_fn`, each component the mean over its
        holders) averaged over :meth:`val_batches`; ``{}`` without validation batches."""
        if not val_batches:
            return lambda state: {}
        eval_fn, shapes = builder.eval_step_fn(), self.batch_shapes(run)
        return lambda state: {"val_loss": mean_loss(eval_fn, state["params"], val_batches,
                                                    put, shapes)}

    def summary(self, run, step: int, last_eval: dict, last_rec: dict) -> dict:
        return {"model": self.name, "examples": step * run.global_batch,
                "final_train_loss": last_rec.get("train_loss"),
                **{f"final_{k}": v for k, v in last_eval.items()}}

    def done_line(self, summary: dict) -> str:
        parts = [f"final {k[len('final_'):].replace('_', ' ')} {v:.4f}"
                 for k, v in summary.items()
                 if k.startswith("final_") and isinstance(v, (int, float))]
        return ", ".join(parts) or "no loss recorded"
