"""Full and compact (pruned) parameters of an :class:`sdp_jax.spec.SDPSpec`.

A worker's *local* parameters in the compact layout (forward masking, docs/design.md invariant 4):

* an always-kept leaf: the full leaf;
* a stacked block leaf ``[L, ...]``: its ``k = C * L`` held blocks ``[k, ...]`` in depth order;
* list-form blocks ``blocks/0 .. blocks/L-1``: ``k`` blocks ``blocks/0 .. blocks/k-1``, slot ``j``
  holding global block ``held[w, j]`` (a model built with ``k`` blocks runs them); blocks of a
  ``Blocks(..., pad=True)`` rule zero-padded to the stack's largest shape;
* a neuron leaf: narrowed to the held indices along its component axis (per layer).

Every worker's local tree has the same structure and shapes (equal row sums of the masks), so
the *stored* layout is one global array ``[W, *local shape]`` per compact leaf, sharded
``P('data')``, and one replicated array per always-kept leaf. List-form blocks are stored
stacked, ``{block path}/slots/{leaf path in a block}`` ``[W, k, ...]``, so the optimizer updates
every slot with one operation and the holders of a block stay bitwise equal.

:class:`Layout` maps between full parameters, a worker's local view and the stored layout, and
gives the static tables that the collectives of :mod:`sdp_jax.sync` use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from sdp_jax.spec import sdp_spec as spec_lib

KEPT, STACK, SLOT, NEURON = "kept", "stack", "slot", "neuron"


@dataclasses.dataclass(frozen=True)
class Local:
    """One leaf of a worker's local (compact) tree.

    form: ``kept`` | ``stack`` (stacked block leaf) | ``slot`` (a leaf of list-form block slot
    ``slot``; ``rel`` is its path inside the block) | ``neuron``. full: the full leaf's path
    (for ``slot``: block 0's). rule: the spec's rule (None for kept).
    """

    form: str
    full: tuple
    rule: Any = None
    slot: int = 0
    rel: tuple = ()


_flatten = spec_lib.flatten
unflatten = spec_lib.unflatten


class HolderTables:
    """Static tables of one masked leaf in the rows view (host numpy).

    Args:
      indices: int32 ``[W, Lg, kc]``: the components each worker holds in each group, ascending.
      counts: int32 ``[Lg, Gc]``: holders of every component (multiplicity ``m_g``).
      axis: component axis of the *full* leaf (0 for block leaves, whose stack axis is the
        component axis; the layer axis is 0 for neuron leaves).
      grouped: False for block leaves (``Lg = 1``), True for neuron leaves (``Lg = L``).

    Attributes:
      full: every worker holds every component in order (DDP): plain collectives suffice.
      held: bool ``[W, Lg, Gc]``.
    """

    def __init__(self, indices: np.ndarray, counts: np.ndarray, axis: int, grouped: bool):
        self.indices = np.asarray(indices, np.int32)
        self.counts = np.asarray(counts, np.int32)
        self.axis, self.grouped = int(axis), bool(grouped)
        self.workers, self.groups, self.kc = self.indices.shape
        self.size = self.counts.shape[1]
        self.held = np.zeros((self.workers, self.groups, self.size), bool)
        for w in range(self.workers):
            for g in range(self.groups):
                self.held[w, g, self.indices[w, g]] = True
        self.full = bool(self.held.all())

    def row_len(self, full_shape) -> int:
        """``r``: elements per component of a leaf of this full shape."""
        n = int(np.prod(full_shape))
        return n // (full_shape[0] if not self.grouped else full_shape[0] * full_shape[self.axis])

    def shard_len(self, full_shape) -> int:
        """``rs = ceil(r / W)``: elements per component on each device."""
        return -(-self.row_len(full_shape) // self.workers)


class Layout:
    """The compact layout of a spec (static, host-side).

    Attributes:
      spec: the :class:`sdp_jax.spec.SDPSpec`.
      leaves: {local path: :class:`Local`} in the compact layout.
    """

    def __init__(self, spec: spec_lib.SDPSpec):
        self.spec = spec
        self.W = spec.workers
        self.leaves: dict[tuple, Local] = {}
        for p in spec.shapes:
            r = spec.rule(p)
            st = spec.stacks.get(r.kind) if r is not None else None
            if r is None:
                self.leaves[p] = Local(KEPT, p)
            elif st is not None and r.block is None:
                self.leaves[p] = Local(STACK, p, r)
            elif st is not None:
                if r.block != 0:
                    continue
                rel = p[len(st.path) + 1:]
                for j in range(spec.kinds[r.kind].k):
                    self.leaves[st.path + (st.block_key(j),) + rel] = Local(SLOT, p, r, j, rel)
            else:
                self.leaves[p] = Local(NEURON, p, r)
        self._tables: dict = {}
        self.stored_shapes: dict[tuple, tuple] = {}   # stored path -> per-worker shape
        self.slot_leaves: dict[tuple, tuple] = {}   # stored slots path -> slot 0's local path
        for lp, lf in self.leaves.items():
            if lf.form == SLOT:
                if lf.slot == 0:
                    self.stored_shapes[self.slots_path(lf)] = (
                        (spec.kinds[lf.rule.kind].k,) + self.local_shape(lp))
                    self.slot_leaves[self.slots_path(lf)] = lp
            else:
                self.stored_shapes[lp] = self.local_shape(lp)

    def slots_path(self, lf: Local) -> tuple:
        """Stored path of the stacked slots of a list-form block leaf."""
        return self.spec.stacks[lf.rule.kind].path + ("slots",) + lf.rel

    def to_stored(self, local: dict) -> dict:
        """A worker's local leaves (flat) -> its stored leaves (list-form slots stacked)."""
        out, slots = {}, {}
        for lp, x in local.items():
            lf = self.leaves[lp]
            if lf.form == SLOT:
                slots.setdefault(self.slots_path(lf), {})[lf.slot] = x
            else:
                out[lp] = x
        for sp, by_slot in slots.items():
            out[sp] = jnp.stack([by_slot[j] for j in range(len(by_slot))])
        return out

    def to_local(self, stored: dict) -> dict:
        """Inverse of :meth:`to_stored` (flat dicts)."""
        return {lp: (stored[self.slots_path(lf)][lf.slot] if lf.form == SLOT else stored[lp])
                for lp, lf in self.leaves.items()}

    def dtype(self, p: tuple):
        """The dtype of a stored, local or full leaf path (a stack of slots: block 0's)."""
        if p in self.spec.dtypes:
            return self.spec.dtypes[p]
        return self.spec.dtypes[self.leaves[self.slot_leaves.get(p, p)].full]

    def stored_compact(self, sp: tuple) -> bool:
        """Whether a stored leaf is per worker (``[W, ...]``)."""
        return sp not in self.leaves or self.compact(sp)

    # ------------------------------------------------------------------ shapes
    def local_shape(self, lp: tuple) -> tuple:
        """Per-worker shape of a local leaf (no worker axis)."""
        lf = self.leaves[lp]
        return self.spec.compact_shape(lf.full)

    def compact(self, lp: tuple) -> bool:
        """Whether a local leaf is stored per worker (``[W, ...]``, sharded ``P('data')``)."""
        return self.leaves[lp].form != KEPT

    def indices(self, lf: Local) -> np.ndarray:
        """int32 ``[W, ...]``: every worker's held indices along a neuron leaf's component
        axis (:meth:`sdp_jax.spec.SDPSpec.indices` of each worker, stacked)."""
        return np.stack([self.spec.indices(lf.rule, w) for w in range(self.W)])

    def _all_blocks(self, flat: dict, lf: Local):
        """The ``L`` list-form blocks' leaves at ``lf.rel``, stacked ``[L, ...]`` (each
        zero-padded to the slot shape)."""
        st = self.spec.stacks[lf.rule.kind]
        shape = st.union[lf.rel]
        return jnp.stack([_pad(flat[self.block_full(lf, g)], shape) for g in range(st.n)])

    def block_full(self, lf: Local, g) -> tuple:
        """Full path of a list-form block leaf ``lf`` in block ``g``."""
        st = self.spec.stacks[lf.rule.kind]
        return st.path + (st.block_key(g),) + lf.rel

    def unpad(self, lf: Local, g, x):
        """A slot-shaped value of list-form block ``g`` -> that block's own shape."""
        shape = self.spec.shapes[self.block_full(lf, g)]
        return x[tuple(slice(0, n) for n in shape)]

    # ------------------------------------------------------------------ prune / unprune
    def prune(self, full: Any, w, take=None) -> dict:
        """Worker ``w``'s local leaves ``{local path: array}`` from full parameters (nested
        dict or flat ``{path: array}``); ``w`` may be traced. ``take(path, x, idx, fn)``, when
        given, runs ``fn(x, idx)``, the pruning of full leaf ``path`` on its component axis
        by the held indices ``idx`` (e.g. on each device's own part of a sharded leaf,
        :meth:`sdp_jax.step.inner.InnerLayout.take`)."""
        take = take or (lambda p, x, idx, fn: fn(x, idx))
        flat = full if _is_flat(full) else _flatten(full)
        spec, out = self.spec, {}
        stacks = {}
        for lp, lf in self.leaves.items():
            if lf.form == KEPT:
                out[lp] = flat[lf.full]
            elif lf.form == STACK:
                out[lp] = flat[lf.full][jnp.asarray(spec.kinds[lf.rule.kind].held)[w]]
            elif lf.form == SLOT:
                key = self.slots_path(lf)
                if key not in stacks:
                    held = jnp.asarray(spec.kinds[lf.rule.kind].held)[w]
                    stacks[key] = self._all_blocks(flat, lf)[held]
                out[lp] = stacks[key][lf.slot]
            else:
                idx = jnp.asarray(self.indices(lf))[w]
                a = lf.rule.axis
                if lf.rule.layer is None:
                    fn = jax.vmap(lambda xl, il, a=a: jnp.take(xl, il, axis=a - 1))
                else:
                    fn = lambda x, i, a=a: jnp.take(x, i, axis=a)  # noqa: E731
                out[lp] = take(lf.full, flat[lf.full], idx, fn)
        return out

    def stored(self, full: Any) -> dict:
        """Full parameters -> the stored layout: ``[W, ...]`` per compact leaf (every worker's
        local leaf stacked), the full leaf per always-kept leaf. Nested dict."""
        per = [self.to_stored(self.prune(full, w)) for w in range(self.W)]
        return unflatten({sp: (jnp.stack([x[sp] for x in per]) if self.stored_compact(sp)
                               else per[0][sp]) for sp in self.stored_shapes})

    def embed(self, full: Any, local: dict, w) -> dict:
        """Full parameters with worker ``w``'s local values written over their components
        (flat ``{path: array}``); gradients flow to ``local`` only where it is used."""
        flat = dict(full if _is_flat(full) else _flatten(full))
        spec = self.spec
        slots: dict = {}
        for lp, lf in self.leaves.items():
            x = local[lp]
            if lf.form == KEPT:
                flat[lf.full] = x
            elif lf.form == STACK:
                held = jnp.asarray(spec.kinds[lf.rule.kind].held)[w]
                flat[lf.full] = flat[lf.full].at[held].set(x)
            elif lf.form == SLOT:
                slots.setdefault(self.slots_path(lf), {})[lf.slot] = (lf, x)
            else:
                idx = jnp.asarray(self.indices(lf))[w]
                a = lf.rule.axis
                if lf.rule.layer is None:
                    def put(xl, il, vl, a=a):
                        return jnp.moveaxis(jnp.moveaxis(xl, a - 1, 0).at[il].set(
                            jnp.moveaxis(vl, a - 1, 0)), 0, a - 1)
                    flat[lf.full] = jax.vmap(put)(flat[lf.full], idx, x)
                else:
                    flat[lf.full] = jnp.moveaxis(jnp.moveaxis(flat[lf.full], a, 0).at[idx].set(
                        jnp.moveaxis(x, a, 0)), 0, a)
        for by_slot in slots.values():
            lf0 = by_slot[0][0]
            bt = spec.kinds[lf0.rule.kind]
            stack = self._all_blocks(flat, lf0).at[jnp.asarray(bt.held)[w]].set(
                jnp.stack([by_slot[j][1] for j in range(bt.k)]))
            for g in range(stack.shape[0]):
                flat[self.block_full(lf0, g)] = self.unpad(lf0, g, stack[g])
        return flat

    def unprune(self, stored: Any, average: bool = False) -> dict:
        """Stored layout -> full parameters (host numpy), every component taken from its first
        holder (holders agree after gradient averaging), or with ``average`` the mean of its
        holders' values (periodic parameter averaging, between averaging steps; computed in
        float64 and cast back). Nested dict like the spec's parameters."""
        flat = {sp: np.asarray(jax.device_get(x)) for sp, x in _flatten(stored).items()}
        spec, out = self.spec, {}
        for lp, lf in self.leaves.items():
            if lf.form == KEPT:
                out[lf.full] = flat[lp]
                continue
            t = spec.kinds[lf.rule.kind]
            if lf.form == STACK or (lf.form == SLOT and lf.slot == 0):
                x = flat[self.slots_path(lf) if lf.form == SLOT else lp]    # [W, k, ...]
                per_block = self._blocks_of(x, t, average)                  # L arrays
                if lf.form == STACK:
                    out[lf.full] = np.stack(per_block)
                else:
                    for g, v in enumerate(per_block):
                        out[self.block_full(lf, g)] = self.unpad(lf, g, v)
            elif lf.form == NEURON:
                out[lf.full] = self._neurons_of(flat[lp], lf, average)
        return unflatten({p: out[p] for p in spec.shapes})

    @staticmethod
    def _blocks_of(x: np.ndarray, t, average: bool) -> list:
        """Block ``g``'s value from a stored stack ``x`` ``[W, k, ...]`` (worker ``w`` holds
        ``g`` in slot ``t.slot[w, g]``): its first holder's, or its holders' mean."""
        held = t.masks[0]                                                   # [W, L]
        out = []
        for g in range(held.shape[1]):
            ws = np.flatnonzero(held[:, g])
            vals = x[ws, t.slot[ws, g]]
            out.append(vals.astype(np.float64).mean(0).astype(x.dtype) if average else vals[0])
        return out

    def _neurons_of(self, x: np.ndarray, lf: Local, average: bool) -> np.ndarray:
        """A neuron leaf's full value from its stored ``[W, ...]`` compact form: each
        component from its first holder, or its holders' mean."""
        full = np.zeros(self.spec.shapes[lf.full], np.float64 if average else x.dtype)
        count = np.zeros(full.shape, np.int64)
        a = lf.rule.axis
        workers = range(self.W) if average else range(self.W - 1, -1, -1)  # first holder wins
        for w in workers:
            idx = self.spec.indices(lf.rule, w)
            if lf.rule.layer is None:
                fm, cm, xm = (np.moveaxis(y, a, 1) for y in (full, count, x[w]))
                for layer in range(full.shape[0]):
                    if average:
                        fm[layer, idx[layer]] += xm[layer]
                        cm[layer, idx[layer]] += 1
                    else:
                        fm[layer, idx[layer]] = xm[layer]
            elif average:
                np.moveaxis(full, a, 0)[idx] += np.moveaxis(x[w], a, 0)
                np.moveaxis(count, a, 0)[idx] += 1
            else:
                np.moveaxis(full, a, 0)[idx] = np.moveaxis(x[w], a, 0)
        return (full / np.maximum(count, 1)).astype(x.dtype) if average else full

    # ------------------------------------------------------------------ tables
    def holder_tables(self, lp: tuple):
        """:class:`HolderTables` of a compact local leaf in its rows view (list
        block slots: of the stack of all ``k`` slots of that relative path; ``lp`` may also be
        that stack's stored path)."""
        lf = self.leaves[self.slot_leaves.get(lp, lp)]
        key = self.slots_path(lf) if lf.form == SLOT else lp
        if key not in self._tables:
            t = self.spec.kinds[lf.rule.kind]
            if lf.form in (STACK, SLOT):
                self._tables[key] = HolderTables(t.held[:, None, :], t.counts[None, :],
                                                      0, False)
            else:
                idx = self.indices(lf)
                counts = np.repeat(t.counts, lf.rule.expand, axis=1)
                if lf.rule.layer is None:
                    self._tables[key] = HolderTables(idx, counts, lf.rule.axis, True)
                else:
                    self._tables[key] = HolderTables(
                        idx[:, None, :], counts[lf.rule.layer][None], lf.rule.axis + 1, True)
        return self._tables[key]

    def inverse_counts(self, lp: tuple) -> np.ndarray:
        """float32 ``[W, ...]`` broadcastable to a compact local leaf: ``1 / m`` of the
        component each of its entries belongs to (so a psum of weighted squares counts every
        component once). ``lp`` may also be the stored path of a stack of slots."""
        if lp in self.slot_leaves:
            t = self.spec.kinds[self.leaves[self.slot_leaves[lp]].rule.kind]
            shape = self.stored_shapes[lp]
            c = t.counts[t.held]                                            # [W, k]
            return (1.0 / c).reshape((self.W, shape[0]) + (1,) * (len(shape) - 1)).astype(
                np.float32)
        lf = self.leaves[lp]
        t = self.spec.kinds[lf.rule.kind]
        shape = self.local_shape(lp)
        if lf.form == STACK:
            c = t.counts[t.held]                                            # [W, k]
            return (1.0 / c).reshape((self.W, shape[0]) + (1,) * (len(shape) - 1)).astype(
                np.float32)
        if lf.form == SLOT:
            c = t.counts[t.held[:, lf.slot]]
            return (1.0 / c).reshape((self.W,) + (1,) * len(shape)).astype(np.float32)
        idx = self.indices(lf)
        counts = np.repeat(t.counts, lf.rule.expand, axis=1)                 # [Lg, G * e]
        a = lf.rule.axis
        if lf.rule.layer is None:
            c = np.stack([np.take_along_axis(counts, idx[w], axis=1) for w in range(self.W)])
            view = (self.W, shape[0]) + (1,) * (a - 1) + (shape[a],) + (1,) * (len(shape) - a - 1)
        else:
            c = counts[lf.rule.layer][idx]                                    # [W, k * e]
            view = (self.W,) + (1,) * a + (shape[a],) + (1,) * (len(shape) - a - 1)
        return (1.0 / c).reshape(view).astype(np.float32)


def opt_state_specs(optimizer, params_specs, params_shapes):
    """Partition specs of ``optimizer``'s state for parameters with ``params_specs``: each
    parameter-shaped entry (moments) takes its parameter's spec, anything else (counts) is
    replicated."""
    abstract_opt = jax.eval_shape(optimizer.init, params_shapes)
    masked = optax.MaskedNode   # a leaf another transformation of optax.partition updates
    return optax.tree_map_params(optimizer, lambda v, spec: v if isinstance(v, masked) else spec,
                                 abstract_opt, params_specs,
                                 transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, (P, masked)))


def _pad(x, shape):
    """Zero-pad ``x`` at the end of each axis to ``shape``."""
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape)])


def _is_flat(tree) -> bool:
    return isinstance(tree, dict) and bool(tree) and all(isinstance(k, tuple) for k in tree)


def of(spec: spec_lib.SDPSpec) -> Layout:
    """The (cached) :class:`Layout` of a spec."""
    lay = getattr(spec, "_layout", None)
    if lay is None:
        lay = Layout(spec)
        spec._layout = lay
    return lay
