"""Elastic resume: continue a checkpoint under another worker count ``W``, coverage, mask
scheme, variant, FSDP setting or batch per worker (``--config.elastic=True``).

SDP keeps every component on at least one worker, and after gradient averaging all holders of
a component hold equal values and equal optimizer moments (docs/design.md invariant 10). So
the full model and its optimizer state can be rebuilt exactly from any checkpoint and laid out
anew under the masks of the new setting:

1. the checkpoint's run is resolved from its recorded config (:func:`checkpoint_run`) and its
   state read to host memory in its own layout, emulated on one local device (no mesh of the
   old size is needed: a run of 8 workers resumes on 6 devices, or on 1 process of 2);
2. the parameters and every parameter-shaped entry of the optimizer state (the moments) are
   joined into full arrays, each component from its first holder (bit for bit), or as the
   mean of its holders' copies under periodic parameter averaging
   (:meth:`sdp_jax.step.SDPStep.full_params`); counts and other entries are kept;
3. the new run lays them out under its own masks (:meth:`sdp_jax.step.SDPStep.store`,
   on the host's CPU backend; each device then receives only its own share), at the
   checkpoint's step.

The step count carries on. The data position carries on in examples: when the global batch
``W * batch_per_worker`` changes, the new run's stream begins where the old one stopped
(:class:`sdp_jax.train.data.Origin`, recorded in every later checkpoint), so no training
example is skipped or read twice across the switch. Every switch is logged and recorded in
the checkpoints and in ``summary.json`` (``elastic``).

Every process reads the whole checkpoint into its host memory once: the old layout's stored
copies (about ``W_old * C`` times the parameters and moments under forward masking), then the
full parameters and moments, then the new layout's stored copies of one tree at a time.
Pipelined runs are not re-laid out (refused in one line).
"""

from __future__ import annotations

import copy
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sdp_jax import mesh as mesh_lib
from sdp_jax.options import MeshShape
from sdp_jax.step import state as state_lib
from sdp_jax.train import run as run_lib
from sdp_jax.train.data import tokens as data_lib

# The config fields an elastic resume may change (dotted; "x." a whole section; "masks." the
# recorded mask recipes, which follow from the others).
FIELDS = ("workers", "batch_per_worker", "fsdp", "sdp.", "masks.")
HINT = ("Or continue it under this run's setting with --config.elastic=True (the full model "
        "and its optimizer moments rebuilt and laid out under new masks).")


def saved_workers(saved: dict) -> int:
    """The resolved ``W`` a checkpoint's meta records (checkpoints from before it was recorded:
    their config's explicit ``workers``)."""
    return int(saved.get("workers", saved["config"].get("workers")))


def describe(config_or_saved, workers: int) -> dict:
    """The setting an elastic switch reports: ``workers`` (W), ``variant``, ``coverage``,
    ``scheme``, ``fsdp``, ``global_batch`` (examples per step), from a config (ConfigDict or
    its JSON dict)."""
    c = config_or_saved
    sdp = c["sdp"]
    return {"workers": int(workers), "variant": sdp["variant"],
            "coverage": float(sdp["coverage"]), "scheme": sdp["scheme"],
            "fsdp": bool(c["fsdp"]), "global_batch": int(workers) * int(c["batch_per_worker"])}


def change_line(saved: dict, run: run_lib.RunSpec) -> str:
    """What an elastic switch changes, e.g. ``"workers 8 -> 6, global_batch 16 -> 12"``
    (``saved``: the checkpoint's meta; the mask recipes follow and are not named)."""
    before = describe(saved["config"], saved_workers(saved))
    after = describe(run.config, run.workers)
    moved = [f"{k} {before[k]} -> {after[k]}" for k in before if before[k] != after[k]]
    return ", ".join(moved) or "the mask recipe (another mask seed or option)"


def recorded_setting(saved: dict) -> dict:
    """The setting a checkpoint was written under (``saved``: its ``meta``), as dotted
    config fields: the resolved ``workers``, ``batch_per_worker``, ``fsdp`` and every
    ``sdp.KEY``: the fields an elastic resume may change (:data:`FIELDS`; the mask recipes
    follow from them)."""
    old = saved["config"]
    out = {"workers": saved_workers(saved), "batch_per_worker": old["batch_per_worker"],
           "fsdp": old["fsdp"]}
    out.update({f"sdp.{k}": tuple(v) if isinstance(v, list) else v
                for k, v in old["sdp"].items()})
    return out


def _field(config, name: str):
    """The dotted field ``name`` of ``config``."""
    section, _, key = name.rpartition(".")
    return (config[section] if section else config)[key]


def _set(config, name: str, value) -> None:
    """Set the dotted field ``name`` of an unlocked ``config``."""
    section, _, key = name.rpartition(".")
    (config[section] if section else config)[key] = value


def checkpoint_run(run: run_lib.RunSpec, saved: dict) -> run_lib.RunSpec:
    """The run that wrote a checkpoint (its ``meta`` item ``saved``), resolved as this run's
    config with the checkpoint's elastic fields (:func:`recorded_setting`), emulated on one
    local device (its layout only: nothing of it is compiled).

    Raises:
      ValueError: the checkpoint's config no longer resolves (names the field)."""
    config = copy.deepcopy(run.config)
    with config.unlocked():
        for name, value in recorded_setting(saved).items():
            _set(config, name, value)
        config.emulate_workers = True
        _one_device_workers(config)
        config.grad_accum, config.align_every = 1, 0
        config.profile_start = config.profile_stop = 0
    return run_lib.resolve(config, 1, run.family, processes=1)


def _one_device_workers(config) -> None:
    """Workers of one device each (``mesh.fsdp = mesh.tensor = 1``) in an unlocked ``config``:
    the stored arrays' global shapes are the same on any ``F x T`` (a worker's devices only
    shard them), so a checkpoint's layout is read with its workers emulated on one device."""
    if "mesh" in config:
        config.mesh.fsdp = config.mesh.tensor = 1


def as_written(config, saved: dict, given, device_count: int):
    """``config`` (a copy) under the setting of the checkpoint whose meta is ``saved``, for
    reading the checkpoint back as it is (the tools, :func:`sdp_jax.tools.trained.load`).

    ``config.json`` names a run's newest setting once its step is compiled: after an elastic
    switch (``--config.elastic=True``) that stopped before its first save, or for an earlier
    checkpoint (``--step``) of a run that switched since, the checkpoint read is the old
    setting's. Every field of :func:`recorded_setting` that
    ``config`` holds as ``given`` does (``given``: the run's config.json; a field the caller
    overrode stays the caller's, and the compatibility check names it) is taken from the
    checkpoint; ``workers`` only when the resolved ``W`` differs (``workers=0`` stays 0 when
    it resolves to the checkpoint's ``W`` on ``device_count`` devices). A checkpoint's ``W x F
    x T`` larger than ``device_count`` is emulated on one device (``emulate_workers``, workers
    of one device each: the same results, to float rounding). A config that already is the checkpoint's is returned as
    it is."""
    setting = recorded_setting(saved)
    stages = int(config.get("pipeline", {}).get("stages", 1))
    try:
        same_w = run_lib.resolve_workers(config, device_count, stages, processes=1,
                                         inner=MeshShape.from_config(config).devices) \
            == setting["workers"]
    except ValueError:   # (more workers than devices: not the checkpoint's W here either)
        same_w = False
    moved = {name: value for name, value in setting.items()
             if name != "workers" and _field(config, name) != value
             and _field(config, name) == _field(given, name)}
    if not same_w and config.workers == given.workers:
        moved["workers"] = setting["workers"]
    if not moved:
        return config
    config = copy.deepcopy(config)
    with config.unlocked(), config.ignore_type():
        for name, value in moved.items():
            _set(config, name, value)
        if config.workers * MeshShape.from_config(config).devices > device_count \
                and stages == 1:
            config.emulate_workers = True
            _one_device_workers(config)
    return config


def check(run: run_lib.RunSpec, saved: dict, stream) -> None:
    """Refuse, before any compute, a switch that is not built: a pipelined run, or a user's
    model whose batches are indexed by step (not a :class:`sdp_jax.train.data.Stream`) when
    the global batch changes.

    Raises:
      ValueError: naming the reason and the fix."""
    if run.pipe.stages > 1:
        raise ValueError("--config.elastic=True: a pipelined run is not re-laid out under "
                         "another setting (not built); resume it with the checkpoint's "
                         "values, or use a new --workdir.")
    before = describe(saved["config"], saved_workers(saved))["global_batch"]
    if before != run.global_batch and not isinstance(stream, data_lib.Stream):
        raise ValueError(f"--config.elastic=True: this model's batches are indexed by step, so "
                         f"the global batch cannot change across the switch (checkpoint "
                         f"{before}, this run {run.global_batch}); keep W * batch_per_worker "
                         f"= {before}, e.g. --config.batch_per_worker="
                         f"{max(before // run.workers, 1)}.")


def _lay(fn, full, abstract):
    """``fn(full)`` (full host arrays -> a stored tree), placed as ``abstract``
    (ShapeDtypeStructs with shardings): computed on this process's own CPU device (with
    several processes ``jax.devices("cpu")[0]`` is process 0's, which no other process can
    read back), each of this process's devices then given only its own slice, so no device
    holds more than its share; without a CPU backend (``JAX_PLATFORMS`` without ``cpu``),
    computed on the mesh, where every device briefly holds ``full``."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.jit(fn, out_shardings=jax.tree.map(lambda a: a.sharding, abstract))(full)
    with jax.default_device(cpu):
        host = jax.tree.map(np.asarray, jax.jit(fn)(full))
    return jax.tree.map(lambda x, a: jax.make_array_from_callback(
        a.shape, a.sharding, lambda index: x[index]), host, abstract)


def lay_out(builder, full: dict, step: int) -> dict:
    """:meth:`sdp_jax.step.SDPStep.full_state`'s output -> a train state in ``builder``'s
    layout on its mesh, at ``step`` (:meth:`sdp_jax.step.SDPStep.store`, placed by
    :func:`_lay`: each device receives only its share).

    Raises:
      ValueError: the optimizer state's structure differs (another optimizer)."""
    abstract = builder.abstract_state()
    fresh, tdef, is_new = state_lib.split_moments(abstract["opt_state"], builder.compact_shapes)
    old, old_def, _ = state_lib.split_moments(full["opt_state"], full["params"])
    if tdef != old_def:
        raise ValueError("--config.elastic=True: the checkpoint's optimizer state has another "
                         "structure than this run's optimizer; resume with the checkpoint's "
                         "optimizer settings.")
    moment = lambda t: builder.store(t, "moment")  # noqa: E731
    leaves = [_lay(moment, o, a) if m else _lay(jnp.asarray, np.asarray(o, a.dtype), a)
              for a, o, m in zip(fresh, old, is_new)]
    state = {"params": _lay(builder.store, full["params"], abstract["params"]),
             "opt_state": tdef.unflatten(leaves),
             "step": _lay(jnp.asarray, np.int32(step), abstract["step"])}
    if full["stats"] is not None:
        state["stats"] = _lay(lambda t: builder.store(t, "stats"), full["stats"],
                              abstract["stats"])
    return state


def read_full(manager, step: int, saved: dict, run: run_lib.RunSpec):
    """``(full, old)``: the checkpoint at ``step`` (``saved``: its ``meta``) read to this
    process's host memory in its own layout (emulated on one local device) and joined into
    the full model and optimizer state (:meth:`sdp_jax.step.SDPStep.full_state`); ``old``:
    the checkpoint's run (:func:`checkpoint_run`). Every process reads the whole checkpoint.

    Raises:
      ValueError: an unreadable checkpoint, or one whose layout is not its recorded run's
        (names the leaves)."""
    old = checkpoint_run(run, saved)
    mesh = mesh_lib.make_mesh(old.workers, emulated=True, devices=jax.local_devices())
    old_builder = old.family.step(old, mesh)
    target = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), old_builder.abstract_state())
    state = manager.restore(step, target)
    return old_builder.full_state(state, old.options.periodic), old


def rebuild(manager, step: int, saved: dict, run: run_lib.RunSpec, builder,
            log: Callable[[str], None]) -> dict:
    """The checkpoint at ``step`` (``saved``: its ``meta``) laid out for ``run``'s
    ``builder`` (:func:`read_full`, then :func:`lay_out`: each process places only its own
    devices' shares), with one line logged.

    Raises:
      ValueError: an unreadable checkpoint, or one whose layout is not its recorded run's
        (names the leaves)."""
    full, old = read_full(manager, step, saved, run)
    average = old.options.periodic
    log(f"elastic resume (--config.elastic) at step {step}: {change_line(saved, run)}; the "
        f"full model and its optimizer moments rebuilt from the checkpoint's {old.workers} "
        "workers" + (" (holders' copies averaged)" if average else "")
        + " and laid out under this run's masks"
        + (f"; the run is now {run.total_steps} steps (was {old.total_steps}: flop_matched "
           "at the new coverage; the schedule follows the new length)"
           if run.total_steps != old.total_steps else ""))
    return lay_out(builder, full, step)


def origin(saved: dict, step: int, run: run_lib.RunSpec, stream,
           switched: bool) -> data_lib.Origin:
    """The data stream's origin after resuming the checkpoint at ``step`` (``saved``: its
    meta): the checkpoint's (``Origin(0, 0)`` when it records none), or, after an elastic
    switch (``switched``) that changes the global batch, a new one at the first example the
    checkpoint's run had not read."""
    before = data_lib.Origin(*saved.get("data_origin", (0, 0)))
    if not switched or not isinstance(stream, data_lib.Stream):
        return before
    old_batch = describe(saved["config"], saved_workers(saved))["global_batch"]
    if old_batch == run.global_batch:
        return before
    return data_lib.Origin(step, stream.position(before, step, old_batch))
