"""Model families as the hooks of the one step (:class:`sdp_jax.step.SDPStep`).

A family gives the step its loss over a worker's local parameters, the apply of one block (the
block runner hook) and the full model's initial parameters; it knows nothing about SDP.

:class:`LanguageModel`: next-token cross-entropy of a LLaMA (:mod:`sdp_jax.models.llama`) on
int32 token batches ``[b, T + 1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sdp_jax import spec as spec_lib
from sdp_jax import step as step_lib
from sdp_jax import sync
from sdp_jax.models.llama import BLOCK_KEY, Llama, LlamaConfig, block_apply_fn, next_token_loss

LOSS_CHUNKS = 8  # sequence pieces of the head and loss under activation checkpointing
# config.sdp.method -> the step's averaging method
METHODS = {"auto": "alltoall", "alltoall": "alltoall", "reference": "psum"}


class LanguageModel:
    """The LLaMA family: loss, block apply and initial parameters for :class:`SDPStep`.

    Args:
      cfg: :class:`sdp_jax.models.llama.LlamaConfig`.
    """

    def __init__(self, cfg: LlamaConfig):
        self.cfg = cfg
        abstract = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))
        self.graphdef = nnx.graphdef(abstract)
        self.block = block_apply_fn(abstract)
        self.shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))

    def init(self, seed: int) -> dict:
        """The full model's parameters from ``seed`` (nested dict of float32 arrays)."""
        return nnx.to_pure_dict(nnx.state(Llama(self.cfg, nnx.Rngs(seed)), nnx.Param))

    def _head_model(self, kept: dict, dtype):
        """The model with an empty block stack: it serves the embedding and the head; the
        step's runner applies the blocks."""
        empty = jax.tree.map(lambda s: jnp.zeros((0,) + s.shape[1:], dtype),
                             self.shapes[BLOCK_KEY])
        return nnx.merge(self.graphdef, {**kept, BLOCK_KEY: empty})

    def loss(self, kept: dict, tokens, run: step_lib.Runner):
        """Next-token loss (nats/token, float32) of embedding -> ``run`` -> head.

        Under activation checkpointing the sequence is cut into up to ``LOSS_CHUNKS`` equal
        pieces whose logits ``[b, T / pieces, V]`` are recomputed in the backward pass instead
        of stored (with a large vocabulary the logits are the largest activation)."""
        dtype = kept["embed"].dtype
        model = self._head_model(kept, dtype)
        h = run(model.embed_tokens(tokens[:, :-1]))
        targets = tokens[:, 1:]
        T = h.shape[1]
        chunks = 1
        if run.train and run.remat != "none":
            chunks = max(c for c in range(1, LOSS_CHUNKS + 1) if T % c == 0)
        if chunks == 1:
            return next_token_loss(model.logits(h), targets)
        B = h.shape[0]
        hs = h.reshape(B, chunks, T // chunks, h.shape[2]).swapaxes(0, 1)
        ts_ = targets.reshape(B, chunks, T // chunks).swapaxes(0, 1)

        def body(total, piece):
            return total + next_token_loss(model.logits(piece[0]), piece[1]), None
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable,
                              prevent_cse=False)
        total, _ = jax.lax.scan(body, sync.to_varying(jnp.zeros((), jnp.float32)), (hs, ts_),
                                unroll=run.unroll)
        return total / chunks


def language_model_step(cfg: LlamaConfig, spec: spec_lib.SDPSpec, optim, mesh,
                        total_steps: int, *, averaging: str = "gradients", sync_every: int = 1,
                        method: str = "auto", fsdp: bool = False, remat: str = "none",
                        dtype: str = "float32", unroll: bool = False) -> step_lib.SDPStep:
    """The :class:`sdp_jax.step.SDPStep` of a LLaMA run: AdamW (or SGD) with warm-up and cosine
    decay from ``optim`` (:class:`sdp_jax.train_step.OptimConfig`), clipping at
    ``optim.grad_clip``, ``init_state(seed)`` from the model's initializer.

    Raises:
      ValueError: ``method`` not one of ``auto``, ``alltoall``, ``reference``; and everything
        :class:`SDPStep` refuses.
    """
    from sdp_jax import train_step as ts  # pylint: disable=g-import-not-at-top
    if method not in METHODS:
        raise ValueError(f"method={method!r}; use one of {', '.join(METHODS)} "
                         "(--config.sdp.method).")
    task = LanguageModel(cfg)
    return step_lib.SDPStep(
        spec, task.loss, ts.make_optimizer(optim, total_steps), mesh, block_fn=task.block,
        grad_clip=optim.grad_clip, method=METHODS[method], averaging=averaging,
        sync_every=sync_every, fsdp=fsdp, remat=remat, dtype=dtype,
        schedule=ts.lr_schedule(optim, total_steps), init_fn=task.init,
        total_steps=total_steps, unroll=unroll)
