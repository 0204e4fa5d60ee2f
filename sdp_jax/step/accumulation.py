"""Gradient accumulation: a worker's slice of the batch in ``K`` microbatches, one after another.

:func:`accumulate` gives a parameter source (:class:`sdp_jax.step.sources.Source`) a ``grads`` of
the same signature (``(params, batch, stats, count_branch) -> (loss, aux, gradient,
parameters, new model state)``) that cuts the batch's leading axis ``b`` into ``K``
microbatches of ``b / K`` rows, sums the source's :meth:`~sdp_jax.step.sources.Source.worker_grads`
over them in one ``lax.scan`` and divides by ``K``, then applies the source's
:meth:`~sdp_jax.step.sources.Source.reduce` once. Only one microbatch's activations are alive at a
time, so the activation memory of a step falls towards ``1 / K`` of the whole slice's, while
the averaging over holders, the clipping and the optimizer step see the mean gradient of the
whole slice: for a loss that is a mean over equal-sized examples (the language models' tokens)
the same update as one step on the ``K``-times batch, to float rounding (every averaging is
linear, so the averaged mean is the mean of the averaged). Model state (BatchNorm running
statistics) is updated once per step, by the mean of the microbatches' updates (each starts
from the step's statistics; the update is linear in the batch statistics); each microbatch
normalises with its own batch statistics, as in any framework's accumulation, so a BatchNorm
model's step is not the whole batch's.

Costs: the step builds its sources without the block runner's averaging inside the backward
loop when it accumulates (:func:`sdp_jax.step.sources.in_loop_tables`), so the averaging over
holders (and backward masking's scatter to the owners' shards) runs once per step, after the
last microbatch, with the bytes of a step without accumulation. What cannot leave the loss runs
per microbatch: FSDP's gathers and reduce-scatters (the transpose of its gathers: ``K`` times
the bytes), and a pipeline's boundary sends (the same bytes in ``K`` times the sends, with a
fill and drain per microbatch loop: ``K`` bubbles per step).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from sdp_jax.sync import collectives as sync


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
    """The ``grads`` of ``source`` (:class:`sdp_jax.step.sources.Source`) over ``k`` microbatches
    (see the module docstring); ``source.grads`` itself when ``k == 1``. ``unroll``: the
    microbatch loop unrolled (XLA counts a loop body's FLOPs once; the same results).

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

        def one(mb):
            return source.worker_grads(params, mb, stats, count_branch)

        jaxpr, shapes = jax.make_jaxpr(one, return_shape=True)(
            jax.tree.map(lambda x: x[0], micro))
        avals = jax.tree.unflatten(jax.tree.structure(shapes), jaxpr.out_avals)
        start = jax.tree.map(lambda a: _cast_like(jnp.zeros(a.shape, a.dtype), a), avals)

        def body(total, mb):
            return jax.tree.map(lambda x, y: x + y, total, one(mb)), None

        total, _ = jax.lax.scan(body, start, micro, unroll=bool(unroll))
        loss, aux, g, new = jax.tree.map(lambda x: x * scale, total)
        return loss, aux, source.reduce(g), source.local(params), new
    return accumulated
