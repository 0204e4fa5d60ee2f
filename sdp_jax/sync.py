"""Collectives for SDP averaging, used inside ``jax.shard_map`` over the mesh axis ``data``.

Overlap averaging is a masked mean (DESIGN.md invariant 2; Singh et al., arXiv 2507.09029,
Sec. 3, Eq. for the SDP update): for every component ``g`` the averaged value is

    x_g <- sum_{w holds g} x_g^(w) / m_g,        m_g = number of workers holding g,

computed as ``psum(mask * x, 'data') / count`` with ``count`` host-known and static. Parameters every
worker holds (always-kept) use the plain mean over all ``W`` workers.

Two layouts exist:
* *full* layout: every device has a full-size array whose leading axis indexes components, and a
  bool mask says which entries it holds (:func:`masked_mean`). Always correct; the reference.
* *compact* layout: every device stores only its ``k`` held components, ``[1, k, ...]`` locally
  (a global ``[W, k, ...]`` array sharded ``P('data')``), with static tables from
  :mod:`sdp_jax.masks` mapping slots to global components (:func:`compact_masked_mean`).

Everything here must run inside ``jax.shard_map`` with the named axis bound.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

AXIS = "data"


def to_varying(tree: Any, axis: str = AXIS) -> Any:
    """Mark values that are invariant over ``axis`` (every leaf must be) as varying (``lax.pcast(..., to='varying')``).

    Taking ``jax.grad`` with respect to a parameter that enters ``shard_map`` replicated (``P()``)
    returns the gradient already *summed* over the axis (the transpose of the implicit broadcast);
    casting the parameter to varying first gives each worker its own local gradient, which the
    explicit averaging below then combines exactly once (DESIGN.md invariant 1).
    """
    if hasattr(lax, "pcast"):
        return jax.tree.map(lambda x: lax.pcast(x, axis, to="varying"), tree)
    return jax.tree.map(lambda x: lax.pvary(x, axis), tree)  # older JAX


def worker_index(axis: str = AXIS):
    """This device's worker index along ``axis`` (int32 scalar)."""
    return lax.axis_index(axis)


def masked_mean(x: jax.Array, mask: np.ndarray, axis: str = AXIS) -> jax.Array:
    """Reference masked mean over holders, full layout.

    Args:
      x: this worker's full-size values ``[G, ...]`` (entries it does not hold are ignored).
      mask: static numpy bool ``[W, G]`` mask matrix.
      axis: mesh axis name of the workers.

    Returns:
      ``[G, ...]``: for each component the mean over the workers holding it; the same on every
      worker (invariant over ``axis``).

    Raises:
      ValueError: if a component is held by no worker (the mean would divide by zero).
    """
    mask = np.asarray(mask, dtype=bool)
    counts = mask.sum(0)
    if (counts == 0).any():
        raise ValueError(f"components {np.flatnonzero(counts == 0).tolist()} are held by no worker.")
    bshape = (mask.shape[1],) + (1,) * (x.ndim - 1)
    mine = jnp.asarray(mask)[worker_index(axis)].reshape(bshape)
    total = lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis)
    return total / jnp.asarray(counts, x.dtype).reshape(bshape)


class CompactTables:
    """Static index tables of a mask matrix for the compact layout (host numpy, hashed by id).

    Attributes:
      mask: bool [W, G]; held: int32 [W, k]; slot: int32 [W, G] (-1 = not held);
      counts: int32 [G] multiplicities; full: True when every worker holds every component in
      depth order (then compact == full and averaging is a plain mean).
    """

    def __init__(self, mask: np.ndarray):
        from sdp_jax import masks as _masks
        self.mask = np.asarray(mask, dtype=bool)
        self.held = _masks.held_table(self.mask)
        self.slot = _masks.slot_table(self.mask)
        self.counts = _masks.multiplicities(self.mask)
        self.workers, self.components = self.mask.shape
        self.k = self.held.shape[1]
        self.full = bool(self.mask.all())


def _my_slot(tables: CompactTables, g, axis: str):
    s = jnp.asarray(tables.slot)[worker_index(axis), g]
    return s >= 0, jnp.maximum(s, 0)


def component_mean(tree: Any, g, tables: CompactTables, axis: str = AXIS) -> Any:
    """Mean over the holders of component ``g`` of their compact copies.

    Args:
      tree: pytree of compact leaves, local shape ``[1, k, ...]``.
      g: int32 scalar (may be traced), global component index.
    Returns:
      pytree of ``[...]`` (one component, no stack axis), invariant over ``axis``.
    """
    held, s = _my_slot(tables, g, axis)
    count = jnp.asarray(tables.counts)[g]

    def one(x):
        v = lax.dynamic_index_in_dim(x[0], s, 0, keepdims=False)
        return jnp.where(held, v, jnp.zeros_like(v))

    total = lax.psum(jax.tree.map(one, tree), axis)
    return jax.tree.map(lambda t: t / count.astype(t.dtype), total)


def compact_masked_mean(tree: Any, tables: CompactTables, axis: str = AXIS, *,
                        method: str = "auto") -> Any:
    """Average compact per-worker values over the holders of each component.

    Args:
      tree: pytree of leaves with local shape ``[1, k, ...]`` (varying over ``axis``).
      tables: :class:`CompactTables` of the mask in use.
      method: ``"auto"`` (plain mean when every worker holds every component, else
        ``"blockwise"``), ``"blockwise"`` (loop over the ``G`` components, one component-sized
        psum each: temporary memory of one component) or ``"reference"`` (scatter into a
        full-size ``[G, ...]`` buffer, one psum, gather back: the DESIGN.md reference).

    Returns:
      pytree like ``tree``: slot ``j`` of worker ``w`` holds the mean over all holders of
      component ``held[w, j]``.

    Communication: every method moves ``G`` components' bytes per device through all-reduce (as
    many as DDP); moving only held bytes is future work (issue 4).
    """
    if method == "auto":
        method = "mean" if tables.full else "blockwise"
    if method == "mean":
        if not tables.full:
            raise ValueError("method='mean' is only valid when every worker holds every component.")
        return jax.tree.map(lambda x: lax.pmean(x, axis), tree)
    if method == "reference":
        held = jnp.asarray(tables.held)[worker_index(axis)]

        def ref(x):
            buf = jnp.zeros((tables.components,) + x.shape[2:], x.dtype).at[held].set(x[0])
            total = lax.psum(buf, axis)
            avg = total / jnp.asarray(tables.counts, x.dtype).reshape(
                (-1,) + (1,) * (x.ndim - 2))
            return avg[held][None]
        return jax.tree.map(ref, tree)
    if method != "blockwise":
        raise ValueError(f"unknown averaging method {method!r}; use auto, blockwise or reference.")

    def body(g, acc):
        held, s = _my_slot(tables, g, axis)
        avg = component_mean(tree, g, tables, axis)

        def put(a, v):
            cur = lax.dynamic_index_in_dim(a[0], s, 0, keepdims=False)
            new = jnp.where(held, v.astype(a.dtype), cur)
            return lax.dynamic_update_index_in_dim(a, new[None], s, 1)
        return jax.tree.map(put, acc, avg)

    return lax.fori_loop(0, tables.components, body, tree)


def compact_sq_norm(tree: Any, tables: CompactTables, axis: str = AXIS) -> jax.Array:
    """Squared global L2 norm of *averaged* compact values, each component counted once.

    Each worker sums its slots' squared norms weighted by ``1 / m_g``; the psum over workers then
    counts every component exactly once, so the result is identical on every worker (DESIGN.md
    invariant 6: clipping computed from a per-worker norm would make holders drift apart).

    Returns: float32 scalar, invariant over ``axis``.
    """
    held = jnp.asarray(tables.held)[worker_index(axis)]
    w = 1.0 / jnp.asarray(tables.counts, jnp.float32)[held]  # [k]
    local = jnp.float32(0.0)
    for x in jax.tree.leaves(tree):
        per_slot = jnp.sum(jnp.square(x[0].astype(jnp.float32)).reshape(x.shape[1], -1), axis=1)
        local = local + jnp.sum(per_slot * w)
    return lax.psum(local, axis)


# ------------------------------------------------------------------------------------------
# Neuron-level components (N-SDP): one mask per layer, components along an axis of each leaf
# ------------------------------------------------------------------------------------------

class LayerTables:
    """Static tables of a neuron-level leaf: which indices along its component axis each worker
    holds in each layer.

    Args:
      indices: int32 [W, L, kc], held indices along the component axis (ascending per layer).
      counts: int32 [L, Gc], holders of every index of the full axis.
      axis: component axis of the *full* leaf (the layer axis is 0).
    """

    def __init__(self, indices: np.ndarray, counts: np.ndarray, axis: int):
        self.indices = np.asarray(indices, np.int32)
        self.counts = np.asarray(counts, np.int32)
        self.axis = int(axis)
        self.workers, self.layers, self.kc = self.indices.shape
        self.size = self.counts.shape[1]
        self.full = bool((self.counts == self.workers).all())


def _layer_buffers(tree, tables, layer, axis_name):
    """Per leaf: scatter this worker's layer slice into a zero full-size layer buffer."""
    my = worker_index(axis_name)

    def one(x, t):
        idx = jnp.asarray(t.indices)[my, layer]                     # [kc]
        xl = lax.dynamic_index_in_dim(x[0], layer, 0, keepdims=False)  # layer slice, compact
        a = t.axis - 1
        xm = jnp.moveaxis(xl, a, 0)
        buf = jnp.zeros((t.size,) + xm.shape[1:], x.dtype).at[idx].set(xm)
        return buf
    return jax.tree.map(one, tree, tables)


def layer_value(tree: Any, tables: Any, layer, axis_name: str = AXIS) -> Any:
    """Full-size values of one layer of compact neuron-level leaves: for each index the mean over
    the workers holding it (their copies agree after averaging, so this is *the* value).

    Args:
      tree: compact leaves, local shape ``[1, L, ...]``; tables: matching :class:`LayerTables`.
      layer: int32 scalar (may be traced).
    Returns:
      leaves of the full layer shape with the component axis moved first, invariant over the axis.
    """
    bufs = _layer_buffers(tree, tables, layer, axis_name)
    total = lax.psum(bufs, axis_name)

    def div(t, tab):
        c = jnp.asarray(tab.counts)[layer].astype(t.dtype)
        return t / c.reshape((-1,) + (1,) * (t.ndim - 1))
    return jax.tree.map(div, total, tables)


def layer_masked_mean(tree: Any, tables: Any, axis_name: str = AXIS) -> Any:
    """Masked mean over holders for compact neuron-level leaves, one layer at a time (temporary
    memory: one full-size layer per leaf). Same contract as :func:`compact_masked_mean`."""
    first = jax.tree.leaves(tables, is_leaf=lambda t: isinstance(t, LayerTables))[0]
    if all(t.full for t in jax.tree.leaves(tables, is_leaf=lambda t: isinstance(t, LayerTables))):
        return jax.tree.map(lambda x: lax.pmean(x, axis_name), tree)
    my = worker_index(axis_name)

    def body(layer, acc):
        vals = layer_value(acc, tables, layer, axis_name)

        def put(x, v, t):
            idx = jnp.asarray(t.indices)[my, layer]
            upd = jnp.moveaxis(v[idx], 0, t.axis - 1)
            return lax.dynamic_update_index_in_dim(x, upd[None].astype(x.dtype), layer, 1)
        return jax.tree.map(put, acc, vals, tables)

    return lax.fori_loop(0, first.layers, body, tree)


def layer_sq_norm(tree: Any, tables: Any, axis_name: str = AXIS) -> jax.Array:
    """Squared norm of averaged compact neuron-level leaves, every index counted once
    (weights ``1 / m``), identical on every worker. float32 scalar."""
    my = worker_index(axis_name)
    local = jnp.float32(0.0)
    for x, t in zip(jax.tree.leaves(tree),
                    jax.tree.leaves(tables, is_leaf=lambda t: isinstance(t, LayerTables))):
        idx = jnp.asarray(t.indices)[my]                                  # [L, kc]
        w = 1.0 / jnp.take_along_axis(jnp.asarray(t.counts, jnp.float32), idx, axis=1)
        xm = jnp.moveaxis(x[0].astype(jnp.float32), t.axis, 1)            # [L, kc, ...]
        per = jnp.sum(jnp.square(xm).reshape(xm.shape[0], xm.shape[1], -1), axis=2)
        local = local + jnp.sum(per * w)
    return lax.psum(local, axis_name)
