"""Gradient accumulation (sdp_jax.step.accumulation, config.grad_accum): K microbatches per
optimizer step take the step of the K-times batch, for every variant, with FSDP, activation
checkpointing, a pipeline and emulated workers; the compiled activation peak falls."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdp_jax import mesh as mesh_lib
from sdp_jax.costs import program as costs
from sdp_jax.models import llama
from sdp_jax.models.llama import LlamaConfig
from sdp_jax.options import StepOptions
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.train import config as config_lib
from sdp_jax.train import families
from sdp_jax.train import optimizer as optim_lib
from sdp_jax.train import run as run_lib

W, K, B = 4, 2, 4          # workers, microbatches, rows per worker (B / K per microbatch)
CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48,
                  max_seq_len=16)
# SGD with an active clip (the update is linear in the averaged gradient, so K microbatches and
# the whole batch agree to rounding; the clip checks the norm of the accumulated mean).
SGD = optim_lib.OptimConfig(name="sgd", lr=0.5, warmup_steps=1, weight_decay=0.0)
CLIP = 0.05
COVERAGE = {"ddp": 1.0, "b-sdp": 0.5, "n-sdp": 0.5, "bb-sdp": 0.5, "nb-sdp": 0.5}


def _step(variant, k, mesh=None, pipe=None, cfg=CFG, **kw):
    workers = W
    plan = llama.make_plan(variant, cfg, workers, COVERAGE[variant], "cyclic", 0, pipe=pipe)
    mesh = mesh or mesh_lib.make_mesh(workers, 1 if pipe is None else pipe.stages)
    return families.language_model_step(
        cfg, plan, SGD, mesh, StepOptions(total_steps=10, grad_clip=CLIP, grad_accum=k, **kw),
        pipe)


def _batches(step, n=3, rows=B):
    rng = np.random.default_rng(3)
    return [jnp.asarray(rng.integers(0, 64, (step.spec.workers * rows, 13)), jnp.int32)
            for _ in range(n)]


def _train(step, batches):
    state, losses, norms = step.init_state(seed=0), [], []
    for x in batches:
        state, m = step.train_step_fn()(state, step.put_batch(x))
        losses.append(float(m["train_loss"]))
        norms.append(float(m["grad_norm"]))
    return state, losses, norms


def _assert_equal_runs(one, acc, rtol=1e-4, atol=1e-6):
    batches = _batches(one)
    s1, l1, n1 = _train(one, batches)
    s2, l2, n2 = _train(acc, batches)
    assert max(n1) > CLIP   # clipping was active
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    np.testing.assert_allclose(n2, n1, rtol=1e-4)
    f1, f2 = one.full_params(s1["params"]), acc.full_params(s2["params"])
    for x, y in zip(jax.tree.leaves(f1), jax.tree.leaves(f2), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=rtol, atol=atol)
    return f1, f2


# (b-sdp without FSDP: test_accumulation_with_emulated_workers, against the devices' step)
CASES = [("ddp", {}), ("b-sdp", dict(fsdp=True, remat="full")),
         ("n-sdp", dict(remat="dots", method="reference")), ("bb-sdp", dict(remat="full")),
         ("nb-sdp", dict(fsdp=True))]


@pytest.mark.slow
@pytest.mark.parametrize("variant, kw", CASES)
def test_accumulated_step_equals_the_step_on_the_whole_batch(variant, kw):
    """Every variant (with FSDP, activation checkpointing or the reference averaging for
    some): 2 microbatches per step take the step on the whole batch."""
    assert {v for v, _ in CASES} == set(spec_lib.VARIANTS)
    one = _step(variant, 1, **kw)
    f0 = one.full_params(one.init_state(seed=0)["params"])
    f1, _ = _assert_equal_runs(one, _step(variant, K, **kw))
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(f0), jax.tree.leaves(f1)))
    assert moved > 1e-3   # the runs trained


@pytest.mark.slow
def test_accumulation_with_a_pipeline():
    """A 1F1B pipeline of 2 stages, 2 pipeline microbatches in each of 2 accumulation
    microbatches."""
    from sdp_jax.pipeline import schedules as pl
    pipe = pl.PipelineConfig(stages=2, microbatches=2, schedule="1f1b")
    cfg = dataclasses.replace(CFG, n_layers=8)   # 4 blocks per stage, 2 held by each worker
    _assert_equal_runs(_step("b-sdp", 1, pipe=pipe, cfg=cfg),
                       _step("b-sdp", K, pipe=pipe, cfg=cfg))


@pytest.mark.slow
def test_accumulation_with_emulated_workers():
    mesh = mesh_lib.make_mesh(W, emulated=True)
    _assert_equal_runs(_step("b-sdp", 1), _step("b-sdp", K, mesh=mesh, emulate_workers=True))


@pytest.mark.slow
def test_the_activation_peak_falls_with_more_microbatches():
    cfg = LlamaConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                      d_ff=128, max_seq_len=128)
    shape = jax.ShapeDtypeStruct((W * 16, 129), jnp.int32)
    temps = [costs.memory_stats(_step("ddp", k, cfg=cfg).compiled_train_step(shape))["temp_bytes"]
             for k in (1, 4)]
    assert temps[1] < 0.5 * temps[0], temps


def test_bad_grad_accum_is_refused_in_one_line():
    with pytest.raises(ValueError, match="grad_accum=0 must be a positive integer"):
        _step("ddp", 0)
    step = _step("ddp", 3)
    with pytest.raises(ValueError, match="batch that 3 divides, got 4 rows"):
        step.train_step_fn()(step.init_state(0), step.put_batch(_batches(step, 1)[0]))
    config = config_lib.base_config()
    config.update(dict(grad_accum=3, batch_per_worker=8, workers=4))
    with pytest.raises(ValueError, match="config.grad_accum=3 does not divide "
                                         "config.batch_per_worker=8"):
        run_lib.resolve(config, 8)
    config.update(dict(grad_accum=4, pipeline=dict(config.pipeline, stages=2, microbatches=4)))
    with pytest.raises(ValueError, match=r"pipeline.microbatches=4 does not divide the rows of a "
                                         r"gradient-accumulation microbatch, batch_per_worker / "
                                         r"grad_accum = 8 / 4"):
        run_lib.resolve(config, 8)
    config.update(dict(grad_accum=True))
    with pytest.raises(ValueError, match="grad_accum"):
        run_lib.resolve(config, 8)


@pytest.mark.slow
def test_a_run_resumes_under_another_grad_accum(tmp_path):
    """grad_accum chooses how a step is computed, not what: a run stopped at step 2 resumes
    with 2 microbatches per step and ends where the run without accumulation ends; the
    summary records the setting."""
    import json

    from sdp_jax.train import loop

    def tiny(**kw):
        c = config_lib.base_config()
        c.model.update(vocab_size=256, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                       d_ff=64, max_seq_len=32)
        c.update(dict(workers=4, num_cpu_devices=4, seq_len=32, batch_per_worker=4, steps=4,
                      eval_every=2, checkpoint_every=0, eval_batches=2, log_every=1))
        c.sdp.update(variant="b-sdp", coverage=0.5)
        c.optim.warmup_steps = 1
        c.update(kw)
        return c
    loop.train(tiny(), str(tmp_path / "full"))
    loop.train(tiny(stop_at_step=2), str(tmp_path / "res"))
    done = loop.train(tiny(grad_accum=2), str(tmp_path / "res"))
    assert done["completed"] and done["grad_accum"] == 2

    def losses(wd):
        return [json.loads(line)["train_loss"] for line in open(wd / "metrics.jsonl")]
    np.testing.assert_allclose(losses(tmp_path / "res"), losses(tmp_path / "full"), rtol=1e-4)


@pytest.mark.slow
def test_vision_models_accumulate_and_batchnorm_takes_the_mean_update():
    """Swin (LayerNorm, no model state): 2 microbatches take the whole batch's step. ResNet
    (BatchNorm): each microbatch normalises by its own statistics, and the running statistics
    take the mean of the microbatches' updates, so the step differs from the whole batch's
    (documented), and trains."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sdp_jax.models import vision as vm
    mesh = mesh_lib.make_mesh(W)
    rng = np.random.default_rng(0)

    def run(cfg, variant, k):
        plan = families.vision_spec(cfg, variant, W, COVERAGE[variant])
        step = families.vision_step(cfg, plan, SGD, mesh,
                                    StepOptions(total_steps=10, grad_clip=CLIP, grad_accum=k))
        state, out = step.init_state(seed=0), []
        first = jax.device_get(state.get("stats"))
        for x, y in batches:
            state, m = step.train_step_fn()(state, (x, y))
            out.append(float(m["train_loss"]))
        return first, state, out

    swin = vm.VisionConfig(name="swin_t", embed_dim=8, depths=(2, 2), num_heads=(2, 2),
                           image_size=16, num_classes=5)
    resnet = vm.VisionConfig(name="resnet18", width=4, depths=(2, 2), image_size=16,
                             num_classes=5)
    sh = NamedSharding(mesh, P("data"))
    batches = [(jax.device_put(jnp.asarray(rng.normal(size=(2 * W, 16, 16, 3)), jnp.float32),
                               sh),
                jax.device_put(jnp.asarray(rng.integers(0, 5, 2 * W), jnp.int32), sh))
               for _ in range(3)]
    (_, st1, l1), (_, st2, l2) = run(swin, "b-sdp", 1), run(swin, "b-sdp", 2)
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(st1["params"]), jax.tree.leaves(st2["params"])):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)
    start, r2, losses = run(resnet, "b-sdp", 2)
    assert all(np.isfinite(losses)) and "stats" in r2
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(r2["stats"]))]
    assert min(moved) > 0   # every running statistic took the microbatches' mean update
