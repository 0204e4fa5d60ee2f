"""The parameter sources of the SDP step, one per regime: where a worker's parameters come from
when its model runs, and where their gradients go.

* :class:`Compact`: forward masking (``ddp``, ``b-sdp``, ``n-sdp``): the worker's compact
  subnetwork alone runs (docs/design.md invariant 4); with the block runner the block
  gradients are averaged inside the backward loop (:func:`in_loop_tables`).
* :class:`BackwardHeld`: backward masking (``bb-sdp``, ``nb-sdp``) without FSDP: the full
  forward pass on every worker, gradients only into the held components, sent to the owners
  of their shards (ZeRO-2: the optimizer updates each device's ``1/W``).
* :class:`FsdpGather`: FSDP with the block runner: each block gathered from its shards when it
  runs (only the held blocks, neurons and heads under forward masking).
* :class:`FsdpWhole`: FSDP without the block runner: the whole model gathered at the start of
  the step, the worker's subnetwork pruned from it.

Each runs inside ``jax.shard_map`` over ``data`` and has the interface of :class:`Source`:
:meth:`~Source.worker_grads` (the worker's loss and gradient, with what the source averages
inside the backward pass), :meth:`~Source.reduce` (what it averages after it) and
:meth:`~Source.local`; :meth:`~Source.grads` returns ``(loss, aux, gradient, parameters, new
model state)``, the gradient and parameters flat in the optimizer's layout (compact, or ``S`` with the mean over holders already taken under FSDP and backward
masking). Pipeline stages are not a source of their own: the state layout drops the stage axis
(:meth:`sdp_jax.step.state.Staging.unstage`) and every source runs per stage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from sdp_jax.mesh import DATA
from sdp_jax.spec import layout as layout_lib
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step import regime as regime_lib
from sdp_jax.step.regime import Kind
from sdp_jax.step.runner import GATHERED, ModelCall, held_weight_grads
from sdp_jax.step.state import StateLayout, map_moments, shardings
from sdp_jax.sync import collectives as sync

_flatten, _unflatten = spec_lib.flatten, spec_lib.unflatten


def in_loop_tables(state: StateLayout, call: ModelCall) -> dict:
    """The block leaves whose gradients are averaged inside the backward loop
    (:func:`sdp_jax.sync.mean_in_backward`: {local path: None for a plain mean, or the leaf's
    holder tables}); the others are averaged after the backward pass.

    In the loop when the regime allows it (:attr:`sdp_jax.step.regime.Regime.averages_in_loop`:
    the block runner, gradient averaging by ``alltoall``, no FSDP, periodic averaging,
    pipeline or gradient accumulation). Leaves
    stored per worker (``C``) held by every worker (DDP's blocks) get a plain mean, N-SDP's
    neuron leaves (loop step i is layer i on every worker) the holder mean of layer i.
    B-SDP's blocks cannot be averaged there: loop step i runs a different block on each worker
    (its i-th held one); their gradients go to the owners inside the loop (the first
    all_to_all leg of :func:`sdp_jax.sync.holder_mean`) and come back averaged after it
    (:func:`sdp_jax.sync.sinks_to_mean`). Replicated leaves (N-SDP's norms) are averaged after
    the loop, where their mean leaves the step invariant. Under backward masking (every block
    runs on every worker) the neuron leaves of ``nb-sdp`` go to their owners' shards inside
    the loop (the first all_to_all leg of layer i at loop step i), where the sharded update
    reads them; ``bb-sdp``'s blocks stay after it (at loop step i only the holders of block i
    have its gradient).
    """
    lay, spec = state.layout, state.spec
    if not state.regime.averages_in_loop:
        return {}
    if spec.backward:   # N-SDP's neuron leaves, left in the owners' shards (ZeRO-2)
        if spec_lib.BLOCK in spec.kinds:
            return {}
        return {p: lay.holder_tables(p) for p, lf in lay.leaves.items()
                if call.in_block(p) and lf.form == layout_lib.NEURON
                and not lay.holder_tables(p).full}
    out = {}
    for p, lf in lay.leaves.items():
        if not call.in_block(p) or state.param_layout.get(p) != Kind.COMPACT \
                or lf.form == layout_lib.KEPT:
            continue
        if lay.holder_tables(p).full:
            out[p] = None
        elif lf.form == layout_lib.NEURON and spec_lib.BLOCK not in spec.kinds:
            out[p] = lay.holder_tables(p)   # grouped: layer i at loop step i
        elif lf.form == layout_lib.STACK:
            out[p] = lay.holder_tables(p)   # to the owners in the loop, back after it
    return out


class Source:
    """The interface of a parameter source (one per regime, below). Gradient accumulation
    (:mod:`sdp_jax.step.accumulation`) sums :meth:`worker_grads` over microbatches and calls
    :meth:`reduce` once; the full model's evaluation (:mod:`sdp_jax.step.evaluation`) asks the
    source for the full model (:meth:`full_model`) or, where the source gathers blocks as they
    run (:attr:`gathers_blocks`), for its loss of the full model."""

    #: the source gathers each block from its FSDP shards as the block runs, so no device
    #: ever holds the full model (:class:`FsdpGather`): evaluation runs the source's own loss.
    gathers_blocks = False

    def full_model(self, params) -> dict:
        """Inside ``jax.shard_map`` over ``data``: the full model's parameters (nested dict,
        full shapes), the same on every worker: each component the mean over its holders
        (forward masking), the replicated full model (backward masking), or gathered from
        its FSDP shards. Not given by a source that :attr:`gathers_blocks` (the evaluation
        refuses to gather the whole model there)."""
        raise NotImplementedError

    def skips_unheld(self) -> bool:
        """Whether a worker's unheld blocks skip their weight gradients
        (:func:`sdp_jax.step.runner.held_weight_grads`); only :class:`BackwardHeld` can."""
        return False

    def earlier_layouts(self, optimizer, placement, opt_specs) -> tuple:
        """The checkpoint layouts earlier releases wrote for this regime, as pairs ``(current
        abstract state -> old, restored old state -> current)`` (:mod:`sdp_jax.train.migrations`
        tries them in turn); none but :class:`BackwardHeld`'s."""
        return ()

    def worker_grads(self, params, batch, stats=None, count_branch=None):
        """``(loss, aux, gradient, new model state)`` of the worker's ``batch``: the gradient
        as the backward pass leaves it (a pytree :meth:`reduce` takes; sums of two are
        meaningful), with the averaging the source does inside the backward pass done."""
        raise NotImplementedError

    def reduce(self, g):
        """:meth:`worker_grads`'s gradient -> the gradient in the optimizer's layout (flat),
        with the averaging the source does after the backward pass (linear in ``g``)."""
        return g

    def local(self, params) -> dict:
        """The worker's parameters as the optimizer takes them (flat)."""
        raise NotImplementedError

    def grads(self, params, batch, stats=None, count_branch=None):
        """``(loss, aux, gradient, parameters, new model state)``: :meth:`worker_grads`
        reduced, and :meth:`local`."""
        loss, aux, g, new = self.worker_grads(params, batch, stats, count_branch)
        return loss, aux, self.reduce(g), self.local(params), new


class Compact(Source):
    """Forward masking: the worker's compact subnetwork (flat local leaves) alone runs."""

    def __init__(self, state: StateLayout, call: ModelCall, tables: dict):
        self.state, self.call, self.tables = state, call, tables

    def loss(self, local: dict, batch, *stats, sinks=None, orders=None, average=True):
        """The loss of the local leaves; with the block runner, block gradients averaged
        inside the backward loop (``sinks``: :func:`sdp_jax.sync.owner_sinks` of B-SDP's
        blocks), in the orders of :func:`sdp_jax.sync.cotangent_orders`, which are recorded in
        the dict ``orders`` if given (for :func:`sdp_jax.sync.sinks_to_mean`). With
        ``average=False`` the gradients stay the worker's own, and ``local`` may be any stack
        of blocks, e.g. the full model's (:mod:`sdp_jax.step.alignment`).

        Raises:
          ValueError: a block traced twice with different gradient orders (its rows would
            reach the same sinks in two layouts)."""
        call = self.call
        if call.block_fn is None:
            return call.loss(local, batch, *stats)
        blocks = {p: x for p, x in local.items() if call.in_block(p)}
        kept = {p: x for p, x in local.items() if not call.in_block(p)}
        n = next(iter(blocks.values())).shape[0]
        tables = self.tables if average else {}
        found = {} if orders is None else orders

        def prepare(x, i, run):
            new = sync.cotangent_orders(run, x)
            if found and new != found:
                raise ValueError(f"the blocks were traced twice with different gradient "
                                 f"orders ({found} and {new}); run each block once per loss "
                                 f"or average after the loop (--config.sdp.method=reference)")
            found.update(new)
            return sync.mean_in_backward(x, tables, i, DATA, sinks, orders=found)
        prepare = prepare if tables else None
        return call.call(kept, n, lambda p, i, x: call.cast(x[p]), batch, xs=blocks,
                         prepare=prepare)

    def differentiable(self, local: dict) -> dict:
        """The local leaves as the gradient is taken of them: replicated ones varying over
        ``data`` (each worker's own gradient, not summed by ``shard_map``)."""
        return {lp: sync.to_varying(x) if self.state.param_layout.get(lp) == Kind.REPLICATED
                else x for lp, x in local.items()}

    def local(self, params) -> dict:
        """The worker's parameters as the optimizer takes them: flat, compact."""
        st = self.state
        return st.to_local(st.strip(params))

    def full_model(self, params) -> dict:
        """Each component the mean over its holders (:func:`sdp_jax.sync.gather_full`)."""
        return sync.gather_full(_unflatten(self.local(params)), self.state.spec)

    def worker_grads(self, params, batch, stats=None, count_branch=None):
        """(loss, aux, local gradient (flat, compact), new model state)."""
        st, call = self.state, self.call
        local = self.local(params)
        state_local = st.state_local(stats)
        extra = () if state_local is None else (state_local,)
        diff = self.differentiable(local)
        owners = {p: t for p, t in self.tables.items() if t is not None and not t.grouped}
        if not owners:
            return call.value_and_grad(self.loss, diff, batch, *extra)
        # B-SDP: block gradients reach their owners inside the backward loop, as gradients of
        # zero accumulators (sinks), and come back averaged after it.
        sinks, orders = sync.owner_sinks({p: local[p] for p in owners}, owners, DATA), {}
        loss, aux, (g, sums), new = call.value_and_grad(
            lambda both, *a: self.loss(both[0], *a, sinks=both[1], orders=orders),
            (diff, sinks), batch, *extra)
        g.update(sync.sinks_to_mean(sums, {p: g[p] for p in owners}, owners, DATA, orders))
        return loss, aux, g, new


class BackwardHeld(Source):
    """Backward masking without FSDP: every worker holds the full model (replicated); the full
    forward pass runs, and gradients flow only into the components the worker holds."""

    def __init__(self, state: StateLayout, call: ModelCall, tables: dict, method: str):
        self.state, self.call, self.tables, self.method = state, call, tables, method

    def full_model(self, params) -> dict:
        """Every worker's replicated full model."""
        return _unflatten(_flatten(params))

    def skips_unheld(self) -> bool:
        """Whether a worker's unheld blocks skip their weight gradients
        (:func:`sdp_jax.step.runner.held_weight_grads`): whole blocks (``bb-sdp``) with the block
        runner and full activation checkpointing (which recomputes each block in the backward
        pass anyway)."""
        lay, call = self.state.layout, self.call
        return (call.block_fn is not None and call.remat == "full"
                and spec_lib.BLOCK in self.state.spec.kinds
                and all(lf.form in (layout_lib.KEPT, layout_lib.STACK)
                        for p, lf in lay.leaves.items() if call.in_block(p)))

    def loss(self, mine: dict, full: dict, batch, sinks=None, count_branch=None):
        """The full forward pass with the block runner; gradients flow only into ``mine``
        (this worker's compact part of every masked leaf, and the always-kept leaves) and, for
        the leaves sent to their owners inside the loop (not in ``mine``), into ``sinks``
        (:func:`sdp_jax.sync.owner_sinks`). ``count_branch``: see
        :meth:`sdp_jax.step.SDPStep.compiled_train_step`."""
        lay, spec, call = self.state.layout, self.state.spec, self.call
        my = sync.worker_index(DATA)
        frozen = jax.lax.stop_gradient(full)   # (as stored: not gathered)
        bt = spec.kinds.get(spec_lib.BLOCK)
        tables = self.tables
        xs = prepare = None
        if tables:   # this worker's values of the in-loop leaves, scanned layer by layer
            pruned = self._prune(frozen, my)
            xs = {"own": {p: pruned[p] for p in tables}, "sink": sinks}
            prepare = lambda x, i, run: {   # noqa: E731
                "own": sync.mean_in_backward(x["own"], tables, i, DATA, x["sink"])}

        def get(p, g, x):
            lf = lay.leaves[p]
            if lf.form == layout_lib.KEPT:
                return call.cast(jax.lax.dynamic_index_in_dim(mine[p], g, 0, False))
            base = jax.lax.dynamic_index_in_dim(frozen[p], g, 0, False)
            if lf.form == layout_lib.STACK:   # held: the differentiable copy; else frozen
                s = jnp.asarray(bt.slot)[my, g]
                own = jax.lax.dynamic_index_in_dim(mine[p], jnp.maximum(s, 0), 0, False)
                return call.cast(jnp.where(s >= 0, own, base))
            a = lf.rule.axis
            idx = jnp.asarray(lay.indices(lf))[my, g]
            own = (x["own"][p] if p in tables
                   else jax.lax.dynamic_index_in_dim(mine[p], g, 0, False))
            base, own = call.inner.whole((base, own))   # (one block, whole, for the scatter)
            own = jnp.moveaxis(own, a - 1, 0)
            base = jnp.moveaxis(base, a - 1, 0).at[idx].set(own)
            return call.cast(jnp.moveaxis(base, 0, a - 1))

        kept = {p: x for p, x in mine.items() if not call.in_block(p)}
        apply = self._held_apply(mine, frozen, count_branch) if self.skips_unheld() else None
        return call.call(kept, spec.n_blocks, get, batch, xs=xs, prepare=prepare, apply=apply)

    def _prune(self, full: dict, my) -> dict:
        """Worker ``my``'s compact leaves of the full model (flat), each device pruning its
        own part of a leaf split over the worker's devices (:meth:`sdp_jax.step.inner.
        InnerLayout.take`): the full model is not gathered as one (a leaf whose component axis
        ``fsdp`` splits is whole on each device while it is pruned)."""
        return self.state.layout.prune(full, my, take=self.call.inner.take)

    def _held_apply(self, mine: dict, frozen: dict, count_branch):
        """``apply(g, _, h)`` of the block runner where held blocks alone compute weight
        gradients (:func:`sdp_jax.step.runner.held_weight_grads`)."""
        lay, call = self.state.layout, self.call
        bt = self.state.spec.kinds[spec_lib.BLOCK]
        my = sync.worker_index(DATA)

        def apply(g, _, h):
            s = jnp.asarray(bt.slot)[my, g]
            at = lambda x, j: jax.lax.dynamic_index_in_dim(x, j, 0, False)  # noqa: E731
            own, base, always = {}, {}, {}
            for p, lf in lay.leaves.items():
                if not call.in_block(p):
                    continue
                if lf.form == layout_lib.KEPT:
                    always[p] = at(mine[p], g)
                else:
                    own[p], base[p] = at(mine[p], jnp.maximum(s, 0)), at(frozen[p], g)
            return held_weight_grads(
                lambda leaves, h: call.block({p: call.cast(x) for p, x in leaves.items()}, h),
                s >= 0, own, base, always, h, branch=count_branch)
        return apply

    def earlier_layouts(self, optimizer, placement, opt_specs) -> tuple:
        return (self.compact_optimizer(optimizer, placement, opt_specs),)

    def compact_optimizer(self, optimizer, placement, opt_specs) -> tuple:
        """The compact optimizer layout of checkpoints written before the sharded update, and
        its conversion to layout ``S``: every parameter-shaped entry (a moment) goes from its
        holders to the shards as a gradient does (:meth:`mean_shards`; holders agree, so the
        mean is their value, to the last bit with two holders and to float32 rounding with
        more). ``placement``: where the workers run; ``opt_specs``: the current optimizer
        state's partition specs. Returns ``(to_old, from_old)`` (see
        :meth:`Source.earlier_layouts`)."""
        st, lay = self.state, self.state.layout
        codes = {p: Kind.COMPACT if lay.stored_compact(p) else Kind.REPLICATED
                 for p in lay.stored_shapes}
        specs, shapes = st.struct(codes)
        old_specs = layout_lib.opt_state_specs(optimizer, specs, shapes)

        def to_old(abstract: dict) -> dict:
            opt = jax.eval_shape(optimizer.init, shapes)
            opt = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                               opt, shardings(st.mesh, old_specs))
            return {**abstract, "opt_state": opt}

        def moment(tree):   # this worker's compact leaves (stored form) -> its shards
            flat = {p: x[0] if codes[p] == Kind.COMPACT else sync.to_varying(x)
                    for p, x in spec_lib.flatten(tree).items()}
            dts = {x.dtype for x in flat.values()}   # the moments' dtype (e.g. mu_dtype)
            flat = lay.to_local(flat)
            if self.call.block_fn is None:   # full-size leaves, zero where not held
                flat = st.zero_embedded(flat)
            return spec_lib.unflatten({p: x.astype(next(iter(dts)) if len(dts) == 1 else
                                                   lay.dtype(p))
                                       for p, x in self.mean_shards(flat).items()})

        def convert(opt):
            opt = map_moments(moment, st.staging.unstage(opt, old_specs), shapes)
            return st.staging.restage(opt, opt_specs)

        def from_old(state: dict) -> dict:
            fn = placement.map(convert, (old_specs,), opt_specs)
            laid = {"out_shardings": shardings(st.mesh, opt_specs)} if st.inner.active else {}
            fn = jax.jit(fn, **laid)   # (over a worker's devices: laid out as the step's)
            return {**state, "opt_state": fn(state["opt_state"])}

        return to_old, from_old

    def mean_shards(self, g: dict, done: dict | None = None) -> dict:
        """A worker's gradient (flat; compact leaves of the block subtree, full-size leaves
        elsewhere, of which only the entries it holds count) -> the mean over each entry's
        holders (docs/design.md invariant 2) in layout ``S``, float32 (or wider). Compact
        leaves go to the owners of their pieces (the first all_to_all leg of
        :func:`sdp_jax.sync.holder_shards`: ``(W-1)/W`` of the compact bytes per device);
        full-size masked leaves (every leaf with ``method="reference"``) are masked,
        scaled by ``1 / holders`` and reduce-scattered (``(W-1)/W`` of their bytes);
        always-kept leaves outside the blocks (``R`` in the optimizer) are all-reduced.
        ``done``: {path: the mean already in layout ``S`` (sent inside the backward loop)}."""
        st = self.state
        my = sync.worker_index(DATA)
        out = dict(done or {})
        tabs = {p: t for p, t in st.rows.items() if t is not None and p not in out}
        if tabs and self.method == "reference":   # the reference: every leaf full-size
            g, tabs = st.zero_embedded(g), {}
        if tabs:
            for p, x in sync.holder_shards({p: g[p] for p in tabs}, tabs, DATA).items():
                out[p] = x if tabs[p].grouped else x[0]
        for p, x in g.items():
            if p in tabs or p in out:
                continue
            x = x.astype(sync._sum_dtype([x]))
            if st.compact_layout[p] == Kind.REPLICATED:   # always-kept, updated whole
                out[p] = jax.lax.pmean(x, DATA)
                continue
            mask, inv = st.spec.leaf_mask(p), jnp.asarray(st.inv_holders[p], x.dtype)
            x = x * (inv if mask is None else jnp.asarray(mask, x.dtype)[my] * inv)
            rows = st.to_shards(p, x)
            out[p] = jax.lax.psum_scatter(rows, DATA, scatter_dimension=rows.ndim - 1,
                                          tiled=True)
        return out

    def worker_grads(self, params, batch, stats=None, count_branch=None):
        """(loss, aux, ``(the worker's gradient, the means already sent to the owners' shards
        inside the backward loop)``, new model state)."""
        st, call, tables = self.state, self.call, self.tables
        state_local = st.state_local(stats)
        extra = () if state_local is None else (state_local,)
        full = _flatten(params)   # (as stored: each device prunes its own part)
        my = sync.worker_index(DATA)
        if call.block_fn is None:   # the full gradient, masked to this worker's part
            loss, aux, g, new = call.value_and_grad(call.loss, sync.to_varying(full), batch,
                                                    *extra)
            return loss, aux, (g, {}), new
        local = self._prune(full, my)
        diff = {p: sync.to_varying(x) if st.layout.leaves[p].form == layout_lib.KEPT else x
                for p, x in local.items() if p not in tables}   # (kept: local gradients)
        sinks = sync.owner_sinks({p: local[p] for p in tables}, tables, DATA)
        loss, aux, (g, sums), new = call.value_and_grad(
            lambda both, *a: self.loss(both[0], *a, sinks=both[1], count_branch=count_branch),
            (diff, sinks), full, batch, *extra)
        done = sync.sinks_to_shards(sums, {p: local[p] for p in tables}, tables)
        return loss, aux, (g, done), new

    def reduce(self, g):
        """The masked mean in layout ``S`` (:meth:`mean_shards`)."""
        return self.mean_shards(*g)

    def local(self, params) -> dict:
        """The worker's part of the parameters as the sharded update takes them: layout ``S``
        (``R`` for always-kept leaves outside the blocks)."""
        return self.state.my_shards(_flatten(params))


class FsdpGather(Source):
    """FSDP with the block runner: every leaf stored once in shards (``S``), each block
    gathered, in the compute dtype, when it runs."""

    gathers_blocks = True

    def __init__(self, state: StateLayout, call: ModelCall):
        self.state, self.call = state, call

    def loss(self, shards, batch, train=True):
        """Train: forward variants gather only the worker's held blocks / neurons / heads
        (all_to_all); backward variants gather whole blocks and keep the gradients of the held
        parts only. Eval (``train=False``): the full model."""
        st, call = self.state, self.call
        flat = _flatten(shards)
        my = sync.worker_index(DATA)
        pruned, masked_grads = train and not st.spec.backward, train and st.spec.backward
        dtype = call.dtype if call.dtype is not None else next(iter(flat.values())).dtype
        kept = {p: st.from_shards(p, sync.fsdp_gather(x[None], st.rows_len(p), dtype)[0])
                for p, x in flat.items() if not call.in_block(p)}
        bt = st.spec.kinds.get(spec_lib.BLOCK)
        n = bt.k if pruned and bt is not None else st.spec.n_blocks

        def get(p, i, _):
            x, t = flat[p], st.rows[p]
            shape, rlen = st.spec.shapes[p], st.rows_len(p)
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
                    rows = sync.fsdp_gather(x, rlen, dtype, idx=sync.slot_indices(t, 0, i, 1))
                else:
                    keep = (jnp.asarray(t.held)[my, 0, i][None] if masked_grads and not t.full
                            else None)
                    rows = sync.fsdp_gather(jax.lax.dynamic_slice_in_dim(x, i, 1, 0), rlen,
                                            dtype, keep=keep)
                val = rows.reshape(shape[1:])
            return checkpoint_name(val, GATHERED)

        return call.call(kept, n, get, batch, train=train)

    def divide_counts(self, grads: dict) -> dict:
        """Masked sums in layout ``S`` -> masked means (multiplicity of every row)."""
        W, out = self.state.spec.workers, {}
        for p, g in grads.items():
            t = self.state.rows[p]
            if t is None:
                out[p] = g / W
            else:
                c = t.counts[0][:, None] if not t.grouped else t.counts[..., None]
                out[p] = g / jnp.asarray(c, g.dtype)
        return out

    def local(self, params) -> dict:
        """The device's shards (layout ``S``), flat."""
        return _flatten(params)

    def worker_grads(self, params, batch, stats=None, count_branch=None):
        """(loss, aux, the masked sums in layout ``S`` (the gathers' transpose), None)."""
        loss, aux, g, _ = self.call.value_and_grad(self.loss, params, batch)
        return loss, aux, g, None

    def reduce(self, g):
        return self.divide_counts(_flatten(g))


class FsdpWhole(Source):
    """FSDP without the block runner (list-form blocks, model state): the whole model gathered
    at the start of the step in the compute dtype; forward variants prune the worker's
    subnetwork from it locally, backward variants run it whole with gradients only into the
    held parts. The gradient is the masked mean in layout ``S`` (the reduce-scatter of the
    gather's transpose: full-size bytes)."""

    def __init__(self, state: StateLayout, call: ModelCall):
        self.state, self.call = state, call

    def gathered(self, shards, dtype=None, scale=False) -> dict:
        """Every leaf gathered whole (flat ``{path: leaf}``; an all_gather in ``dtype``,
        default the stored one). ``scale``: each entry's gradient, in float32, scaled by
        ``1 / holders``, so that the reduce-scatter of the transpose, the sum over workers, is
        the masked mean."""
        st, out = self.state, {}
        for p, x in _flatten(shards).items():
            inv = jnp.asarray(st.inv_holders[p]) if scale else None
            out[p] = st.from_shards(p, sync.fsdp_gather(
                x[None], st.rows_len(p), dtype or x.dtype, scale=inv,
                leaf=st.spec.shapes[p])[0])
        return out

    def full_model(self, params) -> dict:
        """The whole model gathered from its shards, in the stored dtype."""
        return _unflatten(self.gathered(params))

    def loss(self, shards, batch, *stats):
        st = self.state
        lay, my = st.layout, sync.worker_index(DATA)
        full = self.gathered(shards, self.call.dtype, scale=True)
        if st.spec.backward:
            local = lay.embed(jax.lax.stop_gradient(full), lay.prune(full, my), my)
        else:
            local = lay.prune(full, my)
            if st.stacked_slots:
                local = lay.to_stored(local)
        return self.call.loss_fn(_unflatten(local), batch, *map(_unflatten, stats))

    def worker_grads(self, params, batch, stats=None, count_branch=None):
        """(loss, aux, the masked means in layout ``S`` (the gathers' transpose), new model
        state)."""
        state_local = self.state.state_local(stats)
        extra = () if state_local is None else (state_local,)
        return self.call.value_and_grad(self.loss, params, batch, *extra)

    def reduce(self, g):
        return _flatten(g)

    def local(self, params) -> dict:
        """The device's shards (layout ``S``), flat."""
        return _flatten(params)


def source_of(state: StateLayout, call: ModelCall, tables: dict) -> Source:
    """The parameter source the regime chose (:attr:`sdp_jax.step.regime.Regime.source`; see the
    module docstring), built on the state layout ``state``, the model call ``call`` and the
    in-loop holder tables ``tables`` (:func:`in_loop_tables`)."""
    regime = state.regime
    if regime.source == regime_lib.Source.FSDP_BLOCKS:
        return FsdpGather(state, call)
    if regime.source == regime_lib.Source.FSDP_WHOLE:
        return FsdpWhole(state, call)
    if regime.source == regime_lib.Source.BACKWARD_HELD:
        return BackwardHeld(state, call, tables, regime.method)
    return Compact(state, call, tables)
