"""A model defined in this file, trained through sdp_jax's public loop (sdp_jax.train.task.Task):
stopped by SIGTERM after a checkpoint and resumed, on another device count, to the parameters
of an uninterrupted run; the run's outputs; a bad task or config refused before any compute;
the example examples/custom_loop.py.

Run as a script (``python tests/test_custom_loop.py WORKDIR``) it trains the run that the
SIGTERM test stops."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sdp_jax import mesh as mesh_lib
from sdp_jax.spec import sdp_spec as sdp
from sdp_jax.tools import evaluate, trained
from sdp_jax.train import checkpoint as ckpt_lib
from sdp_jax.train import curves, loop
from sdp_jax.train.task import Task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, CHECKPOINT_EVERY, EVAL_EVERY, W, B = 30, 5, 10, 4, 8
SLOW = "SDP_TEST_SECONDS_PER_BATCH"   # a slow data pipeline: the signal lands mid-run
TIMEOUT = 240


class Block(nnx.Module):
    def __init__(self, d, f, rngs):
        self.up, self.down = nnx.Linear(d, f, rngs=rngs), nnx.Linear(f, d, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jnp.tanh(self.up(h)))


class Net(nnx.Module):
    def __init__(self, depth, width, rngs):
        self.inp, self.out = nnx.Linear(5, 16, rngs=rngs), nnx.Linear(16, 1, rngs=rngs)
        self.blocks = nnx.List([Block(16, width, rngs) for _ in range(depth)])

    def __call__(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)[:, 0]


class Regression(Task):
    """y = cos(x_0 - x_1) + x_2 / 2 from x ~ N(0, I_5); batches are dicts."""

    name = "test-mlp"

    def model_fields(self):
        return {"depth": 4, "width": 24}

    def init(self, model, seed):
        return Net(model.depth, model.width, nnx.Rngs(seed))

    def rules(self, model):
        return [sdp.Blocks("blocks"), sdp.Neurons("blocks/*/up/kernel", 1, "mlp"),
                sdp.Neurons("blocks/*/up/bias", 0, "mlp"),
                sdp.Neurons("blocks/*/down/kernel", 0, "mlp")]

    def loss(self, model, plan):
        def loss_fn(params, batch):   # the subnetwork, or the full model in evaluation
            depth = len(params["blocks"])
            net = nnx.graphdef(nnx.eval_shape(lambda: Net(depth, model.width, nnx.Rngs(0))))
            return jnp.mean((nnx.merge(net, params)(batch["x"]) - batch["y"]) ** 2)
        return loss_fn

    def batch(self, config, step, size):
        time.sleep(float(os.environ.get(SLOW, "0")))
        return examples(np.random.default_rng([0, config.seed, step]), size)

    def val_batches(self, config, size):
        return [examples(np.random.default_rng([1, config.seed]), size)]


def examples(rng, size):
    x = rng.normal(size=(size, 5))     # float64: stored as float32
    return {"x": x, "y": np.cos(x[:, 0] - x[:, 1]) + x[:, 2] / 2}


def config(**overrides):
    c = Regression().config()
    c.sdp.variant, c.sdp.coverage = "b-sdp", 0.5
    c.workers, c.batch_per_worker, c.steps = W, B, STEPS
    c.checkpoint_every, c.eval_every, c.log_every = CHECKPOINT_EVERY, EVAL_EVERY, 1
    c.optim.warmup_steps = 2
    c.update(overrides)
    return c


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run SIGTERM stopped (1 process x 4 devices) and resumed here (8 devices; W = 4 in
    both), and the same run uninterrupted: ``(stopped workdir, the stop step, the python
    script's stdout, the checkpoints it left, resumed summary, uninterrupted workdir)``."""
    root = tmp_path_factory.mktemp("custom_loop")
    wd = root / "stopped"
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               PYTHONUNBUFFERED="1", **{SLOW: "0.1"})
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(wd)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = wd / "checkpoints" / str(CHECKPOINT_EVERY)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None and not first.is_dir():
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()   # still training after a checkpoint
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, (out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    step = int(re.search(r"interrupted by SIGTERM at step (\d+) of 30", out).group(1))
    m = ckpt_lib.CheckpointManager(str(wd / "checkpoints"))
    try:
        kept = {s: m.read_meta(s)["config"]["model"] for s in m.all_steps()}
    finally:
        m.close()
    resumed = loop.train(config(), str(wd), task=Regression())
    straight = root / "straight"
    loop.train(config(), str(straight), task=Regression())
    return wd, step, out, kept, resumed, straight


@pytest.mark.slow
def test_sigterm_then_resume_ends_with_the_uninterrupted_parameters(runs):
    wd, step, out, kept, resumed, straight = runs
    assert "devices: 4 x cpu" in out   # the stopped run had 4 devices, the resumed one 8
    assert "SIGTERM: stopping after this step" in out
    assert CHECKPOINT_EVERY <= step < STEPS and max(kept) == step   # saved at the stop
    assert kept[step] == {"name": "test-mlp", "depth": 4, "width": 24}
    assert resumed["completed"] and resumed["steps"] == STEPS
    got = trained.load(str(wd), task=Regression()).full_params()
    want = trained.load(str(straight), task=Regression()).full_params()
    start = jax.tree.map(np.asarray, sdp.pure_tree(Net(4, 24, nnx.Rngs(0))))
    assert jax.tree.structure(got) == jax.tree.structure(want) == jax.tree.structure(start)
    moved = 0.0
    for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(start)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
        moved = max(moved, float(np.max(np.abs(g - s))))
    assert moved > 1e-3   # trained: the comparison is not of two initializations


def test_the_run_writes_metrics_tensorboard_and_summary(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    wd, _, _, _, resumed, straight = runs
    recs = read_jsonl(wd / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))   # the stop's records kept
    assert [r["step"] for r in recs if "val_loss" in r] == [10, 20, 30]
    assert all(math.isfinite(r["train_loss"]) and r["examples_per_s"] > 0 for r in recs)
    assert [r["train_loss"] for r in recs] == pytest.approx(
        [r["train_loss"] for r in read_jsonl(straight / "metrics.jsonl")], rel=1e-5)
    events = EventAccumulator(str(wd))
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")] == list(range(1, STEPS + 1))
    assert [e.value for e in events.Scalars("val_loss")] == pytest.approx(
        [r["val_loss"] for r in recs if "val_loss" in r])
    summary = json.loads((wd / "summary.json").read_text())
    assert summary == {k: v for k, v in resumed.items() if k != "signal"}
    net = Net(4, 24, nnx.Rngs(0))
    total = sum(x.size for x in jax.tree.leaves(sdp.pure_tree(net)))
    block = sum(x.size for x in jax.tree.leaves(sdp.pure_tree(net.blocks[0])))
    assert summary["model"] == "test-mlp" and summary["variant"] == "b-sdp"
    assert summary["completed"] and summary["interrupted_by"] is None
    assert summary["examples"] == STEPS * W * B and summary["item"] == "examples"
    assert summary["final_val_loss"] == recs[-1]["val_loss"]
    assert summary["final_train_loss"] == recs[-1]["train_loss"]
    assert summary["params_total"] == total
    assert summary["params_per_device"] == total - 2 * block   # 2 of the 4 blocks
    assert summary["peak_bytes_per_device"] > 0 and summary["model_flops_per_step"] > 0
    assert json.loads((wd / "config.json").read_text())["model"] == {
        "name": "test-mlp", "depth": 4, "width": 24}
    assert (wd / "curves.png").is_file()
    # its loss axis names no unit (a task's loss is its own), a language model's nats/token
    run = curves.read_run(str(wd))
    assert curves.loss_label("val_loss", [run]) == "validation loss"
    assert curves.loss_label("val_loss", [{**run, "item": "tokens"}]).endswith("(nats/token)")
    # read back on the command line with --task: the run's own evaluation of its last state
    out = evaluate.main(["--workdir", str(wd), "--task", f"{__name__}:Regression"])
    assert out["step"] == STEPS and out["val_loss"] == pytest.approx(summary["final_val_loss"],
                                                                   rel=1e-5)
    for bad, why in (("nomodule_xyz:Regression", "cannot import"), (__name__, "module:Class"),
                     (f"{__name__}:Net", "not a Task")):
        with pytest.raises(SystemExit) as e:
            evaluate.main(["--workdir", str(wd), f"--task={bad}"])
        assert e.value.code == 2
    with pytest.raises(SystemExit):   # without --task: the error names it
        evaluate.main(["--workdir", str(wd)])
    # rerun once finished: nothing trained, the stored summary
    again = loop.train(config(), str(wd), task=Regression())
    assert again["steps"] == STEPS and again["signal"] is None


def test_a_task_run_measures_the_gradient_alignment(tmp_path):
    """config.align_every serves a user's model as the built-in language model."""
    s = loop.train(config(steps=2, align_every=2, checkpoint_every=0, eval_every=0),
                   str(tmp_path), task=Regression())
    rec = read_jsonl(tmp_path / "metrics.jsonl")[-1]
    assert s["completed"] and rec["step"] == 2
    for key in ("grad_alignment", "update_alignment"):   # b-sdp: cosines below 1
        assert 0 < rec[key] < 0.999


class NoLoss(Regression):
    loss = Task.loss


class HalfBatch(Regression):
    def batch(self, config, step, size):
        return super().batch(config, step, size // 2)


class WrongRule(Regression):
    def rules(self, model):
        return [sdp.Blocks("layers")]


class ClipInOptions(Regression):
    def model_hooks(self, model, plan):
        return {"grad_clip": 0.5}


class NotAHook(Regression):
    def model_hooks(self, model, plan):
        return {"block": None}


class OldName(Regression):
    def step_options(self, model, plan):
        return {}


class OwnSlots(Regression):
    def model_hooks(self, model, plan):
        return {"stacked_slots": True}


@pytest.mark.parametrize("task, edit, match", [
    (NoLoss(), None, r"NoLoss does not define loss; a Task defines init\(model, seed\)"),
    (object(), None, r"is not a sdp_jax\.train\.task\.Family; pass an instance"),
    (Regression(), lambda c: c.model.__setattr__("widht", 8),
     r"config\.model\.widht is not a field of a test-mlp run config \(Regression\(\)\.config"),
    (Regression(), lambda c: c.model.__delitem__("depth"),
     (r"config\.model\.depth is missing; build the run config on Regression\(\)\.config\(\) "
      r"\(default model\.depth: 4\)")),
    (Regression(), lambda c: c.model.__setattr__("name", "other"),
     r"config\.model\.name='other' but the task is 'test-mlp'; build the run config with"),
    (Regression(), lambda c: c.sdp.__setattr__("coverage", 0.3), r"^test-mlp: .*coverage"),
    (WrongRule(), None, r"^test-mlp: .*'layers'"),
    (HalfBatch(), None, (r"HalfBatch\.batch\(config, 0, 32\) returned a leaf of shape "
                         r"\(16, 5\); every leaf of a global batch needs the leading axis "
                         r"size=32")),
    (ClipInOptions(), None, (r"model_hooks gives grad_clip, which the run sets "
                             r"\(--config\.optim\.grad_clip\); set it there")),
    (NotAHook(), None, r"NotAHook\.model_hooks gives 'block', which is not a model hook; give "
                       r"only block_fn, extras, has_aux, param_metrics, stacked_slots, "
                       r"state_spec"),
    (OldName(), None, r"OldName defines step_options, which is now model_hooks"),
    (OwnSlots(), lambda c: c.__setattr__("align_every", 2),
     r"config\.align_every=2: the gradient alignment is not built for test-mlp models .*; set "
     r"--config\.align_every=0\.$"),
    (Regression(), lambda c: (c.__setattr__("align_every", 2),
                              c.sdp.__setattr__("average", "parameters")),
     r"not built for parameter averaging \(config\.sdp\.average=parameters\)"),
])
def test_a_bad_task_or_config_is_one_line_before_any_compute(tmp_path, task, edit, match):
    c = config()
    if edit is not None:
        edit(c)
    with pytest.raises(ValueError, match=match) as e:
        loop.train(c, str(tmp_path / "bad"), task=task)
    assert "\n" not in str(e.value)
    steps = tmp_path / "bad" / "checkpoints"
    assert not (steps.exists() and any(p.name.isdigit() for p in steps.iterdir()))


class Diverges(Regression):
    def batch(self, config, step, size):
        b = super().batch(config, step, size)
        if step == 3:   # the 4th step's batch
            b["x"][0, 0] = np.nan
        return b


def test_a_non_finite_loss_stops_before_its_state_is_saved(tmp_path):
    with pytest.raises(FloatingPointError, match=r"non-finite grad_norm nan, train_loss nan at step 4: "
                                                 r"stopped without saving this state; the "
                                                 r"last checkpoint \(step 2\) is kept"):
        loop.train(config(checkpoint_every=2), str(tmp_path / "nan"), task=Diverges())
    m = ckpt_lib.CheckpointManager(str(tmp_path / "nan" / "checkpoints"))
    try:
        assert m.all_steps() == [2]
    finally:
        m.close()


@pytest.mark.slow
def test_example_runs(tmp_path):
    """examples/custom_loop.py: stopped at step 20, resumed to 40, equal to a run without the
    stop."""
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "custom_loop.py"),
                          str(tmp_path)], capture_output=True, text=True, timeout=TIMEOUT,
                         env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[1] stopped at step 20 of 40 (completed: False)" in out.stdout
    assert f"resumed from {tmp_path / 'run' / 'checkpoints'} at step 20" in out.stdout
    assert "[2] resumed and finished: 40 steps" in out.stdout
    diff = float(re.search(r"max \|difference\| (\S+)", out.stdout).group(1))
    assert diff < 1e-6
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [10, 20, 30, 40]


if __name__ == "__main__":   # the run test_sigterm_... stops: python tests/test_custom_loop.py WORKDIR
    run = config(num_cpu_devices=4)
    mesh_lib.simulate_cpu_devices(run.num_cpu_devices)
    summary = loop.train(run, sys.argv[1], task=Regression())
    sys.exit(128 + int(signal.Signals[summary["interrupted_by"]])
             if summary["interrupted_by"] else 0)
