"""The mesh: its axis names, simulated CPU devices, and the run's device mesh.

One place for the names every collective uses (``data``: the W data-parallel workers, SDP's
axis; ``fsdp`` and ``tensor``: the devices inside one worker, ``F x T`` of them, over which a
worker's arrays are sharded (HSDP) and its matrices split (tensor parallelism); ``stage``: the P
pipeline stages) and for the one rule by which a CPU-only machine simulates several devices
(docs/design.md, "One step in flight on a CPU").

The names follow the JAX ecosystem's mesh axes (MaxText's ``data``, ``fsdp``, ``tensor``,
``stage``). A worker's ``F x T`` devices are adjacent in the mesh's device order (one host's
devices, or one slice's, on real hardware), so that ``data`` is the axis that crosses hosts.
"""

from __future__ import annotations

import collections
import itertools

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

DATA = "data"     # the data-parallel workers (W): every holder mean is over this axis
STAGE = "stage"   # the pipeline stages (P): sdp_jax.pipeline
FSDP = "fsdp"     # inside a worker: its parameters and optimizer state sharded (HSDP), F devices
TENSOR = "tensor"  # inside a worker: its matrices split (tensor parallelism), T devices
INNER = (FSDP, TENSOR)   # the axes of a worker's own devices (auto: laid out by XLA)


def inner_sizes(mesh) -> tuple[int, int]:
    """``(F, T)``: the devices of one worker along ``fsdp`` and ``tensor`` (1 for an axis the
    mesh lacks)."""
    shape = dict(mesh.shape)
    return int(shape.get(FSDP, 1)), int(shape.get(TENSOR, 1))


def manual_axes(mesh) -> frozenset:
    """The axes a per-worker function is written over (``data``, and ``stage`` when
    pipelined): ``jax.shard_map``'s manual axes; the others (``fsdp``, ``tensor``) stay
    automatic, laid out by the arrays' shardings."""
    return frozenset(a for a in mesh.axis_names if a not in INNER)


def simulate_cpu_devices(count) -> None:
    """Simulate at least ``count`` CPU devices: the one rule of ``train.py``, the bench, the
    studies and the tools.

    The count is only raised, never lowered, and only before JAX's backend starts (the
    setting affects the CPU platform alone: GPU and TPU runs use their real devices). Once a
    backend is up (a test process, a caller that already used JAX) its devices stay as they
    are and :func:`make_mesh` names a shortfall. A ``count`` that is not a positive integer
    is left alone here: the config's validation names it (``sdp_jax.train.run.resolve``).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        return
    if count <= int(jax.config.jax_num_cpu_devices):
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:   # the backend already started: keep its devices
        pass


def check_devices_per_process(devices=None) -> None:
    """Refuse processes that hold unequal numbers of devices (``devices``: default
    ``jax.devices()``, every process's, each with its ``process_index``): the global batch's
    rows and the checkpoints' shards are laid out evenly over the processes, so e.g. 3 + 1
    devices would end in a reshape error inside the checkpoint manager on one process.

    Raises:
      ValueError: one line naming each process's device count and the fix."""
    devices = jax.devices() if devices is None else devices
    counts = collections.Counter(int(d.process_index) for d in devices)
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"process {p}: {n}" for p, n in sorted(counts.items()))
        raise ValueError(f"the processes hold unequal numbers of devices ({shown}); give every "
                         "process the same number (the same CUDA_VISIBLE_DEVICES count, or "
                         "--config.num_cpu_devices on a CPU)")


def check_worker_shape(workers: int, stages: int = 1, fsdp: int = 1, tensor: int = 1) -> None:
    """The one rule of what a worker of several devices (``F x T > 1``) does not compose with
    here: a pipeline (``stages > 1``). (A single worker of several devices, ``W = 1``, runs
    as :class:`sdp_jax.sync.placement.OneWorker`.)
    :func:`make_mesh`, :class:`sdp_jax.step.SDPStep` (a user's mesh) and a run's validation
    (:func:`sdp_jax.train.run.resolve`, before any compile) all ask it.

    Raises:
      ValueError: one line naming the sizes and the fix."""
    if fsdp * tensor == 1:
        return
    sizes = f"mesh.fsdp x mesh.tensor = {fsdp} x {tensor}"
    if stages > 1:
        raise ValueError(f"a pipeline (pipeline.stages={stages}) with workers of several devices "
                         f"({sizes}) is not built; set --config.mesh.fsdp=1 "
                         "--config.mesh.tensor=1, or --config.pipeline.stages=1.")


def _granule(d) -> tuple[int, int]:
    """A device's unit of the slow network: its TPU slice (``slice_index``, 0 where the
    platform sets none), then its process (host)."""
    return int(getattr(d, "slice_index", 0) or 0), int(d.process_index)


def worker_grid(devices, workers: int, fsdp: int, tensor: int) -> np.ndarray:
    """The devices of ``W`` workers of ``F x T`` devices each, as a ``[W, F, T]`` object array:
    the device order of a ``data x fsdp x tensor`` mesh.

    Devices are grouped by TPU slice (``slice_index``), then by process (host), and taken
    group after group, so that a worker's devices are one host's, or several whole hosts
    taken in order (a slice's, when its hosts are a multiple of them), and ``data`` is the
    axis between them. Inside each group, or each worker spanning several, the ``[k, F, T]``
    order comes from ``jax.experimental.mesh_utils.create_device_mesh`` (on a TPU it follows
    the chips' physical torus, so that ``tensor`` and ``fsdp`` run over neighbouring chips;
    elsewhere it keeps the id order); where that cannot lay the devices out, their id order
    is kept.

    Args:
      devices: at least ``W * F * T`` devices (``jax.devices()``); the first are used.
      workers, fsdp, tensor: ``W``, ``F``, ``T``.

    Raises:
      ValueError: fewer than ``W * F * T`` devices; with several hosts of equal device
        counts, ``F x T`` neither dividing nor a multiple of a host's devices (a worker
        would straddle two hosts; names both and the fix)."""
    inner = fsdp * tensor
    need = workers * inner
    if need > len(devices):
        raise ValueError(f"{need} devices needed for {workers} workers of {fsdp} x {tensor}, "
                         f"{len(devices)} present; lower --config.workers or "
                         "--config.mesh.fsdp / --config.mesh.tensor")
    ordered = sorted(devices, key=lambda d: (*_granule(d), d.id))[:need]
    groups = [list(g) for _, g in itertools.groupby(ordered, key=_granule)]
    size = len(groups[0])
    if inner > 1 and all(len(g) == size for g in groups):
        if size % inner == 0:     # whole workers per host or slice
            parts = [(g, (size // inner, fsdp, tensor)) for g in groups]
        elif inner % size == 0:   # a worker spans inner / size whole hosts, in order
            k = inner // size
            parts = [(sum(groups[i:i + k], []), (1, fsdp, tensor))
                     for i in range(0, len(groups), k)]
        elif len(groups) > 1:
            raise ValueError(
                f"a worker of mesh.fsdp x mesh.tensor = {fsdp} x {tensor} = {inner} devices "
                f"would straddle two of the hosts of {size} devices each; choose a "
                f"mesh.fsdp x mesh.tensor that divides {size} or is a multiple of it.")
        else:
            parts = []
        try:
            if parts:
                return np.concatenate([mesh_utils.create_device_mesh(shape, devs)
                                       for devs, shape in parts])
        except (ValueError, AssertionError, NotImplementedError):   # no such physical layout
            pass
    return np.asarray(ordered, dtype=object).reshape(workers, fsdp, tensor)


def make_mesh(workers: int, stages: int = 1, devices=None, emulated: bool = False,
              fsdp: int = 1, tensor: int = 1) -> Mesh:
    """The run's mesh: ``('data',)`` of ``W`` devices; ``('data', 'stage')`` of shape
    ``(W, P)`` when pipelined; ``('data', 'fsdp', 'tensor')`` of shape ``(W, F, T)`` when a
    worker spans ``F x T > 1`` devices (axis types Auto: the pipeline's averaging and a
    worker's inner layout are written in the global view and partitioned by XLA).
    ``emulated``: the mesh of workers emulated on one device (:mod:`sdp_jax.sync.placement`):
    ``('data',)`` of one device, axis type Auto (the per-worker ``jax.vmap`` axis is not a
    sharded one), whatever ``workers``.

    Devices are taken in process order (then by id), so that each process's devices are
    adjacent on ``data`` and it loads one contiguous range of batch rows; with ``F x T > 1``
    they are grouped by TPU slice, then by host, a worker's devices one host's or several
    whole hosts', laid out by the chips' topology (:func:`worker_grid`).

    Raises:
      ValueError: fewer devices than ``W * P * F * T`` (names the counts and the fix); a
        pipeline with ``F x T > 1`` (:func:`check_worker_shape`).
    """
    devices = list(devices if devices is not None else jax.devices())
    if emulated:
        return jax.make_mesh((1,), (DATA,), axis_types=(AxisType.Auto,), devices=devices[:1])
    inner = fsdp * tensor
    check_worker_shape(workers, stages, fsdp, tensor)
    need = workers * stages * inner
    if need > len(devices):
        what = (f"workers * pipeline.stages = {workers} * {stages} = {need}:" if stages > 1
                else f"workers * mesh.fsdp * mesh.tensor = {workers} * {fsdp} * {tensor} = "
                     f"{need}:" if inner > 1 else f"workers = {need}:")
        raise ValueError(f"{what} devices needed, {len(devices)} "
                         f"{devices[0].platform if devices else ''} devices present; lower "
                         "--config.workers" + (" or --config.pipeline.stages" if stages > 1 else "")
                         + (" or --config.mesh.fsdp / --config.mesh.tensor" if inner > 1 else "")
                         + " (on a CPU, raise --config.num_cpu_devices).")
    if inner > 1:
        return Mesh(worker_grid(devices, workers, fsdp, tensor), (DATA, FSDP, TENSOR),
                    axis_types=(AxisType.Auto,) * 3)
    devices = devices[:need]
    if stages > 1:
        mesh = jax.make_mesh((workers, stages), (DATA, STAGE),
                             axis_types=(AxisType.Auto,) * 2, devices=devices)
    else:
        mesh = jax.make_mesh((workers,), (DATA,), devices=devices)
    if jax.process_count() > 1:
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        mesh = Mesh(np.asarray(ordered, dtype=object).reshape(mesh.devices.shape),
                    mesh.axis_names, axis_types=mesh.axis_types)
    return mesh
