"""Gradient alignment of an SDP step: how well a worker's subnetwork gradient and the holders'
averaged update point where the full model's gradient points (the gradient-alignment
explanation of Singh et al., arXiv 2507.09029, for block against width-wise subnetworks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sdp_jax.mesh import DATA
from sdp_jax.options import StepOptions
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step.evaluation import Evaluation
from sdp_jax.step.sources import Compact
from sdp_jax.sync import collectives as sync

_flatten, _unflatten = spec_lib.flatten, spec_lib.unflatten


def check(options: StepOptions, *, pipelined: bool = False, no_full_loss: str = "",
          asked: str = "SDPStep.alignment_fn()",
          fix: str = "measure it on an unpipelined run without FSDP, averaging gradients"
          ) -> None:
    """The one owner of the gradient alignment's refusals, for
    :meth:`sdp_jax.step.SDPStep.alignment_fn` and a run config's ``align_every``
    (:func:`sdp_jax.train.run.resolve`).

    Args:
      options: the step's :class:`sdp_jax.options.StepOptions`; pipelined: a mesh axis
        ``stage`` (a pipeline);
      no_full_loss: what to call the model when it has no full-model loss of its own here
        (one that runs its own block slots, ``stacked_slots``: the vision models); empty
        when it has one.
      asked: what the message says was asked for; fix: how to drop the request.

    Raises:
      ValueError: a pipeline, FSDP, such a model, parameter averaging (the alignment needs
        the full model, one model per component and the model's own loss on every device)."""
    if pipelined:
        what = "pipelines"
    elif options.fsdp:
        what = "FSDP"
    elif no_full_loss:
        what = no_full_loss
    elif options.periodic:
        what = "parameter averaging (config.sdp.average=parameters)"
    else:
        return
    raise ValueError(f"{asked}: the gradient alignment is not built for {what} (it needs the "
                     "full model, one model per component and the model's own loss on every "
                     f"device); {fix}.")


def cosine(a: dict, b: dict) -> jax.Array:
    """``<a, b> / (|a| |b|)`` over every leaf of two flat dicts of the same keys and shapes,
    in float32 (0 when either is zero)."""
    dot = sum(jnp.vdot(a[p].astype(jnp.float32), b[p].astype(jnp.float32)) for p in a)
    na = sum(jnp.sum(jnp.square(a[p].astype(jnp.float32))) for p in a)
    nb = sum(jnp.sum(jnp.square(b[p].astype(jnp.float32))) for p in b)
    return dot / jnp.maximum(jnp.sqrt(na) * jnp.sqrt(nb), jnp.finfo(jnp.float32).tiny)


def local_alignment(evaluation: Evaluation, params, batch, stats=None) -> dict:
    """Inside ``shard_map`` over ``data``: ``{"grad_alignment", "update_alignment"}`` (float32
    scalars, replicated; see :meth:`sdp_jax.step.SDPStep.alignment_fn`)."""
    st, call = evaluation.state, evaluation.call
    lay, my = st.layout, sync.worker_index(DATA)
    # the subnetwork's loss without in-loop averaging (each worker's own gradient)
    own = Compact(st, call, {})
    full, full_stats = evaluation.gather(params, stats)
    full = _flatten(full)
    extra = () if full_stats is None else (_flatten(full_stats),)
    # the full model's gradient on this worker's slice (its own: varying, not summed)
    _, _, g_full, _ = call.value_and_grad(lambda f, *a: own.loss(f, *a, average=False),
                                          sync.to_varying(full), batch, *extra)
    g_held = lay.prune(g_full, my)   # restricted to the components this worker holds
    if st.spec.backward:   # the full forward pass: its held gradient is g_held itself
        g_sub = g_held
    else:                  # the worker's compact subnetwork alone
        local = st.to_local(st.strip(params))
        state_local = st.state_local(stats)
        _, _, g_sub, _ = call.value_and_grad(
            lambda f, *a: own.loss(f, *a, average=False), own.differentiable(local), batch,
            *(() if state_local is None else (state_local,)))
    held = jax.lax.pmean(cosine(g_sub, g_held), DATA)
    # the averaged update (each component's mean over its holders) against DDP's mean
    sdp = _flatten(sync.gather_full(_unflatten(g_sub), st.spec))
    ddp = {p: jax.lax.pmean(x, DATA) for p, x in g_full.items()}
    return {"grad_alignment": held, "update_alignment": cosine(sdp, ddp)}
