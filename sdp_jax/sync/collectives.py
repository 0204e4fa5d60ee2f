"""Collectives for SDP averaging, used inside ``jax.shard_map`` over the mesh axis ``data``.

Overlap averaging is a masked mean (docs/design.md invariant 2; Singh et al., arXiv 2507.09029,
Sec. 3, Eq. for the SDP update): for every component ``g`` the averaged value is

    x_g <- sum_{w holds g} x_g^(w) / m_g,        m_g = number of workers holding g,

computed as ``psum(mask * x, 'data') / count`` with ``count`` host-known and static. Parameters every
worker holds (always-kept) use the plain mean over all ``W`` workers.

Two layouts exist:
* *full* layout: every device has a full-size array whose leading axis indexes components, and a
  bool mask says which entries it holds (:func:`masked_average`). Always correct; the reference.
* *compact* layout: every device stores only its ``k`` held components, ``[1, k, ...]`` locally
  (a global ``[W, k, ...]`` array sharded ``P('data')``), with static tables from
  :mod:`sdp_jax.spec.masks` mapping slots to global components (:func:`average`).

Holder-only averaging (:func:`holder_mean`) and the FSDP gathers (:func:`fsdp_gather`) use a third,
*shard* layout and ``all_to_all`` so that a worker moves only the bytes of what it holds; see the
section below.

Everything here must run inside ``jax.shard_map`` with the named axis bound.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sdp_jax.mesh import DATA, INNER
from sdp_jax.spec import layout as layout_lib
from sdp_jax.spec import masks as _masks
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.sync.placement import emulating

AXIS = DATA   # the workers' mesh axis (sdp_jax.mesh)


def to_varying(tree: Any, axis: str | tuple = AXIS) -> Any:
    """Mark values that are invariant over ``axis`` (a name or a tuple of names; every leaf
    must be) as varying (``lax.pcast(..., to='varying')``).

    Taking ``jax.grad`` with respect to a parameter that enters ``shard_map`` replicated (``P()``)
    returns the gradient already *summed* over the axis (the transpose of the implicit broadcast);
    casting the parameter to varying first gives each worker its own local gradient, which the
    explicit averaging below then combines exactly once (docs/design.md invariant 1).

    Emulated workers (``jax.vmap`` over ``data``, :func:`sdp_jax.sync.placement.emulating`) have no
    such types: ``tree`` is returned as it is (there the gradient of an unmapped value is each
    worker's own already)."""
    if emulating():
        return tree
    if hasattr(lax, "pcast"):
        return jax.tree.map(lambda x: lax.pcast(x, axis, to="varying"), tree)
    return jax.tree.map(lambda x: lax.pvary(x, axis), tree)  # older JAX


def zeros_varying(shape, dtype, like, axis: str | None = AXIS) -> jax.Array:
    """Zeros (an accumulator) varying over ``axis`` and every mesh axis ``like`` varies over
    (e.g. the pipeline axis ``stage``), so that a loop carry keeps one type. With
    ``axis=None`` only ``like``'s axes: plain zeros outside ``jax.shard_map``."""
    axes = ({axis} if axis else set()) | set(varying_axes(like) or ())
    zeros = jnp.zeros(shape, dtype)
    return to_varying(zeros, tuple(sorted(axes))) if axes else zeros


def worker_index(axis: str = AXIS):
    """This device's worker index along ``axis`` (int32 scalar)."""
    return lax.axis_index(axis)


class CompactTables:
    """Static index tables of a mask matrix for the compact layout (host numpy, hashed by id).

    Attributes:
      mask: bool [W, G]; held: int32 [W, k]; slot: int32 [W, G] (-1 = not held);
      counts: int32 [G] multiplicities; full: True when every worker holds every component in
      depth order (then compact == full and averaging is a plain mean).
    """

    def __init__(self, mask: np.ndarray):
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


# ------------------------------------------------------------------------------------------
# Holder-only averaging and FSDP gathers: all_to_all with static tables
# ------------------------------------------------------------------------------------------
#
# A masked leaf is viewed as *rows*: ``[Lg, Gc, r]`` with ``Lg`` groups (1 for block leaves, whose
# components are the L blocks; L layers for neuron leaves), ``Gc`` components per group and ``r``
# elements per component (the other axes, flattened). Its *shard* on device ``s`` is column piece
# ``s`` of every row, ``[Lg, Gc, rs]`` with ``rs = ceil(r / W)`` (the last piece zero-padded): the
# FSDP (ZeRO-3) layout of the full parameter, each element stored once.
#
# Gathering worker ``w``'s ``c`` rows (components ``idx[w]``) from the shards is one all_to_all:
# owner ``s`` sends ``shard_s[idx[w]]`` to every ``w``, and ``w`` concatenates the ``W`` column
# pieces. Its transpose sends each worker's rows back in pieces to their owners, which add them into
# their shard: the sum over holders. Dividing by the multiplicity gives the masked mean (invariant
# 2). Per device and per row this moves ``(W - 1) / W`` of the row's bytes each way, so averaging
# the ``C * G`` rows a worker holds costs ``C`` times the bytes of an all-reduce of all ``G`` rows
# (docs/design.md, "Holder-only collectives").


def to_rows(x: jax.Array, tables: layout_lib.HolderTables) -> jax.Array:
    """A (compact or full) leaf ``[L or k, ...]`` (no worker axis) -> rows ``[Lg, n, r]``."""
    if not tables.grouped:
        return x.reshape((1, x.shape[0], -1))
    xm = jnp.moveaxis(x, tables.axis, 1)
    return xm.reshape(xm.shape[:2] + (-1,))


def from_rows(rows: jax.Array, shape, tables: layout_lib.HolderTables) -> jax.Array:
    """Inverse of :func:`to_rows` for a leaf of ``shape`` (``rows`` may carry padding)."""
    shape = tuple(shape)
    if not tables.grouped:
        n = int(np.prod(shape[1:]))
        return rows[..., :n].reshape(shape)
    a = tables.axis
    moved = (shape[0], shape[a]) + shape[1:a] + shape[a + 1:]
    n = int(np.prod(moved[2:]))
    return jnp.moveaxis(rows[..., :n].reshape(moved), 1, a)


def pad_last(x: jax.Array, size: int) -> jax.Array:
    """Zero-pad the last axis of ``x`` to ``size``."""
    extra = size - x.shape[-1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _worker_axes() -> tuple:
    """The automatic mesh axes of the per-worker function being traced (a worker's own
    devices, ``fsdp`` and ``tensor``, :mod:`sdp_jax.step.inner`) of size > 1; ``()`` on one
    device per worker or when emulated."""
    if emulating():
        return ()
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return tuple(a for a in INNER if a in types and mesh.shape[a] > 1
                 and types[a] == jax.sharding.AxisType.Auto)


def _columns_per_device(fn, split: tuple, whole: tuple = ()):
    """``fn(*split, *whole)``, each array of ``split`` and the result split on their last axis
    (columns) over a worker's own devices (:func:`_worker_axes`), each device running ``fn``
    on its columns (``whole``: the same on each): an exchange over ``data`` then moves ``1 /
    (F x T)`` of the columns from each of them (XLA does not split a manual axis's collective
    over the automatic axes beside it). Unchanged without such axes, or when their size does
    not divide every split array's columns."""
    names = _worker_axes()
    mesh = jax.sharding.get_abstract_mesh() if names else None
    size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    if size == 1 or any(x.shape[-1] % size for x in split):
        return fn(*split, *whole)
    cols = lambda x: jax.sharding.PartitionSpec(*([None] * (x.ndim - 1)), names)  # noqa: E731
    out = jax.eval_shape(fn, *split, *whole)
    specs = tuple(cols(x) for x in split) + (jax.sharding.PartitionSpec(),) * len(whole)
    res = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=cols(out),
                        axis_names=set(names), check_vma=False)(*split, *whole)
    return varying(res)


def varying(x, axis: str = AXIS):
    """``x`` typed varying over ``axis`` (:func:`to_varying` unless it already is): the result
    of a nested ``jax.shard_map`` over a worker's own axes (``check_vma=False``), which
    carries no type over ``data``, as the values it was computed from are typed."""
    return to_varying(x, axis) if axis not in (varying_axes(x) or ()) else x


def pieces_to_owners(acc: jax.Array, pieces: jax.Array, idx: jax.Array,
                     axis: str = AXIS) -> jax.Array:
    """Add every worker's rows into their owners' shards (the sum over holders), one all_to_all.

    Args:
      acc: this device's shard of one group, ``[Gc, rs]``.
      pieces: this worker's rows cut into column pieces, ``[c, W, rs]`` (piece ``s`` belongs to
        device ``s``).
      idx: int32 ``[W, c]``: the components every worker's ``c`` rows belong to.
    Returns:
      ``acc`` plus, for every worker ``w`` and slot ``j``, this device's piece of ``w``'s row
      ``j`` added at row ``idx[w, j]``. Bytes per device: ``(W-1)/W`` of ``pieces``.
    """
    def add(acc, pieces, idx):
        recv = lax.all_to_all(pieces.transpose(1, 0, 2), axis, 0, 0)  # recv[w]: w's pieces
        return acc.at[idx.reshape(-1)].add(recv.reshape(-1, recv.shape[-1]).astype(acc.dtype))
    return _columns_per_device(add, (acc, pieces), (jnp.asarray(idx),))


def pieces_from_owners(shard: jax.Array, idx: jax.Array, axis: str = AXIS) -> jax.Array:
    """This worker's rows ``idx[me]`` fetched from their owners' shards, one all_to_all.

    Args:
      shard: ``[Gc, rs]`` (one group); idx: int32 ``[W, c]``.
    Returns:
      ``[c, W, rs]`` column pieces, dtype of ``shard``. Bytes per device: ``(W-1)/W`` of it.
    """
    def fetch(shard, idx):   # send[w]: rows w needs; recv[s]: piece s
        return lax.all_to_all(shard[idx], axis, 0, 0).transpose(1, 0, 2)
    return _columns_per_device(fetch, (shard,), (jnp.asarray(idx),))


def rows_to_owners(acc: jax.Array, vals: jax.Array, idx: jax.Array,
                   axis: str = AXIS) -> jax.Array:
    """:func:`pieces_to_owners` for whole rows ``vals`` ``[c, r]`` (``r <= W * rs``)."""
    W, rs = idx.shape[0], acc.shape[-1]
    return pieces_to_owners(acc, pad_last(vals, W * rs).reshape(vals.shape[0], W, rs), idx,
                            axis)


def rows_from_owners(shard: jax.Array, idx: jax.Array, r: int, axis: str = AXIS) -> jax.Array:
    """:func:`pieces_from_owners` as whole rows ``[c, r]`` (padding dropped)."""
    pieces = pieces_from_owners(shard, idx, axis)
    return pieces.reshape(pieces.shape[0], -1)[:, :r]


def slot_indices(tables: layout_lib.HolderTables, group, first, count):
    """int32 ``[W, count]``: the components every worker holds in slots ``first ..
    first + count - 1`` of ``group`` (``group`` and ``first`` may be traced)."""
    t = jnp.asarray(tables.indices)
    return lax.dynamic_slice(t, (0, group, first), (tables.workers, 1, count))[:, 0]


def _fused_groups(tables: dict) -> list[list]:
    """Paths whose tables hold the same components in every slot: their rows travel together,
    concatenated, in one collective per loop step (each leaf keeps its own component axis)."""
    groups: dict[bytes, list] = {}
    for p, t in tables.items():
        key = t.indices.tobytes() + t.counts.tobytes() + bytes([t.grouped])
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def _slots_per_step(tables: layout_lib.HolderTables, bytes_per_slot: int, budget: int | None) -> int:
    """Block leaves: the most slots per loop step (a divisor of ``kc``) whose rows fit in
    ``budget`` bytes (None: all at once). Neuron leaves: a whole group per step."""
    if tables.grouped:
        return tables.kc
    if budget is None:
        return tables.kc
    fit = max(1, budget // max(bytes_per_slot, 1))
    return max(c for c in range(1, tables.kc + 1) if tables.kc % c == 0 and c <= fit)


def _loop_plan(tables: layout_lib.HolderTables, bytes_per_slot: int, step_bytes: int | None):
    """(slots per loop step, loop steps) of one fused group."""
    c = _slots_per_step(tables, bytes_per_slot, step_bytes)
    return c, (tables.groups if tables.grouped else tables.kc // c)


def _step_position(tables: layout_lib.HolderTables, i, c):
    """Loop step ``i`` -> (group, first slot): a whole group per step for neuron leaves, ``c``
    blocks per step for block leaves."""
    return (i, 0) if tables.grouped else (0, i * c)


def _unfuse(x, paths, widths) -> dict:
    """Split the last axis of a fused array back into its leaves' widths."""
    out, off = {}, 0
    for p, wdt in zip(paths, widths):
        out[p] = x[..., off:off + wdt]
        off += wdt
    return out


def _split_rows(rows, W):
    """rows ``[Lg, n, r]`` -> ``[Lg, n, W, rs]`` (column pieces, zero-padded)."""
    rs = -(-rows.shape[-1] // W)
    return pad_last(rows, W * rs).reshape(rows.shape[:2] + (W, rs))


def _slot_rows(x, n: int, dtype, W: int):
    """``x`` (``n`` components along its first axis) as rows in ``dtype`` cut into ``W``
    column pieces: ``[n, W, rs]`` (:func:`_split_rows` of one group)."""
    return _split_rows(x.reshape(1, n, -1).astype(dtype), W)[0]


def _sum_dtype(leaves) -> Any:
    """dtype in which holder collectives add leaves up: float32, or the leaves' if wider."""
    return jnp.result_type(jnp.float32, *[x.dtype for x in leaves])


def _piece_width(leaf: jax.Array, t: layout_lib.HolderTables) -> int:
    """``rs = ceil(r / W)`` of a compact leaf of tables ``t`` (``r``: elements per component:
    per block of ``[k, ...]``, per neuron of one layer of ``[L, ..., kc, ...]``)."""
    return -(-(int(np.prod(leaf.shape)) // (t.groups * t.kc)) // t.workers)


def _fresh_to_owners(rows: list, t: layout_lib.HolderTables, group, first, count, axis: str) -> jax.Array:
    """One loop step's first all_to_all leg into a zero shard: ``rows`` the fused leaves'
    column pieces ``[count, W, rs]`` of slots ``first ..`` of ``group``; returns this device's
    ``[Gc, sum rs]`` sums."""
    dt = rows[0].dtype
    acc = zeros_varying((t.size, sum(x.shape[-1] for x in rows)), dt, rows[0], axis)
    return pieces_to_owners(acc, jnp.concatenate(rows, axis=-1),
                            slot_indices(t, group, first, count), axis)


# Loop steps of holder averaging move at most this many bytes of rows per device (block leaves;
# None = one step): temporary memory stays a few blocks even for billion-parameter models.
STEP_BYTES = 256 * 2**20


def holder_shards(tree: dict, tables: dict, axis: str = AXIS,
                  step_bytes: int | None = STEP_BYTES) -> dict:
    """Masked mean over holders, left in the shard layout.

    Args:
      tree: {path: this worker's compact leaf (no worker axis)}, components ``indices[me]``.
      tables: {path: :class:`layout_lib.HolderTables`}; leaves with equal tables are sent together.
      step_bytes: rows moved per loop step (block leaves are sent a few slots at a time).
    Returns:
      {path: ``[Lg, Gc, rs]``}: this device's column piece of the holder mean of every
      component, float32 or the leaf's dtype if wider. Temporary memory: the shards plus one
      step's rows; bytes on the wire per device: ``(W-1)/W`` of the worker's compact bytes.
    """
    out = {}
    for paths in _fused_groups(tables):
        t = tables[paths[0]]
        W = t.workers
        dt = _sum_dtype([tree[p] for p in paths])
        rows = [_split_rows(to_rows(tree[p], tables[p]).astype(dt), W)  # [Lg, kc, W, rs]
                for p in paths]
        widths = [x.shape[-1] for x in rows]
        c, steps = _loop_plan(t, W * sum(widths) * jnp.dtype(dt).itemsize, step_bytes)
        acc = zeros_varying((t.groups, t.size, sum(widths)), dt, rows[0], axis)

        def body(i, acc, t=t, rows=rows, c=c):
            l, j0 = _step_position(t, i, c)
            pieces = jnp.concatenate([lax.dynamic_slice_in_dim(
                lax.dynamic_index_in_dim(x, l, 0, False), j0, c, 0) for x in rows], axis=-1)
            a = pieces_to_owners(lax.dynamic_index_in_dim(acc, l, 0, False), pieces,
                                 slot_indices(t, l, j0, c), axis)
            return lax.dynamic_update_index_in_dim(acc, a, l, 0)
        acc = lax.fori_loop(0, steps, body, acc)
        out.update(_unfuse(acc / jnp.asarray(t.counts, dt)[..., None], paths, widths))
    return out


def shards_to_compact(shards: dict, like: dict, tables: dict, axis: str = AXIS,
                      step_bytes: int | None = STEP_BYTES) -> dict:
    """Each worker's compact leaves gathered from shard-layout values (inverse direction of
    :func:`holder_shards`). ``like``: {path: compact leaf} giving shapes and dtypes."""
    out = {}
    for paths in _fused_groups(tables):
        t = tables[paths[0]]
        W = t.workers
        shard = jnp.concatenate([shards[p] for p in paths], axis=-1)  # [Lg, Gc, RS]
        widths = [shards[p].shape[-1] for p in paths]
        # The loop writes every slot; starting from ``like``'s buffers (dead after averaging)
        # lets XLA update them in place instead of allocating another compact-sized copy.
        rows = {p: _split_rows(to_rows(like[p], tables[p]).astype(shard.dtype), W)
                for p in paths}
        c, steps = _loop_plan(t, W * shard.shape[-1] * shard.dtype.itemsize, step_bytes)

        def body(i, rows, t=t, shard=shard, c=c, paths=paths, widths=widths):
            l, j0 = _step_position(t, i, c)
            pieces = pieces_from_owners(lax.dynamic_index_in_dim(shard, l, 0, False),
                                        slot_indices(t, l, j0, c), axis)   # [c, W, RS]
            new = {}
            for p, piece in _unfuse(pieces, paths, widths).items():
                grp = lax.dynamic_index_in_dim(rows[p], l, 0, False)
                grp = lax.dynamic_update_slice_in_dim(grp, piece, j0, 0)
                new[p] = lax.dynamic_update_index_in_dim(rows[p], grp, l, 0)
            return new
        rows = lax.fori_loop(0, steps, body, rows)
        for p in paths:
            x = rows[p]
            x = from_rows(x.reshape(x.shape[:2] + (-1,)), like[p].shape, tables[p])
            out[p] = x.astype(like[p].dtype)
    return out


def holder_mean(tree: dict, tables: dict, axis: str = AXIS,
                step_bytes: int | None = STEP_BYTES) -> dict:
    """Masked mean over holders of compact leaves, moving only held bytes.

    Leaves without the worker axis (block leaves ``[k, ...]``, neuron leaves ``[L, ..., kc, ...]``
    in the rows view of their tables): every worker gets, for each component it holds, the mean over all its
    holders. Two all_to_all passes (to the owners, and back) over the worker's ``C * G``
    components: ``2 (W-1)/W`` times the compact bytes per device, ``C`` times an all-reduce.
    """
    return shards_to_compact(holder_shards(tree, tables, axis, step_bytes), tree, tables, axis,
                             step_bytes)


def _group_holder_mean(ct: dict, tables: dict, group, axis: str) -> dict:
    """Masked mean over holders of one group (layer) of neuron leaves: ``ct`` {path: this
    worker's compact slice of group ``group`` (traced), component axis ``tables[p].axis - 1``},
    both all_to_all legs of :func:`holder_mean` for that group only."""
    out = {}
    for paths in _fused_groups(tables):
        t = tables[paths[0]]
        W = t.workers
        dt = _sum_dtype([ct[p] for p in paths])
        moved = {p: jnp.moveaxis(ct[p], tables[p].axis - 1, 0) for p in paths}
        rows = [_slot_rows(moved[p], t.kc, dt, W) for p in paths]     # [kc, W, rs]
        widths = [x.shape[-1] for x in rows]
        acc = _fresh_to_owners(rows, t, group, 0, t.kc, axis)
        acc = acc / jnp.asarray(t.counts, dt)[group][:, None]
        back = _unfuse(pieces_from_owners(acc, slot_indices(t, group, 0, t.kc), axis), paths,
                       widths)                                                 # [kc, W, rs]
        for p in paths:
            m = moved[p]
            v = back[p].reshape(t.kc, -1)[:, :int(np.prod(m.shape[1:]))].reshape(m.shape)
            out[p] = jnp.moveaxis(v, 0, tables[p].axis - 1).astype(ct[p].dtype)
    return out


def _owner_groups(tables: dict) -> list[list]:
    """Fused groups (:func:`_fused_groups`) of the block leaves (tables not grouped) of
    :func:`mean_in_backward`; a group's key is its first path."""
    return _fused_groups({p: t for p, t in tables.items() if t is not None and not t.grouped})


def owner_sinks(like: dict, tables: dict, axis: str = AXIS) -> dict:
    """Zero accumulators of :func:`mean_in_backward`: {first path of a fused group: this
    device's shard of the group's summed rows, float32 (or the leaves' dtype if wider)},
    ``[Gc, RS]`` for block leaves, ``[L, Gc, RS]`` for neuron leaves (scan it with the layers:
    loop step ``i`` adds layer ``i``); ``RS``: the leaves' ``rs = ceil(r / W)`` together.
    ``like``: {path: the worker's compact leaf}; ``tables``: their :class:`layout_lib.HolderTables`."""
    out = {}
    for paths in _fused_groups({p: t for p, t in tables.items() if t is not None}):
        t = tables[paths[0]]
        rs = sum(_piece_width(like[p], t) for p in paths)
        shape = ((t.groups,) if t.grouped else ()) + (t.size, rs)
        out[paths[0]] = zeros_varying(shape, _sum_dtype([like[p] for p in paths]),
                                      like[paths[0]], axis)
    return out


def sinks_to_shards(sums: dict, like: dict, tables: dict) -> dict:
    """The gradients of :func:`owner_sinks` (sums over holders in the owners' shards) -> {path:
    the holder mean in the shard layout (:func:`holder_shards`' ``[Lg, Gc, rs]``)}."""
    out = {}
    for paths in _fused_groups({p: tables[p] for p in like}):
        t, key = tables[paths[0]], paths[0]
        acc = sums[key] / jnp.asarray(t.counts if t.grouped else t.counts[0],
                                      sums[key].dtype)[..., None]
        acc = acc if t.grouped else acc[None]
        out.update(_unfuse(acc, paths, [_piece_width(like[p], t) for p in paths]))
    return out


def sinks_to_mean(sums: dict, like: dict, tables: dict, axis: str = AXIS,
                  orders: dict | None = None) -> dict:
    """The gradients of :func:`owner_sinks` (the sums over holders, in the owners' shards) ->
    {path: the worker's compact leaf of the holder mean}: divided by the multiplicities, then
    fetched back by the second all_to_all leg of :func:`holder_mean` (after the backward
    pass). ``orders``: the ones :func:`mean_in_backward` sent the rows in (its ``orders``)."""
    orders = orders or {}
    shards = sinks_to_shards(sums, like, {p: t for p, t in tables.items() if t is not None
                                          and not t.grouped})
    like = {p: to_order(like[p], orders.get(p), 1) for p in shards}
    out = shards_to_compact(shards, like, {p: tables[p] for p in shards}, axis)
    return {p: from_order(v, orders.get(p), 1) for p, v in out.items()}


def cotangent_orders(fn, tree: dict) -> dict:
    """The axis order in which the backward pass of ``fn`` produces each leaf's cotangent.

    JAX transposes a matmul's weight gradient into the weight's axis order after the matmul
    (``dot_general``'s transpose rule: the product comes out as ``[output dims, input dims]``,
    then a ``transpose``). An average over ``axis`` taken after that transpose makes XLA
    materialise the transposed copy before the all-reduce, and fold the transpose into the
    matmul's operands, where XLA:CPU then leaves the matmul unfused; ``jax.jit``'s partitioner
    all-reduces the matmul's own product instead. :func:`mean_in_backward` averages in the order
    returned here, so that the two transposes cancel and the collectives see the product.

    Traces ``jax.vjp(fn, tree)`` once (no compute) and follows each cotangent back through
    ``transpose``, ``convert_element_type`` and calls of nested jaxprs (``jit``,
    ``closed_call``, ``checkpoint``) to the operation that made it; anything else (a ``scan``
    whose outputs are stacked, a kernel call, an addition of several uses) ends the walk. The
    orders only change the layout in which collectives run, never the values; a leaf whose
    walk finds nothing keeps its own order (at worst a slower program).

    Args:
      fn: ``tree -> outputs`` (any pytree of arrays), traceable; may close over tracers.
      tree: a flat dict {path: array} (may be tracers) to differentiate.
    Returns:
      {path: ``perm``, a tuple of ``tree[path].ndim`` ints, with cotangent ``==
      jnp.transpose(z, perm)`` for the array ``z`` the backward pass computes; only paths
      whose order is not the identity}.
    Raises:
      ValueError: ``tree`` is not a flat dict.
    """
    if not isinstance(tree, dict) or any(isinstance(v, (dict, list, tuple))
                                         for v in tree.values()):
        raise ValueError("cotangent_orders: tree must be a flat dict {path: array}; flatten "
                         "nested parameters first (e.g. sdp_jax.spec.flatten).")
    closed = _cotangent_jaxpr(fn, tree)
    orders = {}
    paths = [kp[0].key for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    for path, var in zip(paths, closed.jaxpr.outvars):   # (both in the dict's sorted order)
        perm = _producer_perm(closed.jaxpr, var)
        if perm is not None and len(perm) == np.ndim(tree[path]) \
                and perm != tuple(range(len(perm))):
            orders[path] = perm
    return orders


def _cotangent_jaxpr(fn, tree: dict):
    """The closed jaxpr of ``fn``'s backward pass at ``tree`` (:func:`cotangent_orders`): its
    outputs are the cotangents of ``tree``'s leaves, for cotangents of ones (float0 zeros for
    integer outputs) on ``fn``'s outputs; traced only, nothing computed."""
    def trace(t):
        out, vjp = jax.vjp(fn, t)
        return vjp(jax.tree.map(lambda y: jnp.ones_like(y) if jnp.issubdtype(
            y.dtype, jnp.inexact) else np.zeros(y.shape, jax.dtypes.float0), out))[0]

    return jax.make_jaxpr(trace)(tree)


# Primitives whose nested jaxpr :func:`_producer_perm` follows (calls, not loops).
_CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat"})


def _producer_perm(jaxpr, var) -> tuple | None:
    """The permutation of the ``transpose`` equations between ``var`` (an output of ``jaxpr``)
    and the operation that made it, walking back through ``transpose``,
    ``convert_element_type`` and calls of nested jaxprs (:data:`_CALL_PRIMITIVES`); None when
    the walk meets no ``transpose`` (:func:`cotangent_orders`)."""
    from jax.extend import core as jcore

    perm = None
    while isinstance(var, jcore.Var):
        eqn = next((e for e in jaxpr.eqns if any(v is var for v in e.outvars)), None)
        if eqn is None:
            break
        name = eqn.primitive.name
        if name == "convert_element_type":
            var = eqn.invars[0]
        elif name == "transpose":
            q = eqn.params["permutation"]
            perm = tuple(q) if perm is None else tuple(q[i] for i in perm)
            var = eqn.invars[0]
        elif name in _CALL_PRIMITIVES and isinstance(eqn.params.get("jaxpr"),
                                                     (jcore.ClosedJaxpr, jcore.Jaxpr)):
            inner = eqn.params["jaxpr"]
            inner = inner.jaxpr if isinstance(inner, jcore.ClosedJaxpr) else inner
            i = [i for i, v in enumerate(eqn.outvars) if v is var][0]
            if i >= len(inner.outvars) or inner.outvars[i].aval.shape != var.aval.shape:
                break
            var, jaxpr = inner.outvars[i], inner
        else:
            break
    return perm


def _lead_perm(perm, lead: int) -> tuple:
    """``perm`` shifted past ``lead`` leading axes that stay in place."""
    return tuple(range(lead)) + tuple(lead + int(i) for i in perm)


def to_order(x: jax.Array, perm, lead: int = 0) -> jax.Array:
    """``x`` (in its leaf's axis order) in the order ``perm`` of :func:`cotangent_orders` (the
    backward pass's own), after ``lead`` leading axes that stay first (e.g. a compact leaf's
    slot axis): shape ``x.shape[:lead] + tuple(x.shape[lead + i] for i in argsort(perm))``,
    ``len(perm) == x.ndim - lead``; ``perm`` None: ``x``."""
    return x if perm is None else jnp.transpose(x, _lead_perm(np.argsort(perm), lead))


def from_order(z: jax.Array, perm, lead: int = 0) -> jax.Array:
    """Inverse of :func:`to_order`."""
    return z if perm is None else jnp.transpose(z, _lead_perm(perm, lead))


def mean_in_backward(tree: dict, tables: dict, group, axis: str = AXIS,
                     sinks: dict | None = None, orders: dict | None = None) -> dict:
    """Identity on the values; its transpose averages each leaf's cotangent over the leaf's
    holders inside the backward pass's block loop, as soon as one block's gradient exists
    (where a GPU or TPU can overlap it with the next block's backward compute), instead of
    after the whole backward pass.

    Call inside ``jax.shard_map`` on one block's parameters inside the block loop (loop step
    ``group``), before any cast to the compute dtype (cotangents are averaged in the master
    dtype).

    Args:
      tree: {path: this worker's value of one block of a leaf}, varying over ``axis``.
      tables: {path: one of}

        * None: held by every worker: the cotangent becomes its plain mean (an all-reduce);
        * a grouped :class:`layout_lib.HolderTables` (neuron leaves; the component axis of the slice is
          ``axis - 1``; loop step ``group`` is layer ``group`` on every worker): the holder
          mean of that layer, both all_to_all legs of :func:`holder_mean`; or, when its fused
          group has a sink (this step's ``[Gc, RS]`` slice of :func:`owner_sinks`' ``[L, Gc,
          RS]``), only the first leg, into the sink's gradient (the sums in the owners'
          shards: :func:`sinks_to_shards`), and the leaf's own cotangent is zero;
        * a block :class:`layout_lib.HolderTables` (B-SDP: loop step ``group`` is the worker's slot
          ``group``, a different block on each worker, so the mean cannot be formed yet):
          the cotangent is sent to its owners (the first all_to_all leg) and added into the
          gradient of ``sinks`` (:func:`owner_sinks`); the leaf's own cotangent is zero.
          :func:`sinks_to_mean` finishes the mean after the backward pass.

        A path not in ``tables`` keeps its cotangent.
      group: int32 scalar (may be traced): the loop step.
      sinks: :func:`owner_sinks` of the block leaves (needed when ``tables`` has any), and of
        the neuron leaves to be left in the owners' shards (this step's slices).
      orders: {path: :func:`cotangent_orders`' order of the leaf's cotangent}: a plain mean
        runs in that order, and a block leaf's rows go to the owners in it (then pass the same
        ``orders`` to :func:`sinks_to_mean`); grouped leaves ignore it. Values are the same
        with any orders.
    Returns:
      ``tree`` unchanged. Bytes per device on the wire equal those of :func:`average` for the
      same leaves, issued where each block's gradient is computed; a loss that runs the blocks
      twice issues them twice (still the right mean: it is linear).
    Raises:
      ValueError: block leaves without ``sinks`` of the same tables.
    """
    sinks, orders = dict(sinks or {}), dict(orders or {})
    ident = _averaging_identity(tables, _sunk_groups(tables, sinks),
                                {k: v.dtype for k, v in sinks.items()}, axis, orders)
    return ident(tree, sinks, group)


def _averaging_identity(tables: dict, owners: list, dtypes: dict, axis: str, orders: dict):
    """:func:`mean_in_backward`'s ``(tree, sinks, group) -> tree`` (a ``jax.custom_vjp``): its
    backward pass averages the plain and neuron cotangents in place (:func:`_means_in_place`),
    sends those of the groups ``owners`` into the sinks' gradients (:func:`_sink_grad`, in the
    sinks' ``dtypes``) and zeroes them."""
    sunk = {p for g in owners for p in g}

    @jax.custom_vjp
    def ident(x, snk, g):
        return x

    def fwd(x, snk, g):
        return x, g

    def bwd(g, ct):
        out = dict(ct)
        out.update(_means_in_place(ct, tables, sunk, g, axis, orders))
        sent = {}
        for paths in owners:
            sent[paths[0]] = _sink_grad(ct, tables, paths, g, dtypes[paths[0]], axis, orders)
            out.update({p: jnp.zeros_like(ct[p]) for p in paths})
        return out, sent, None

    ident.defvjp(fwd, bwd)
    return ident


def _sunk_groups(tables: dict, sinks: dict) -> list[list]:
    """The fused groups whose cotangents :func:`mean_in_backward` sends into ``sinks``: every
    block group (:func:`_owner_groups`), then the neuron groups whose first path has a sink.
    Raises ValueError when ``sinks`` does not name exactly those groups."""
    owners = _owner_groups(tables)
    owners += [g for g in _fused_groups({p: t for p, t in tables.items()
                                         if t is not None and t.grouped}) if g[0] in sinks]
    if set(sinks) != {g[0] for g in owners}:
        raise ValueError("mean_in_backward: block leaves need sinks=owner_sinks(...) of the "
                         "same tables (and only the groups they name).")
    return owners


def _means_in_place(ct: dict, tables: dict, sunk: set, g, axis: str, orders: dict) -> dict:
    """The cotangents :func:`mean_in_backward` averages in loop step ``g`` itself: {path: the
    plain mean (tables None; in the backward pass's own order, :func:`cotangent_orders`) or
    the layer's holder mean (grouped tables not in ``sunk``)}."""
    plain = {p: v for p, v in ct.items() if p in tables and tables[p] is None}
    grouped = {p: v for p, v in ct.items()
               if tables.get(p) is not None and tables[p].grouped and p not in sunk}
    out = {}
    if plain:   # averaged in the backward pass's own order (cotangent_orders)
        red = to_varying(lax.pmean({p: to_order(v, orders.get(p)) for p, v in plain.items()},
                                   axis), axis)
        out.update({p: from_order(v, orders.get(p)) for p, v in red.items()})
    if grouped:
        out.update(_group_holder_mean(grouped, {p: tables[p] for p in grouped}, g, axis))
    return out


def _sink_grad(ct: dict, tables: dict, paths: list, g, dtype, axis: str,
               orders: dict) -> jax.Array:
    """Loop step ``g``'s first all_to_all leg of one fused group ``paths`` of
    :func:`mean_in_backward`: the cotangents' rows (in ``dtype``, the sink's) added into zero
    owner shards, ``[Gc, RS]`` (the gradient of the group's sink)."""
    t = tables[paths[0]]
    if t.grouped:   # layer g of every worker: its kc neurons' rows
        rows = [_slot_rows(jnp.moveaxis(ct[p], tables[p].axis - 1, 0), t.kc, dtype, t.workers)
                for p in paths]
        return _fresh_to_owners(rows, t, g, 0, t.kc, axis)
    # slot g of every worker: one block's rows, [1, W, rs]
    rows = [_slot_rows(to_order(ct[p], orders.get(p)), 1, dtype, t.workers) for p in paths]
    return _fresh_to_owners(rows, t, 0, g, 1, axis)


def all_gather_invariant(x: jax.Array, axis: str = AXIS) -> jax.Array:
    """Tiled all-gather of shards ``[..., rs]`` along the last axis; the result is the same on
    every worker and typed invariant, so it may leave ``shard_map`` replicated (``P()``)
    (under the ``jax.vmap`` of emulated workers, where nothing is typed, a plain all-gather)."""
    if emulating():
        return lax.all_gather(x, axis, axis=x.ndim - 1, tiled=True)
    for to in ("invarying", "invariant"):  # the spelling of jax 0.10; a later one
        try:
            return lax.all_gather(x, axis, axis=x.ndim - 1, tiled=True, to=to)
        except (TypeError, ValueError):
            continue
    gather = getattr(lax, "all_gather_invariant", None)
    if gather is not None:
        return gather(x, axis, axis=x.ndim - 1, tiled=True)
    # Last resort (correct, but an all-reduce more on the wire): make it invariant by a psum.
    return lax.psum(lax.all_gather(x, axis, axis=x.ndim - 1, tiled=True)
                    / lax.axis_size(axis), axis)


def shards_sq_norm(shards: dict, axis: str = AXIS) -> jax.Array:
    """Squared L2 norm of shard-layout values: every element lives on exactly one device, so the
    psum counts each component once (docs/design.md invariant 6). float32 scalar, invariant."""
    return sum_parts([jnp.sum(jnp.square(x.astype(jnp.float32))) for x in shards.values()],
                     axis, True)


def sum_parts(parts: list, axis: str = AXIS, over_axis: bool = True) -> jax.Array:
    """Sum of float32 scalars ``parts`` (e.g. squared norms of leaves), each counted once: a
    part that varies over another mesh axis than ``axis`` (the pipeline axis ``stage``, whose
    devices hold different blocks) is summed over that axis; ``over_axis``: also over ``axis``
    (parts that differ between workers, each counted once). Returns a float32 scalar, invariant
    over ``axis`` when ``over_axis`` and over every other axis."""
    groups: dict[tuple, Any] = {}
    for v in parts:
        v = jnp.asarray(v, jnp.float32)
        vma = varying_axes(v) or ()
        extra = tuple(sorted(a for a in vma if a != axis))
        groups[extra] = groups.get(extra, jnp.float32(0.0)) + v
    total = jnp.float32(0.0)
    for extra, v in groups.items():
        names = ((axis,) if over_axis else ()) + extra
        total = total + (lax.psum(v, names) if names else v)
    return total


# ---------------------------------------------------------------- FSDP gathers (differentiable)

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _gather_rows(shard, idx, keep, scale, r, dtype, leaf):
    return _gather_rows_fwd(shard, idx, keep, scale, r, dtype, leaf)[0]


def _gather_rows_fwd(shard, idx, keep, scale, r, dtype, leaf):
    x = shard.astype(dtype)  # communicate in the compute dtype
    if idx is None:
        out = lax.all_gather(x, AXIS, axis=x.ndim - 1, tiled=True)[..., :r]
    else:
        out = rows_from_owners(x, idx, r, AXIS)
    return out, (idx, keep, scale, jnp.zeros((0,) + shard.shape, shard.dtype))


def _gather_rows_bwd(r, dtype, leaf, res, ct):
    idx, keep, scale, probe = res  # probe: empty array with the shard's shape and master dtype
    shape = probe.shape[1:]
    ct = ct.astype(probe.dtype)  # gradients are reduced in the master dtype (float32)
    if scale is not None:   # per entry of the leaf, in the master dtype
        ct = (ct.reshape(ct.shape[:-1] + leaf) * scale.astype(ct.dtype)).reshape(ct.shape)
    if keep is not None:
        ct = ct * keep.reshape(keep.shape + (1,) * (ct.ndim - keep.ndim)).astype(ct.dtype)
    W = lax.axis_size(AXIS)
    if idx is None:
        g = lax.psum_scatter(pad_last(ct, W * shape[-1]), AXIS,
                             scatter_dimension=ct.ndim - 1, tiled=True)
    else:
        g = rows_to_owners(zeros_varying(shape, ct.dtype, ct), ct, idx, AXIS)
    return g, None, None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def fsdp_gather(shard: jax.Array, r: int, dtype, idx: jax.Array | None = None,
                keep: jax.Array | None = None, scale: jax.Array | None = None,
                leaf: tuple | None = None) -> jax.Array:
    """Gather rows of an FSDP-sharded leaf for compute; its gradient is the masked sum.

    Args:
      shard: this device's column piece ``[n, rs]`` (float32 master values).
      r: row length without padding.
      dtype: compute dtype; the gather moves ``dtype`` bytes (bf16: half of float32).
      idx: int32 ``[W, c]``: gather worker-specific rows ``idx[me]`` by all_to_all (SDP: only the
        components this worker holds); None: every row by all_gather (DDP-FSDP, or the full
        forward pass of the backward variants).
      keep: optional bool ``[n]`` (rows of this worker whose gradient counts: backward masking).
      scale: optional float32 array broadcastable to ``leaf`` (each row reshaped to the leaf's
        shape ``leaf``, ``r = prod(leaf)``) multiplying the cotangent after its cast to the
        master dtype, e.g. ``1 / m`` of every entry's component (the sum over workers is then
        the masked mean over holders, docs/design.md invariant 2).
    Returns:
      ``[c or n, r]`` in ``dtype``. Backward: the cotangent (cast to the master dtype, masked by
      ``keep``) goes back to the owners by the transposed collective (all_to_all + scatter-add,
      or reduce-scatter), so the gradient of ``shard`` is the sum over the workers that use each
      row; divide by the multiplicity for the masked mean.
    """
    return _gather_rows(shard, idx, keep, scale, int(r), jnp.dtype(dtype),
                        None if leaf is None else tuple(int(d) for d in leaf))


# ------------------------------------------------------------------------------------------
# Tree-level averaging and clipping for any model (driven by an sdp_jax.spec.SDPSpec)
# ------------------------------------------------------------------------------------------

def masked_average(tree: Any, masks: Any, axis: str = AXIS) -> Any:
    """The reference masked mean over holders, full layout (docs/design.md invariant 2).

    Args:
      tree: this worker's full-size values (a pytree; entries it does not hold are ignored).
      masks: the spec's mask pytree (:meth:`sdp_jax.spec.SDPSpec.mask_tree`): per leaf a static
        bool ``[W, ...]`` broadcastable to the leaf, or None (every worker holds it).

    Returns:
      pytree like ``tree``: every entry is ``psum(mask * x) / count`` with ``count`` the number of
      workers holding it (host-known); always-kept leaves the plain mean. The same on every
      worker (invariant over ``axis``).
    """
    my = worker_index(axis)

    def one(m, x):
        if m is None:
            return lax.pmean(x, axis)
        m = np.asarray(m, bool)
        count = m.sum(0)
        if (count == 0).any():
            raise ValueError(f"entries {np.argwhere(count == 0)[:4].tolist()} of a leaf are held "
                             "by no worker (the mean would divide by zero).")
        mine = jnp.asarray(m)[my]
        total = lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis)
        return total / jnp.asarray(count, x.dtype)

    return jax.tree.map(one, masks, tree, is_leaf=lambda m: m is None or isinstance(m, np.ndarray))


def _check_compact(flat: dict, lay) -> bool:
    """Whether ``flat`` is in the stored form (list-form slots stacked); raises if it is in
    neither compact form."""
    if set(flat) == set(lay.leaves):
        return False
    if set(flat) == set(lay.stored_shapes):
        return True
    odd = sorted(set(flat) ^ set(lay.leaves), key=str)[:2]
    raise ValueError(f"the tree is not in the spec's compact layout (e.g. {odd}); pass "
                     "compact=False for full-size values, or a worker's local tree "
                     "(sdp_jax.spec.layout.Layout.prune).")


def average(tree: Any, spec, *, compact: bool = True, method: str = "alltoall",
            axis: str = AXIS, done: frozenset = frozenset()) -> Any:
    """Mean of every component over exactly the workers that hold it, for a whole tree.

    Call inside ``jax.shard_map`` over ``axis``, on each worker's own (local) values, e.g. the
    gradient of its loss. Values must be *varying* over ``axis``: a parameter that enters
    ``shard_map`` replicated (``P()``) has a gradient that is already summed over the workers
    (docs/design.md invariant 1); cast it with :func:`to_varying` before differentiating.

    Args:
      tree: ``compact=True``: a worker's local tree in the compact layout of
        :class:`sdp_jax.spec.layout.Layout` (what a forward-masking worker trains: ``k`` blocks,
        narrowed neuron leaves), with list-form blocks as ``k`` blocks or stacked as stored
        (``{path}/slots/...`` ``[k, ...]``, :meth:`~sdp_jax.spec.layout.Layout.to_stored`);
        ``compact=False``: full-size values (nested dict like the
        parameters; entries the worker does not hold are ignored).
      spec: the :class:`sdp_jax.spec.SDPSpec`.
      compact: whether ``tree`` is in the compact layout (see above).
      method: compact layout only (the full layout always uses the masked psum):
        ``"alltoall"`` moves only held bytes (:func:`holder_mean`:
        per device ``2 (W-1)/W`` times the worker's compact bytes, ``C`` times an all-reduce);
        ``"reference"`` scatters into full-size buffers and runs :func:`masked_average` (the
        masked psum; every method gives the same values).
      done: compact layout, ``alltoall``: local paths already averaged (e.g. inside the
        backward loop by :func:`mean_in_backward`), returned as they are.

    Returns:
      tree like ``tree``; always-kept leaves are the plain mean over all workers.

    Raises:
      ValueError: unknown ``method``; ``done`` with ``reference`` or the full layout, or naming
        paths not in ``tree``.
    """
    if method not in ("alltoall", "reference"):
        raise ValueError(f"method={method!r}; use alltoall or reference.")
    if done and (method != "alltoall" or not compact):
        raise ValueError("done= (leaves averaged in the backward loop) is for the compact "
                         "layout with method='alltoall'; the reference psum averages every leaf.")
    if not compact:
        return masked_average(tree, spec.mask_tree(), axis)
    lay = layout_lib.of(spec)
    flat = spec_lib.flatten(tree)
    stored = _check_compact(flat, lay)
    my = worker_index(axis)
    if method == "reference":   # full-size buffers, float32 sums
        back = _psum_average(flat, spec, lay, stored, my, axis)
        return jax.tree_util.tree_unflatten(jax.tree.structure(tree),
                                            [back[p].astype(x.dtype) for p, x in flat.items()])
    if not set(done) <= set(flat):
        raise ValueError(f"done= names paths that are not in the tree: "
                         f"{sorted(set(done) - set(flat), key=str)[:2]}.")
    out = _holder_average(flat, done, lay, axis)
    return jax.tree_util.tree_unflatten(jax.tree.structure(tree), [out[p] for p in flat])


def _psum_average(flat: dict, spec, lay, stored: bool, my, axis: str) -> dict:
    """:func:`average`'s ``method="reference"``: the compact leaves ``flat`` (stored form
    when ``stored``) of worker ``my`` widened to float32 (or wider), embedded in zero full-size
    buffers, averaged by :func:`masked_average` and pruned back to ``flat``'s form (the sums'
    dtype; the caller casts back)."""
    loc = lay.to_local(flat) if stored else flat
    wide = {p: x.astype(jnp.result_type(jnp.float32, x.dtype)) for p, x in loc.items()}
    zeros = {p: jnp.zeros(s, jnp.result_type(*wide.values())) for p, s in spec.shapes.items()}
    full = lay.embed(zeros, wide, my)
    avg = masked_average(full, {p: spec.leaf_mask(p) for p in spec.shapes}, axis)
    back = lay.prune(avg, my)
    return lay.to_stored(back) if stored else back


def _holder_average(flat: dict, done, lay, axis: str) -> dict:
    """:func:`average`'s ``method="alltoall"``: {path of ``flat``: its mean}: a plain mean for
    the leaves every worker holds, :func:`holder_mean` for the others (list-form slots
    stacked, then split back), the paths in ``done`` as they are."""
    plain, rows, tabs, slots = _compact_groups({p: x for p, x in flat.items() if p not in done},
                                               lay)
    out = {lp: lax.pmean(x, axis) for lp, x in plain.items()}
    out.update({lp: flat[lp] for lp in done})
    for key, v in (holder_mean(rows, tabs, axis) if rows else {}).items():
        lf = lay.leaves.get(key)
        if key in slots:
            for j, lp in slots[key].items():
                out[lp] = v[j]
        elif lf is None:   # stored slots
            out[key] = v
        else:
            out[key] = v if (lf.form == layout_lib.STACK or lf.rule.layer is None) else v[0]
    return out


def varying_axes(x) -> frozenset | None:
    """The mesh axes over which ``x`` (inside ``jax.shard_map``) may differ between devices,
    or None when this JAX does not say (``aval.vma``; ``aval.manual_axis_type.varying`` in
    jax 0.10) or nothing types it (emulated workers under ``jax.vmap``,
    :func:`sdp_jax.sync.placement.emulating`: any value may differ)."""
    if emulating():
        return None
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return None if vma is None else frozenset(vma)


def _varying(x, axis: str) -> bool:
    """Whether ``x`` may differ between the workers of ``axis`` (True when JAX does not say)."""
    vma = varying_axes(x)
    return True if vma is None else axis in vma


def _compact_groups(flat: dict, lay) -> tuple[dict, dict, dict, dict]:
    """Split a worker's compact local leaves for the holder collectives: ``(plain, rows,
    tables, slots)``: leaves averaged by a plain mean (always-kept, or held by every worker),
    leaves in the shape :func:`holder_shards` takes (list-form block slots stacked per relative
    path under their stored path, :meth:`sdp_jax.spec.layout.Layout.slots_path`), their tables,
    and {stored slots path: {slot: local path}}."""
    plain, rows, tabs, slots = {}, {}, {}, {}
    for lp, x in flat.items():
        lf = lay.leaves.get(lp)
        if lf is None:   # stored form: a stack of slots, already in the rows view
            if lay.holder_tables(lp).full:
                plain[lp] = x
            else:
                rows[lp], tabs[lp] = x, lay.holder_tables(lp)
        elif lf.form == layout_lib.KEPT or lay.holder_tables(lp).full:
            plain[lp] = x
        elif lf.form == layout_lib.SLOT:
            slots.setdefault(lay.slots_path(lf), {})[lf.slot] = lp
            tabs[lay.slots_path(lf)] = lay.holder_tables(lp)
        else:
            rows[lp] = x if lf.form == layout_lib.STACK or lf.rule.layer is None else x[None]
            tabs[lp] = lay.holder_tables(lp)
    for key, by_slot in slots.items():
        rows[key] = jnp.stack([flat[by_slot[j]] for j in range(len(by_slot))])
    return plain, rows, tabs, slots


def gather_full(tree: Any, spec, axis: str = AXIS) -> dict:
    """The full parameters, the same on every worker, from every worker's compact local values
    (each component the mean over its holders; after an averaged update the holders agree, so
    it is their value). Used by the evaluation of forward-masked steps.

    Args:
      tree: a worker's local tree in the compact layout (inside ``jax.shard_map``; either form,
        see :func:`average`).
    Returns:
      nested dict like the spec's parameters, invariant over ``axis``, in the local dtypes.
      Bytes per device: the holder ``all_to_all`` of the worker's compact bytes plus an
      all-gather of the full model (``(W-1)/W`` of it), instead of a full-size all-reduce.
    """
    lay = layout_lib.of(spec)
    flat = spec_lib.flatten(tree)
    _check_compact(flat, lay)
    out = {}
    plain, rows, tabs, slots = _compact_groups(flat, lay)
    for lp, x in plain.items():   # always-kept, or every worker holds all in order
        v = lax.pmean(x, axis) if _varying(x, axis) else x   # a replicated input: as it is
        if lp in lay.slot_leaves:   # stored stack of slots held by all: slot j = block j
            lf = lay.leaves[lay.slot_leaves[lp]]
            for g in range(v.shape[0]):
                out[lay.block_full(lf, g)] = lay.unpad(lf, g, v[g])
            continue
        lf = lay.leaves[lp]
        if lf.form == layout_lib.SLOT:   # every worker holds every block, slot j = block j
            out[lay.block_full(lf, lf.slot)] = lay.unpad(lf, lf.slot, v)
        else:
            out[lp] = v
    for key, sh in (holder_shards(rows, tabs, axis) if rows else {}).items():
        t = tabs[key]
        if key in slots or key in lay.slot_leaves:
            lp0 = slots[key][0] if key in slots else lay.slot_leaves[key]
            lf = lay.leaves[lp0]
            dt = flat[slots[key][0] if key in slots else key].dtype
            L = t.size
            full = from_rows(all_gather_invariant(sh.astype(dt), axis),
                             (L,) + lay.local_shape(lp0), t)
            for g in range(L):
                out[lay.block_full(lf, g)] = lay.unpad(lf, g, full[g])
            continue
        lf, dt = lay.leaves[key], flat[key].dtype
        g = all_gather_invariant(sh.astype(dt), axis)
        if lf.form == layout_lib.STACK or lf.rule.layer is None:
            out[key] = from_rows(g, spec.shapes[key], t)
        else:
            out[key] = from_rows(g, (1,) + spec.shapes[key], t)[0]
    return layout_lib.unflatten({p: out[p] for p in spec.shapes})


def global_norm(tree: Any, spec, *, compact: bool = True, axis: str = AXIS) -> jax.Array:
    """Global L2 norm of an *averaged* tree (:func:`average`'s output) with every component
    counted once, so it is the same on every worker (docs/design.md invariant 6: a norm over a
    worker's own compact blocks differs between workers and makes holders drift apart).

    Args:
      tree: averaged values in the compact layout (``compact=True``; either form, see
        :func:`average`) or full layout.
    Returns:
      float32 scalar, invariant over ``axis``. Compact layout: each worker weights its entries
      by ``1 / m`` (multiplicity) and one psum adds them up.
    """
    flat = spec_lib.flatten(tree)
    if not compact:
        return jnp.sqrt(sum_parts([jnp.sum(jnp.square(x.astype(jnp.float32)))
                                   for x in flat.values()], axis, False))
    lay = layout_lib.of(spec)
    _check_compact(flat, lay)
    my = worker_index(axis)
    kept, local = [], []
    for lp, x in flat.items():
        x2 = jnp.square(x.astype(jnp.float32))
        if lp in lay.leaves and lay.leaves[lp].form == layout_lib.KEPT:
            kept.append(jnp.sum(x2))
            continue
        inv = jnp.asarray(lay.inverse_counts(lp))[my]   # per component: sum first, no full temp
        per = jnp.sum(x2, axis=tuple(i for i, n in enumerate(inv.shape) if n == 1),
                      keepdims=True)
        local.append(jnp.sum(per * inv))
    return jnp.sqrt(sum_parts(kept, axis, False) + sum_parts(local, axis, True))


def clip_by_global_norm(tree: Any, spec, max_norm: float, *, compact: bool = True,
                        axis: str = AXIS) -> tuple[Any, jax.Array]:
    """Scale an averaged tree so that its :func:`global_norm` is at most ``max_norm`` (the
    same factor on every worker; ``max_norm <= 0``: no clipping).

    Returns:
      ``(clipped tree, norm before clipping)`` (float32 scalar). Use this instead of
      ``optax.clip_by_global_norm`` inside ``shard_map``, which sees only one worker's values.
    """
    norm = global_norm(tree, spec, compact=compact, axis=axis)
    return clip_to(tree, norm, max_norm), norm


def clip_to(tree: Any, norm: jax.Array, max_norm: float) -> Any:
    """``tree * min(1, max_norm / (norm + 1e-6))``: global-norm clipping (Pascanu et al. 2013,
    "On the difficulty of training recurrent neural networks", Sec. 3.2) by a ``norm`` that the
    caller computed so that every holder gets the same one; ``max_norm <= 0``: unchanged."""
    if max_norm <= 0:
        return tree
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), tree)
