"""The optimizer step after the gradient: the holder averaging that keeps holders in agreement,
the global norm every holder computes alike (docs/design.md invariant 6), the clipped optax
update, and the parameters rebuilt for the next step. One small piece per averaging mode:

* :class:`Averaged`: gradients averaged over their holders every step (:func:`sdp_jax.sync.
  average`; with the block runner some already inside the backward loop), the norm of the
  averaged gradient with every component counted once (C = 1 is DDP).
* :class:`Sharded`: FSDP and backward masking's ZeRO-2: the gradient arrives as the mean over
  holders in shards (``S``), each element on one device; the norm sums every shard once;
  backward masking then all-gathers every worker's full copy.
* :class:`Periodic`: each worker steps on its own gradient (the norm of its subnetwork); every
  ``sync_every`` steps the parameters are averaged over their holders.

Each runs inside ``jax.shard_map`` over ``data``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from sdp_jax.mesh import DATA
from sdp_jax.spec import layout as layout_lib
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step.regime import Kind, Update
from sdp_jax.step.state import StateLayout
from sdp_jax.sync import collectives as sync

_flatten, _unflatten = spec_lib.flatten, spec_lib.unflatten


def clipped_update(optimizer: optax.GradientTransformation, grads: Any, norm: jax.Array,
                   grad_clip: float, opt_state: Any, params: Any) -> tuple[Any, Any]:
    """One optimizer step: ``grads`` clipped to global norm ``grad_clip`` by the caller's
    ``norm`` (:func:`sdp_jax.sync.clip_to`; 0 = no clipping), then ``optimizer``'s update
    applied to ``params``. Returns ``(new params, new optimizer state)``."""
    grads = sync.clip_to(grads, norm, grad_clip)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def holder_average(state: StateLayout, local: dict, method: str,
                   done: frozenset = frozenset()) -> dict:
    """Mean over holders of a worker's local values (flat), except the leaves ``done``
    (averaged inside the backward loop)."""
    return _flatten(sync.average(_unflatten(local), state.spec, method=method, done=done))


class Averaged:
    """Gradients averaged over their holders every step."""

    def __init__(self, state: StateLayout, method: str, in_loop: dict):
        self.state, self.method, self.done = state, method, frozenset(in_loop)

    def averaged(self, grads: dict) -> dict:
        """A worker's gradient (flat, local) -> the mean over holders of every component."""
        return holder_average(self.state, grads, self.method, self.done)

    def norm(self, grads: dict) -> tuple[dict, jax.Array]:
        grads = self.averaged(grads)
        return grads, sync.global_norm(_unflatten(grads), self.state.spec)

    def rebuild(self, new: dict, sync_now: bool) -> dict:
        return _unflatten(new)

    def reported(self, gnorm: jax.Array) -> jax.Array:
        return gnorm


class Sharded(Averaged):
    """FSDP and ZeRO-2: the gradient is already the mean over holders, in shards."""

    def averaged(self, grads: dict) -> dict:
        return grads

    def norm(self, grads: dict) -> tuple[dict, jax.Array]:
        codes = self.state.compact_layout   # every element of the averaged gradient on one device
        whole = [jnp.sum(jnp.square(g.astype(jnp.float32))) for p, g in grads.items()
                 if codes[p] == Kind.REPLICATED]   # the same on every worker: once
        gnorm = jnp.sqrt(sync.shards_sq_norm({p: g for p, g in grads.items()
                                              if codes[p] == Kind.SHARDED}, DATA)
                         + sync.sum_parts(whole, DATA, False))
        return grads, gnorm

    def rebuild(self, new: dict, sync_now: bool) -> dict:
        st = self.state
        if st.spec.backward and not st.fsdp:   # every worker's full copy: one all-gather
            return _unflatten({p: st.from_shards(p, sync.all_gather_invariant(x, DATA))
                               if st.compact_layout[p] == Kind.SHARDED else x
                               for p, x in new.items()})
        return _unflatten(new)


class Periodic(Averaged):
    """Each worker on its own gradient; parameters averaged over holders at sync steps."""

    def norm(self, grads: dict) -> tuple[dict, jax.Array]:   # the worker's own gradient
        gnorm = jnp.sqrt(sync.sum_parts([jnp.sum(jnp.square(g.astype(jnp.float32)))
                                         for g in grads.values()], DATA, False))
        return grads, gnorm

    def rebuild(self, new: dict, sync_now: bool) -> dict:
        if not sync_now:
            return _unflatten(new)
        st = self.state
        mine = st.to_local({p: x[0] for p, x in new.items()})
        return st.lead(holder_average(st, mine, self.method), st.compact_layout)

    def reported(self, gnorm: jax.Array) -> jax.Array:
        return jax.lax.pmean(gnorm, DATA)


def averaged_stats(state: StateLayout, new: dict, method: str) -> dict:
    """The loss's new model state (nested) -> the stored ``stats``: each component the mean over
    its holders (every worker under backward masking)."""
    new = _flatten(new)
    if state.spec.backward:
        return _unflatten({p: jax.lax.pmean(x, DATA) for p, x in new.items()})
    sspec = state.state_spec
    avg = _flatten(sync.average(_unflatten(new), sspec, method=method))
    if not state.stacked_slots:
        avg = layout_lib.of(sspec).to_stored(avg)
    return _unflatten({p: x[None] if state.stats_layout[p] == Kind.COMPACT else x
                       for p, x in avg.items()})


def update_of(state: StateLayout, in_loop: dict) -> Averaged:
    """The update piece the regime chose (:attr:`sdp_jax.step.regime.Regime.update`; see the module
    docstring), averaging with the regime's method except the leaves ``in_loop`` (averaged
    inside the backward loop)."""
    regime = state.regime
    piece = {Update.SHARDED: Sharded, Update.PERIODIC: Periodic,
             Update.AVERAGED: Averaged}[regime.update]
    return piece(state, regime.method, in_loop)


def apply(update: Averaged, optimizer, grad_clip: float, grads: dict, local: dict, opt_state,
          sync_now: bool):
    """The optimizer step of a worker: ``(new stored parameters, new optimizer state, the
    reported gradient norm)`` from its gradient and parameters (flat, in the optimizer's
    layout)."""
    st = update.state
    grads, gnorm = update.norm(grads)
    codes = st.compact_layout
    new, opt_state = clipped_update(optimizer, st.lead(grads, codes), gnorm, grad_clip,
                                    opt_state, st.lead(local, codes))
    return update.rebuild(_flatten(new), sync_now), opt_state, update.reported(gnorm)
