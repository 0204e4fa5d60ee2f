"""LLaMA-style decoder in Flax NNX with the transformer blocks stacked on a leading axis.

Architecture (Touvron et al., "LLaMA", arXiv 2302.13971, Sec. 2.2): pre-normalization with RMSNorm
(Zhang & Sennrich 2019), SwiGLU MLP (Shazeer 2020), rotary position embeddings (Su et al. 2021),
causal multi-head attention with optional grouped-query attention (Ainslie et al. 2023), and an
untied or tied output head. No biases.

The ``L`` blocks are one :class:`Block` module whose parameters carry a leading ``[L, ...]`` axis
(built with ``nnx.vmap``). The forward pass scans over that axis, so a model whose block stack has
been pruned to ``k`` of the ``L`` blocks (B-SDP, a compact subnetwork) runs the same code on the
shorter stack: blocks are visited in the order they are stored, which the pruning keeps ascending
(depth order, docs/design.md invariant 5), and a dropped block contributes only its identity shortcut.

Parameter tree (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``), shapes for ``d`` = d_model,
``H`` heads, ``K`` key/value heads, ``h`` = head dim, ``F`` = MLP hidden width, ``V`` = vocab:

    embed:       [V, d]
    blocks:
      attn_norm: [L, d]          attn: wq [L, d, H, h], wk/wv [L, d, K, h], wo [L, H, h, d]
      mlp_norm:  [L, d]          mlp:  w_gate/w_up [L, d, F], w_down [L, F, d]
    final_norm:  [d]
    lm_head:     [d, V]          (absent when tie_embeddings)

Heads and MLP neurons have their own axes so neuron-level pruning is indexing too.

Incremental decoding (:meth:`Llama.decode`) runs the same blocks on new tokens only, reading and
writing the keys and values of earlier positions in a :class:`KVCache` (:func:`init_cache`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sdp_jax import fields
from sdp_jax.fields import setting
from sdp_jax.pipeline import schedules as pl
from sdp_jax.spec import sdp_spec as spec_lib

BLOCK_KEY = "blocks"
ATTENTION = ("dot_product", "cudnn", "chunked")   # LlamaConfig.attention


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model shape. All sizes are counts of elements (not bytes).

    ``subnet_rescale``: when a layer runs with fewer attention heads or MLP neurons than
    configured (a compact N-SDP subnetwork), multiply its output by (configured / held), as
    inverted dropout does (Srivastava et al. 2014, Sec. 10): with every component equally likely
    to be held, the subnetwork's output is then an unbiased estimate of the full layer's, so the
    full model used for validation sees the scale it was trained at. Our default (the SDP paper
    does not say); no effect on the full model or at C = 1."""

    SECTION = "model"

    vocab_size: int = setting(256, "vocabulary (256: byte-level text; llm.c shards need "
                              "theirs, e.g. 50304 or 32000)", low=1)
    d_model: int = setting(128, "width d", low=1)
    n_layers: int = setting(4, "number of blocks L (B-SDP's components)", low=1)
    n_heads: int = setting(4, "query heads", low=1)
    n_kv_heads: int = setting(4, "key/value heads (grouped-query attention: n_heads a multiple "
                              "of n_kv_heads; N-SDP masks a key/value group with its query "
                              "heads)", low=1)
    d_ff: int = setting(384, "SwiGLU hidden width (N-SDP's neurons)", low=1)
    max_seq_len: int = setting(256, "longest sequence the rotary embeddings are built for (at "
                               "least seq_len)", low=1)
    tie_embeddings: bool = setting(False, "share the input embedding with the output layer")
    rope_theta: float = setting(10000.0, "rotary base", low=0, open_low=True)
    norm_eps: float = setting(1e-5, "RMSNorm epsilon", low=0, open_low=True)
    init_std: float = setting(0.02, "standard deviation of the initial weights", low=0,
                              open_low=True)
    subnet_rescale: bool = setting(True, "N-SDP: scale a pruned layer's output by configured / "
                                   "held (inverted dropout), so the full model sees the "
                                   "trained scale")
    attention: str = setting("dot_product", "dot_product, cudnn (NVIDIA GPUs) or chunked "
                             "(queries in chunks of attention_chunk rows); how attention is "
                             "computed, not what", choices=ATTENTION, control=True)
    attention_chunk: int = setting(128, "query rows per chunk of attention=chunked", low=1,
                                   control=True)

    def __post_init__(self):
        fields.check_settings(self)
        if self.attention == "cudnn" and jax.default_backend() != "gpu":
            raise ValueError(f"model.attention='cudnn' needs an NVIDIA GPU, but JAX's backend "
                             f"is {jax.default_backend()!r}; use model.attention=chunked (or "
                             "dot_product) here.")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} must be divisible by "
                             f"model.n_heads={self.n_heads}.")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head dim d_model/n_heads={self.d_model // self.n_heads} must be even "
                             "for rotary embeddings.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be a multiple of "
                             f"model.n_kv_heads={self.n_kv_heads} (grouped-query attention).")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_config(cls, cfg: Any) -> "LlamaConfig":
        """Build from an ``ml_collections.ConfigDict`` (or dict) ``model`` section."""
        d = dict(cfg)
        d.pop("name", None)
        return fields.from_section(cls, d, "model")

    def param_count(self) -> dict[str, int]:
        """Parameter counts: ``per_block``, ``blocks`` (all L), ``always_kept``, ``total``."""
        d, f, h = self.d_model, self.d_ff, self.head_dim
        per_block = (d * self.n_heads * h * 2 + d * self.n_kv_heads * h * 2 + 3 * d * f + 2 * d)
        kept = self.vocab_size * d * (1 if self.tie_embeddings else 2) + d
        return {"per_block": per_block, "blocks": per_block * self.n_layers,
                "always_kept": kept, "total": per_block * self.n_layers + kept}


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): ``x / rms(x) * scale``."""

    def __init__(self, d: int, eps: float):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, start=0):
    """Rotary tables (Su et al. 2021, Eq. 34): cos, sin float32 ``[T, head_dim/2]`` of the
    ``T = seq_len`` positions ``start, start + 1, ...`` (``start``: an int or an int32 scalar
    array)."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    pos = jnp.arange(seq_len, dtype=jnp.float32)
    if not (isinstance(start, int) and start == 0):   # (the training program is unchanged)
        pos = pos + jnp.asarray(start).astype(jnp.float32)   # exact below 2**24
    ang = pos[:, None] * inv[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin):
    """Rotate ``x`` [B, T, N, h] pairwise (first half with second half of the head dim)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)


def causal_attention(q, k, v, impl: str = "dot_product", chunk: int = 128):
    """Causal scaled dot-product attention (Vaswani et al. 2017, Eq. 1) with grouped-query
    heads (Ainslie et al. 2023).

    Args:
      q: ``[B, T, H, h]``; k, v: ``[B, T, K, h]`` with ``H`` a multiple of ``K``; one dtype.
      impl: ``dot_product``, ``cudnn`` or ``chunked`` (:class:`LlamaConfig` ``attention``).
      chunk: query rows per chunk of ``chunked``.
    Returns:
      ``[B, T, H, h]`` in ``q``'s dtype.
    """
    if impl == "chunked":
        return chunked_attention(q, k, v, chunk)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation="cudnn" if impl == "cudnn" else None)


def cached_attention(q, k, v, start):
    """Attention of ``T`` new queries at positions ``start .. start + T - 1`` over a key/value
    cache: query ``t`` sees the cached positions ``0 .. start + t`` (causal; later cache rows
    are masked out, whatever they hold). The arithmetic is ``jax.nn.dot_product_attention``'s
    XLA path, whatever ``model.attention`` is (one query row per decoding step).

    Args:
      q: ``[B, T, H, h]``; k, v: the cache ``[B, S, K, h]`` (``H`` a multiple of ``K``) with the
        new positions already written; start: int32 scalar, ``start + T <= S``.
    Returns:
      ``[B, T, H, h]`` in ``q``'s dtype.
    """
    T, S = q.shape[1], k.shape[1]
    visible = jnp.arange(S)[None, :] <= start + jnp.arange(T)[:, None]      # [T, S]
    return jax.nn.dot_product_attention(q, k, v, mask=visible[None, None])


def chunked_attention(q, k, v, chunk: int = 128):
    """Causal attention computed ``chunk`` query rows at a time.

    Each chunk's scores ``[B, H, c, T]`` (float32) and softmax are formed, applied to ``v`` and
    dropped; the chunk is wrapped in ``jax.checkpoint``, so the backward pass recomputes them
    chunk by chunk and saves only ``q``, ``k`` and ``v``. Peak score memory is ``c / T`` of the
    dense ``[B, H, T, T]``, at the cost of one more ``q k^T`` product per chunk in the backward
    pass. The forward arithmetic is that of ``jax.nn.dot_product_attention``'s XLA path
    (float32 scores scaled by ``1 / sqrt(h)``, masked, softmax in float32, probabilities cast
    to ``v``'s dtype); the gradients of ``k`` and ``v``, summed over the chunks, are summed in
    float32. When ``chunk`` does not divide ``T`` the queries are zero-padded to a multiple of
    it (the padded rows are dropped from the output).

    Args:
      q: ``[B, T, H, h]``; k, v: ``[B, T, K, h]``, ``H`` a multiple of ``K`` (query head ``n``
        uses key/value head ``n // (H / K)``); one floating dtype.
      chunk: query rows per chunk (positive).
    Returns:
      ``[B, T, H, h]`` in ``q``'s dtype.
    Raises:
      ValueError: mismatched shapes, ``H`` not a multiple of ``K``, or ``chunk < 1``.
    """
    B, T, H, h = q.shape
    K = k.shape[2]
    if k.shape != (B, T, K, h) or v.shape != k.shape or H % K:
        raise ValueError(f"chunked_attention needs q [B, T, H, h] and k, v [B, T, K, h] with H "
                         f"a multiple of K; got q {q.shape}, k {k.shape}, v {v.shape}.")
    if chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be a positive integer.")
    c = min(int(chunk), T)
    n = -(-T // c)
    qp = jnp.pad(q, ((0, 0), (0, n * c - T), (0, 0), (0, 0))) if n * c != T else q
    qs = qp.reshape(B, n, c, K, H // K, h).swapaxes(0, 1)           # [n, B, c, K, G, h]
    keys = jnp.arange(T)
    scale = 1.0 / math.sqrt(h)
    # k and v enter every chunk: closed over in float32, their gradients add up in float32.
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)

    @jax.checkpoint
    def one(qi, start):
        kc, vc = k32.astype(k.dtype), v32.astype(v.dtype)
        s = jnp.einsum("bckgh,bskh->bkgcs", qi, kc, preferred_element_type=jnp.float32) * scale
        causal = (start + jnp.arange(c))[:, None] >= keys[None, :]
        s = jnp.where(causal, s, jnp.float32(-0.7 * float(jnp.finfo(jnp.float32).max)))
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bkgcs,bskh->bckgh", p, vc)

    out = jax.lax.map(lambda a: one(*a), (qs, jnp.arange(n) * c))      # [n, B, c, K, G, h]
    return out.swapaxes(0, 1).reshape(B, n * c, H, h)[:, :T].astype(q.dtype)


def _normal(rngs: nnx.Rngs, shape, std):
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * std)


class Attention(nnx.Module):
    """Causal attention with rotary embeddings and grouped-query attention (K <= H heads)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, H, K, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.wq = _normal(rngs, (d, H, h), cfg.init_std)
        self.wk = _normal(rngs, (d, K, h), cfg.init_std)
        self.wv = _normal(rngs, (d, K, h), cfg.init_std)
        self.wo = _normal(rngs, (H, h, d), out_std)
        self.n_heads, self.rescale = H, cfg.subnet_rescale
        self.impl, self.chunk = cfg.attention, cfg.attention_chunk

    def __call__(self, x, cos, sin, cache=None):
        """``x [B, T, d]`` -> ``[B, T, d]``. With ``cache = (k, v, start)`` (this block's
        cache ``[B, S, K, h]`` and the position of ``x``'s first token) the new keys and values
        are written into the cache at ``start``, the queries attend over it
        (:func:`cached_attention`), and the result is ``(out, (k, v))``."""
        q = jnp.einsum("btd,dnh->btnh", x, self.wq[...])
        k = jnp.einsum("btd,dnh->btnh", x, self.wk[...])
        v = jnp.einsum("btd,dnh->btnh", x, self.wv[...])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            o = causal_attention(q, k, v, self.impl, self.chunk)
        else:
            ck, cv, start = cache
            k, v = (jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), start, axis=1)
                    for c, n in ((ck, k), (cv, v)))
            o = cached_attention(q, k.astype(q.dtype), v.astype(q.dtype), start)
        out = jnp.einsum("btnh,nhd->btd", o, self.wo[...])
        held = q.shape[2]
        if self.rescale and held != self.n_heads:
            out = out * (self.n_heads / held)
        return out if cache is None else (out, (k, v))


class MLP(nnx.Module):
    """SwiGLU MLP: ``w_down(silu(x w_gate) * (x w_up))``."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.w_gate = _normal(rngs, (d, f), cfg.init_std)
        self.w_up = _normal(rngs, (d, f), cfg.init_std)
        self.w_down = _normal(rngs, (f, d), cfg.init_std / math.sqrt(2 * cfg.n_layers))
        self.d_ff, self.rescale = f, cfg.subnet_rescale

    def __call__(self, x):
        out = (jax.nn.silu(x @ self.w_gate[...]) * (x @ self.w_up[...])) @ self.w_down[...]
        held = self.w_gate.shape[-1]
        if self.rescale and held != self.d_ff:
            out = out * (self.d_ff / held)
        return out


class Block(nnx.Module):
    """Pre-norm transformer block: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, h, cos, sin, cache=None):
        """``h [B, T, d]`` -> ``[B, T, d]``; with ``cache`` (:meth:`Attention.__call__`)
        ``(h, (k, v))``, the block's cache with the new positions written."""
        a = self.attn(self.attn_norm(h), cos, sin, cache)
        a, kv = (a, None) if cache is None else a
        h = h + a
        h = h + self.mlp(self.mlp_norm(h))
        return h if cache is None else (h, kv)


class Llama(nnx.Module):
    """LLaMA-style decoder with a stacked block axis (see module docstring)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _normal(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = _normal(rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std)

    # The three stages are separate so that callers can run the blocks their own way (scan over
    # a compact stack, or stream full-model blocks one at a time from their holders).
    def embed_tokens(self, tokens):
        """tokens int32 [B, T] -> residual stream float32 [B, T, d]."""
        return jnp.take(self.embed[...], tokens, axis=0)

    def logits(self, h):
        """residual stream [B, T, d] -> logits float32 [B, T, V]."""
        h = self.final_norm(h)
        w = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return (h @ w).astype(jnp.float32)

    def run_blocks(self, h, remat: Callable | None = None, unroll: bool = False):
        """Apply the stored block stack ``[k, ...]`` in order (k may be < L: a compact subnet).

        ``unroll=True`` unrolls the scan (XLA's cost analysis counts a loop body once, so FLOP
        counts need the unrolled program)."""
        return self._scan_blocks(h, 0, None, remat, unroll)[0]

    def _scan_blocks(self, h, start, cache, remat=None, unroll=False):
        """``(h, cache)`` after the block stack on ``h [B, T, d]`` at positions ``start ..``;
        ``cache``: a :class:`KVCache` read and written (None: plain causal attention)."""
        graphdef, state = nnx.split(self.blocks)
        cos, sin = rope_tables(h.shape[1], self.cfg.head_dim, self.cfg.rope_theta, start)

        def body(x, layer):
            block_state, kv = layer
            block = nnx.merge(graphdef, block_state)
            return (block(x, cos, sin), None) if kv is None else block(x, cos, sin,
                                                                       (*kv, start))

        if remat is not None:
            body = remat(body)
        h, kv = jax.lax.scan(body, h, (state, None if cache is None else tuple(cache)),
                             unroll=unroll)
        return h, None if cache is None else KVCache(*kv)

    def __call__(self, tokens, unroll: bool = False):
        """tokens int32 [B, T] -> logits float32 [B, T, V]."""
        return self.logits(self.run_blocks(self.embed_tokens(tokens), unroll=unroll))

    def decode(self, tokens, cache: "KVCache", start):
        """Incremental decoding: the logits of ``T`` new tokens at positions ``start .. start
        + T - 1``, given the keys and values of the positions before them in ``cache``.

        A prompt is decoded once (``start = 0``, its ``T`` tokens: the prefill), then one token
        at a time (``T = 1``, ``start`` = its position); every decoded position's keys and
        values are written into the cache, and each query sees the cache up to its own
        position, so the logits are the full forward's (:meth:`__call__`) of the tokens so far
        (to float rounding: XLA's dot-product attention whatever ``model.attention``).

        Args:
          tokens: int32 ``[B, T]``.
          cache: a :class:`KVCache` of ``S >= start + T`` positions (:func:`init_cache`).
          start: int or int32 scalar array (traced: one compiled step serves every position).
        Returns:
          ``(logits float32 [B, T, V], the cache with positions start .. start + T - 1
          written)``.
        Raises:
          ValueError: ``tokens`` not ``[B, T]`` with the cache's ``B`` and ``T <= S``, or a
            Python-int ``start`` with ``start + T > S`` (a traced ``start`` cannot be checked:
            past the cache, the writes would be clamped to its last rows).
        """
        B, T = tokens.shape
        S = cache.k.shape[2]
        need = T + (start if isinstance(start, int) else 0)   # (a traced start: unknown)
        if cache.k.shape[1] != B or need > S or (isinstance(start, int) and start < 0):
            raise ValueError(f"decode: tokens {tokens.shape} at start={start} need a cache of "
                             f"batch {B} and at least {need} positions, got k "
                             f"{cache.k.shape} [L, B, S, K, h]; build it with "
                             "init_cache(cfg, B, S).")
        h, cache = self._scan_blocks(self.embed_tokens(tokens), start, cache)
        return self.logits(h), cache


class KVCache(NamedTuple):
    """The keys and values (after rotary embedding) of every decoded position, per block:
    ``k``, ``v`` ``[L, B, S, K, h]`` (``S`` positions, ``K`` key/value heads, head dim ``h``;
    the dtype of :func:`init_cache`). A pytree; which positions are filled is the caller's
    count (:meth:`Llama.decode` masks later rows)."""
    k: jax.Array
    v: jax.Array


def init_cache(cfg: LlamaConfig, batch: int, size: int, dtype=jnp.float32) -> KVCache:
    """An empty (zero) :class:`KVCache` of ``size`` positions for ``batch`` sequences of the
    model ``cfg``, in ``dtype`` (the parameters' compute dtype).

    Raises:
      ValueError: ``batch`` or ``size`` not positive, or ``size > cfg.max_seq_len``."""
    if batch < 1 or not 1 <= size <= cfg.max_seq_len:
        raise ValueError(f"init_cache: batch={batch}, size={size}: need batch >= 1 and "
                         f"1 <= size <= model.max_seq_len={cfg.max_seq_len}.")
    shape = (cfg.n_layers, batch, size, cfg.n_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def sdp_rules(cfg: LlamaConfig) -> list:
    """The model's SDP components (:mod:`sdp_jax.spec`): the stacked blocks (B-SDP), and per
    block the MLP hidden neurons and the attention key/value head groups (N-SDP; a group takes
    its ``H / K`` query heads with it). Embedding, norms and head are always-kept."""
    group = cfg.n_heads // cfg.n_kv_heads
    n = spec_lib.Neurons
    return [spec_lib.Blocks(BLOCK_KEY, stacked=True),
            n("blocks/mlp/w_gate", 2, "mlp", stacked=True),
            n("blocks/mlp/w_up", 2, "mlp", stacked=True),
            n("blocks/mlp/w_down", 1, "mlp", stacked=True),
            n("blocks/attn/wq", 2, "heads", group, stacked=True),
            n("blocks/attn/wk", 2, "heads", stacked=True),
            n("blocks/attn/wv", 2, "heads", stacked=True),
            n("blocks/attn/wo", 1, "heads", group, stacked=True)]


# What the components are called in errors and logs.
SDP_NAMES = {"block": "blocks", "mlp": "MLP hidden neurons per block",
             "heads": "key/value head groups per block"}


def block_apply_fn(model: Llama):
    """Pure function ``(block_params, h) -> h`` for ONE block (params without the stack axis),
    used to stream the full model block by block."""
    graphdef, _ = nnx.split(model.blocks)

    def apply(block_params, h):
        cos, sin = rope_tables(h.shape[1], model.cfg.head_dim, model.cfg.rope_theta)
        return nnx.merge(graphdef, block_params)(h, cos, sin)

    return apply


def next_token_loss(logits, targets):
    """Mean next-token cross-entropy in nats per token.

    Args:
      logits: float32 [B, T, V]. targets: int32 [B, T].
    Returns:
      float32 scalar.
    """
    logz = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - tgt)


def make_plan(variant: str, cfg: LlamaConfig, workers: int, coverage: float,
              scheme: str = "cyclic", seed: int = 0, allow_nonuniform: bool = False,
              allow_disconnected: bool = False, pipe=None) -> spec_lib.SDPSpec:
    """The :class:`sdp_jax.spec.SDPSpec` of a LLaMA model for a variant (DDP: all-ones block
    mask), from the model's declared rules (:func:`sdp_rules`).

    With ``pipe`` (:class:`sdp_jax.pipeline.PipelineConfig`, ``stages = P > 1``): the spec of
    one pipeline stage, whose ``L / P`` blocks carry the same masks in every stage, and the
    always-kept boundary parameters (:func:`sdp_jax.pipeline.init_boundary`).

    Raises:
      ValueError: unknown variant, a coverage not realizable for a component kind, or a
        disconnected mask graph (unless ``allow_disconnected``); ``P`` not dividing ``L``.
    """
    tree = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))
    if pipe is not None and pipe.stages > 1:
        if cfg.n_layers % pipe.stages:
            raise ValueError(f"pipeline.stages={pipe.stages} does not divide "
                             f"model.n_layers={cfg.n_layers}; choose a divisor of it.")
        stage = dataclasses.replace(cfg, n_layers=cfg.n_layers // pipe.stages)
        tree = {**nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Llama(stage, nnx.Rngs(0))),
                                             nnx.Param)),
                "boundary": jax.eval_shape(lambda: pl.init_boundary(jax.random.key(0), cfg,
                                                                    pipe))}
    return spec_lib.build(tree, sdp_rules(cfg), variant, workers, coverage, scheme=scheme,
                          seed=seed, allow_nonuniform=allow_nonuniform, names=SDP_NAMES,
                          allow_disconnected=allow_disconnected)


def model_flops_per_token(cfg: LlamaConfig, seq_len: int, blocks: int | None = None,
                          width: float = 1.0) -> float:
    """Training FLOPs per token, ``6 * N + 12 * L * T * d`` (Kaplan et al. 2020, Sec. 2.1, with the
    attention term of PaLM, Chowdhery et al. 2022, App. B); ``blocks`` defaults to ``L``;
    ``width``: the fraction of each block's neurons and heads that runs (N-SDP's coverage)."""
    blocks = cfg.n_layers if blocks is None else blocks
    c = cfg.param_count()
    n = c["per_block"] * blocks * width + c["always_kept"] - cfg.vocab_size * cfg.d_model * (
        0 if cfg.tie_embeddings else 1)  # the input embedding lookup is no matmul
    return 6.0 * n + 12.0 * blocks * seq_len * cfg.d_model * width
