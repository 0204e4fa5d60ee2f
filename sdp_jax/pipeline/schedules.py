"""Pipeline parallelism on a mesh axis ``stage`` with compressed stage boundaries (MAPL).

The LLaMA model's ``L`` blocks are split into ``P`` pipeline stages of ``L / P`` consecutive blocks;
device ``(w, s)`` of the mesh ``('data', 'stage')`` runs stage ``s`` of worker ``w``. A step
runs the GPipe schedule (Huang et al. 2019, "GPipe", arXiv 1811.06965, Sec. 2.2): the worker's
batch is cut into ``M`` microbatches and ``M + P - 1`` ticks are run; at each tick every stage
applies its blocks to what it received and sends the result to the next stage with
``lax.ppermute`` over ``stage``. The backward pass is the transpose of that program (``jax.grad``
of the whole schedule: all forwards, then all backwards, as in GPipe), so the gradients crossing a
boundary have the shape of the forward payload: r wide when compressed. With
``schedule="1f1b"`` a step runs the one-forward-one-backward schedule instead
(:meth:`Pipeline.one_f_one_b`, PipeDream-Flush): ``M + 2 (P - 1)`` ticks, each running one
microbatch's forward pass and an earlier one's backward pass, so a stage keeps the activations
of at most ``2 P - 1`` microbatches instead of all ``M``; the same gradients (tested), the same
boundary payloads, ``(M + 2 P - 2) / (M + P - 1)`` times GPipe's transfers (the longer
bubble). Evaluation runs GPipe's forward program under either schedule.

Compression of a boundary (MAPL: Janson, Oyallon, Belilovsky, arXiv 2606.05484; docs/design.md,
"MAPL-style projectors"): stage ``s`` sends, per token, ``c = (h - anchor_s(token)) A_s``
(r = d / ratio wide, in the compute dtype) and the token id (the narrowest unsigned integer type that holds the
vocabulary: one byte for byte-level text); stage ``s + 1`` rebuilds
``h' = c A_s^T + anchor_s(token)``, with ``anchor_s(token) = E_s[token] B_s`` for a learnable
``E_s`` [V, r_a] and a frozen orthogonal ``B_s`` [r_a, d] (factorized anchor embeddings). Methods:

* ``none``: the d-wide residual stream crosses as is (no anchors, no token ids);
* ``fixed``: ``A_s`` a frozen random orthogonal matrix (the Subspace Networks baseline);
* ``unconstrained``: ``A_s`` trained by AdamW like every other weight (it leaves the manifold);
* ``mapl``: ``A_s`` on the Stiefel manifold, trained by
  :func:`sdp_jax.pipeline.stiefel.stiefel_sgd`.

The compressed methods share the anchors, so they differ only in how ``A`` is obtained. Our
choices where the paper is silent: one projector and one anchor table per boundary, ``A`` and
``E`` initialized as a random orthogonal matrix and N(0, 0.02^2), no weight decay on boundary
parameters, anchors at every compressed boundary.

The schedule is the loss of the one step (:class:`Pipeline`, for :class:`sdp_jax.step.SDPStep`
on a mesh ``('data', 'stage')``), so every composition of the step holds with a pipeline: the
spec describes one stage (its ``L / P`` blocks, the same masks in every stage); each device
stores its worker's part of its stage's blocks (compact under forward masking: B-SDP, N-SDP;
full under backward masking; FSDP shards over ``data``), and the step's averaging over holders,
clipping by the norm with every component counted once, activation checkpointing and compute
dtype apply per stage. With ``bfloat16`` the boundary payload travels in bf16.

Not built here: interleaved (virtual-stage) 1F1B and zero-bubble schedules; FSDP of the boundary
parameters of a compressed method (refused: the Stiefel optimizer and the orthogonality metric
need whole projectors).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from sdp_jax import fields
from sdp_jax.costs import comm
from sdp_jax.fields import setting
from sdp_jax.mesh import DATA, STAGE
from sdp_jax.sync import collectives as sync

METHODS = ("none", "fixed", "unconstrained", "mapl")
SCHEDULES = ("gpipe", "1f1b")
FROZEN = "frozen"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline and boundary-compression settings (the ``pipeline`` config section).

    Attributes:
      stages: ``P`` pipeline stages (mesh axis ``stage``); 1 = no pipeline.
      microbatches: ``M`` microbatches per worker batch (``batch_per_worker % M == 0``).
      schedule: ``gpipe`` (all forwards, then all backwards: activations of ``M``
        microbatches) or ``1f1b`` (one forward, one backward: at most ``2 P - 1``; the same
        gradients; :meth:`Pipeline.one_f_one_b`).
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

    SECTION = "pipeline"

    stages: int = setting(1, "P pipeline stages on the mesh axis stage (W x P devices; 1 = no "
                          "pipeline)", low=1)
    microbatches: int = setting(4, "M microbatches per worker batch (batch_per_worker "
                                "divisible by M)", low=1)
    schedule: str = setting("gpipe", "gpipe (all forwards, then all backwards) or 1f1b (one "
                            "forward, one backward: at most 2P - 1 microbatches' activations)",
                            choices=SCHEDULES)
    method: str = setting("none", "what crosses a stage boundary: none (the residual stream), "
                          "fixed, unconstrained or mapl (a projection to d / ratio floats)",
                          choices=METHODS)
    ratio: int = setting(4, "compression ratio d / r (d_model divisible by it)", low=1)
    anchor_rank: int = setting(16, "rank of the anchor embeddings subtracted before the "
                               "projection (0 = no anchors, no token ids sent)", low=0)
    proj_lr: float = setting(0.01, "mapl: peak learning rate of the projectors' Stiefel "
                             "optimizer", low=0, open_low=True)
    proj_momentum: float = setting(0.9, "mapl: the Stiefel optimizer's momentum", low=0, high=1,
                                   open_high=True)
    polar_steps: int = setting(10, "mapl: Polar Express iterations per msign (fewer do not "
                               "reach the polar factor; more only lengthen the compile)", low=8,
                               high=32)
    rvq_levels: int = setting(0, "residual vector quantization of the boundary payload: levels "
                              "(0 = off)", low=0)
    rvq_codebook: int = setting(256, "codes per quantization level (indices travel as uint8 up "
                                "to 256, uint16 up to 65536)", low=1, high=65536)
    rvq_beta: float = setting(0.25, "commitment weight of the quantization", low=0)

    def __post_init__(self):
        fields.check_settings(self)
        if self.method != "none" and self.stages == 1:
            raise ValueError(f"pipeline.method={self.method!r} compresses stage boundaries, but "
                             "pipeline.stages=1 has none; set --config.pipeline.stages=2 (or "
                             "more), or method=none.")

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

    def check(self, model, batch_per_worker: int | None = None,
              fsdp: bool = False, average: str = "gradients") -> None:
        """Raise ValueError (naming the value and the fix) if this pipeline cannot run ``model``
        (with ``batch_per_worker`` sequences per worker, when given, FSDP and the averaging
        mode ``average``)."""
        if model.n_layers % self.stages:
            raise ValueError(f"pipeline.stages={self.stages} does not divide "
                             f"model.n_layers={model.n_layers}; choose a divisor of it.")
        if fsdp and self.compressed:
            raise ValueError(f"fsdp=True with pipeline.method={self.method!r}: the boundary "
                             "projectors are optimized and checked as whole matrices, which "
                             "FSDP would shard; use method=none with fsdp, or fsdp=False.")
        if average == "parameters" and self.method == "mapl":
            raise ValueError("average=parameters with pipeline.method='mapl': the mean of the "
                             "workers' orthogonal projectors leaves the Stiefel manifold; use "
                             "average=gradients, or method fixed, unconstrained or none.")
        if batch_per_worker is not None and batch_per_worker % self.microbatches:
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


def init_boundary(key, model, pipe: PipelineConfig) -> dict:
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
        """Payload of boundary ``i`` (after stage ``i``): [b, T, r] in ``h``'s dtype (``[b, T, d]``
        for ``none``) from the residual stream ``h`` [b, T, d] and token ids ``tok`` int32 [b, T]."""
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


class Pipeline:
    """The pipeline schedule (GPipe or 1F1B) over the mesh axis ``stage``, as the loss of the
    one step.

    It is the ``loss_fn(kept, tokens, run)`` of :class:`sdp_jax.step.SDPStep` (block-runner
    form) for a mesh ``('data', 'stage')``: the step stores each device's stage of the block
    stack (compact under forward masking, FSDP shards, ...), and ``run(h)`` applies that stage's
    blocks (with the step's activation checkpointing, compute dtype and FSDP gathers). Runs
    inside ``jax.shard_map``.

    Args:
      pipe: :class:`PipelineConfig` (``stages`` = the mesh's ``stage`` size).
      d_model, vocab_size: the model's width and vocabulary.
      embed: ``(kept, x int32 [b, T]) -> h [b, T, d]`` (compute dtype): the first stage's input.
      head: ``(kept, h [b, T, d], y int32 [b, T]) -> float32`` mean loss: the last stage's.
    """

    def __init__(self, pipe: PipelineConfig, d_model: int, vocab_size: int, embed, head):
        self.pipe, self.d_model, self.vocab_size = pipe, d_model, vocab_size
        self.embed, self.head = embed, head
        self.boundary = Boundary(pipe)

    def loss(self, kept: dict, tokens, run):
        """``(loss, aux)`` of this worker's batch ``tokens`` int32 ``[b, T + 1]``: the mean
        next-token loss (nats/token, float32, the same on every stage), plus in training with
        RVQ the codebook and commitment terms (mean over microbatches, summed over
        boundaries), which ``aux["rvq_loss"]`` reports; ``aux["train_loss"]`` is then the
        next-token loss alone, as evaluation returns it. ``kept`` holds the always-kept leaves and
        ``boundary`` (:func:`init_boundary`). In training with ``schedule="1f1b"`` the
        schedule is :meth:`one_f_one_b`; otherwise GPipe, whose backward pass is ``jax.grad``
        of this forward program."""
        if self.pipe.schedule == "1f1b" and getattr(run, "train", True):
            return self.one_f_one_b(kept, tokens, run)
        Pn, M = self.pipe.stages, self.pipe.microbatches
        bnd = kept.get("boundary", {})
        s = lax.axis_index(STAGE)
        x, y = tokens[:, :-1], tokens[:, 1:]
        b, T = x.shape
        xs = x.reshape(M, b // M, T)
        dtype = self.embed(kept, xs[0, :, :1]).dtype
        perm, _ = self._perms()
        init = self._zero_payload(b // M, T, dtype)
        quant = self.pipe.quantized
        send_codes = self._code_sender(dtype)

        def tick(carry, t):
            recv, recv_tok = carry
            h_in, tok = self._stage_input(kept, recv, recv_tok, xs[jnp.minimum(t, M - 1)],
                                          dtype)
            h = run(h_in)
            aux = jnp.zeros((), jnp.float32)
            if Pn > 1:
                c, codes, aux = self._stage_output(kept, h, tok, dtype)
                if quant:
                    recv = send_codes(c, codes, bnd["rvq_codebook"][self._dec(s)])
                    aux = jnp.where((t >= s) & (t - s < M) & (s < Pn - 1), aux, 0.0)
                else:
                    recv = lax.ppermute(c, STAGE, perm)
                recv_tok = self._send_ids(tok, recv_tok)
            return (recv, recv_tok), (h, aux)

        _, (hs, auxs) = lax.scan(tick, init, jnp.arange(M + Pn - 1))
        out = hs[Pn - 1:].reshape(b, T, -1)                       # the last stage's outputs
        lm = jnp.where(s == Pn - 1, self.head(kept, out, y), 0.0)
        lm = lax.psum(lm, STAGE)
        if not quant or not getattr(run, "train", True):   # evaluation: next-token loss
            return lm, {}
        aux = lax.psum(jnp.sum(auxs) / M, STAGE)
        return lm + aux, {"rvq_loss": aux, "train_loss": lm}

    # ------------------------------------------------------------ shared by both schedules
    @property
    def _send_tok(self) -> bool:
        """Whether token ids travel beside the payload (anchors need them at the receiver)."""
        return self.pipe.compressed and self.pipe.anchor_rank > 0

    def _perms(self) -> tuple[list, list]:
        """``(forward, backward)`` source-target pairs of ``lax.ppermute`` over ``stage``: stage
        ``i`` to ``i + 1``, and back."""
        fwd = [(i, i + 1) for i in range(self.pipe.stages - 1)]
        return fwd, [(j, i) for i, j in fwd]

    def _send_ids(self, tok, recv_tok):
        """The token ids the next stage receives (in :func:`token_id_dtype`) when anchors need
        them (:attr:`_send_tok`); else ``recv_tok`` as it is."""
        if not self._send_tok:
            return recv_tok
        return lax.ppermute(tok.astype(token_id_dtype(self.vocab_size)), STAGE, self._perms()[0])

    def _code_sender(self, dtype):
        """GPipe's RVQ send ``(q, codes, cb) -> payload`` in ``dtype``: only the code indices
        travel forward; the receiver sums its own copy of the codebooks ``cb``, and the
        straight-through gradient of ``q`` (r floats) travels back (``cb`` gets zero)."""
        perm, back = self._perms()

        @jax.custom_vjp
        def send_codes(q, codes, cb):
            del q
            return self.boundary.lookup(cb, lax.ppermute(codes, STAGE, perm)).astype(dtype)

        def send_fwd(q, codes, cb):
            return send_codes(q, codes, cb), cb

        def send_bwd(cb, g):
            return lax.ppermute(g, STAGE, back), None, jnp.zeros_like(cb)

        send_codes.defvjp(send_fwd, send_bwd)
        return send_codes

    def _enc(self, s):
        return jnp.clip(s, 0, max(self.pipe.stages - 2, 0))

    def _dec(self, s):
        return jnp.clip(s - 1, 0, max(self.pipe.stages - 2, 0))

    def _zero_payload(self, mb: int, T: int, dtype):
        """Zero ``(payload [mb, T, r], token ids [mb, T])``, varying over ``data`` and ``stage``
        (a scan carry's initial value)."""
        return (lax.pcast(jnp.zeros((mb, T, self.pipe.width(self.d_model)), dtype), _BOTH,
                          to="varying"),
                lax.pcast(jnp.zeros((mb, T), token_id_dtype(self.vocab_size)), _BOTH,
                          to="varying"))

    def _stage_input(self, kept, recv, recv_tok, tok0, dtype):
        """``(h_in [mb, T, d] in dtype, token ids int32 [mb, T])`` of this stage for one
        microbatch: the embedding of ``tok0`` on the first stage, else the decoded payload
        ``recv`` (with the received token ids ``recv_tok`` when anchors need them)."""
        s = lax.axis_index(STAGE)
        first = s == 0
        tok = jnp.where(first, tok0, recv_tok.astype(jnp.int32)) if self._send_tok else tok0
        h_in = jnp.where(first, self.embed(kept, tok0),
                         self.boundary.decode(kept.get("boundary", {}), self._dec(s), recv,
                                              tok).astype(dtype))
        return h_in, tok

    def _stage_output(self, kept, h, tok, dtype):
        """``(payload [mb, T, r] in dtype, RVQ codes or None, RVQ loss float32)`` this stage
        sends for its output ``h`` (with RVQ the payload is the straight-through quantized
        value; the loss is 0 without RVQ)."""
        bnd, bd = kept.get("boundary", {}), self.boundary
        i = self._enc(lax.axis_index(STAGE))
        c = bd.encode(bnd, i, h, tok).astype(dtype)
        if not self.pipe.quantized:
            return c, None, jnp.zeros((), jnp.float32)
        q, codes, aux = bd.quantize(bnd, i, c)
        return q, codes, aux.astype(jnp.float32)

    # ------------------------------------------------------------------------ 1F1B
    def one_f_one_b(self, kept: dict, tokens, run):
        """The loss of :meth:`loss` under the one-forward-one-backward schedule (PipeDream-Flush,
        Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training", arXiv
        2006.09503, Sec. 3; Megatron-LM's default), with the gradient computed inside the
        schedule.

        ``M + 2 (P - 1)`` ticks; at tick ``t`` stage ``s`` runs the forward pass of microbatch
        ``t - s`` and the backward pass of microbatch ``t - 2 (P - 1) + s`` (each when it
        exists), then sends the payload forward and the payload's gradient back
        (``lax.ppermute`` over ``stage``, one tick per hop each way). The last stage runs a
        microbatch's backward pass right after its forward pass. Stage ``s`` therefore keeps
        the residuals (``jax.vjp``) of at most ``2 (P - 1 - s) + 1`` microbatches (a ring of
        ``min(2 P - 1, M + 1)`` slots beside the current tick's), where GPipe keeps those of
        all ``M + P - 1`` ticks until its backward pass starts: 1F1B saves memory when ``M``
        is well above ``P`` (0.52x GPipe's peak at P = 2, M = 8, docs/pipelines.md) and costs
        more when ``M <= P``. Residuals that do not depend on the microbatch (the stage's
        parameters, values computed from them alone, also inside the block scan) are not
        stored per slot.

        The schedule computes the gradient of every input of the stage itself: ``kept`` and
        the values ``run`` closes over (:func:`jax.closure_convert`: the stage's block
        parameters, FSDP shards, ...), accumulated in float32. It returns the loss as the
        value ``psum(L_s + sum_i <g_i, theta_i - stop_gradient(theta_i)>, stage)``, whose
        gradient under the step's ``jax.value_and_grad`` is exactly ``g``, so the step's
        averaging, clipping and optimizer apply unchanged. RVQ: the code indices travel
        forward, the straight-through gradient back, as under GPipe.

        Args / returns: as :meth:`loss` (training only; evaluation runs GPipe's forward)."""
        Pn, M = self.pipe.stages, self.pipe.microbatches
        s = lax.axis_index(STAGE)
        last = s == Pn - 1
        x, y = tokens[:, :-1], tokens[:, 1:]
        b, T = x.shape
        mb = b // M
        xs, ys = x.reshape(M, mb, T), y.reshape(M, mb, T)
        dtype = self.embed(kept, xs[0, :, :1]).dtype
        recv0, tok0 = self._zero_payload(mb, T, dtype)
        run_c, traced, live, fixed, theta = _closure_inputs(kept, run, (mb, T, self.d_model),
                                                            dtype)
        forward = self._1f1b_forward(run_c, traced, fixed, last, dtype)
        per_mb, slots = _residual_slots(forward, (theta, recv0, tok0, _full_vary(xs[0]),
                                                  _full_vary(ys[0]),
                                                  _full_vary(jnp.asarray(True))),
                                        _ring_size(Pn, M)[1])
        acc = jax.tree.map(lambda v: _vary_like(jnp.zeros(v.shape, jnp.float32), v), theta)
        zero = _full_vary(jnp.zeros((), jnp.float32))
        tick = self._1f1b_tick(forward, theta, xs, ys, per_mb, s, last, dtype)
        carry = (recv0, tok0, recv0, slots, acc, zero, zero)
        (_, _, _, _, grads, lm, aux), _ = lax.scan(tick, carry, jnp.arange(M + 2 * (Pn - 1)))
        return self._1f1b_loss(grads, live, lm, aux)

    def _1f1b_forward(self, run_c, traced, fixed, last, dtype):
        """:meth:`one_f_one_b`'s ``forward(theta, recv, recv_tok, x_m, y_m, valid)``: the
        ``jax.vjp`` (with aux) of this stage on one microbatch with respect to ``theta`` and the
        received payload: outputs ``(payload, this stage's loss / M)``, aux ``(RVQ codes, token
        ids, next-token loss / M, RVQ loss / M)``. ``run_c`` replays the stage's blocks with
        the closed-over values (``traced``: which come from ``theta``, the others from
        ``fixed``, see :func:`_closure_inputs`)."""
        M = self.pipe.microbatches

        def stage(th, recv, recv_tok, x_m, y_m, valid):
            kp, cs = th
            it, fx = iter(cs), iter(fixed)
            h_in, tok = self._stage_input(kp, recv, recv_tok, x_m, dtype)
            h = run_c(h_in, *[next(it) if d else next(fx) for d in traced])
            lm = jnp.where(last & valid, self.head(kp, h, y_m), 0.0) / M
            c, codes, aux = self._stage_output(kp, h, tok, dtype)
            aux = jnp.where(valid & ~last, aux, 0.0) / M
            return (c, lm + aux), (codes, tok, lm, aux)

        def forward(th, recv, recv_tok, x_m, y_m, valid):
            return jax.vjp(lambda t_, r_: stage(t_, r_, recv_tok, x_m, y_m, valid), th, recv,
                           has_aux=True)
        return forward

    def _1f1b_tick(self, forward, theta, xs, ys, per_mb, s, last, dtype):
        """:meth:`one_f_one_b`'s scan body ``(carry, t)``: at tick ``t`` the forward pass of
        microbatch ``t - s`` and the backward pass of microbatch ``t - 2 (P - 1) + s`` (each
        when it exists), the residuals kept in the ring of slots (:func:`_ring_residuals`),
        the gradient accumulated in float32, then the payload sent forward and its gradient
        back. Carry: ``(recv, recv_tok, grad_in, slots, acc, lm_sum, aux_sum)``."""
        Pn, M = self.pipe.stages, self.pipe.microbatches
        small, K = _ring_size(Pn, M)
        _, bwd_perm = self._perms()

        def tick(carry, t):
            recv, recv_tok, grad_in, slots, acc, lm_sum, aux_sum = carry
            mf, mb_ = t - s, t - 2 * (Pn - 1) + s
            vf, vb = (mf >= 0) & (mf < M), (mb_ >= 0) & (mb_ < M)
            mfc = jnp.clip(mf, 0, M - 1)
            (c, _), back, (codes, tok, lm, aux) = forward(theta, recv, recv_tok, xs[mfc],
                                                          ys[mfc], vf)
            # Writing microbatch mf's slot never overwrites a live one: the live microbatches
            # are mb_ .. mf - 1, fewer than min(M, 2P - 1) apart (and with K = 2P - 1 also
            # for mf outside [0, M)). A tick without a backward pass reads what it wrote
            # (finite values; its cotangents are zero).
            put = jnp.where(vf, mf, M) if small else jnp.mod(mf, K)
            get = jnp.where(vb, jnp.mod(mb_, K), put)
            back = _ring_residuals(back, per_mb, slots, put, get)
            g_out = jnp.where(last | ~vb, jnp.zeros_like(grad_in), grad_in)
            g_th, g_recv = back((g_out, _full_vary(vb.astype(jnp.float32))))
            # Without a backward pass the cotangents are zero, and so is g_th: a closed-over
            # value invariant over stage has its gradient summed over the stages inside
            # back(), whose other stages may be in a tick with a backward pass.
            acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, g_th)
            lm_sum, aux_sum = lm_sum + _full_vary(lm), aux_sum + _full_vary(aux)
            recv, recv_tok = self._1f1b_send(theta, c, codes, tok, recv_tok, s, dtype)
            g_recv = jnp.where(vb, _full_vary(g_recv), 0).astype(grad_in.dtype)
            grad_in = lax.ppermute(g_recv, STAGE, bwd_perm)
            return (recv, recv_tok, grad_in, slots, acc, lm_sum, aux_sum), None
        return tick

    def _1f1b_send(self, theta, c, codes, tok, recv_tok, s, dtype):
        """``(payload, token ids)`` the next stage receives at the end of a 1F1B tick: with RVQ
        the codes (decoded by the receiver's codebook in ``theta``), else the payload ``c``;
        the ids as :meth:`_send_ids`."""
        fwd_perm, _ = self._perms()
        if self.pipe.quantized:
            cb = theta[0]["boundary"]["rvq_codebook"][self._dec(s)]
            recv = self.boundary.lookup(cb, lax.ppermute(codes, STAGE, fwd_perm))
            recv = recv.astype(dtype)
        else:
            recv = lax.ppermute(c, STAGE, fwd_perm)
        return recv, self._send_ids(tok, recv_tok)

    def _1f1b_loss(self, grads, live, lm, aux):
        """:meth:`one_f_one_b`'s ``(loss, aux)`` from the accumulated gradients ``grads`` of the
        differentiated inputs ``live`` and this stage's loss sums ``lm``, ``aux``."""
        # The gradient g enters the outer differentiation as <g, theta - sg(theta)> (value 0).
        # A g the same on every device of an axis (summed over it inside back()) is counted
        # once: the psum over stage below, and the loss's variation over data, would
        # otherwise add it once per device of that axis.
        attach = sum(
            jnp.vdot(g, (p - lax.stop_gradient(p)).astype(jnp.float32))
            / math.prod(lax.axis_size(a) for a in _invariant_axes(g, _BOTH))
            for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(live), strict=True))
        loss = lax.psum(lm + aux + attach, STAGE)
        if not self.pipe.quantized:
            return loss, {}
        return loss, {"rvq_loss": lax.psum(aux, STAGE), "train_loss": lax.psum(lm, STAGE)}


# Both mesh axes of a pipelined step: what per-microbatch values of the 1F1B schedule vary over.
_BOTH = (DATA, STAGE)


def _full_vary(v):
    """``v`` cast to vary over ``data`` and ``stage`` (inside ``jax.shard_map``)."""
    missing = _invariant_axes(v, _BOTH)
    return lax.pcast(v, missing, to="varying") if missing else v


def _ring_size(Pn: int, M: int) -> tuple[bool, int]:
    """``(small, K)``: the 1F1B ring of residual slots. Microbatch m lives in slot m mod K.
    With M + 1 < 2P - 1 (``small``) slot M takes the writes of ticks without a forward pass
    (so K stays at most M + 1)."""
    small = M + 1 < 2 * Pn - 1
    return small, (M + 1 if small else 2 * Pn - 1)


def _closure_inputs(kept: dict, run, h_shape: tuple, dtype):
    """``(run_c, traced, live, fixed, theta)`` of the 1F1B schedule: ``run`` with its
    closed-over values made arguments (:func:`jax.closure_convert`, traced at a ``h_shape``
    input in ``dtype``), which of those values are differentiated (``traced``, one bool each),
    ``live = (kept, the differentiated ones)``, ``fixed``: the others, and ``theta``: the
    stop_gradient copy of ``live`` that the schedule differentiates, ``kept`` made to vary
    over both axes."""
    run_c, consts = jax.closure_convert(run, _full_vary(jnp.zeros(h_shape, dtype)))
    # Differentiated: ``kept`` and the closed-over values the enclosing differentiation
    # traces (same trace as ``kept``); the others (stop_gradient copies, tables) are
    # constants of the schedule.
    # (When JAX does not say, every closed-over value is differentiated here. A traced
    # value left out is still differentiated, by the enclosing differentiation through
    # the schedule: the same gradient, with GPipe's memory for it.)
    ref = getattr(next(iter(jax.tree.leaves(kept)), None), "_trace", None)
    traced = [ref is None or getattr(c, "_trace", None) is ref for c in consts]
    live = (kept, [c for c, d in zip(consts, traced) if d])
    fixed = [c for c, d in zip(consts, traced) if not d]
    # ``kept`` is made to vary over data and stage, so that its gradient inside the
    # schedule is this stage's own (the transpose of an implicit pcast would be a psum
    # over stage, mixing the stages' different microbatches). The closed-over values keep
    # their types: ``run_c`` replays a program traced with them.
    theta = (jax.tree.map(_full_vary, lax.stop_gradient(kept)), lax.stop_gradient(live[1]))
    return run_c, traced, live, fixed, theta


def _residual_slots(forward, args: tuple, K: int) -> tuple[list, list]:
    """``(per_mb, slots)``: which residuals of ``forward(*args)`` (its vjp's leaves) depend on
    the microbatch, and a zero ring of ``K`` slots for each of those (varying over both axes).
    The others are the same at every tick and taken from the current one. ``args`` are traced
    with the types the tick has: everything per microbatch varies over both axes."""
    jaxpr = jax.make_jaxpr(lambda *a: jax.tree.leaves(forward(*a)[1]))(*args)
    n_theta = len(jax.tree.leaves(args[0]))
    per_mb = _depends_on(jaxpr, [i >= n_theta for i in range(len(jaxpr.jaxpr.invars))])
    slots = [lax.pcast(jnp.zeros((K,) + v.aval.shape, v.aval.dtype), _BOTH, to="varying")
             for v, d in zip(jaxpr.jaxpr.outvars, per_mb) if d]
    return per_mb, slots


def _ring_residuals(back, per_mb: list, slots: list, put, get):
    """The vjp ``back`` with its per-microbatch residuals (``per_mb``) written into ring slot
    ``put`` of ``slots`` (updated in place, a list) and read back from slot ``get``: the
    backward pass of the microbatch the tick differentiates."""
    leaves, tree = jax.tree.flatten(back)
    mine, j = [], 0
    for leaf, d in zip(leaves, per_mb, strict=True):
        if d:
            slots[j] = lax.dynamic_update_index_in_dim(slots[j], _full_vary(leaf), put, 0)
            leaf = lax.dynamic_index_in_dim(slots[j], get, 0, False)
            j += 1
        mine.append(leaf)
    return jax.tree.unflatten(tree, mine)


def _vma(x):
    """The mesh axes ``x`` varies over inside ``jax.shard_map`` (None when JAX does not say)."""
    return sync.varying_axes(x)


def _invariant_axes(x, axes) -> tuple:
    """Those of ``axes`` that ``x`` does not vary over (inside ``jax.shard_map``; none when JAX
    does not say)."""
    have = _vma(x)
    return () if have is None else tuple(a for a in axes if a not in have)


def _vary_like(x, ref):
    """``x`` cast to vary over the mesh axes ``ref`` varies over (inside ``jax.shard_map``)."""
    axes = _invariant_axes(x, sorted(_vma(ref) or ()))
    return lax.pcast(x, axes, to="varying") if axes else x


def _depends_on(jaxpr, dependent: list) -> list:
    """For each output of ``jaxpr`` (a Jaxpr or ClosedJaxpr), whether it may depend on the inputs
    flagged in ``dependent`` (one bool per input variable): a forward pass over the equations.
    ``scan`` bodies are followed (a carry to a fixed point: a per-block cast of the stage's
    weights inside the block scan does not depend on the microbatch), and so are nested
    programs whose inputs and outputs are the equation's (``jit``, ``checkpoint``, custom
    derivatives); any other equation's outputs depend on an input when an operand does."""
    from jax.extend.core import Literal  # pylint: disable=g-import-not-at-top
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    dep = {v for v, d in zip(jaxpr.invars, dependent) if d}

    def has(v):
        return not isinstance(v, Literal) and v in dep
    for eqn in jaxpr.eqns:
        ins = [has(v) for v in eqn.invars]
        if any(ins):
            dep.update(v for v, d in zip(eqn.outvars, _eqn_depends(eqn, ins)) if d)
    return [has(v) for v in jaxpr.outvars]


def _eqn_depends(eqn, ins: list) -> list:
    """:func:`_depends_on` of one equation: which outputs may depend on the flagged inputs."""
    p = eqn.params
    if eqn.primitive.name == "scan":
        nc, nk = p["num_consts"], p["num_carry"]
        carry = ins[nc:nc + nk]
        while True:   # the carry's flags only grow, so this ends
            out = _depends_on(p["jaxpr"], ins[:nc] + carry + ins[nc + nk:])
            grown = [a or b for a, b in zip(carry, out[:nk])]
            if grown == carry:
                return carry + out[nk:]
            carry = grown
    sub = next((p[k] for k in ("jaxpr", "call_jaxpr") if k in p), None)
    inner = getattr(sub, "jaxpr", sub)
    if inner is not None and hasattr(inner, "invars") and len(inner.invars) == len(ins) \
            and len(inner.outvars) == len(eqn.outvars):
        return _depends_on(inner, ins)
    return [True] * len(eqn.outvars)


def boundary_param_count(model, pipe: PipelineConfig) -> int:
    """Elements of the boundary parameters (projectors, anchors, codebooks; frozen ones
    included), stored on every device."""
    shapes = jax.eval_shape(lambda: init_boundary(jax.random.key(0), model, pipe))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def codebook_sync_bytes(model, pipe: PipelineConfig) -> int:
    """RVQ codebook bytes a boundary's receiver must get per step to decode like its sender:
    the codebooks change every step (``levels * K * r`` float32), 0 without RVQ. (Here both
    stages hold the codebook and apply the same update from the averaged gradient; a deployment
    that keeps it on the sender would send this.)"""
    if not pipe.quantized:
        return 0
    return 4 * pipe.rvq_levels * pipe.rvq_codebook * pipe.width(model.d_model)


def token_id_dtype(vocab_size: int):
    """The narrowest unsigned integer type that holds token ids below ``vocab_size`` (uint8 for
    byte-level text, uint16 up to 65536, else int32): what travels beside the payload."""
    if vocab_size <= 256:
        return jnp.uint8
    return jnp.uint16 if vocab_size <= 65536 else jnp.int32


def boundary_bytes(compiled, *, tokens_per_worker: int, stages: int,
                   codebook_bytes: int = 0) -> dict:
    """Bytes crossing the stage boundaries per step, from the compiled program's
    ``collective-permute`` instructions (the only collective over ``stage`` that carries
    activations; their loop trip counts included; :mod:`sdp_jax.costs.comm`).

    Args:
      compiled: the compiled train step (:meth:`sdp_jax.step.SDPStep.compiled_train_step`).
      tokens_per_worker: tokens one worker processes per step (``b * T``).
      stages: ``P``.
      codebook_bytes: RVQ codebook synchronization per boundary per step (bytes; counted, not
        read from the program: see :func:`codebook_sync_bytes`).

    Returns:
      ``{"per_boundary": bytes one boundary carries per step for one worker (forward payload,
      token ids or codes, backward gradients, and codebook synchronization), "per_token": that /
      tokens per worker per step, "codebook_per_step": codebook_bytes, "ops": [(bytes, count,
      HLO name)], "stages": P}``."""
    ops = [o for o in comm.collective_ops(compiled.as_text())
           if o["op"] == "collective-permute"]
    total = float(sum(o["bytes"] * o["count"] for o in ops)) + codebook_bytes
    return {"per_boundary": total, "per_token": total / max(tokens_per_worker, 1),
            "codebook_per_step": codebook_bytes,
            "ops": [(o["bytes"], o["count"], o["name"]) for o in ops], "stages": stages}
