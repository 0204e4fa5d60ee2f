"""How the step calls a model: its loss on a tree of leaves, and the *block runner* that
applies a worker's blocks one by one (a scan over the blocks, each under activation
checkpointing, each block's parameters fetched by the caller's ``get``).

The parameter sources (:mod:`sdp_jax.step.sources`) decide where each block's parameters come from
(the compact stack, the frozen full model, an FSDP gather); :class:`ModelCall` runs the model
on them, in the compute dtype.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from sdp_jax.options import ModelHooks, StepOptions
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step.inner import InnerLayout

GATHERED = "fsdp_gathered"  # checkpoint_name of FSDP-gathered parameters (never saved)
# Outputs that only move or re-type data: not saved for the backward pass under FSDP without
# activation checkpointing, so that no copy of a gathered parameter (the all_gather's output,
# its reshape or its cast) is kept as a residual: the backward pass gathers again, as FSDP
# does. (jax's save_anything_except_these_names(GATHERED) let the value under the name be
# saved instead: the whole gathered block stayed alive.) Cheap to recompute from what is kept.
_MOVES = frozenset({"all_gather", "all_to_all", "reshape", "convert_element_type", "squeeze",
                    "expand_dims", "broadcast_in_dim", "dynamic_slice", "slice", "transpose",
                    "concatenate", "gather", "copy", "name"})


def _save_all_but_gathered(prim, *_, **__) -> bool:
    """Remat policy of FSDP with ``remat='none'``: every value is saveable except data
    movement (:data:`_MOVES`), so activations are kept and gathered parameters never are."""
    return prim.name not in _MOVES


def cast_floating(x: jax.Array, dtype) -> jax.Array:
    """``x`` in the compute ``dtype`` if it is floating (None: unchanged); integers as they
    are."""
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.astype(dtype)


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




def _merge_hint(loss_fn: Callable, spec: spec_lib.SDPSpec) -> Callable:
    """``loss_fn``, with flax's leaf-count error of ``nnx.merge`` (a graphdef built for another
    depth than the parameters the loss is given) turned into a one-line error naming the fix."""
    def loss(*args):
        try:
            return loss_fn(*args)
        except ValueError as e:
            if "Incorrect number of leaves" not in str(e):
                raise
            one_stack = spec.blocks_stacked or (spec.block_path and len(spec.stacks) <= 1)
            depth = (f" ({spec.local_blocks} of {spec.n_blocks} blocks per worker under "
                     f"{spec.variant})" if one_stack and spec.local_blocks else "")
            raise ValueError(
                f"loss_fn merged its parameters into a graphdef of another shape "
                f"({str(e).splitlines()[0].rstrip('.')}): in training it gets the worker's "
                f"local parameters{depth}, in evaluation the full model; build the graphdef "
                "from the depth of the parameters it is given (e.g. nnx.graphdef(nnx.eval_shape"
                "(lambda: Net(len(params['blocks']), nnx.Rngs(0))))) or from spec.local_blocks, "
                "not from the full model (docs/custom_models.md).") from None
    return loss


class ModelCall:
    """The user's model as the step calls it: the loss on a worker's leaves in the compute
    dtype, with or without the block runner.

    Args:
      spec: the run's :class:`sdp_jax.spec.SDPSpec` (its shapes name the leaves).
      model: the model's functions, :class:`sdp_jax.options.ModelHooks` (the loss, the block
        runner's ``block_fn``, ``has_aux``; a ``state_spec`` means the loss takes and returns
        model state).
      options: :class:`sdp_jax.options.StepOptions`: the compute dtype, and the block
        runner's activation checkpointing, scan unrolling, and whether gathered parameters
        are never saved (``fsdp``, :func:`remat_block`).
      inner: the layout over a worker's own devices, a :class:`sdp_jax.step.inner.InnerLayout`
        (each leaf gathered over ``fsdp`` when the model uses it); None: one device.
    """

    def __init__(self, spec: spec_lib.SDPSpec, model: ModelHooks, options: StepOptions,
                 inner=None):
        block_fn = model.block_fn
        self.inner = InnerLayout(spec) if inner is None else inner
        self.spec, self.loss_fn, self.block_fn = spec, _merge_hint(model.loss_fn, spec), block_fn
        self.dtype, self.remat = options.compute_dtype, options.remat
        self.unroll, self.fsdp = options.unroll, options.fsdp
        self.has_aux, self.has_state = model.has_aux, model.state_spec is not None
        self.prefix = spec.block_path if block_fn is not None else None
        self.block_paths = [p for p in spec.shapes if self.in_block(p)]

    def in_block(self, p) -> bool:
        """Whether leaf ``p`` (a path tuple) is in the stacked block subtree of the runner."""
        return self.prefix is not None and p[:len(self.prefix)] == self.prefix

    def cast(self, x):
        return cast_floating(x, self.dtype)

    def _use(self, p, x, per_block: bool = False):
        """Leaf ``p`` as the model uses it (:meth:`sdp_jax.step.inner.InnerLayout.in_use`)."""
        return self.inner.in_use(p, x, per_block)

    def _kept(self, flat: dict) -> dict:
        """The leaves ``flat`` ({path: array}) as the loss takes them: nested, in the compute
        dtype, gathered over a worker's own devices."""
        return spec_lib.unflatten({p: self._use(p, self.cast(x)) for p, x in flat.items()})

    def loss(self, flat: dict, batch, *stats):
        """``loss_fn`` on the leaves ``flat`` ({path: array}, cast to the compute dtype) without
        the block runner; ``stats``: the model state (flat), if the loss takes one."""
        return self.loss_fn(self._kept(flat), batch, *map(spec_lib.unflatten, stats))

    def block(self, leaves: dict, h):
        """``block_fn`` on one block's leaves ``{full path: value}`` (flat)."""
        return self.block_fn(spec_lib.unflatten({p[len(self.prefix):]: self._use(p, x, True)
                                                 for p, x in leaves.items()}), h)

    def call(self, kept: dict, n: int, get, batch, train=True, xs=None, prepare=None,
             apply=None):
        """``loss_fn`` with the block runner: ``kept`` {path: leaf} outside the block subtree;
        ``n`` blocks whose leaf ``path`` of block ``i`` (traced) is ``get(path, i, x)`` in the
        compute dtype, ``x`` slice ``i`` of ``xs`` (stacked leaves scanned over: their gradients
        are then stacked, not accumulated in a carry), first passed through
        ``prepare(x, i, run)`` if given (inside the loop, and inside activation checkpointing;
        ``run(x)``: the block applied to the hidden state with the leaves ``x``). ``apply(i, x,
        h)``, if given, computes block ``i``'s output itself (instead of ``get`` and
        ``prepare``)."""
        paths = self.block_paths

        def body(h, ix):
            i, x = ix
            if apply is not None:
                return apply(i, x, h), None

            def run(x):
                return self.block({p: get(p, i, x) for p in paths}, h)
            if prepare is not None:
                x = prepare(x, i, run)
            return run(x), None
        runner = scan_runner(body, (jnp.arange(n), xs), train=train, remat=self.remat,
                             unroll=self.unroll, fsdp=self.fsdp)
        return self.loss_fn(self._kept(kept), batch, runner)

    def value_and_grad(self, fn, *args):
        """(loss, aux, gradient, new model state or None) of ``fn`` (a loss of the step, in
        the form of ``loss_fn``: with aux and model state as the step was built)."""
        def split(*a):
            out = fn(*a)
            if not self.has_state:
                return out if self.has_aux else (out, {})
            if self.has_aux:
                loss, aux, new = out
            else:
                (loss, new), aux = out, {}
            return loss, (aux, new)
        (loss, aux), grads = jax.value_and_grad(split, has_aux=True)(*args)
        aux, new = aux if self.has_state else (aux, None)
        return loss, aux, grads, new

    def output_loss(self, out):
        """The loss of a ``loss_fn`` output (dropping the aux values)."""
        return out[0] if self.has_aux else out
