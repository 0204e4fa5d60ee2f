"""Hugging Face ``transformers`` LLaMA checkpoints (``LlamaForCausalLM``): this package's LLaMA
parameters (:mod:`sdp_jax.models.llama`) to and from a ``config.json`` and safetensors state dict.

The two models compute the same function (tested against ``transformers`` within 1e-4 in
float32): RMSNorm ``x / sqrt(mean(x^2) + eps) * weight``, SwiGLU, grouped-query attention with
query head ``n`` reading key/value head ``n // (H / K)``, and the same rotary convention (the
first half of a head's dimensions rotated with the second half, ``rotate_half``; no
permutation of the query and key weights is needed). Only the layouts differ: a
``torch.nn.Linear`` keeps ``[out, in]``, this package ``[in, ...out]`` with the heads on their
own axis and the ``L`` blocks stacked:

=================================  =====================================================
``model.embed_tokens.weight``      ``embed`` ``[V, d]``
``model.layers.{i}.self_attn.``    ``q_proj`` ``[H h, d]`` = ``wq[i]`` ``[d, H, h]``
                                   reshaped ``[d, H h]`` and transposed; ``k_proj`` /
                                   ``v_proj`` from ``wk`` / ``wv`` ``[d, K, h]``;
                                   ``o_proj`` ``[d, H h]`` from ``wo[i]`` ``[H, h, d]``
``model.layers.{i}.mlp.``          ``gate_proj`` / ``up_proj`` ``[F, d]`` = ``w_gate[i]`` /
                                   ``w_up[i]`` transposed; ``down_proj`` ``[d, F]`` =
                                   ``w_down[i]`` transposed
``model.layers.{i}.``              ``input_layernorm.weight`` = ``attn_norm.scale[i]``,
                                   ``post_attention_layernorm.weight`` =
                                   ``mlp_norm.scale[i]``
``model.norm.weight``              ``final_norm.scale``
``lm_head.weight``                 ``lm_head`` ``[d, V]`` transposed (absent when tied)
=================================  =====================================================
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from sdp_jax.models.llama import LlamaConfig

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# LlamaConfig field <- config.json key (transformers' LlamaConfig)
FIELDS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
          "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
          "d_ff": "intermediate_size", "max_seq_len": "max_position_embeddings",
          "tie_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta",
          "norm_eps": "rms_norm_eps"}
# transformers' LlamaConfig defaults: what a config.json that leaves a key out means
HF_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
               "num_hidden_layers": 32, "num_attention_heads": 32,
               "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": False}
# What a run must match of a checkpoint it starts from (max_seq_len may differ).
MATCHED = tuple(f for f in FIELDS if f != "max_seq_len")


def hf_config(cfg: LlamaConfig, eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``transformers``' ``LlamaConfig`` for the model ``cfg`` (float32
    weights, no biases, SiLU, no rope scaling); ``eos_token_id``: the end-of-text id of the
    run's tokenizer, if it had one."""
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           **{hf: getattr(cfg, ours) for ours, hf in FIELDS.items()},
           "head_dim": cfg.head_dim, "hidden_act": "silu", "attention_bias": False,
           "mlp_bias": False, "attention_dropout": 0.0, "rope_scaling": None,
           "initializer_range": cfg.init_std, "pretraining_tp": 1, "use_cache": True,
           "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": eos_token_id}
    out["rope_theta"] = float(out["rope_theta"])   # transformers 4.x; 5.x reads rope_parameters
    out["rope_parameters"] = {"rope_theta": float(cfg.rope_theta), "rope_type": "default"}
    return out


def model_fields(hf: dict, where: str = "config.json") -> dict[str, Any]:
    """The :class:`~sdp_jax.models.llama.LlamaConfig` fields of a ``transformers`` LLaMA
    ``config.json`` (as a dict); a key it leaves out has ``transformers``' default
    (:data:`HF_DEFAULTS`, e.g. ``rms_norm_eps`` 1e-6), as ``transformers`` would read it.

    Raises:
      ValueError: not a LLaMA (``model_type``), or a feature this package's LLaMA lacks:
        biases, rope scaling, an activation other than SiLU, a head dim other than
        ``hidden_size / num_attention_heads`` (naming the key and its value)."""
    hf = dict(hf)
    rope = hf.get("rope_parameters") or {}
    if rope:   # transformers 5.x keeps the rotary settings here
        if rope.get("rope_type", "default") != "default":
            hf["rope_scaling"] = rope
        hf.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if hf.get("model_type") != "llama":
        raise ValueError(f"{where}: model_type={hf.get('model_type')!r}, not a LLaMA "
                         "(LlamaForCausalLM); only LLaMA checkpoints load here")
    unsupported = [(k, hf.get(k)) for k, ok in (
        ("attention_bias", False), ("mlp_bias", False), ("rope_scaling", None),
        ("hidden_act", "silu"), ("pretraining_tp", 1)) if hf.get(k, ok) not in (ok,)]
    heads = hf.get("num_attention_heads") or 1
    if hf.get("head_dim") not in (None, hf.get("hidden_size", 0) // heads):
        unsupported.append(("head_dim", hf.get("head_dim")))
    if unsupported:
        k, v = unsupported[0]
        raise ValueError(f"{where}: {k}={v!r} is a LLaMA variant this package does not build "
                         "(no biases, no rope scaling, SiLU, head_dim = hidden_size / heads)")
    hf = {**HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    hf.setdefault("num_key_value_heads", hf["num_attention_heads"])
    out = {ours: hf[key] for ours, key in FIELDS.items()}
    out["tie_embeddings"] = bool(out["tie_embeddings"])
    return out


def to_hf(params: dict, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """This package's full LLaMA parameters (nested dict, blocks stacked ``[L, ...]``) -> the
    ``LlamaForCausalLM`` state dict (float32, contiguous, see the module docstring)."""
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    b, d = params["blocks"], cfg.d_model
    out = {"model.embed_tokens.weight": f32(params["embed"]),
           "model.norm.weight": f32(params["final_norm"]["scale"])}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = f32(np.asarray(params["lm_head"]).T)
    for i in range(cfg.n_layers):
        at, mlp, pre = b["attn"], b["mlp"], f"model.layers.{i}."
        out.update({
            pre + "self_attn.q_proj.weight": f32(np.asarray(at["wq"][i]).reshape(d, -1).T),
            pre + "self_attn.k_proj.weight": f32(np.asarray(at["wk"][i]).reshape(d, -1).T),
            pre + "self_attn.v_proj.weight": f32(np.asarray(at["wv"][i]).reshape(d, -1).T),
            pre + "self_attn.o_proj.weight": f32(np.asarray(at["wo"][i]).reshape(-1, d).T),
            pre + "mlp.gate_proj.weight": f32(np.asarray(mlp["w_gate"][i]).T),
            pre + "mlp.up_proj.weight": f32(np.asarray(mlp["w_up"][i]).T),
            pre + "mlp.down_proj.weight": f32(np.asarray(mlp["w_down"][i]).T),
            pre + "input_layernorm.weight": f32(b["attn_norm"]["scale"][i]),
            pre + "post_attention_layernorm.weight": f32(b["mlp_norm"]["scale"][i])})
    return out


def from_hf(state: dict[str, np.ndarray], cfg: LlamaConfig, where: str = "") -> dict:
    """A ``LlamaForCausalLM`` state dict -> this package's full LLaMA parameters (nested dict
    of float32 numpy, blocks stacked), the inverse of :func:`to_hf`.

    Raises:
      ValueError: a missing tensor or one of another shape than ``cfg`` gives (naming it)."""
    d, H, K, h, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff

    def get(name, shape):
        if name not in state:
            raise ValueError(f"{where}: no tensor {name!r}; not a LlamaForCausalLM checkpoint "
                             f"of {cfg.n_layers} layers")
        x = np.asarray(state[name], np.float32)
        if x.shape != shape:
            raise ValueError(f"{where}: {name} has shape {x.shape}, the config gives {shape}")
        return x

    def layers(fmt, shape, fix):
        return np.stack([fix(get(f"model.layers.{i}.{fmt}", shape))
                         for i in range(cfg.n_layers)])
    out = {"embed": get("model.embed_tokens.weight", (cfg.vocab_size, d)),
           "final_norm": {"scale": get("model.norm.weight", (d,))},
           "blocks": {
               "attn": {"wq": layers("self_attn.q_proj.weight", (H * h, d),
                                     lambda w: w.T.reshape(d, H, h)),
                        "wk": layers("self_attn.k_proj.weight", (K * h, d),
                                     lambda w: w.T.reshape(d, K, h)),
                        "wv": layers("self_attn.v_proj.weight", (K * h, d),
                                     lambda w: w.T.reshape(d, K, h)),
                        "wo": layers("self_attn.o_proj.weight", (d, H * h),
                                     lambda w: w.T.reshape(H, h, d))},
               "attn_norm": {"scale": layers("input_layernorm.weight", (d,), lambda w: w)},
               "mlp": {"w_gate": layers("mlp.gate_proj.weight", (F, d), lambda w: w.T),
                       "w_up": layers("mlp.up_proj.weight", (F, d), lambda w: w.T),
                       "w_down": layers("mlp.down_proj.weight", (d, F), lambda w: w.T)},
               "mlp_norm": {"scale": layers("post_attention_layernorm.weight", (d,),
                                            lambda w: w)}}}
    if not cfg.tie_embeddings:
        out["lm_head"] = get("lm_head.weight", (cfg.vocab_size, d)).T.copy()
    return out


def read_config(folder: str) -> dict:
    """A Hugging Face model folder's ``config.json``.

    Raises:
      ValueError: no folder or no readable ``config.json`` there."""
    path = os.path.join(folder, "config.json")
    if os.path.isdir(os.path.join(folder, "checkpoints")):
        raise ValueError(f"{folder!r} is a training run's folder, not a Hugging Face LLaMA; "
                         f"export it first (python -m sdp_jax.tools.export --workdir {folder} "
                         "--format hf --out DIR) and give DIR")
    if not os.path.isfile(path):
        raise ValueError(f"{folder!r} has no config.json: give a Hugging Face LLaMA folder "
                         "(save_pretrained's, or python -m sdp_jax.tools.export --format hf)")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None


def check_matches(folder: str, cfg: LlamaConfig) -> None:
    """Raises ValueError (one line, with the ``--config.model.FIELD=VALUE`` flags to set) unless
    the checkpoint in ``folder`` has the shape of ``cfg`` (every field but ``max_seq_len``)."""
    fields = model_fields(read_config(folder), os.path.join(folder, "config.json"))
    wrong = [(k, fields[k]) for k in MATCHED if k in fields and fields[k] != getattr(cfg, k)]
    if wrong:
        raise ValueError(f"the checkpoint in {folder!r} is another shape than the run's model; "
                         "set " + " ".join(f"--config.model.{k}={v}" for k, v in wrong))


def read(folder: str, cfg: LlamaConfig) -> dict:
    """The parameters of the LLaMA checkpoint in ``folder`` (``model.safetensors``, or the
    shards ``model.safetensors.index.json`` lists; any float dtype, read as float32) as this
    package's full parameters for ``cfg`` (:func:`from_hf`).

    Raises:
      ValueError: the errors of :func:`check_matches` and :func:`from_hf`; no safetensors
        weights in ``folder``."""
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top

    check_matches(folder, cfg)
    if os.path.isfile(os.path.join(folder, INDEX)):
        with open(os.path.join(folder, INDEX)) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, WEIGHTS)):
        files = [WEIGHTS]
    else:
        raise ValueError(f"{folder!r} has neither {WEIGHTS} nor {INDEX} (PyTorch .bin weights "
                         "are not read: save the model with safe_serialization=True)")
    state = {}
    for name in files:   # a tensor at a time (the flax reader knows bf16; numpy does not)
        with safe_open(os.path.join(folder, name), framework="flax") as f:
            for key in f.keys():
                state[key] = np.asarray(f.get_tensor(key).astype("float32"))
    return from_hf(state, cfg, folder)
