"""One builder for DDP and B-SDP training steps: pure, jitted ``train_step(state, batch)``.

DDP is B-SDP with the all-ones mask (coverage 1): the same code path, layout and averaging
(DESIGN.md invariant 1). The state layout on the mesh axis ``data`` (``W`` workers):

* always-kept parameters (embedding, final norm, LM head): replicated, ``P()``;
* block parameters: compact, a global ``[W, k, ...]`` array sharded ``P('data')``: device ``w``
  stores only its worker's ``k = C * L`` blocks, in depth order (``held[w]`` from
  :func:`sdp_jax.masks.held_table`). Parameters, gradients, AdamW moments and activations of
  the per-device program are therefore all ``k``-block sized (invariant 4);
* optimizer state mirrors the parameters; the step counter is a replicated int32.

The step (inside ``jax.shard_map``): local loss and gradient on the worker's subnetwork and its
own slice of the batch -> masked mean of block gradients over their holders and plain mean of
always-kept gradients (:mod:`sdp_jax.sync`) -> global-norm clipping from the averaged gradient with
each block counted once -> AdamW (optax) with warm-up and cosine decay.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax import masks as masks_lib
from sdp_jax import sync
from sdp_jax.models.llama import BLOCK_KEY, Llama, LlamaConfig, block_apply_fn, next_token_loss

VARIANTS = ("ddp", "b-sdp")
AXIS = sync.AXIS


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay (Loshchilov & Hutter 2019) and global-norm
    clipping. ``lr`` is the peak learning rate; it decays to ``lr * min_lr_ratio``."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self):
        def check(name, ok, rule):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not ok(v):
                raise ValueError(f"optim.{name}={v!r} must be {rule} "
                                 f"(--config.optim.{name}=...).")
        check("lr", lambda v: v > 0, "a finite number > 0")
        check("min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]")
        check("warmup_steps", lambda v: v >= 0 and float(v).is_integer(), "an integer >= 0")
        check("weight_decay", lambda v: v >= 0, ">= 0")
        check("b1", lambda v: 0 <= v < 1, "in [0, 1)")
        check("b2", lambda v: 0 <= v < 1, "in [0, 1)")
        check("eps", lambda v: v > 0, "> 0")
        check("grad_clip", lambda v: v >= 0, ">= 0 (0 = no clipping)")

    @classmethod
    def from_config(cls, cfg) -> "OptimConfig":
        d = dict(cfg)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown optim config keys {unknown}; valid keys: {sorted(names)}.")
        return cls(**d)


def lr_schedule(optim: OptimConfig, total_steps: int):
    """optax schedule: linear warm-up to ``lr`` over ``warmup_steps``, cosine to the floor."""
    warm = min(optim.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim.lr, warmup_steps=warm,
        decay_steps=max(total_steps, warm + 1), end_value=optim.lr * optim.min_lr_ratio)


def _decay_mask(params):
    # No weight decay on norm scales (standard for LLaMA pre-training).
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any("norm" in str(getattr(k, "key", k)) for k in path), params)


def make_optimizer(optim: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW without clipping (clipping is done by the step from the holder-averaged norm)."""
    return optax.adamw(lr_schedule(optim, total_steps), b1=optim.b1, b2=optim.b2, eps=optim.eps,
                       weight_decay=optim.weight_decay, mask=_decay_mask)


def make_mask(variant: str, workers: int, n_layers: int, coverage: float, scheme: str,
              seed: int, allow_nonuniform: bool = False) -> masks_lib.MaskRecipe:
    """The mask recipe of a variant: DDP is coverage 1 (all-ones), B-SDP masks blocks.

    Raises:
      ValueError: unknown variant, or an unrealizable coverage (see :mod:`sdp_jax.masks`).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; this release supports {VARIANTS} "
                         "(n-sdp, bb-sdp, nb-sdp are not built yet).")
    if variant == "ddp":
        coverage = 1.0
    return masks_lib.MaskRecipe(scheme, workers, n_layers, float(coverage), seed, allow_nonuniform)


def _is_block_path(path) -> bool:
    return len(path) > 0 and getattr(path[0], "key", None) == BLOCK_KEY


def _map_blocks(fn_block, fn_kept, tree):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: fn_block(x) if _is_block_path(p) else fn_kept(x), tree)


def _split(tree):
    kept = {k: v for k, v in tree.items() if k != BLOCK_KEY}
    return kept, tree[BLOCK_KEY]


class StepBuilder:
    """Builds the state layout, initializer, train step and full-model evaluation for one run.

    Args:
      model_cfg: :class:`LlamaConfig`.
      recipe: :class:`sdp_jax.masks.MaskRecipe` over the ``L`` blocks (``W`` = mesh size).
      optim: :class:`OptimConfig`.
      mesh: ``jax.sharding.Mesh`` with one axis ``data`` of size ``W``.
      total_steps: schedule length in optimizer steps.
      averaging: method passed to :func:`sdp_jax.sync.compact_masked_mean`.
      unroll: unroll the block scan (for FLOP counting; same results).

    Raises:
      ValueError: mesh size differs from ``recipe.workers``, or recipe does not cover ``L`` blocks.
    """

    def __init__(self, model_cfg: LlamaConfig, recipe: masks_lib.MaskRecipe, optim: OptimConfig,
                 mesh, total_steps: int, averaging: str = "auto", unroll: bool = False):
        if mesh.shape[AXIS] != recipe.workers:
            raise ValueError(f"mesh axis '{AXIS}' has {mesh.shape[AXIS]} devices but the mask "
                             f"recipe has W={recipe.workers} workers.")
        if recipe.components != model_cfg.n_layers:
            raise ValueError(f"mask covers G={recipe.components} blocks but the model has "
                             f"L={model_cfg.n_layers}.")
        self.model_cfg, self.recipe, self.optim, self.mesh = model_cfg, recipe, optim, mesh
        self.total_steps = int(total_steps)
        self.averaging = averaging
        self.unroll = unroll
        self.mask = recipe.matrix()
        self.tables = sync.CompactTables(self.mask)
        self.optimizer = make_optimizer(optim, self.total_steps)
        self.schedule = lr_schedule(optim, self.total_steps)
        abstract_model = nnx.eval_shape(lambda: Llama(model_cfg, nnx.Rngs(0)))
        self.graphdef = nnx.graphdef(abstract_model)
        self._block_apply = block_apply_fn(abstract_model)
        full = nnx.to_pure_dict(nnx.state(abstract_model, nnx.Param))
        self.full_param_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), full)
        W, k = self.tables.workers, self.tables.k
        self.param_specs = _map_blocks(lambda x: P(AXIS), lambda x: P(), full)
        local = _map_blocks(lambda x: jax.ShapeDtypeStruct((W, k) + x.shape[1:], x.dtype),
                            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), full)
        self.param_shapes = jax.tree.map(
            lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                 sharding=NamedSharding(mesh, spec)),
            local, self.param_specs)
        abstract_opt = jax.eval_shape(self.optimizer.init, self.param_shapes)
        self.opt_specs = optax.tree_map_params(
            self.optimizer, lambda _, spec: spec, abstract_opt, self.param_specs,
            transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
        self.state_specs = {"params": self.param_specs, "opt_state": self.opt_specs, "step": P()}
        self._train_step = None
        self._eval_step = None

    # ---------------------------------------------------------------- layout
    def shardings(self, specs=None):
        specs = self.state_specs if specs is None else specs
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def abstract_state(self):
        """ShapeDtypeStruct tree (with shardings) of the train state, for compile and restore."""
        opt = jax.eval_shape(self.optimizer.init, self.param_shapes)
        shapes = {"params": self.param_shapes, "opt_state": opt,
                  "step": jax.ShapeDtypeStruct((), jnp.int32)}
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.shardings())

    def batch_sharding(self):
        return NamedSharding(self.mesh, P(AXIS))

    def per_device_param_count(self) -> int:
        """Parameters stored per device (compact blocks + always-kept)."""
        c = self.model_cfg.param_count()
        return c["per_block"] * self.tables.k + c["always_kept"]

    # ---------------------------------------------------------------- init
    def init_state(self, seed: int):
        """Initialize the full model from ``seed`` and prune it to each worker's blocks.

        Every holder of a block starts from the same values (the full model's), so the copies
        agree from step 0. Returns the sharded state dict ``{params, opt_state, step}``.
        """
        held = jnp.asarray(self.tables.held)  # [W, k]
        cfg = self.model_cfg

        def init():
            model = Llama(cfg, nnx.Rngs(seed))
            full = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            return _map_blocks(lambda x: x[held], lambda x: x, full)

        params = jax.jit(init, out_shardings=self.shardings(self.param_specs))()
        opt_state = jax.jit(self.optimizer.init,
                            out_shardings=self.shardings(self.opt_specs))(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, P()))
        return {"params": params, "opt_state": opt_state, "step": step}

    # ---------------------------------------------------------------- step
    def _model(self, params_local):
        unstacked = _map_blocks(lambda x: x[0], lambda x: x, params_local)
        return nnx.merge(self.graphdef, unstacked)

    def _local_loss(self, params_local, batch):
        model = self._model(params_local)
        logits = model(batch[:, :-1], unroll=self.unroll)
        return next_token_loss(logits, batch[:, 1:])

    def average_grads(self, grads):
        """Masked mean of compact block gradients over holders; plain mean for always-kept."""
        kept, blocks = _split(grads)
        kept = jax.tree.map(lambda g: jax.lax.pmean(g, AXIS), kept)
        blocks = sync.compact_masked_mean(blocks, self.tables, AXIS, method=self.averaging)
        return {**kept, BLOCK_KEY: blocks}

    def grad_norm(self, grads):
        """Global L2 norm of the averaged gradient, each component counted once (invariant 6)."""
        kept, blocks = _split(grads)
        sq = sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(kept)),
                 jnp.float32(0.0))
        return jnp.sqrt(sq + sync.compact_sq_norm(blocks, self.tables, AXIS))

    def _averaged_grads(self, params, batch):
        kept, blocks = _split(params)  # blocks are already varying (sharded P('data'))
        local = {**sync.to_varying(kept), BLOCK_KEY: blocks}
        loss, grads = jax.value_and_grad(self._local_loss)(local, batch)
        return jax.lax.pmean(loss, AXIS), self.average_grads(grads)

    def grads_fn(self):
        """Jitted ``(params, batch) -> (loss, averaged gradient)`` in the state's layout: what the
        optimizer sees (before clipping). For inspection and tests."""
        fn = jax.shard_map(self._averaged_grads, mesh=self.mesh,
                           in_specs=(self.param_specs, P(AXIS)), out_specs=(P(), self.param_specs))
        return jax.jit(fn)

    def _local_step(self, state, batch):
        params = state["params"]
        loss, grads = self._averaged_grads(params, batch)
        gnorm = self.grad_norm(grads)
        if self.optim.grad_clip > 0:
            scale = jnp.minimum(1.0, self.optim.grad_clip / (gnorm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], params)
        params = optax.apply_updates(params, updates)
        metrics = {"train_loss": loss, "grad_norm": gnorm,
                   "lr": self.schedule(state["step"])}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def train_step_fn(self):
        """The jitted step ``(state, batch int32 [W*b, T+1] sharded P('data')) -> (state, metrics)``.
        ``state`` is donated. metrics: ``train_loss`` (nats/token, mean over workers),
        ``grad_norm`` (before clipping), ``lr``."""
        if self._train_step is None:
            fn = jax.shard_map(self._local_step, mesh=self.mesh,
                               in_specs=(self.state_specs, P(AXIS)),
                               out_specs=(self.state_specs, P()))
            self._train_step = jax.jit(fn, donate_argnums=0)
        return self._train_step

    # ---------------------------------------------------------------- eval (full model)
    def _local_eval(self, params, batch):
        model = self._model(params)
        _, blocks = _split(params)
        h = model.embed_tokens(batch[:, :-1])

        def body(g, h):
            if self.tables.full:  # every worker holds block g at slot g: no communication
                bp = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x[0], g, 0, False),
                                  blocks)
            else:  # fetch block g from its holders (their copies agree)
                bp = sync.component_mean(blocks, g, self.tables, AXIS)
            return self._block_apply(bp, h)

        h = jax.lax.fori_loop(0, self.tables.components, body, h)
        loss = next_token_loss(model.logits(h), batch[:, 1:])
        return jax.lax.pmean(loss, AXIS)

    def eval_step_fn(self):
        """Jitted full-model loss ``(params, batch [W*b, T+1]) -> nats/token`` (all L blocks, each
        block streamed from its holders, so no device stores the full model)."""
        if self._eval_step is None:
            fn = jax.shard_map(self._local_eval, mesh=self.mesh,
                               in_specs=(self.param_specs, P(AXIS)), out_specs=P())
            self._eval_step = jax.jit(fn)
        return self._eval_step

    # ---------------------------------------------------------------- export
    def full_params(self, params):
        """Unprune: the full model's parameters (blocks ``[L, ...]``), taken from each block's
        first holder. Returns a pytree of replicated arrays (gathers the whole model)."""
        first = np.argmax(self.mask, axis=0)  # [L] first holder of each block
        slot = self.tables.slot[first, np.arange(self.tables.components)]
        w_idx, s_idx = jnp.asarray(first), jnp.asarray(slot)
        rep = NamedSharding(self.mesh, P())
        fn = jax.jit(lambda p: _map_blocks(lambda x: jax.reshard(x, rep)[w_idx, s_idx],
                                           lambda x: x, p), out_shardings=rep)
        return fn(params)

    def compiled_train_step(self, batch_shape):
        """Compile the train step for abstract inputs (no data, no device memory for the state).

        Args:
          batch_shape: (global batch, T + 1).
        Returns:
          ``jax.stages.Compiled``; see :mod:`sdp_jax.bench` for reading its memory and FLOPs.
        """
        batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=self.batch_sharding())
        return self.train_step_fn().lower(self.abstract_state(), batch).compile()


def memory_stats(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled program from ``compiled.memory_analysis()``.

    peak ~ argument + temp + output - alias (donated state aliases its output).
    Returns dict with ``argument_bytes``, ``output_bytes``, ``alias_bytes``, ``temp_bytes``,
    ``peak_bytes_per_device`` (all bytes, ints).
    """
    ma = compiled.memory_analysis()
    arg = int(ma.argument_size_in_bytes)
    out = int(ma.output_size_in_bytes)
    alias = int(ma.alias_size_in_bytes)
    temp = int(ma.temp_size_in_bytes)
    return {"argument_bytes": arg, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp,
            "peak_bytes_per_device": arg + temp + out - alias}


def flops_per_device(compiled) -> float:
    """FLOPs of one per-device step from ``compiled.cost_analysis()`` (0.0 if unavailable).

    XLA counts a loop body once, whatever its trip count: compile with ``unroll=True`` (see
    :class:`StepBuilder`) for a count that includes every block."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return float((ca or {}).get("flops", 0.0))


def model_flops_per_token(cfg: LlamaConfig, seq_len: int, blocks: int | None = None) -> float:
    """Training FLOPs per token, ``6 * N + 12 * L * T * d`` (Kaplan et al. 2020, Sec. 2.1, with the
    attention term of PaLM, Chowdhery et al. 2022, App. B); ``blocks`` defaults to ``L``."""
    blocks = cfg.n_layers if blocks is None else blocks
    c = cfg.param_count()
    n = c["per_block"] * blocks + c["always_kept"] - cfg.vocab_size * cfg.d_model * (
        0 if cfg.tie_embeddings else 1)  # the input embedding lookup is no matmul
    return 6.0 * n + 12.0 * blocks * seq_len * cfg.d_model


def flop_matched_steps(ddp_steps: int, coverage: float) -> int:
    """FLOP-matched budget (Singh et al., Sec. 5): an SDP run at coverage C takes ``1/C`` times
    the optimizer steps of the DDP budget, rounded up."""
    return int(math.ceil(ddp_steps / coverage - 1e-9))
