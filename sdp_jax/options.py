"""What a train step is given besides the spec, the optimizer and the mesh: its options
(:class:`StepOptions`, every setting declared once with its run-config field, doc and rule) and
the model's functions (:class:`ModelHooks`).

A run config's step settings are these declarations: :mod:`sdp_jax.train.config` builds its
fields from them (same names, defaults and docs), :meth:`StepOptions.from_config` reads a
config into one object, and every refusal names the field as the command line sets it
(``config.sdp.average='x'`` for ``--config.sdp.average``). docs/configuration.md lists them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp

from sdp_jax.fields import (check_settings, config_path, read_settings, setting, setting_name,
                            settings)

# Activation checkpointing modes of the block runner (sdp_jax.step.runner.remat_block).
REMAT = ("none", "full", "dots")
# Compute dtypes, and the short names a config may give (recorded under the canonical name).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32"}


def _name(field: str) -> str:
    """How messages name a :class:`StepOptions` field: its run-config field
    (:func:`sdp_jax.fields.setting_name`, e.g. ``config.sdp.average``)."""
    return setting_name(StepOptions, next(f for f in settings(StepOptions) if f.name == field))


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The settings of one :class:`sdp_jax.step.SDPStep`, checked when built.

    Every field is declared once (:func:`sdp_jax.fields.setting`): its run-config field
    (``path``), default, one-line doc and rule. A run builds it from its config
    (:meth:`from_config`); a library user writes ``StepOptions(fsdp=True, remat="full")``.

    Raises:
      ValueError: one line naming the field as a run config sets it (``config.sdp.average``,
        the flag ``--config.sdp.average``), the value and the rule: a value of the wrong type
        or out of bounds; parameter averaging with FSDP; ``sync_every`` other than 1 without
        parameter averaging.
    """

    average: str = setting(
        "gradients", "gradients (every step; C = 1 is DDP) or parameters (each worker steps on "
        "its own gradient, parameters averaged over holders every sync_every steps)",
        path="sdp.average", choices=("gradients", "parameters"))
    sync_every: int = setting(
        1, "H, the steps between parameter averagings (sdp.average=parameters)",
        path="sdp.sync_every", kind=int, low=1)
    method: str = setting(
        "auto", "averaging of masked leaves: auto (= alltoall), alltoall (holder-only bytes) "
        "or reference (the full-size masked psum)",
        path="sdp.method", choices=("auto", "alltoall", "reference"))
    fsdp: bool = setting(
        False, "shard parameters, gradients and optimizer state over the workers (ZeRO-3)",
        path="fsdp", kind=bool)
    remat: str = setting(
        "none", "activation checkpointing of every block: none, full (save the block input) "
        "or dots (also matmul outputs); vision models: none or full",
        path="remat", choices=REMAT, control=True)
    dtype: str | None = setting(
        None, "compute dtype, float32 or bfloat16 (bf16): floating parameters are cast to it "
        "before the loss (the stored parameters, optimizer state and gradient averaging keep "
        "their dtype: float32 in a run); None = as stored", path="dtype",
        kind=str, choices=tuple(DTYPES), run_default="float32")
    emulate_workers: bool = setting(
        False, "run the W workers on one device (jax.vmap; W times one worker's memory)",
        path="emulate_workers", kind=bool, control=True)
    grad_accum: int = setting(
        1, "microbatches per optimizer step, run one after another; 1 = no accumulation",
        path="grad_accum", kind=int, low=1, control=True)
    grad_clip: float = setting(
        0.0, "clip the averaged gradient to this global norm (each component counted once); "
        "0 = no clipping (a run's default: 1)", path="optim.grad_clip", kind=float, low=0,
        run_default=1.0)
    total_steps: int | None = setting(
        None, "the run's optimizer steps (the last one averages under parameter averaging); "
        "None = unknown", path=None, kind=int, low=0)
    unroll: bool = setting(
        False, "unroll the block scan (XLA counts a loop body's FLOPs once; same results)",
        path=None)

    def __post_init__(self):
        if self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        check_settings(self)
        for f in settings(self):   # numpy scalars (np.float32(0.5), np.True_) as Python's
            value, kind = getattr(self, f.name), f.metadata["kind"]
            if value is not None and kind in (bool, int, float):
                object.__setattr__(self, f.name, kind(value))
        average, fsdp, sync_every = (_name(n) for n in ("average", "fsdp", "sync_every"))
        if self.periodic and self.fsdp:
            raise ValueError(f"{average}=parameters needs per-worker parameter copies, but FSDP "
                             f"stores one sharded copy ({fsdp}=True); use "
                             f"--{average}=gradients, or --{fsdp}=False.")
        if not self.periodic and self.sync_every != 1:
            raise ValueError(f"{sync_every}={self.sync_every} only applies with "
                             f"--{average}=parameters (gradients are averaged every step); set "
                             "both or neither.")

    @classmethod
    def from_config(cls, config, **library) -> "StepOptions":
        """The options a run config gives (each field read at its declared path), with
        ``library`` (the fields no config sets: ``total_steps``, ``unroll``).

        Raises:
          ValueError: as the class does."""
        return cls(**read_settings(cls, config), **library)

    def check_for(self, spec, remat_modes: tuple = REMAT) -> None:
        """Refuse options the model or the masking regime does not support.

        Args:
          spec: the run's :class:`sdp_jax.spec.SDPSpec` (backward masking keeps every worker's
            full parameters identical: no parameter averaging).
          remat_modes: the activation checkpointing modes the model supports.

        Raises:
          ValueError: naming the field, the value and the fix."""
        if self.remat not in remat_modes:
            raise ValueError(f"{_name('remat')}={self.remat!r}; use one of "
                             f"{', '.join(remat_modes)} (activation checkpointing of every "
                             "block).")
        if self.periodic and spec.backward:
            raise ValueError(f"{_name('average')}=parameters is not available for "
                             f"{spec.variant} (backward masking keeps every worker's full "
                             f"parameters identical); use --{_name('average')}=gradients or a "
                             "forward variant (ddp, b-sdp, n-sdp).")

    @property
    def periodic(self) -> bool:
        """Periodic parameter averaging (``average="parameters"``)."""
        return self.average == "parameters"

    @property
    def reference(self) -> bool:
        """Masked leaves averaged by the full-size masked psum (``method="reference"``)
        instead of the holder-only all_to_alls (:func:`sdp_jax.sync.average`)."""
        return self.method == "reference"

    @property
    def flops_counted(self) -> bool:
        """Whether XLA's cost analysis of the compiled step counts every FLOP of it: it counts
        a loop body once, so not with activation checkpointing's block scan (``remat``) or
        the accumulation loop (``grad_accum > 1``)."""
        return self.remat == "none" and self.grad_accum == 1

    def describe(self, workers: int, batch_per_worker: int) -> str:
        """The settings that make this step differ from plain DDP's, as a run's opening line
        and the bench print them: ``"; FSDP (ZeRO-3) over the 8 workers; activation
        checkpointing: full; ..."`` (``""`` for none; ``batch_per_worker`` sizes the
        accumulation's microbatches)."""
        return ((f"; parameters averaged over holders every {self.sync_every} steps"
                 if self.periodic else "")
                + (f"; FSDP (ZeRO-3) over the {workers} workers" if self.fsdp else "")
                + (f"; activation checkpointing: {self.remat}" if self.remat != "none" else "")
                + (f"; compute dtype {self.dtype}" if self.dtype not in (None, "float32")
                   else "")
                + (f"; gradient accumulation over {self.grad_accum} microbatches of "
                   f"{batch_per_worker // self.grad_accum}" if self.grad_accum > 1 else ""))

    def record(self) -> dict:
        """``{field: value}`` of the settings a run config sets (its names: ``average``,
        ``fsdp``, ``grad_accum``, ...), for ``summary.json``."""
        return {f.name: getattr(self, f.name) for f in settings(self)
                if config_path(type(self), f)}

    @property
    def compute_dtype(self):
        """The compute dtype as a ``jnp.dtype`` (None: as stored)."""
        return None if self.dtype is None else jnp.dtype(DTYPES[self.dtype])


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The devices of one worker: ``F`` along the mesh axis ``fsdp`` and ``T`` along
    ``tensor`` (section ``mesh``; ``W`` is ``config.workers``); the run's mesh is ``W x F x
    T`` devices (:func:`sdp_jax.mesh.make_mesh`). A worker's parameters and optimizer state
    are sharded over its ``F x T`` devices and its batch rows split over ``fsdp`` (HSDP:
    FSDP inside a worker, data parallelism across, as torchtitan's ``dp_shard`` x
    ``dp_replicate``); its attention heads and MLP neurons (the axes of the model's
    ``Neurons`` rules) are split over ``tensor`` (Megatron-style column and row splits;
    Shoeybi et al. 2019, Sec. 3). The averaging over holders stays over ``data``.

    Raises:
      ValueError: a size that is not a positive integer, naming ``config.mesh.FIELD``."""

    SECTION = "mesh"

    fsdp: int = setting(1, "F, devices per worker along the mesh axis fsdp: the worker's "
                        "parameters, gradients and optimizer state sharded over them, its batch "
                        "rows split (HSDP); 1 = none (config.fsdp shards over the workers)",
                        low=1, control=True)
    tensor: int = setting(1, "T, devices per worker along the mesh axis tensor: attention heads "
                          "and MLP neurons split over them (tensor parallelism; LLaMA); 1 = none",
                          low=1, control=True)

    def __post_init__(self):
        check_settings(self)

    @classmethod
    def from_config(cls, config) -> "MeshShape":
        """The section ``mesh`` of a run config (the defaults when it has none)."""
        return cls(**read_settings(cls, config)) if "mesh" in config else cls()

    @property
    def devices(self) -> int:
        """``F x T``, the devices of one worker."""
        return self.fsdp * self.tensor


@dataclasses.dataclass(frozen=True)
class ModelHooks:
    """The model's functions a train step calls (see :class:`sdp_jax.step.SDPStep`).

    Attributes:
      loss_fn: ``(params, batch) -> loss`` or, with ``block_fn``, ``(params, batch, run) ->
        loss``; float32 scalar, ``(loss, aux dict)`` with ``has_aux``, and with
        ``state_spec`` also the new model state last.
      block_fn: ``(block_params, h) -> h`` for one block of the stacked block subtree (the
        block runner: needed by FSDP's per-block gathers and activation checkpointing).
      init_fn: ``seed -> full parameters`` for :meth:`sdp_jax.step.SDPStep.init_state`.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; the aux values are averaged over workers
        and reported as metrics.
      state_spec: the :class:`sdp_jax.spec.SDPSpec` of non-gradient model state (e.g.
        BatchNorm statistics), built with the same variant, W and masks as the parameters'.
      stacked_slots: list-form block slots reach ``loss_fn`` stacked as stored.
      param_metrics: ``params -> {name: float32 scalar}`` of the worker's updated
        parameters, reported as metrics.
      extras: anything the builder of the step attaches for its callers, e.g. the vision
        model of :func:`sdp_jax.train.families.vision_step`, which its evaluation reads; the
        step keeps it as :attr:`sdp_jax.step.SDPStep.extras` and never reads it.
    """

    loss_fn: Callable
    block_fn: Callable | None = None
    init_fn: Callable | None = None
    has_aux: bool = False
    state_spec: Any = None
    stacked_slots: bool = False
    param_metrics: Callable | None = None
    extras: Any = None

    def __post_init__(self):
        if not callable(self.loss_fn):
            raise ValueError(f"loss_fn={self.loss_fn!r} is not callable; give the model's "
                             "loss, (params, batch) -> float32 scalar.")
