"""Pipeline axis `stage` with compressed boundaries (MAPL): equivalences, bytes, orthogonality."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train_cli import tiny  # the tiny config with dotted overrides

from sdp_jax import checkpoint as ckpt_lib
from sdp_jax import pipeline as pl
from sdp_jax import stiefel, study, trainer
from sdp_jax import train_step as ts
from sdp_jax.models.llama import Llama, LlamaConfig, next_token_loss

CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=2, n_kv_heads=2, d_ff=64,
                  max_seq_len=32)
T = 16


def _builder(method="none", ratio=4, workers=2, stages=2, variant="ddp", coverage=1.0,
             cfg=CFG, anchor_rank=8, microbatches=2, rvq_levels=0):
    pipe = pl.PipelineConfig(stages=stages, microbatches=microbatches, method=method,
                             ratio=ratio, anchor_rank=anchor_rank, rvq_levels=rvq_levels,
                             rvq_codebook=16)
    return pl.PipelineStep(cfg, pipe, ts.OptimConfig(warmup_steps=0), pl.make_mesh(workers, stages),
                           20, variant=variant, coverage=coverage, batch_per_worker=4)


def _tokens(b, batch=4, seed=1):
    tok = jax.random.randint(jax.random.key(seed), (b.W * batch, T + 1), 0, b.model.vocab_size)
    return tok, jax.device_put(tok, b.batch_sharding())


def _placed(b, full):
    params = b.full_to_compact(full)
    return jax.device_put(params, b.shardings(b._specs(params)))


def _close(a, b, atol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         atol=atol, rtol=1e-4), a, b)


def test_uncompressed_pipeline_equals_unpipelined_model():
    b = _builder("none")
    full = b.init_full(0)
    tok, tok_d = _tokens(b)
    model = Llama(CFG, nnx.Rngs(0))  # the same initialization as init_full(0)
    graphdef, state = nnx.split(model, nnx.Param)

    def model_loss(st):
        return next_token_loss(nnx.merge(graphdef, st)(tok[:, :-1]), tok[:, 1:])

    want_loss, g = jax.jit(jax.value_and_grad(model_loss))(state)
    g = nnx.to_pure_dict(g)
    loss, grads, _ = jax.jit(b.grads)(_placed(b, full), tok_d)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    got = b.compact_to_full(grads)
    _close(got["blocks"], g["blocks"], 1e-6)
    _close(got["kept"], {"embed": g["embed"], "final_norm": g["final_norm"],
                         "lm_head": g["lm_head"]}, 1e-6)
    # The full-model evaluation through the pipeline is the same model.
    np.testing.assert_allclose(float(b.eval_loss_fn()(_placed(b, full), tok_d)),
                               float(want_loss), rtol=1e-5)


def test_full_width_identity_projector_equals_uncompressed():
    b = _builder("fixed", ratio=1)   # r = d
    ref = _builder("none")
    full = b.init_full(0)
    bnd = dict(full["boundary"])
    bnd["frozen_A"] = jnp.broadcast_to(jnp.eye(CFG.d_model), bnd["frozen_A"].shape)
    bnd["anchor_embed"] = bnd["anchor_embed"] * 50  # anchors far from zero cancel exactly
    full = {**full, "boundary": bnd}
    tok, tok_d = _tokens(b)
    want = float(jax.jit(ref.reference_loss)({**full, "boundary": {}}, tok))
    np.testing.assert_allclose(float(jax.jit(b.reference_loss)(full, tok)), want, rtol=1e-5)
    loss, grads, _ = jax.jit(b.grads)(_placed(b, full), tok_d)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    # `fixed` never moves A: no gradient reaches it, and the optimizer routes it to set_to_zero
    assert float(jnp.abs(grads["boundary"]["frozen_A"]).max()) == 0.0
    assert b._labels(full)["boundary"]["frozen_A"] == pl.FROZEN
    # A compressed boundary (r < d) is not the identity: the check above can fail.
    b4 = _builder("fixed", ratio=4)
    assert abs(float(jax.jit(b4.reference_loss)(b4.init_full(0), tok)) - want) > 1e-4


@pytest.mark.parametrize("rvq_levels", [0, 2])
def test_compressed_pipeline_forward_and_gradient_match_single_device(rvq_levels):
    b = _builder("mapl", ratio=4, rvq_levels=rvq_levels)
    full = b.init_full(0)
    tok, tok_d = _tokens(b)
    want_loss, want = jax.jit(jax.value_and_grad(b.reference_loss))(full, tok)
    loss, grads, _ = jax.jit(b.grads)(_placed(b, full), tok_d)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    got = b.compact_to_full(grads)
    _close(got["kept"], want["kept"], 1e-6)
    _close(got["blocks"], want["blocks"], 1e-6)
    _close(got["boundary"]["stiefel_A"], want["boundary"]["stiefel_A"], 1e-6)
    _close(got["boundary"]["anchor_embed"], want["boundary"]["anchor_embed"], 1e-6)
    if rvq_levels:  # codebooks are trained (codebook loss), and only codes travel forward
        lm = float(b.eval_loss_fn()(_placed(b, full), tok_d))   # validation: next-token only
        assert 0 < float(loss) - lm < 0.1
        assert float(jnp.abs(got["boundary"]["rvq_codebook"]).max()) > 0
        _close(got["boundary"]["rvq_codebook"], want["boundary"]["rvq_codebook"], 1e-6)
    # every worker's copy of a block carries the same (averaged) gradient
    for leaf in jax.tree.leaves(grads["blocks"]):
        np.testing.assert_allclose(np.asarray(leaf[0]), np.asarray(leaf[1]), atol=1e-7)


def test_block_sdp_pipeline_averages_over_holders():
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=2, n_kv_heads=2, d_ff=64,
                      max_seq_len=32)
    b = _builder("mapl", ratio=4, workers=4, variant="b-sdp", coverage=0.5, cfg=cfg)
    assert b.k == 2 and list(b.counts) == [2, 2, 2, 2]
    full = b.init_full(0)
    compact = b.full_to_compact(full)
    tok, tok_d = _tokens(b)
    _, grads, _ = jax.jit(b.grads)(jax.device_put(compact, b.shardings(b._specs(compact))),
                                   tok_d)
    # Reference: each worker's subnetwork on its own quarter of the batch, on one device; a
    # block's gradient is the mean over its holders, always-kept ones the mean over workers.
    ref_grad = jax.jit(jax.grad(b.reference_loss))
    per = [ref_grad(
        {**full, "blocks": jax.tree.map(lambda a, w=w: a[w].reshape((-1,) + a.shape[3:]),
                                        compact["blocks"])}, tok[w * 4:(w + 1) * 4])
        for w in range(4)]
    want_embed = sum(p["kept"]["embed"] for p in per) / 4
    np.testing.assert_allclose(np.asarray(grads["kept"]["embed"]), np.asarray(want_embed),
                               atol=1e-6)
    wq = np.asarray(grads["blocks"]["attn"]["wq"])             # [W, P, k, ...]
    for s in range(2):
        for l in range(b.Lp):
            holders = [(w, int(np.flatnonzero(b.held[w] == l)[0])) for w in range(4)
                       if l in b.held[w]]
            want_l = sum(np.asarray(per[w]["blocks"]["attn"]["wq"][s * b.k + j])
                         for w, j in holders) / len(holders)
            for w, j in holders:
                np.testing.assert_allclose(wq[w, s, j], want_l, atol=1e-6)


def test_boundary_bytes_of_compiled_step():
    cfg = LlamaConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, n_kv_heads=2,
                      d_ff=64, max_seq_len=32)
    out = {}
    for method, rvq in (("none", 0), ("mapl", 0), ("rvq", 2)):
        b = _builder("mapl" if rvq else method, ratio=4, cfg=cfg, rvq_levels=rvq)
        c = b.compiled_train_step(jax.ShapeDtypeStruct((b.W * 4, T + 1), jnp.int32))
        out[method] = b.boundary_bytes(c, 4, T)
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


def test_projectors_orthogonality_by_method():
    errs = {}
    for method in ("mapl", "unconstrained"):
        b = _builder(method, ratio=4)
        state = b.init_state(0)
        a0 = np.asarray(state["params"]["boundary"][pl.projector_key(method)])
        step = b.train_step_fn()
        for i in range(4):
            state, m = step(state, _tokens(b, seed=i)[1])
            float(m["train_loss"])
        errs[method] = float(m["ortho_err"])
        a = np.asarray(state["params"]["boundary"][pl.projector_key(method)])
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
    ({"pipeline.schedule": "1f1b"}, "only gpipe is built"),
    ({"pipeline.method": "none", "pipeline.rvq_levels": 2}, "rvq_levels=2 needs a compressed"),
    ({"sdp.variant": "n-sdp", "sdp.coverage": 0.5}, "not built with a pipeline"),
    ({"fsdp": True}, "config.fsdp=True is not built with a pipeline"),
    ({"workers": 5}, "5 \\* 2 devices needed, 8 present"),
])
def test_pipeline_config_errors(override, match):
    c = tiny_pipe(**override)
    with pytest.raises(ValueError, match=match):
        trainer.resolve(c, jax.device_count())


def test_pipelined_run_end_to_end(tmp_path):
    c = tiny_pipe(steps=4, eval_every=4, checkpoint_every=4)
    s = trainer.train(c, str(tmp_path / "run"))
    assert s["completed"] and np.isfinite(s["final_val_loss"])
    assert s["final_ortho_err"] < 1e-5
    assert s["boundary_bytes_per_token"] == pytest.approx((2 * 8 * 4 + 1) * 1.5)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        recs = [json.loads(x) for x in f]
    assert all("ortho_err" in r for r in recs) and recs[-1]["step"] == 4


def test_study_table_and_plot(tmp_path):
    rows = [{"method": "none", "ratio": 1, "r": 128, "bytes_per_token": 1280.0, "val_loss": 1.5},
            {"method": "fixed", "ratio": 4, "r": 32, "bytes_per_token": 321.2, "val_loss": 1.6,
             "ortho_err": 1e-7},
            {"method": "mapl", "ratio": 4, "r": 32, "bytes_per_token": 321.2, "val_loss": 1.56,
             "ortho_err": 2e-7, "seed": 0},
            {"method": "mapl", "ratio": 4, "r": 32, "bytes_per_token": 321.2, "val_loss": 1.54,
             "ortho_err": 3e-7, "seed": 1}]
    agg = study.aggregate(rows)
    assert [r["method"] for r in agg] == ["none", "fixed", "mapl"]
    assert agg[2]["seeds"] == [0, 1] and agg[2]["ortho_err"] == 3e-7
    table = study.format_table(agg)
    assert "| mapl | 4x | 32 | 321.2 | 0.251x | 1.5500 (1.5600, 1.5400) |" in table
    assert "+3.33%" in table   # mapl's mean vs none
    study.plot(agg, str(tmp_path / "p.png"), "t")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_checkpoints_before_the_pipeline_section_still_resume():
    """A checkpoint written before a config field existed (at any depth) compares as if it had
    the field's default; a real difference is still reported."""
    saved = {"steps": 10, "pipeline": {"stages": 2, "method": "mapl"}}      # no rvq_* fields
    now = {"steps": 10, "pipeline": {"stages": 2, "method": "mapl", "rvq_levels": 0}}
    defaults = {"fsdp": False, "pipeline": {"rvq_levels": 0, "stages": 1}}
    merged = ckpt_lib._with_defaults(saved, defaults)
    assert merged["pipeline"] == {"stages": 2, "method": "mapl", "rvq_levels": 0}
    assert ckpt_lib._diff(merged, {**now, "fsdp": False}) == []
    now["pipeline"]["rvq_levels"] = 2
    assert ckpt_lib._diff(merged, {**now, "fsdp": False}) == [
        "pipeline.rvq_levels: checkpoint has 0, this run has 2"]
