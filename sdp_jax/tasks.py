"""Model families as the hooks of the one step (:class:`sdp_jax.step.SDPStep`).

A family gives the step its loss over a worker's local parameters, the apply of one block (the
block runner hook) and the full model's initial parameters; it knows nothing about SDP.

:class:`LanguageModel`: next-token cross-entropy of a LLaMA (:mod:`sdp_jax.models.llama`) on
int32 token batches ``[b, T + 1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``).

Vision models (:mod:`sdp_jax.models.vision`) declare their components as spec rules
(:func:`vision_rules`): one :class:`sdp_jax.spec.Blocks` rule per stage (blocks ``s{i}/b{j}``,
stage-balanced masks; the first block of a downsampling ResNet stage is stored zero-padded to
the other blocks' shape: its first conv has half the input channels), and per stage one neuron
kind per block component (ResNet ``channels``: the inner channels of each basic block with
their BatchNorm; Swin ``mlp`` hidden units and attention ``heads``). The BatchNorm running
statistics follow the same rules (:func:`vision_spec`).
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sdp_jax import spec as spec_lib
from sdp_jax import step as step_lib
from sdp_jax import sync
from sdp_jax.models import vision as vm
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


# ----------------------------------------------------------------------------------------------
# Vision models
# ----------------------------------------------------------------------------------------------

def vision_rules(cfg: vm.VisionConfig, *, blocks: bool = True, stats: bool = False) -> list:
    """The SDP rules of a vision model: ``Blocks("s{i}", key="b{}")`` per stage (``pad`` for
    a downsampling ResNet stage) when ``blocks``, and the neuron kinds ``"s{i}.{kind}"`` of
    :func:`sdp_jax.models.vision.components`; ``stats``: the rules of the BatchNorm running
    statistics instead of the parameters."""
    stages, kinds = vm.components(cfg)
    rules = [spec_lib.Blocks(st.key, key="b{}", pad=st.down) for st in stages] if blocks else []
    for st in stages:
        for kind in kinds:
            for sub, (axis, expand) in (kind.stats if stats else kind.leaves).items():
                rules.append(spec_lib.Neurons("/".join((st.key, "*") + sub), axis,
                                              f"{st.key}.{kind.name}", expand))
    return rules


def vision_spec(cfg: vm.VisionConfig, variant: str, workers: int, coverage: float,
                scheme: str = "cyclic", seed: int = 0, allow_nonuniform: bool = False,
                stage_blocks: tuple = ()) -> spec_lib.SDPSpec:
    """The spec of a vision model's parameters.

    Block variants hold ``k_s`` blocks of stage ``s`` (:func:`sdp_jax.spec.stage_balance`:
    Swin-T, depths (2, 2, 6, 2), at C = 2/3 holds (2, 1, 4, 1) blocks per worker; ResNet-18 at
    C = 1/2 one block of every stage); neuron variants hold ``C`` of each kind's components in
    every block (``C * G`` whole for every kind and stage: Swin-T's 3 heads in stage 0 allow C in
    {1/3, 2/3, 1}). ``ddp`` declares no components (every leaf always-kept).

    Raises:
      ValueError: what :func:`sdp_jax.spec.build` refuses, prefixed with the model's name
        (unknown variant, ``C`` not realizable for a stage or kind, bad ``stage_blocks``).
    """
    return _vision_build(cfg, False, variant, workers, coverage, scheme, seed,
                         allow_nonuniform, stage_blocks)


def vision_stats_spec(cfg: vm.VisionConfig, spec: spec_lib.SDPSpec) -> spec_lib.SDPSpec | None:
    """The spec of the BatchNorm running statistics (None for a model without BatchNorm),
    built from the parameters' spec's arguments, so that its masks are the same."""
    stats = _vision_build(cfg, True, spec.variant, spec.workers, spec.coverage, spec.scheme,
                          spec.seed, spec.allow_nonuniform, spec.stage_blocks)
    for kind, t in (stats.kinds.items() if stats else ()):
        if not np.array_equal(t.masks, spec.kinds[kind].masks):
            raise ValueError(f"the BatchNorm statistics' {kind} masks differ from the "
                             "parameters'; build the spec with tasks.vision_spec.")
    return stats


def _vision_build(cfg, stats, variant, workers, coverage, scheme, seed, allow_nonuniform,
                  stage_blocks):
    model = nnx.eval_shape(lambda: vm.build(cfg))
    tree = model.batch_stats() if stats else model.params()
    if not tree:
        return None
    stages, kinds = vm.components(cfg)
    names = {f"{st.key}.{k.name}": f"{k.name} per block of stage {st.key}"
             for st in stages for k in kinds}
    names.update({f"{st.key}.blocks": f"blocks of stage {st.key}" for st in stages})
    try:
        return spec_lib.build(tree, vision_rules(cfg, blocks=variant != "ddp", stats=stats),
                              variant, workers, coverage, scheme=scheme, seed=seed,
                              allow_nonuniform=allow_nonuniform, names=names,
                              allow_disconnected=True, stage_blocks=tuple(stage_blocks or ()),
                              stage_balanced=True)
    except ValueError as e:
        raise ValueError(f"{cfg.name}: {e}") from None


def vision_record(spec: spec_lib.SDPSpec) -> dict:
    """What a vision checkpoint stores to recognise its masks (DESIGN.md invariant 7): the
    block recipes and a SHA-256 over each stage's block mask ``[W, L_s]`` and each block's
    neuron masks ``[W, G]``, in the form vision checkpoints have always recorded (so runs
    written before the spec existed still resume)."""
    h = hashlib.sha256()
    blocks = {k[:-len(".blocks")]: t for k, t in spec.kinds.items() if k in spec.stacks}
    for name, t in sorted(blocks.items()):
        h.update(name.encode())
        h.update(np.ascontiguousarray(t.masks[0]).tobytes())
    neurons = []
    for k, t in spec.kinds.items():
        if k not in spec.stacks:
            stage, kind = k.split(".", 1)
            neurons += [((stage, str(key[0]), kind), m) for key, m in zip(t.layers, t.masks)]
    for name, m in sorted(neurons, key=lambda e: e[0]):
        h.update("/".join(name).encode())
        h.update(np.ascontiguousarray(m).tobytes())
    return {"variant": spec.variant,
            "recipes": {f"{k}.blocks": blocks[k].recipe for k in sorted(blocks)},
            "mask_sha256": h.hexdigest()}
