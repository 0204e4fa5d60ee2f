"""The full model's evaluation from a run's stored state: every block with all its neurons and
heads, each component the mean over its holders (FSDP: gathered from its owners), without any
device storing the whole model when the block runner streams the blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sdp_jax.mesh import DATA
from sdp_jax.spec import layout as layout_lib
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step.regime import Kind
from sdp_jax.step.runner import ModelCall
from sdp_jax.step.sources import Source
from sdp_jax.step.state import StateLayout
from sdp_jax.sync import collectives as sync
from sdp_jax.sync.placement import Placement

_flatten, _unflatten = spec_lib.flatten, spec_lib.unflatten


class Evaluation:
    """Full-model gathers and the jitted evaluation loss of one step's state layout.

    Args:
      state: the state layout (its regime: under parameter averaging the holders' average is
        evaluated); call: the model call; source: the run's parameter source (its FSDP
        gathers are reused here); placement: where the workers run
        (:class:`sdp_jax.sync.placement.Placement`).
    """

    def __init__(self, state: StateLayout, call: ModelCall, source: Source,
                 placement: Placement):
        self.state, self.call, self.source = state, call, source
        self.periodic = state.regime.periodic
        self.placement = placement
        self._step = None
        if call.block_fn is not None:
            self._tables()

    def _tables(self):
        """Static tables of the streamed full-model evaluation (block runner)."""
        lay, spec = self.state.layout, self.state.spec
        bt = spec.kinds.get(spec_lib.BLOCK)
        self._blocks = sync.CompactTables(bt.masks[0]) if bt is not None else None
        self._layers = {}
        for p, lf in lay.leaves.items():
            if lf.form == layout_lib.NEURON and self.call.in_block(p):
                t = spec.kinds[lf.rule.kind]
                self._layers[p] = sync.LayerTables(lay.indices(lf),
                                                   np.repeat(t.counts, lf.rule.expand, axis=1),
                                                   lf.rule.axis)

    def gather(self, params, stats=None) -> tuple[dict, dict | None]:
        """Inside ``jax.shard_map`` over ``data``: the full model, the same on every worker
        (see :meth:`sdp_jax.step.SDPStep.gather`).

        Raises:
          ValueError: with the block runner under FSDP, or with a pipeline."""
        st = self.state
        if self.source.gathers_blocks or st.staged:
            raise ValueError("gather() would hold the whole model on every device; with the "
                             "block runner under FSDP or with a pipeline use eval_step_fn, "
                             "which streams the blocks.")
        full = self.source.full_model(self.call.inner.whole(params))
        if stats is None or st.spec.backward:
            return full, (None if stats is None else _unflatten(_flatten(stats)))
        flat = {p: x[0] if st.stats_layout[p] == Kind.COMPACT else x
                for p, x in _flatten(stats).items()}
        return full, sync.gather_full(_unflatten(flat), st.state_spec)

    def _local(self, params, batch):
        params = self.state.staging.unstage(params, self.state.param_specs)
        batch = self.call.inner.split_rows(batch)
        if self.source.gathers_blocks:
            out = self.source.loss(params, batch, train=False)
        elif self.call.block_fn is None:
            out = self.call.loss(_flatten(self.gather(params)[0]), batch)
        else:
            out = self._streamed(self._indexable(params), batch)
        return jax.lax.pmean(self.call.output_loss(out), DATA)

    def _indexable(self, params):
        """The stored parameters as :meth:`_streamed` reads them: a worker's compact leaves of
        N-SDP's neurons and heads, whose holders' values it scatters into full layers, whole
        on each of the worker's devices (:meth:`sdp_jax.step.inner.InnerLayout.whole`: jax
        0.10's partitioner fails a scatter from a leaf split over them); the others as
        stored, read one block at a time."""
        st = self.state
        flat = _flatten(params)
        scattered = {p: x for p, x in flat.items() if st.param_layout[p] != Kind.REPLICATED
                     and p in st.layout.leaves
                     and st.layout.leaves[p].form == layout_lib.NEURON}
        return _unflatten({**flat, **self.call.inner.whole(scattered)})

    def _streamed(self, params, batch):
        """The full model with the block runner: each block's parameters fetched from their
        holders when it is reached, so no device stores the full model."""
        st, call = self.state, self.call
        flat, lay, codes = _flatten(params), st.layout, st.param_layout
        kept = {p: x[0] if codes[p] == Kind.PER_WORKER else x
                for p, x in flat.items() if not call.in_block(p)}
        if self.periodic:   # evaluate the holders' average
            kept = {p: jax.lax.pmean(x, DATA) if codes[p] == Kind.PER_WORKER else x
                    for p, x in kept.items()}

        def get(p, g, _):
            code, lf = codes[p], lay.leaves[p]
            if code == Kind.REPLICATED:
                v = jax.lax.dynamic_index_in_dim(flat[p], g, 0, False)
            elif lf.form == layout_lib.KEPT:   # Rw
                v = jax.lax.pmean(jax.lax.dynamic_index_in_dim(flat[p][0], g, 0, False), DATA)
            elif lf.form == layout_lib.STACK:
                if self._blocks.full and not self.periodic:
                    v = jax.lax.dynamic_index_in_dim(flat[p][0], g, 0, False)
                else:
                    v = sync.component_mean({p: flat[p]}, g, self._blocks, DATA)[p]
            else:
                v = jnp.moveaxis(sync.layer_value({p: flat[p]}, {p: self._layers[p]}, g,
                                                  DATA)[p], 0, lf.rule.axis - 1)
            return call.cast(v)

        return call.call(kept, st.spec.n_blocks, get, batch, train=False)

    def step_fn(self):
        """Jitted full-model loss ``(params, batch) -> float32`` (see
        :meth:`sdp_jax.step.SDPStep.eval_step_fn`).

        Raises:
          ValueError: a step with model state or stacked slots."""
        if self.state.state_spec is not None or self.state.stacked_slots:
            raise ValueError("a step with model state or stacked_slots evaluates through "
                             "gather() (its loss updates the state or runs slots): evaluate the "
                             "gathered full model with your own loss.")
        if self._step is None:
            fn = self.placement.map(self._local, (self.state.param_specs, P(DATA)), P())
            self._step = jax.jit(fn)
        return self._step
