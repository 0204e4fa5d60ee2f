"""The regime of one train step, decided once: forward or backward masking, FSDP, periodic
parameter averaging, the block runner, and what each piece of the step does under it.

:meth:`Regime.of` reads the spec and the step's options once; every piece then asks the regime
instead of working the combination out again:

* the layout kind of each stored leaf (:meth:`Regime.kind`, for
  :class:`sdp_jax.step.state.StateLayout`);
* whether the optimizer works on shards (:attr:`Regime.sharded_update`, ZeRO-2 / ZeRO-3);
* whether block gradients may be averaged inside the backward loop
  (:attr:`Regime.averages_in_loop`, :func:`sdp_jax.step.sources.in_loop_tables`);
* the parameter source (:attr:`Regime.source`: where a worker's parameters come from and where
  its gradients go, :func:`sdp_jax.step.sources.source_of`), the update
  (:attr:`Regime.update`, :func:`sdp_jax.step.update.update_of`), and through the source the
  evaluation's gather (:class:`sdp_jax.step.evaluation.Evaluation` asks it) and the checkpoint
  layouts earlier releases wrote (:meth:`sdp_jax.step.sources.Source.earlier_layouts`, which
  :mod:`sdp_jax.train.migrations` tries).

The four regimes (Singh et al., arXiv 2507.09029, Sec. 3: forward masking runs the subnetwork,
backward masking the full model with sparse gradients; FSDP is ZeRO-3, Rajbhandari et al. 2020):

========================  ===================  =====================  ==================
regime                    parameters stored    optimizer state        update
========================  ===================  =====================  ==================
forward (compact)         C / R (Rw periodic)  as the parameters      averaged, periodic
backward (held)           R (full copies)      S (ZeRO-2) in blocks   sharded
FSDP with block runner    S                    S                      sharded
FSDP of the whole model   S                    S                      sharded
========================  ===================  =====================  ==================
"""

from __future__ import annotations

import dataclasses
import enum

from sdp_jax.options import StepOptions


class Kind(enum.StrEnum):
    """How one stored leaf lies on the mesh (:mod:`sdp_jax.step.state` gives the shapes)."""

    REPLICATED = "R"
    COMPACT = "C"
    PER_WORKER = "Rw"
    SHARDED = "S"


class Source(enum.StrEnum):
    """The parameter source of a regime (:mod:`sdp_jax.step.sources`)."""

    COMPACT = "compact"            # forward masking: the worker's compact subnetwork
    BACKWARD_HELD = "backward"     # backward masking: the full model, held gradients
    FSDP_BLOCKS = "fsdp-blocks"    # FSDP, each block gathered when it runs
    FSDP_WHOLE = "fsdp-whole"      # FSDP, the whole model gathered at the start of the step


class Update(enum.StrEnum):
    """The update of a regime (:mod:`sdp_jax.step.update`)."""

    AVERAGED = "averaged"          # holder-averaged gradients, every step
    PERIODIC = "periodic"          # local steps, parameters averaged every H steps
    SHARDED = "sharded"            # the optimizer on each device's shards (ZeRO-2 / ZeRO-3)


@dataclasses.dataclass(frozen=True)
class Regime:
    """What one step does, decided once (see the module docstring).

    Attributes:
      backward: backward masking (``bb-sdp``, ``nb-sdp``): every worker runs the full model.
      fsdp: parameters, gradients and optimizer state sharded over the workers.
      periodic: parameter averaging every ``sync_every`` steps (forward masking, no FSDP).
      runner: the model has a block runner (``block_fn``).
      staged: the mesh has a pipeline axis ``stage``.
      reference: masked leaves averaged by the full-size masked psum.
      accumulating: gradient accumulation over several microbatches.
      inner: ``(F, T)``, the devices of one worker along the mesh axes ``fsdp`` and
        ``tensor``: its stored leaves laid out over them (:mod:`sdp_jax.step.inner`).
    """

    backward: bool
    fsdp: bool
    periodic: bool
    runner: bool
    staged: bool
    reference: bool
    accumulating: bool
    inner: tuple[int, int] = (1, 1)

    @classmethod
    def of(cls, spec, options: StepOptions, runner: bool, staged: bool,
           inner: tuple[int, int] = (1, 1)) -> "Regime":
        """The regime of a step of ``spec`` (its variant) with ``options``; ``runner``: the
        model gives ``block_fn``; ``staged``: the mesh has an axis ``stage``; ``inner``:
        ``(F, T)`` (:func:`sdp_jax.mesh.inner_sizes` of the mesh)."""
        return cls(backward=bool(spec.backward), fsdp=options.fsdp, periodic=options.periodic,
                   runner=runner, staged=staged, reference=options.reference,
                   accumulating=options.grad_accum > 1, inner=tuple(inner))

    @property
    def method(self) -> str:
        """The averaging of masked leaves, as :func:`sdp_jax.sync.average` takes it."""
        return "reference" if self.reference else "alltoall"

    @property
    def sharded_update(self) -> bool:
        """The optimizer works on each device's shards of the masked leaves: FSDP (ZeRO-3)
        and backward masking, whose every worker keeps the full model (ZeRO-2). The same
        regimes store the full model's leaves (sharded or replicated), not compact ones."""
        return self.fsdp or self.backward

    def kind(self, *, optimizer: bool, in_blocks_or_masked: bool, stored_compact: bool) -> Kind:
        """The layout kind of one stored leaf.

        Args:
          optimizer: the leaf's kind in the optimizer's layout (else in the parameters').
          in_blocks_or_masked: the leaf is in the stacked block subtree or masked.
          stored_compact: forward masking stores the leaf per worker, compact."""
        if self.fsdp:
            return Kind.SHARDED
        if self.backward:   # full replicated copies; optimizer state and update on shards
            return Kind.SHARDED if optimizer and in_blocks_or_masked else Kind.REPLICATED
        if stored_compact:
            return Kind.COMPACT
        return Kind.PER_WORKER if self.periodic else Kind.REPLICATED

    @property
    def averages_in_loop(self) -> bool:
        """Whether block gradients may be averaged inside the backward loop: the block
        runner, the holder-only averaging, and none of FSDP (its reduce-scatter is the
        transpose of its gathers), periodic averaging, a pipeline (its schedule runs the blocks
        once per microbatch) or accumulation (the accumulated gradient is averaged once)."""
        return (self.runner and not (self.fsdp or self.periodic or self.staged
                                     or self.reference or self.accumulating))

    @property
    def source(self) -> Source:
        """Where a worker's parameters come from and where its gradients go."""
        if self.fsdp:
            return Source.FSDP_BLOCKS if self.runner else Source.FSDP_WHOLE
        return Source.BACKWARD_HELD if self.backward else Source.COMPACT

    @property
    def update(self) -> Update:
        """How the averaged gradient becomes new parameters."""
        if self.sharded_update:
            return Update.SHARDED
        return Update.PERIODIC if self.periodic else Update.AVERAGED
