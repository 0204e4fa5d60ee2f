"""Selectable attention (issue 14, item 3): the query-chunked attention equals
jax.nn.dot_product_attention in values, gradients and training steps, and its compiled step
keeps less memory; bad choices are refused before any compute."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax.options import StepOptions
from sdp_jax.costs import program as costs
from sdp_jax.models import llama
from sdp_jax.models.llama import LlamaConfig
from sdp_jax.train import config as config_lib
from sdp_jax.train import families
from sdp_jax.train import optimizer as optim_lib
from sdp_jax.train import run as run_lib

W = 4
CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                  max_seq_len=64)


def _qkv(B, T, H, K, h, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(kq, (B, T, H, h)).astype(dtype),
            jax.random.normal(kk, (B, T, K, h)).astype(dtype),
            jax.random.normal(kv, (B, T, K, h)).astype(dtype))


def _loss(impl, chunk):
    return lambda *a: jnp.sum(jnp.sin(llama.causal_attention(*a, impl, chunk)
                                      .astype(jnp.float32)))


@pytest.mark.parametrize("shape,chunk", [((2, 16, 4, 2, 8), 4), ((2, 13, 4, 4, 8), 5),
                                         ((1, 8, 2, 1, 4), 100)])
def test_chunked_attention_equals_dot_product(shape, chunk):
    """GQA (K < H); T = 13 is prime (queries padded to 15); one chunk of the whole sequence."""
    q, k, v = _qkv(*shape)
    np.testing.assert_allclose(llama.causal_attention(q, k, v, "chunked", chunk),
                               llama.causal_attention(q, k, v, "dot_product"), atol=1e-6)
    got = jax.grad(_loss("chunked", chunk), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(_loss("dot_product", chunk), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=2e-6)


@pytest.mark.slow
def test_chunked_attention_in_bf16_is_as_accurate_as_dot_product():
    """bf16 inputs: against the float32 gradients, the chunked gradients (k and v summed over
    16 chunks, in float32) are no further off than dot_product's."""
    q, k, v = _qkv(1, 256, 4, 2, 16)
    exact = jax.grad(_loss("dot_product", 16), argnums=(0, 1, 2))(q, k, v)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    for impl_grads in [jax.grad(_loss(i, 16), argnums=(0, 1, 2))(*low)
                       for i in ("chunked", "dot_product")]:
        errs = [float(jnp.linalg.norm(g.astype(jnp.float32) - e) / jnp.linalg.norm(e))
                for g, e in zip(impl_grads, exact)]
        assert max(errs) < 0.02, errs
    chunked = jax.grad(_loss("chunked", 16), argnums=(1, 2))(*low)
    dense = jax.grad(_loss("dot_product", 16), argnums=(1, 2))(*low)
    for c, d, e in zip(chunked, dense, exact[1:]):
        err = lambda g: float(jnp.linalg.norm(g.astype(jnp.float32) - e))  # noqa: E731
        assert err(c) <= 1.1 * err(d), (err(c), err(d))


def test_chunked_attention_refuses_bad_shapes():
    q, k, v = _qkv(1, 8, 3, 2, 4)
    with pytest.raises(ValueError, match=r"H a multiple of K.*q \(1, 8, 3, 4\)"):
        llama.chunked_attention(q, k, v, 4)


def _builder(mesh, cfg, variant="ddp", coverage=1.0):
    plan = llama.make_plan(variant, cfg, W, coverage, "cyclic", 0)
    return families.language_model_step(cfg, plan, optim_lib.OptimConfig(lr=1e-2, warmup_steps=1),
                                        mesh, StepOptions(total_steps=10, grad_clip=1.0))


@pytest.mark.slow
@pytest.mark.parametrize("variant,coverage", [("ddp", 1.0), ("n-sdp", 0.5)])
def test_chunked_attention_trains_like_dot_product(variant, coverage):
    mesh = jax.make_mesh((W,), ("data",), devices=jax.devices()[:W])
    rng = np.random.default_rng(0)
    sh = NamedSharding(mesh, P("data"))
    batches = [jax.device_put(jnp.asarray(rng.integers(0, 64, (2 * W, 17)), jnp.int32), sh)
               for _ in range(3)]
    states = []
    for cfg in (CFG, dataclasses.replace(CFG, attention="chunked", attention_chunk=4)):
        b = _builder(mesh, cfg, variant, coverage)
        state = b.init_state(seed=0)
        for x in batches:
            state, _ = b.train_step(state, x)
        states.append(b.full_params(state))
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_chunked_attention_keeps_less_memory():
    """The dense step saves every block's [B, H, T, T] scores for the backward pass; the
    chunked one saves q, k, v and recomputes one chunk's scores at a time."""
    mesh = jax.make_mesh((W,), ("data",), devices=jax.devices()[:W])
    batch = jax.ShapeDtypeStruct((4 * W, 65), jnp.int32)
    temp = {}
    for impl in ("dot_product", "chunked"):
        cfg = dataclasses.replace(CFG, attention=impl, attention_chunk=8)
        temp[impl] = costs.memory_stats(_builder(mesh, cfg).compiled_train_step(batch))["temp_bytes"]
    scores = 4 * CFG.n_heads * 64 * 64 * 4   # one block's float32 scores per device
    assert temp["chunked"] < temp["dot_product"] - scores, temp


def test_attention_choices_are_checked():
    with pytest.raises(ValueError, match=r"model.attention='flash'.*dot_product, cudnn, chunked"):
        dataclasses.replace(CFG, attention="flash")
    with pytest.raises(ValueError, match=r"attention_chunk=0 must be a positive integer"):
        dataclasses.replace(CFG, attention="chunked", attention_chunk=0)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match=r"'cudnn' needs an NVIDIA GPU.*chunked"):
            dataclasses.replace(CFG, attention="cudnn")


def test_cudnn_attention_needs_bf16(monkeypatch):
    """On a GPU, cuDNN's attention refuses float32: the run config says so before compute."""
    monkeypatch.setattr(llama.jax, "default_backend", lambda: "gpu")
    c = config_lib.base_config()
    c.model.attention = "cudnn"
    with pytest.raises(ValueError, match=r"bf16 only.*dtype='float32'.*--config.dtype=bfloat16"):
        families.LanguageModelFamily().model_config(c)
    c.dtype = "bfloat16"
    assert families.LanguageModelFamily().model_config(c).attention == "cudnn"


def test_attention_is_not_part_of_the_trajectory():
    """A checkpoint resumes under another attention implementation (same function)."""
    a = config_lib.base_config()
    b = config_lib.base_config()
    b.model.attention, b.model.attention_chunk = "chunked", 64
    assert run_lib.trajectory_config(a) == run_lib.trajectory_config(b)
    b.model.d_model = 256
    assert run_lib.trajectory_config(a) != run_lib.trajectory_config(b)
