"""Where the ``W`` workers of the mesh axis ``data`` run: one device each, or all on one device.

A per-worker function (the train step, the evaluation, the alignment: code written for one
worker, whose collectives name the axis ``data``) becomes a function of the global arrays in one
of two ways, behind one method, :meth:`Placement.map`:

* :class:`OnDevices`: ``jax.shard_map`` over the mesh, worker ``w`` on the ``w``-th device of
  ``data`` (the mesh's ``data`` size is ``W``), or on the ``F x T`` devices of its mesh axes
  ``fsdp`` and ``tensor`` (manual over ``data`` alone); one worker of several devices
  (:class:`OneWorker`) runs as emulated below, on its ``F x T`` devices;
* :class:`Emulated`: every worker on one device (the mesh's ``data`` size is 1), the same
  per-worker function under ``jax.vmap`` with ``axis_name="data"``, so that ``psum``,
  ``all_to_all``, ``all_gather`` and ``axis_index`` over ``data`` mean what they mean across
  devices. A leaf stored split over ``data`` (``P('data')`` on dimension ``d``, a global
  ``[..., W * n, ...]`` array) is reshaped to ``[..., W, n, ...]`` and mapped on ``d``; a
  replicated leaf (``P()``) enters every worker unmapped, and leaves as worker 0's value. That
  every worker computes it alike is checked as ``jax.shard_map`` checks it: the same function
  is first traced (shapes only, no compile) under ``jax.shard_map`` over an abstract mesh of
  ``W`` devices, whose replication check refuses an output that differs between workers. The
  device then holds every worker's share of the state (``W`` times a worker's leaves stored
  per worker; a leaf stored replicated, ``P()``, once) and ``W`` workers' activations
  (:meth:`Emulated.describe`); a ``lax.cond`` whose predicate differs between workers (the
  held / unheld branch of :func:`sdp_jax.step.runner.held_weight_grads`) runs both branches.
  While a worker's function is traced under the ``vmap``, :func:`emulating` is True: the
  typed casts of ``shard_map`` (:func:`sdp_jax.sync.to_varying`) are then left out.

The global arrays, their shapes and partition specs are the same in both placements, so a
checkpoint written by one resumes under the other (the ``data`` axis of size 1 keeps them on one
device). Every variant, both averaging modes, FSDP (its shards are leaves split over ``data``),
activation checkpointing and bf16 run emulated; a pipeline (its stages are devices, ``stage``)
and several processes are refused (:func:`check_emulation`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax.mesh import DATA, FSDP, TENSOR, inner_sizes, manual_axes

_is_spec = lambda x: isinstance(x, P)  # noqa: E731
_EMULATING = contextvars.ContextVar("sdp_jax_emulating", default=False)


def emulating() -> bool:
    """Whether the function being traced is an emulated worker's (inside the ``jax.vmap`` of
    :meth:`Emulated.map`): its values carry no ``shard_map`` types, so
    :mod:`sdp_jax.sync` leaves out its typed casts (``pcast``) and reads no varying axes."""
    return _EMULATING.get()


@contextlib.contextmanager
def _emulated_trace():
    token = _EMULATING.set(True)
    try:
        yield
    finally:
        _EMULATING.reset(token)


class Placement:
    """How a per-worker function runs over the ``W`` workers (base of :class:`OnDevices` and
    :class:`Emulated`).

    Attributes:
      mesh: the run's mesh (axis ``data``, optionally ``stage``).
      workers: ``W``.
      emulated: whether every worker runs on one device.
    """

    emulated = False

    def __init__(self, mesh, workers: int):
        self.mesh, self.workers = mesh, int(workers)

    def map(self, fn: Callable, in_specs: tuple, out_specs: Any,
            check_vma: bool = True) -> Callable:
        """``fn`` (one worker's function of its local arrays, collectives over ``data``) as a
        function of the global arrays laid out by ``in_specs`` (a tuple, one PartitionSpec
        tree prefix per argument), returning arrays laid out by ``out_specs`` (a prefix of
        the output tree), as ``jax.shard_map`` takes them. Call it inside ``jax.jit``.
        ``check_vma``: ``jax.shard_map``'s check that a replicated output is typed invariant
        (leave it on unless a collective's result is equal on every worker but not typed
        so, as an FSDP all-gather)."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for a run's log: where the workers run."""
        n = self.mesh.devices.size
        return f"{self.workers} workers on {n} device{'s' if n > 1 else ''} (jax.shard_map)"


class OnDevices(Placement):
    """The workers along ``data``, each on one device or on the ``F x T`` devices of the mesh
    axes ``fsdp`` and ``tensor``: ``jax.shard_map`` manual over ``data`` (and ``stage``)
    alone. A worker's own axes stay automatic: the specs given name them (a stored leaf's
    layout over its worker's devices, :mod:`sdp_jax.step.inner`), ``shard_map`` is given the
    specs without them, and the arrays' shardings carry them into the worker's function,
    where XLA partitions its computation over them."""

    def describe(self) -> str:
        f, t = inner_sizes(self.mesh)
        return super().describe() if f * t == 1 else _workers_of_devices(self)

    def map(self, fn, in_specs, out_specs, check_vma=True):
        manual = manual_axes(self.mesh)
        if manual == frozenset(self.mesh.axis_names):
            return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma)
        keep = lambda t: jax.tree.map(lambda s: manual_spec(s, manual), t,  # noqa: E731
                                      is_leaf=_is_spec)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=keep(in_specs),
                             out_specs=keep(out_specs), check_vma=check_vma,
                             axis_names=set(manual))


def _workers_of_devices(placement: Placement) -> str:
    """The log line of workers that each span ``F x T > 1`` devices (:class:`OnDevices`,
    :class:`OneWorker`)."""
    f, t = inner_sizes(placement.mesh)
    w = placement.workers
    axes = " x ".join(placement.mesh.axis_names)
    sizes = " x ".join(str(n) for n in placement.mesh.devices.shape)
    many = f"{w} workers of {f * t} devices each" if w > 1 else f"1 worker of {f * t} devices"
    return (f"{many} (mesh {axes} = {sizes}): a worker's parameters and optimizer state sharded "
            f"over its devices, its batch rows over '{FSDP}', its heads and neurons over "
            f"'{TENSOR}'; SDP averaging over '{DATA}'")


def manual_spec(spec: P, manual) -> P:
    """``spec`` with only the mesh axes in ``manual`` (the others: None), as
    ``jax.shard_map`` over those axes takes it."""
    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(a for a in names if a in manual)
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*(None if e is None else keep(e) for e in spec))


class Emulated(Placement):
    """Every worker on one device: the per-worker function under ``jax.vmap`` over ``data``
    (the module docstring gives the layout)."""

    emulated = True

    def describe(self) -> str:
        return (f"{self.workers} worker{'s' if self.workers > 1 else ''} emulated on 1 device "
                f"(jax.vmap over '{DATA}'): the "
                f"device holds the {self.workers} workers' parameters, optimizer state and "
                f"activations, up to {self.workers} times one worker's memory")

    def _data_dim(self, spec: P) -> int | None:
        """The dimension of a leaf that ``spec`` splits over ``data`` (None: replicated)."""
        dims = [i for i, s in enumerate(spec) if s is not None]
        if any(spec[i] != DATA for i in dims) or len(dims) > 1:
            raise ValueError(f"a leaf laid out {spec} cannot be emulated: only leaves split over "
                             f"'{DATA}' alone or replicated run on one device (no pipeline "
                             "stages, no other mesh axes).")
        return dims[0] if dims else None

    def _split(self, spec: P, x):
        d = self._data_dim(spec)
        if d is None:
            return x, None
        if x.shape[d] % self.workers:
            raise ValueError(f"a leaf of shape {x.shape} does not split over W={self.workers} "
                             f"workers on dimension {d}; give it a size there that is a "
                             f"multiple of {self.workers}.")
        return x.reshape(x.shape[:d] + (self.workers, -1) + x.shape[d + 1:]), d

    def _join(self, spec: P, y):
        d = self._data_dim(spec)
        if d is None:
            return y[0]   # worker 0's copy of a value every worker computes alike
        return y.reshape(y.shape[:d] + (-1,) + y.shape[d + 2:])

    def _constrain(self, spec: P, y):
        return jax.lax.with_sharding_constraint(y, NamedSharding(self.mesh, spec))

    def _check_replication(self, fn, in_specs, out_specs, args) -> None:
        """Trace ``fn`` (shapes only) under ``jax.shard_map`` over an abstract mesh of ``W``
        devices: its check refuses a replicated output that differs between workers, as on
        ``W`` devices (raises its ValueError)."""
        mesh = AbstractMesh((self.workers,), (DATA,), axis_types=(AxisType.Auto,))
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
        jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs),
                       *shapes)

    def map(self, fn, in_specs, out_specs, check_vma=True):
        def mapped(*args):
            if len(args) != len(in_specs):
                raise ValueError(f"{len(args)} arguments for {len(in_specs)} in_specs; give "
                                 "one PartitionSpec tree per argument.")
            values, axes = [], []
            for spec, arg in zip(in_specs, args):
                leaves, tree = jax.tree.flatten(arg)
                pairs = [self._split(s, x) for s, x in zip(_leaf_specs(spec, arg), leaves)]
                values.append(tree.unflatten([v for v, _ in pairs]))
                axes.append(tree.unflatten([d for _, d in pairs]))
            if check_vma:
                self._check_replication(fn, in_specs, out_specs, args)
            out_axes = jax.tree.map(lambda s: self._data_dim(s) or 0, out_specs,
                                    is_leaf=_is_spec)
            with _emulated_trace():
                out = jax.vmap(fn, in_axes=tuple(axes), out_axes=out_axes, axis_name=DATA,
                               axis_size=self.workers)(*values)
            leaves, tree = jax.tree.flatten(out)
            return tree.unflatten([self._constrain(s, self._join(s, y))
                                   for s, y in zip(_leaf_specs(out_specs, out), leaves)])
        return mapped


class OneWorker(Emulated):
    """One worker of several devices (``W = 1``, ``F x T > 1``): the per-worker function under
    ``jax.vmap`` over ``data`` of size 1 (as :class:`Emulated`: its collectives over ``data``
    are the identity and move no bytes), every mesh axis automatic, the worker's arrays laid
    out over ``fsdp`` and ``tensor`` as the specs declare (jax 0.10's partitioner rejects a
    ``jax.shard_map`` manual over a ``data`` axis of one device beside automatic ones)."""

    emulated = False

    def describe(self) -> str:
        return _workers_of_devices(self)

    def _data_dim(self, spec: P) -> int | None:
        dims = [i for i, e in enumerate(spec) if e is not None
                and DATA in (e if isinstance(e, tuple) else (e,))]
        return dims[0] if dims else None

    def _check_replication(self, fn, in_specs, out_specs, args) -> None:
        return None   # (one worker: nothing can differ between workers)

    def map(self, fn, in_specs, out_specs, check_vma=True):
        mapped = super().map(fn, in_specs, out_specs, check_vma)

        def on_mesh(*args):
            with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
                return mapped(*args)
        return on_mesh


def _leaf_specs(specs: Any, tree: Any) -> list:
    """The PartitionSpec of every leaf of ``tree`` (flattened order), from ``specs``, a tree
    prefix of ``tree`` as ``jax.shard_map``'s ``in_specs`` and ``out_specs`` are."""
    full = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs, tree,
                        is_leaf=_is_spec)
    return jax.tree.leaves(full, is_leaf=_is_spec)


def check_emulation(stages: int, processes: int, data_devices: int = 1,
                    fix: str = "drop emulate_workers") -> None:
    """The one owner of emulation's refusals (:func:`placement_of` for :class:`sdp_jax.step.
    SDPStep`, :func:`sdp_jax.train.run.resolve` for a run config, which rewords ``fix``).

    Args:
      stages: pipeline stages (a ``stage`` mesh axis of that size, or 1); processes: the
        run's processes (``jax.process_count()``); data_devices: devices along ``data``.

    Raises:
      ValueError: a pipeline (its stages are devices), several processes, or more than one
        device along ``data``."""
    if stages > 1:
        raise ValueError(f"emulated workers run on one device, but a pipeline of {stages} stages "
                         f"runs on {stages} devices; {fix}, or run without a pipeline.")
    if processes > 1:
        raise ValueError(f"emulated workers run on one device of one process, but {processes} "
                         f"processes run; {fix}, or launch one process.")
    if data_devices != 1:
        raise ValueError(f"emulated workers run on one device, but the mesh's '{DATA}' axis has "
                         f"{data_devices} devices; build it on one device "
                         "(sdp_jax.mesh.make_mesh(W, emulated=True)), or " + fix + ".")


def placement_of(mesh, workers: int, emulate: bool) -> Placement:
    """The placement of ``W = workers`` on ``mesh``: :class:`Emulated` when ``emulate`` (on
    ``mesh`` with axis type Auto), else :class:`OnDevices`.

    Raises:
      ValueError: emulation refused (:func:`check_emulation`), or a mesh axis other than
        ``data`` and ``stage``."""
    if not emulate:
        f, t = inner_sizes(mesh)
        if workers == 1 and f * t > 1:
            return OneWorker(mesh, workers)
        return OnDevices(mesh, workers)
    shape = dict(mesh.shape)
    spans = len({d.process_index for d in mesh.devices.flat})   # one device: one process
    check_emulation(shape.get("stage", 1), spans, shape.get(DATA, 1))
    others = [a for a in mesh.axis_names if a != DATA]
    if others:
        raise ValueError(f"emulated workers run on one device, but the mesh has the axes "
                         f"{tuple(mesh.axis_names)}; give a mesh of the axis '{DATA}' alone.")
    if any(t != AxisType.Auto for t in mesh.axis_types):   # the vmap axis is not a sharded one
        mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,))
    return Emulated(mesh, workers)
