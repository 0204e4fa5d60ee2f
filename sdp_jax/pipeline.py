"""Pipeline parallelism on a mesh axis ``stage`` with compressed stage boundaries (MAPL).

The LLaMA model's ``L`` blocks are split into ``P`` pipeline stages of ``L / P`` consecutive blocks;
device ``(w, s)`` of the mesh ``('data', 'stage')`` runs stage ``s`` of worker ``w``. A step
runs the GPipe schedule (Huang et al. 2019, "GPipe", arXiv 1811.06965, Sec. 2.2): the worker's
batch is cut into ``M`` microbatches and ``M + P - 1`` ticks are run; at each tick every stage
applies its blocks to what it received and sends the result to the next stage with
``lax.ppermute`` over ``stage``. The backward pass is the transpose of that program (``jax.grad``
of the whole schedule: all forwards, then all backwards, as in GPipe), so the gradients crossing a
boundary have the shape of the forward payload: r wide when compressed.

Compression of a boundary (MAPL: Janson, Oyallon, Belilovsky, arXiv 2606.05484; DESIGN.md,
"MAPL-style projectors"): stage ``s`` sends, per token, ``c = (h - anchor_s(token)) A_s``
(r = d / ratio wide, float32) and the token id (the narrowest unsigned integer type that holds the
vocabulary: one byte for byte-level text); stage ``s + 1`` rebuilds
``h' = c A_s^T + anchor_s(token)``, with ``anchor_s(token) = E_s[token] B_s`` for a learnable
``E_s`` [V, r_a] and a frozen orthogonal ``B_s`` [r_a, d] (factorized anchor embeddings). Methods:

* ``none``: the d-wide residual stream crosses as is (no anchors, no token ids);
* ``fixed``: ``A_s`` a frozen random orthogonal matrix (the Subspace Networks baseline);
* ``unconstrained``: ``A_s`` trained by AdamW like every other weight (it leaves the manifold);
* ``mapl``: ``A_s`` on the Stiefel manifold, trained by :func:`sdp_jax.stiefel.stiefel_sgd`.

The compressed methods share the anchors, so they differ only in how ``A`` is obtained. Our
choices where the paper is silent: one projector and one anchor table per boundary, ``A`` and
``E`` initialized as a random orthogonal matrix and N(0, 0.02^2), no weight decay on boundary
parameters, anchors at every compressed boundary.

Composition with the ``data`` axis: each worker holds, in every stage, ``k = C * L / P`` of the
stage's blocks (the same cyclic mask in every stage), stored compact as a global
``[W, P, k, ...]`` array sharded ``P('data', 'stage')``: the device keeps only its worker's blocks
of its stage (B-SDP forward masking; ``C = 1`` is DDP on the same code path). Gradients of
compact blocks are averaged over exactly their holders (a masked sum over ``data`` divided by the
multiplicity; DESIGN.md invariant 2), always-kept and boundary parameters over every worker, and
global-norm clipping counts every block once (invariant 6).

Not built here: 1F1B scheduling (GPipe only), neuron-level and backward-masking variants with a
pipeline, FSDP, mixed precision and activation checkpointing inside the pipeline (float32 only).
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
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax import fields, stiefel, sync
from sdp_jax import masks as masks_lib
from sdp_jax import train_step as ts
from sdp_jax.models.llama import Llama, LlamaConfig, block_apply_fn, next_token_loss

DATA = "data"
STAGE = "stage"
METHODS = ("none", "fixed", "unconstrained", "mapl")
SCHEDULES = ("gpipe",)
PIPE_VARIANTS = ("ddp", "b-sdp")
FROZEN = "frozen"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline and boundary-compression settings (the ``pipeline`` config section).

    Attributes:
      stages: ``P`` pipeline stages (mesh axis ``stage``); 1 = no pipeline.
      microbatches: ``M`` GPipe microbatches per worker batch (``batch_per_worker % M == 0``).
      schedule: ``gpipe`` (the only one built).
      method: ``none`` | ``fixed`` | ``unconstrained`` | ``mapl`` (module docstring).
      ratio: compression ratio ``d / r`` (``d_model`` divisible by it); ignored by ``none``.
      anchor_rank: ``r_a``, rank of the factorized anchor embeddings (0 = no anchors, and no
        token ids sent).
      proj_lr: peak learning rate of the Stiefel optimizer (``mapl``; spectral-norm step
        length), with the run's warm-up and cosine decay.
      proj_momentum: its momentum.
      polar_steps: Polar Express iterations per ``msign``.
      rvq_levels: residual vector quantization of the compressed payload: levels (0 = off).
        The sender sends ``rvq_levels`` code indices per token instead of ``r`` floats; the
        receiver sums its copy of the codebooks' vectors.
      rvq_codebook: ``K`` codes per level (indices travel as uint8 for K <= 256).
      rvq_beta: commitment weight (van den Oord et al. 2017, "Neural Discrete Representation
        Learning", arXiv 1711.00937, Eq. 3); the codebook and commitment terms are added to the
        training loss.
    """

    stages: int = 1
    microbatches: int = 4
    schedule: str = "gpipe"
    method: str = "none"
    ratio: int = 4
    anchor_rank: int = 16
    proj_lr: float = 0.01
    proj_momentum: float = 0.9
    polar_steps: int = 10
    rvq_levels: int = 0
    rvq_codebook: int = 256
    rvq_beta: float = 0.25

    def __post_init__(self):
        for name in ("stages", "microbatches", "ratio", "rvq_codebook"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"pipeline.{name}={v!r} must be a positive integer "
                                 f"(--config.pipeline.{name}=...).")
        if isinstance(self.rvq_levels, bool) or not isinstance(self.rvq_levels, int) \
                or self.rvq_levels < 0:
            raise ValueError(f"pipeline.rvq_levels={self.rvq_levels!r} must be an integer >= 0 "
                             "(0 = no quantization).")
        if self.rvq_codebook > 65536:
            raise ValueError(f"pipeline.rvq_codebook={self.rvq_codebook} exceeds 65536 codes "
                             "(indices travel as uint16 at most).")
        beta = self.rvq_beta
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1e6:
            raise ValueError(f"pipeline.rvq_beta={beta!r} must be a number >= 0.")
        ps = self.polar_steps
        if isinstance(ps, bool) or not isinstance(ps, int) or not 8 <= ps <= 32:
            raise ValueError(f"pipeline.polar_steps={ps!r} must be an integer in [8, 32]: fewer "
                             "Polar Express steps do not reach the polar factor (Amsel et al. "
                             "publish 8 coefficient sets), more only lengthen the compile; use 10.")
        if self.method != "none" and self.stages == 1:
            raise ValueError(f"pipeline.method={self.method!r} compresses stage boundaries, but "
                             "pipeline.stages=1 has none; set --config.pipeline.stages=2 (or "
                             "more), or method=none.")
        a = self.anchor_rank
        if isinstance(a, bool) or not isinstance(a, int) or a < 0:
            raise ValueError(f"pipeline.anchor_rank={a!r} must be an integer >= 0 (0 = no "
                             "anchors).")
        if self.method not in METHODS:
            raise ValueError(f"pipeline.method={self.method!r}; choose one of "
                             f"{', '.join(METHODS)}.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline.schedule={self.schedule!r}; only gpipe is built "
                             "(1F1B is not).")
        lr, mom = self.proj_lr, self.proj_momentum
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) \
                or lr <= 0:
            raise ValueError(f"pipeline.proj_lr={lr!r} must be a finite number > 0.")
        if isinstance(mom, bool) or not isinstance(mom, (int, float)) or not 0 <= mom < 1:
            raise ValueError(f"pipeline.proj_momentum={mom!r} must be in [0, 1).")

    @classmethod
    def from_config(cls, cfg) -> PipelineConfig:
        return fields.from_section(cls, cfg, "pipeline")

    @property
    def compressed(self) -> bool:
        return self.method != "none" and self.stages > 1

    @property
    def quantized(self) -> bool:
        return self.compressed and self.rvq_levels > 0

    def width(self, d_model: int) -> int:
        """Float elements per token of the boundary payload: ``r = d / ratio`` or ``d``."""
        return d_model // self.ratio if self.compressed else d_model

    def check(self, model: LlamaConfig, batch_per_worker: int) -> None:
        """Raise ValueError (naming the value and the fix) if this pipeline cannot run ``model``."""
        if model.n_layers % self.stages:
            raise ValueError(f"pipeline.stages={self.stages} does not divide "
                             f"model.n_layers={model.n_layers}; choose a divisor of it.")
        if batch_per_worker % self.microbatches:
            raise ValueError(f"pipeline.microbatches={self.microbatches} does not divide "
                             f"batch_per_worker={batch_per_worker}; choose a divisor of it.")
        if self.rvq_levels and self.method == "none":
            raise ValueError(f"pipeline.rvq_levels={self.rvq_levels} needs a compressed method "
                             "(fixed, unconstrained, mapl), not none; set rvq_levels=0.")
        if self.compressed:
            d = model.d_model
            if d % self.ratio or self.ratio > d:
                ok = [r for r in (2, 4, 8, 16, 32) if d % r == 0]
                raise ValueError(f"pipeline.ratio={self.ratio} does not divide "
                                 f"model.d_model={d}; use a divisor of it"
                                 + (f" (e.g. {', '.join(map(str, ok))})." if ok else "."))
            if self.anchor_rank > d:
                raise ValueError(f"pipeline.anchor_rank={self.anchor_rank} exceeds "
                                 f"model.d_model={d}; use at most d.")


def _orthogonal(key, n: int, d: int, r: int) -> jax.Array:
    """``n`` random matrices with orthonormal columns, float32 [n, d, r] (QR of a Gaussian)."""
    q, rr = jnp.linalg.qr(jax.random.normal(key, (n, d, r), jnp.float32))
    return q * jnp.sign(jnp.diagonal(rr, axis1=-2, axis2=-1))[:, None, :]


def projector_key(method: str) -> str:
    """Name of the projector leaf under ``boundary`` for ``method``: the name routes it to its
    optimizer (``stiefel`` -> :func:`stiefel.stiefel_sgd`, ``frozen`` -> no update)."""
    return {"mapl": "stiefel_A", "fixed": "frozen_A", "unconstrained": "A"}[method]


def init_boundary(key, model: LlamaConfig, pipe: PipelineConfig) -> dict:
    """Boundary parameters of the ``P - 1`` boundaries (float32):

    ``{projector_key(method): [P-1, d, r], "anchor_embed": [P-1, V, r_a],
    "frozen_anchor_basis": [P-1, r_a, d]}``; the anchor leaves are absent when
    ``anchor_rank == 0`` and the whole dict is empty for ``none``; with RVQ also
    ``"rvq_codebook": [P-1, levels, K, r]``."""
    if not pipe.compressed:
        return {}
    n, d, r, ra = pipe.stages - 1, model.d_model, pipe.width(model.d_model), pipe.anchor_rank
    k1, k2, k3 = jax.random.split(key, 3)
    out = {projector_key(pipe.method): _orthogonal(k1, n, d, r)}
    if ra:
        out["anchor_embed"] = jax.random.normal(k2, (n, model.vocab_size, ra),
                                                jnp.float32) * model.init_std
        out["frozen_anchor_basis"] = jnp.swapaxes(_orthogonal(k3, n, d, ra), -1, -2)
    if pipe.quantized:
        out["rvq_codebook"] = jax.random.normal(
            jax.random.fold_in(key, 7), (n, pipe.rvq_levels, pipe.rvq_codebook, r),
            jnp.float32) * model.init_std
    return out


def _rms(x, scale, eps):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


class Boundary:
    """Encoder / decoder of the compressed boundaries (pure functions of the boundary params)."""

    def __init__(self, pipe: PipelineConfig):
        self.pipe = pipe
        self.key = projector_key(pipe.method) if pipe.compressed else None

    def _anchor(self, bnd, i, tok):
        if "anchor_embed" not in bnd:
            return 0.0
        basis = lax.stop_gradient(bnd["frozen_anchor_basis"][i])
        return jnp.take(bnd["anchor_embed"][i], tok, axis=0) @ basis

    def _proj(self, bnd, i):
        a = bnd[self.key][i]
        return lax.stop_gradient(a) if self.pipe.method == "fixed" else a

    def encode(self, bnd, i, h, tok):
        """Payload of boundary ``i`` (after stage ``i``): float32 [b, T, r] (``[b, T, d]`` for
        ``none``) from the residual stream ``h`` [b, T, d] and token ids ``tok`` int32 [b, T]."""
        if self.key is None:
            return h
        return (h - self._anchor(bnd, i, tok)) @ self._proj(bnd, i)

    def quantize(self, bnd, i, c):
        """Residual vector quantization of the payload ``c`` [b, T, r] at boundary ``i``.

        Returns ``(q_st, codes, aux)``: ``q_st`` = ``c + stop_gradient(q - c)`` (the quantized
        value forward, the straight-through gradient backward; van den Oord et al. 2017,
        Sec. 3.2), ``codes`` [b, T, levels] in :func:`token_id_dtype` of ``K``, and ``aux`` the
        codebook + ``beta`` commitment loss summed over levels (float32 scalar)."""
        cb = bnd["rvq_codebook"][i]                               # [levels, K, r]
        res, q, aux, codes = c, jnp.zeros_like(c), 0.0, []
        for level in range(cb.shape[0]):
            e_all = cb[level]
            d2 = (jnp.sum(res * res, -1, keepdims=True) - 2 * res @ e_all.T
                  + jnp.sum(e_all * e_all, -1))
            idx = jnp.argmin(lax.stop_gradient(d2), axis=-1)
            e = jnp.take(e_all, idx, axis=0)
            aux = aux + jnp.mean((lax.stop_gradient(res) - e) ** 2) \
                + self.pipe.rvq_beta * jnp.mean((res - lax.stop_gradient(e)) ** 2)
            q, res = q + e, res - lax.stop_gradient(e)
            codes.append(idx)
        codes = jnp.stack(codes, -1).astype(token_id_dtype(cb.shape[1]))
        return c + lax.stop_gradient(q - c), codes, aux

    @staticmethod
    def lookup(cb, codes):
        """Sum of the codebook vectors ``cb`` [levels, K, r] named by ``codes`` [..., levels]."""
        levels = jnp.arange(cb.shape[0])
        return jnp.sum(cb[levels, codes.astype(jnp.int32)], axis=-2)

    def decode(self, bnd, i, c, tok):
        """Rebuilt residual stream [b, T, d] from the payload ``c`` of boundary ``i``."""
        if self.key is None:
            return c
        return c @ jnp.swapaxes(self._proj(bnd, i), -1, -2) + self._anchor(bnd, i, tok)


class PipelineStep:
    """Builds the pipelined train and eval steps of a LLaMA model on a ``(data, stage)`` mesh.

    Args:
      model: the model shape (``n_layers`` divisible by ``pipe.stages``).
      pipe: :class:`PipelineConfig`.
      optim: :class:`sdp_jax.train_step.OptimConfig` (AdamW for every non-projector weight).
      mesh: a ``jax.sharding.Mesh`` with axes ``('data', 'stage')`` of sizes ``(W, P)``; see
        :func:`make_mesh`.
      total_steps: length of the learning-rate schedules.
      variant: ``ddp`` or ``b-sdp`` (blocks per stage masked on ``data``).
      coverage: ``C`` (B-SDP); the stage's ``L / P`` blocks times ``C`` must be whole.
      scheme, mask_seed, allow_nonuniform: the mask recipe (:class:`sdp_jax.masks.MaskRecipe`).
      batch_per_worker: sequences per worker per step (for the microbatch check).

    Raises:
      ValueError: a bad combination (names the value and the fix), before anything is compiled.
    """

    def __init__(self, model: LlamaConfig, pipe: PipelineConfig, optim: ts.OptimConfig, mesh,
                 total_steps: int, *, variant: str = "ddp", coverage: float = 1.0,
                 scheme: str = "cyclic", mask_seed: int = 0, allow_nonuniform: bool = False,
                 batch_per_worker: int | None = None):
        if tuple(mesh.axis_names) != (DATA, STAGE):
            raise ValueError(f"mesh axes {mesh.axis_names} must be ('data', 'stage'); use "
                             "sdp_jax.pipeline.make_mesh.")
        W, Pn = mesh.shape[DATA], mesh.shape[STAGE]
        if Pn != pipe.stages:
            raise ValueError(f"the mesh has {Pn} stages but pipeline.stages={pipe.stages}.")
        if variant not in PIPE_VARIANTS:
            raise ValueError(f"sdp.variant={variant!r} is not built with a pipeline; use one of "
                             f"{', '.join(PIPE_VARIANTS)} (or pipeline.stages=1).")
        if variant == "ddp" and coverage != 1.0:
            raise ValueError(f"sdp.coverage={coverage} with variant ddp; DDP holds every block "
                             "(coverage 1), use b-sdp for C < 1.")
        pipe.check(model, batch_per_worker or pipe.microbatches)
        self.model, self.pipe, self.optim, self.mesh = model, pipe, optim, mesh
        self.W, self.P, self.total_steps = W, Pn, total_steps
        self.Lp = model.n_layers // Pn
        self.recipe = masks_lib.MaskRecipe(scheme, W, self.Lp, coverage, mask_seed,
                                           allow_nonuniform)
        self.mask = self.recipe.matrix()                          # [W, Lp], same in every stage
        self.held = masks_lib.held_table(self.mask)               # [W, k]
        self.k = self.held.shape[1]
        self.counts = masks_lib.multiplicities(self.mask)         # [Lp]
        self.first = np.argmax(self.mask, axis=0)                 # a holder of each block
        self.first_slot = masks_lib.slot_table(self.mask)[self.first, np.arange(self.Lp)]
        self.boundary = Boundary(pipe)
        graph_model = nnx.eval_shape(lambda: Llama(model, nnx.Rngs(0)))
        self._block = block_apply_fn(graph_model)
        self._onehot = np.zeros((W, self.k, self.Lp), np.float32)
        for w in range(W):
            self._onehot[w, np.arange(self.k), self.held[w]] = 1.0
        self.tx = self._optimizer()
        self._train = None
        self._eval = None

    # ---- layouts -------------------------------------------------------------------------

    def _specs(self, params):
        def spec(path, _):
            top = str(getattr(path[0], "key", path[0]))
            return P(DATA, STAGE) if top == "blocks" else P()
        return jax.tree_util.tree_map_with_path(spec, params)

    def shardings(self, tree_specs):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), tree_specs,
                            is_leaf=lambda x: isinstance(x, P))

    def _labels(self, params):
        def label(path, _):
            keys = [str(getattr(k, "key", k)) for k in path]
            if any(FROZEN in k for k in keys):
                return FROZEN
            if any(stiefel.PROJECTOR in k for k in keys):
                return stiefel.PROJECTOR
            return stiefel.OTHER
        return jax.tree_util.tree_map_with_path(label, params)

    def _optimizer(self):
        def decay(params):  # no decay on norm scales and boundary parameters
            return jax.tree_util.tree_map_with_path(
                lambda path, _: not any(n in str(getattr(k, "key", k)) for k in path
                                        for n in ("norm", "boundary")), params)
        adamw = ts.make_optimizer(self.optim, self.total_steps, decay_mask=decay)
        sched = optax.warmup_cosine_decay_schedule(
            0.0, self.pipe.proj_lr, min(self.optim.warmup_steps, max(self.total_steps - 1, 0)),
            max(self.total_steps, self.optim.warmup_steps + 1),
            self.pipe.proj_lr * self.optim.min_lr_ratio)
        proj = stiefel.stiefel_sgd(sched, self.pipe.proj_momentum, self.pipe.polar_steps)
        return optax.partition({stiefel.PROJECTOR: proj, FROZEN: optax.set_to_zero(),
                                stiefel.OTHER: adamw}, self._labels)

    def full_to_compact(self, full: dict) -> dict:
        """``{kept, blocks [L, ...], boundary}`` -> the training layout: blocks become
        ``[W, P, k, ...]`` (worker ``w`` stage ``s`` slot ``j`` = block ``s*L/P + held[w, j]``)."""
        def compact(x):
            x = x.reshape((self.P, self.Lp) + x.shape[1:])
            return jnp.stack([x[:, self.held[w]] for w in range(self.W)])
        return {**full, "blocks": jax.tree.map(compact, full["blocks"])}

    def compact_to_full(self, params: dict) -> dict:
        """Inverse of :meth:`full_to_compact`: every block from one of its holders (holders
        agree), ``[L, ...]``."""
        def full(x):
            x = x[self.first, :, self.first_slot]                 # [Lp, P, ...]
            x = jnp.swapaxes(x, 0, 1)
            return x.reshape((self.P * self.Lp,) + x.shape[2:])
        return {**params, "blocks": jax.tree.map(full, params["blocks"])}

    def init_full(self, seed: int) -> dict:
        """Full parameters ``{kept: {embed, final_norm, lm_head}, blocks: [L, ...], boundary}``
        (float32), the model initialized as :class:`sdp_jax.models.llama.Llama`."""
        model = Llama(self.model, nnx.Rngs(seed))
        p = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        kept = {"embed": p["embed"], "final_norm": p["final_norm"]}
        if "lm_head" in p:
            kept["lm_head"] = p["lm_head"]
        bnd = init_boundary(jax.random.key(seed + 104729), self.model, self.pipe)
        return {"kept": kept, "blocks": p["blocks"], "boundary": bnd}

    def init_state(self, seed: int) -> dict:
        """``{params, opt_state, step}`` placed on the mesh (blocks compact, the rest
        replicated)."""
        params = self.full_to_compact(self.init_full(seed))
        params = jax.device_put(params, self.shardings(self._specs(params)))
        opt_state = jax.jit(self.tx.init)(params)
        return {"params": params, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32)}

    def abstract_state(self) -> Any:
        """Shapes, dtypes and shardings of :meth:`init_state` (for checkpoint restore)."""
        def build():
            params = self.full_to_compact(self.init_full(0))
            return {"params": params, "opt_state": self.tx.init(params),
                    "step": jnp.zeros((), jnp.int32)}
        shapes = jax.eval_shape(build)
        p_sh = self.shardings(self._specs(shapes["params"]))
        out = jax.jit(build, out_shardings={"params": p_sh, "opt_state": None,
                                            "step": NamedSharding(self.mesh, P())})
        return out.eval_shape()

    # ---- the model -----------------------------------------------------------------------

    def _run_blocks(self, blocks, h):
        h, _ = lax.scan(lambda x, bp: (self._block(bp, x), None), h, blocks)
        return h

    def _head_loss(self, kept, h, y):
        h = _rms(h, kept["final_norm"]["scale"], self.model.norm_eps)
        w = kept["embed"].T if self.model.tie_embeddings else kept["lm_head"]
        return next_token_loss(h @ w, y)

    def reference_loss(self, full: dict, tokens) -> jax.Array:
        """The same model on one device, stage after stage (no pipeline): mean next-token loss
        in nats of ``tokens`` int32 [B, T + 1] (plus the RVQ codebook and commitment terms when
        quantized) under full parameters (:meth:`init_full`
        layout; ``blocks`` may also be one worker's subnetwork ``[P * k, ...]``, k per stage).
        The pipelined steps must agree with it."""
        x, y = tokens[:, :-1], tokens[:, 1:]
        h = jnp.take(full["kept"]["embed"], x, axis=0)
        per_stage = jax.tree.leaves(full["blocks"])[0].shape[0] // self.P
        bnd, aux = full["boundary"], 0.0
        for s in range(self.P):
            lo = s * per_stage
            sl = jax.tree.map(lambda a, lo=lo: a[lo:lo + per_stage], full["blocks"])
            h = self._run_blocks(sl, h)
            if s < self.P - 1:
                c = self.boundary.encode(bnd, s, h, x)
                if self.pipe.quantized:
                    c, _, a = self.boundary.quantize(bnd, s, c)
                    aux = aux + a
                h = self.boundary.decode(bnd, s, c, x)
        return self._head_loss(full["kept"], h, y) + aux

    def _pipe_loss(self, params, tokens, lead: int):
        """Inside ``shard_map``: this device's stage of the GPipe schedule. ``lead`` = leading
        block axes of size 1 to drop (2 for the compact layout, 1 for full blocks)."""
        kept, bnd = params["kept"], params["boundary"]
        blocks = jax.tree.map(lambda a: a.reshape(a.shape[lead:]), params["blocks"])
        Pn, M = self.P, self.pipe.microbatches
        s = lax.axis_index(STAGE)
        x, y = tokens[:, :-1], tokens[:, 1:]
        b, T = x.shape
        xs = x.reshape(M, b // M, T)
        width = self.pipe.width(self.model.d_model)
        send_tok = self.pipe.compressed and self.pipe.anchor_rank > 0
        id_dtype = token_id_dtype(self.model.vocab_size)
        perm = [(i, i + 1) for i in range(Pn - 1)]
        enc_i = jnp.clip(s, 0, max(Pn - 2, 0))
        dec_i = jnp.clip(s - 1, 0, max(Pn - 2, 0))
        vary = (DATA, STAGE)
        init = (lax.pcast(jnp.zeros((b // M, T, width), jnp.float32), vary, to="varying"),
                lax.pcast(jnp.zeros((b // M, T), id_dtype), vary, to="varying"))
        quant = self.pipe.quantized

        # RVQ: only the code indices travel forward; the receiver sums its own copy of the
        # codebooks, and the straight-through gradient (r floats) travels back.
        @jax.custom_vjp
        def send_codes(q, codes, cb):
            del q
            return self.boundary.lookup(cb, lax.ppermute(codes, STAGE, perm))

        def send_fwd(q, codes, cb):
            return send_codes(q, codes, cb), cb

        def send_bwd(cb, g):
            return lax.ppermute(g, STAGE, [(j, i) for i, j in perm]), None, jnp.zeros_like(cb)

        send_codes.defvjp(send_fwd, send_bwd)

        def tick(carry, t):
            recv, recv_tok = carry
            tok0 = xs[jnp.minimum(t, M - 1)]
            first = s == 0
            tok = jnp.where(first, tok0, recv_tok.astype(jnp.int32)) if send_tok else tok0
            h_in = jnp.where(first, jnp.take(kept["embed"], tok0, axis=0),
                             self.boundary.decode(bnd, dec_i, recv, tok))
            h = self._run_blocks(blocks, h_in)
            aux = jnp.zeros((), jnp.float32)
            if Pn > 1:
                c = self.boundary.encode(bnd, enc_i, h, tok)
                if quant:
                    q, codes, aux = self.boundary.quantize(bnd, enc_i, c)
                    recv = send_codes(q, codes, bnd["rvq_codebook"][dec_i])
                    aux = jnp.where((t >= s) & (t - s < M) & (s < Pn - 1), aux, 0.0)
                else:
                    recv = lax.ppermute(c, STAGE, perm)
                if send_tok:
                    recv_tok = lax.ppermute(tok.astype(id_dtype), STAGE, perm)
            return (recv, recv_tok), (h, aux)

        _, (hs, auxs) = lax.scan(tick, init, jnp.arange(M + Pn - 1))
        out = hs[Pn - 1:].reshape(b, T, -1)                       # the last stage's outputs
        lm = jnp.where(s == Pn - 1, self._head_loss(kept, out, y), 0.0)
        # RVQ codebook + commitment terms: mean over microbatches, summed over boundaries
        aux = jnp.sum(auxs) / M if quant else jnp.zeros((), jnp.float32)
        lm, aux = (lax.pmean(lax.psum(v, STAGE), DATA) for v in (lm, aux))
        return lm + aux, lm

    def pipelined_loss_fn(self, compact: bool = True):
        """``(params, tokens [W*b, T+1] int32) -> (training loss, next-token loss)`` (float32
        scalars, nats per token; they differ by the RVQ codebook and commitment terms) of the
        GPipe schedule on the mesh; ``compact``: params in the training layout, else full
        blocks ``[L, ...]`` (the full model, as evaluated)."""
        def fn(params, tokens):
            if not compact:
                params = {**params, "blocks": jax.tree.map(
                    lambda a: a.reshape((self.P, self.Lp) + a.shape[1:]), params["blocks"])}
            specs = self._specs(params)
            if not compact:
                specs = {**specs, "blocks": jax.tree.map(lambda _: P(STAGE), specs["blocks"],
                                                         is_leaf=lambda x: isinstance(x, P))}
            return jax.shard_map(lambda p, t: self._pipe_loss(p, t, 2 if compact else 1),
                                 mesh=self.mesh, in_specs=(specs, P(DATA)),
                                 out_specs=(P(), P()))(
                params, tokens)
        return fn

    # ---- averaging, clipping, the step -----------------------------------------------------

    def average_block_grads(self, g):
        """Holder mean of compact block gradients ``[W, P, k, ...]`` of the global mean loss.

        Worker ``w``'s own gradient is ``W * g[w]`` (the loss is a mean over workers), so the
        mean over the ``m_l`` holders of block ``l`` is ``W / m_l * sum_{w holds l} g[w]``: a
        masked sum over ``data`` divided by the count (DESIGN.md invariant 2). Returns the
        compact averaged gradient and the full one ``[P, Lp, ...]`` (each block once)."""
        scale = jnp.asarray(self.W / self.counts, jnp.float32)

        def one(x):
            full = jnp.einsum("wkl,wpk...->pl...", self._onehot, x)
            full = full * scale.reshape((1, -1) + (1,) * (full.ndim - 2))
            return jnp.einsum("wkl,pl...->wpk...", self._onehot, full), full
        pairs = jax.tree.map(one, g)
        is_pair = lambda t: isinstance(t, tuple)
        return (jax.tree.map(lambda t: t[0], pairs, is_leaf=is_pair),
                jax.tree.map(lambda t: t[1], pairs, is_leaf=is_pair))

    def grads(self, params, tokens):
        """``(loss, grads, norm)``: the training loss (:meth:`reference_loss`'s), the averaged
        gradients (training layout) of the pipelined step and their global norm with each
        block counted once."""
        (loss, _), g = jax.value_and_grad(self.pipelined_loss_fn(), has_aux=True)(params, tokens)
        return (loss, *self._average(g))

    def _average(self, g):
        blocks, full = self.average_block_grads(g["blocks"])
        g = {**g, "blocks": blocks}
        once = {"kept": g["kept"], "blocks": full,
                "boundary": {k: v for k, v in g["boundary"].items() if FROZEN not in k}}
        return g, optax.tree.norm(once)

    def _step(self, state, tokens):
        (loss, lm), g = jax.value_and_grad(self.pipelined_loss_fn(), has_aux=True)(
            state["params"], tokens)
        g, norm = self._average(g)
        g = sync.clip_to(g, norm, self.optim.grad_clip)
        updates, opt_state = self.tx.update(g, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"train_loss": lm, "grad_norm": norm,
                   "lr": ts.lr_schedule(self.optim, self.total_steps)(state["step"])}
        if self.pipe.quantized:
            metrics["rvq_loss"] = loss - lm
        if self.pipe.compressed:
            metrics["ortho_err"] = stiefel.orthogonality_error(
                params["boundary"][self.boundary.key])
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def batch_sharding(self):
        return NamedSharding(self.mesh, P(DATA))

    def train_step_fn(self, sync_now: bool = True):
        """Jitted ``(state, tokens int32 [W*b, T+1]) -> (state, metrics)``; the state is donated.
        Metrics: ``train_loss`` (next-token loss, nats/token), ``grad_norm``, ``lr``;
        ``ortho_err`` (max |A^T A - I| over the boundaries) when compressed; ``rvq_loss`` (the
        codebook and commitment terms, also minimized) with RVQ."""
        if self._train is None:
            self._train = jax.jit(self._step, donate_argnums=0)
        return self._train

    def eval_loss_fn(self):
        """Jitted ``(params, tokens) -> next-token loss`` (nats/token) of the full model (every
        block, through the pipeline and its compressed boundaries)."""
        if self._eval is None:
            fn = self.pipelined_loss_fn(compact=False)
            self._eval = jax.jit(lambda p, t: fn(self.compact_to_full(p), t)[1])
        return self._eval

    def compiled_train_step(self, batch):
        """The train step lowered and compiled for abstract inputs: ``batch`` a
        ``jax.ShapeDtypeStruct`` of the int32 tokens ``(W * b, T + 1)``."""
        tok = jax.ShapeDtypeStruct(batch.shape, jnp.int32, sharding=self.batch_sharding())
        return self.train_step_fn().lower(self.abstract_state(), tok).compile()

    # The interface of sdp_jax.step.SDPStep that the training loop uses.
    def eval_step_fn(self):
        return self.eval_loss_fn()

    def is_sync_step(self, step: int) -> bool:  # gradients are averaged every step
        return True

    def codebook_sync_bytes(self) -> int:
        """RVQ codebook bytes a boundary's receiver must get per step to decode like its
        sender: the codebooks change every step (``levels * K * r`` float32), 0 without RVQ.
        (Here both stages hold the codebook and apply the same update from the all-reduced
        gradient; a deployment that keeps it on the sender would send this.)"""
        if not self.pipe.quantized:
            return 0
        return 4 * self.pipe.rvq_levels * self.pipe.rvq_codebook * self.pipe.width(
            self.model.d_model)

    def boundary_bytes(self, compiled, batch_per_worker: int, seq_len: int) -> dict:
        """:func:`boundary_bytes` of this step's compiled program, codebook sync included."""
        return boundary_bytes(compiled, tokens_per_worker=batch_per_worker * seq_len,
                              stages=self.P, codebook_bytes=self.codebook_sync_bytes())

    def boundary_param_count(self) -> int:
        """Elements of the boundary parameters (projectors, anchors, codebooks; frozen ones
        included), stored on every device."""
        shapes = jax.eval_shape(lambda: init_boundary(jax.random.key(0), self.model, self.pipe))
        return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))

    def per_device_param_count(self) -> int:
        """Parameters stored on one device: its stage's ``k`` blocks (compact), plus the
        replicated embedding, head and boundary parameters."""
        shapes = jax.eval_shape(lambda: self.full_to_compact(self.init_full(0)))
        n = sum(math.prod(x.shape[2:]) for x in jax.tree.leaves(shapes["blocks"]))
        rest = {k: v for k, v in shapes.items() if k != "blocks"}
        return n + sum(math.prod(x.shape) for x in jax.tree.leaves(rest))


def token_id_dtype(vocab_size: int):
    """The narrowest unsigned integer type that holds token ids below ``vocab_size`` (uint8 for
    byte-level text, uint16 up to 65536, else int32): what travels beside the payload."""
    if vocab_size <= 256:
        return jnp.uint8
    return jnp.uint16 if vocab_size <= 65536 else jnp.int32


def make_mesh(workers: int, stages: int, devices=None):
    """Mesh ``('data', 'stage')`` of shape ``(W, P)`` over the first ``W * P`` devices (axis
    types Auto: the step's averaging is written in the global view and partitioned by XLA).

    Raises:
      ValueError: fewer devices than ``W * P`` (names the counts and the fix)."""
    devices = list(devices if devices is not None else jax.devices())
    if workers * stages > len(devices):
        raise ValueError(f"workers * pipeline.stages = {workers} * {stages} = "
                         f"{workers * stages} devices needed, {len(devices)} present; lower "
                         "--config.workers or --config.pipeline.stages (on a CPU, raise "
                         "--config.num_cpu_devices).")
    return jax.make_mesh((workers, stages), (DATA, STAGE), axis_types=(AxisType.Auto,) * 2,
                         devices=devices[:workers * stages])


def boundary_bytes(compiled, *, tokens_per_worker: int, stages: int,
                   codebook_bytes: int = 0) -> dict:
    """Bytes crossing the stage boundaries per step, from the compiled program's
    ``collective-permute`` instructions (the only collective over ``stage`` that carries
    activations; their loop trip counts included; :mod:`sdp_jax.comm`).

    Args:
      compiled: the compiled train step (:meth:`PipelineStep.compiled_train_step`).
      tokens_per_worker: tokens one worker processes per step (``b * T``).
      stages: ``P``.
      codebook_bytes: RVQ codebook synchronization per boundary per step (bytes; counted, not
        read from the program: see :meth:`PipelineStep.codebook_sync_bytes`).

    Returns:
      ``{"per_boundary": bytes one boundary carries per step for one worker (forward payload,
      token ids or codes, backward gradients, and codebook synchronization), "per_token": that /
      tokens per worker per step, "codebook_per_step": codebook_bytes, "ops": [(bytes, count,
      HLO name)], "stages": P}``."""
    from sdp_jax import comm  # pylint: disable=g-import-not-at-top

    ops = [o for o in comm.collective_ops(compiled.as_text())
           if o["op"] == "collective-permute"]
    total = float(sum(o["bytes"] * o["count"] for o in ops)) + codebook_bytes
    return {"per_boundary": total, "per_token": total / max(tokens_per_worker, 1),
            "codebook_per_step": codebook_bytes,
            "ops": [(o["bytes"], o["count"], o["name"]) for o in ops], "stages": stages}
