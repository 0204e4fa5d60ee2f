"""A worker's own devices: how its stored leaves and its batch lie over the mesh axes ``fsdp``
and ``tensor`` (``F x T`` devices per worker, :func:`sdp_jax.mesh.make_mesh`).

The per-worker function is written for one worker and is manual over ``data`` alone
(:meth:`sdp_jax.sync.placement.Placement.map`); inside it a worker's arrays keep the shardings
declared here over its own devices, and XLA's partitioner inserts the gathers,
reduce-scatters and all-reduces over ``fsdp`` and ``tensor``. Two declared rules, per stored
leaf of the kinds ``R``, ``C`` and ``Rw`` (:class:`sdp_jax.step.regime.Kind`; a worker's
row shard of a leaf in ``S``, already split over ``data``, is split further over its own
devices where their count divides it, :meth:`InnerLayout.rows_axes`):

* **tensor**: a leaf that a :class:`sdp_jax.spec.Neurons` rule matches is split over
  ``tensor`` on its component axis (``spec.component_axes``): LLaMA's q, k, v, gate and up by
  output (column-parallel), o and down by input (row-parallel), the Megatron-LM split (Shoeybi
  et al. 2019, Sec. 3). ``T`` must divide the leaf's component count (its held count under
  N-SDP's forward masking), so that each device holds whole heads and key/value groups.
* **fsdp**: every leaf is sharded over ``fsdp`` on its largest axis that ``F`` divides, other
  than the tensor axis and the first axis of a leaf of several: a block stack's (the block
  runner slices it one block at a time) or a lookup table's rows (an embedding's vocabulary,
  which a gather indexes). A leaf with no such axis stays whole on each device (e.g. a norm
  of odd width).

The batch's rows are split over ``data`` and, inside a worker, over ``fsdp``
(:meth:`InnerLayout.split_rows`): each of a worker's ``fsdp`` devices runs
``b / F`` of its rows (HSDP: FSDP inside a worker, data parallelism across; torchtitan's
``dp_shard`` inside ``dp_replicate``), and over ``tensor`` every device sees the same rows.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from sdp_jax import sync
from sdp_jax.mesh import FSDP, TENSOR
from sdp_jax.spec import layout as layout_lib


class InnerLayout:
    """The declared layout over ``fsdp`` and ``tensor`` of one run's stored leaves.

    Args:
      spec: the run's :class:`sdp_jax.spec.SDPSpec` (its ``component_axes``).
      fsdp, tensor: ``F`` and ``T``, the worker's devices along ``fsdp`` and ``tensor``
        (:attr:`sdp_jax.step.regime.Regime.inner`).

    Attributes:
      fsdp, tensor: ``F``, ``T``; active: ``F x T > 1``.
    """

    def __init__(self, spec, fsdp: int = 1, tensor: int = 1):
        self.spec = spec
        self.fsdp, self.tensor = int(fsdp), int(tensor)
        self.active = self.fsdp * self.tensor > 1

    def axes(self, p: tuple, shape: tuple) -> list:
        """The mesh axis (``fsdp``, ``tensor`` or None) of each axis of a worker's stored leaf
        ``p`` of shape ``shape`` (no worker or stage axis; the full model's leaf under
        backward masking, a worker's compact one under forward masking).

        A leaf of a block stack (:meth:`stacked`) keeps its axis 0, the stack's, whole.

        Raises:
          ValueError: ``T`` does not divide the leaf's component count (names both and the
            fix)."""
        out = [None] * len(shape)
        if not self.active:
            return out
        split = self._tensor_axis(p, shape)
        if split is not None:
            out[split] = TENSOR
        if self.fsdp > 1:
            free = [a for a in range(len(shape)) if out[a] is None
                    and not (a == 0 and (self.stacked(p) or len(shape) > 1))
                    and shape[a] % self.fsdp == 0]
            if free:
                out[max(free, key=lambda a: (shape[a], -a))] = FSDP
        return out

    def _tensor_axis(self, p: tuple, shape: tuple) -> int | None:
        hit = self.spec.component_axes.get(p)
        if self.tensor == 1 or hit is None:
            return None
        axis, expand = hit
        count = shape[axis] // expand
        if count % self.tensor:
            name = "/".join(str(k) for k in p)
            raise ValueError(
                f"mesh.tensor={self.tensor} does not divide the {count} components (heads, key/"
                f"value groups or neurons) of {name!r} along axis {axis} that a worker holds; "
                f"choose a mesh.tensor that divides {count} (or a coverage whose held count "
                "it divides).")
        return axis

    def check(self) -> None:
        """Refuse a ``T`` the model cannot be split by, before any compile (the step and the
        run's validation, :func:`sdp_jax.train.run.resolve`, both call it): ``T > 1`` for a
        model without ``Neurons`` rules, or a ``T`` that does not divide the component count
        a worker stores of a leaf split over ``tensor`` (its held count under forward
        masking, the full count otherwise).

        Raises:
          ValueError: naming ``mesh.tensor``, the leaf and its count, and the fix."""
        if self.tensor == 1:
            return
        if not self.spec.component_axes:
            raise ValueError(f"mesh.tensor={self.tensor} splits the axes of the model's Neurons "
                             "rules over tensor, but this model declares none; declare them "
                             "(sdp_jax.spec.Neurons) or set --config.mesh.tensor=1.")
        shapes = (self.spec.shapes if self.spec.backward
                  else layout_lib.of(self.spec).stored_shapes)
        for p, shape in shapes.items():
            self._tensor_axis(p, tuple(shape))

    def rows_axes(self, shard_len: int) -> tuple:
        """The worker's own axes (``fsdp``, ``tensor``, or both) over which a leaf of the rows
        layout ``S`` (FSDP over ``data`` / ZeRO-3, and backward masking's ZeRO-2 optimizer
        state) splits the ``shard_len`` entries of a worker's row shard further: both when
        ``F x T`` divides ``shard_len``, else the one of ``F`` and ``T`` that divides it, else
        none (the shard stays whole on each of the worker's devices). The stored shape does
        not depend on ``F`` and ``T`` (a checkpoint resumes across them); the spec of its last
        axis becomes ``('data', *axes)``."""
        if not self.active:
            return ()
        for axes, size in (((FSDP, TENSOR), self.fsdp * self.tensor), ((FSDP,), self.fsdp),
                           ((TENSOR,), self.tensor)):
            sized = tuple(a for a in axes if (self.fsdp if a == FSDP else self.tensor) > 1)
            if sized and shard_len % size == 0:
                return sized
        return ()

    def in_use(self, p: tuple, x, per_block: bool = False):
        """Inside the per-worker function: leaf ``p``'s value ``x`` as the model uses it,
        gathered over ``fsdp`` (FSDP's all-gather before use; its transpose reduce-scatters
        the gradient) and kept split over ``tensor`` on its component axis. ``per_block``:
        ``x`` is one block of a stack (its stack axis dropped). Unchanged when ``F x T = 1``.
        (Gathering here, rather than leaving it to XLA, also keeps jax 0.10's partitioner off
        a gather from a table split over ``fsdp``, which it fails.)"""
        if not self.active:
            return x
        axes = [None] * x.ndim
        hit = self.spec.component_axes.get(p)
        if self.tensor > 1 and hit is not None:
            axes[hit[0] - int(per_block)] = TENSOR
        return jax.lax.with_sharding_constraint(x, P(*axes))

    def stacked(self, p: tuple) -> bool:
        """Whether stored leaf ``p`` lies in a block stack (its axis 0 the stack's)."""
        bp = self.spec.block_path
        return bool(self.spec.blocks_stacked) and bp is not None and p[:len(bp)] == bp

    def take(self, p: tuple, x, idx, fn):
        """Inside the per-worker function: ``fn(x, idx)`` (``idx`` int32, replicated), which
        indexes leaf ``p`` on its component axis (``spec.component_axes``; N-SDP's pruning to
        the held neurons and heads), run by each of the worker's devices on its own part of
        ``x`` (a nested ``jax.shard_map`` over the worker's axes: jax 0.10's partitioner
        fails a gather from a leaf split over them). The component axis is gathered first
        (over ``tensor``, or over ``fsdp`` where ``F`` splits it, as for MLP leaves when
        ``T = 1``: then that leaf is whole on each device while it is pruned); the other axes
        stay split. The result keeps ``x``'s layout but along the component axis. ``x``: the
        stored leaf (backward masking's full model). Unchanged when ``F x T = 1``."""
        axes = self.axes(p, tuple(x.shape)) if self.active else []
        names = tuple(a for a in axes if a is not None)
        if not names:
            return fn(x, idx)
        comp = self.spec.component_axes[p][0]
        out_axes = [None if i == comp else a for i, a in enumerate(axes)]

        def own_part(xl, il):
            if axes[comp] is not None:
                xl = jax.lax.all_gather(xl, axes[comp], axis=comp, tiled=True)
            return fn(xl, il)
        mesh = jax.sharding.get_abstract_mesh()
        out = jax.shard_map(own_part, mesh=mesh, in_specs=(P(*axes), P()),
                            out_specs=P(*out_axes), axis_names=set(names),
                            check_vma=False)(x, idx)
        return sync.varying(out)   # (a worker's own: its gradient is not summed over data)

    def whole(self, tree):
        """Inside the per-worker function: every leaf of ``tree`` whole on each of the
        worker's devices (gathered over ``fsdp`` and ``tensor``), for code that indexes a
        leaf along any axis (jax 0.10's partitioner fails on a gather or a scatter on a leaf
        split over a worker's own devices): one block's leaves as backward masking writes
        the held neurons and heads into the frozen ones, and N-SDP's compact leaves whose
        holders' values the full model's evaluation scatters into full layers. Unchanged
        when ``F x T = 1``."""
        if not self.active:
            return tree
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P()), tree)

    def split_rows(self, batch):
        """Inside the per-worker function: a worker's batch (leading axis its ``b`` rows)
        constrained to rows split over ``fsdp``, so that each of its ``F`` devices runs ``b /
        F`` of them (the batch enters replicated over the worker's devices: with a ``tensor``
        axis beside it, jax 0.10's partitioner fails a check on a batch that enters split over
        ``(data, fsdp)``). Unchanged when ``F = 1``."""
        if self.fsdp == 1:
            return batch
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P(FSDP)), batch)


def check_rows(fsdp: int, rows: int) -> None:
    """The one rule of a worker's rows: ``F`` divides the rows of its microbatch (each of its
    ``fsdp`` devices runs an equal share).

    Raises:
      ValueError: naming both and the fix."""
    if fsdp > 1 and rows % fsdp:
        raise ValueError(f"config.mesh.fsdp={fsdp} does not divide the {rows} rows of a "
                         "worker's microbatch (batch_per_worker / grad_accum); each fsdp device "
                         "runs an equal share: choose a batch_per_worker that it divides.")
