"""The step and its pieces: :class:`SDPStep`, the one SDP training step of any model.

The public face of the wing; ``from sdp_jax import step`` then ``step.SDPStep`` as before. Its
members, from the top (each imports only those below it):

* :mod:`sdp_jax.step.sdp_step`: :class:`SDPStep`, the facade a caller builds;
* :mod:`sdp_jax.step.alignment`: gradient alignment across workers;
* :mod:`sdp_jax.step.evaluation`, :mod:`sdp_jax.step.update`, :mod:`sdp_jax.step.accumulation`,
  :mod:`sdp_jax.step.host`: the full model's loss, averaging and the optimizer step,
  microbatches, host-side conversions of the state;
* :mod:`sdp_jax.step.sources`: where the loss's parameters come from, one source per regime;
* :mod:`sdp_jax.step.state`, :mod:`sdp_jax.step.runner`: the state's layout; the model call and
  the block runner;
* :mod:`sdp_jax.step.regime`, :mod:`sdp_jax.step.inner`: the regime of a step, decided once
  from the spec and the options; the layout over a worker's own devices (``fsdp``, ``tensor``).
"""

from sdp_jax.step.sdp_step import SDPStep, batch_sharding

__all__ = ["batch_sharding", "SDPStep"]
