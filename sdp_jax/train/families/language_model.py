"""The language model family: LLaMA's hooks for the one step and for the one training loop.

For the step (:class:`sdp_jax.step.SDPStep`), :class:`LanguageModel` gives the next-token
cross-entropy of a LLaMA (:mod:`sdp_jax.models.llama`) on int32 token batches ``[b, T + 1]``
(inputs ``[:, :-1]``, targets ``[:, 1:]``) over a worker's local parameters, the apply of one
block (the block runner hook) and the full model's initial parameters; it knows nothing about
SDP. :func:`language_model_step` builds the step, pipelined or not. For the loop
(:func:`sdp_jax.train.loop.train`) and the config validation (:func:`sdp_jax.train.run.resolve`),
:class:`LanguageModelFamily` implements the protocol :class:`sdp_jax.train.task.Family` (the one
a user's own model also implements, through :class:`sdp_jax.train.task.Task`): the model and
data fields, the spec, the data, the step, the evaluation and the summary fields.
"""

from __future__ import annotations

import copy
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

from sdp_jax.costs.program import fmt_bytes
from sdp_jax.models import hf_llama, llama
from sdp_jax.models.llama import BLOCK_KEY, Llama, LlamaConfig, block_apply_fn, next_token_loss
from sdp_jax.options import ModelHooks, StepOptions
from sdp_jax.pipeline import schedules as pl
from sdp_jax.pipeline import stiefel
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step import runner
from sdp_jax.step import sdp_step as step_lib
from sdp_jax.sync import collectives as sync
from sdp_jax.train import config as config_lib
from sdp_jax.train import migrations
from sdp_jax.train import optimizer as optim_lib
from sdp_jax.train.data import corpus
from sdp_jax.train.data import tokens as data_lib
from sdp_jax.train.task import Family, mean_loss, schedule_steps

LOSS_CHUNKS = 8  # sequence pieces of the head and loss under activation checkpointing


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

    def _head_model(self, kept: dict):
        """The model with an empty block stack: it serves the embedding and the head; the
        step's runner applies the blocks. Leaves of ``kept`` that are not the model's (a
        pipeline's ``boundary``) are left out."""
        dtype = kept["embed"].dtype
        empty = jax.tree.map(lambda s: jnp.zeros((0,) + s.shape[1:], dtype),
                             self.shapes[BLOCK_KEY])
        own = {k: v for k, v in kept.items() if k in self.shapes}
        return nnx.merge(self.graphdef, {**own, BLOCK_KEY: empty})

    def embed(self, kept: dict, x):
        """Token ids int32 ``[b, T]`` -> residual stream ``[b, T, d]`` (``kept``'s dtype)."""
        return self._head_model(kept).embed_tokens(x)

    def head(self, kept: dict, h, targets):
        """Mean next-token loss (nats/token, float32) of the residual stream ``h``."""
        return next_token_loss(self._head_model(kept).logits(h), targets)

    def loss(self, kept: dict, tokens, run: runner.Runner):
        """Next-token loss (nats/token, float32) of embedding -> ``run`` -> head.

        Under activation checkpointing the sequence is cut into up to ``LOSS_CHUNKS`` equal
        pieces whose logits ``[b, T / pieces, V]`` are recomputed in the backward pass instead
        of stored (with a large vocabulary the logits are the largest activation)."""
        model = self._head_model(kept)
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
        total, _ = jax.lax.scan(body, sync.zeros_varying((), jnp.float32, h, axis=None),
                                (hs, ts_), unroll=run.unroll)
        return total / chunks


def language_model_step(cfg: LlamaConfig, spec: spec_lib.SDPSpec, optim, mesh,
                        options: StepOptions, pipe=None) -> step_lib.SDPStep:
    """The :class:`sdp_jax.step.SDPStep` of a LLaMA run: AdamW (or SGD) with warm-up and cosine
    decay from ``optim`` (:class:`sdp_jax.train.optimizer.OptimConfig`) over
    ``options.total_steps``, ``options`` (:class:`sdp_jax.options.StepOptions`, clipping at
    ``options.grad_clip``), ``init_state(seed)`` from the model's initializer.

    With ``pipe`` (:class:`sdp_jax.pipeline.PipelineConfig`, ``stages > 1``) the loss is the
    pipeline schedule (``pipe.schedule``: GPipe or 1F1B) over the mesh axis ``stage`` (``mesh`` from
    :func:`sdp_jax.mesh.make_mesh`; ``spec`` the spec of one stage with the boundary parameters,
    :func:`sdp_jax.models.llama.make_plan` with ``pipe``); the parameters gain ``boundary``
    (:func:`sdp_jax.pipeline.init_boundary`), the optimizer routes the projectors
    (:func:`sdp_jax.train.optimizer.pipeline_optimizer`), and the metrics gain ``ortho_err`` (max
    |A^T A - I| over the boundaries) when compressed and ``rvq_loss`` with RVQ (also in
    ``train_loss``).

    Raises:
      ValueError: ``options`` without ``total_steps``; a mesh or spec that does not match
        ``pipe``; and everything :class:`SDPStep` refuses.
    """
    task, total = LanguageModel(cfg), schedule_steps(options)
    stages = 1 if pipe is None else pipe.stages
    got = 1 if mesh is None else int(dict(mesh.shape).get("stage", 1))
    if got != stages or spec.n_blocks != cfg.n_layers // stages:
        raise ValueError(f"pipeline.stages={stages} needs a mesh axis 'stage' of that size "
                         "(sdp_jax.mesh.make_mesh) and the spec of one stage "
                         f"(sdp_jax.models.llama.make_plan(..., pipe=pipe)); got a 'stage' axis of {got} "
                         f"and a spec of {spec.n_blocks} of the {cfg.n_layers} blocks.")
    schedule = optim_lib.lr_schedule(optim, total)
    if stages == 1:
        return step_lib.SDPStep(spec, ModelHooks(task.loss, task.block, task.init),
                                optim_lib.make_optimizer(optim, total), mesh, options, schedule)
    pipe.check(cfg, fsdp=options.fsdp, average=options.average)
    sched = pl.Pipeline(pipe, cfg.d_model, cfg.vocab_size, task.embed, task.head)

    def init(seed):   # the boundary's seed as the pipeline has always drawn it
        return {**task.init(seed),
                "boundary": pl.init_boundary(jax.random.key(seed + 104729), cfg, pipe)}

    def ortho(params):
        return {"ortho_err": stiefel.orthogonality_error(
            params["boundary"][pl.projector_key(pipe.method)])}
    hooks = ModelHooks(sched.loss, task.block, init, has_aux=True,
                       param_metrics=ortho if pipe.compressed else None)
    return step_lib.SDPStep(spec, hooks, optim_lib.pipeline_optimizer(pipe, optim, total), mesh,
                            options, schedule)



# ----------------------------------------------------------------------------------------------
# Model families: the protocol of the one training loop (sdp_jax.train.task.Family)
# ----------------------------------------------------------------------------------------------

class LanguageModelFamily(Family):
    """A LLaMA run (optionally pipelined) in :func:`sdp_jax.train.loop.train`: validation of the
    model and data fields, the spec, the data, the step, the evaluation (``val_loss``
    nats/token and, for byte-level data, ``val_bpb`` bits/byte) and the summary fields."""

    kind = "language-model"
    declared = (config_lib.LanguageModelRun, data_lib.DataConfig)
    rate_key = "tokens_per_s"

    def template(self, config):
        return config_lib.base_config(), "sdp_jax.train.config.base_config()"

    def aligns(self, model, plan) -> bool:
        return True

    def model_config(self, config) -> LlamaConfig:
        model = LlamaConfig.from_config(config.model)
        if config.seq_len > model.max_seq_len:
            raise ValueError(f"config.seq_len={config.seq_len} exceeds model.max_seq_len="
                             f"{model.max_seq_len}; lower seq_len or raise model.max_seq_len.")
        data_lib.check(config.data, model.vocab_size)
        if config.get("init_from") and config.pipeline.stages > 1 \
                and config.pipeline.method != "none":   # (the folder: initial_state reads it)
            raise ValueError(f"config.init_from={config.init_from!r} with pipeline.method="
                             f"{config.pipeline.method!r}: a Hugging Face LLaMA has no "
                             "boundary projectors; use pipeline.method=none, or no init_from.")
        if model.attention == "cudnn" and config.dtype not in ("bfloat16", "bf16"):
            raise ValueError(f"model.attention='cudnn' computes in bf16 only (cuDNN refuses "
                             f"float32), but dtype={config.dtype!r}; add --config.dtype=bfloat16 "
                             "or use model.attention=chunked.")
        return model

    def plan(self, config, model, workers, pipe) -> spec_lib.SDPSpec:
        """The masks (with a pipeline, over one stage's ``L / P`` blocks, the same in every
        stage)."""

        s = config.sdp
        return llama.make_plan(s.variant, model, workers, s.coverage, s.scheme, s.mask_seed,
                            s.allow_nonuniform, s.allow_disconnected, pipe=pipe)

    def added_fields(self) -> dict:
        """:data:`sdp_jax.train.migrations.LANGUAGE_MODEL_ADDED` (a copy)."""
        return copy.deepcopy(migrations.LANGUAGE_MODEL_ADDED)

    def data(self, run, rows, log, train: bool = True):
        """``(start -> train iterator, validation batches)`` of this process's ``rows``
        (``train=False``: ``(None, validation batches)``, the training set not read)."""
        config = run.config
        kw = dict(seq_len=config.seq_len, global_batch=run.global_batch,
                  vocab_size=run.model.vocab_size, rows=rows)
        log(data_lib.describe(config.data))   # a bad path fails here, before any compile
        if not train:
            return None, data_lib.make_val_batches(config.data,
                                                   num_batches=config.eval_batches, **kw)
        return (data_lib.train_stream(config.data, seed=config.seed, **kw),   # bad sizes fail here
                data_lib.make_val_batches(config.data, num_batches=config.eval_batches, **kw))

    def step(self, run, mesh) -> step_lib.SDPStep:
        return language_model_step(run.model, run.plan, run.optim, mesh, run.options, run.pipe)

    def check_start(self, run):
        """``config.init_from``'s Hugging Face LLaMA checked against the run's model from its
        ``config.json`` and safetensors headers (:func:`sdp_jax.models.hf_llama.check_folder`:
        a missing, truncated or foreign file, another shape); its folder and context length
        (``max_position_embeddings``, which ``export --format hf`` writes back) are recorded.
        None without ``init_from``."""
        folder = run.config.get("init_from")
        return hf_llama.check_folder(folder, run.model) if folder else None

    def initial_state(self, run, builder, log):
        """The model's initializer, or the Hugging Face LLaMA of ``config.init_from``
        (:func:`sdp_jax.models.hf_llama.read`) laid out under the run's masks: every holder of
        a component starts from its values (continued pre-training under any variant). The
        folder is read only by a run without a checkpoint (:meth:`check_start` checked it
        before the workdir was created): a run that resumes from its own checkpoint, and the
        tools, never need it.

        Raises:
          ValueError: the folder's faults (:func:`sdp_jax.models.hf_llama.check_folder`);
            before any compile."""
        folder = run.config.get("init_from")
        if not folder:
            return builder.init_state(run.config.seed)
        params = hf_llama.read(folder, run.model)
        if run.pipe.stages > 1:   # (method none: the boundary holds no parameters)
            params["boundary"] = pl.init_boundary(jax.random.key(0), run.model, run.pipe)
        log(f"initialized from the Hugging Face LLaMA in {folder} "
            f"({sum(x.size for x in jax.tree.leaves(params)):,} parameters)")
        theirs, ours = os.path.join(folder, "tokenizer.json"), run.config.data.tokenizer
        if os.path.isfile(theirs) and not (ours and os.path.samefile(
                corpus.tokenizer_file(ours), theirs)):
            log(f"note: {folder} holds the tokenizer.json it was trained with, but this run "
                f"tokenizes with {ours or 'bytes'}; add --config.data.tokenizer={folder} to "
                "train on the tokens the model knows")
        return builder.init(params)

    def batch_shapes(self, run):
        return jax.ShapeDtypeStruct((run.global_batch, run.config.seq_len + 1), jnp.int32)

    def items_per_step(self, run) -> int:
        return run.global_batch * run.config.seq_len

    def model_flops_per_item(self, run) -> float:
        """Training FLOPs per token of the subnetwork a worker runs
        (:func:`sdp_jax.models.llama.model_flops_per_token`): ``k`` blocks per stage under
        forward block masking, ``C`` of every block's width under N-SDP, the whole model under
        backward masking."""

        plan, forward = run.plan, run.plan.regime == "forward"
        blocks = (plan.kinds[spec_lib.BLOCK].k * run.pipe.stages
                  if forward and spec_lib.BLOCK in plan.kinds else None)
        width = plan.coverage if forward and spec_lib.BLOCK not in plan.kinds else 1.0
        return llama.model_flops_per_token(run.model, run.config.seq_len, blocks, width)

    def param_count(self, run) -> int:
        return run.model.param_count()["total"]

    def describe(self, run) -> list[str]:
        """The pipeline's log line (none without one)."""
        pipe, m = run.pipe, run.model
        if pipe.stages == 1:
            return []
        return [f"pipeline: {pipe.stages} stages x {run.workers} workers ({pipe.schedule}, "
                f"{pipe.microbatches} microbatches); masks are per stage "
                f"({m.n_layers // pipe.stages} blocks each); boundaries: {pipe.method}"
                + (f", {pipe.ratio}x (r = {pipe.width(m.d_model)}), anchors of rank "
                   f"{pipe.anchor_rank}" if pipe.compressed else "")
                + (f", RVQ {pipe.rvq_levels} levels x {pipe.rvq_codebook} codes"
                   if pipe.quantized else "")
                + (f"; {pl.boundary_param_count(m, pipe):,} boundary parameters "
                   "(not in the total below)" if pipe.compressed else "")]

    def compiled(self, run, compiled) -> tuple[list[str], dict]:
        """The pipeline's settings and boundary bytes (None without a pipeline)."""
        fields = {"pipeline": dict(run.pipe.__dict__), "boundary_bytes_per_token": None,
                  "boundary_bytes_per_step": None}
        if run.pipe.stages == 1:
            return [], fields
        b = boundary_bytes(run, compiled)
        fields.update(boundary_bytes_per_token=b["per_token"],
                      boundary_bytes_per_step=b["per_boundary"])
        return [f"stage boundaries: {fmt_bytes(b['per_boundary'])} per boundary per worker "
                f"per step ({b['per_token']:.1f} bytes/token, forward and backward, from the "
                "compiled program)"], fields

    def evaluator(self, run, builder, val_batches, put, log):
        """``state -> {val_loss[, val_bpb]}``: the full model on the validation batches."""
        eval_fn, byte_level = builder.eval_step_fn(), data_lib.byte_level(run.config.data)
        shape = self.batch_shapes(run)

        def evaluate(state):
            v = mean_loss(eval_fn, state["params"], val_batches, put, shape)
            return {"val_loss": v, **({"val_bpb": v / math.log(2)} if byte_level else {})}
        return evaluate

    def postfix(self, rec) -> dict:
        post = {"loss": f"{rec['train_loss']:.3f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
        if "ortho_err" in rec:
            post["|A'A-I|"] = f"{rec['ortho_err']:.1e}"
        if "val_loss" in rec:
            post["val"] = f"{rec['val_loss']:.3f}"
        return post

    def summary(self, run, step, last_eval, last_rec) -> dict:
        return {"n_layers": run.model.n_layers,
                "tokens": step * self.items_per_step(run),
                "final_val_loss": last_eval.get("val_loss"),
                "final_val_bpb": last_eval.get("val_bpb"),
                "final_ortho_err": last_rec.get("ortho_err")}

    def done_line(self, s) -> str:
        bpb = (f", {s['final_val_bpb']:.3f} bits/byte" if s.get("final_val_bpb") is not None
               else "")
        return (f"final val loss {s['final_val_loss']:.4f} nats/token{bpb}")


def boundary_bytes(run, compiled) -> dict:
    """Stage-boundary bytes of a pipelined run's compiled train step
    (:func:`sdp_jax.pipeline.boundary_bytes` with the run's tokens per worker, stages and RVQ
    codebook synchronization; ``run`` from :func:`sdp_jax.train.run.resolve`)."""
    c = run.config
    return pl.boundary_bytes(compiled, tokens_per_worker=c.batch_per_worker * c.seq_len,
                             stages=run.pipe.stages,
                             codebook_bytes=pl.codebook_sync_bytes(run.model, run.pipe))
