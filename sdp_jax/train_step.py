"""One builder for every variant's training step: pure, jitted ``train_step(state, batch)``.

DDP is B-SDP with the all-ones mask (coverage 1): the same code path, layout and averaging
(DESIGN.md invariant 1). State layout on the mesh axis ``data`` (``W`` workers), per leaf:

* ``R``: replicated, ``P()``: the full parameter (always-kept parameters; every parameter under
  backward masking, where each worker runs the full model);
* ``C``: compact, a global ``[W, ...]`` array sharded ``P('data')``: device ``w`` stores only its
  worker's part: ``k = C * L`` blocks in depth order (block kinds), or ``C`` of every block's
  MLP neurons / attention head groups (narrower matrices, N-SDP). Forward masking stores
  parameters, optimizer state and (hence) gradients and activations compact (invariant 4);
  backward masking stores optimizer state and gradients compact;
* ``Rw``: a per-worker copy ``[W, ...]`` sharded ``P('data')`` of an always-kept parameter, used
  by periodic parameter averaging, where workers drift apart between averaging steps;
* ``S`` (``fsdp=True``, ZeRO-3): the *full* parameter, each element stored once, in the rows view
  of :mod:`sdp_jax.sync` (``[n]``, ``[L, r]`` or ``[L, Gc, r]``, zero-padded) and sharded over
  ``data`` on its last axis. Parameters, gradients and optimizer state all use it. The same
  devices are SDP workers and FSDP shards: worker ``w`` gathers only the blocks (neurons, heads)
  it holds, one block per scan step (an all_to_all with static tables), and the transpose sends
  its gradients back to their owners (the masked sum over holders).

The step (inside ``jax.shard_map``): local loss and gradient of the worker's (sub)network on its
own slice of the batch -> masked mean over holders (:mod:`sdp_jax.sync`) -> global-norm clipping
from the averaged gradient with every component counted once (invariant 6) -> the optax
optimizer (AdamW with warm-up and cosine decay, or SGD) on the compact parameters -> under
backward masking, every worker's full parameters are refreshed from the holders.

Composes with activation checkpointing of each block (``remat``: ``none``, ``full``, or ``dots``:
save the outputs of matmuls against weights) and mixed precision (``dtype="bfloat16"``: compute
and FSDP gathers in bf16; master parameters, optimizer state and gradient averaging in float32).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax import fields, sync
from sdp_jax import layout as layout_lib
from sdp_jax import spec as spec_lib
from sdp_jax.models.llama import (BLOCK_KEY, SDP_NAMES, Llama, LlamaConfig, block_apply_fn,
                                  next_token_loss, sdp_rules)
from sdp_jax.spec import VARIANTS, SDPSpec  # noqa: F401  (VARIANTS re-exported)

AXIS = sync.AXIS
AVERAGING = ("gradients", "parameters")
REMAT = ("none", "full", "dots")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "fp32": jnp.float32,
          "bf16": jnp.bfloat16}
METHODS = ("auto", "alltoall", "blockwise", "reference")
LOSS_CHUNKS = 8  # sequence pieces of the head and loss under activation checkpointing
_GATHERED = "fsdp_gathered"  # checkpoint_name of FSDP-gathered parameters (never saved)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay (Loshchilov & Hutter 2019) and global-norm
    clipping. ``lr`` is the peak learning rate; it decays to ``lr * min_lr_ratio``."""

    name: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self):
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"optim.name={self.name!r}; choose adamw or sgd.")

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
        return fields.from_section(cls, cfg, "optim")


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


def make_optimizer(optim: OptimConfig, total_steps: int,
                   decay_mask=None) -> optax.GradientTransformation:
    """AdamW (or plain SGD with decoupled weight decay) without clipping: clipping is done by the
    step from the holder-averaged gradient norm. ``decay_mask``: params -> bool tree of the
    leaves that get weight decay (default: all but norm scales)."""
    sched = lr_schedule(optim, total_steps)
    mask = _decay_mask if decay_mask is None else decay_mask
    if optim.name == "sgd":
        return optax.chain(optax.add_decayed_weights(optim.weight_decay, mask=mask),
                           optax.sgd(sched))
    return optax.adamw(sched, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                       weight_decay=optim.weight_decay, mask=mask)


def make_plan(variant: str, cfg: LlamaConfig, workers: int, coverage: float,
              scheme: str = "cyclic", seed: int = 0, allow_nonuniform: bool = False,
              allow_disconnected: bool = False) -> SDPSpec:
    """The :class:`sdp_jax.spec.SDPSpec` of a LLaMA model for a variant (DDP: all-ones block
    mask), from the model's declared rules (:func:`sdp_jax.models.llama.sdp_rules`).

    Raises:
      ValueError: unknown variant, a coverage not realizable for a component kind, or a
        disconnected mask graph (unless ``allow_disconnected``).
    """
    shapes = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))
    return spec_lib.build(shapes, sdp_rules(cfg), variant, workers, coverage, scheme=scheme,
                          seed=seed, allow_nonuniform=allow_nonuniform, names=SDP_NAMES,
                          allow_disconnected=allow_disconnected)


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def _map_paths(fn, tree, *rest):
    """``tree_map_with_path`` with the path as a tuple of dict keys."""
    return jax.tree_util.tree_map_with_path(lambda p, *xs: fn(_keys(p), *xs), tree, *rest)


def _select(tree, pred):
    """Flat dict {path: leaf} of the leaves whose path satisfies ``pred``."""
    out = {}
    jax.tree_util.tree_map_with_path(
        lambda p, x: out.__setitem__(_keys(p), x) if pred(_keys(p)) else None, tree)
    return out


def _merge(tree, flat):
    """Replace the leaves of ``tree`` found in ``flat`` (path -> leaf)."""
    return _map_paths(lambda p, x: flat.get(p, x), tree)


def _take(x, idx, axis):
    """Per-layer gather: x [L, ...], idx [L, k] -> x with ``axis`` (of x) narrowed to k."""
    return jax.vmap(lambda xl, il: jnp.take(xl, il, axis=axis - 1))(x, idx)


class StepBuilder:
    """Builds the state layout, initializer, train step and full-model evaluation for one run.

    Args:
      model_cfg: :class:`LlamaConfig`.
      plan: :class:`sdp_jax.spec.SDPSpec` (``W`` = mesh size).
      optim: :class:`OptimConfig`.
      mesh: ``jax.sharding.Mesh`` with one axis ``data`` of size ``W``.
      total_steps: schedule length in optimizer steps.
      averaging: ``"gradients"`` (every step; C = 1 is DDP) or ``"parameters"`` (each worker
        steps on its own gradient; parameters are averaged over holders every ``sync_every``
        steps, forward-masking variants only).
      sync_every: ``H`` for parameter averaging.
      method: averaging of masked leaves: ``auto`` (= ``alltoall``: only held bytes move,
        :func:`sdp_jax.sync.holder_mean`; a plain mean when every worker holds everything),
        ``blockwise`` or ``reference`` (full-size psums, :func:`sdp_jax.sync.compact_masked_mean`).
      unroll: unroll the block scan (for FLOP counting; same results).
      fsdp: shard parameters, gradients and optimizer state over the workers (ZeRO-3, layout
        ``S``); every variant composes with it.
      remat: activation checkpointing of each block: ``none``, ``full`` (save only the block
        input) or ``dots`` (also save matmul outputs against weights).
      dtype: compute dtype, ``float32`` or ``bfloat16`` (master parameters and optimizer state
        stay float32).

    Raises:
      ValueError: mesh size differs from the plan's ``W``; parameter averaging with backward
        masking or with FSDP; a bad ``averaging`` / ``sync_every`` / ``method`` / ``remat`` /
        ``dtype``.
    """

    def __init__(self, model_cfg: LlamaConfig, plan: SDPSpec, optim: OptimConfig, mesh,
                 total_steps: int, averaging: str = "gradients", sync_every: int = 1,
                 method: str = "auto", unroll: bool = False, fsdp: bool = False,
                 remat: str = "none", dtype: str = "float32"):
        if mesh.shape[AXIS] != plan.workers:
            raise ValueError(f"mesh axis '{AXIS}' has {mesh.shape[AXIS]} devices but the plan "
                             f"has W={plan.workers} workers.")
        if averaging not in AVERAGING:
            raise ValueError(f"averaging={averaging!r}; choose one of {AVERAGING}.")
        if averaging == "parameters" and plan.backward:
            raise ValueError(f"periodic parameter averaging is not available for {plan.variant}: "
                             "backward masking keeps every worker's full parameters identical "
                             "after each step. Use a forward variant or averaging=gradients.")
        if averaging == "parameters" and fsdp:
            raise ValueError("periodic parameter averaging needs per-worker copies of the "
                             "parameters, but FSDP stores one sharded copy: use "
                             "averaging=gradients with fsdp, or fsdp=False.")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r} must be a positive integer.")
        if method not in METHODS:
            raise ValueError(f"method={method!r}; use one of {', '.join(METHODS)}.")
        if remat not in REMAT:
            raise ValueError(f"remat={remat!r}; use one of {', '.join(REMAT)}.")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}; use float32 or bfloat16.")
        if not isinstance(fsdp, bool):
            raise ValueError(f"fsdp={fsdp!r} must be True or False.")
        self.model_cfg, self.plan, self.optim, self.mesh = model_cfg, plan, optim, mesh
        self.total_steps = int(total_steps)
        self.averaging, self.sync_every, self.method, self.unroll = (
            averaging, sync_every, method, unroll)
        self.fsdp, self.remat, self.dtype = fsdp, remat, jnp.dtype(DTYPES[dtype])
        self.periodic = averaging == "parameters"
        self.optimizer = make_optimizer(optim, self.total_steps)
        self.schedule = lr_schedule(optim, self.total_steps)
        abstract_model = nnx.eval_shape(lambda: Llama(model_cfg, nnx.Rngs(0)))
        self.graphdef = nnx.graphdef(abstract_model)
        self._block_apply = block_apply_fn(abstract_model)
        full = nnx.to_pure_dict(nnx.state(abstract_model, nnx.Param))
        self.full_param_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                              full)
        self.rule_of = {p: plan.rule(p) for p in _select(full, lambda p: True)}
        self.full_param_shapes_flat = _select(self.full_param_shapes, lambda p: True)
        self.holder_tables = {}  # masked leaves: rows view, for holder-only averaging and FSDP
        if "block" in plan.kinds:
            self.block_tables = sync.CompactTables(plan.kinds["block"].masks[0])
            blocks = sync.HolderTables.for_blocks(self.block_tables)
        self.layer_tables = {}
        for p, r in self.rule_of.items():
            if r is not None and r.kind != "block":
                t = plan.kinds[r.kind]
                counts = np.repeat(t.counts, r.expand, axis=1)
                idx = np.stack([plan.indices(r, w) for w in range(plan.workers)])
                self.layer_tables[p] = sync.LayerTables(idx, counts, r.axis)
                self.holder_tables[p] = sync.HolderTables.for_layers(self.layer_tables[p])
            elif r is not None:
                self.holder_tables[p] = blocks
        L = model_cfg.n_layers
        every = sync.HolderTables(np.tile(np.arange(L), (plan.workers, 1, 1)),
                                  np.full((1, L), plan.workers), 0, False)
        for p, r in self.rule_of.items():  # held by all, but stacked per block (N-SDP norms)
            if r is None and p[0] == BLOCK_KEY:
                self.holder_tables[p] = every

        W = plan.workers

        def layout(p, stored):
            if fsdp:
                return "S"
            if self.rule_of[p] is not None and (stored == "opt" or not plan.backward):
                return "C"
            return "Rw" if self.periodic else "R"
        self.param_layout = {p: layout(p, "params") for p in self.rule_of}
        self.compact_layout = {p: layout(p, "opt") for p in self.rule_of}

        def shard_shape(p, full_shape):
            t = self.holder_tables.get(p)
            if t is None:
                return (W * -(-int(np.prod(full_shape)) // W),)
            rows = (full_shape[0],) if not t.grouped else (full_shape[0], full_shape[t.axis])
            return rows + (W * t.shard_len(full_shape),)

        def shape(p, x, lay):
            if lay[p] == "S":
                return shard_shape(p, x.shape)
            if lay[p] == "C":
                return (W,) + plan.compact_shape(p, x.shape)
            return ((W,) if lay[p] == "Rw" else ()) + tuple(x.shape)

        def spec(p, x, lay):
            if lay[p] == "S":
                return P(*([None] * (len(shard_shape(p, x.shape)) - 1) + [AXIS]))
            return P() if lay[p] == "R" else P(AXIS)

        def struct(lay):
            specs = _map_paths(lambda p, x: spec(p, x, lay), full)
            shapes = _map_paths(lambda p, x, s: jax.ShapeDtypeStruct(
                shape(p, x, lay), x.dtype, sharding=NamedSharding(mesh, s)), full, specs)
            return specs, shapes

        self.param_specs, self.param_shapes = struct(self.param_layout)
        self.compact_specs, self.compact_shapes = struct(self.compact_layout)
        self.opt_specs = layout_lib.opt_state_specs(self.optimizer, self.compact_specs,
                                                    self.compact_shapes)
        self.state_specs = {"params": self.param_specs, "opt_state": self.opt_specs, "step": P()}
        self._train_steps: dict[bool, Any] = {}
        self._eval_step = None

    # ---------------------------------------------------------------- layout
    def shardings(self, specs=None):
        specs = self.state_specs if specs is None else specs
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def abstract_state(self):
        """ShapeDtypeStruct tree (with shardings) of the train state, for compile and restore."""
        opt = jax.eval_shape(self.optimizer.init, self.compact_shapes)
        shapes = {"params": self.param_shapes, "opt_state": opt,
                  "step": jax.ShapeDtypeStruct((), jnp.int32)}
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.shardings())

    def batch_sharding(self):
        return NamedSharding(self.mesh, P(AXIS))

    def per_device_param_count(self) -> int:
        """Parameter elements stored per device (compact where the layout is compact; a 1/W
        shard under FSDP, padding included)."""
        def per_device(p, s):
            lay = self.param_layout[p]
            if lay == "S":
                return np.prod(s.shape) // self.plan.workers
            return np.prod(s.shape[1:] if lay != "R" else s.shape)
        return int(sum(per_device(p, s)
                       for p, s in _select(self.param_shapes, lambda p: True).items()))

    def _rows_len(self, p) -> int:
        """``r``: elements per row of leaf ``p`` in the rows view (all of it if always-kept)."""
        shape = self.full_param_shapes_flat[p].shape
        t = self.holder_tables.get(p)
        return int(np.prod(shape)) if t is None else t.row_len(shape)

    def _to_shards(self, p, x):
        """Full leaf -> the FSDP layout ``S`` (rows view, padded to a multiple of W)."""
        W = self.plan.workers
        t = self.holder_tables.get(p)
        rows = x.reshape(-1) if t is None else sync.to_rows(x, t)
        if t is not None and not t.grouped:
            rows = rows[0]
        return sync.pad_last(rows, W * -(-rows.shape[-1] // W))

    def _from_shards(self, p, x):
        """Inverse of :meth:`_to_shards` (the padding is dropped)."""
        shape = self.full_param_shapes_flat[p].shape
        t = self.holder_tables.get(p)
        if t is None:
            return x[:int(np.prod(shape))].reshape(shape)
        return sync.from_rows(x, shape, t)

    # ---------------------------------------------------------------- pruning
    def _prune_worker(self, p, x, w):
        """Worker ``w``'s compact part of the full leaf ``x`` (``w`` may be traced)."""
        r = self.rule_of[p]
        if r is None:
            return x
        if r.kind == "block":
            return x[jnp.asarray(self.block_tables.held)[w]]
        return _take(x, jnp.asarray(self.layer_tables[p].indices)[w], r.axis)

    def prune_all(self, full, layout=None):
        """Full parameters -> the stored layout: compact ``[W, ...]`` for C leaves, per-worker
        copies for Rw leaves, unchanged for R leaves."""
        layout = self.param_layout if layout is None else layout
        W = self.plan.workers

        def one(p, x):
            if layout[p] == "S":
                return self._to_shards(p, x)
            if layout[p] == "C":
                return jnp.stack([self._prune_worker(p, x, w) for w in range(W)])
            if layout[p] == "Rw":
                return jnp.broadcast_to(x, (W,) + x.shape)
            return x
        return _map_paths(one, full)

    # ---------------------------------------------------------------- init
    def init_state(self, seed: int):
        """Initialize the full model from ``seed`` and prune it to each worker's part.

        Every holder of a component starts from the same values (the full model's), so the
        copies agree from step 0. Returns the sharded state dict ``{params, opt_state, step}``.
        """
        cfg = self.model_cfg

        def init():
            model = Llama(cfg, nnx.Rngs(seed))
            return self.prune_all(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

        params = jax.jit(init, out_shardings=self.shardings(self.param_specs))()
        opt_init = self.optimizer.init
        if self.plan.backward and not self.fsdp:  # opt state mirrors the compact parameters
            opt_init = lambda full: self.optimizer.init(  # noqa: E731
                self.prune_all(full, self.compact_layout))
        opt_state = jax.jit(opt_init, out_shardings=self.shardings(self.opt_specs))(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, P()))
        return {"params": params, "opt_state": opt_state, "step": step}

    # ---------------------------------------------------------------- averaging
    def _strip(self, tree, layout):
        """Local view: drop the leading per-worker axis of C / Rw leaves."""
        return _map_paths(lambda p, x: x if layout[p] in ("R", "S") else x[0], tree)

    def _by_kind(self, tree):
        """Split a parameter-shaped tree into flat {path: leaf} dicts: always-kept leaves,
        block-masked leaves, neuron-masked leaves."""
        def kind(p):
            r = self.rule_of[p]
            return "kept" if r is None else ("block" if r.kind == "block" else "neuron")
        return tuple(_select(tree, lambda p, k=k: kind(p) == k)
                     for k in ("kept", "block", "neuron"))

    def average(self, tree):
        """Masked mean over holders of local values in the compact layout (local shapes with
        the leading 1): block leaves over block holders, neuron leaves over neuron holders,
        always-kept leaves over all workers.

        Bytes per device: an all-reduce of the always-kept leaves, plus (``method`` auto or
        alltoall) ``2 (W-1)/W`` times the worker's compact bytes of masked leaves: ``C`` times
        DDP's all-reduce of them."""
        kept, blocks, neurons = self._by_kind(tree)
        out = {p: jax.lax.pmean(x, AXIS) for p, x in kept.items()}
        for group in (blocks, neurons):
            if not group:
                continue
            tabs = {p: self.holder_tables[p] for p in group}
            if all(t.full for t in tabs.values()):
                out.update({p: jax.lax.pmean(x, AXIS) for p, x in group.items()})
            elif self.method in ("auto", "alltoall"):
                mean = sync.holder_mean({p: x[0] for p, x in group.items()}, tabs, AXIS)
                out.update({p: x[None] for p, x in mean.items()})
            elif group is blocks:
                out.update(sync.compact_masked_mean(blocks, self.block_tables, AXIS,
                                                    method=self.method))
            else:
                out.update(sync.layer_masked_mean(
                    neurons, {p: self.layer_tables[p] for p in neurons}, AXIS))
        return _merge(tree, out)

    def grad_norm(self, grads):
        """Global L2 norm of the averaged gradient, each component counted once (invariant 6)."""
        kept, blocks, neurons = self._by_kind(grads)
        sq = jnp.float32(0.0)
        for p, g in kept.items():
            g = g[0] if self.compact_layout[p] == "Rw" else g
            sq = sq + jnp.sum(jnp.square(g.astype(jnp.float32)))
        if blocks:
            sq = sq + sync.compact_sq_norm(blocks, self.block_tables, AXIS)
        if neurons:
            sq = sq + sync.layer_sq_norm(neurons, {p: self.layer_tables[p] for p in neurons}, AXIS)
        return jnp.sqrt(sq)

    # ---------------------------------------------------------------- losses
    def _cast(self, x):
        """To the compute dtype (floating leaves only)."""
        return x.astype(self.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    def _head_model(self, kept):
        """The model with an empty block stack: it serves the embedding and the head, the blocks
        are run by :meth:`_run_stack`. ``kept``: {path: value} of every always-kept leaf."""
        empty = {**self.full_param_shapes, BLOCK_KEY: jax.tree.map(
            lambda s: jnp.zeros((0,) + s.shape[1:], self.dtype),
            self.full_param_shapes[BLOCK_KEY])}
        return nnx.merge(self.graphdef, _merge(empty, {p: self._cast(x) for p, x in kept.items()}))

    def _layer_params(self, get):
        """Parameters of one block (no stack axis): ``get(path, rule)`` gives each leaf."""
        blocks = _select(self.full_param_shapes, lambda p: p[0] == BLOCK_KEY)
        flat = {p: get(p, self.rule_of[p]) for p in blocks}
        tree = _merge(self.full_param_shapes[BLOCK_KEY],
                      {p[1:]: v for p, v in flat.items()})
        return tree

    def _remat_body(self, body):
        """Activation checkpointing of one block (Chen et al. 2016, "Training deep nets with
        sublinear memory cost"): ``full`` saves only the block input, ``dots`` also the outputs of
        matmuls against weights. Under FSDP the gathered parameters are never saved: the
        backward pass gathers them again, as FSDP does."""
        cp = jax.checkpoint_policies
        if self.remat == "full":
            policy = cp.nothing_saveable
        elif self.remat == "dots":
            policy = cp.dots_with_no_batch_dims_saveable
        elif self.fsdp:
            policy = cp.save_anything_except_these_names(_GATHERED)
        else:
            return body
        return jax.checkpoint(body, policy=policy, prevent_cse=False)

    def _run_stack(self, h, n, get, train=True, xs=None):
        """Apply ``n`` blocks in order; ``get(path, rule, i, x)`` gives leaf ``path`` of block
        ``i`` (traced) in the compute dtype; ``x`` is slice ``i`` of ``xs`` (a dict of stacked
        leaves scanned over: their gradients are then stacked, not accumulated in a carry)."""
        def body(h, ix):
            i, x = ix
            return self._block_apply(self._layer_params(lambda p, r: get(p, r, i, x)), h), None
        if train:
            body = self._remat_body(body)
        h, _ = jax.lax.scan(body, h, (jnp.arange(n), xs), unroll=self.unroll if train else 1)
        return h

    def _tokens_loss(self, kept, n, get, batch, train=True, xs=None):
        """Next-token loss (nats/token) of embedding -> ``n`` blocks from ``get`` -> head."""
        model = self._head_model(kept)
        h = self._run_stack(model.embed_tokens(batch[:, :-1]), n, get, train, xs)
        return self._head_loss(model, h, batch[:, 1:], train)

    def _head_loss(self, model, h, targets, train):
        """Head and cross-entropy. With activation checkpointing the sequence is cut into
        up to ``LOSS_CHUNKS`` equal pieces whose logits ``[B, T / pieces, V]`` are recomputed in
        the backward pass instead of stored (with a large vocabulary the logits are the largest
        activation of a language model)."""
        T = h.shape[1]
        chunks = 1
        if train and self.remat != "none":
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
                                unroll=self.unroll)
        return total / chunks

    def _forward_loss(self, local, batch):
        """Forward masking without FSDP: the worker's compact subnetwork alone."""
        flat = _select(local, lambda p: True)
        kept = {p: x for p, x in flat.items() if p[0] != BLOCK_KEY}
        blocks = {p: x for p, x in flat.items() if p[0] == BLOCK_KEY}
        n = next(iter(blocks.values())).shape[0]
        return self._tokens_loss(kept, n, lambda p, r, i, x: self._cast(x[p]), batch,
                                 xs=blocks)

    def _backward_loss(self, diff, full, batch):
        """Full forward pass; gradients flow only into ``diff`` (this worker's compact part of
        every masked leaf, and the always-kept leaves); the rest of the model is constant."""
        my = sync.worker_index(AXIS)
        frozen = _select(jax.lax.stop_gradient(full), lambda p: True)
        mine = _select(diff, lambda p: True)

        def get(p, r, g, _):
            if r is None:
                return self._cast(jax.lax.dynamic_index_in_dim(mine[p], g, 0, False))
            base = jax.lax.dynamic_index_in_dim(frozen[p], g, 0, False)
            if r.kind == "block":  # held: the differentiable copy; else the frozen block
                s = jnp.asarray(self.block_tables.slot)[my, g]
                own = jax.lax.dynamic_index_in_dim(mine[p], jnp.maximum(s, 0), 0, False)
                return self._cast(jnp.where(s >= 0, own, base))
            idx = jnp.asarray(self.layer_tables[p].indices)[my, g]
            own = jnp.moveaxis(jax.lax.dynamic_index_in_dim(mine[p], g, 0, False),
                               r.axis - 1, 0)
            base = jnp.moveaxis(base, r.axis - 1, 0).at[idx].set(own)
            return self._cast(jnp.moveaxis(base, 0, r.axis - 1))

        kept = {p: x for p, x in mine.items() if p[0] != BLOCK_KEY}
        return self._tokens_loss(kept, self.model_cfg.n_layers, get, batch)

    def _fsdp_loss(self, shards, batch, mode="train"):
        """Loss from FSDP shards (layout ``S``): each leaf is gathered, in the compute dtype,
        when it is used. ``mode="train"``: forward variants gather only the worker's held
        blocks / neurons / heads (all_to_all); backward variants gather whole blocks and keep
        gradients of the held parts only. ``mode="eval"``: the full model."""
        flat = _select(shards, lambda p: True)
        my = sync.worker_index(AXIS)
        pruned = mode == "train" and not self.plan.backward
        masked_grads = mode == "train" and self.plan.backward
        kept = {p: self._from_shards(p, sync.fsdp_gather(x[None], self._rows_len(p),
                                                         self.dtype)[0])
                for p, x in flat.items() if p[0] != BLOCK_KEY}
        L = self.model_cfg.n_layers
        n = self.plan.kinds["block"].k if pruned and "block" in self.plan.kinds else L

        def get(p, r, i, _):
            x, t = flat[p], self.holder_tables[p]
            shape, rlen = self.full_param_shapes_flat[p].shape, self._rows_len(p)
            if t.grouped:  # neuron leaf: layer i, [Gc, rs]
                sh = jax.lax.dynamic_index_in_dim(x, i, 0, False)
                if pruned and not t.full:
                    rows = sync.fsdp_gather(sh, rlen, self.dtype,
                                            idx=sync.slot_indices(t, i, 0, t.kc))
                else:
                    keep = (jnp.asarray(t.held)[my, i] if masked_grads and not t.full
                            else None)
                    rows = sync.fsdp_gather(sh, rlen, self.dtype, keep=keep)
                leaf = list((1,) + shape[1:])
                leaf[t.axis] = rows.shape[0]
                val = sync.from_rows(rows[None], leaf, t)[0]
            else:  # block leaf: block (or slot) i, [L, rs]
                if pruned and not t.full:
                    rows = sync.fsdp_gather(x, rlen, self.dtype,
                                            idx=sync.slot_indices(t, 0, i, 1))
                else:
                    keep = (jnp.asarray(t.held)[my, 0, i][None] if masked_grads and not t.full
                            else None)
                    rows = sync.fsdp_gather(jax.lax.dynamic_slice_in_dim(x, i, 1, 0), rlen,
                                            self.dtype, keep=keep)
                val = rows.reshape(shape[1:])
            return checkpoint_name(val, _GATHERED)

        return self._tokens_loss(kept, n, get, batch, train=mode == "train")

    def _divide_counts(self, grads):
        """FSDP: masked sums in layout ``S`` -> masked means (multiplicity of every row)."""
        W = self.plan.workers

        def one(p, g):
            t = self.holder_tables.get(p)
            if t is None:
                return g / W
            c = t.counts[0][:, None] if not t.grouped else t.counts[..., None]
            return g / jnp.asarray(c, g.dtype)
        return _map_paths(one, grads)

    # ---------------------------------------------------------------- step
    def _local_grads(self, params, batch):
        """(loss, local gradient in the compact layout with leading 1s, compact params).
        Under FSDP the gradient is already the masked mean, in layout ``S``."""
        if self.fsdp:
            loss, g = jax.value_and_grad(self._fsdp_loss)(params, batch)
            return loss, self._divide_counts(g), params
        if not self.plan.backward:
            local = self._strip(params, self.param_layout)
            local = _map_paths(lambda p, x: sync.to_varying(x)
                                if self.param_layout[p] == "R" else x, local)
            loss, g = jax.value_and_grad(self._forward_loss)(local, batch)
            return loss, _map_paths(lambda p, x: x if self.param_layout[p] == "R" else x[None],
                                     g), params
        my = sync.worker_index(AXIS)
        compact = _map_paths(lambda p, x: x if self.rule_of[p] is None
                              else self._prune_worker(p, x, my), params)
        diff = _map_paths(lambda p, x: sync.to_varying(x) if self.rule_of[p] is None else x,
                           compact)  # local gradients for always-kept leaves too
        loss, g = jax.value_and_grad(self._backward_loss)(diff, params, batch)
        lead = lambda tree: _map_paths(  # noqa: E731
            lambda p, x: x if self.compact_layout[p] == "R" else x[None], tree)
        return loss, lead(g), lead(compact)

    def _averaged_grads(self, params, batch):
        loss, g, _ = self._local_grads(params, batch)
        return jax.lax.pmean(loss, AXIS), (g if self.fsdp else self.average(g))

    def grads_fn(self):
        """Jitted ``(params, batch) -> (loss, averaged gradient)``; the gradient is in the
        compact layout (``compact_specs``; layout ``S`` under FSDP). For inspection and tests."""
        fn = jax.shard_map(self._averaged_grads, mesh=self.mesh,
                           in_specs=(self.param_specs, P(AXIS)),
                           out_specs=(P(), self.compact_specs))
        return jax.jit(fn)

    def _writeback(self, full, compact):
        """Backward masking: every worker's full parameters from the holders' new values
        (:func:`sdp_jax.sync.gather_full`: the holder mean sent to the owners by an all_to_all
        of held bytes, then an all-gather). Always-kept leaves are already the same everywhere
        and are taken as they are."""
        kept, blocks, neurons = self._by_kind(compact)
        local = {p: (x[0] if self.compact_layout[p] == "C" else x)
                 for p, x in _select(compact, lambda p: True).items()}
        rebuilt = _select(sync.gather_full(layout_lib.unflatten(local), self.plan),
                          lambda p: True)
        return _merge(full, {**kept, **{p: rebuilt[p] for p in (*blocks, *neurons)}})

    def _local_step(self, state, batch, sync_now: bool):
        params = state["params"]
        loss, grads, compact = self._local_grads(params, batch)
        if self.fsdp:  # every element of the averaged gradient lives on one device
            gnorm = jnp.sqrt(sync.shards_sq_norm(_select(grads, lambda p: True), AXIS))
        elif self.periodic:  # each worker on its own gradient; norm of its own subnetwork
            gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                                 for g in jax.tree.leaves(grads)))
        else:
            grads = self.average(grads)
            gnorm = self.grad_norm(grads)
        grads = sync.clip_to(grads, gnorm, self.optim.grad_clip)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], compact)
        new = optax.apply_updates(compact, updates)
        if self.plan.backward and not self.fsdp:
            new = self._writeback(params, new)
        elif self.periodic and sync_now:
            new = self.average(new)
        if self.periodic:
            gnorm = jax.lax.pmean(gnorm, AXIS)
        metrics = {"train_loss": jax.lax.pmean(loss, AXIS), "grad_norm": gnorm,
                   "lr": self.schedule(state["step"])}
        return {"params": new, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def train_step_fn(self, sync_now: bool = True):
        """The jitted step ``(state, batch int32 [W*b, T+1] sharded P('data')) -> (state,
        metrics)``; ``state`` is donated. metrics: ``train_loss`` (nats/token, mean over
        workers), ``grad_norm`` (before clipping), ``lr``. With parameter averaging,
        ``sync_now=False`` gives the step without the averaging."""
        sync_now = bool(sync_now) or not self.periodic
        if sync_now not in self._train_steps:
            fn = jax.shard_map(lambda s, b: self._local_step(s, b, sync_now), mesh=self.mesh,
                               in_specs=(self.state_specs, P(AXIS)),
                               out_specs=(self.state_specs, P()))
            self._train_steps[sync_now] = jax.jit(fn, donate_argnums=0)
        return self._train_steps[sync_now]

    def is_sync_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) ends with parameter averaging."""
        return (not self.periodic or step % self.sync_every == 0
                or step == self.total_steps)

    # ---------------------------------------------------------------- eval (full model)
    def _local_eval(self, params, batch):
        if self.fsdp:
            return jax.lax.pmean(self._fsdp_loss(params, batch, mode="eval"), AXIS)
        my_view = self._strip(params, self.param_layout)
        kept = _select(my_view, lambda p: p[0] != BLOCK_KEY)
        if self.periodic:  # evaluate the holders' average
            kept = {p: jax.lax.pmean(x, AXIS) for p, x in kept.items()}
        flat = _select(params, lambda p: p[0] == BLOCK_KEY)

        def get(p, r, g, _):
            lay = self.param_layout[p]
            if lay == "R":
                v = jax.lax.dynamic_index_in_dim(flat[p], g, 0, False)
            elif r is None:  # Rw
                v = jax.lax.pmean(jax.lax.dynamic_index_in_dim(flat[p][0], g, 0, False), AXIS)
            elif r.kind == "block":
                if self.block_tables.full and not self.periodic:
                    v = jax.lax.dynamic_index_in_dim(flat[p][0], g, 0, False)
                else:
                    v = sync.component_mean({p: flat[p]}, g, self.block_tables, AXIS)[p]
            else:
                v = jnp.moveaxis(sync.layer_value({p: flat[p]}, {p: self.layer_tables[p]}, g,
                                                  AXIS)[p], 0, r.axis - 1)
            return self._cast(v)

        loss = self._tokens_loss(kept, self.model_cfg.n_layers, get, batch, train=False)
        return jax.lax.pmean(loss, AXIS)

    def eval_step_fn(self):
        """Jitted full-model loss ``(params, batch [W*b, T+1]) -> nats/token``: all ``L``
        blocks with all neurons and heads, each block's parameters fetched from their holders
        (or FSDP owners) when it is reached, so no device stores the full model."""
        if self._eval_step is None:
            fn = jax.shard_map(self._local_eval, mesh=self.mesh,
                               in_specs=(self.param_specs, P(AXIS)), out_specs=P())
            self._eval_step = jax.jit(fn)
        return self._eval_step

    # ---------------------------------------------------------------- export
    def full_params(self, params):
        """Unprune: the full model's parameters (numpy, on the host), each component taken
        from its first holder (for always-kept per-worker copies: worker 0's). Gathers the
        whole model to the host."""
        flat = _select(params, lambda p: True)
        shapes = _select(self.full_param_shapes, lambda p: True)
        out = {}
        W = self.plan.workers
        for p, x in flat.items():
            x = np.asarray(jax.device_get(x))
            lay, r = self.param_layout[p], self.rule_of[p]
            if lay == "S":
                out[p] = np.asarray(self._from_shards(p, x))
            elif lay == "R":
                out[p] = x
            elif r is None:
                out[p] = x[0]
            elif r.kind == "block":
                t = self.block_tables
                first = np.argmax(t.mask, axis=0)
                out[p] = x[first, t.slot[first, np.arange(t.components)]]
            else:
                t = self.layer_tables[p]
                full = np.zeros(shapes[p].shape, x.dtype)
                fm = np.moveaxis(full, r.axis, 1)
                for w in range(W - 1, -1, -1):  # lower workers win: first holder
                    xm = np.moveaxis(x[w], r.axis, 1)
                    for layer in range(t.layers):
                        fm[layer, t.indices[w, layer]] = xm[layer]
                out[p] = np.moveaxis(fm, 1, r.axis)
        return _map_paths(lambda p, s: out[p], self.full_param_shapes)

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
