"""Pipeline axis `stage` with compressed boundaries (MAPL) through the one step: equivalences,
compositions (N-SDP, FSDP, bf16, remat), bytes, orthogonality."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import resume_from_old_layout
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_train_cli import tiny  # the tiny config with dotted overrides

from sdp_jax.options import StepOptions
from sdp_jax.costs import program as costs
from sdp_jax.pipeline import stiefel
from sdp_jax.sync import collectives as sync
from sdp_jax import mesh as mesh_lib
from sdp_jax.pipeline import schedules as pl
from sdp_jax.models import llama
from sdp_jax.models.llama import Llama, LlamaConfig, next_token_loss
from sdp_jax.study import mapl as study
from sdp_jax.train import checkpoint as ckpt_lib
from sdp_jax.train import migrations
from sdp_jax.train import families
from sdp_jax.train import loop
from sdp_jax.train import optimizer as optim_lib
from sdp_jax.train.run import resolve

CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=2, n_kv_heads=2, d_ff=64,
                  max_seq_len=32)
CFG8 = LlamaConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=2, n_kv_heads=2, d_ff=64,
                   max_seq_len=32)   # 4 blocks per stage: C = 1/2 on 4 workers stays connected
T = 16
ADAM = optim_lib.OptimConfig(warmup_steps=0)
# SGD with an active clip threshold for the 3-step equivalences (as tests/test_fsdp.py): the
# clipping factor must come from the norm with every component counted once across the stages.
SGD = optim_lib.OptimConfig(name="sgd", lr=0.5, warmup_steps=1, weight_decay=0.0)
SGD_CLIP = 0.05   # (the other optimizers clip at a run's default, 1)


def _pipe(method="none", stages=2, microbatches=2, ratio=4, anchor_rank=8, rvq_levels=0,
          schedule="gpipe"):
    return pl.PipelineConfig(stages=stages, microbatches=microbatches, method=method,
                             ratio=ratio, anchor_rank=anchor_rank, rvq_levels=rvq_levels,
                             rvq_codebook=16, schedule=schedule)


def _step(method="none", ratio=4, workers=2, stages=2, variant="ddp", coverage=1.0, cfg=CFG,
          anchor_rank=8, microbatches=2, rvq_levels=0, optim=ADAM, schedule="gpipe", **kw):
    pipe = _pipe(method, stages, microbatches, ratio, anchor_rank, rvq_levels, schedule)
    plan = llama.make_plan(variant, cfg, workers, coverage, pipe=pipe)
    clip = SGD_CLIP if optim is SGD else 1.0
    st = families.language_model_step(cfg, plan, optim, mesh_lib.make_mesh(workers, stages),
                                      StepOptions(total_steps=20, grad_clip=clip, **kw), pipe)
    st.cfg, st.pipe = cfg, pipe
    return st


def _tokens(st, batch=4, seed=1):
    W = st.spec.workers
    tok = jax.random.randint(jax.random.key(seed), (W * batch, T + 1), 0, st.cfg.vocab_size)
    return tok, st.put_batch(tok)


def _close(a, b, atol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         atol=atol, rtol=1e-4), a, b)


def reference_loss(cfg, pipe, full, tokens):
    """The oracle: the same model on one device, stage after stage (no schedule, no mesh):
    mean next-token loss of ``tokens`` [B, T + 1] plus the RVQ terms. ``full["blocks"]`` may be
    one worker's subnetwork ``[P * k, ...]`` (k per stage)."""
    task, bd = families.LanguageModel(cfg), pl.Boundary(pipe)
    x, y = tokens[:, :-1], tokens[:, 1:]
    h = task.embed(full, x)
    n = jax.tree.leaves(full["blocks"])[0].shape[0] // pipe.stages
    bnd, aux = full.get("boundary", {}), 0.0
    for s in range(pipe.stages):
        for i in range(s * n, (s + 1) * n):
            h = task.block(jax.tree.map(lambda a, i=i: a[i], full["blocks"]), h)
        if s < pipe.stages - 1:
            c = bd.encode(bnd, s, h, x)
            if pipe.quantized:
                c, _, a = bd.quantize(bnd, s, c)
                aux = aux + a
            h = bd.decode(bnd, s, c, x)
    return task.head(full, h, y) + aux


def _train(st, batches, full=None):
    state = st.init(full) if full is not None else st.init_state(0)
    losses = []
    for x in batches:
        state, m = st.train_step_fn()(state, x)
        losses.append(float(m["train_loss"]))
    return state, losses


def _same_model(s1, st1, s2, st2, **kw):
    f1, f2 = s1.full_params(st1), s2.full_params(st2)
    for x, y in zip(jax.tree.leaves(f1), jax.tree.leaves(f2), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


@pytest.mark.slow
def test_uncompressed_pipeline_equals_unpipelined_model():
    st = _step("none")
    tok, tok_d = _tokens(st)
    model = Llama(CFG, nnx.Rngs(0))  # the same initialization as the step's init_state(0)
    graphdef, state = nnx.split(model, nnx.Param)

    def model_loss(s):
        return next_token_loss(nnx.merge(graphdef, s)(tok[:, :-1]), tok[:, 1:])

    want_loss, g = jax.jit(jax.value_and_grad(model_loss))(state)
    params = st.init_state(0)["params"]
    assert jax.tree.leaves(params["blocks"])[0].shape[:3] == (2, 2, 2)   # [W, P, k, ...]
    loss, grads = st.grads_fn()(params, tok_d)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    _close(st.full_params(grads), nnx.to_pure_dict(g), 1e-6)
    # The full-model evaluation through the pipeline is the same model.
    np.testing.assert_allclose(float(st.eval_step_fn()(params, tok_d)), float(want_loss),
                               rtol=1e-5)


@pytest.mark.slow
def test_pipelined_ddp_equals_unpipelined_ddp_after_3_steps():
    """The staged layout, the per-stage optimizer and the clipping norm summed over the stages
    give the same trajectory as the step without a pipeline."""
    plain = families.language_model_step(CFG, llama.make_plan("ddp", CFG, 2, 1.0), SGD,
                                         jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]),
                                         StepOptions(total_steps=20, grad_clip=SGD_CLIP))
    piped = _step("none", optim=SGD)
    # the schedule runs the blocks once per microbatch: averaging stays after the backward pass
    assert plain.in_loop_tables and not piped.in_loop_tables
    tok = [jax.random.randint(jax.random.key(i), (8, T + 1), 0, 64) for i in range(3)]
    s1, l1 = _train(plain, [plain.put_batch(t) for t in tok])
    s2, l2 = _train(piped, [piped.put_batch(t) for t in tok])
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    _same_model(plain, s1, piped, s2, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_full_width_identity_projector_equals_uncompressed():
    st = _step("fixed", ratio=1)   # r = d
    full = st.model.init_fn(0)
    bnd = dict(full["boundary"])
    bnd["frozen_A"] = jnp.broadcast_to(jnp.eye(CFG.d_model), bnd["frozen_A"].shape)
    bnd["anchor_embed"] = bnd["anchor_embed"] * 50  # anchors far from zero cancel exactly
    full = {**full, "boundary": bnd}
    tok, tok_d = _tokens(st)
    want = float(jax.jit(lambda f, t: reference_loss(CFG, _pipe("none"), f, t))(
        {**full, "boundary": {}}, tok))
    state = st.init(full)
    loss, grads = st.grads_fn()(state["params"], tok_d)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    # `fixed` never moves A: no gradient reaches it, and the optimizer does not update it
    assert float(jnp.abs(grads["boundary"]["frozen_A"]).max()) == 0.0
    a0 = np.asarray(state["params"]["boundary"]["frozen_A"])
    state, _ = st.train_step_fn()(state, tok_d)
    np.testing.assert_array_equal(np.asarray(state["params"]["boundary"]["frozen_A"]), a0)
    # A compressed boundary (r < d) is not the identity: the check above can fail.
    p4 = _pipe("fixed", ratio=4)
    f4 = {**full, "boundary": pl.init_boundary(jax.random.key(0), CFG, p4)}
    assert abs(float(jax.jit(lambda f, t: reference_loss(CFG, p4, f, t))(f4, tok)) - want) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("rvq_levels", [0, 2])
def test_compressed_pipeline_forward_and_gradient_match_single_device(rvq_levels):
    st = _step("mapl", ratio=4, rvq_levels=rvq_levels)
    full = st.model.init_fn(0)
    tok, tok_d = _tokens(st)
    want_loss, want = jax.jit(jax.value_and_grad(
        lambda f, t: reference_loss(CFG, st.pipe, f, t)))(full, tok)
    params = st.init(full)["params"]
    loss, grads = st.grads_fn()(params, tok_d)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    got = st.full_params(grads)
    _close(got, want, 1e-6)
    if rvq_levels:  # codebooks are trained (codebook loss), and only codes travel forward
        lm = float(st.eval_step_fn()(params, tok_d))   # validation: next-token only
        assert 0 < float(loss) - lm < 0.1
        assert float(jnp.abs(got["boundary"]["rvq_codebook"]).max()) > 0
    # every worker's copy of a block carries the same (averaged) gradient
    for leaf in jax.tree.leaves(grads["blocks"]):
        np.testing.assert_allclose(np.asarray(leaf[0]), np.asarray(leaf[1]), atol=1e-7)


@pytest.mark.slow
def test_block_sdp_pipeline_averages_over_holders():
    cfg = CFG8
    st = _step("mapl", ratio=4, workers=4, variant="b-sdp", coverage=0.5, cfg=cfg)
    bt = st.spec.kinds["block"]
    held, Lp = bt.held, st.spec.n_blocks                      # the same masks in every stage
    assert held.shape == (4, 2) and Lp == 4 and list(bt.counts) == [2, 2, 2, 2]
    full = st.model.init_fn(0)
    params = st.init(full)["params"]
    tok, tok_d = _tokens(st)
    _, grads = st.grads_fn()(params, tok_d)
    # Reference: each worker's subnetwork on its own quarter of the batch, on one device; a
    # block's gradient is the mean over its holders, always-kept ones the mean over workers.
    ref_grad = jax.jit(jax.grad(lambda f, t: reference_loss(cfg, st.pipe, f, t)))
    per = [ref_grad({**full, "blocks": jax.tree.map(
        lambda a, w=w: np.asarray(a[w]).reshape((-1,) + a.shape[3:]), params["blocks"])},
        tok[w * 4:(w + 1) * 4]) for w in range(4)]
    np.testing.assert_allclose(np.asarray(grads["embed"]),
                               np.asarray(sum(p["embed"] for p in per) / 4), atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(grads["boundary"]["stiefel_A"]),
        np.asarray(sum(p["boundary"]["stiefel_A"] for p in per) / 4), atol=1e-6)
    wq = np.asarray(grads["blocks"]["attn"]["wq"])             # [W, P, k, ...]
    for s in range(2):
        for b in range(Lp):
            holders = [(w, int(np.flatnonzero(held[w] == b)[0])) for w in range(4)
                       if b in held[w]]
            want_b = sum(np.asarray(per[w]["blocks"]["attn"]["wq"][s * 2 + j])
                         for w, j in holders) / len(holders)
            for w, j in holders:
                np.testing.assert_allclose(wq[w, s, j], want_b, atol=1e-6)


# The compositions that the pipeline builder refused before the one step (issue 12): each at
# C = 1 equals DDP, and each with FSDP equals it without FSDP, after 3 steps.
def _batches(st, n=3, b=2):
    return [st.put_batch(jax.random.randint(jax.random.key(10 + i), (st.spec.workers * b, T + 1),
                                            0, 64)) for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["n-sdp", "nb-sdp"])
def test_pipeline_neuron_sdp_at_full_coverage_equals_ddp(variant):
    ddp = _step("mapl", variant="ddp", optim=SGD)
    nsdp = _step("mapl", variant=variant, coverage=1.0, optim=SGD)
    assert "mlp" in nsdp.spec.kinds and "heads" in nsdp.spec.kinds
    s1, l1 = _train(ddp, _batches(ddp))
    s2, l2 = _train(nsdp, _batches(nsdp))
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    _same_model(ddp, s1, nsdp, s2, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["n-sdp", "b-sdp", "bb-sdp"])
def test_pipeline_with_fsdp_equals_it_without_fsdp(variant):
    kw = dict(variant=variant, coverage=0.5, workers=4, optim=SGD, cfg=CFG8)
    plain, sharded = _step("none", **kw), _step("none", fsdp=True, **kw)
    assert sharded.per_device_param_count() < plain.per_device_param_count()
    s1, l1 = _train(plain, _batches(plain))
    s2, l2 = _train(sharded, _batches(sharded))
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    _same_model(plain, s1, sharded, s2, rtol=1e-4, atol=1e-6)
    x = _batches(plain, 1)[0]
    np.testing.assert_allclose(float(sharded.eval_step_fn()(s2["params"], x)),
                               float(plain.eval_step_fn()(s1["params"], x)), rtol=1e-5)


@pytest.mark.slow
def test_pipeline_bf16_remat_full_coverage_equals_ddp_and_fsdp_equals_plain():
    kw = dict(optim=SGD, dtype="bfloat16", remat="full")
    ddp = _step("none", variant="ddp", **kw)
    full_b = _step("none", variant="b-sdp", coverage=1.0, **kw)
    s1, l1 = _train(ddp, _batches(ddp))
    s2, l2 = _train(full_b, _batches(full_b))
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    _same_model(ddp, s1, full_b, s2, rtol=1e-6, atol=1e-7)
    # the program sends the payload (and its gradient) across the boundary in bf16 (XLA:CPU
    # widens bf16 collectives to float32 when it compiles them, measured: so read the program)
    tok = jax.ShapeDtypeStruct((4, T + 1), jnp.int32, sharding=ddp.batch_sharding())
    text = ddp.train_step_fn().lower(ddp.abstract_state(), tok).as_text()
    permutes = [ln for ln in text.splitlines() if "collective_permute" in ln]
    assert len(permutes) == 2 and all("x32xbf16>" in ln for ln in permutes)
    for leaf in jax.tree.leaves(s1["params"]) + jax.tree.leaves(s1["opt_state"]):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32   # float32 master state
    kw.update(variant="b-sdp", coverage=0.5, workers=4, cfg=CFG8)
    plain, sharded = _step("none", **kw), _step("none", fsdp=True, **kw)
    s1, l1 = _train(plain, _batches(plain))
    s2, l2 = _train(sharded, _batches(sharded))
    np.testing.assert_allclose(l2, l1, rtol=1e-2)
    _same_model(plain, s1, sharded, s2, rtol=2e-2, atol=2e-3)


# 1F1B (issue 14 item 6): the same gradients as GPipe through every composition of the step, in
# less memory. 4 microbatches of 1 example: every stage runs warm-up, steady state and drain.
@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(method="mapl", rvq_levels=2, stages=4),   # 3 boundaries: token ids, RVQ codes
    dict(variant="bb-sdp", coverage=0.5, workers=4, cfg=CFG8),   # frozen copy closed over
    dict(variant="n-sdp", coverage=0.5, workers=4, cfg=CFG8, fsdp=True, dtype="bfloat16",
         remat="full"),                                          # FSDP shards closed over
], ids=["mapl-rvq-4-stages", "bb-sdp", "n-sdp-fsdp-bf16-remat"])
def test_1f1b_equals_gpipe_after_3_steps(kw):
    bf16 = kw.get("dtype") == "bfloat16"
    gp = _step(**kw, microbatches=4, optim=SGD)
    ob = _step(**kw, microbatches=4, optim=SGD, schedule="1f1b")
    s1, l1 = _train(gp, _batches(gp, b=4))
    s2, l2 = _train(ob, _batches(ob, b=4))
    assert np.all(np.isfinite(l2)) and l1[0] != l1[-1]
    np.testing.assert_allclose(l2, l1, rtol=2e-3 if bf16 else 1e-5)
    _same_model(gp, s1, ob, s2, rtol=2e-2 if bf16 else 1e-4, atol=2e-3 if bf16 else 1e-6)
    if kw.get("rvq_levels"):   # evaluation is GPipe's forward program under either schedule
        x = _batches(gp, 1, b=4)[0]
        np.testing.assert_allclose(float(ob.eval_step_fn()(s2["params"], x)),
                                   float(gp.eval_step_fn()(s2["params"], x)), rtol=1e-6)


@pytest.mark.parametrize("vary", [(), ("data",), ("stage",), ("data", "stage")])
def test_1f1b_counts_a_weight_shared_by_devices_once(vary):
    """A value the stage's blocks close over may be the same on every device of an axis (its
    gradient is then summed over that axis inside the schedule): Pipeline.loss called directly,
    the weight's gradient under 1F1B equals GPipe's for each of the four variances."""
    Wn, Pn, d, V = 2, 2, 8, 16
    mesh = mesh_lib.make_mesh(Wn, Pn)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    kept = {"emb": jax.random.normal(k1, (V, d)), "out": jax.random.normal(k2, (d, V))}
    w = jax.random.normal(k3, (Pn, d, d)) / 3
    tok = jax.random.randint(jax.random.key(5), (Wn * 4, 5), 0, V)

    def head(k, h, y):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h @ k["out"]), y[..., None], -1))

    def grad_of(schedule):
        pp = pl.Pipeline(pl.PipelineConfig(stages=Pn, microbatches=2, schedule=schedule), d, V,
                         lambda k, x: k["emb"][x], head)

        def f(kept, w, tok):
            w = w[0] if "stage" in vary else w[0] + w[1] * 0   # stage-sharded or the same
            w = jax.lax.pcast(w, ("data",), to="varying") if "data" in vary else w

            def loss(kept, w):
                run = lambda h: jnp.tanh(h @ w)   # noqa: E731
                run.train = True
                return pp.loss(jax.tree.map(lambda x: jax.lax.pcast(x, ("data",),
                                                                    to="varying"), kept),
                               tok, run)[0]
            g = jax.grad(loss, argnums=(0, 1))(kept, w)[1]   # as the step: kept too
            missing = tuple(a for a in ("data", "stage") if a not in sync.varying_axes(g))
            return jax.lax.pcast(g, missing, to="varying")[None] if missing else g[None]
        sm = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("stage") if "stage" in vary else P(),
                                                   P("data")), out_specs=P(("data", "stage")))
        return np.asarray(jax.jit(sm)(kept, w if "stage" in vary else w[:1].repeat(Pn, 0), tok))
    np.testing.assert_allclose(grad_of("1f1b"), grad_of("gpipe"), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_1f1b_peak_below_gpipe_with_2_stages_and_8_microbatches():
    """GPipe keeps the residuals of all M + P - 1 ticks for its backward pass; 1F1B those of at
    most 2P - 1 microbatches (measured: 0.56x here)."""
    peak = {}
    for sched in ("gpipe", "1f1b"):
        st = _step(microbatches=8, schedule=sched)
        tok = jax.ShapeDtypeStruct((st.spec.workers * 16, T + 1), jnp.int32)
        peak[sched] = costs.memory_stats(st.compiled_train_step(tok))["peak_bytes_per_device"]
    assert peak["1f1b"] < 0.65 * peak["gpipe"]


@pytest.mark.slow
def test_pipeline_parameter_averaging_trains():
    st = _step("unconstrained", variant="b-sdp", coverage=0.5, workers=4, cfg=CFG8,
               optim=optim_lib.OptimConfig(lr=1e-2, warmup_steps=0), average="parameters",
               sync_every=2)
    x = _batches(st, 1)[0]
    state = st.init_state(0)
    losses = []
    for i in range(6):
        state, m = st.train_step_fn(sync_now=st.is_sync_step(i + 1))(state, x)
        losses.append(float(m["train_loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1
    emb = np.asarray(state["params"]["embed"])     # per-worker copies [W, V, d], averaged
    np.testing.assert_allclose(emb[0], emb[3], atol=1e-6)


@pytest.mark.slow
def test_boundary_bytes_of_compiled_step():
    cfg = LlamaConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, n_kv_heads=2,
                      d_ff=64, max_seq_len=32)
    out = {}
    for method, rvq in (("none", 0), ("mapl", 0), ("rvq", 2)):
        st = _step("mapl" if rvq else method, ratio=4, cfg=cfg, rvq_levels=rvq)
        c = st.compiled_train_step(jax.ShapeDtypeStruct((2 * 4, T + 1), jnp.int32))
        out[method] = pl.boundary_bytes(c, tokens_per_worker=4 * T, stages=2,
                                        codebook_bytes=pl.codebook_sync_bytes(cfg, st.pipe))
    ticks = (2 + 2 - 1) / 2   # (M + P - 1) / M transfers per microbatch
    # uncompressed: d float32 forward and d float32 gradients back per token
    assert out["none"]["per_token"] == pytest.approx(2 * 64 * 4 * ticks)
    # 4x: r = 16 floats each way plus a one-byte token id (vocab 256)
    assert out["mapl"]["per_token"] == pytest.approx((2 * 16 * 4 + 1) * ticks)
    assert out["mapl"]["per_token"] <= 0.26 * out["none"]["per_token"]
    # RVQ, 2 levels of 16 codes: two one-byte codes and the token id forward, r floats back,
    # plus the codebooks (2 x 16 x 16 float32) sent once per step
    assert out["rvq"]["codebook_per_step"] == 2 * 16 * 16 * 4
    assert out["rvq"]["per_token"] == pytest.approx((2 + 1 + 16 * 4) * ticks + 2048 / (4 * T))


@pytest.mark.slow
def test_projectors_orthogonality_by_method():
    errs = {}
    for method in ("mapl", "unconstrained"):
        st = _step(method, ratio=4)
        state = st.init_state(0)
        key = pl.projector_key(method)
        a0 = np.asarray(state["params"]["boundary"][key])
        for i in range(4):
            state, m = st.train_step_fn()(state, _tokens(st, seed=i)[1])
            float(m["train_loss"])
        errs[method] = float(m["ortho_err"])
        a = np.asarray(state["params"]["boundary"][key])
        assert np.abs(a - a0).max() > 1e-4   # it was trained
        assert errs[method] == pytest.approx(float(stiefel.orthogonality_error(a)), abs=1e-7)
    assert errs["mapl"] < 1e-5
    assert errs["unconstrained"] > 1e-3   # AdamW leaves the manifold


def tiny_pipe(**kw):
    return tiny(**{"pipeline.stages": 2, "pipeline.microbatches": 2, "pipeline.method": "mapl",
                   "pipeline.anchor_rank": 8, "workers": 2, **kw})


@pytest.mark.parametrize("override, match", [
    ({"pipeline.ratio": 3}, "pipeline.ratio=3 does not divide model.d_model=32"),
    ({"pipeline.stages": 3}, "pipeline.stages=3 does not divide model.n_layers=4"),
    ({"pipeline.microbatches": 3}, "microbatches=3 does not divide batch_per_worker=2"),
    ({"pipeline.method": "pca"}, "pipeline.method='pca'"),
    ({"pipeline.schedule": "pipedream"}, "use gpipe or 1f1b"),
    ({"pipeline.method": "none", "pipeline.rvq_levels": 2}, "rvq_levels=2 needs a compressed"),
    ({"fsdp": True}, "fsdp=True with pipeline.method='mapl'"),
    ({"sdp.average": "parameters", "sdp.sync_every": 2}, "mean of the workers' orthogonal"),
    ({"workers": 5}, "5 \\* 2 needs 10 devices but only 8 devices are available"),
])
def test_pipeline_config_errors(override, match):
    c = tiny_pipe(**override)
    with pytest.raises(ValueError, match=match):
        resolve(c, jax.device_count())


def test_study_methods_are_the_pipelines():
    assert study.METHODS == pl.METHODS and study.SCHEDULES == pl.SCHEDULES


def test_every_device_is_a_worker_with_several_processes(monkeypatch):
    """The multi-process check is the one of every run (sdp_jax.train.run.resolve_workers), so it
    also covers pipelines: with several processes, workers x stages must use every device (a
    pipelined config launched as 2 processes used to fail only after compiling)."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"workers x pipeline.stages must be the 8 devices \(got 2 x 2 = 4\)"):
        resolve(tiny_pipe(), 8)
    with pytest.raises(ValueError, match="every device is a worker.*got 2 of 8 devices"):
        resolve(tiny(workers=2), 8)
    assert resolve(tiny_pipe(workers=0), 8).workers == 4


@pytest.mark.slow
def test_pipelined_run_end_to_end(tmp_path):
    c = tiny_pipe(steps=4, eval_every=4, checkpoint_every=4)
    s = loop.train(c, str(tmp_path / "run"))
    assert s["completed"] and np.isfinite(s["final_val_loss"])
    assert s["final_ortho_err"] < 1e-5
    assert s["boundary_bytes_per_token"] == pytest.approx((2 * 8 * 4 + 1) * 1.5)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        recs = [json.loads(x) for x in f]
    assert all("ortho_err" in r for r in recs) and recs[-1]["step"] == 4


@pytest.mark.slow
def test_checkpoints_of_the_old_pipeline_builder_resume(tmp_path):
    """Pipelined checkpoints written before the pipeline became the loss of the one step kept
    the always-kept parameters under ``kept``; they still resume, to the same trajectory. The
    old layout is pinned: the SHA-256 of its key paths, shapes and dtypes, as the old builder
    (commit 576784c) gave them for this config."""
    import hashlib
    import shutil

    import orbax.checkpoint as ocp
    c = tiny_pipe(**{"sdp.variant": "b-sdp", "sdp.coverage": 0.5, "model.n_layers": 8,
                     "sdp.allow_disconnected": True})
    spec = resolve(c, 8)
    old = migrations.pipeline_kept(loop.make_step(spec, loop.make_mesh(spec)).abstract_state(),
                           True)
    lines = sorted(f"{jax.tree_util.keystr(p)} {tuple(x.shape)} {x.dtype}"
                   for p, x in jax.tree_util.tree_leaves_with_path(old))
    assert any(ln.startswith("['params']['kept']['embed'] ") for ln in lines)
    assert hashlib.sha256("\n".join(lines).encode()).hexdigest() == (
        "41373f08cf99e2b002060c74c760465c358d99c8ac6f39cd4087cce510e06dc3")

    c = tiny_pipe(steps=8, eval_every=8, checkpoint_every=4, stop_at_step=4)
    a, b = tmp_path / "a", tmp_path / "b"
    loop.train(c, str(a))
    shutil.copytree(a, b)   # b: the same checkpoint, its state in the old layout
    spec = resolve(c, 8)
    abstract = loop.make_step(spec, loop.make_mesh(spec)).abstract_state()
    path = b / "checkpoints" / "4" / "state"
    ck = ocp.StandardCheckpointer()
    state = ck.restore(path, abstract)
    resume_from_old_layout(ck, path, migrations.pipeline_kept(state, True), abstract, c, a, b)


def test_study_table_and_plot(tmp_path):
    rows = [{"method": "none", "ratio": 1, "r": 128, "bytes_per_token": 1280.0, "val_loss": 1.5},
            {"method": "fixed", "ratio": 4, "r": 32, "bytes_per_token": 321.2, "val_loss": 1.6,
             "ortho_err": 1e-7},
            {"method": "mapl", "ratio": 4, "r": 32, "bytes_per_token": 321.2, "val_loss": 1.56,
             "ortho_err": 2e-7, "seed": 0, "peak_bytes_per_device": 8 * 2**20},
            {"method": "mapl", "ratio": 4, "r": 32, "bytes_per_token": 321.2, "val_loss": 1.54,
             "ortho_err": 3e-7, "seed": 1, "peak_bytes_per_device": 8 * 2**20},
            {"method": "mapl", "ratio": 4, "r": 32, "bytes_per_token": 385.4, "val_loss": 1.55,
             "schedule": "1f1b", "peak_bytes_per_device": 5 * 2**20},
            {"method": "none", "ratio": 1, "r": 128, "bytes_per_token": 1541.6, "val_loss": 1.5,
             "schedule": "1f1b"}]
    agg = study.aggregate(rows)
    assert [(r["method"], r.get("schedule", "gpipe")) for r in agg] == [
        ("none", "gpipe"), ("fixed", "gpipe"), ("mapl", "gpipe"), ("mapl", "1f1b"),
        ("none", "1f1b")]
    assert agg[2]["seeds"] == [0, 1] and agg[2]["ortho_err"] == 3e-7
    table = study.format_table(agg)
    assert ("| mapl | 4x | 32 | gpipe | 321.2 | 0.251x | 8.0 | 1.000x | "
            "1.5500 (1.5600, 1.5400) |") in table
    # 1F1B: bytes against the 1F1B none row, peak against GPipe's mapl row
    assert "| mapl | 4x | 32 | 1f1b | 385.4 | 0.250x | 5.0 | 0.625x | 1.5500 |" in table
    assert "+3.33%" in table   # mapl's mean vs none
    study.plot(agg, str(tmp_path / "p.png"), "t")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_study_runs_each_schedule_in_its_own_folder(tmp_path, monkeypatch, capsys):
    """--schedules: every method under each schedule, 1F1B's runs in folders ending in _1f1b,
    its peak against GPipe's; a bad value is a one-line error before anything runs."""
    seen = []
    monkeypatch.setattr(study, "measure_bytes", lambda c: {
        "per_token": 1.0, "per_boundary": 2.0,
        "peak_bytes_per_device": (4 if c.pipeline.schedule == "gpipe" else 1) * 2**20})
    monkeypatch.setattr(loop, "train", lambda c, where: seen.append(
        (c.pipeline.schedule, where)) or {"completed": True, "final_val_loss": 1.0,
                                           "final_val_bpb": 1.0, "wall_s": 0.0})
    study.main(["--methods=none", "--schedules=gpipe,1f1b", f"--out={tmp_path}"])
    run = tmp_path / "runs" / "seed0"
    assert seen == [("gpipe", str(run / "none_1x")), ("1f1b", str(run / "none_1x_1f1b"))]
    assert "| none | - | 128 | 1f1b | 1.0 | 1.000x | 1.0 | 0.250x |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        study.main(["--schedules=gpipe,pipedream", f"--out={tmp_path / 'x'}"], check_only=True)
    assert "--schedules='gpipe,pipedream': unknown 'pipedream'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        study.main(["--schedules=gpipe", "--config.pipeline.schedule=pipedream"], check_only=True)
    assert "--config.pipeline.schedule='pipedream': choose" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # the seed rule the SDP study applies too (cli.seeds)
        study.main(["--seeds=1,-1", f"--out={tmp_path / 'y'}"], check_only=True)
    assert "--seeds='1,-1': give distinct non-negative seeds" in capsys.readouterr().err


def test_checkpoints_before_the_pipeline_section_still_resume():
    """A checkpoint written before a config field existed (at any depth) compares as if it had
    the field's default; a real difference is still reported."""
    saved = {"steps": 10, "pipeline": {"stages": 2, "method": "mapl"}}      # no rvq_* fields
    now = {"steps": 10, "pipeline": {"stages": 2, "method": "mapl", "rvq_levels": 0}}
    defaults = {"fsdp": False, "pipeline": {"rvq_levels": 0, "stages": 1}}
    merged = ckpt_lib.with_defaults(saved, defaults)
    assert merged["pipeline"] == {"stages": 2, "method": "mapl", "rvq_levels": 0}
    assert ckpt_lib._diff(merged, {**now, "fsdp": False}) == []
    now["pipeline"]["rvq_levels"] = 2
    assert ckpt_lib._diff(merged, {**now, "fsdp": False}) == [
        "pipeline.rvq_levels: checkpoint has 0, this run has 2"]
