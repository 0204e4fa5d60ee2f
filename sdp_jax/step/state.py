"""The train state's layout: how each leaf of the parameters, the optimizer state and the model
state is stored on the mesh (its kind, as the regime decides, :class:`sdp_jax.step.regime.Regime`),
its shapes and partition specs, the pipeline's stage axis and the FSDP shards' rows view. The
conversions between the full model and this layout (init, store, ``full_params``) are
:class:`sdp_jax.step.host.HostForms`.

Layout kinds (:class:`Kind`), per stored leaf (mesh axis ``data``, ``W`` workers):

* ``R`` (:attr:`Kind.REPLICATED`): ``P()`` (always-kept leaves; every parameter under backward
  masking);
* ``C`` (:attr:`Kind.COMPACT`): a global ``[W, ...]`` array sharded ``P('data')``: device ``w``
  stores only its worker's part (parameters and optimizer state under forward masking);
* ``Rw`` (:attr:`Kind.PER_WORKER`): a per-worker copy ``[W, ...]`` of an always-kept leaf
  (periodic parameter averaging, where the workers drift apart between averaging steps);
* ``S`` (:attr:`Kind.SHARDED`, FSDP / ZeRO-3, and the optimizer state of backward masking,
  ZeRO-2): the *full* leaf, each element stored once, in the rows view of :mod:`sdp_jax.sync`
  (``[n]``, ``[L, r]`` or ``[L, Gc, r]``, zero-padded), sharded over ``data`` on its last axis.

With a pipeline (a mesh axis ``stage``) every leaf of the block subtree gains a stage axis
split over ``stage`` (``[W, P, k, ...]`` for ``C``, ``[P, L / P, ...]`` for ``R``, ``[P, ...]``
rows for ``S``); the step drops it inside ``shard_map`` (:meth:`StateLayout.unstage`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax.mesh import DATA, STAGE
from sdp_jax.spec import layout as layout_lib
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step.inner import InnerLayout
from sdp_jax.step.regime import Kind, Regime
from sdp_jax.sync import collectives as sync

_flatten, _unflatten = spec_lib.flatten, spec_lib.unflatten


WORKER_AXIS = (Kind.COMPACT, Kind.PER_WORKER)   # kinds with a leading [W] axis


def shardings(mesh, specs):
    """NamedShardings on ``mesh`` of a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def abstract_state(optimizer, stored: dict, compact_shapes, state_shardings) -> dict:
    """ShapeDtypeStruct tree (with ``state_shardings``) of a train state: the ``stored``
    entries (e.g. ``params``), the optimizer state of the parameters ``compact_shapes`` (the
    tree the optimizer updates) and the int32 step."""
    opt = jax.eval_shape(optimizer.init, compact_shapes)
    shapes = {**stored, "opt_state": opt, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, state_shardings)


def split_moments(opt_state, params_like) -> tuple[list, Any, list[bool]]:
    """``(entries, treedef, flags)``: ``opt_state`` flattened with every parameter-shaped entry
    (a moment, e.g. Adam's ``mu``: a dict of the tree structure of ``params_like``) kept whole,
    and which entries are such moments (the others: counts and the like)."""
    struct = jax.tree.structure(params_like)
    is_m = lambda x: isinstance(x, dict) and jax.tree.structure(x) == struct  # noqa: E731
    entries, tdef = jax.tree.flatten(opt_state, is_leaf=is_m)
    return entries, tdef, [is_m(e) for e in entries]


def map_moments(fn, opt_state, params_like, other=lambda x: x):
    """``opt_state`` with ``fn(moment)`` for each parameter-shaped entry
    (:func:`split_moments`) and ``other(leaf)`` for the rest."""
    entries, tdef, flags = split_moments(opt_state, params_like)
    return tdef.unflatten([fn(e) if m else other(e) for e, m in zip(entries, flags)])


def _is_spec(x) -> bool:
    return isinstance(x, P)


def stage_map(fn, specs, *trees):
    """``fn(i, *leaves)`` for the leaves whose PartitionSpec names ``stage`` at position ``i``;
    any other leaf: the first tree's."""
    def one(s, *xs):
        s = tuple(s)
        return fn(s.index(STAGE), *xs) if STAGE in s else xs[0]
    return jax.tree.map(one, specs, *trees, is_leaf=_is_spec)


class Staging:
    """The pipeline's stage axis of a stored train state: which leaves carry it (the stacked
    block subtree's, on a mesh with an axis ``stage``), and the tree operations across it.

    Args:
      prefix: the stacked block subtree's path when the block runner is used, else None.
      mesh: the run's mesh (``data``, optionally ``stage``).

    Attributes:
      staged: the mesh has an axis ``stage``; stages: its size ``P`` (1 without).
    """

    def __init__(self, prefix, mesh):
        self.prefix = prefix
        self.staged = STAGE in mesh.axis_names
        self.stages = int(mesh.shape[STAGE]) if self.staged else 1

    def in_block(self, p) -> bool:
        """Whether leaf ``p`` is in the stacked block subtree of the block runner."""
        return self.prefix is not None and p[:len(self.prefix)] == self.prefix

    def is_staged(self, p) -> bool:
        """Whether leaf ``p`` is split over the pipeline axis (its stage's blocks only)."""
        return self.staged and self.in_block(p)

    # A leaf split over ``stage`` carries a stage axis at the position of STAGE in its
    # PartitionSpec; inside shard_map the step drops it (each device sees its stage's blocks,
    # the spec's L / P) and puts it back on the way out.
    def unstage(self, tree, specs):
        return stage_map(lambda i, x: jnp.squeeze(x, i), specs, tree) if self.staged else tree

    def restage(self, tree, specs):
        return stage_map(lambda i, x: jnp.expand_dims(x, i), specs, tree) if self.staged \
            else tree

    def take(self, tree, stage: int, specs):
        """Stage ``stage`` of a stored tree (numpy or jax leaves); others unchanged."""
        return stage_map(lambda i, x: x[(slice(None),) * i + (stage,)], specs, tree)

    def per_stage(self, fn, tree, specs, out_specs):
        """``fn`` (on one stage's tree, as without a pipeline) applied per stage and the
        results stacked on the stage axes of ``out_specs``."""
        if not self.staged:
            return fn(tree)
        return self.stack([fn(self.take(tree, s, specs)) for s in range(self.stages)],
                          out_specs)

    @staticmethod
    def stack(parts: list, specs):
        """Per-stage trees stacked on the stage axes of ``specs`` (other leaves: stage 0's)."""
        return stage_map(lambda i, *xs: jnp.stack(xs, i), specs, *parts)


class StateLayout:
    """The layout of one run's train state ``{params, opt_state, step[, stats]}``.

    Args:
      spec: the run's spec; optimizer: the optax transformation (for the optimizer state's
        structure); mesh: the run's mesh (``data``, optionally ``stage``).
      prefix: the stacked block subtree's path when the block runner is used, else None.
      regime: the step's :class:`sdp_jax.step.regime.Regime` (each leaf's kind: FSDP puts every
        parameter in ``S``, periodic parameter averaging always-kept ones in ``Rw``).
      state_spec: the spec of the model state (``stats``), or None.
      stacked_slots: the loss takes list-form slots stacked as stored.

    Attributes:
      param_layout / compact_layout: {path: :class:`Kind`} of the parameters / of the
        optimizer's parameters (compact, or ``S`` under FSDP and backward masking);
      param_specs, param_shapes, compact_specs, compact_shapes, opt_specs, state_specs
        (and ``stats_specs``, ``stats_shapes`` with model state): nested trees.
    """

    def __init__(self, spec: spec_lib.SDPSpec, optimizer, mesh, *, prefix, regime: Regime,
                 state_spec: spec_lib.SDPSpec | None, stacked_slots: bool):
        self.spec, self.optimizer, self.mesh, self.prefix = spec, optimizer, mesh, prefix
        self.regime, self.fsdp, self.periodic = regime, regime.fsdp, regime.periodic
        self.state_spec, self.stacked_slots = state_spec, stacked_slots
        self.staging = Staging(prefix, mesh)
        self.staged, self.stages = self.staging.staged, self.staging.stages
        self.layout = layout_lib.of(spec)
        self.inner = InnerLayout(spec, *regime.inner)
        self.full_shapes = {p: ((self.stages * sh[0],) + tuple(sh[1:]) if self.staging.is_staged(p)
                                else sh) for p, sh in spec.shapes.items()}
        # The optimizer works on shards (S) under FSDP and under backward masking, whose every
        # worker keeps the full model: ZeRO-2 (each device updates 1/W of every masked leaf; an
        # elementwise optimizer such as AdamW). Backward masking keeps always-kept leaves
        # outside the blocks whole (R: updated alike on every worker, e.g. the pipeline's
        # projectors, which the Stiefel optimizer needs as matrices).
        self.sharded_update = regime.sharded_update
        self.rows = self._row_tables() if self.sharded_update else {}
        if self.sharded_update:   # 1 / holders of every entry (broadcastable), float32
            self.inv_holders = {
                p: np.float32(1.0 / spec.workers) if spec.leaf_mask(p) is None
                else (1.0 / np.maximum(spec.leaf_mask(p).sum(0), 1)).astype(np.float32)
                for p in spec.shapes}
        lay = self.layout
        p_keys = spec.shapes if regime.sharded_update else lay.stored_shapes
        o_keys = spec.shapes if self.sharded_update else lay.stored_shapes
        self.param_layout = {p: self._kind(p, optimizer=False) for p in p_keys}
        self.compact_layout = {p: self._kind(p, optimizer=True) for p in o_keys}
        self.param_specs, self.param_shapes = self.struct(self.param_layout)
        self.compact_specs, self.compact_shapes = self.struct(self.compact_layout)
        self.opt_specs = layout_lib.opt_state_specs(optimizer, self.compact_specs,
                                                    self.compact_shapes)
        self.state_specs = {"params": self.param_specs, "opt_state": self.opt_specs,
                            "step": P()}
        if state_spec is not None:
            self.stats_layout, self.stats_specs, self.stats_shapes = self._state_struct()
            self.state_specs["stats"] = self.stats_specs

    def _kind(self, p, optimizer: bool) -> Kind:
        """Leaf ``p``'s layout kind, as the regime decides it (:meth:`Regime.kind`)."""
        return self.regime.kind(
            optimizer=optimizer,
            in_blocks_or_masked=self.staging.in_block(p) or self.spec.leaf_mask(p) is not None,
            stored_compact=not self.regime.sharded_update and self.layout.stored_compact(p))

    # ------------------------------------------------------------------ shapes and specs
    def _row_tables(self) -> dict:
        """The rows view of every leaf in ``S`` (:class:`sdp_jax.spec.layout.HolderTables`; None
        for a leaf outside the block subtree, stored flat)."""
        lay, spec = self.layout, self.spec
        if self.prefix is None:   # no block runner: every leaf stored flat
            return dict.fromkeys(spec.shapes)
        L, W = spec.n_blocks, spec.workers
        every = layout_lib.HolderTables(np.tile(np.arange(L), (W, 1, 1)), np.full((1, L), W),
                                        0, False)
        out = {}
        for p in spec.shapes:
            if not self.staging.in_block(p):
                out[p] = None
            elif lay.leaves[p].form == layout_lib.KEPT:
                out[p] = every    # held by all, but stacked per block (e.g. N-SDP norms)
            else:
                out[p] = lay.holder_tables(p)
        return out

    def _shard_shape(self, p) -> tuple:
        W, full_shape = self.spec.workers, self.spec.shapes[p]
        t = self.rows[p]
        if t is None:
            return (W * -(-int(np.prod(full_shape)) // W),)
        rows = (full_shape[0],) if not t.grouped else (full_shape[0], full_shape[t.axis])
        return rows + (W * t.shard_len(full_shape),)

    def struct(self, codes: dict):
        """(PartitionSpecs, ShapeDtypeStructs with shardings), nested, of a tree stored in the
        layout ``codes`` ({path: :class:`Kind`})."""
        W, lay = self.spec.workers, self.layout
        specs, shapes = {}, {}
        for p, c in codes.items():
            if c == Kind.SHARDED:
                shape = self._shard_shape(p)
                inner = self.inner.rows_axes(shape[-1] // W)
                axes = [None] * (len(shape) - 1) + [(DATA, *inner) if inner else DATA]
            else:
                base = lay.stored_shapes.get(p, self.spec.shapes.get(p))
                if c == Kind.REPLICATED and p in self.spec.shapes:
                    base = self.spec.shapes[p]
                shape = ((W,) if c in WORKER_AXIS else ()) + tuple(base)
                axes = [] if c == Kind.REPLICATED else [DATA]
                if self.inner.active:   # a worker's own devices (sdp_jax.step.inner)
                    axes += self.inner.axes(p, tuple(base))
            if self.staging.is_staged(p):   # [W, P, ...] for C / Rw, [P, ...] for R / S
                i = 1 if c in WORKER_AXIS else 0
                shape = shape[:i] + (self.stages,) + shape[i:]
                axes = axes[:i] + [STAGE] + axes[i:]
            specs[p] = P(*axes)
            shapes[p] = jax.ShapeDtypeStruct(shape, lay.dtype(p),
                                             sharding=NamedSharding(self.mesh, specs[p]))
        return _unflatten(specs), _unflatten(shapes)

    def _state_struct(self):
        """Kinds, partition specs and shapes of the model state (``stats``): stored like
        forward-masked parameters (replicated full leaves under backward masking)."""
        sspec, W = self.state_spec, self.spec.workers
        lay = layout_lib.of(sspec)
        if self.spec.backward:
            codes = {p: Kind.REPLICATED for p in sspec.shapes}
            base = dict(sspec.shapes)
        else:
            codes = {p: Kind.COMPACT if lay.stored_compact(p) else Kind.REPLICATED
                     for p in lay.stored_shapes}
            base = dict(lay.stored_shapes)
        specs = {p: P(DATA) if c == Kind.COMPACT else P() for p, c in codes.items()}
        shapes = {p: jax.ShapeDtypeStruct(((W,) if c == Kind.COMPACT else ()) + tuple(base[p]),
                                          lay.dtype(p),
                                          sharding=NamedSharding(self.mesh, specs[p]))
                  for p, c in codes.items()}
        return codes, _unflatten(specs), _unflatten(shapes)

    def shardings(self, specs=None):
        """NamedShardings of ``specs`` (default: the state's)."""
        return shardings(self.mesh, self.state_specs if specs is None else specs)

    def abstract_state(self) -> dict:
        """ShapeDtypeStruct tree (with shardings) of the train state, for compile and restore."""
        stored = {"params": self.param_shapes}
        if self.state_spec is not None:
            stored["stats"] = self.stats_shapes
        return abstract_state(self.optimizer, stored, self.compact_shapes, self.shardings())

    def per_device_param_count(self) -> int:
        """Parameter elements stored per device (compact where the layout is compact; a 1/W
        shard under FSDP, padding included; with a pipeline, the device's stage's blocks; a
        leaf's share over a worker's own devices, :mod:`sdp_jax.step.inner`)."""
        total = 0
        for s in jax.tree.leaves(self.param_shapes):
            names = [a for e in s.sharding.spec if e is not None
                     for a in (e if isinstance(e, tuple) else (e,))]
            total += int(np.prod(s.shape)) // int(np.prod([self.mesh.shape[a] for a in names]))
        return total

    # ------------------------------------------------------------------ shards (S)
    def rows_len(self, p) -> int:
        t, shape = self.rows[p], self.spec.shapes[p]
        return int(np.prod(shape)) if t is None else t.row_len(shape)

    def to_shards(self, p, x):
        """Full leaf -> layout ``S`` (rows view, padded to a multiple of W)."""
        W, t = self.spec.workers, self.rows[p]
        rows = x.reshape(-1) if t is None else sync.to_rows(x, t)
        if t is not None and not t.grouped:
            rows = rows[0]
        return sync.pad_last(rows, W * -(-rows.shape[-1] // W))

    def from_shards(self, p, x):
        """Inverse of :meth:`to_shards` (the padding is dropped)."""
        shape, t = self.spec.shapes[p], self.rows[p]
        if t is None:
            return x[:int(np.prod(shape))].reshape(shape)
        return sync.from_rows(x, shape, t)

    def my_shards(self, full: dict) -> dict:
        """Backward masking, inside ``shard_map``: full replicated leaves (flat) -> this
        device's piece of each in layout ``S`` (the parameters its optimizer updates)."""
        my = sync.worker_index(DATA)
        out = {}
        for p, x in full.items():
            if self.compact_layout[p] == Kind.REPLICATED:   # updated whole on every worker
                out[p] = x
                continue
            rows = self.to_shards(p, x)
            rs = rows.shape[-1] // self.spec.workers
            out[p] = jax.lax.dynamic_slice_in_dim(rows, my * rs, rs, rows.ndim - 1)
        return out

    def zero_embedded(self, local: dict) -> dict:
        """Inside ``shard_map``: a worker's local leaves (flat, every leaf of the layout) ->
        full-size leaves, zero where the worker holds nothing."""
        zeros = {p: jnp.zeros(sh, local[p].dtype if p in local else jnp.float32)
                 for p, sh in self.spec.shapes.items()}
        return dict(self.layout.embed(_unflatten(zeros), local, sync.worker_index(DATA)))

    # ------------------------------------------------------------------ a worker's view
    def strip(self, params: dict) -> dict:
        """Stored leaves -> this worker's view, flat (the leading per-worker axis of ``C`` /
        ``Rw`` leaves dropped)."""
        return {p: x[0] if self.param_layout[p] in WORKER_AXIS else x
                for p, x in _flatten(params).items()}

    def lead(self, local: dict, codes: dict) -> dict:
        """Local leaves (flat) -> the stored tree (list-form slots stacked, a leading worker
        axis of size 1 on ``C`` / ``Rw`` leaves)."""
        if not self.sharded_update and not self.stacked_slots:
            local = self.layout.to_stored(local)
        return _unflatten({p: x[None] if codes[p] in WORKER_AXIS else x
                           for p, x in local.items()})

    def to_local(self, stored: dict, lay=None) -> dict:
        """A worker's stored leaves (flat, no worker axis) -> the form ``loss_fn`` sees."""
        lay = lay or self.layout
        return stored if self.stacked_slots else lay.to_local(stored)

    def state_local(self, stats):
        """The model state as ``loss_fn`` sees it (flat; None without a state)."""
        if self.state_spec is None:
            return None
        flat = _flatten(stats)
        if self.spec.backward:
            return flat
        flat = {p: x[0] if self.stats_layout[p] == Kind.COMPACT else x
                for p, x in flat.items()}
        return self.to_local(flat, layout_lib.of(self.state_spec))
