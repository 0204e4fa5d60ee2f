"""Gradient accumulation: a worker's slice of the batch in ``K`` microbatches, one after another.

:func:`accumulate` wraps the ``grads`` of a parameter source (:mod:`sdp_jax.sources`:
``(params, batch, stats, count_branch) -> (loss, aux, gradient, parameters, new model
state)``) into one of the same signature that cuts the batch's leading axis ``b`` into ``K``
microbatches of ``b / K`` rows, runs the source on each in turn (one ``lax.scan``) and
returns the means of the losses, aux values and gradients. Only one microbatch's activations
are alive at a time, so the activation memory of a step is about ``1 / K`` of the whole
slice's, while the optimizer step, the averaging over holders and the clipping see the mean
gradient of the whole slice: the same update as one step on the ``K``-times batch, to float
rounding (every averaging a source does is linear, so the mean of the microbatches' averaged
gradients is the average of the mean gradient).

Costs: the step builds its sources without the block runner's in-loop averaging when it
accumulates (:func:`sdp_jax.sources.in_loop_tables`), so the averaging over holders runs once
per step, after the last microbatch, on the accumulated gradient (the same bytes as without
accumulation, none of them overlapping the backward pass). What a source cannot move out of
the loss runs once per microbatch: FSDP's gathers and reduce-scatters (the transpose of its
gathers) and a pipeline's boundary sends, whose bytes grow ``K``-fold. Model state (BatchNorm statistics) is threaded from
one microbatch to the next, so it sees ``K`` updates of ``b / K`` examples each (as in any
framework's accumulation; the normalisation in the forward pass uses each microbatch's own
statistics).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from sdp_jax import sync


def check_accumulation(grad_accum, name: str = "grad_accum") -> None:
    """Raises ValueError unless ``grad_accum`` is a positive integer (``name`` is how the
    caller calls it in the message, e.g. ``config.grad_accum``)."""
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"{name}={grad_accum!r} must be a positive integer (microbatches per "
                         "optimizer step; 1 = no accumulation).")


def microbatches(batch, k: int):
    """A batch pytree whose leaves lead with ``b`` rows -> the same leaves shaped
    ``[k, b / k, ...]``.

    Raises:
      ValueError: a leaf whose leading axis ``k`` does not divide (naming the sizes)."""
    def cut(x):
        if x.shape[0] % k:
            raise ValueError(f"gradient accumulation over {k} microbatches needs a per-worker "
                             f"batch that {k} divides, got {x.shape[0]} rows; choose "
                             "batch_per_worker a multiple of grad_accum.")
        return x.reshape((k, x.shape[0] // k) + x.shape[1:])
    return jax.tree.map(cut, batch)


def _cast_like(x, aval):
    """``x`` marked varying over the mesh axes ``aval`` (an abstract value of a traced result)
    varies over and ``x`` does not, so that a loop carry keeps one type."""
    want = getattr(aval, "vma", None)
    if want is None:
        want = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    extra = tuple(sorted(set(want or ()) - set(sync.varying_axes(x) or ())))
    return sync.to_varying(x, extra) if extra else x


def accumulate(source, k: int, unroll: bool = False) -> Callable:
    """The ``grads`` of a parameter source (``source.grads``, with ``source.local(params)`` its
    parameters in the optimizer's layout), over ``k`` microbatches (see the module docstring);
    ``source.grads`` itself when ``k == 1``. ``unroll``: the microbatch loop unrolled (XLA
    counts a loop body's FLOPs once; the same results).

    The microbatches run in one ``lax.scan`` of ``k`` trips whose carry starts at zeros typed as
    the source's results (their varying mesh axes read from a trace of one microbatch, which
    computes nothing).

    The returned function raises ValueError (when traced, before any compute) for a batch
    whose per-worker rows ``k`` does not divide."""
    if k == 1:
        return source.grads
    scale = 1.0 / k

    def accumulated(params, batch, stats=None, count_branch=None):
        micro = microbatches(batch, k)

        def one(mb, state):
            loss, aux, g, _, state = source.grads(params, mb, state, count_branch)
            return loss, aux, g, state

        jaxpr, shapes = jax.make_jaxpr(one, return_shape=True)(
            jax.tree.map(lambda x: x[0], micro), stats)
        avals = jax.tree.unflatten(jax.tree.structure(shapes), jaxpr.out_avals)
        zeros = [jax.tree.map(lambda a: _cast_like(jnp.zeros(a.shape, a.dtype), a), t)
                 for t in avals[:3]]
        start = (*zeros, jax.tree.map(_cast_like, stats, avals[3]))

        def body(carry, mb):
            total, aux_sum, g_sum, state = carry
            l_i, a_i, g_i, state = one(mb, state)
            add = lambda a, b: jax.tree.map(lambda x, y: x + y, a, b)  # noqa: E731
            return (total + l_i, add(aux_sum, a_i), add(g_sum, g_i), state), None

        (loss, aux, g, stats), _ = jax.lax.scan(body, start, micro, unroll=bool(unroll))
        mean = lambda t: jax.tree.map(lambda x: x * scale, t)  # noqa: E731
        return loss * scale, mean(aux), mean(g), source.local(params), stats
    return accumulated
