"""The SDP training step: one builder for every variant, for the built-in language models and
for a model that is not part of this package.

:class:`SDPStep` builds the pure, jitted ``train_step(state, batch) -> (state, metrics)`` from

* an :class:`sdp_jax.spec.SDPSpec` (the model's declared rules, variant, W, C, scheme, seed);
* a loss function (float32 scalar: the mean loss of a worker's slice of the batch) for the
  worker's *local* parameters (nested dicts). Under forward masking (``ddp``, ``b-sdp``,
  ``n-sdp``) they are compact: ``k`` blocks, narrowed neuron leaves (:mod:`sdp_jax.layout`), so
  the worker's subnetwork alone runs (docs/design.md invariant 4); under backward masking (``bb-sdp``,
  ``nb-sdp``) they are the full model, and only the held components get gradients;
* an ``optax.GradientTransformation`` without clipping (``grad_clip`` clips by the norm of the
  averaged gradient with every component counted once, invariant 6).

Two forms of the loss:

* ``loss_fn(params, batch)``: ``params`` is the whole local tree;
* with ``block_fn`` (the *block runner* hook; needed by FSDP and activation checkpointing):
  ``loss_fn(params, batch, run)``, where ``params`` holds every leaf outside the stacked block
  subtree (``Blocks(path, stacked=True)``) and ``run(h) -> h`` applies the worker's blocks in
  depth order, each as ``block_fn(block_params, h)`` on one block's parameters (no stack axis).
  The step decides where each block's parameters come from (the compact stack, the frozen full
  model under backward masking, or an FSDP gather of only the held rows), wraps each block
  in ``jax.checkpoint`` for ``remat``, and averages the block gradients inside the backward
  loop (:meth:`SDPStep._in_loop_tables`). Call ``run`` once per step: each call's backward
  pass issues its own averaging collectives (the mean stays right, the bytes multiply).

The step, inside ``jax.shard_map`` over the mesh axis ``data``: local loss and gradient ->
:func:`sdp_jax.sync.average` (mean over each component's holders, invariant 2; with the block
runner and ``method="alltoall"`` the block gradients are averaged inside the backward loop as
each block's gradient appears, :func:`sdp_jax.sync.mean_in_backward`) -> clipping by
:func:`sdp_jax.sync.global_norm` -> the optimizer on the compact parameters (forward
masking). Under backward masking every worker keeps the full model and the update is sharded
(ZeRO-2): the local gradient goes to the owners of its pieces (the first all_to_all leg of
:func:`sdp_jax.sync.holder_shards`, the mean over holders in layout ``S``), each device updates
its ``1/W`` of every masked leaf, and one all-gather rebuilds every worker's full parameters
(:meth:`SDPStep._mean_shards`). With periodic parameter averaging (``averaging=
"parameters"``) each worker steps on its own gradient and the parameters are averaged over
their holders every ``sync_every`` steps instead.

State layout, per stored leaf (mesh axis ``data``, ``W`` workers):

* ``R``: replicated ``P()`` (always-kept leaves; every parameter under backward masking);
* ``C``: compact, a global ``[W, ...]`` array sharded ``P('data')``: device ``w`` stores only its
  worker's part (parameters and optimizer state under forward masking);
* ``Rw``: a per-worker copy ``[W, ...]`` of an always-kept leaf (periodic averaging, where the
  workers drift apart between averaging steps);
* ``S`` (``fsdp=True``, ZeRO-3): the *full* leaf, each element stored once, in the rows view of
  :mod:`sdp_jax.sync` (``[n]``, ``[L, r]`` or ``[L, Gc, r]``, zero-padded), sharded over ``data``
  on its last axis. The same devices are SDP workers and FSDP shards: worker ``w`` gathers only
  the blocks (neurons, heads) it holds, one block per scan step (an all_to_all with static
  tables); the transpose sends its gradients back to their owners (the masked sum over holders).
  Without the block runner (list-form blocks, model state: the vision models) every leaf is
  stored flat (``[n]``) and gathered whole at the start of the step; the worker prunes its
  subnetwork from it, and each entry's gradient, scaled by ``1 / holders``, returns by
  reduce-scatter (full-size bytes: the holder-only gathers need the block runner).
  Backward masking without FSDP stores its optimizer state in this layout (ZeRO-2).

Mixed precision (``dtype="bfloat16"``): compute and FSDP gathers in bf16; master parameters,
optimizer state and gradient averaging in float32.

Pipeline stages: on a mesh ``('data', 'stage')`` of ``W x P`` devices the spec describes one
stage (its ``L / P`` blocks; the same masks in every stage) and every leaf of the block subtree
gains a stage axis split over ``stage`` (``[W, P, k, ...]`` for ``C``, ``[P, L / P, ...]`` for
``R``, ``[P, ...]`` rows for ``S``), so device ``(w, s)`` stores worker ``w``'s part of stage
``s``'s blocks; always-kept leaves are replicated over ``stage``. Inside ``shard_map`` the step
drops the stage axis, and everything above (averaging over ``data``, FSDP, remat, dtype) runs per
stage; the loss (block-runner form) runs the schedule, e.g. :class:`sdp_jax.pipeline.Pipeline`,
and must return the same value on every stage. The gradient norm sums the stages' blocks once
(:func:`sdp_jax.sync.sum_parts`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax import layout as layout_lib
from sdp_jax import spec as spec_lib
from sdp_jax import sync
from sdp_jax.mesh import STAGE

AXIS = sync.AXIS
AVERAGING = ("gradients", "parameters")
REMAT = ("none", "full", "dots")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "fp32": jnp.float32,
          "bf16": jnp.bfloat16}
METHODS = ("alltoall", "psum")
_GATHERED = "fsdp_gathered"  # checkpoint_name of FSDP-gathered parameters (never saved)
# Outputs that only move or re-type data: not saved for the backward pass under FSDP without
# activation checkpointing, so that no copy of a gathered parameter (the all_gather's output,
# its reshape or its cast) is kept as a residual: the backward pass gathers again, as FSDP
# does. (jax's save_anything_except_these_names(_GATHERED) let the value under the name be
# saved instead: the whole gathered block stayed alive.) Cheap to recompute from what is kept.
_MOVES = frozenset({"all_gather", "all_to_all", "reshape", "convert_element_type", "squeeze",
                    "expand_dims", "broadcast_in_dim", "dynamic_slice", "slice", "transpose",
                    "concatenate", "gather", "copy", "name"})


def batch_sharding(mesh) -> NamedSharding:
    """The global batch's sharding on a run's mesh: rows split over ``data`` (replicated over
    ``stage``). The loop also derives from it the rows each process loads
    (:func:`sdp_jax.train.data.sharding_rows`)."""
    return NamedSharding(mesh, P(AXIS))


def _save_all_but_gathered(prim, *_, **__) -> bool:
    """Remat policy of FSDP with ``remat='none'``: every value is saveable except data
    movement (:data:`_MOVES`), so activations are kept and gathered parameters never are."""
    return prim.name not in _MOVES
_flatten, _unflatten = spec_lib.flatten, spec_lib.unflatten


def check_remat_dtype(remat: str, dtype: str | None) -> None:
    """Raises ValueError unless ``remat`` is one of :data:`REMAT` and ``dtype`` a key of
    :data:`DTYPES` (or None: as stored)."""
    if remat not in REMAT:
        raise ValueError(f"remat={remat!r}; use one of {', '.join(REMAT)}.")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; use float32 or bfloat16 (None: as stored).")


def cast_floating(x: jax.Array, dtype) -> jax.Array:
    """``x`` in the compute ``dtype`` if it is floating (None: unchanged); integers as they
    are."""
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.astype(dtype)


def clipped_update(optimizer: optax.GradientTransformation, grads: Any, norm: jax.Array,
                   grad_clip: float, opt_state: Any, params: Any) -> tuple[Any, Any]:
    """One optimizer step: ``grads`` clipped to global norm ``grad_clip`` by the caller's
    ``norm`` (:func:`sdp_jax.sync.clip_to`; 0 = no clipping), then ``optimizer``'s update
    applied to ``params``. Returns ``(new params, new optimizer state)``."""
    grads = sync.clip_to(grads, norm, grad_clip)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def remat_block(body: Callable, remat: str, fsdp: bool = False) -> Callable:
    """Activation checkpointing of one block's function ``body``: ``full`` saves only the
    block input, ``dots`` also matmul outputs against weights, ``none`` saves everything
    (``body`` returned as it is). Under FSDP the gathered parameters are never saved: the
    backward pass gathers them again, as FSDP does."""
    cp = jax.checkpoint_policies
    if remat == "full":
        policy = cp.nothing_saveable
    elif remat == "dots":
        policy = cp.dots_with_no_batch_dims_saveable
    elif fsdp:
        policy = _save_all_but_gathered
    else:
        return body
    return jax.checkpoint(body, policy=policy, prevent_cse=False)


def held_weight_grads(f: Callable, held, own: dict, frozen: dict, always: dict, h,
                      branch: bool | None = None):
    """``f({**own, **always}, h)`` where ``held`` (a traced bool scalar), else
    ``f({**frozen, **always}, h)``, whose backward pass computes the weight gradient of ``own``
    only where ``held``: a worker's unheld block under backward masking gets the input
    gradient (``h``'s, which the blocks below need) and no weight-gradient matmul.

    The backward pass recomputes the block from its inputs (a custom VJP whose residuals are
    the inputs) and runs one of two VJPs under ``lax.cond``: the full one, or the one of ``h``
    alone with the weights constant. That is the recomputation activation checkpointing does
    anyway, so :class:`SDPStep` uses it under ``remat="full"`` only (without checkpointing the
    recomputation would cost more FLOPs, one forward pass of every block, than the skipped
    weight gradients, ``(1 - C)`` of a third of the block's FLOPs, save).

    Args:
      f: ``(leaves, h) -> h`` one block: leaves a flat dict of arrays (any dtype), ``h`` the
        hidden state (any shape and floating dtype; the output has ``h``'s shape and dtype).
      held: bool scalar; where False the cotangent of ``own`` is zero.
      own: the differentiable values of the held-masked leaves; ``frozen``: their values where
        not held (same keys, shapes and dtypes; no cotangent); ``always``: leaves whose
        gradient is always computed.
      branch: None (the default); True / False replaces ``held`` by a constant in the backward
        pass, for counting FLOPs only (:func:`sdp_jax.bench.measure.measure`: XLA's cost analysis
        counts a conditional as its costliest branch).

    Returns:
      the block's output, ``h``'s shape and dtype.
    """
    def pick(held, own, frozen):
        return {p: jnp.where(held, own[p], frozen[p]) for p in own}

    @jax.custom_vjp
    def block(held, own, frozen, always, h):
        return f({**pick(held, own, frozen), **always}, h)

    def fwd(held, own, frozen, always, h):   # residuals: the block's inputs, one weight copy
        w = pick(held, own, frozen)
        return f({**w, **always}, h), (held, w, always, h)

    def bwd(res, dy):
        held, w, always, h = res

        def weights():
            _, vjp = jax.vjp(lambda w, a, h: f({**w, **a}, h), w, always, h)
            return vjp(dy)

        def inputs_only():
            _, vjp = jax.vjp(lambda a, h: f({**w, **a}, h), always, h)
            da, dh = vjp(dy)
            return jax.tree.map(jnp.zeros_like, w), da, dh
        if branch is None:
            d_own, d_always, dh = jax.lax.cond(held, weights, inputs_only)
        else:
            d_own, d_always, dh = weights() if branch else inputs_only()
        return None, d_own, None, d_always, dh

    block.defvjp(fwd, bwd)
    return block(held, own, frozen, always, h)


def shardings(mesh, specs):
    """NamedShardings on ``mesh`` of a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def abstract_state(builder, stored: dict) -> dict:
    """ShapeDtypeStruct tree (with the builder's state shardings) of a train state: the
    ``stored`` entries (e.g. ``params``), the optimizer state of ``builder.compact_shapes``
    and the int32 step."""
    opt = jax.eval_shape(builder.optimizer.init, builder.compact_shapes)
    shapes = {**stored, "opt_state": opt, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, builder.shardings())


class Runner:
    """The block stack as ``loss_fn`` sees it: ``run(h) -> h`` applies the worker's blocks.

    Attributes:
      train: True in the train step, False in evaluation (full model, no checkpointing).
      remat: the step's activation checkpointing (``none``, ``full``, ``dots``).
      unroll: whether scans are unrolled (for FLOP counting).
    """

    def __init__(self, fn: Callable, train: bool, remat: str, unroll: bool):
        self._fn, self.train, self.remat, self.unroll = fn, train, remat, unroll

    def __call__(self, h):
        return self._fn(h)


def scan_runner(body: Callable, xs: Any, *, train: bool, remat: str, unroll: bool,
                fsdp: bool = False) -> Runner:
    """The block runner ``run(h) -> h``: ``jax.lax.scan`` of ``body(h, x) -> (h, None)`` over
    ``xs`` (one slice per block), each block under :func:`remat_block` in training; in
    evaluation (``train=False``) no checkpointing and no unrolling."""
    if train:
        body = remat_block(body, remat, fsdp)

    def run(h):
        h, _ = jax.lax.scan(body, h, xs, unroll=unroll if train else 1)
        return h
    return Runner(run, train, remat if train else "none", unroll)


class SDPStep:
    """The train step, evaluation and state layout of one SDP run.

    Args:
      spec: the spec (``W`` = the mesh's ``data`` size).
      loss_fn: ``(params, batch) -> loss`` or, with ``block_fn``, ``(params, batch, run) ->
        loss`` (float32 scalar; ``(loss, aux dict)`` with ``has_aux``); see the module
        docstring. ``batch`` is the worker's slice (leading axis ``b``) of the global batch.
      optimizer: an optax transformation, applied to the compact parameters under forward
        masking; under FSDP and backward masking to the shards of layout ``S`` (each device's
        ``1/W`` of a leaf, flattened into rows: ``[n]``, ``[L, r]`` or ``[L, Gc, r]``), so it
        must act elementwise (AdamW, SGD, Lion; not Adafactor, LAMB, Muon or a weight-decay
        mask that reads a leaf's shape). Backward masking keeps always-kept leaves outside the
        blocks whole.
      mesh: a mesh with an axis ``data`` of size ``W``; default: the first ``W`` devices.
      block_fn: ``(block_params, h) -> h`` for one block of the stacked block subtree.
      grad_clip: global-norm clipping threshold of the averaged gradient (0 = none).
      method: averaging of masked leaves, ``alltoall`` (holder-only bytes) or ``psum`` (the
        full-size reference); see :func:`sdp_jax.sync.average`.
      averaging: ``gradients`` (every step; C = 1 is DDP) or ``parameters`` (each worker steps
        on its own gradient; parameters averaged over holders every ``sync_every`` steps;
        forward variants without FSDP).
      sync_every: ``H`` of parameter averaging (a positive integer).
      fsdp: shard parameters, gradients and optimizer state over the workers (ZeRO-3, layout
        ``S``). With ``block_fn`` each block is gathered when it runs, only the held blocks /
        neurons / heads (all_to_all); without it the whole model is gathered at the start of
        the step (all_gather of full-size bytes; the gathered copy lives through the step)
        and the worker's subnetwork pruned from it locally. Model state is not sharded.
      remat: activation checkpointing of each block (Chen et al. 2016, "Training deep nets with
        sublinear memory cost"): ``none``, ``full`` (save only the block input) or ``dots``
        (also save matmul outputs against weights); needs ``block_fn``.
      dtype: compute dtype, ``float32`` or ``bfloat16``: floating parameters are cast to it
        before the loss (None, the default: as stored).
      schedule: optional optax schedule, reported as metric ``lr``.
      init_fn: optional ``seed -> full parameters`` for :meth:`init_state`.
      total_steps: the run's length, for :meth:`is_sync_step` (the last step averages).
      unroll: unroll the block scan (XLA counts a loop body's FLOPs once; same results).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; the aux values are averaged over workers
        and reported as metrics (an aux ``train_loss`` replaces the loss's value there, e.g.
        the next-token loss of a loss with auxiliary terms).
      state_spec: the spec of non-gradient model state (e.g. BatchNorm running statistics,
        masked like the layers they belong to; built with the same variant, W and masks as
        ``spec``). ``loss_fn(params, batch, state)`` then returns ``(loss, new_state)`` (with
        ``has_aux``: ``(loss, aux, new_state)``); after every step each component of the new
        state is averaged over its holders (under backward masking, over all workers). The
        train state gains ``stats``. Not with ``block_fn``.
      stacked_slots: list-form block slots reach ``loss_fn`` stacked as they are stored
        (``{path}/slots/...`` ``[k, ...]``) instead of as ``k`` blocks; the model then runs a
        worker's slots itself (e.g. :mod:`sdp_jax.models.vision`; the held block ids are
        ``spec.kinds[kind].held[sync.worker_index()]``). Model state is averaged every
        step, also between the averaging steps of ``averaging="parameters"``.
      param_metrics: ``params -> {name: float32 scalar}`` of the worker's updated parameters
        (stored form without the worker and stage axes), reported as metrics (mean over
        workers; with a pipeline each value must be the same on every stage), e.g. the
        boundary projectors' orthogonality error. Not with FSDP.

    Raises:
      ValueError: the mesh's ``data`` size differs from ``W`` or too few devices; a bad
        ``grad_clip``, ``method``, ``averaging``, ``sync_every``, ``remat`` or ``dtype``; a
        ``stage`` axis without ``block_fn``, or with model state or ``stacked_slots``;
        ``param_metrics`` with FSDP;
        parameter averaging with backward masking or FSDP; remat without ``block_fn``;
        ``block_fn`` without a stacked block subtree, or with a masked leaf outside it.
    """

    # Earlier checkpoint layouts of the same run: pairs (current abstract state -> that
    # layout's, restored state -> current) that sdp_jax.train.loop.restore_or_init tries in turn.
    legacy: tuple = ()

    def __init__(self, spec: spec_lib.SDPSpec, loss_fn: Callable, optimizer, mesh=None, *,
                 block_fn: Callable | None = None, grad_clip: float = 0.0,
                 method: str = "alltoall", averaging: str = "gradients", sync_every: int = 1,
                 fsdp: bool = False, remat: str = "none", dtype: str | None = None,
                 schedule: Callable | None = None, init_fn: Callable | None = None,
                 total_steps: int | None = None, unroll: bool = False, has_aux: bool = False,
                 state_spec: spec_lib.SDPSpec | None = None, stacked_slots: bool = False,
                 param_metrics: Callable | None = None):
        mesh = self._check(spec, mesh, block_fn, grad_clip, method, averaging, sync_every, fsdp,
                           remat, dtype)
        self.staged = STAGE in mesh.axis_names
        self.stages = int(mesh.shape[STAGE]) if self.staged else 1
        if self.staged and (state_spec is not None or stacked_slots):
            raise ValueError("a mesh axis 'stage' (pipeline) is built for a stacked block stack "
                             "run by the block runner; model state (state_spec) and "
                             "stacked_slots are not: drop the 'stage' axis or them.")
        if param_metrics is not None and fsdp:
            raise ValueError("param_metrics reads the worker's parameters, which FSDP stores as "
                             "shards; drop param_metrics or fsdp.")
        self.param_metrics = param_metrics
        if state_spec is not None:
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
        self.state_spec, self.stacked_slots = state_spec, bool(stacked_slots)
        self.spec, self.loss_fn, self.optimizer, self.mesh = spec, loss_fn, optimizer, mesh
        self.block_fn, self.grad_clip, self.method = block_fn, float(grad_clip), method
        self.averaging, self.sync_every, self.fsdp, self.remat = (averaging, sync_every, fsdp,
                                                                  remat)
        self.dtype = None if dtype is None else jnp.dtype(DTYPES[dtype])
        self.periodic = averaging == "parameters"
        self.schedule, self.init_fn, self.unroll, self.has_aux = (schedule, init_fn, unroll,
                                                                  has_aux)
        self.total_steps = total_steps
        # FLOP counting only (sdp_jax.bench): every block takes this branch of
        # held_weight_grads in the backward pass (wrong gradients; None: each its own)
        self.count_branch: bool | None = None
        self.layout = lay = layout_lib.of(spec)
        self.prefix = spec.block_path if block_fn is not None else None
        self.full_shapes = {p: ((self.stages * sh[0],) + tuple(sh[1:]) if self._staged(p)
                                else sh) for p, sh in spec.shapes.items()}
        # The optimizer works on shards (layout S) under FSDP and under backward masking, whose
        # every worker keeps the full model: ZeRO-2 (each device updates 1/W of every masked
        # leaf; an elementwise optimizer such as AdamW, as with FSDP). Backward masking keeps
        # always-kept leaves outside the blocks whole (R: updated alike on every worker, e.g.
        # the pipeline's projectors, which the Stiefel optimizer needs as matrices).
        self.sharded_update = bool(fsdp or spec.backward)
        self._rows = self._row_tables() if self.sharded_update else {}
        if self.sharded_update:   # 1 / holders of every entry (broadcastable), float32
            self._inv_holders = {
                p: np.float32(1.0 / spec.workers) if spec.leaf_mask(p) is None
                else (1.0 / np.maximum(spec.leaf_mask(p).sum(0), 1)).astype(np.float32)
                for p in spec.shapes}

        def code(sp, which):
            if fsdp:
                return "S"
            if spec.backward:   # full replicated copies; optimizer state and update on shards
                if which == "params" or not (self._in_block(sp) or spec.leaf_mask(sp) is not None):
                    return "R"
                return "S"
            if lay.stored_compact(sp):
                return "C"
            return "Rw" if self.periodic else "R"
        p_keys = spec.shapes if (spec.backward or fsdp) else lay.stored_shapes
        o_keys = spec.shapes if self.sharded_update else lay.stored_shapes
        self.param_layout = {p: code(p, "params") for p in p_keys}
        self.compact_layout = {p: code(p, "opt") for p in o_keys}
        self.param_specs, self.param_shapes = self._struct(self.param_layout)
        self.compact_specs, self.compact_shapes = self._struct(self.compact_layout)
        self.opt_specs = layout_lib.opt_state_specs(optimizer, self.compact_specs,
                                                    self.compact_shapes)
        self.state_specs = {"params": self.param_specs, "opt_state": self.opt_specs,
                            "step": P()}
        if state_spec is not None:
            self.stats_layout, self.stats_specs, self.stats_shapes = self._state_struct()
            self.state_specs["stats"] = self.stats_specs
        self._loop_tables = self._in_loop_tables()
        if spec.backward and not fsdp:   # checkpoints of the compact optimizer state
            self.legacy = self.legacy + ((self._compact_opt_abstract, self._opt_from_compact),)
        self._train_steps: dict[bool, Any] = {}
        self._eval_step = None
        self._alignment = None
        if block_fn is not None:
            self._eval_tables()

    @staticmethod
    def _check(spec, mesh, block_fn, grad_clip, method, averaging, sync_every, fsdp, remat,
               dtype):
        """Every refusal of the step's settings, before any tracing; returns the mesh."""
        W = spec.workers
        if mesh is None:
            if len(jax.devices()) < W:
                raise ValueError(f"the spec has W={W} workers but only {len(jax.devices())} "
                                 "devices are present; on a CPU set "
                                 f"jax.config.update('jax_num_cpu_devices', {W}) before using "
                                 "JAX.")
            mesh = jax.make_mesh((W,), (AXIS,), devices=jax.devices()[:W])
        if AXIS not in mesh.shape:
            raise ValueError(f"the mesh has axes {tuple(mesh.axis_names)}, none named "
                             f"'{AXIS}'; build it as jax.make_mesh(({W},), ('{AXIS}',)).")
        if mesh.shape[AXIS] != W:
            raise ValueError(f"mesh axis '{AXIS}' has {mesh.shape[AXIS]} devices but the "
                             f"spec has W={W} workers.")
        if isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float, np.floating)) \
                or not np.isfinite(grad_clip) or grad_clip < 0:
            raise ValueError(f"grad_clip={grad_clip!r} must be a finite number >= 0 "
                             "(0 = no clipping).")
        if method not in METHODS:
            raise ValueError(f"method={method!r}; use alltoall or psum.")
        if averaging not in AVERAGING:
            raise ValueError(f"averaging={averaging!r}; choose one of {AVERAGING}.")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r} must be a positive integer.")
        check_remat_dtype(remat, dtype)
        if not isinstance(fsdp, bool):
            raise ValueError(f"fsdp={fsdp!r} must be True or False.")
        if averaging == "parameters" and spec.backward:
            raise ValueError(f"periodic parameter averaging is not available for {spec.variant}: "
                             "backward masking keeps every worker's full parameters identical "
                             "after each step. Use a forward variant or averaging=gradients.")
        if averaging == "parameters" and fsdp:
            raise ValueError("periodic parameter averaging needs per-worker copies of the "
                             "parameters, but FSDP stores one sharded copy: use "
                             "averaging=gradients with fsdp, or fsdp=False.")
        if STAGE in mesh.axis_names and block_fn is None:
            raise ValueError("a mesh axis 'stage' (pipeline) runs the blocks stage by stage: pass "
                             "block_fn and a pipelined loss_fn(params, batch, run) (e.g. "
                             "sdp_jax.pipeline.Pipeline.loss), or drop the 'stage' axis.")
        if remat != "none" and block_fn is None:
            raise ValueError("remat works block by block inside the block runner: pass block_fn "
                             "(one block's apply) and a loss_fn(params, batch, run) that calls "
                             "run(h), or set remat off (or checkpoint inside your model).")
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
        return mesh

    def _in_loop_tables(self) -> dict:
        """The block leaves whose gradients are averaged inside the backward loop
        (:func:`sdp_jax.sync.mean_in_backward`: {local path: None for a plain mean, or the
        leaf's holder tables}); the others are averaged after the backward pass.

        In the loop: forward masking with the block runner, gradient averaging by ``alltoall``,
        no FSDP (its reduce-scatter is the transpose of its gathers), no pipeline (its schedule
        runs the blocks once per microbatch, which would repeat the collectives). Leaves stored
        per worker (layout ``C``) held by every worker (DDP's blocks) get a plain mean, N-SDP's
        neuron leaves (loop step i is layer i on every worker) the holder mean of layer i.
        B-SDP's blocks cannot be averaged there: loop step i runs a different block on each
        worker (its i-th held one); their gradients go to the owners inside the loop (the first
        all_to_all leg of :func:`sdp_jax.sync.holder_mean`) and come back averaged after it
        (:func:`sdp_jax.sync.sinks_to_mean`). Replicated leaves (layout ``R``: N-SDP's norms)
        are averaged after the loop, where their mean leaves the step invariant. Under backward
        masking (every block runs on every worker) the neuron leaves of ``nb-sdp`` go to their
        owners' shards inside the loop (the first all_to_all leg of layer i at loop step i),
        where the sharded update (ZeRO-2) reads them; ``bb-sdp``'s blocks stay after it (at
        loop step i only the holders of block i have its gradient).
        """
        lay = self.layout
        if (self.block_fn is None or self.fsdp or self.periodic or self.staged
                or self.method != "alltoall"):
            return {}
        if self.spec.backward:   # N-SDP's neuron leaves, left in the owners' shards (ZeRO-2)
            if spec_lib.BLOCK in self.spec.kinds:
                return {}
            return {p: lay.holder_tables(p) for p, lf in lay.leaves.items()
                    if self._in_block(p) and lf.form == layout_lib.NEURON
                    and not lay.holder_tables(p).full}
        out = {}
        for p, lf in lay.leaves.items():
            if not self._in_block(p) or self.param_layout.get(p) != "C" \
                    or lf.form == layout_lib.KEPT:
                continue
            if lay.holder_tables(p).full:
                out[p] = None
            elif lf.form == layout_lib.NEURON and spec_lib.BLOCK not in self.spec.kinds:
                out[p] = lay.holder_tables(p)   # grouped: layer i at loop step i
            elif lf.form == layout_lib.STACK:
                out[p] = lay.holder_tables(p)   # to the owners in the loop, back after it
        return out

    def _compact_opt_codes(self) -> dict:
        """Backward masking: the compact optimizer layout that checkpoints written before the
        sharded update (ZeRO-2) stored: each worker's held components ``C``, always-kept
        leaves ``R``."""
        lay = self.layout
        return {p: "C" if lay.stored_compact(p) else "R" for p in lay.stored_shapes}

    def _compact_opt_abstract(self, abstract: dict) -> dict:
        """An abstract train state -> the same with the compact optimizer state (``legacy``)."""
        specs, shapes = self._struct(self._compact_opt_codes())
        opt = jax.eval_shape(self.optimizer.init, shapes)
        sh = shardings(self.mesh, layout_lib.opt_state_specs(self.optimizer, specs, shapes))
        opt = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                           opt, sh)
        return {**abstract, "opt_state": opt}

    def _opt_from_compact(self, state: dict) -> dict:
        """A train state with the compact optimizer state -> layout ``S`` (``legacy``): every
        parameter-shaped entry (a moment) goes from its holders to the shards as a gradient
        does (:meth:`_mean_shards`; holders agree, so the mean is their value, to the last bit
        with two holders and to float32 rounding with more)."""
        codes = self._compact_opt_codes()
        specs, shapes = self._struct(codes)
        old_specs = layout_lib.opt_state_specs(self.optimizer, specs, shapes)
        struct = jax.tree.structure(shapes)
        lay = self.layout

        def moment(tree):   # this worker's compact leaves (stored form) -> its shards
            flat = {p: x[0] if codes[p] == "C" else sync.to_varying(x)
                    for p, x in _flatten(tree).items()}
            dts = {x.dtype for x in flat.values()}   # the moments' dtype (e.g. mu_dtype)
            flat = lay.to_local(flat)
            if self.block_fn is None:   # full-size leaves, zero where not held
                flat = self._zero_embedded(flat)
            return _unflatten({p: x.astype(next(iter(dts)) if len(dts) == 1 else lay.dtype(p))
                               for p, x in self._mean_shards(flat).items()})

        is_moment = lambda x: isinstance(x, dict) and jax.tree.structure(x) == struct  # noqa

        def convert(opt):
            opt = self._unstage(opt, old_specs)
            opt = jax.tree.map(lambda x: moment(x) if is_moment(x) else x, opt,
                               is_leaf=is_moment)
            return self._restage(opt, self.opt_specs)
        fn = jax.shard_map(convert, mesh=self.mesh, in_specs=(old_specs,),
                           out_specs=self.opt_specs)
        return {**state, "opt_state": jax.jit(fn)(state["opt_state"])}

    # ------------------------------------------------------------------ layout
    def _in_block(self, p) -> bool:
        return self.prefix is not None and p[:len(self.prefix)] == self.prefix

    def _staged(self, p) -> bool:
        """Whether leaf ``p`` is split over the pipeline axis (its stage's blocks only)."""
        return self.staged and self._in_block(p)

    # A leaf split over ``stage`` carries a stage axis at the position of STAGE in its
    # PartitionSpec; inside shard_map the step drops it (each device sees its stage's blocks,
    # the spec's L / P) and puts it back on the way out.
    def _unstage(self, tree, specs):
        return _stage_map(lambda i, x: jnp.squeeze(x, i), specs, tree) if self.staged else tree

    def _restage(self, tree, specs):
        return _stage_map(lambda i, x: jnp.expand_dims(x, i), specs, tree) if self.staged \
            else tree

    def _take(self, tree, stage: int, specs):
        """Stage ``stage`` of a stored tree (numpy or jax leaves); others unchanged."""
        return _stage_map(lambda i, x: x[(slice(None),) * i + (stage,)], specs, tree)

    def _per_stage(self, fn, tree, specs, out_specs):
        """``fn`` (on one stage's tree, as without a pipeline) applied per stage and the
        results stacked on the stage axes of ``out_specs``."""
        if not self.staged:
            return fn(tree)
        return self._stack([fn(self._take(tree, s, specs)) for s in range(self.stages)],
                           out_specs)

    @staticmethod
    def _stack(parts: list, specs):
        """Per-stage trees stacked on the stage axes of ``specs`` (other leaves: stage 0's)."""
        return _stage_map(lambda i, *xs: jnp.stack(xs, i), specs, *parts)

    def _row_tables(self) -> dict:
        """FSDP: the rows view of every leaf (:class:`sdp_jax.layout_lib.HolderTables`; None for a
        leaf outside the block subtree, stored flat)."""
        lay, spec = self.layout, self.spec
        if self.prefix is None:   # no block runner: every leaf stored flat
            return dict.fromkeys(spec.shapes)
        L, W = spec.n_blocks, spec.workers
        every = layout_lib.HolderTables(np.tile(np.arange(L), (W, 1, 1)), np.full((1, L), W), 0,
                                  False)
        out = {}
        for p in spec.shapes:
            if not self._in_block(p):
                out[p] = None
            elif lay.leaves[p].form == layout_lib.KEPT:
                out[p] = every    # held by all, but stacked per block (e.g. N-SDP norms)
            else:
                out[p] = lay.holder_tables(p)
        return out

    def _shard_shape(self, p) -> tuple:
        W, full_shape = self.spec.workers, self.spec.shapes[p]
        t = self._rows[p]
        if t is None:
            return (W * -(-int(np.prod(full_shape)) // W),)
        rows = (full_shape[0],) if not t.grouped else (full_shape[0], full_shape[t.axis])
        return rows + (W * t.shard_len(full_shape),)

    def _struct(self, codes: dict):
        W, lay = self.spec.workers, self.layout
        specs, shapes = {}, {}
        for p, c in codes.items():
            if c == "S":
                shape = self._shard_shape(p)
                axes = [None] * (len(shape) - 1) + [AXIS]
            else:
                base = lay.stored_shapes.get(p, self.spec.shapes.get(p))
                if c == "R" and p in self.spec.shapes:
                    base = self.spec.shapes[p]
                shape = ((W,) if c in ("C", "Rw") else ()) + tuple(base)
                axes = [] if c == "R" else [AXIS]
            if self._staged(p):   # [W, P, ...] for C / Rw, [P, ...] for R / S
                i = 1 if c in ("C", "Rw") else 0
                shape = shape[:i] + (self.stages,) + shape[i:]
                axes = axes[:i] + [STAGE] + axes[i:]
            specs[p] = P(*axes)
            shapes[p] = jax.ShapeDtypeStruct(shape, lay.dtype(p),
                                             sharding=NamedSharding(self.mesh, specs[p]))
        return _unflatten(specs), _unflatten(shapes)

    def _state_struct(self):
        """Layout codes, partition specs and shapes of the model state (``stats``): stored like
        forward-masked parameters (replicated full leaves under backward masking)."""
        sspec, W = self.state_spec, self.spec.workers
        lay = layout_lib.of(sspec)
        if self.spec.backward:
            codes = {p: "R" for p in sspec.shapes}
            base = dict(sspec.shapes)
        else:
            codes = {p: "C" if lay.stored_compact(p) else "R" for p in lay.stored_shapes}
            base = dict(lay.stored_shapes)
        specs = {p: P(AXIS) if c == "C" else P() for p, c in codes.items()}
        shapes = {p: jax.ShapeDtypeStruct(((W,) if c == "C" else ()) + tuple(base[p]),
                                          lay.dtype(p), sharding=NamedSharding(self.mesh, specs[p]))
                  for p, c in codes.items()}
        return codes, _unflatten(specs), _unflatten(shapes)

    def shardings(self, specs=None):
        """NamedShardings of ``specs`` (default: the state's)."""
        return shardings(self.mesh, self.state_specs if specs is None else specs)

    def abstract_state(self):
        """ShapeDtypeStruct tree (with shardings) of the train state, for compile and restore."""
        stored = {"params": self.param_shapes}
        if self.state_spec is not None:
            stored["stats"] = self.stats_shapes
        return abstract_state(self, stored)

    def batch_sharding(self):
        return batch_sharding(self.mesh)

    def per_device_param_count(self) -> int:
        """Parameter elements stored per device (compact where the layout is compact; a 1/W
        shard under FSDP, padding included; with a pipeline, the device's stage's blocks)."""
        total = 0
        for s in jax.tree.leaves(self.param_shapes):
            split = np.prod([self.mesh.shape[a] for a in s.sharding.spec if a is not None])
            total += int(np.prod(s.shape)) // int(split)
        return total

    # ------------------------------------------------------------------ FSDP rows
    def _rows_len(self, p) -> int:
        t, shape = self._rows[p], self.spec.shapes[p]
        return int(np.prod(shape)) if t is None else t.row_len(shape)

    def _to_shards(self, p, x):
        """Full leaf -> layout ``S`` (rows view, padded to a multiple of W)."""
        W, t = self.spec.workers, self._rows[p]
        rows = x.reshape(-1) if t is None else sync.to_rows(x, t)
        if t is not None and not t.grouped:
            rows = rows[0]
        return sync.pad_last(rows, W * -(-rows.shape[-1] // W))

    def _from_shards(self, p, x):
        """Inverse of :meth:`_to_shards` (the padding is dropped)."""
        shape, t = self.spec.shapes[p], self._rows[p]
        if t is None:
            return x[:int(np.prod(shape))].reshape(shape)
        return sync.from_rows(x, shape, t)

    def _my_shards(self, full: dict) -> dict:
        """Backward masking: full replicated leaves (flat) -> this device's piece of each in
        layout ``S`` (the parameters its optimizer updates)."""
        my = sync.worker_index(AXIS)
        out = {}
        for p, x in full.items():
            if self.compact_layout[p] == "R":   # updated whole on every worker
                out[p] = x
                continue
            rows = self._to_shards(p, x)
            rs = rows.shape[-1] // self.spec.workers
            out[p] = jax.lax.dynamic_slice_in_dim(rows, my * rs, rs, rows.ndim - 1)
        return out

    def _zero_embedded(self, local: dict) -> dict:
        """A worker's local leaves (flat, every leaf of the layout) -> full-size leaves, zero
        where the worker holds nothing."""
        zeros = {p: jnp.zeros(sh, local[p].dtype if p in local else jnp.float32)
                 for p, sh in self.spec.shapes.items()}
        return dict(self.layout.embed(_unflatten(zeros), local, sync.worker_index(AXIS)))

    def _mean_shards(self, g: dict, done: dict | None = None) -> dict:
        """Backward masking: a worker's gradient (flat; compact leaves of the block subtree,
        full-size leaves elsewhere, of which only the entries it holds count) -> the mean over
        each entry's holders (docs/design.md invariant 2) in layout ``S``, float32 (or wider).
        Compact leaves go to the owners of their pieces (the first all_to_all leg of
        :func:`sdp_jax.sync.holder_shards`: ``(W-1)/W`` of the compact bytes per device);
        full-size masked leaves (every leaf with ``method="psum"``, the reference) are masked,
        scaled by ``1 / holders`` and reduce-scattered (``(W-1)/W`` of their bytes);
        always-kept leaves outside the blocks (layout ``R`` in the optimizer) are all-reduced.
        ``done``: {path: the mean already in layout ``S``
        (sent to the owners inside the backward loop)}."""
        my = sync.worker_index(AXIS)
        out = dict(done or {})
        tabs = {p: t for p, t in self._rows.items() if t is not None and p not in out}
        if tabs and self.method == "psum":   # the reference: every leaf full-size
            g, tabs = self._zero_embedded(g), {}
        if tabs:
            for p, x in sync.holder_shards({p: g[p] for p in tabs}, tabs, AXIS).items():
                out[p] = x if tabs[p].grouped else x[0]
        for p, x in g.items():
            if p in tabs or p in out:
                continue
            x = x.astype(sync._sum_dtype([x]))
            if self.compact_layout[p] == "R":   # always-kept, updated whole: the plain mean
                out[p] = jax.lax.pmean(x, AXIS)
                continue
            mask, inv = self.spec.leaf_mask(p), jnp.asarray(self._inv_holders[p], x.dtype)
            x = x * (inv if mask is None else jnp.asarray(mask, x.dtype)[my] * inv)
            rows = self._to_shards(p, x)
            out[p] = jax.lax.psum_scatter(rows, AXIS, scatter_dimension=rows.ndim - 1,
                                          tiled=True)
        return out

    # ------------------------------------------------------------------ init
    def _store(self, full) -> dict:
        """Full parameters -> the stored parameter layout (nested dict)."""
        flat = _flatten(spec_lib.pure_tree(full))
        if not self.staged:
            return self._store_stage(flat)
        parts = []
        for s in range(self.stages):   # stage s: blocks [s * L / P, (s + 1) * L / P)
            part = {}
            for p, x in flat.items():
                n = self.spec.shapes[p][0] if self._staged(p) else None
                part[p] = x[s * n:(s + 1) * n] if n is not None else x
            parts.append(self._store_stage(part))
        return self._stack(parts, self.param_specs)

    def _store_stage(self, flat: dict) -> dict:
        """One stage's full parameters (flat; the whole model without a pipeline) -> stored."""
        if self.fsdp:
            return _unflatten({p: self._to_shards(p, x) for p, x in flat.items()})
        if self.spec.backward:
            return _unflatten(flat)
        W = self.spec.workers
        stored = _flatten(self.layout.stored(flat))
        return _unflatten({p: (jnp.broadcast_to(x, (W,) + x.shape)
                               if self.param_layout[p] == "Rw" else x)
                           for p, x in stored.items()})

    def init(self, full_params: Any) -> dict:
        """State ``{params, opt_state, step}`` (and ``stats`` with a ``state_spec``) on the mesh
        from the full model's parameters: an
        ``nnx.Module``, ``nnx.State`` or nested dict, or a function of no arguments that
        returns one (then called inside ``jit``, so no device holds the whole model); with a
        ``state_spec``, a pair ``(parameters, model state)`` or a function returning one.
        Every holder of a component starts from the same values.

        Raises:
          ValueError: the parameters (or the model state) differ in paths or shapes from the
            spec's (``state_spec``'s); a step with model state given no pair."""
        traced = callable(full_params) and not hasattr(full_params, "items") \
            and not _is_module(full_params) and not isinstance(full_params, tuple)
        make = full_params if traced else (lambda: full_params)
        full_state = None
        if self.state_spec is not None:   # (parameters, state)
            probe = jax.eval_shape(make)
            if not isinstance(probe, (tuple, list)) or len(probe) != 2:
                raise ValueError("a step with model state (state_spec) initializes from a pair "
                                 "(parameters, state), or a function returning one; got "
                                 f"{type(probe).__name__}.")
            got_s = spec_lib.flat_shapes(spec_lib.pure_tree(probe[1]))
            if got_s != self.state_spec.shapes:
                diff = sorted(set(got_s.items()) ^ set(self.state_spec.shapes.items()),
                              key=str)[:2]
                raise ValueError(f"the model state differs from the one state_spec was built "
                                 f"from ({diff}); build state_spec from this state.")
            make_both = make
            make = lambda: spec_lib.pure_tree(make_both()[0])  # noqa: E731
            full_state = lambda: spec_lib.pure_tree(make_both()[1])  # noqa: E731
        got = spec_lib.flat_shapes(jax.eval_shape(lambda: spec_lib.pure_tree(make())))
        if got != self.full_shapes:
            diff = sorted(set(got.items()) ^ set(self.full_shapes.items()), key=str)[:2]
            raise ValueError(f"the parameters differ from the ones the spec was built from "
                             f"({diff}); build the spec from this model, or init from the "
                             "model the spec describes"
                             + (f" (with a pipeline the spec describes one of the {self.stages}"
                                " stages: sdp_jax.models.llama.make_plan(..., pipe=pipe))."
                                if self.staged else "."))
        out = self.shardings(self.param_specs)
        if traced:
            params = jax.jit(lambda: self._store(make()), out_shardings=out)()
        else:   # a copy: the step donates the state, not the caller's model
            params = jax.jit(lambda t: jax.tree.map(jnp.copy, self._store(t)),
                             out_shardings=out)(spec_lib.pure_tree(make()))

        def opt_init(params):
            compact = params
            if self.spec.backward and not self.fsdp:   # full copies -> shards (layout S)
                compact = self._per_stage(
                    lambda t: _unflatten({p: self._to_shards(p, x)
                                          if self.compact_layout[p] == "S" else x
                                          for p, x in _flatten(t).items()}),
                    params, self.param_specs, self.compact_specs)
            return self.optimizer.init(compact)
        opt_state = jax.jit(opt_init, out_shardings=self.shardings(self.opt_specs))(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, P()))
        out = {"params": params, "opt_state": opt_state, "step": step}
        if self.state_spec is not None:
            def store_state():
                flat = _flatten(full_state())
                if self.spec.backward:
                    return _unflatten(flat)
                return layout_lib.of(self.state_spec).stored(flat)
            out["stats"] = jax.jit(lambda: jax.tree.map(jnp.copy, store_state()),
                                   out_shardings=self.shardings(self.stats_specs))()
        return out

    def init_state(self, seed: int) -> dict:
        """:meth:`init` from ``init_fn(seed)`` (the constructor's ``init_fn``)."""
        if self.init_fn is None:
            raise ValueError("init_state needs init_fn (seed -> full parameters); or call "
                             "init(full_params).")
        return self.init(lambda: self.init_fn(seed))

    def full_params(self, params, optimizer_layout: bool = False) -> dict:
        """The full model's parameters (host numpy, nested dict), each component from its
        first holder (always-kept per-worker copies: worker 0's). Accepts the state or its
        ``params``; gathers the whole model to this host (one process). With
        ``optimizer_layout``, a tree in the optimizer's layout instead (``compact_specs``:
        :meth:`grads_fn`'s gradient, a moment of the optimizer state)."""
        if isinstance(params, dict) and "opt_state" in params:
            params = params["params"]
        codes = self.compact_layout if optimizer_layout else self.param_layout
        specs = self.compact_specs if optimizer_layout else self.param_specs
        params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)
        if not self.staged:
            return self._full_stage(params, codes)
        parts = [_flatten(self._full_stage(self._take(params, s, specs), codes))
                 for s in range(self.stages)]
        return _unflatten({p: np.concatenate([q[p] for q in parts]) if self._staged(p)
                           else parts[0][p] for p in parts[0]})

    def _full_stage(self, params, codes: dict) -> dict:
        """:meth:`full_params` of one stage's stored tree in the layout ``codes`` (the whole
        model without a pipeline)."""
        flat = _flatten(params)
        if self.sharded_update:   # shards joined; replicated leaves as they are
            return _unflatten({p: np.asarray(self._from_shards(p, x)) if codes[p] == "S" else x
                               for p, x in flat.items()})
        flat = {p: x[0] if codes[p] == "Rw" else x for p, x in flat.items()}
        return self.layout.unprune(_unflatten(flat))

    # ------------------------------------------------------------------ the loss
    def _cast(self, x):
        return cast_floating(x, self.dtype)

    def _block(self, leaves: dict, h):
        """``block_fn`` on one block's leaves ``{full path: value}`` (flat)."""
        return self.block_fn(_unflatten({p[len(self.prefix):]: x for p, x in leaves.items()}), h)

    def _call(self, kept: dict, n: int, get, batch, train=True, xs=None, prepare=None,
              apply=None):
        """``loss_fn`` with the block runner: ``kept`` {path: leaf} outside the block subtree;
        ``n`` blocks whose leaf ``path`` of block ``i`` (traced) is ``get(path, i, x)`` in the
        compute dtype, ``x`` slice ``i`` of ``xs`` (stacked leaves scanned over: their gradients
        are then stacked, not accumulated in a carry), first passed through
        ``prepare(x, i, run)`` if given (inside the loop, and inside activation checkpointing;
        ``run(x)``: the block applied to the hidden state with the leaves ``x``). ``apply(i, x,
        h)``, if given, computes block ``i``'s output itself (instead of ``get`` and
        ``prepare``)."""
        paths = [p for p in self.spec.shapes if self._in_block(p)]

        def body(h, ix):
            i, x = ix
            if apply is not None:
                return apply(i, x, h), None

            def run(x):
                return self._block({p: get(p, i, x) for p in paths}, h)
            if prepare is not None:
                x = prepare(x, i, run)
            return run(x), None
        runner = scan_runner(body, (jnp.arange(n), xs), train=train, remat=self.remat,
                             unroll=self.unroll, fsdp=self.fsdp)
        return self.loss_fn(_unflatten({p: self._cast(x) for p, x in kept.items()}), batch,
                            runner)

    def _forward_loss(self, local: dict, batch, *stats, sinks=None, orders=None,
                      average=True):
        """Forward masking: the worker's compact subnetwork alone (flat local leaves); with the
        block runner, block gradients averaged inside the backward loop
        (:meth:`_in_loop_tables`; ``sinks``: :func:`sdp_jax.sync.owner_sinks` of B-SDP's
        blocks), in the orders of :func:`sdp_jax.sync.cotangent_orders`, which are recorded in
        the dict ``orders`` if given (for :func:`sdp_jax.sync.sinks_to_mean`). With
        ``average=False`` the gradients stay the worker's own, and ``local`` may be any stack
        of blocks, e.g. the full model's (:meth:`alignment_fn`).

        Raises:
          ValueError: a block traced twice with different gradient orders (its rows would
            reach the same sinks in two layouts)."""
        if self.block_fn is None:
            return self.loss_fn(_unflatten({p: self._cast(x) for p, x in local.items()}), batch,
                                *map(_unflatten, stats))
        blocks = {p: x for p, x in local.items() if self._in_block(p)}
        kept = {p: x for p, x in local.items() if not self._in_block(p)}
        n = next(iter(blocks.values())).shape[0]
        tables = self._loop_tables if average else {}
        found = {} if orders is None else orders

        def prepare(x, i, run):
            new = sync.cotangent_orders(run, x)
            if found and new != found:
                raise ValueError(f"the blocks were traced twice with different gradient "
                                 f"orders ({found} and {new}); run each block once per loss "
                                 f"or average after the loop (--config.sdp.method=reference)")
            found.update(new)
            return sync.mean_in_backward(x, tables, i, AXIS, sinks, orders=found)
        prepare = prepare if tables else None
        return self._call(kept, n, lambda p, i, x: self._cast(x[p]), batch, xs=blocks,
                          prepare=prepare)

    def _full_loss(self, full: dict, batch, *stats):
        """Backward masking without the block runner: the loss of the full model (flat)."""
        return self.loss_fn(_unflatten({p: self._cast(x) for p, x in full.items()}), batch,
                            *map(_unflatten, stats))

    def _backward_loss(self, mine: dict, full: dict, batch, sinks=None):
        """Backward masking with the block runner: the full forward pass; gradients flow only
        into ``mine`` (this worker's compact part of every masked leaf, and the always-kept
        leaves) and, for the leaves sent to their owners inside the loop
        (:meth:`_in_loop_tables`, not in ``mine``), into ``sinks``
        (:func:`sdp_jax.sync.owner_sinks`)."""
        lay, spec = self.layout, self.spec
        my = sync.worker_index(AXIS)
        frozen = jax.lax.stop_gradient(full)
        bt = spec.kinds.get(spec_lib.BLOCK)
        tables = self._loop_tables
        xs = prepare = None
        if tables:   # this worker's values of the in-loop leaves, scanned layer by layer
            pruned = lay.prune(frozen, my)
            xs = {"own": {p: pruned[p] for p in tables}, "sink": sinks}
            prepare = lambda x, i, run: {   # noqa: E731
                "own": sync.mean_in_backward(x["own"], tables, i, AXIS, x["sink"])}

        def get(p, g, x):
            lf = lay.leaves[p]
            if lf.form == layout_lib.KEPT:
                return self._cast(jax.lax.dynamic_index_in_dim(mine[p], g, 0, False))
            base = jax.lax.dynamic_index_in_dim(frozen[p], g, 0, False)
            if lf.form == layout_lib.STACK:   # held: the differentiable copy; else frozen
                s = jnp.asarray(bt.slot)[my, g]
                own = jax.lax.dynamic_index_in_dim(mine[p], jnp.maximum(s, 0), 0, False)
                return self._cast(jnp.where(s >= 0, own, base))
            a = lf.rule.axis
            idx = jnp.asarray(lay.indices(lf))[my, g]
            own = (x["own"][p] if p in tables
                   else jax.lax.dynamic_index_in_dim(mine[p], g, 0, False))
            own = jnp.moveaxis(own, a - 1, 0)
            base = jnp.moveaxis(base, a - 1, 0).at[idx].set(own)
            return self._cast(jnp.moveaxis(base, 0, a - 1))

        kept = {p: x for p, x in mine.items() if not self._in_block(p)}
        apply = None
        if self.skips_unheld():   # held blocks alone compute weight gradients

            def apply(g, _, h):
                s = jnp.asarray(bt.slot)[my, g]
                at = lambda x, j: jax.lax.dynamic_index_in_dim(x, j, 0, False)  # noqa: E731
                own, base, always = {}, {}, {}
                for p, lf in lay.leaves.items():
                    if not self._in_block(p):
                        continue
                    if lf.form == layout_lib.KEPT:
                        always[p] = at(mine[p], g)
                    else:
                        own[p], base[p] = at(mine[p], jnp.maximum(s, 0)), at(frozen[p], g)
                return held_weight_grads(
                    lambda leaves, h: self._block({p: self._cast(x) for p, x in leaves.items()},
                                                  h),
                    s >= 0, own, base, always, h, branch=self.count_branch)
        return self._call(kept, spec.n_blocks, get, batch, xs=xs, prepare=prepare, apply=apply)

    def skips_unheld(self) -> bool:
        """Whether a worker's unheld blocks skip their weight gradients
        (:func:`held_weight_grads`): backward masking of whole blocks (``bb-sdp``) with the
        block runner, full activation checkpointing (which recomputes each block in the
        backward pass anyway) and no FSDP (whose gathers mask the gradients of unheld blocks
        instead, :meth:`_fsdp_loss`)."""
        lay = self.layout
        return (self.spec.backward and self.block_fn is not None and self.remat == "full"
                and not self.fsdp and spec_lib.BLOCK in self.spec.kinds
                and all(lf.form in (layout_lib.KEPT, layout_lib.STACK)
                        for p, lf in lay.leaves.items() if self._in_block(p)))

    def _fsdp_loss(self, shards, batch, train=True):
        """Loss from FSDP shards (layout ``S``): each leaf is gathered, in the compute dtype,
        when it is used. Train: forward variants gather only the worker's held blocks /
        neurons / heads (all_to_all); backward variants gather whole blocks and keep the
        gradients of the held parts only. Eval: the full model."""
        flat = _flatten(shards)
        my = sync.worker_index(AXIS)
        pruned, masked_grads = train and not self.spec.backward, train and self.spec.backward
        dtype = self.dtype if self.dtype is not None else next(iter(flat.values())).dtype
        kept = {p: self._from_shards(p, sync.fsdp_gather(x[None], self._rows_len(p),
                                                         dtype)[0])
                for p, x in flat.items() if not self._in_block(p)}
        bt = self.spec.kinds.get(spec_lib.BLOCK)
        n = bt.k if pruned and bt is not None else self.spec.n_blocks

        def get(p, i, _):
            x, t = flat[p], self._rows[p]
            shape, rlen = self.spec.shapes[p], self._rows_len(p)
            if t.grouped:  # neuron leaf: layer i, [Gc, rs]
                sh = jax.lax.dynamic_index_in_dim(x, i, 0, False)
                if pruned and not t.full:
                    rows = sync.fsdp_gather(sh, rlen, dtype,
                                            idx=sync.slot_indices(t, i, 0, t.kc))
                else:
                    keep = (jnp.asarray(t.held)[my, i] if masked_grads and not t.full
                            else None)
                    rows = sync.fsdp_gather(sh, rlen, dtype, keep=keep)
                leaf = list((1,) + shape[1:])
                leaf[t.axis] = rows.shape[0]
                val = sync.from_rows(rows[None], leaf, t)[0]
            else:  # block leaf: block (or slot) i, [L, rs]
                if pruned and not t.full:
                    rows = sync.fsdp_gather(x, rlen, dtype,
                                            idx=sync.slot_indices(t, 0, i, 1))
                else:
                    keep = (jnp.asarray(t.held)[my, 0, i][None] if masked_grads and not t.full
                            else None)
                    rows = sync.fsdp_gather(jax.lax.dynamic_slice_in_dim(x, i, 1, 0), rlen,
                                            dtype, keep=keep)
                val = rows.reshape(shape[1:])
            return checkpoint_name(val, _GATHERED)

        return self._call(kept, n, get, batch, train=train)

    def _gathered(self, shards, dtype=None, scale=False) -> dict:
        """FSDP without the block runner: every leaf gathered whole (flat ``{path: leaf}``; an
        all_gather in ``dtype``, default the stored one). ``scale``: each entry's gradient,
        in float32, scaled by ``1 / holders``, so that the reduce-scatter of the transpose,
        the sum over workers, is the masked mean."""
        out = {}
        for p, x in _flatten(shards).items():
            inv = jnp.asarray(self._inv_holders[p]) if scale else None
            out[p] = self._from_shards(p, sync.fsdp_gather(
                x[None], self._rows_len(p), dtype or x.dtype, scale=inv,
                leaf=self.spec.shapes[p])[0])
        return out

    def _gathered_loss(self, shards, batch, *stats):
        """FSDP without the block runner (e.g. list-form blocks, model state): the whole model
        gathered at the start of the step in the compute dtype; forward variants prune the
        worker's subnetwork from it locally, backward variants run it whole with gradients
        only into the held parts. The gradient is the masked mean in layout ``S``."""
        lay, my = self.layout, sync.worker_index(AXIS)
        full = self._gathered(shards, self.dtype, scale=True)
        if self.spec.backward:
            local = lay.embed(jax.lax.stop_gradient(full), lay.prune(full, my), my)
        else:
            local = lay.prune(full, my)
            if self.stacked_slots:
                local = lay.to_stored(local)
        return self.loss_fn(_unflatten(local), batch, *map(_unflatten, stats))

    def _divide_counts(self, grads: dict) -> dict:
        """FSDP: masked sums in layout ``S`` -> masked means (multiplicity of every row)."""
        W, out = self.spec.workers, {}
        for p, g in grads.items():
            t = self._rows[p]
            if t is None:
                out[p] = g / W
            else:
                c = t.counts[0][:, None] if not t.grouped else t.counts[..., None]
                out[p] = g / jnp.asarray(c, g.dtype)
        return out

    # ------------------------------------------------------------------ the step
    def _strip(self, params: dict) -> dict:
        """Flat stored leaves -> this worker's view (the leading per-worker axis of C / Rw
        leaves dropped)."""
        return {p: x[0] if self.param_layout[p] in ("C", "Rw") else x
                for p, x in _flatten(params).items()}

    def _value_and_grad(self, fn, *args):
        """(loss, aux, gradient, new model state or None) of ``fn`` (a loss of the step)."""
        def split(*a):
            out = fn(*a)
            if self.state_spec is None:
                return out if self.has_aux else (out, {})
            if self.has_aux:
                loss, aux, new = out
            else:
                (loss, new), aux = out, {}
            return loss, (aux, new)
        (loss, aux), grads = jax.value_and_grad(split, has_aux=True)(*args)
        aux, new = aux if self.state_spec is not None else (aux, None)
        return loss, aux, grads, new

    def _to_local(self, stored: dict, lay=None) -> dict:
        """A worker's stored leaves (flat, no worker axis) -> the form ``loss_fn`` sees."""
        lay = lay or self.layout
        return stored if self.stacked_slots else lay.to_local(stored)

    def _state_local(self, stats):
        """The model state as ``loss_fn`` sees it (flat; None without a state)."""
        if self.state_spec is None:
            return None
        flat = _flatten(stats)
        if self.spec.backward:
            return flat
        flat = {p: x[0] if self.stats_layout[p] == "C" else x for p, x in flat.items()}
        return self._to_local(flat, layout_lib.of(self.state_spec))

    def _local_grads(self, params, batch, stats=None):
        """(loss, aux, the worker's local gradient and local parameters, flat, in the compact
        layout without the worker axis, the new model state). Under FSDP and backward masking:
        the masked-mean gradient and the parameters in the optimizer's layout (``S``, and
        ``R`` for backward masking's always-kept leaves outside the blocks)."""
        lay = self.layout
        st = self._state_local(stats)
        extra = () if st is None else (st,)
        if self.fsdp and self.block_fn is None:
            loss, aux, g, new = self._value_and_grad(self._gathered_loss, params, batch, *extra)
            return loss, aux, _flatten(g), _flatten(params), new
        if self.fsdp:
            loss, aux, g, _ = self._value_and_grad(self._fsdp_loss, params, batch)
            return loss, aux, self._divide_counts(_flatten(g)), _flatten(params), None
        if self.spec.backward:   # the masked-mean gradient and the parameters, in layout S
            full = _flatten(params)
            my = sync.worker_index(AXIS)
            if self.block_fn is None:   # the full gradient, masked to this worker's part
                loss, aux, g, new = self._value_and_grad(self._full_loss, sync.to_varying(full),
                                                         batch, *extra)
                return loss, aux, self._mean_shards(g), self._my_shards(full), new
            local, tables = lay.prune(full, my), self._loop_tables
            diff = {p: sync.to_varying(x) if lay.leaves[p].form == layout_lib.KEPT else x
                    for p, x in local.items() if p not in tables}   # (kept: local gradients)
            sinks = sync.owner_sinks({p: local[p] for p in tables}, tables, AXIS)
            loss, aux, (g, sums), new = self._value_and_grad(
                lambda both, *a: self._backward_loss(both[0], *a, sinks=both[1]),
                (diff, sinks), full, batch, *extra)
            done = sync.sinks_to_shards(sums, {p: local[p] for p in tables}, tables)
            return loss, aux, self._mean_shards(g, done), self._my_shards(full), new
        local = self._to_local(self._strip(params))
        diff = {lp: sync.to_varying(x) if self.param_layout.get(lp) == "R" else x
                for lp, x in local.items()}
        owners = {p: t for p, t in self._loop_tables.items() if t is not None and not t.grouped}
        if not owners:
            loss, aux, g, new = self._value_and_grad(self._forward_loss, diff, batch, *extra)
            return loss, aux, g, local, new
        # B-SDP: block gradients reach their owners inside the backward loop, as gradients of
        # zero accumulators (sinks), and come back averaged after it.
        sinks, orders = sync.owner_sinks({p: local[p] for p in owners}, owners, AXIS), {}
        loss, aux, (g, sums), new = self._value_and_grad(
            lambda both, *a: self._forward_loss(both[0], *a, sinks=both[1], orders=orders),
            (diff, sinks), batch, *extra)
        g.update(sync.sinks_to_mean(sums, {p: g[p] for p in owners}, owners, AXIS, orders))
        return loss, aux, g, local, new

    def _new_state(self, new: dict):
        """The loss's new model state (nested) -> the stored ``stats``: each component the mean
        over its holders (every worker under backward masking)."""
        new = _flatten(new)
        if self.spec.backward:
            return _unflatten({p: jax.lax.pmean(x, AXIS) for p, x in new.items()})
        sspec = self.state_spec
        avg = _flatten(sync.average(_unflatten(new), sspec, method=self.method))
        if not self.stacked_slots:
            avg = layout_lib.of(sspec).to_stored(avg)
        return _unflatten({p: x[None] if self.stats_layout[p] == "C" else x
                           for p, x in avg.items()})

    def _average(self, local: dict, gradient: bool) -> dict:
        """Mean over holders of a worker's local values (flat); of a ``gradient``, except the
        leaves already averaged inside the backward loop (:meth:`_in_loop_tables`)."""
        done = frozenset(self._loop_tables) if gradient else frozenset()
        return _flatten(sync.average(_unflatten(local), self.spec, method=self.method,
                                     done=done))

    def _lead(self, local: dict, codes: dict) -> dict:
        """Local leaves (flat) -> the stored tree (list-form slots stacked, a leading worker
        axis of size 1 on C / Rw leaves)."""
        if not self.sharded_update and not self.stacked_slots:
            local = self.layout.to_stored(local)
        return _unflatten({p: x[None] if codes[p] in ("C", "Rw") else x
                           for p, x in local.items()})

    def _local_step(self, state, batch, sync_now: bool):
        spec = self.spec
        state = self._unstage(state, self.state_specs)
        loss, aux, grads, local, new_stats = self._local_grads(state["params"], batch,
                                                               state.get("stats"))
        if self.sharded_update:   # every element of the averaged gradient lives on one device
            whole = [jnp.sum(jnp.square(g.astype(jnp.float32))) for p, g in grads.items()
                     if self.compact_layout[p] == "R"]   # the same on every worker: once
            gnorm = jnp.sqrt(sync.shards_sq_norm({p: g for p, g in grads.items()
                                                  if self.compact_layout[p] == "S"}, AXIS)
                             + sync.sum_parts(whole, AXIS, False))
        elif self.periodic:   # each worker on its own gradient: the norm of its subnetwork
            gnorm = jnp.sqrt(sync.sum_parts([jnp.sum(jnp.square(g.astype(jnp.float32)))
                                             for g in grads.values()], AXIS, False))
        else:
            grads = self._average(grads, gradient=True)
            gnorm = sync.global_norm(_unflatten(grads), spec)
        codes = self.compact_layout
        new, opt_state = clipped_update(self.optimizer, self._lead(grads, codes), gnorm,
                                        self.grad_clip, state["opt_state"],
                                        self._lead(local, codes))
        new = _flatten(new)
        if spec.backward and not self.fsdp:   # every worker's full copy: one all-gather
            params = _unflatten({p: self._from_shards(p, sync.all_gather_invariant(x, AXIS))
                                 if codes[p] == "S" else x for p, x in new.items()})
        elif self.periodic and sync_now:
            mine = self._to_local({p: x[0] for p, x in new.items()})
            params = self._lead(self._average(mine, gradient=False), codes)
        else:
            params = _unflatten(new)
        if self.periodic:
            gnorm = jax.lax.pmean(gnorm, AXIS)
        if self.staged and STAGE in (sync.varying_axes(loss) or ()):
            raise ValueError("with a mesh axis 'stage' the loss must be the same on every stage "
                             "(e.g. psum the last stage's loss over 'stage', as "
                             "sdp_jax.pipeline.Pipeline.loss does).")
        metrics = {"train_loss": jax.lax.pmean(loss, AXIS), "grad_norm": gnorm,
                   **{k: jax.lax.pmean(v, AXIS) for k, v in aux.items()}}
        if self.schedule is not None:
            metrics["lr"] = self.schedule(state["step"])
        if self.param_metrics is not None:
            mine = _unflatten(self._strip(params))
            metrics.update({k: jax.lax.pmean(v, AXIS)
                            for k, v in self.param_metrics(mine).items()})
        out = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        if self.state_spec is not None:
            out["stats"] = self._new_state(new_stats)
        return self._restage(out, self.state_specs), metrics

    def train_step_fn(self, sync_now: bool = True):
        """Jitted ``(state, batch) -> (state, metrics)``; ``batch`` is a pytree of arrays whose
        leading axis is the global batch ``W * b`` (sharded ``P('data')``); ``state`` is
        donated. metrics: ``train_loss`` (mean over workers), ``grad_norm`` (of the averaged
        gradient, before clipping; with parameter averaging the mean over workers of each
        worker's own gradient norm), ``lr`` (with a schedule), the loss's aux values. With
        parameter averaging, ``sync_now=False`` gives the step without the averaging."""
        sync_now = bool(sync_now) or not self.periodic
        if sync_now not in self._train_steps:
            fn = jax.shard_map(lambda s, b: self._local_step(s, b, sync_now), mesh=self.mesh,
                               in_specs=(self.state_specs, P(AXIS)),
                               out_specs=(self.state_specs, P()))
            self._train_steps[sync_now] = jax.jit(fn, donate_argnums=0)
        return self._train_steps[sync_now]

    @property
    def train_step(self):
        """``(state, batch) -> (state, metrics)``: :meth:`train_step_fn`; with periodic
        parameter averaging every ``H > 1`` steps, a function that runs the step with or
        without the averaging as :meth:`is_sync_step` says for the state's next step (it reads
        the step counter from the device, waiting for the previous step)."""
        if not self.periodic or self.sync_every == 1:
            return self.train_step_fn()

        def step(state, batch):
            n = int(jax.device_get(state["step"])) + 1
            return self.train_step_fn(self.is_sync_step(n))(state, batch)
        return step

    def is_sync_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) ends with parameter averaging."""
        return (not self.periodic or step % self.sync_every == 0
                or (self.total_steps is not None and step == self.total_steps))

    def _averaged_grads(self, params, batch):
        params = self._unstage(params, self.param_specs)
        loss, _, g, _, _ = self._local_grads(params, batch)
        if not self.sharded_update:   # (layout S: already the mean)
            g = self._average(g, gradient=True)
        return (jax.lax.pmean(loss, AXIS),
                self._restage(self._lead(g, self.compact_layout), self.compact_specs))

    def grads_fn(self):
        """Jitted ``(params, batch) -> (loss, averaged gradient)``, the gradient in the
        optimizer's layout (``compact_specs``: compact, or layout ``S`` under FSDP and backward
        masking; :meth:`full_params` with ``optimizer_layout=True`` gives the full shapes).
        For inspection and tests.

        Raises:
          ValueError: a step with model state (``state_spec``)."""
        if self.state_spec is not None:
            raise ValueError("grads_fn is not built for a step with model state (state_spec).")
        fn = jax.shard_map(self._averaged_grads, mesh=self.mesh,
                           in_specs=(self.param_specs, P(AXIS)),
                           out_specs=(P(), self.compact_specs))
        return jax.jit(fn)

    def _local_alignment(self, params, batch, stats=None):
        """Inside ``shard_map``: the two cosines of :meth:`alignment_fn` (replicated)."""
        lay, my = self.layout, sync.worker_index(AXIS)
        full, full_stats = self.gather(params, stats)
        full = _flatten(full)
        extra = () if full_stats is None else (_flatten(full_stats),)
        # the full model's gradient on this worker's slice (its own: varying, not summed)
        _, _, g_full, _ = self._value_and_grad(
            lambda f, *a: self._forward_loss(f, *a, average=False),
            sync.to_varying(full), batch, *extra)
        g_held = lay.prune(g_full, my)   # restricted to the components this worker holds
        if self.spec.backward:   # the full forward pass: its held gradient is g_held itself
            g_sub = g_held
        else:                    # the worker's compact subnetwork alone
            local = self._to_local(self._strip(params))
            st = self._state_local(stats)
            diff = {lp: sync.to_varying(x) if self.param_layout.get(lp) == "R" else x
                    for lp, x in local.items()}
            _, _, g_sub, _ = self._value_and_grad(
                lambda f, *a: self._forward_loss(f, *a, average=False), diff, batch,
                *(() if st is None else (st,)))

        def cosine(a: dict, b: dict):
            dot = sum(jnp.vdot(a[p].astype(jnp.float32), b[p].astype(jnp.float32))
                      for p in a)
            na = sum(jnp.sum(jnp.square(a[p].astype(jnp.float32))) for p in a)
            nb = sum(jnp.sum(jnp.square(b[p].astype(jnp.float32))) for p in b)
            return dot / jnp.maximum(jnp.sqrt(na) * jnp.sqrt(nb),
                                     jnp.finfo(jnp.float32).tiny)
        held = jax.lax.pmean(cosine(g_sub, g_held), AXIS)
        # the averaged update (each component's mean over its holders) against DDP's mean
        sdp = _flatten(sync.gather_full(_unflatten(g_sub), self.spec))
        ddp = {p: jax.lax.pmean(x, AXIS) for p, x in g_full.items()}
        return {"grad_alignment": held, "update_alignment": cosine(sdp, ddp)}

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
          ValueError: FSDP, parameter averaging (``averaging="parameters"``: the workers'
            copies differ), a pipeline (``stage`` axis), or ``stacked_slots`` (a model that
            runs its own slots, e.g. the vision models, has no full-model loss here)."""
        if self.fsdp or self.periodic or self.staged or self.stacked_slots:
            raise ValueError("the gradient alignment needs the full model on every device, "
                             "one model per component and the model's own loss: not built for "
                             "FSDP, parameter averaging, pipelines or stacked_slots models (the "
                             "vision models); measure it on an unpipelined run without "
                             "--config.fsdp, averaging gradients.")
        if self._alignment is None:
            if self.state_spec is None:
                fn = jax.shard_map(lambda p, b: self._local_alignment(p, b), mesh=self.mesh,
                                   in_specs=(self.param_specs, P(AXIS)), out_specs=P())
                self._alignment = jax.jit(lambda s, b: fn(s["params"], b))
            else:
                fn = jax.shard_map(lambda p, st, b: self._local_alignment(p, b, st),
                                   mesh=self.mesh, in_specs=(self.param_specs,
                                                             self.state_specs["stats"], P(AXIS)),
                                   out_specs=P())
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
        return jax.tree.map(lambda x: jax.device_put(x, self.batch_sharding()), batch)

    def compiled_train_step(self, batch: Any):
        """The train step lowered and compiled for abstract inputs (no data, no state in device
        memory): ``batch`` a pytree of ``jax.ShapeDtypeStruct`` of the global batch. Read its
        per-device memory with ``memory_analysis()``
        (:func:`sdp_jax.costs.memory_stats`)."""
        batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                            sharding=self.batch_sharding()),
                             batch)
        return self.train_step_fn().lower(self.abstract_state(), batch).compile()

    # ------------------------------------------------------------------ evaluation
    def _eval_tables(self):
        """Static tables of the streamed full-model evaluation (block runner)."""
        lay, spec = self.layout, self.spec
        bt = spec.kinds.get(spec_lib.BLOCK)
        self._blocks = sync.CompactTables(bt.masks[0]) if bt is not None else None
        self._layers = {}
        for p, lf in lay.leaves.items():
            if lf.form == layout_lib.NEURON and self._in_block(p):
                t = spec.kinds[lf.rule.kind]
                self._layers[p] = sync.LayerTables(lay.indices(lf),
                                                   np.repeat(t.counts, lf.rule.expand, axis=1),
                                                   lf.rule.axis)

    def gather(self, params, stats=None) -> tuple[dict, dict | None]:
        """Inside ``jax.shard_map`` over ``data`` (params in :attr:`param_specs`, stats in
        :attr:`stats_specs`): the full model, the same on every worker, as nested dicts
        ``(parameters, model state or None)``, each component the mean over its holders
        (:func:`sdp_jax.sync.gather_full`; FSDP: every leaf all-gathered), in the stored
        dtypes.

        Raises:
          ValueError: with the block runner under FSDP, or with a pipeline (use
            :meth:`eval_step_fn`, which streams the blocks)."""
        if (self.fsdp and self.block_fn is not None) or self.staged:
            raise ValueError("gather() would hold the whole model on every device; with the "
                             "block runner under FSDP or with a pipeline use eval_step_fn, "
                             "which streams the blocks.")
        if self.fsdp:
            full = _unflatten(self._gathered(params))
        elif self.spec.backward:
            full = _unflatten(_flatten(params))
        else:
            full = sync.gather_full(_unflatten(self._to_local(self._strip(params))), self.spec)
        if stats is None or self.spec.backward:
            return full, (None if stats is None else _unflatten(_flatten(stats)))
        flat = {p: x[0] if self.stats_layout[p] == "C" else x
                for p, x in _flatten(stats).items()}
        return full, sync.gather_full(_unflatten(flat), self.state_spec)

    def _local_eval(self, params, batch):
        params = self._unstage(params, self.param_specs)
        if self.fsdp and self.block_fn is not None:
            out = self._fsdp_loss(params, batch, train=False)
        elif self.block_fn is None:
            full = _flatten(self.gather(params)[0])
            out = self.loss_fn(_unflatten({p: self._cast(x) for p, x in full.items()}), batch)
        else:
            out = self._streamed_eval(params, batch)
        loss = out[0] if self.has_aux else out
        return jax.lax.pmean(loss, AXIS)

    def _streamed_eval(self, params, batch):
        """The full model with the block runner: each block's parameters fetched from their
        holders when it is reached, so no device stores the full model."""
        flat, lay = _flatten(params), self.layout
        kept = {p: x[0] if self.param_layout[p] == "Rw" else x
                for p, x in flat.items() if not self._in_block(p)}
        if self.periodic:   # evaluate the holders' average
            kept = {p: jax.lax.pmean(x, AXIS) if self.param_layout[p] == "Rw" else x
                    for p, x in kept.items()}

        def get(p, g, _):
            code, lf = self.param_layout[p], lay.leaves[p]
            if code == "R":
                v = jax.lax.dynamic_index_in_dim(flat[p], g, 0, False)
            elif lf.form == layout_lib.KEPT:   # Rw
                v = jax.lax.pmean(jax.lax.dynamic_index_in_dim(flat[p][0], g, 0, False), AXIS)
            elif lf.form == layout_lib.STACK:
                if self._blocks.full and not self.periodic:
                    v = jax.lax.dynamic_index_in_dim(flat[p][0], g, 0, False)
                else:
                    v = sync.component_mean({p: flat[p]}, g, self._blocks, AXIS)[p]
            else:
                v = jnp.moveaxis(sync.layer_value({p: flat[p]}, {p: self._layers[p]}, g,
                                                  AXIS)[p], 0, lf.rule.axis - 1)
            return self._cast(v)

        return self._call(kept, self.spec.n_blocks, get, batch, train=False)

    def eval_step_fn(self):
        """Jitted full-model loss ``(params, batch) -> float32`` (mean over workers of each
        worker's slice): every block with all its neurons and heads, each component the mean
        over its holders (FSDP: gathered from its owners)."""
        if self.state_spec is not None or self.stacked_slots:
            raise ValueError("a step with model state or stacked_slots evaluates through "
                             "gather() (its loss updates the state or runs slots); see "
                             "sdp_jax.train.families.VisionEval.")
        if self._eval_step is None:
            fn = jax.shard_map(self._local_eval, mesh=self.mesh,
                               in_specs=(self.param_specs, P(AXIS)), out_specs=P())
            self._eval_step = jax.jit(fn)
        return self._eval_step


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _stage_map(fn, specs, *trees):
    """``fn(i, *leaves)`` for the leaves whose PartitionSpec names ``stage`` at position ``i``;
    any other leaf: the first tree's."""
    def one(s, *xs):
        s = tuple(s)
        return fn(s.index(STAGE), *xs) if STAGE in s else xs[0]
    return jax.tree.map(one, specs, *trees, is_leaf=_is_spec)


def _is_module(x) -> bool:
    from flax import nnx  # pylint: disable=g-import-not-at-top
    return isinstance(x, (nnx.Module, nnx.State))
