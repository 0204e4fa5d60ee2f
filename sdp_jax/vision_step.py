"""The jitted ``train_step`` and accuracy evaluation of the vision models, for every variant.

Which blocks / channels / neurons / heads each worker holds is the model's
:class:`sdp_jax.spec.SDPSpec` (:func:`sdp_jax.tasks.vision_spec`; its BatchNorm statistics have
their own spec with the same masks, :func:`sdp_jax.tasks.vision_stats_spec`); the compact
layout is :class:`sdp_jax.layout.Layout`'s, and averaging, clipping and rebuilding the full
model are :func:`sdp_jax.sync.average`, :func:`sdp_jax.sync.global_norm` and
:func:`sdp_jax.sync.gather_full`.

Layouts (mesh axis ``data``, W workers): always-kept leaves replicated ``P()``; a masked leaf of a
forward variant is stored compact, a global ``[W, ...]`` array sharded ``P('data')``: for blocks,
the stage's ``k_s`` held blocks stacked as *slots* ``{stage}/slots/...`` ``[W, k_s, ...]`` in depth
order (block 0 of a downsampling ResNet stage is zero-padded to the other blocks' shape: its first
conv has half the input channels); for neurons, narrower matrices. Backward variants store the full
parameters replicated and the optimizer state compact.

BatchNorm under SDP (our choice, documented in the README): each worker normalizes by its own
batch's statistics; after every step the running mean and variance of a layer are averaged over
the workers that hold it, like its parameters: block holders for the BatchNorms inside a block
(B-SDP), channel holders for ``bn1`` (N-SDP), all workers for the stem, the projection shortcuts
and ``bn2`` under N-SDP, and all workers under backward masking (every worker runs the full
model forward).

Averaging moves only held bytes (:func:`sdp_jax.sync.holder_mean`); clipping uses the global
norm of the averaged gradient with every component counted once (invariant 6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax import layout as layout_lib
from sdp_jax import spec as spec_lib
from sdp_jax import step as step_lib
from sdp_jax import sync
from sdp_jax import tasks
from sdp_jax import train_step as ts
from sdp_jax.models import vision as vm

AXIS = sync.AXIS
_flatten, _unflatten = spec_lib.flatten, spec_lib.unflatten


def _decay(params):
    """Weight decay on conv / linear weights only (not norms, biases, relative position bias)."""
    def decayed(path, _):
        key = str(getattr(path[-1], "key", path[-1]))
        return key == "kernel" or key.endswith("_w")
    return jax.tree_util.tree_map_with_path(decayed, params)


class _Part:
    """One state tree of the run (parameters or BatchNorm statistics) in its spec's layout:
    ``layout`` {stored path: "C" (compact ``[W, ...]``) | "R" (replicated)}."""

    def __init__(self, spec, full: dict, mesh, backward: bool, opt: bool = False):
        self.spec, self.full = spec, full
        self.lay = layout_lib.of(spec) if spec is not None else None
        W = spec.workers if spec is not None else 1
        if self.lay is None:
            stored = {p: tuple(s.shape) for p, s in full.items()}
        else:
            stored = self.lay.stored_shapes
        self.full_form = backward and not opt
        if self.full_form:
            self.layout = {p: "R" for p in full}
            shapes = {p: (tuple(s.shape), s.dtype) for p, s in full.items()}
        else:
            self.layout = {p: ("C" if self.lay is not None and self.lay.stored_compact(p)
                               else "R") for p in stored}
            shapes = {p: (((W,) if self.layout[p] == "C" else ()) + tuple(stored[p]),
                          self._dtype(p)) for p in stored}
        self.specs = _unflatten({p: P(AXIS) if c == "C" else P() for p, c in self.layout.items()})
        self.shapes = _unflatten({p: jax.ShapeDtypeStruct(
            shp, dt, sharding=NamedSharding(mesh, P(AXIS) if self.layout[p] == "C" else P()))
            for p, (shp, dt) in shapes.items()})

    def _dtype(self, p):
        if p in self.full:
            return self.full[p].dtype
        lf = next(f for f in self.lay.leaves.values() if f.form == layout_lib.SLOT
                  and self.lay.slots_path(f) == p)
        return self.full[lf.full].dtype

    def stored(self, full: dict) -> dict:
        """Full leaves (flat) -> this part's stored tree (nested)."""
        if self.full_form or self.lay is None:
            return _unflatten(full)
        return self.lay.stored(full)

    def local(self, tree) -> dict:
        """Stored tree -> this worker's leaves (flat; the stored form without the worker axis:
        list-form block slots stacked under ``{stage}/slots``, as the model runs them)."""
        return {p: (x[0] if self.layout[p] == "C" else x) for p, x in _flatten(tree).items()}

    def prune(self, full: dict, w) -> dict:
        """Worker ``w``'s leaves (as :meth:`local` gives them) from full ones."""
        return full if self.lay is None else self.lay.to_stored(self.lay.prune(full, w))

    def lead(self, local: dict) -> dict:
        """This worker's leaves (flat) -> its stored tree (leading axis 1 on C)."""
        return _unflatten({p: x[None] if self.layout[p] == "C" else x
                           for p, x in local.items()})

    def average(self, local: dict) -> dict:
        """Mean over holders of this worker's leaves (flat)."""
        if self.lay is None:
            return {p: jax.lax.pmean(x, AXIS) for p, x in local.items()}
        return _flatten(sync.average(_unflatten(local), self.spec))

    def gather_full(self, local: dict) -> dict:
        """Full leaves (flat, invariant) from every worker's local ones."""
        if self.lay is None:
            return {p: jax.lax.pmean(x, AXIS) for p, x in local.items()}
        return _flatten(sync.gather_full(_unflatten(local), self.spec))


class VisionStepBuilder:
    """State layout, initializer, train step and accuracy evaluation of one vision run.

    Args:
      cfg: :class:`sdp_jax.models.vision.VisionConfig`.
      plan: the parameters' :class:`sdp_jax.spec.SDPSpec` (:func:`sdp_jax.tasks.vision_spec`;
        ``W`` = mesh size).
      optim: :class:`sdp_jax.train_step.OptimConfig`.
      mesh: mesh with one axis ``data`` of size ``W``.
      total_steps: schedule length (optimizer steps).
      dtype: compute dtype ``float32`` or ``bfloat16`` (parameters, optimizer state, BatchNorm
        statistics and averaging stay float32).
      remat: activation checkpointing of every block in the train step: ``none`` or ``full``
        (keep each block's input, recompute the rest in the backward pass).

    Raises:
      ValueError: mesh size differs from ``W``; bad dtype or remat.
    """

    def __init__(self, cfg: vm.VisionConfig, plan: spec_lib.SDPSpec, optim: ts.OptimConfig,
                 mesh, total_steps: int, dtype: str = "float32", remat: str = "none"):
        if mesh.shape[AXIS] != plan.workers:
            raise ValueError(f"mesh axis '{AXIS}' has {mesh.shape[AXIS]} devices but the plan "
                             f"has W={plan.workers} workers.")
        if dtype not in ts.DTYPES:
            raise ValueError(f"dtype={dtype!r}; use float32 or bfloat16.")
        if remat not in ("none", "full"):
            raise ValueError(f"remat={remat!r}; use none or full for vision models.")
        self.remat = remat == "full"
        self.cfg, self.plan, self.optim, self.mesh = cfg, plan, optim, mesh
        self.total_steps = int(total_steps)
        self.dtype = jnp.dtype(ts.DTYPES[dtype])
        self.optimizer = ts.make_optimizer(optim, self.total_steps, decay_mask=_decay)
        self.schedule = ts.lr_schedule(optim, self.total_steps)
        model = nnx.eval_shape(lambda: vm.build(cfg))
        self.full_params = _flatten(model.params())
        self.full_stats = _flatten(model.batch_stats())
        stats_spec = tasks.vision_stats_spec(cfg, plan)
        back = plan.backward
        self.p = _Part(plan if plan.kinds else None, self.full_params, mesh, back)
        self.o = _Part(plan if plan.kinds else None, self.full_params, mesh, back, opt=True)
        self.s = _Part(stats_spec if stats_spec and stats_spec.kinds else None, self.full_stats,
                       mesh, back)
        self.param_shapes, self.param_specs = self.p.shapes, self.p.specs
        self.compact_shapes, self.compact_specs = self.o.shapes, self.o.specs
        self.stats_shapes, self.stats_specs = self.s.shapes, self.s.specs
        self.p_layout = self.p.layout
        self.opt_specs = layout_lib.opt_state_specs(self.optimizer, self.compact_specs,
                                                    self.compact_shapes)
        self.state_specs = {"params": self.param_specs, "stats": self.stats_specs,
                            "opt_state": self.opt_specs, "step": P()}
        # What slot 0 of each downsampling stage holds on every worker (static; see
        # models.vision._first_slot): block 0 everywhere, never, or on some workers.
        self.held = {st.path[0]: plan.kinds[k].held for k, st in plan.stacks.items()
                     if k in plan.kinds}
        self.slot0 = {key: ("down" if (h[:, 0] == 0).all() else
                            "regular" if (h[:, 0] != 0).all() else "mixed")
                      for key, h in self.held.items()}
        self._train_step = None
        self._eval_steps: dict = {}
        self._bn_fn = None
        self._full_fn = None

    # ------------------------------------------------------------------ layout helpers
    def shardings(self, specs=None):
        """NamedShardings of ``specs`` (default: the state's)."""
        return step_lib.shardings(self.mesh, self.state_specs if specs is None else specs)

    def abstract_state(self):
        """ShapeDtypeStruct tree (with shardings) of the train state."""
        return step_lib.abstract_state(self, {"params": self.param_shapes,
                                              "stats": self.stats_shapes})

    def batch_sharding(self):
        return NamedSharding(self.mesh, P(AXIS))

    def per_device_param_count(self) -> int:
        """Parameter elements stored per device."""
        return int(sum(np.prod(s.shape[1:] if self.p_layout.get(p) == "C" else s.shape)
                       for p, s in _flatten(self.param_shapes).items()))

    def init_state(self, seed: int):
        """Initialize the full model from ``seed`` and store each worker's part (holders of a
        component start from the same values). Returns ``{params, stats, opt_state, step}``."""
        def init():
            m = vm.build(self.cfg, seed)
            return (self.p.stored(_flatten(m.params())),
                    self.s.stored(_flatten(m.batch_stats())))
        params, stats = jax.jit(init, out_shardings=(self.shardings(self.param_specs),
                                                     self.shardings(self.stats_specs)))()

        def opt_init(params):
            compact = self.o.stored(_flatten(params)) if self.plan.backward else params
            return self.optimizer.init(compact)
        opt_state = jax.jit(opt_init, out_shardings=self.shardings(self.opt_specs))(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, P()))
        return {"params": params, "stats": stats, "opt_state": opt_state, "step": step}

    # ------------------------------------------------------------------ step pieces
    def _slots(self):
        my = sync.worker_index(AXIS)
        return {k: jnp.asarray(h)[my] for k, h in self.held.items()}

    def _cast(self, tree):
        return {p: x.astype(self.dtype) for p, x in tree.items()}

    def _loss(self, params: dict, stats: dict, images, labels, train: bool, slots=None):
        """Loss of a worker's (or the full) leaves, flat; returns (loss, (new stats flat,
        correct))."""
        logits, new = vm.forward(self.cfg, _unflatten(self._cast(params)), _unflatten(stats),
                                 images.astype(self.dtype), train, slots, self.slot0,
                                 self.remat and train)
        loss = vm.cross_entropy(logits, labels)
        correct = jnp.sum(jnp.argmax(logits, -1) == labels)
        return loss, (_flatten(new) if new else {}, correct)

    def _local_step(self, state, images, labels):
        plan = self.plan
        if plan.backward:  # full forward on every worker; gradients kept for held components
            full = _flatten(state["params"])
            stats = _flatten(state["stats"])
            diff = sync.to_varying(full)
            (loss, (new_stats, correct)), g_full = jax.value_and_grad(
                self._loss, has_aux=True)(diff, stats, images, labels, True)
            my = sync.worker_index(AXIS)
            grads, compact = self.o.prune(g_full, my), self.o.prune(full, my)
            new_stats = {p: jax.lax.pmean(x, AXIS) for p, x in new_stats.items()}
        else:
            local = self.p.local(state["params"])
            stats = self.s.local(state["stats"])
            diff = {p: sync.to_varying(x) if self.p.layout[p] == "R" else x
                    for p, x in local.items()}   # local gradients of replicated leaves
            (loss, (new_stats, correct)), grads = jax.value_and_grad(
                self._loss, has_aux=True)(diff, stats, images, labels, True, self._slots())
            compact = local
            new_stats = self.s.average(new_stats)
        grads = self.o.average(grads)
        gnorm = (sync.global_norm(_unflatten(grads), plan) if self.o.lay is not None else
                 jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads.values())))
        grads = sync.clip_to(grads, gnorm, self.optim.grad_clip)
        updates, opt_state = self.optimizer.update(self.o.lead(grads), state["opt_state"],
                                                   self.o.lead(compact))
        new = _flatten(optax.apply_updates(self.o.lead(compact), updates))
        if plan.backward:   # every worker's full model from the holders' new values
            mine = self.o.local(_unflatten(new))
            rebuilt = self.o.gather_full(mine)
            params = _unflatten({p: mine[p] if self.o.layout.get(p) == "R" else rebuilt[p]
                                 for p in rebuilt})   # always-kept: already equal
            stats_out = _unflatten(new_stats)
        else:
            params = _unflatten(new)
            stats_out = self.s.lead(new_stats)
        n = images.shape[0] * plan.workers
        metrics = {"train_loss": jax.lax.pmean(loss, AXIS), "grad_norm": gnorm,
                   "train_acc": jax.lax.psum(correct, AXIS) / n,
                   "lr": self.schedule(state["step"])}
        return {"params": params, "stats": stats_out, "opt_state": opt_state,
                "step": state["step"] + 1}, metrics

    def train_step_fn(self):
        """Jitted ``(state, images float32 [W*b, H, W, C], labels int32 [W*b]) -> (state,
        metrics)`` with the batch sharded ``P('data')``; ``state`` is donated. metrics:
        ``train_loss`` (nats, mean over workers), ``train_acc`` (fraction of the global batch),
        ``grad_norm`` (of the averaged gradient, before clipping), ``lr``."""
        if self._train_step is None:
            fn = jax.shard_map(self._local_step, mesh=self.mesh,
                               in_specs=(self.state_specs, P(AXIS), P(AXIS)),
                               out_specs=(self.state_specs, P()))
            self._train_step = jax.jit(fn, donate_argnums=0)
        return self._train_step

    def compiled_train_step(self, batch_per_worker: int):
        """Compile the train step for abstract inputs (no data, no state in device memory)."""
        W, c = self.plan.workers, self.cfg
        sh = self.batch_sharding()
        x = jax.ShapeDtypeStruct((W * batch_per_worker, c.image_size, c.image_size,
                                  c.in_channels), jnp.float32, sharding=sh)
        y = jax.ShapeDtypeStruct((W * batch_per_worker,), jnp.int32, sharding=sh)
        return self.train_step_fn().lower(self.abstract_state(), x, y).compile()

    # ------------------------------------------------------------------ full model
    def _local_full(self, params, stats):
        if self.plan.backward:
            return _flatten(params), _flatten(stats)
        return (self.p.gather_full(self.p.local(params)),
                self.s.gather_full(self.s.local(stats)))

    @property
    def recalibrate(self) -> bool:
        """Whether full-model evaluation should re-estimate BatchNorm statistics
        (:meth:`bn_stats_fn`): forward masking with some component not held by every worker, on a
        model with BatchNorm. The running statistics averaged over holders were measured inside
        subnetworks; the full model's activations differ (more blocks summed, more channels), so
        its BatchNorm layers need their own statistics, as slimmable networks re-estimate them
        per width (Yu et al. 2019, "Slimmable neural networks", Sec. 3.3). Measured on the digits
        default (B-SDP C = 1/2, 40 steps): test accuracy 0.26 with the averaged running
        statistics, 0.69 with re-estimated ones."""
        spec = self.s.spec
        if self.plan.backward or spec is None:
            return False
        return any(not t.full for t in spec.kinds.values())

    def _local_bn_stats(self, params, stats, images):
        full_p, full_s = self._local_full(params, stats)
        zeros = {p: jnp.zeros_like(x) for p, x in full_s.items()}
        _, new = vm.forward(self.cfg, _unflatten(self._cast(full_p)), _unflatten(zeros),
                            images.astype(self.dtype), True)
        # From zero running statistics one update leaves (1 - momentum) * batch statistics.
        return jax.tree.map(lambda x: jax.lax.pmean(x / (1 - vm.BN_MOMENTUM), AXIS), new)

    def bn_stats_fn(self):
        """Jitted ``(params, stats, images [W*b, H, W, C]) -> full-model BatchNorm statistics``
        (nested dict like the model's ``batch_stats``, replicated): each worker's batch mean and
        (biased) variance of every BatchNorm of the full model, averaged over workers. Average
        them over a few batches and pass them to ``eval_step_fn(recalibrated=True)``."""
        if self._bn_fn is None:
            spec = jax.tree.map(lambda _: P(), _unflatten(self.full_stats))
            self._bn_fn = jax.jit(jax.shard_map(
                self._local_bn_stats, mesh=self.mesh,
                in_specs=(self.param_specs, self.stats_specs, P(AXIS)), out_specs=spec))
        return self._bn_fn

    def _local_eval(self, params, stats, images, labels, valid, full_stats=None):
        full_p, full_s = self._local_full(params, stats)
        if full_stats is not None:
            full_s = _flatten(full_stats)
        logits, _ = vm.forward(self.cfg, _unflatten(self._cast(full_p)), _unflatten(full_s),
                               images.astype(self.dtype), False)
        logz = jax.nn.logsumexp(logits, -1)
        nll = logz - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0]
        right = (jnp.argmax(logits, -1) == labels) & valid
        return (jax.lax.psum(jnp.sum(jnp.where(valid, nll, 0.0)), AXIS),
                jax.lax.psum(jnp.sum(right), AXIS), jax.lax.psum(jnp.sum(valid), AXIS))

    def eval_step_fn(self, recalibrated: bool = False):
        """Jitted full-model evaluation ``(params, stats, images, labels, valid bool [N]
        [, full BatchNorm statistics]) -> (summed loss nats, correct count, example count)`` over
        a batch sharded ``P('data')``: every block with every channel / neuron / head, BatchNorm
        in inference mode with the running statistics averaged over holders, or
        (``recalibrated``) with statistics from :meth:`bn_stats_fn` as the last argument."""
        if recalibrated not in self._eval_steps:
            specs = (self.param_specs, self.stats_specs, P(AXIS), P(AXIS), P(AXIS))
            if recalibrated:
                specs += (jax.tree.map(lambda _: P(), _unflatten(self.full_stats)),)
            fn = jax.shard_map(self._local_eval, mesh=self.mesh, in_specs=specs,
                               out_specs=(P(), P(), P()))
            self._eval_steps[recalibrated] = jax.jit(fn)
        return self._eval_steps[recalibrated]

    def full_model(self, state) -> tuple[dict, dict]:
        """(params, stats) of the full model as nested dicts of replicated arrays: each
        component is the mean over its holders (equal to every holder's copy after a step)."""
        if self._full_fn is None:
            def fn(params, stats):
                p, s = self._local_full(params, stats)
                return _unflatten(p), _unflatten(s)
            pspec = jax.tree.map(lambda _: P(), _unflatten(self.full_params))
            sspec = jax.tree.map(lambda _: P(), _unflatten(self.full_stats))
            self._full_fn = jax.jit(jax.shard_map(
                fn, mesh=self.mesh, in_specs=(self.param_specs, self.stats_specs),
                out_specs=(pspec, sspec)))
        return self._full_fn(state["params"], state["stats"])
