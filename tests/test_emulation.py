"""Workers emulated on one device (sdp_jax.sync.placement.Emulated, issue 37): the per-worker
program under jax.vmap over 'data' gives what the same workers give on their own devices."""

import os
import sys

import jax
import numpy as np
import optax
import pytest

from sdp_jax import mesh as mesh_lib
from sdp_jax.models import llama
from sdp_jax.models import vision as vm
from sdp_jax.models.llama import LlamaConfig
from sdp_jax.options import StepOptions
from sdp_jax.sync import placement
from sdp_jax.train import families, loop
from sdp_jax.train import optimizer as optim_lib
from sdp_jax.train.run import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_custom_model as custom  # noqa: E402
from test_train_cli import tiny  # noqa: E402

W = 8
CFG = LlamaConfig(vocab_size=64, d_model=16, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=32,
                  max_seq_len=16)
OPT = optim_lib.OptimConfig(lr=1e-2, warmup_steps=1)


def options(**settings) -> StepOptions:
    """The step options of these tests: 10 steps, clipping at 1 (a run's default)."""
    return StepOptions(total_steps=10, grad_clip=1.0, **settings)


def _meshes():
    return mesh_lib.make_mesh(W), mesh_lib.make_mesh(W, emulated=True)


def _train(step, batches):
    """The state after one step per batch (host arrays), the last metrics, the step fn."""
    state = step.init_state(0)
    for b in batches:
        state, m = step.train_step(state, step.put_batch(b))
        float(m["train_loss"])   # one step in flight
    return state, {k: float(v) for k, v in m.items()}


def _assert_same(a, b, tol):
    la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
    assert len(la) == len(lb) and jax.tree.structure(a) == jax.tree.structure(b)
    worst = max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                for x, y in zip(la, lb) if np.size(x))
    assert worst <= tol, worst


def _lm_batches(n=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, (2 * W, 13)).astype(np.int32) for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("variant,coverage,settings,tol", [
    ("ddp", 1.0, {}, 1e-6),
    ("b-sdp", 0.5, {}, 1e-6),
    ("n-sdp", 0.5, {}, 1e-6),
    ("bb-sdp", 0.5, {}, 1e-6),
    ("nb-sdp", 0.5, {}, 1e-6),
    ("b-sdp", 0.5, {"method": "reference"}, 1e-6),
    ("n-sdp", 0.5, {"average": "parameters", "sync_every": 2}, 1e-6),
    ("b-sdp", 0.5, {"fsdp": True, "remat": "full", "dtype": "bfloat16"}, 1e-4),
    ("bb-sdp", 0.5, {"remat": "full"}, 1e-6),   # held_weight_grads' lax.cond under vmap
], ids=["ddp", "b-sdp", "n-sdp", "bb-sdp", "nb-sdp", "b-sdp-psum", "n-sdp-parameters",
        "b-sdp-fsdp-remat-bf16", "bb-sdp-remat"])
def test_eight_emulated_workers_equal_eight_devices(variant, coverage, settings, tol):
    """8 workers on 1 device (jax.vmap) against 8 simulated devices (jax.shard_map), 3 steps
    of the LLaMA step: the whole state (parameters, optimizer moments, step), the metrics and
    the full model's evaluation loss agree to float rounding."""
    plan = llama.make_plan(variant, CFG, W, coverage, "cyclic", 0)
    batches = _lm_batches()
    out = []
    for mesh, emulate in zip(_meshes(), (False, True)):
        step = families.language_model_step(CFG, plan, OPT, mesh,
                                            options(emulate_workers=emulate, **settings))
        assert step.placement.emulated == emulate
        assert len(step.mesh.devices.flat) == (1 if emulate else W)
        state, metrics = _train(step, batches)
        loss = (float(step.eval_step_fn()(state["params"], step.put_batch(batches[0])))
                if not settings else None)   # (the full model's loss: once per variant)
        out.append((state, metrics, loss, step.full_params(state["params"])))
    (a, ma, la, fa), (b, mb, lb, fb) = out
    _assert_same(a, b, tol)
    _assert_same(fa, fb, tol)
    assert set(ma) == set(mb) and all(abs(ma[k] - mb[k]) <= 10 * tol + 1e-6 * abs(ma[k])
                                      for k in ma), (ma, mb)
    assert settings or abs(la - lb) <= 10 * tol


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["b-sdp"])
def test_vision_emulated_equals_devices_with_batchnorm(variant):
    """A ResNet with BatchNorm statistics (model state averaged over holders every step, the
    vision model's own slots): emulated and on devices after 3 steps, and the full model's
    evaluation (sdp_jax.train.families.VisionEval) on both."""
    cfg = vm.VisionConfig(name="resnet18", width=4, depths=(2, 2), image_size=16,
                          num_classes=5)
    plan = families.vision_spec(cfg, variant, W, 0.5)
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(2 * W, 16, 16, 3)).astype(np.float32),
                rng.integers(0, 5, 2 * W).astype(np.int32)) for _ in range(3)]
    out = []
    for mesh, emulate in zip(_meshes(), (False, True)):
        step = families.vision_step(cfg, plan, OPT, mesh, options(emulate_workers=emulate))
        state, metrics = _train(step, batches)
        ev = families.VisionEval(step)
        x, y = step.put_batch(batches[0])
        valid = step.put_batch(np.ones(2 * W, bool))
        scores = ev.eval_step_fn()(state["params"], state["stats"], x, y, valid)
        out.append((state, metrics, [float(s) for s in scores], ev.full_model(state)))
    (a, ma, sa, fa), (b, mb, sb, fb) = out
    _assert_same(a, b, 1e-5)
    _assert_same(fa, fb, 1e-5)
    np.testing.assert_allclose(sa, sb, rtol=1e-5)
    assert abs(ma["train_loss"] - mb["train_loss"]) < 1e-5


def test_a_users_model_emulated_equals_devices():
    """A model outside the package (list-form blocks, no block runner; tests/test_custom_model.py)
    through SDPStep with emulate_workers=True and the default mesh (one device)."""
    spec_args = ("n-sdp", 0.5)
    x, y = custom.data(n=custom.W * 8)
    batches = [(np.asarray(x), np.asarray(y))] * 3
    out = []
    for emulate in (False, True):
        step, _ = custom.make(*spec_args, emulate_workers=emulate)
        state = step.init(custom.Net())
        for b in batches:
            state, m = step.train_step(state, step.put_batch(b))
        out.append((state, float(m["train_loss"])))
    _assert_same(out[0][0], out[1][0], 1e-6)
    assert abs(out[0][1] - out[1][1]) < 1e-6


def test_an_update_that_differs_between_workers_is_refused_as_on_devices():
    """optax.clip_by_global_norm in the chain (each worker's own norm) changes replicated
    state differently on each worker: emulation refuses it with the one line of the devices'
    step (the abstract shard_map check), not by keeping worker 0's update."""
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    step, _ = custom.make("b-sdp", 0.5, clipped, emulate_workers=True)
    x, y = custom.data()
    with pytest.raises(ValueError) as e:
        step.train_step(step.init(custom.Net()), step.put_batch((np.asarray(x), np.asarray(y))))
    assert "\n" not in str(e.value) and "optax.clip_by_global_norm" in str(e.value)


def test_sdpstep_refusals_are_one_line():
    """A mesh of several devices, or a pipeline mesh, with emulation; several processes."""
    plan = llama.make_plan("b-sdp", CFG, W, 0.5, "cyclic", 0)
    with pytest.raises(ValueError, match="'data' axis has 8 devices"):
        families.language_model_step(CFG, plan, OPT, mesh_lib.make_mesh(W),
                                     options(emulate_workers=True))
    with pytest.raises(ValueError, match="pipeline of 2 stages"):
        placement.placement_of(mesh_lib.make_mesh(1, 2), W, True)
    with pytest.raises(ValueError, match="2 processes run; set --config.emulate_workers=False"):
        placement.check_emulation(1, 2, fix="set --config.emulate_workers=False")
    with pytest.raises(ValueError, match="emulate_workers=True"):   # the fix is named
        families.language_model_step(CFG, plan, OPT, mesh_lib.make_mesh(4), options())
    with pytest.raises(ValueError, match="emulate_workers='yes' must be True or False"):
        families.language_model_step(CFG, plan, OPT, None, options(emulate_workers="yes"))
    # a user's one-device mesh of explicit axes: emulated on the same device, axis type Auto
    own = placement.placement_of(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]), W,
                                 True)
    assert own.emulated and own.mesh.axis_types == (jax.sharding.AxisType.Auto,)
    # without emulation the step is what it was: shard_map on W devices
    assert placement.placement_of(mesh_lib.make_mesh(W), W, False).emulated is False


def test_config_refusals_before_compute():
    """A pipeline with emulated workers, and a value that is not a bool (a config read from
    JSON escapes ConfigDict's type check), are one-line errors from the validation."""
    with pytest.raises(ValueError, match="pipeline of 2 stages runs on 2 devices; set "
                                         "--config.emulate_workers=False"):
        resolve(tiny(emulate_workers=True, workers=4, **{"pipeline.stages": 2,
                                                             "pipeline.microbatches": 2}),
                jax.device_count())
    with pytest.raises(ValueError, match="config.workers=0 .every device. with "
                                         "config.emulate_workers=True: give the number"):
        resolve(tiny(emulate_workers=True, workers=0), jax.device_count())
    c = tiny()
    with c.ignore_type():
        c.emulate_workers = "yes"
    with pytest.raises(ValueError, match="config.emulate_workers='yes' must be True or False"):
        resolve(c, jax.device_count())


@pytest.mark.slow
def test_train_loop_emulated_resumes_on_devices(tmp_path, capsys):
    """train.py's loop with 8 emulated workers on 1 device: the same final loss as on 8
    devices; W=16 workers on the 8 devices' machine (more workers than devices); a run
    stopped emulated resumes on devices, and one stopped on devices resumes emulated (the
    checkpoint's arrays have the same global shapes), each ending where the uninterrupted
    run ends."""
    common = {"sdp.variant": "b-sdp", "sdp.coverage": 0.5, "steps": 4, "eval_every": 4,
              "checkpoint_every": 0, "workers": W}
    real = loop.train(tiny(**common), str(tmp_path / "real"))
    emu = loop.train(tiny(emulate_workers=True, **common), str(tmp_path / "emu"))
    assert emu["completed"] and abs(emu["final_val_loss"] - real["final_val_loss"]) < 1e-5
    assert emu["devices"] == 1 and real["devices"] == W and emu["emulate_workers"]
    assert "8 workers emulated on 1 device" in capsys.readouterr().out
    for first, second in ((True, False), (False, True)):
        wd = str(tmp_path / f"from_{'emulated' if first else 'devices'}")
        part = loop.train(tiny(emulate_workers=first, stop_at_step=2, **common), wd)
        assert part["steps"] == 2 and not part["completed"]
        capsys.readouterr()
        done = loop.train(tiny(emulate_workers=second, **common), wd)
        assert "at step 2" in capsys.readouterr().out   # resumed, not started again
        assert done["completed"] and done["devices"] == (1 if second else W)
        assert abs(done["final_val_loss"] - real["final_val_loss"]) < 1e-5
    wide = loop.train(tiny(emulate_workers=True, **{**common, "workers": 2 * W, "steps": 2,
                                                     "eval_every": 0}),
                      str(tmp_path / "wide"))
    assert wide["completed"] and wide["workers"] == 2 * W


def test_emulated_placement_splits_and_joins_the_global_arrays():
    """The placement alone: a leaf split over 'data' on dimension 1 reaches worker w as its
    w-th block, psum and all_to_all over 'data' act across the emulated workers, a replicated
    output comes back once."""
    mesh = mesh_lib.make_mesh(4, emulated=True)
    place = placement.placement_of(mesh, 4, True)
    from jax.sharding import PartitionSpec as P

    def worker(x, r):   # x: [2, 3] of this worker; r replicated [3]
        w = jax.lax.axis_index("data")
        total = jax.lax.psum(x.sum(), "data")
        pieces = w * 10 + jax.numpy.arange(4)   # piece j goes to worker j
        received = jax.lax.all_to_all(pieces, "data", 0, 0, tiled=True)
        return x + w * 100, total + r.sum(), received
    x = np.arange(2 * 12, dtype=np.float32).reshape(2, 12)
    r = np.ones(3, np.float32)
    fn = jax.jit(place.map(worker, (P(None, "data"), P()), (P(None, "data"), P(), P("data"))))
    y, total, received = fn(x, r)
    ref = x.copy()
    for w in range(4):
        ref[:, 3 * w:3 * w + 3] += 100 * w
    np.testing.assert_array_equal(np.asarray(y), ref)
    assert float(total) == float(x.sum()) + 3.0
    # worker w received piece w of every worker v: v * 10 + w
    np.testing.assert_array_equal(np.asarray(received),
                                  [v * 10 + w for w in range(4) for v in range(4)])
    assert "4 workers emulated on 1 device" in place.describe()
    with pytest.raises(ValueError, match="cannot be emulated"):
        jax.jit(place.map(lambda a: a, (P(("data", "stage")),), P()))(x)
