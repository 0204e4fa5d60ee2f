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
import math
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


# The special tokens' ids a config.json names (kept through a conversion: check_folder records
# them, the export writes them back where the run's own tokenizer gives none).
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


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
        hf.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if hf.get("model_type") != "llama":
        raise ValueError(f"{where}: model_type={hf.get('model_type')!r}, not a LLaMA "
                         "(LlamaForCausalLM); only LLaMA checkpoints load here")
    unsupported = [(k, hf.get(k)) for k, ok in (
        ("attention_bias", False), ("mlp_bias", False), ("rope_scaling", None),
        ("hidden_act", "silu"), ("pretraining_tp", 1)) if hf.get(k, ok) not in (ok,)]
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        unsupported.append(("rope_parameters", rope))   # (named as the file names it)
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


def tensor_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The ``LlamaForCausalLM`` state dict of the model ``cfg``: ``{tensor name: shape}``
    (``[out, in]`` layouts, see the module docstring; no ``lm_head.weight`` when tied)."""
    d, H, K, h, F, V = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                        cfg.vocab_size)
    out = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (V, d)
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        out.update({pre + "self_attn.q_proj.weight": (H * h, d),
                    pre + "self_attn.k_proj.weight": (K * h, d),
                    pre + "self_attn.v_proj.weight": (K * h, d),
                    pre + "self_attn.o_proj.weight": (d, H * h),
                    pre + "mlp.gate_proj.weight": (F, d), pre + "mlp.up_proj.weight": (F, d),
                    pre + "mlp.down_proj.weight": (d, F),
                    pre + "input_layernorm.weight": (d,),
                    pre + "post_attention_layernorm.weight": (d,)})
    return out


def from_hf(state: dict[str, np.ndarray], cfg: LlamaConfig, where: str = "") -> dict:
    """A ``LlamaForCausalLM`` state dict -> this package's full LLaMA parameters (nested dict
    of float32 numpy, blocks stacked), the inverse of :func:`to_hf`.

    Raises:
      ValueError: a missing tensor or one of another shape than ``cfg`` gives
        (:func:`tensor_shapes`; naming it)."""
    d, H, K, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    shapes = tensor_shapes(cfg)

    def get(name):
        if name not in state:
            raise ValueError(f"{where}: no tensor {name!r}; not a LlamaForCausalLM checkpoint "
                             f"of {cfg.n_layers} layers")
        x = np.asarray(state[name], np.float32)
        if x.shape != shapes[name]:
            raise ValueError(f"{where}: {name} has shape {x.shape}, the config gives "
                             f"{shapes[name]}")
        return x

    def layers(fmt, fix):
        return np.stack([fix(get(f"model.layers.{i}.{fmt}")) for i in range(cfg.n_layers)])
    same = lambda w: w  # noqa: E731
    out = {"embed": get("model.embed_tokens.weight"),
           "final_norm": {"scale": get("model.norm.weight")},
           "blocks": {
               "attn": {"wq": layers("self_attn.q_proj.weight", lambda w: w.T.reshape(d, H, h)),
                        "wk": layers("self_attn.k_proj.weight", lambda w: w.T.reshape(d, K, h)),
                        "wv": layers("self_attn.v_proj.weight", lambda w: w.T.reshape(d, K, h)),
                        "wo": layers("self_attn.o_proj.weight", lambda w: w.T.reshape(H, h, d))},
               "attn_norm": {"scale": layers("input_layernorm.weight", same)},
               "mlp": {"w_gate": layers("mlp.gate_proj.weight", lambda w: w.T),
                       "w_up": layers("mlp.up_proj.weight", lambda w: w.T),
                       "w_down": layers("mlp.down_proj.weight", lambda w: w.T)},
               "mlp_norm": {"scale": layers("post_attention_layernorm.weight", same)}}}
    if not cfg.tie_embeddings:
        out["lm_head"] = get("lm_head.weight").T.copy()
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


def check_matches(folder: str, cfg: LlamaConfig) -> dict:
    """The ``config.json`` of the checkpoint in ``folder`` (a dict), checked to give the shape
    of ``cfg`` (every field but ``max_seq_len``).

    Raises:
      ValueError: (one line) no config.json or another model (:func:`read_config`,
        :func:`model_fields`), or another shape, with the ``--config.model.FIELD=VALUE`` flags
        to set."""
    hf = read_config(folder)
    fields = model_fields(hf, os.path.join(folder, "config.json"))
    wrong = [(k, fields[k]) for k in MATCHED if k in fields and fields[k] != getattr(cfg, k)]
    if wrong:
        raise ValueError(f"the checkpoint in {folder!r} is another shape than the run's model; "
                         "set " + " ".join(f"--config.model.{k}={v}" for k, v in wrong))
    return hf


# safetensors' float dtypes (bytes per element): the weights read here (as float32)
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
MAX_HEADER = 100_000_000   # bytes; safetensors refuses a longer header
AGAIN = "copy or download the folder again"


def read_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors of the safetensors file ``path`` from its header alone (no tensor data is
    read): ``{name: (dtype, shape)}``, dtype as safetensors names it (``F32``, ``BF16``...).

    A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON that
    give each tensor's dtype, shape and byte range in the data after it, then the data: a file
    shorter than its header says is truncated.

    Raises:
      ValueError: one line naming the file: unreadable, not a safetensors file, truncated (the
        bytes its header needs and the bytes it has), or a header whose byte ranges do not
        match its shapes."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
            raw = f.read(n) if 2 <= n <= MAX_HEADER else b""
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e}); {AGAIN}") from None
    if not raw.startswith(b"{"):
        what = f"{size:,} bytes that do not begin with a safetensors header" if size else "empty"
        raise ValueError(f"{path}: not a safetensors file ({what}); save the model with "
                         "save_pretrained(..., safe_serialization=True)")
    if len(raw) < n:
        raise ValueError(f"{path}: truncated: its header alone needs {8 + n:,} bytes, the "
                         f"file holds {size:,}; {AGAIN}")
    try:
        meta = json.loads(raw)
        tensors = {name: (t["dtype"], tuple(int(x) for x in t["shape"]),
                          tuple(int(x) for x in t["data_offsets"]))
                   for name, t in meta.items() if name != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{path}: damaged safetensors header ({type(e).__name__}: "
                         f"{str(e)[:100]}); {AGAIN}") from None
    data = size - 8 - n
    for name, (dtype, shape, (begin, end)) in tensors.items():
        if end > data:
            raise ValueError(f"{path}: truncated: its header places tensor {name} up to byte "
                             f"{8 + n + end:,}, the file holds {size:,}; {AGAIN}")
        if dtype in FLOAT_DTYPES and end - begin != FLOAT_DTYPES[dtype] * math.prod(shape):
            raise ValueError(f"{path}: damaged safetensors header: tensor {name} ({dtype}, "
                             f"{shape}) spans {end - begin:,} bytes; {AGAIN}")
    return {name: (dtype, shape) for name, (dtype, shape, _) in tensors.items()}


def weight_files(folder: str) -> tuple[list[str], dict[str, str]]:
    """``(the safetensors files of the LLaMA in folder, {tensor: file} of its index)``: the
    shards ``model.safetensors.index.json`` lists, or ``model.safetensors`` (then ``{}``).

    Raises:
      ValueError: neither file, an index without a readable ``weight_map``, or a shard the
        index lists that is missing (naming it)."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                mapping = dict(json.load(f)["weight_map"])
            files = sorted(set(mapping.values()))
            paths = [os.path.join(folder, name) for name in files]
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            raise ValueError(f"{index}: not a safetensors index (no readable weight_map: "
                             f"{type(e).__name__}: {str(e)[:100]}); {AGAIN}") from None
        missing = [name for name, p in zip(files, paths) if not os.path.isfile(p)]
        if missing:
            count = sum(v == missing[0] for v in mapping.values())
            more = (f" ({len(missing)} of its {len(files)} shards are missing)"
                    if len(missing) > 1 else "")
            raise ValueError(f"{os.path.join(folder, missing[0])}: missing, though {INDEX} maps "
                             f"{count} tensors to it{more}; {AGAIN}")
        return files, mapping
    if os.path.isfile(os.path.join(folder, WEIGHTS)):
        return [WEIGHTS], {}
    raise ValueError(f"{folder!r} has neither {WEIGHTS} nor {INDEX} (PyTorch .bin weights "
                     "are not read: save the model with safe_serialization=True)")


def check_folder(folder: str, cfg: LlamaConfig) -> dict[str, Any]:
    """Check the Hugging Face LLaMA in ``folder`` against the model ``cfg`` from its
    ``config.json``, its index and its safetensors headers alone (:func:`read_header`; no
    tensor data is read): the shape (:func:`check_matches`), every weight file there and
    whole, every tensor ``cfg`` needs (:func:`tensor_shapes`) in one of them, of its shape and
    a float dtype. A run checks this before it creates its workdir.

    Returns:
      what a run started from the folder records of it: ``{"folder": its absolute path,
      "max_position_embeddings": the context length its config.json gives, or None,
      "token_ids": the special tokens' ids it names (:data:`TOKEN_IDS`)}``.
    Raises:
      ValueError: one line naming the file and what is wrong with it."""
    hf = check_matches(folder, cfg)
    files, mapping = weight_files(folder)
    found = {}
    for name in files:
        for tensor, (dtype, shape) in read_header(os.path.join(folder, name)).items():
            found.setdefault(tensor, (name, dtype, shape))
    for tensor, want in tensor_shapes(cfg).items():
        if tensor not in found:
            mapped = (f" ({INDEX} maps it to {mapping[tensor]}, whose header lacks it)"
                      if tensor in mapping else "")
            raise ValueError(f"{folder}: no tensor {tensor} in {', '.join(files)}{mapped}; not "
                             f"the LlamaForCausalLM of {cfg.n_layers} layers its config.json "
                             f"describes: {AGAIN}")
        name, dtype, shape = found[tensor]
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"{os.path.join(folder, name)}: tensor {tensor} is {dtype}; only "
                             f"float weights ({', '.join(FLOAT_DTYPES)}) are read, not a "
                             "quantized checkpoint")
        if shape != want:
            raise ValueError(f"{os.path.join(folder, name)}: tensor {tensor} has shape "
                             f"{list(shape)}, but the folder's config.json (and the run) give "
                             f"{list(want)}: the weights are of another model")
    context = hf.get("max_position_embeddings")
    return {"folder": os.path.abspath(folder),
            "max_position_embeddings": context if isinstance(context, int) else None,
            "token_ids": {k: hf[k] for k in TOKEN_IDS if hf.get(k) is not None}}


def read(folder: str, cfg: LlamaConfig) -> dict:
    """The parameters of the LLaMA checkpoint in ``folder`` (``model.safetensors``, or the
    shards ``model.safetensors.index.json`` lists; any float dtype, read as float32) as this
    package's full parameters for ``cfg`` (:func:`from_hf`).

    Raises:
      ValueError: the errors of :func:`check_folder` (checked first, from the headers), or a
        file that cannot be read after all (naming it)."""
    from safetensors import SafetensorError, safe_open  # pylint: disable=g-import-not-at-top

    check_folder(folder, cfg)
    wanted, state = tensor_shapes(cfg), {}
    for name in weight_files(folder)[0]:   # a tensor at a time (the flax reader knows bf16)
        path = os.path.join(folder, name)
        try:
            with safe_open(path, framework="flax") as f:
                for key in f.keys():
                    if key in wanted:
                        state[key] = np.asarray(f.get_tensor(key).astype("float32"))
        except (OSError, SafetensorError) as e:   # (a file changed since it was checked)
            raise ValueError(f"{path}: cannot be read ({type(e).__name__}: {str(e)[:200]}); "
                             f"{AGAIN}") from None
    return from_hf(state, cfg, folder)
