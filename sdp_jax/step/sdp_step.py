"""The SDP training step: one builder for every variant, for the built-in language models and
for a model that is not part of this package.

:class:`SDPStep` builds the pure, jitted ``train_step(state, batch) -> (state, metrics)`` from

* an :class:`sdp_jax.spec.SDPSpec` (the model's declared rules, variant, W, C, scheme, seed);
* a loss function (float32 scalar: the mean loss of a worker's slice of the batch) for the
  worker's *local* parameters (nested dicts). Under forward masking (``ddp``, ``b-sdp``,
  ``n-sdp``) they are compact: ``k`` blocks, narrowed neuron leaves (:mod:`sdp_jax.spec.layout`), so
  the worker's subnetwork alone runs (docs/design.md invariant 4); under backward masking
  (``bb-sdp``, ``nb-sdp``) they are the full model, and only the held components get gradients;
* an ``optax.GradientTransformation`` without clipping (``grad_clip`` clips by the norm of the
  averaged gradient with every component counted once, invariant 6).

Two forms of the loss:

* ``loss_fn(params, batch)``: ``params`` is the whole local tree;
* with ``block_fn`` (the *block runner* hook; needed by FSDP and activation checkpointing):
  ``loss_fn(params, batch, run)``, where ``params`` holds every leaf outside the stacked block
  subtree (``Blocks(path, stacked=True)``) and ``run(h) -> h`` applies the worker's blocks in
  depth order, each as ``block_fn(block_params, h)`` on one block's parameters (no stack axis).
  The step decides where each block's parameters come from, wraps each block in
  ``jax.checkpoint`` for ``remat``, and averages the block gradients inside the backward loop
  (:func:`sdp_jax.step.sources.in_loop_tables`). Call ``run`` once per step: each call's backward
  pass issues its own averaging collectives (the mean stays right, the bytes multiply).

The step is assembled from pieces, one job each, inside ``jax.shard_map`` over the mesh axis
``data`` (or, with ``emulate_workers``, under ``jax.vmap`` over ``data`` on one device: the
placement, :mod:`sdp_jax.sync.placement`), as the regime decided once from the spec and the options
says (:class:`sdp_jax.step.regime.Regime`, :attr:`SDPStep.regime`):

* :class:`sdp_jax.step.state.StateLayout`: how every leaf of the state is stored (the layout kinds
  ``R``, ``C``, ``Rw``, ``S``), its shapes and partition specs, init and ``full_params``;
* :class:`sdp_jax.step.runner.ModelCall`: the loss on a tree of leaves, and the block runner;
* a parameter source per regime (:mod:`sdp_jax.step.sources`): the compact subnetwork (forward
  masking), the full model with held gradients and the ZeRO-2 update (backward masking), or
  FSDP gathers; it gives the loss its parameters and takes back the gradient;
* the update (:mod:`sdp_jax.step.update`): holder averaging (:func:`sdp_jax.sync.average`, mean
  over each component's holders, invariant 2), the global norm of :func:`sdp_jax.sync.
  global_norm`, the clipped optax update; or periodic parameter averaging (``average=
  "parameters"``: each worker steps on its own gradient and the parameters are averaged over
  their holders every ``sync_every`` steps);
* :class:`sdp_jax.step.evaluation.Evaluation` (the full model's loss and gathers) and
  :mod:`sdp_jax.step.alignment` (gradient alignment).

Mixed precision (``StepOptions(dtype="bfloat16")``): compute and FSDP gathers in bf16; the
stored parameters, the optimizer state and gradient averaging keep their dtype (float32 in a
run: master parameters).

Pipeline stages: on a mesh ``('data', 'stage')`` of ``W x P`` devices the spec describes one
stage (its ``L / P`` blocks; the same masks in every stage) and every leaf of the block subtree
gains a stage axis split over ``stage``, so device ``(w, s)`` stores worker ``w``'s part of
stage ``s``'s blocks; always-kept leaves are replicated over ``stage``. Inside ``shard_map``
the step drops the stage axis, and everything above (averaging over ``data``, FSDP, remat,
dtype) runs per stage; the loss (block-runner form) runs the schedule, e.g.
:class:`sdp_jax.pipeline.Pipeline`, and must return the same value on every stage. The
gradient norm sums the stages' blocks once (:func:`sdp_jax.sync.sum_parts`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax import mesh as mesh_lib
from sdp_jax.mesh import DATA, STAGE
from sdp_jax.options import ModelHooks, StepOptions
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step import alignment
from sdp_jax.step import update as update_lib
from sdp_jax.step.accumulation import accumulate
from sdp_jax.step.evaluation import Evaluation
from sdp_jax.step.host import HostForms
from sdp_jax.step.inner import InnerLayout, check_rows
from sdp_jax.step.regime import Regime
from sdp_jax.step.runner import ModelCall
from sdp_jax.step.sources import in_loop_tables, source_of
from sdp_jax.step.state import StateLayout, map_moments
from sdp_jax.sync import collectives as sync
from sdp_jax.sync.placement import placement_of


def batch_sharding(mesh) -> NamedSharding:
    """The global batch's sharding on a run's mesh: rows split over ``data`` (replicated over
    a worker's own devices, ``fsdp`` and ``tensor``, which split them inside the step,
    :meth:`sdp_jax.step.inner.InnerLayout.split_rows`; and over ``stage``). The loop also
    derives from it the rows each process loads (:func:`sdp_jax.train.data.sharding_rows`)."""
    return NamedSharding(mesh, P(DATA))


def _explain_unreplicated(fn: Callable) -> Callable:
    """``fn`` (a ``shard_map`` of the step), with the error of an update that differs between
    workers where the state is stored replicated turned into a one-line error naming the usual
    cause (an optimizer that reads one worker's gradient alone, docs/design.md invariant 6)."""
    def traced(*args):
        try:
            return fn(*args)
        except ValueError as e:
            msg = str(e)
            if "could not infer replication" not in msg or "out_specs[0]" not in msg:
                raise
            leaf = msg[msg.index("out_specs[0]") + len("out_specs[0]"):].split(" ")[0]
            raise ValueError(
                f"the updated state {leaf} differs between workers although every worker "
                "stores it alike: the optimizer changed it by a value of one worker's own "
                "gradient, as optax.clip_by_global_norm (or another transform that reads the "
                "gradient's global norm) does inside shard_map; leave clipping out of the "
                "optax chain and set StepOptions(grad_clip=...) (--config.optim.grad_clip), "
                "which clips by the holder-averaged norm (docs/design.md invariant 6).") from None
    return traced


def _check_mesh(spec: spec_lib.SDPSpec, mesh, emulate: bool):
    """The step's mesh (default: the first ``W`` devices, or one device when ``emulate``),
    checked against the spec."""
    W = spec.workers
    need = 1 if emulate else W
    if mesh is None:
        if len(jax.devices()) < need:
            raise ValueError(f"the spec has W={W} workers but only {len(jax.devices())} "
                             "devices are present; on a CPU set "
                             f"jax.config.update('jax_num_cpu_devices', {W}) before using "
                             "JAX, or emulate the workers on one device "
                             "(StepOptions(emulate_workers=True)).")
        mesh = mesh_lib.make_mesh(W, emulated=emulate)
    if DATA not in mesh.shape:
        raise ValueError(f"the mesh has axes {tuple(mesh.axis_names)}, none named "
                         f"'{DATA}'; build it as jax.make_mesh(({need},), ('{DATA}',)).")
    mesh_lib.check_worker_shape(W, int(dict(mesh.shape).get(STAGE, 1)),
                                *mesh_lib.inner_sizes(mesh))
    if mesh.shape[DATA] != W and not emulate:
        raise ValueError(f"mesh axis '{DATA}' has {mesh.shape[DATA]} devices but the "
                         f"spec has W={W} workers; give a mesh of {W} devices, or emulate "
                         "the workers on a mesh of one device "
                         "(StepOptions(emulate_workers=True)).")
    return mesh


def _check_runner(spec, mesh, block_fn, remat) -> None:
    """The refusals of the block runner's settings."""
    if STAGE in mesh.axis_names and block_fn is None:
        raise ValueError("a mesh axis 'stage' (pipeline) runs the blocks stage by stage: pass "
                         "block_fn and a pipelined loss_fn(params, batch, run) (e.g. "
                         "sdp_jax.pipeline.Pipeline.loss), or drop the 'stage' axis.")
    if remat != "none" and block_fn is None:
        raise ValueError("remat works block by block inside the block runner: give "
                         "ModelHooks(loss_fn, block_fn=...) (one block's apply) with a "
                         "loss_fn(params, batch, run) that calls run(h), or set remat off (or "
                         "checkpoint inside your model).")
    if block_fn is not None and not spec.blocks_stacked:
        raise ValueError("block_fn needs a stacked block subtree (rules with "
                         "Blocks(path, stacked=True)); this spec has "
                         + ("list-form blocks" if spec.block_path else
                            "several block stacks" if spec.stacks else "no Blocks rule")
                         + ": drop block_fn and use loss_fn(params, batch).")
    if block_fn is not None:
        outside = [p for p in spec.leaf_rules if p[:len(spec.block_path)] != spec.block_path]
        if outside:
            raise ValueError(f"the block runner handles masked leaves block by block, but "
                             f"{spec_lib.path_str(outside[0])!r} is masked outside the block "
                             f"subtree {spec_lib.path_str(spec.block_path)!r}; move its rule "
                             "into the blocks, or drop block_fn (and fsdp, remat).")


def _check_state(spec, model: ModelHooks, mesh, fsdp: bool) -> None:
    """The refusals of model state, stacked slots and parameter metrics."""
    state_spec, block_fn = model.state_spec, model.block_fn
    stacked_slots, param_metrics = model.stacked_slots, model.param_metrics
    if STAGE in mesh.axis_names and (state_spec is not None or stacked_slots):
        raise ValueError("a mesh axis 'stage' (pipeline) is built for a stacked block stack "
                         "run by the block runner; model state (state_spec) and "
                         "stacked_slots are not: drop the 'stage' axis or them.")
    if param_metrics is not None and fsdp:
        raise ValueError("param_metrics reads the worker's parameters, which FSDP stores as "
                         "shards; drop param_metrics or fsdp.")
    if state_spec is None:
        return
    same = (state_spec.variant == spec.variant and state_spec.workers == spec.workers
            and all(np.array_equal(t.masks, spec.kinds[k].masks)
                    for k, t in state_spec.kinds.items() if k in spec.kinds)
            and set(state_spec.kinds) <= set(spec.kinds))
    if not same:
        raise ValueError("state_spec must describe the same workers and masks as the "
                         "parameters' spec (same variant, W, kinds and masks); build it "
                         "with the same arguments.")
    if block_fn is not None:
        raise ValueError("model state (state_spec) is not built with the block runner; "
                         "drop block_fn, or the state.")


class SDPStep:
    """The train step, evaluation and state layout of one SDP run.

    Args:
      spec: the spec (``W`` = the mesh's ``data`` size).
      model: the model's functions, a :class:`sdp_jax.options.ModelHooks`, or only its loss
        ``(params, batch) -> loss`` (``ModelHooks(loss_fn)``). The loss is a float32 scalar
        (``(loss, aux dict)`` with ``has_aux``) on the worker's slice (leading axis ``b``) of
        the global batch; with ``block_fn`` it takes ``(params, batch, run)`` (see the module
        docstring).
      optimizer: an optax transformation, applied to the compact parameters under forward
        masking; under FSDP and backward masking to the shards of layout ``S`` (each device's
        ``1/W`` of a leaf, flattened into rows: ``[n]``, ``[L, r]`` or ``[L, Gc, r]``), so it
        must act elementwise (AdamW, SGD, Lion; not Adafactor, LAMB, Muon or a weight-decay
        mask that reads a leaf's shape). Backward masking keeps always-kept leaves outside the
        blocks whole. Leave clipping out of it (``options.grad_clip``).
      mesh: a mesh with an axis ``data`` of size ``W``; default: the first ``W`` devices (with
        ``options.emulate_workers``, a mesh of one device, :func:`sdp_jax.mesh.make_mesh`
        ``(W, emulated=True)``).
      options: the step's settings, a :class:`sdp_jax.options.StepOptions` (default: its
        defaults): the averaging (``average``, ``sync_every``, ``method``), ``fsdp``,
        ``remat``, ``dtype``, ``emulate_workers``, ``grad_accum``, ``grad_clip``,
        ``total_steps``, ``unroll``; each documented where it is declared.
      schedule: optional optax schedule, reported as metric ``lr``.

    What the options do here:

    * ``average="parameters"``: each worker steps on its own gradient; parameters averaged
      over holders every ``sync_every`` steps (forward variants without FSDP).
    * ``fsdp``: parameters, gradients and optimizer state sharded over the workers (ZeRO-3,
      layout ``S``). With ``block_fn`` each block is gathered when it runs, only the held
      blocks / neurons / heads (all_to_all); without it the whole model is gathered at the
      start of the step (all_gather of full-size bytes; the gathered copy lives through the
      step) and the worker's subnetwork pruned from it locally. Model state is not sharded.
    * ``remat``: activation checkpointing of each block (Chen et al. 2016, "Training deep
      nets with sublinear memory cost"); needs ``block_fn``.
    * ``emulate_workers``: the ``W`` workers on one device, the same per-worker step under
      ``jax.vmap`` over ``data`` (:class:`sdp_jax.sync.placement.Emulated`; the same results, ``W``
      times one worker's memory). Not with a pipeline or several processes.
    * ``grad_accum``: each worker's slice in ``grad_accum`` microbatches run one after
      another, their mean gradient averaged and applied once (:mod:`sdp_jax.step.accumulation`);
      the per-worker rows ``b`` must be a multiple of it.

    And the model's (:class:`sdp_jax.options.ModelHooks`): ``state_spec`` (model state such
    as BatchNorm statistics: ``loss_fn(params, batch, state)`` returns ``(loss, new_state)``,
    with ``has_aux`` ``(loss, aux, new_state)``; each component of the new state averaged over
    its holders after every step; the train state gains ``stats``; not with ``block_fn``),
    ``stacked_slots`` (the model runs a worker's list-form slots itself, e.g.
    :mod:`sdp_jax.models.vision`; the held block ids are
    ``spec.kinds[kind].held[sync.worker_index()]``), ``param_metrics`` (of the worker's
    updated parameters, mean over workers; not with FSDP).

    Raises:
      ValueError: the mesh's ``data`` size differs from ``W`` (from 1 with
        ``emulate_workers``) or too few devices; emulation with a pipeline or several
        processes; options the variant does not support (parameter averaging with backward
        masking); a ``stage`` axis without ``block_fn``, or with model state or
        ``stacked_slots``; ``param_metrics`` with FSDP; remat without ``block_fn``;
        ``block_fn`` without a stacked block subtree, or with a masked leaf outside it.
    """

    def __init__(self, spec: spec_lib.SDPSpec, model: ModelHooks | Callable, optimizer,
                 mesh=None, options: StepOptions | None = None,
                 schedule: Callable | None = None):
        model = model if isinstance(model, ModelHooks) else ModelHooks(model)
        options = StepOptions() if options is None else options
        if not isinstance(options, StepOptions):
            raise ValueError(f"options={options!r} is not a sdp_jax.options.StepOptions; "
                             "build one, e.g. StepOptions(fsdp=True, remat='full').")
        options.check_for(spec)
        self.placement = placement_of(_check_mesh(spec, mesh, options.emulate_workers),
                                      spec.workers, options.emulate_workers)
        mesh = self.placement.mesh
        _check_runner(spec, mesh, model.block_fn, options.remat)
        _check_state(spec, model, mesh, options.fsdp)
        self.spec, self.model, self.optimizer, self.mesh = spec, model, optimizer, mesh
        self.options, self.schedule = options, schedule
        self.periodic = options.periodic
        self.regime = Regime.of(spec, options, runner=model.block_fn is not None,
                                staged=STAGE in mesh.axis_names,
                                inner=mesh_lib.inner_sizes(mesh))
        self.call = ModelCall(spec, model, options, InnerLayout(spec, *self.regime.inner))
        self.state_layout = StateLayout(spec, optimizer, mesh, prefix=self.call.prefix,
                                        regime=self.regime, state_spec=model.state_spec,
                                        stacked_slots=model.stacked_slots)
        self.state_layout.inner.check()
        self.host = HostForms(self.state_layout)
        self.in_loop_tables = in_loop_tables(self.state_layout, self.call)
        self.source = source_of(self.state_layout, self.call, self.in_loop_tables)
        self.accumulated_grads = accumulate(self.source, options.grad_accum, options.unroll)
        self.update = update_lib.update_of(self.state_layout, self.in_loop_tables)
        self.evaluation = Evaluation(self.state_layout, self.call, self.source, self.placement)
        st = self.state_layout   # the layout's public names, as the step has always offered them
        self.layout, self.staged, self.stages = st.layout, st.staged, st.stages
        self.param_layout, self.compact_layout = st.param_layout, st.compact_layout
        self.param_specs, self.param_shapes = st.param_specs, st.param_shapes
        self.compact_specs, self.compact_shapes = st.compact_specs, st.compact_shapes
        self.opt_specs, self.state_specs = st.opt_specs, st.state_specs
        if model.state_spec is not None:
            self.stats_specs, self.stats_shapes = st.stats_specs, st.stats_shapes
        self._train_steps: dict[tuple, Any] = {}
        self._alignment = None

    @property
    def extras(self):
        """What the step's builder attached (:attr:`sdp_jax.options.ModelHooks.extras`)."""
        return self.model.extras

    # ------------------------------------------------------------------ the state
    def shardings(self, specs=None):
        """NamedShardings of ``specs`` (default: the state's)."""
        return self.state_layout.shardings(specs)

    def abstract_state(self):
        """ShapeDtypeStruct tree (with shardings) of the train state, for compile and restore."""
        return self.state_layout.abstract_state()

    def batch_sharding(self):
        return batch_sharding(self.mesh)

    def per_device_param_count(self) -> int:
        """Parameter elements stored per device (compact where the layout is compact; a 1/W
        shard under FSDP, padding included; with a pipeline, the device's stage's blocks)."""
        return self.state_layout.per_device_param_count()

    def init(self, full_params: Any) -> dict:
        """State ``{params, opt_state, step}`` (and ``stats`` with a ``state_spec``) on the mesh
        from the full model's parameters: an ``nnx.Module``, ``nnx.State`` or nested dict, or
        a function of no arguments that returns one (then called inside ``jit``, so no device
        holds the whole model); with a ``state_spec``, a pair ``(parameters, model state)`` or
        a function returning one. Every holder of a component starts from the same values.

        Raises:
          ValueError: the parameters (or the model state) differ in paths or shapes from the
            spec's (``state_spec``'s); a step with model state given no pair."""
        return self.host.init(full_params)

    def init_state(self, seed: int) -> dict:
        """:meth:`init` from ``init_fn(seed)`` (the constructor's ``init_fn``)."""
        if self.model.init_fn is None:
            raise ValueError("init_state needs init_fn (seed -> full parameters); or call "
                             "init(full_params).")
        return self.init(lambda: self.model.init_fn(seed))

    def full_params(self, params, optimizer_layout: bool = False) -> dict:
        """The full model's parameters (host numpy, nested dict), each component from its
        first holder (always-kept per-worker copies: worker 0's). Accepts the state or its
        ``params``; gathers the whole model to this host (one process). With
        ``optimizer_layout``, a tree in the optimizer's layout instead (``compact_specs``:
        :meth:`grads_fn`'s gradient, a moment of the optimizer state)."""
        return self.host.full_params(params, optimizer_layout)

    def full_state(self, state: dict, average: bool = False) -> dict:
        """A train state in this step's layout -> ``{params, opt_state, stats}`` of the full
        model (host numpy; gathers to this host, one process): the parameters and every
        parameter-shaped entry of the optimizer state joined (``average``: the holders' mean,
        for parameter averaging's drifted copies), other optimizer entries as stored, the
        model state (``stats``; None without one) joined like the parameters. :meth:`store`
        lays it out again (an elastic resume, :mod:`sdp_jax.train.elastic`)."""
        host = self.host
        opt = map_moments(lambda x: host.full_params(x, True, average), state["opt_state"],
                          self.compact_shapes, other=np.asarray)
        stats = state.get("stats")
        if stats is not None:
            stats = host.full_stats(stats, average)
        return {"params": host.full_params(state["params"], average=average), "opt_state": opt,
                "stats": stats}

    def store(self, full, part: str = "params"):
        """A full tree (nested dict of full-shape arrays, e.g. from :meth:`full_state`) -> its
        stored form in this step's layout (traceable under ``jit``), for ``part``:
        ``params`` (the parameters), ``moment`` (a parameter-shaped entry of the optimizer
        state, in the optimizer's layout) or ``stats`` (the model state).

        Raises:
          ValueError: another ``part``."""
        host = self.host
        forms = {"params": host.store, "moment": lambda t: host.optimizer_form(host.store(t)),
                 "stats": host.store_stats}
        if part not in forms:
            raise ValueError(f"part={part!r}; use params, moment or stats.")
        return forms[part](full)

    def per_worker(self, fn, in_specs, out_specs, check_vma: bool = True):
        """``fn`` written for one worker, run over the ``W`` workers as the step's own programs
        are (``jax.shard_map`` over ``data``, or ``jax.vmap`` when emulated; the arguments
        as :meth:`sdp_jax.sync.placement.Placement.map` takes them), e.g. a family's own
        evaluation."""
        return self.placement.map(fn, in_specs, out_specs, check_vma)

    def describe_placement(self) -> str:
        """One line on where the workers run when they are emulated on one device
        (:meth:`sdp_jax.sync.placement.Emulated.describe`) or each spans several devices
        (:meth:`sdp_jax.sync.placement.OnDevices.describe`); ``""`` on ``W`` devices."""
        shown = self.placement.emulated or self.regime.inner != (1, 1)
        return self.placement.describe() if shown else ""

    # ------------------------------------------------------------------ the step
    def skips_unheld(self) -> bool:
        """Whether a worker's unheld blocks skip their weight gradients
        (:func:`sdp_jax.step.runner.held_weight_grads`): backward masking of whole blocks
        (``bb-sdp``) with the block runner, full activation checkpointing (which recomputes
        each block in the backward pass anyway) and no FSDP (whose gathers mask the gradients
        of unheld blocks instead)."""
        return self.source.skips_unheld()

    def earlier_layouts(self) -> tuple:
        """The checkpoint layouts earlier releases wrote for this step's regime, as pairs
        ``(current abstract state -> old abstract state, restored old state -> current
        state)``, tried in turn when a checkpoint does not restore as it is
        (:mod:`sdp_jax.train.migrations`): backward masking's compact optimizer state
        (:meth:`sdp_jax.step.sources.BackwardHeld.compact_optimizer`); none for the others."""
        return self.source.earlier_layouts(self.optimizer, self.placement, self.opt_specs)

    def _local_step(self, state, batch, sync_now: bool, count_branch: bool | None):
        st = self.state_layout
        state = st.staging.unstage(state, self.state_specs)
        batch = st.inner.split_rows(batch)
        loss, aux, grads, local, new_stats = self.accumulated_grads(
            state["params"], batch, state.get("stats"), count_branch=count_branch)
        params, opt_state, gnorm = update_lib.apply(self.update, self.optimizer,
                                                    self.options.grad_clip, grads, local,
                                                    state["opt_state"], sync_now)
        if self.staged and STAGE in (sync.varying_axes(loss) or ()):
            raise ValueError("with a mesh axis 'stage' the loss must be the same on every stage "
                             "(e.g. psum the last stage's loss over 'stage', as "
                             "sdp_jax.pipeline.Pipeline.loss does).")
        metrics = {"train_loss": jax.lax.pmean(loss, DATA), "grad_norm": gnorm,
                   **{k: jax.lax.pmean(v, DATA) for k, v in aux.items()}}
        if self.schedule is not None:
            metrics["lr"] = self.schedule(state["step"])
        if self.model.param_metrics is not None:
            mine = spec_lib.unflatten(st.strip(params))
            metrics.update({k: jax.lax.pmean(v, DATA)
                            for k, v in self.model.param_metrics(mine).items()})
        out = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        if self.model.state_spec is not None:
            out["stats"] = update_lib.averaged_stats(st, new_stats, self.update.method)
        return st.staging.restage(out, self.state_specs), metrics

    def train_step_fn(self, sync_now: bool = True, count_branch: bool | None = None):
        """Jitted ``(state, batch) -> (state, metrics)``; ``batch`` is a pytree of arrays whose
        leading axis is the global batch ``W * b`` (sharded ``P('data')``); ``state`` is
        donated. metrics: ``train_loss`` (mean over workers), ``grad_norm`` (of the averaged
        gradient, before clipping; with parameter averaging the mean over workers of each
        worker's own gradient norm), ``lr`` (with a schedule), the loss's aux values. With
        parameter averaging, ``sync_now=False`` gives the step without the averaging.
        ``count_branch``: see :meth:`compiled_train_step` (for counting FLOPs only)."""
        sync_now = bool(sync_now) or not self.periodic
        key = (sync_now, count_branch)
        if key not in self._train_steps:
            fn = self.placement.map(lambda s, b: self._local_step(s, b, sync_now, count_branch),
                                    (self.state_specs, P(DATA)), (self.state_specs, P()))
            # (the stored layout kept over a worker's own devices, which shard_map leaves to XLA)
            out = ((self.shardings(), NamedSharding(self.mesh, P())) if self.regime.inner
                   != (1, 1) else None)
            self._train_steps[key] = jax.jit(_explain_unreplicated(fn), donate_argnums=0,
                                             out_shardings=out)
        return self._train_steps[key]

    @property
    def train_step(self):
        """``(state, batch) -> (state, metrics)``: :meth:`train_step_fn`; with periodic
        parameter averaging every ``H > 1`` steps, a function that runs the step with or
        without the averaging as :meth:`is_sync_step` says for the state's next step (it reads
        the step counter from the device, waiting for the previous step)."""
        if not self.periodic or self.options.sync_every == 1:
            return self.train_step_fn()

        def step(state, batch):
            n = int(jax.device_get(state["step"])) + 1
            return self.train_step_fn(self.is_sync_step(n))(state, batch)
        return step

    def is_sync_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) ends with parameter averaging."""
        return (not self.periodic or step % self.options.sync_every == 0
                or (self.options.total_steps is not None and step == self.options.total_steps))

    def _averaged_grads(self, params, batch):
        st = self.state_layout
        params = st.staging.unstage(params, self.param_specs)
        loss, _, g, _, _ = self.source.grads(params, st.inner.split_rows(batch))
        g = self.update.averaged(g)
        return (jax.lax.pmean(loss, DATA),
                st.staging.restage(st.lead(g, self.compact_layout), self.compact_specs))

    def grads_fn(self):
        """Jitted ``(params, batch) -> (loss, averaged gradient)``, the gradient in the
        optimizer's layout (``compact_specs``: compact, or layout ``S`` under FSDP and backward
        masking; :meth:`full_params` with ``optimizer_layout=True`` gives the full shapes).
        For inspection and tests.

        Raises:
          ValueError: a step with model state (``state_spec``)."""
        if self.model.state_spec is not None:
            raise ValueError("grads_fn is not built for a step with model state (state_spec).")
        fn = self.placement.map(self._averaged_grads, (self.param_specs, P(DATA)),
                                (P(), self.compact_specs))
        return jax.jit(fn)

    def alignment_fn(self):
        """Jitted ``(state, batch) -> {"grad_alignment", "update_alignment"}`` (float32
        scalars, replicated), measured on the state's parameters and the global batch of a
        train step, without changing either (the gradient-alignment explanation of Singh et
        al., arXiv 2507.09029, for block against width-wise subnetworks):

        * ``grad_alignment``: the mean over workers of ``cos(g_sub, g_full|held)``, where
          ``g_sub`` is the gradient worker ``w``'s training computes for the components it
          holds (forward masking: its compact subnetwork alone runs) and ``g_full|held`` the
          full model's gradient on the same slice of the batch, restricted to those
          components. 1 at ``C = 1``; under backward masking 1 by construction (the full
          forward pass gives the held components the full model's gradient).
        * ``update_alignment``: ``cos(ḡ, g_DDP)`` over every parameter, ``ḡ`` each
          component's mean of ``g_sub`` over its holders (the averaged gradient of an SDP step,
          before clipping) and ``g_DDP`` the mean over workers of the full model's gradient
          (the step DDP would take on the same batch).

        Costs one full-model forward and backward pass per worker on top of the subnetwork's,
        and holds the full model on every device (as :meth:`gather`). Without the block
        runner ``loss_fn`` must also run the full model's tree (as :meth:`eval_step_fn`
        needs), e.g. by building the model from the number of blocks it is given.

        Raises:
          ValueError: FSDP, parameter averaging (``average="parameters"``: the workers'
            copies differ), a pipeline (``stage`` axis), ``stacked_slots`` (a model that
            runs its own slots, e.g. the vision models, has no full-model loss here)."""
        alignment.check(self.options, pipelined=self.staged,
                        no_full_loss="stacked_slots models" if self.model.stacked_slots else "")
        if self._alignment is None:
            ev = self.evaluation
            if self.model.state_spec is None:
                fn = self.placement.map(lambda p, b: alignment.local_alignment(ev, p, b),
                                        (self.param_specs, P(DATA)), P())
                self._alignment = jax.jit(lambda s, b: fn(s["params"], b))
            else:
                fn = self.placement.map(
                    lambda p, st, b: alignment.local_alignment(ev, p, b, st),
                    (self.param_specs, self.state_specs["stats"], P(DATA)), P())
                self._alignment = jax.jit(lambda s, b: fn(s["params"], s["stats"], b))
        return self._alignment

    def put_batch(self, batch: Any) -> Any:
        """A host batch (leading axis ``W * b``) placed on the mesh, sharded ``P('data')``
        (one process; with several, build the global array with
        ``jax.make_array_from_process_local_data``).

        Raises:
          ValueError: a leaf whose leading axis is not a multiple of ``W``."""
        W = self.spec.workers
        for x in jax.tree.leaves(batch):
            if not getattr(x, "shape", ()) or x.shape[0] % W:
                raise ValueError(f"a batch leaf of shape {getattr(x, 'shape', ())} does not "
                                 f"split over W={W} workers; give every leaf a leading axis "
                                 f"that is a multiple of {W} (b examples per worker).")
            check_rows(self.regime.inner[0], x.shape[0] // W // self.options.grad_accum)
        return jax.tree.map(lambda x: jax.device_put(x, self.batch_sharding()), batch)

    def compiled_train_step(self, batch: Any, count_branch: bool | None = None):
        """The train step lowered and compiled for abstract inputs (no data, no state in device
        memory): ``batch`` a pytree of ``jax.ShapeDtypeStruct`` of the global batch. Read its
        per-device memory with ``memory_analysis()`` (:func:`sdp_jax.costs.memory_stats`).

        ``count_branch`` (for counting FLOPs only; wrong gradients): when a worker's unheld
        blocks skip their weight gradients (:meth:`skips_unheld`), every block takes the
        held (True) or the unheld (False) branch of
        :func:`sdp_jax.step.runner.held_weight_grads` (XLA's cost analysis counts a conditional
        as its costliest branch; :func:`sdp_jax.bench.measure.measure` compiles both)."""
        batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                            sharding=self.batch_sharding()),
                             batch)
        step = self.train_step_fn(count_branch=count_branch)
        return step.lower(self.abstract_state(), batch).compile()

    # ------------------------------------------------------------------ evaluation
    def gather(self, params, stats=None) -> tuple[dict, dict | None]:
        """Inside ``jax.shard_map`` over ``data`` (params in :attr:`param_specs`, stats in
        :attr:`stats_specs`): the full model, the same on every worker, as nested dicts
        ``(parameters, model state or None)``, each component the mean over its holders
        (:func:`sdp_jax.sync.gather_full`; FSDP: every leaf all-gathered), in the stored
        dtypes.

        Raises:
          ValueError: with the block runner under FSDP, or with a pipeline (use
            :meth:`eval_step_fn`, which streams the blocks)."""
        return self.evaluation.gather(params, stats)

    def eval_step_fn(self):
        """Jitted full-model loss ``(params, batch) -> float32`` (mean over workers of each
        worker's slice): every block with all its neurons and heads, each component the mean
        over its holders (FSDP: gathered from its owners).

        Raises:
          ValueError: a step with model state or ``stacked_slots`` (evaluate through
            :meth:`gather`)."""
        return self.evaluation.step_fn()
