"""DDP and B-SDP train steps: invariants 1, 2, 4, 6 of docs/design.md on a tiny LLaMA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax.options import StepOptions
from sdp_jax.costs import program as costs
from sdp_jax.models import llama
from sdp_jax.models.llama import LlamaConfig, next_token_loss
from sdp_jax.train import families
from sdp_jax.train import optimizer as optim_lib

W = 4
CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48,
                  max_seq_len=16)
OPT = optim_lib.OptimConfig(lr=1e-2, warmup_steps=1)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((W,), ("data",), devices=jax.devices()[:W])


@pytest.fixture(scope="module")
def batches(mesh):
    rng = np.random.default_rng(0)
    sh = NamedSharding(mesh, P("data"))
    return [jax.device_put(jnp.asarray(rng.integers(0, 64, (2 * W, 13)), jnp.int32), sh)
            for _ in range(3)]


def builder(mesh, variant, coverage, method="auto", scheme="cyclic", optim=OPT, cfg=CFG,
            allow_disconnected=False, clip=1.0, **kw):
    plan = llama.make_plan(variant, cfg, W, coverage, scheme, 0,
                        allow_disconnected=allow_disconnected)
    options = StepOptions(total_steps=10, method=method, grad_clip=clip, **kw)
    return families.language_model_step(cfg, plan, optim, mesh, options)


def graph(cfg=CFG):
    return families.LanguageModel(cfg).graphdef


def run(b, batches):
    state = b.init_state(seed=0)
    losses = []
    for i, x in enumerate(batches):
        state, m = b.train_step_fn(b.is_sync_step(i + 1))(state, x)
        losses.append(float(m["train_loss"]))
    return state, losses


def leaves_close(a, b, **kw):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def test_ddp_gradient_is_single_device_gradient_of_global_batch(mesh, batches):
    b = builder(mesh, "ddp", 1.0)
    state = b.init_state(seed=0)
    loss, grads = b.grads_fn()(state["params"], batches[0])
    full = b.full_params(state["params"])
    x = np.asarray(batches[0])

    def single(p):
        model = nnx.merge(graph(), p)
        return next_token_loss(model(x[:, :-1]), x[:, 1:])

    ref_loss, ref = jax.value_and_grad(single)(full)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got = b.full_params(grads)  # first holder's copy; all copies agree
    # not W times too large (double counting) and not 1/W: equal to the global-batch gradient
    leaves_close(got, ref, rtol=2e-4, atol=1e-7)


def test_bsdp_at_full_coverage_matches_ddp_after_three_steps(mesh, batches):
    s_ddp, l_ddp = run(builder(mesh, "ddp", 1.0), batches)
    for method in ("reference", "alltoall"):  # the masked psum, and the holder all_to_all
        b = builder(mesh, "b-sdp", 1.0, method=method, scheme="random")
        s, losses = run(b, batches)
        np.testing.assert_allclose(losses, l_ddp, rtol=1e-6)
        leaves_close(s["params"], s_ddp["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_bsdp_holders_agree_and_paths_match(mesh, batches):
    b = builder(mesh, "b-sdp", 0.5)
    s, losses = run(b, batches)
    assert np.all(np.isfinite(losses))
    held = b.spec.kinds["block"].held
    for leaf in jax.tree.leaves(s["params"]["blocks"]):
        arr = np.asarray(leaf)
        assert arr.shape[:2] == (W, 2)  # compact: 2 of 4 blocks per worker
        for g in range(CFG.n_layers):
            copies = [arr[w, list(held[w]).index(g)] for w in range(W) if g in held[w]]
            assert len(copies) == 2
            np.testing.assert_array_equal(copies[0], copies[1])  # holders stay identical
    s_ref, l_ref = run(builder(mesh, "b-sdp", 0.5, method="reference"), batches)
    np.testing.assert_allclose(losses, l_ref, rtol=1e-6)
    leaves_close(s["params"], s_ref["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_bsdp_block_gradient_is_mean_over_holders(mesh, batches):
    """Averaged gradient of block g = mean of the holders' local subnetwork gradients."""
    b = builder(mesh, "b-sdp", 0.5)
    state = b.init_state(seed=0)
    _, grads = b.grads_fn()(state["params"], batches[0])
    full = b.full_params(state["params"])
    x = np.asarray(batches[0]).reshape(W, 2, -1)
    bt = b.spec.kinds["block"]
    local = []
    for w in range(W):
        sub = dict(full, blocks=jax.tree.map(lambda a: a[bt.held[w]], full["blocks"]))

        def loss(p, xs=x[w]):
            return next_token_loss(nnx.merge(graph(), p)(xs[:, :-1]), xs[:, 1:])
        local.append(jax.grad(loss)(sub))
    g0 = np.asarray(grads["blocks"]["mlp"]["w_up"])
    for g in range(CFG.n_layers):
        holders = [w for w in range(W) if bt.masks[0][w, g]]
        ref = np.mean([np.asarray(local[w]["blocks"]["mlp"]["w_up"])[list(bt.held[w]).index(g)]
                       for w in holders], axis=0)
        for w in holders:
            np.testing.assert_allclose(g0[w, bt.slot[w, g]], ref, rtol=2e-4, atol=1e-8)
    emb = np.mean([np.asarray(local[w]["embed"]) for w in range(W)], axis=0)
    np.testing.assert_allclose(np.asarray(grads["embed"]), emb, rtol=2e-4, atol=1e-8)


@pytest.mark.slow
def test_clipping_is_identical_on_all_holders(mesh, batches):
    """With a tiny clip threshold, clipping by per-worker norms would desynchronize holders."""
    b = builder(mesh, "b-sdp", 0.5, clip=1e-3)
    s, _ = run(b, batches)
    arr = np.asarray(s["params"]["blocks"]["attn"]["wq"])
    bt = b.spec.kinds["block"]
    for g in range(CFG.n_layers):
        ws = [w for w in range(W) if bt.masks[0][w, g]]
        np.testing.assert_array_equal(arr[ws[0], bt.slot[ws[0], g]],
                                      arr[ws[1], bt.slot[ws[1], g]])


def test_forward_masking_really_prunes(mesh):
    rows = {}
    for v, c in (("ddp", 1.0), ("b-sdp", 0.5)):
        compiled = builder(mesh, v, c).compiled_train_step(
            jax.ShapeDtypeStruct((W * 2, 13), jnp.int32))
        rows[v] = costs.memory_stats(compiled)
    # state (params + AdamW moments) is compact: blocks are half, always-kept are not
    assert rows["b-sdp"]["argument_bytes"] < 0.8 * rows["ddp"]["argument_bytes"]
    assert rows["b-sdp"]["peak_bytes_per_device"] < rows["ddp"]["peak_bytes_per_device"]


def test_full_model_eval_streams_blocks_from_holders(mesh, batches):
    b = builder(mesh, "b-sdp", 0.5)
    s, _ = run(b, batches)
    got = float(b.eval_step_fn()(s["params"], batches[0]))
    full = b.full_params(s["params"])
    x = np.asarray(batches[0])
    ref = float(next_token_loss(nnx.merge(graph(), full)(x[:, :-1]), x[:, 1:]))
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_unknown_variant_and_bad_coverage():
    with pytest.raises(ValueError, match="unknown variant 'x-sdp'"):
        llama.make_plan("x-sdp", CFG, W, 0.5)
    with pytest.raises(ValueError, match="nearest valid coverages"):
        llama.make_plan("b-sdp", CFG, W, 0.3)
    # 2 key/value groups cannot be split in thirds: the error names the component kind
    with pytest.raises(ValueError, match="n-sdp masks 2 key/value head groups per block"):
        llama.make_plan("n-sdp", CFG, 3, 1 / 3)


# ------------------------------------------------------------------ issue 3: all variants

@pytest.mark.slow
@pytest.mark.parametrize("variant", ["b-sdp", "n-sdp", "bb-sdp", "nb-sdp"])
def test_every_variant_at_full_coverage_matches_ddp(mesh, batches, variant):
    s_ddp, l_ddp = run(builder(mesh, "ddp", 1.0), batches)
    b = builder(mesh, variant, 1.0)
    s, losses = run(b, batches)
    np.testing.assert_allclose(losses, l_ddp, rtol=1e-6)
    ref = builder(mesh, "ddp", 1.0).full_params(s_ddp["params"])
    leaves_close(b.full_params(s["params"]), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["bb-sdp", "nb-sdp"])
def test_backward_masking_is_unbiased(mesh, variant):
    """Same batch on every worker: the holder-averaged compact gradient is the full gradient."""
    rng = np.random.default_rng(5)
    one = rng.integers(0, 64, (2, 13))
    same = jax.device_put(jnp.asarray(np.tile(one, (W, 1)), jnp.int32),
                          NamedSharding(mesh, P("data")))
    b = builder(mesh, variant, 0.5)
    state = b.init_state(seed=0)
    _, grads = b.grads_fn()(state["params"], same)
    full = b.full_params(state["params"])

    def single(p):
        return next_token_loss(nnx.merge(graph(), p)(one[:, :-1]), one[:, 1:])
    ref = jax.tree.map(np.asarray, jax.grad(single)(full))
    leaves_close(b.full_params(grads, optimizer_layout=True), ref, rtol=2e-4, atol=1e-7)
    # backward masking keeps the full model on every worker: params are replicated, and the
    # optimizer updates 1/W of every leaf on each device (layout S)
    assert b.param_layout[("blocks", "mlp", "w_up")] == "R"
    assert b.compact_layout[("blocks", "mlp", "w_up")] == "S"


@pytest.mark.slow
def test_nsdp_component_held_by_one_worker_is_updated_from_that_worker_alone(mesh, batches):
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=48,
                      max_seq_len=16)
    # every neuron and head held by exactly one worker (a disconnected mask graph, on purpose)
    b = builder(mesh, "n-sdp", 0.25, cfg=cfg, allow_disconnected=True)
    assert b.spec.kinds["mlp"].counts.max() == 1 and b.spec.kinds["heads"].counts.max() == 1
    state = b.init_state(seed=0)
    _, grads = b.grads_fn()(state["params"], batches[0])
    x = np.asarray(batches[0]).reshape(W, 2, -1)
    params = jax.tree.map(np.asarray, state["params"])
    for w in range(W):
        mine = jax.tree_util.tree_map_with_path(
            lambda p, a: a[w] if b.param_layout[tuple(k.key for k in p)] != "R" else a, params)

        def loss(p, xs=x[w]):
            return next_token_loss(nnx.merge(graph(cfg), p)(xs[:, :-1]), xs[:, 1:])
        own = jax.grad(loss)(mine)
        for path in (("mlp", "w_gate"), ("mlp", "w_down"), ("attn", "wq"), ("attn", "wo")):
            got = np.asarray(grads["blocks"][path[0]][path[1]])[w]
            np.testing.assert_allclose(got, np.asarray(own["blocks"][path[0]][path[1]]),
                                       rtol=2e-4, atol=1e-8)
    # and compact matrices really are narrower: a quarter of the heads and neurons
    assert params["blocks"]["mlp"]["w_up"].shape == (W, 2, 32, 12)
    assert params["blocks"]["attn"]["wq"].shape == (W, 2, 32, 1, 8)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ddp", "b-sdp", "n-sdp"])
def test_periodic_averaging_h1_sgd_equals_gradient_averaging(mesh, batches, variant):
    sgd = optim_lib.OptimConfig(name="sgd", lr=0.5, warmup_steps=0, weight_decay=0.0)
    s_g, l_g = run(builder(mesh, variant, 0.5, optim=sgd, clip=0.0), batches)
    b = builder(mesh, variant, 0.5, optim=sgd, clip=0.0, average="parameters", sync_every=1)
    s_p, l_p = run(b, batches)
    np.testing.assert_allclose(l_p, l_g, rtol=1e-5)
    ref = builder(mesh, variant, 0.5, optim=sgd, clip=0.0)
    leaves_close(b.full_params(s_p["params"]), ref.full_params(s_g["params"]),
                 rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_periodic_averaging_h2_lets_workers_drift_then_agree(mesh, batches):
    b = builder(mesh, "b-sdp", 0.5, average="parameters", sync_every=2)
    state = b.init_state(seed=0)
    for i, x in enumerate(batches + batches[:1]):  # lr is 0 at step 1 (warm-up), so use 4
        state, _ = b.train_step_fn(b.is_sync_step(i + 1))(state, x)
        emb = np.asarray(state["params"]["embed"])
        assert emb.shape[0] == W  # per-worker copies of always-kept parameters
        spread = np.abs(emb - emb[0]).max()
        if i == 2:
            assert spread > 0  # step 3 is a local step: workers drift apart
        if i in (1, 3):
            assert spread == 0  # steps 2 and 4 end with averaging: copies agree


def test_backward_variants_refuse_periodic_averaging(mesh):
    with pytest.raises(ValueError, match="not available for bb-sdp"):
        builder(mesh, "bb-sdp", 0.5, average="parameters", sync_every=2)


@pytest.mark.slow
def test_nsdp_holders_of_each_neuron_and_head_agree(mesh, batches):
    b = builder(mesh, "n-sdp", 0.5, clip=1e-3, scheme="random")  # clipping active
    s, _ = run(b, batches)
    lay = b.layout
    neurons = {p: lf for p, lf in lay.leaves.items() if lf.form == "neuron"}
    assert len(neurons) == 7
    for path, lf in neurons.items():
        idx, axis = lay.indices(lf), lf.rule.axis
        arr = np.moveaxis(np.asarray(s["params"][path[0]][path[1]][path[2]]), axis + 1, 2)
        for layer in range(idx.shape[1]):
            seen = {}
            for w in range(W):
                for j, i in enumerate(idx[w, layer]):
                    v = arr[w, layer, j]
                    if i in seen:
                        np.testing.assert_array_equal(v, seen[i])  # bit-identical copies
                    seen[i] = v
            assert len(seen) == b.spec.shapes[path][axis]  # every index held by someone


@pytest.mark.slow
@pytest.mark.parametrize("variant,coverage,remat", [("ddp", 1.0, "none"), ("n-sdp", 0.5, "full"),
                                                    ("b-sdp", 0.5, "none"),
                                                    ("b-sdp", 0.5, "full"),
                                                    ("nb-sdp", 0.5, "none"),
                                                    ("nb-sdp", 0.5, "full"),
                                                    ("bb-sdp", 0.5, "none")])
def test_averaging_inside_the_backward_loop_equals_averaging_after_it(mesh, batches, variant,
                                                                      coverage, remat):
    """Issue 14, item 2: block gradients averaged inside the backward scan (DDP's all-reduce,
    N-SDP's per-layer holder all_to_alls, B-SDP's leg to the owners, Nb-SDP's per-layer leg to
    the owners' shards) give the parameters of the full-size masked psum after the backward
    pass (method='reference'; under backward masking its reduce-scatter)."""
    b = builder(mesh, variant, coverage, remat=remat)
    loop = b.in_loop_tables
    assert (variant == "bb-sdp") != bool(loop) and all(p[0] == "blocks" for p in loop)
    kinds = {("grouped" if t.grouped else "owners") if t is not None else "mean"
             for t in loop.values()}
    assert kinds == {"ddp": {"mean"}, "n-sdp": {"grouped"}, "nb-sdp": {"grouped"},
                     "b-sdp": {"owners"}, "bb-sdp": set()}[variant], kinds   # (bb: after it)
    ref = builder(mesh, variant, coverage, method="reference", remat=remat)
    assert not ref.in_loop_tables
    s, losses = run(b, batches)
    s_ref, l_ref = run(ref, batches)
    np.testing.assert_allclose(losses, l_ref, rtol=1e-6)
    leaves_close(s["params"], s_ref["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_averaging_bytes_move_inside_the_backward_loop(mesh):
    """The compiled step issues DDP's and N-SDP's block averaging inside the backward loop, and
    B-SDP's first all_to_all leg (half of its block bytes), Nb-SDP's leg to the owners' shards
    (the all-gather of the new parameters follows the update); the reference psum runs
    after."""
    from sdp_jax.costs import comm
    batch = jax.ShapeDtypeStruct((2 * W, 17), jnp.int32)
    share = {}
    for variant, coverage, method in (("ddp", 1.0, "auto"), ("n-sdp", 0.5, "auto"),
                                      ("b-sdp", 0.5, "auto"), ("b-sdp", 0.5, "reference"),
                                      ("nb-sdp", 0.5, "auto")):
        text = builder(mesh, variant, coverage, method=method).compiled_train_step(batch).as_text()
        t = comm.comm_bytes_per_device(text, W)
        share[variant, method] = t["in_backward_loop"] / t["total"]
    assert share["ddp", "auto"] > 0.85, share      # all but the embedding and head
    assert share["n-sdp", "auto"] > 0.7, share     # and the norms (replicated, after)
    assert 0.3 < share["b-sdp", "auto"] < 0.6, share
    assert share["b-sdp", "reference"] == 0.0, share
    assert 0.15 < share["nb-sdp", "auto"] < 0.5, share   # C / (1 + C) of the blocks' bytes


def test_averaging_stays_after_the_loop_where_the_loop_cannot_hold_it(mesh):
    """FSDP (its own reduce-scatter), periodic parameter averaging, block-level backward
    masking (at loop step i only block i's holders have its gradient) and the reference psum
    keep the averaging after the backward pass."""
    assert not builder(mesh, "ddp", 1.0, fsdp=True).in_loop_tables
    assert not builder(mesh, "b-sdp", 0.5, average="parameters", sync_every=2).in_loop_tables
    assert not builder(mesh, "bb-sdp", 0.5).in_loop_tables
    assert not builder(mesh, "nb-sdp", 0.5, method="reference").in_loop_tables
    assert not builder(mesh, "n-sdp", 0.5, method="reference").in_loop_tables



@pytest.mark.slow
def test_gradient_alignment_of_the_block_runner_checked_by_hand(mesh, batches):
    """SDPStep.alignment_fn on the LLaMA (the block runner's path) against plain jax.grad:
    B-SDP at C = 1/2, each worker's subnetwork of 2 blocks against the full model on its rows,
    and the holders' mean against DDP's mean gradient."""
    b = builder(mesh, "b-sdp", 0.5)
    state = b.init_state(seed=0)
    got = {k: float(v) for k, v in b.alignment_fn()(state, batches[0]).items()}
    full = b.full_params(state["params"])
    x = np.asarray(batches[0]).reshape(W, 2, -1)
    held = b.spec.kinds["block"].held

    def loss(p, xs):
        return next_token_loss(nnx.merge(graph(), p)(xs[:, :-1]), xs[:, 1:])

    def flat(t):
        return np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(t)])

    def cos(a, c):
        a, c = flat(a), flat(c)
        return float(a @ c / np.sqrt((a @ a) * (c @ c)))
    grad = jax.jit(jax.grad(loss))  # one compile per shape (full, 2-block subnetwork)
    subs, fulls, cosines = [], [], []
    for w in range(W):
        pick = lambda t, w=w: dict(t, blocks=jax.tree.map(lambda a: a[held[w]], t["blocks"]))  # noqa: E731
        g_full = grad(full, x[w])
        g_sub = grad(pick(full), x[w])
        cosines.append(cos(g_sub, pick(g_full)))
        subs.append(g_sub)
        fulls.append(g_full)
    mean = {k: jax.tree.map(lambda *a: np.mean(a, 0), *[s[k] for s in subs])
            for k in full if k != "blocks"}
    mean["blocks"] = jax.tree.map(np.zeros_like, full["blocks"])
    for g in range(CFG.n_layers):
        mine = [jax.tree.map(lambda a, w=w: a[list(held[w]).index(g)], subs[w]["blocks"])
                for w in range(W) if g in held[w]]
        avg = jax.tree.map(lambda *a: np.mean(a, 0), *mine)
        mean["blocks"] = jax.tree.map(lambda m, a, g=g: np.concatenate([m[:g], a[None],
                                                                        m[g + 1:]]),
                                      mean["blocks"], avg)
    ddp = jax.tree.map(lambda *a: np.mean(a, 0), *fulls)
    np.testing.assert_allclose([got["grad_alignment"], got["update_alignment"]],
                               [np.mean(cosines), cos(mean, ddp)], rtol=0, atol=3e-5)
    assert got["grad_alignment"] < 0.999 and got["update_alignment"] < 0.999
    ddp_b = builder(mesh, "ddp", 1.0)
    one = {k: float(v) for k, v in ddp_b.alignment_fn()(ddp_b.init_state(seed=0),
                                                         batches[0]).items()}
    assert min(one.values()) > 1 - 1e-5
