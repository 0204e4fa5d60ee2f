"""DDP and B-SDP train steps: invariants 1, 2, 4, 6 of DESIGN.md on a tiny LLaMA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax import train_step as ts
from sdp_jax.models.llama import LlamaConfig, next_token_loss

W = 4
CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48,
                  max_seq_len=16)
OPT = ts.OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=1.0)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((W,), ("data",), devices=jax.devices()[:W])


@pytest.fixture(scope="module")
def batches(mesh):
    rng = np.random.default_rng(0)
    sh = NamedSharding(mesh, P("data"))
    return [jax.device_put(jnp.asarray(rng.integers(0, 64, (2 * W, 13)), jnp.int32), sh)
            for _ in range(3)]


def builder(mesh, variant, coverage, averaging="auto", scheme="cyclic", optim=OPT):
    rec = ts.make_mask(variant, W, CFG.n_layers, coverage, scheme, 0)
    return ts.StepBuilder(CFG, rec, optim, mesh, total_steps=10, averaging=averaging)


def run(b, batches):
    state = b.init_state(seed=0)
    step = b.train_step_fn()
    losses = []
    for x in batches:
        state, m = step(state, x)
        losses.append(float(m["train_loss"]))
    return state, losses


def leaves_close(a, b, **kw):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def test_ddp_gradient_is_single_device_gradient_of_global_batch(mesh, batches):
    b = builder(mesh, "ddp", 1.0)
    state = b.init_state(seed=0)
    loss, grads = b.grads_fn()(state["params"], batches[0])
    full = jax.tree.map(np.asarray, b.full_params(state["params"]))
    x = np.asarray(batches[0])

    def single(p):
        model = nnx.merge(b.graphdef, p)
        return next_token_loss(model(x[:, :-1]), x[:, 1:])

    ref_loss, ref = jax.value_and_grad(single)(full)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got = b.full_params(grads)  # worker 0's copy; all copies agree
    # not W times too large (double counting) and not 1/W: equal to the global-batch gradient
    leaves_close(got, ref, rtol=2e-4, atol=1e-7)


def test_bsdp_at_full_coverage_matches_ddp_after_three_steps(mesh, batches):
    s_ddp, l_ddp = run(builder(mesh, "ddp", 1.0), batches)
    for averaging in ("blockwise", "reference"):  # the general masked-mean paths, not pmean
        b = builder(mesh, "b-sdp", 1.0, averaging=averaging, scheme="random")
        s, losses = run(b, batches)
        np.testing.assert_allclose(losses, l_ddp, rtol=1e-6)
        leaves_close(s["params"], s_ddp["params"], rtol=1e-5, atol=1e-7)


def test_bsdp_holders_agree_and_paths_match(mesh, batches):
    b = builder(mesh, "b-sdp", 0.5)
    s, losses = run(b, batches)
    assert np.all(np.isfinite(losses))
    held = b.tables.held
    for leaf in jax.tree.leaves(s["params"]["blocks"]):
        arr = np.asarray(leaf)
        assert arr.shape[:2] == (W, 2)  # compact: 2 of 4 blocks per worker
        for g in range(CFG.n_layers):
            copies = [arr[w, list(held[w]).index(g)] for w in range(W) if g in held[w]]
            assert len(copies) == 2
            np.testing.assert_array_equal(copies[0], copies[1])  # holders stay identical
    s_ref, l_ref = run(builder(mesh, "b-sdp", 0.5, averaging="reference"), batches)
    np.testing.assert_allclose(losses, l_ref, rtol=1e-6)
    leaves_close(s["params"], s_ref["params"], rtol=1e-5, atol=1e-7)


def test_bsdp_block_gradient_is_mean_over_holders(mesh, batches):
    """Averaged gradient of block g = mean of the holders' local subnetwork gradients."""
    b = builder(mesh, "b-sdp", 0.5)
    state = b.init_state(seed=0)
    _, grads = b.grads_fn()(state["params"], batches[0])
    full = jax.tree.map(np.asarray, b.full_params(state["params"]))
    x = np.asarray(batches[0]).reshape(W, 2, -1)
    local = []
    for w in range(W):
        sub = dict(full, blocks=jax.tree.map(lambda a: a[b.tables.held[w]], full["blocks"]))

        def loss(p, xs=x[w]):
            return next_token_loss(nnx.merge(b.graphdef, p)(xs[:, :-1]), xs[:, 1:])
        local.append(jax.grad(loss)(sub))
    g0 = np.asarray(grads["blocks"]["mlp"]["w_up"])
    for g in range(CFG.n_layers):
        holders = [w for w in range(W) if b.mask[w, g]]
        ref = np.mean([np.asarray(local[w]["blocks"]["mlp"]["w_up"])[list(b.tables.held[w]).index(g)]
                       for w in holders], axis=0)
        for w in holders:
            np.testing.assert_allclose(g0[w, b.tables.slot[w, g]], ref, rtol=2e-4, atol=1e-8)
    emb = np.mean([np.asarray(local[w]["embed"]) for w in range(W)], axis=0)
    np.testing.assert_allclose(np.asarray(grads["embed"]), emb, rtol=2e-4, atol=1e-8)


def test_clipping_is_identical_on_all_holders(mesh, batches):
    """With a tiny clip threshold, clipping by per-worker norms would desynchronize holders."""
    opt = ts.OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=1e-3)
    b = builder(mesh, "b-sdp", 0.5, optim=opt)
    s, _ = run(b, batches)
    arr = np.asarray(s["params"]["blocks"]["attn"]["wq"])
    for g in range(CFG.n_layers):
        ws = [w for w in range(W) if b.mask[w, g]]
        np.testing.assert_array_equal(arr[ws[0], b.tables.slot[ws[0], g]],
                                      arr[ws[1], b.tables.slot[ws[1], g]])


def test_forward_masking_really_prunes(mesh):
    rows = {}
    for v, c in (("ddp", 1.0), ("b-sdp", 0.5)):
        compiled = builder(mesh, v, c).compiled_train_step((W * 2, 13))
        rows[v] = ts.memory_stats(compiled)
    # state (params + AdamW moments) is compact: blocks are half, always-kept are not
    assert rows["b-sdp"]["argument_bytes"] < 0.8 * rows["ddp"]["argument_bytes"]
    assert rows["b-sdp"]["peak_bytes_per_device"] < rows["ddp"]["peak_bytes_per_device"]


def test_full_model_eval_streams_blocks_from_holders(mesh, batches):
    b = builder(mesh, "b-sdp", 0.5)
    s, _ = run(b, batches)
    got = float(b.eval_step_fn()(s["params"], batches[0]))
    full = jax.tree.map(np.asarray, b.full_params(s["params"]))
    x = np.asarray(batches[0])
    ref = float(next_token_loss(nnx.merge(b.graphdef, full)(x[:, :-1]), x[:, 1:]))
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_unknown_variant_and_bad_coverage():
    with pytest.raises(ValueError, match="unknown variant 'n-sdp'"):
        ts.make_mask("n-sdp", W, 4, 0.5, "cyclic", 0)
    with pytest.raises(ValueError, match="nearest valid coverages"):
        ts.make_mask("b-sdp", W, 4, 0.3, "cyclic", 0)
