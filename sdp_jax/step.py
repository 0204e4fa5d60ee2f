"""An SDP training step for any model: a spec, a loss function and an optax optimizer.

:class:`SDPStep` builds the pure, jitted ``train_step(state, batch) -> (state, metrics)`` of a
model that is not part of this package, from

* an :class:`sdp_jax.spec.SDPSpec` (the model's declared rules, variant, W, C, scheme, seed);
* ``loss_fn(params, batch) -> float32 scalar``: the mean loss of a worker's batch, for the
  worker's *local* parameters (a nested dict like ``nnx.to_pure_dict`` gives). Under forward
  masking (``ddp``, ``b-sdp``, ``n-sdp``) these are compact: ``k`` blocks, narrowed neuron leaves
  (:mod:`sdp_jax.layout`), so the worker's subnetwork alone runs; under backward masking
  (``bb-sdp``, ``nb-sdp``) they are the full model, and only the held components get gradients;
* an ``optax.GradientTransformation`` (without ``clip_by_global_norm``: pass ``grad_clip``, which
  is computed from the averaged gradient with every component counted once, DESIGN.md
  invariant 6).

The step, inside ``jax.shard_map`` over the mesh axis ``data``: local loss and gradient of the
worker's batch slice -> :func:`sdp_jax.sync.average` (mean over each component's holders,
invariant 2) -> :func:`sdp_jax.sync.clip_by_global_norm` -> the optimizer on the compact
parameters -> under backward masking, every worker's full parameters rebuilt from the holders'
new values (:func:`sdp_jax.sync.gather_full`: holder ``all_to_all``, then an all-gather).

State layout: forward masking stores parameters and optimizer state compact (``[W, ...]``
sharded ``P('data')`` per masked leaf, replicated ``P()`` per always-kept leaf); backward masking
stores the full parameters replicated and the optimizer state compact.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax import layout as layout_lib
from sdp_jax import spec as spec_lib
from sdp_jax import sync

AXIS = sync.AXIS


class SDPStep:
    """The train step of a model described by an :class:`sdp_jax.spec.SDPSpec`.

    Args:
      spec: the spec (``W`` = the mesh's ``data`` size).
      loss_fn: ``(params, batch) -> loss`` (float32 scalar), see the module docstring; ``batch``
        is the worker's slice (leading axis ``b``) of the global batch.
      optimizer: an optax transformation, applied to the compact parameters.
      mesh: a mesh with an axis ``data`` of size ``W``; default: the first ``W`` devices.
      grad_clip: global-norm clipping threshold of the averaged gradient (0 = none).
      method: averaging of masked leaves, ``alltoall`` (holder-only bytes) or ``psum`` (the
        full-size reference); see :func:`sdp_jax.sync.average`.

    Raises:
      ValueError: the mesh's ``data`` size differs from ``W``; fewer devices than ``W``.
    """

    def __init__(self, spec: spec_lib.SDPSpec, loss_fn: Callable, optimizer, mesh=None, *,
                 grad_clip: float = 0.0, method: str = "alltoall"):
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
        if method not in ("alltoall", "psum"):
            raise ValueError(f"method={method!r}; use alltoall or psum.")
        self.spec, self.loss_fn, self.optimizer, self.mesh = spec, loss_fn, optimizer, mesh
        self.grad_clip, self.method = float(grad_clip), method
        self.layout = layout_lib.of(spec)
        lay = self.layout
        compact_specs = {sp: P(AXIS) if lay.stored_compact(sp) else P()
                         for sp in lay.stored_shapes}
        self.compact_specs = layout_lib.unflatten(compact_specs)
        self.compact_shapes = layout_lib.unflatten({
            sp: jax.ShapeDtypeStruct(((W,) if lay.stored_compact(sp) else ()) + shape,
                                     jnp.float32) for sp, shape in lay.stored_shapes.items()})
        if spec.backward:
            self.param_specs = layout_lib.unflatten({p: P() for p in spec.shapes})
        else:
            self.param_specs = self.compact_specs
        self.opt_specs = layout_lib.opt_state_specs(optimizer, self.compact_specs,
                                                    self.compact_shapes)
        self.state_specs = {"params": self.param_specs, "opt_state": self.opt_specs,
                            "step": P()}
        self._step = None

    # ------------------------------------------------------------------ state
    def shardings(self, specs=None):
        """NamedShardings of ``specs`` (default: the state's)."""
        specs = self.state_specs if specs is None else specs
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def init(self, full_params: Any) -> dict:
        """State ``{params, opt_state, step}`` on the mesh from the full model's parameters
        (an ``nnx.Module``, ``nnx.State`` or nested dict): every holder of a component starts
        from the same values."""
        flat = layout_lib._flatten(spec_lib.pure_tree(full_params))
        got = {p: tuple(x.shape) for p, x in flat.items()}
        if got != self.spec.shapes:
            diff = sorted(set(got.items()) ^ set(self.spec.shapes.items()), key=str)[:2]
            raise ValueError(f"the parameters differ from the ones the spec was built from "
                             f"({diff}); build the spec from this model, or init from the "
                             "model the spec describes.")
        full = layout_lib.unflatten(flat)
        lay = self.layout
        if self.spec.backward:   # a copy: the step donates the state, not the caller's model
            params = jax.jit(lambda t: t, out_shardings=self.shardings(self.param_specs))(full)
            compact = jax.jit(lay.stored, out_shardings=self.shardings(self.compact_specs))(full)
        else:
            params = jax.jit(lay.stored, out_shardings=self.shardings(self.param_specs))(full)
            compact = params
        opt_state = jax.jit(self.optimizer.init,
                            out_shardings=self.shardings(self.opt_specs))(compact)
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, P()))
        return {"params": params, "opt_state": opt_state, "step": step}

    def full_params(self, state) -> dict:
        """The full model's parameters (host numpy, nested dict), each component from its
        first holder (gathers the whole model to this host; one process)."""
        if self.spec.backward:
            return jax.tree.map(np.asarray, jax.device_get(state["params"]))
        return self.layout.unprune(state["params"])

    # ------------------------------------------------------------------ the step
    def _lead(self, flat):
        """Stored leaves of this worker (flat) -> with the leading worker axis of size 1."""
        return {sp: x[None] if self.layout.stored_compact(sp) else x for sp, x in flat.items()}

    def _strip(self, flat):
        """Inverse of :meth:`_lead`, then the local view (list-form block slots unstacked)."""
        return self.layout.to_local({sp: x[0] if self.layout.stored_compact(sp) else x
                                     for sp, x in flat.items()})

    def _local_step(self, state, batch):
        lay, spec = self.layout, self.spec
        my = sync.worker_index(AXIS)
        params = state["params"]
        if spec.backward:   # full forward; gradients of the held components only
            full = layout_lib._flatten(params)
            local = lay.prune(full, my)
            frozen = jax.lax.stop_gradient(full)

            def loss(local, batch):
                return self.loss_fn(layout_lib.unflatten(lay.embed(frozen, local, my)), batch)
        else:
            local = self._strip(layout_lib._flatten(params))

            def loss(local, batch):
                return self.loss_fn(layout_lib.unflatten(local), batch)
        compact = lay.to_stored(local)
        diff = {lp: x if lay.compact(lp) else sync.to_varying(x) for lp, x in local.items()}
        value, grads = jax.value_and_grad(loss)(diff, batch)
        grads = sync.average(layout_lib.unflatten(grads), spec, method=self.method)
        grads, norm = sync.clip_by_global_norm(grads, spec, self.grad_clip)
        grads = lay.to_stored(layout_lib._flatten(grads))
        tree = lambda flat: layout_lib.unflatten(self._lead(flat))  # noqa: E731
        updates, opt_state = self.optimizer.update(tree(grads), state["opt_state"],
                                                   tree(compact))
        new = layout_lib._flatten(optax.apply_updates(tree(compact), updates))
        if spec.backward:   # every worker's full parameters from the holders' new values
            local = self._strip(new)
            rebuilt = layout_lib._flatten(sync.gather_full(layout_lib.unflatten(local), spec))
            new_params = layout_lib.unflatten({p: x.astype(full[p].dtype)
                                               for p, x in rebuilt.items()})
        else:
            new_params = layout_lib.unflatten(new)
        metrics = {"train_loss": jax.lax.pmean(value, AXIS), "grad_norm": norm}
        return {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    @property
    def train_step(self):
        """Jitted ``(state, batch) -> (state, metrics)``; ``batch`` is a pytree of arrays whose
        leading axis is the global batch ``W * b`` (sharded ``P('data')``); ``state`` is donated.
        metrics: ``train_loss`` (mean over workers), ``grad_norm`` (of the averaged gradient,
        before clipping)."""
        if self._step is None:
            fn = jax.shard_map(self._local_step, mesh=self.mesh,
                               in_specs=(self.state_specs, P(AXIS)),
                               out_specs=(self.state_specs, P()))
            self._step = jax.jit(fn, donate_argnums=0)
        return self._step

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
        sh = NamedSharding(self.mesh, P(AXIS))
        return jax.tree.map(lambda x: jax.device_put(x, sh), batch)

    def compile(self, state, batch):
        """The train step lowered and compiled for ``state`` and ``batch`` (arrays or
        ``jax.ShapeDtypeStruct`` with shardings): read its per-device memory with
        ``memory_analysis()`` (:func:`sdp_jax.train_step.memory_stats`)."""
        return self.train_step.lower(state, batch).compile()
