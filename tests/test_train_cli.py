"""End to end: the command line, resumption, refusal of foreign checkpoints, bad input."""

import gc
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import compact_opt_state, resume_from_old_layout

from sdp_jax.train import checkpoint as ckpt_lib
from sdp_jax.train import migrations
from sdp_jax.train import loop
from sdp_jax.train import optimizer as optim_lib
from sdp_jax.train.run import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
import llama_tiny  # noqa: E402


def tiny(**overrides):
    c = llama_tiny.get_config()
    for key, value in overrides.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_cli_trains_tiny_and_writes_outputs(tmp_path):
    wd = tmp_path / "run"
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--config",
         os.path.join(ROOT, "configs", "llama_tiny.py"), "--workdir", str(wd),
         "--config.steps=4", "--config.sdp.variant=b-sdp", "--config.sdp.coverage=0.5",
         "--config.peak_flops=1e12"],
        capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: 4 steps" in out.stdout
    recs = read_jsonl(wd / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all("train_loss" in r for r in recs) and "val_loss" in recs[-1]
    # model FLOPs of a worker's 2 of 4 blocks, per device, and MFU against the given peak
    from sdp_jax.models import llama
    cfg = tiny(**{"sdp.variant": "b-sdp", "sdp.coverage": 0.5})
    spec = resolve(cfg, 4)
    per_token = llama.model_flops_per_token(spec.model, cfg.seq_len, 2)
    assert per_token < llama.model_flops_per_token(spec.model, cfg.seq_len)
    for r in recs:
        assert r["model_flops_per_s_per_device"] == pytest.approx(
            r["tokens_per_s"] * per_token / 4, rel=1e-6)
        assert r["mfu"] == pytest.approx(r["model_flops_per_s_per_device"] / 1e12, rel=1e-6)
    # the resolved config beside the run, equal to what --print_config prints
    saved = json.loads((wd / "config.json").read_text())
    assert saved["steps"] == 4 and saved["sdp"]["variant"] == "b-sdp"
    assert saved["peak_flops"] == 1e12 and saved["optim"]["schedule"] == "cosine"
    printed = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--config",
         os.path.join(ROOT, "configs", "llama_tiny.py"), "--workdir", str(tmp_path / "none"),
         "--config.steps=4", "--config.sdp.variant=b-sdp", "--config.sdp.coverage=0.5",
         "--config.peak_flops=1e12", "--print_config"],
        capture_output=True, text=True, env=env, timeout=300)
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert json.loads(printed.stdout) == saved and not (tmp_path / "none").exists()
    # TensorBoard's own reader: every logged scalar at its steps, and the config as text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(wd))
    events.Reload()
    tags = events.Tags()
    for tag in ("train_loss", "grad_norm", "lr", "tokens_per_s", "model_flops_per_s_per_device",
                "mfu", "val_loss", "val_bpb"):
        assert tag in tags["scalars"], tags
    assert [e.step for e in events.Scalars("train_loss")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("train_loss")] == pytest.approx(
        [r["train_loss"] for r in recs])
    assert [e.step for e in events.Scalars("val_loss")] == [r["step"] for r in recs
                                                             if "val_loss" in r]
    assert events.Scalars("peak_bytes_per_device")[0].value > 0
    assert "config" in " ".join(tags["tensors"])
    summary = json.loads((wd / "summary.json").read_text())
    for key in ("variant", "coverage", "workers", "steps", "final_val_loss", "wall_s",
                "peak_bytes_per_device"):
        assert key in summary
    assert summary["variant"] == "b-sdp" and summary["coverage"] == 0.5 and summary["steps"] == 4
    assert summary["workers"] == 4 and summary["peak_bytes_per_device"] > 0
    assert (wd / "checkpoints" / "4").is_dir()


def test_cli_rejects_bad_coverage_before_compute(tmp_path):
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--config",
         os.path.join(ROOT, "configs", "llama_tiny.py"), "--workdir", str(tmp_path / "bad"),
         "--config.sdp.variant=b-sdp", "--config.sdp.coverage=0.3"],
        capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2
    assert "coverage C=0.3" in out.stderr and "nearest valid coverages" in out.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()


@pytest.mark.slow
def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path):
    common = {"sdp.variant": "b-sdp", "sdp.coverage": 0.5, "steps": 6, "eval_every": 3,
              "checkpoint_every": 0}
    loop.train(tiny(**common), str(tmp_path / "full"))
    s1 = loop.train(tiny(stop_at_step=3, **common), str(tmp_path / "resumed"))
    assert s1["steps"] == 3 and not s1["completed"]
    # ... resumed with 2 grain worker processes (a changed data.worker_count used to fail
    # with KeyError: 'next_index'; the data position is now the step)
    os.remove(tmp_path / "resumed" / "summary.json")   # as if killed before writing it ...
    from tensorboardX import SummaryWriter  # ... after logging a step it never checkpointed
    with SummaryWriter(str(tmp_path / "resumed")) as stale:
        stale.add_scalar("train_loss", 99.0, 5)
    first = ckpt_lib.CheckpointManager(str(tmp_path / "resumed" / "checkpoints")).read_meta(3)
    assert 0 < first["wall_s"] <= s1["wall_s"]
    t0 = time.time()
    s2 = loop.train(tiny(**common, **{"data.worker_count": 2}), str(tmp_path / "resumed"))
    assert s2["steps"] == 6 and s2["completed"]
    # both invocations: the first's time from its checkpoint, as the summary was gone. The
    # second's own time lies between what passed from its config.json (written after its
    # clock started) to its summary.json (written once the time was taken) and the whole call.
    run = tmp_path / "resumed"
    own_min = os.path.getmtime(run / "summary.json") - os.path.getmtime(run / "config.json")
    assert own_min - 0.5 <= s2["wall_s"] - first["wall_s"] <= time.time() - t0

    full = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    resumed = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    # TensorBoard: each step once across both invocations' event files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "resumed"))
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")] == list(range(1, 7))
    assert 99.0 not in [e.value for e in events.Scalars("train_loss")]   # purged
    np.testing.assert_allclose([r["train_loss"] for r in resumed],
                               [r["train_loss"] for r in full], rtol=1e-6)
    np.testing.assert_allclose(resumed[-1]["val_loss"], full[-1]["val_loss"], rtol=1e-6)

    def final_params(wd):
        m = ckpt_lib.CheckpointManager(str(wd / "checkpoints"))
        step = m.latest_step()
        assert step == 6
        import orbax.checkpoint as ocp
        out = m._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        return out["state"]["params"]

    a, b = final_params(tmp_path / "full"), final_params(tmp_path / "resumed")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-8)


@pytest.mark.slow
def test_fsdp_bf16_run_resumes_with_another_remat_and_refuses_another_layout(tmp_path):
    common = {"sdp.variant": "n-sdp", "sdp.coverage": 0.5, "fsdp": True, "dtype": "bfloat16",
              "steps": 4, "eval_every": 2, "checkpoint_every": 0}
    full = loop.train(tiny(remat="full", **common), str(tmp_path / "full"))
    assert full["fsdp"] and full["dtype"] == "bfloat16" and full["remat"] == "full"
    part = loop.train(tiny(remat="full", stop_at_step=2, **common), str(tmp_path / "res"))
    assert part["steps"] == 2 and not part["completed"]
    # activation checkpointing changes no result, so it may change on resume
    done = loop.train(tiny(remat="dots", **common), str(tmp_path / "res"))
    assert done["completed"] and done["steps"] == 4
    a = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    b = read_jsonl(tmp_path / "res" / "metrics.jsonl")
    np.testing.assert_allclose([r["train_loss"] for r in b], [r["train_loss"] for r in a],
                               rtol=1e-4)
    assert np.isfinite(done["final_val_loss"])
    # the state layout differs without FSDP: refused before compute, nothing overwritten
    ckpts = sorted(os.listdir(tmp_path / "res" / "checkpoints"))
    with pytest.raises(ValueError, match="fsdp: checkpoint has True, this run has False"):
        loop.train(tiny(remat="full", **{**common, "fsdp": False}), str(tmp_path / "res"))
    assert sorted(os.listdir(tmp_path / "res" / "checkpoints")) == ckpts


def test_non_finite_state_is_never_checkpointed(tmp_path, monkeypatch):
    """An update that overflows after a finite loss and gradient norm (what
    --config.optim.lr=1e39 did: every leaf of the step-1 checkpoint was NaN) is not saved;
    such learning rates are refused up front."""
    import jax.numpy as jnp

    real = optim_lib.lr_schedule
    monkeypatch.setattr(optim_lib, "lr_schedule", lambda optim, total: lambda count: jnp.where(
        count >= 1, jnp.float32(jnp.inf), real(optim, total)(count)))   # inf from step 2 on
    wd = tmp_path / "nan"
    cfg = tiny(steps=6, checkpoint_every=1, keep_checkpoints=3, eval_every=0)
    with pytest.raises(FloatingPointError, match="non-finite parameters .* after step 2 "
                                                 r".* the last checkpoint \(step 1\) is kept"):
        loop.train(cfg, str(wd))
    m = ckpt_lib.CheckpointManager(str(wd / "checkpoints"))
    assert m.latest_step() == 1
    m.close()
    monkeypatch.setattr(optim_lib, "lr_schedule", real)
    with pytest.raises(ValueError, match=r"optim\.lr=1e\+39 must be a finite number in "
                                         r"\(0, 3\.4e\+38\)"):
        resolve(tiny(**{"optim.lr": 1e39}), 4)
    with pytest.raises(ValueError, match="not a usable AdamW learning rate"):
        resolve(tiny(**{"optim.lr": 1e8}), 4)


def test_stop_at_the_checkpoints_step_says_nothing_was_saved(tmp_path, capsys):
    """``--config.stop_at_step`` at the step of the checkpoint a run resumes: no step runs and
    nothing is saved, and the last line says so (not "checkpoint saved"); a stop after a step
    that saved says that."""
    wd = str(tmp_path / "run")
    common = {"steps": 4, "eval_every": 0, "checkpoint_every": 2}
    loop.train(tiny(stop_at_step=2, **common), wd)
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "stopped at step 2 of 4 (checkpoint saved); rerun without --config.stop_at_step (or "
        "with a later step) to resume.")
    kept = os.listdir(os.path.join(wd, "checkpoints", "2", "state"))
    again = loop.train(tiny(stop_at_step=2, **common), wd)
    assert again["steps"] == 2 and not again["completed"]
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "stopped at step 2 of 4 without training: --config.stop_at_step=2 is not after the "
        "checkpoint's step 2, so no step ran and no checkpoint was written (step 2's is the "
        "latest); rerun without --config.stop_at_step (or with a later step) to go on.")
    m = ckpt_lib.CheckpointManager(os.path.join(wd, "checkpoints"))
    assert m.all_steps() == [2]
    m.close()
    assert os.listdir(os.path.join(wd, "checkpoints", "2", "state")) == kept


@pytest.mark.slow
def test_checkpoint_from_before_fsdp_and_dtype_existed_resumes(tmp_path):
    wd = tmp_path / "old"
    loop.train(tiny(stop_at_step=2, eval_every=2), str(wd))
    meta_file = wd / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    for key in ("fsdp", "dtype"):  # what a run of an earlier release recorded
        del meta["config"][key]
    meta_file.write_text(json.dumps(meta))
    done = loop.train(tiny(eval_every=2), str(wd))
    assert done["completed"] and done["steps"] == 6


def test_checkpoint_from_other_config_is_refused(tmp_path):
    wd = str(tmp_path / "run")
    loop.train(tiny(steps=2, eval_every=2), wd)
    before = sorted(os.listdir(os.path.join(wd, "checkpoints")))
    with pytest.raises(ValueError) as e:
        loop.train(tiny(steps=2, eval_every=2, **{"model.d_model": 64}), wd)
    msg = str(e.value)
    assert msg == (f"the checkpoint at step 2 in {wd}/checkpoints is incompatible with this run "
                   "(written by another run config), so it is not loaded: model.d_model: "
                   "checkpoint has 32, this run has 64. Use a new --workdir for this config, or "
                   "rerun with the checkpoint's values to resume it.")
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == before  # nothing overwritten
    with pytest.raises(ValueError, match="steps: checkpoint has 2, this run has 3 .*"
                                         r"--config\.optim\.schedule=wsd may be extended"):
        loop.train(tiny(steps=3, eval_every=2), wd)   # cosine: no extension


def _files(folder):
    """{path: (bytes, mtime)} of every file under ``folder`` but the lock."""
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(d, n)
            if n != ".lock":
                out[p] = (open(p, "rb").read(), os.stat(p).st_mtime_ns)
    return out


def test_a_run_refused_before_its_first_step_leaves_no_workdir(tmp_path, monkeypatch):
    """A step over the memory budget is refused after its compile, in one line, before the
    first step: a fresh workdir is then removed and an existing run's is left as it was
    (config.json, metrics, checkpoints); an allocation that fails anyway at the first step
    (XLA's RESOURCE_EXHAUSTED) is one line too, and leaves no fresh workdir either."""
    fresh, run = tmp_path / "fresh", tmp_path / "run"
    tight = {"sdp.memory_budget_gib": 1e-4, "steps": 2}
    with pytest.raises(ValueError, match=r"the compiled train step peaks at .* per device, "
                       r"over --config.sdp.memory_budget_gib=0.0001: it cannot run; lower") as e:
        loop.train(tiny(**tight), str(fresh))
    assert "\n" not in str(e.value) and not fresh.exists()
    loop.train(tiny(steps=2, stop_at_step=1), str(run))
    before = _files(run)
    assert any(p.endswith("metrics.jsonl") for p in before)
    with pytest.raises(ValueError, match="it cannot run"):
        loop.train(tiny(**tight), str(run))   # (the budget is no part of the trajectory)
    assert _files(run) == before

    def oom(self, state, batch, step):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                         "allocate 95.56GiB.\nmore of XLA's lines")
    monkeypatch.setattr(loop._Program, "one_step", oom)
    with pytest.raises(ValueError, match=r"^out of memory on the device \(Out of memory while "
                       r"trying to allocate 95.56GiB.\); lower the run's memory with an SDP "
                       r"variant .*--config.remat=full") as e:
        loop.train(tiny(steps=2), str(fresh))
    assert "\n" not in str(e.value) and not fresh.exists()


def test_a_workdir_in_use_is_refused(tmp_path):
    """Two runs in one workdir interleaved their metrics and hung on orbax's lock: the second
    is refused, naming the holder, before any compute; the lock goes with its holder."""
    wd = tmp_path / "run"
    wd.mkdir()
    other = loop.WorkdirLock(str(wd))
    other.acquire()
    with pytest.raises(ValueError, match=f"in use by another run .*pid {os.getpid()}"):
        loop.train(tiny(steps=2), str(wd))
    assert not (wd / "checkpoints").exists() or not os.listdir(wd / "checkpoints")
    other.release()
    assert loop.train(tiny(steps=2, eval_every=2), str(wd))["completed"]


@pytest.mark.slow
def test_wsd_run_extends_as_if_planned_longer(tmp_path):
    """Under the warm-up-stable-decay schedule ``steps`` may grow on resume: a 4-step run
    stopped at step 2 (before its cool-down) and extended to 6 steps is the 6-step run."""
    common = {"optim.schedule": "wsd", "optim.warmup_steps": 1, "eval_every": 0,
              "checkpoint_every": 0}
    full = loop.train(tiny(steps=6, **common), str(tmp_path / "full"))
    wd = str(tmp_path / "extended")
    loop.train(tiny(steps=4, stop_at_step=2, **common), wd)
    out = loop.train(tiny(steps=6, **common), wd)
    assert out["completed"] and out["steps"] == 6
    np.testing.assert_allclose(
        [r["train_loss"] for r in read_jsonl(tmp_path / "extended" / "metrics.jsonl")],
        [r["train_loss"] for r in read_jsonl(tmp_path / "full" / "metrics.jsonl")], rtol=1e-6)
    np.testing.assert_allclose(out["final_val_loss"], full["final_val_loss"], rtol=1e-6)
    with pytest.raises(ValueError, match="steps: checkpoint has 6, this run has 5"):
        loop.train(tiny(steps=5, **common), wd)   # grows only
    # every finished run drew its curves; python -m sdp_jax.tools.plot compares the two
    from matplotlib.image import imread

    from sdp_jax.tools import plot
    for run in ("full", "extended"):
        assert imread(tmp_path / run / "curves.png").shape[2] in (3, 4)
    out = plot.main([str(tmp_path / "full"), str(tmp_path / "extended"), "--out",
                     str(tmp_path / "cmp")])
    assert out == str(tmp_path / "cmp" / "curves.png")
    wide = imread(out)   # three panels: steps, tokens, FLOPs
    assert wide.shape[1] > 2.5 * imread(tmp_path / "full" / "curves.png").shape[0]
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["items_per_step"] == 4 * 2 * 32 and summary["item"] == "tokens"
    assert summary["model_flops_per_step"] > 0
    with pytest.raises(SystemExit) as e:
        plot.main([str(tmp_path)])   # not a run directory
    assert e.value.code == 2


@pytest.mark.parametrize("overrides,fragment", [
    ({"workers": 16}, "only 8 devices"),
    ({"seq_len": 1000}, "exceeds model.max_seq_len"),
    ({"sdp.variant": "x-sdp"}, "config.sdp.variant='x-sdp'; use one of ddp, b-sdp"),
    ({"sdp.variant": "b-sdp", "sdp.coverage": 0.25}, "disconnected"),
    ({"remat": "some"}, "config.remat='some'"),
    ({"dtype": "float16"}, "config.dtype='float16'"),
    ({"fsdp": True, "sdp.variant": "b-sdp", "sdp.coverage": 0.5, "sdp.average": "parameters",
      "sdp.sync_every": 2}, "one sharded copy"),
    ({"data.source": "text", "data.train_files": "/nonexistent/*.txt"}, "/nonexistent/*.txt"),
    ({"profile_start": 3}, "config.profile_start=3 with config.profile_stop=0: give both"),
    ({"profile_start": 3, "profile_stop": 2}, "config.profile_stop=2 is before"),
    ({"profile_start": 7, "profile_stop": 9}, "config.profile_start=7 is past the run's last"),
    ({"profile_stop": -1}, "config.profile_stop=-1 must be an integer >= 0"),
])
def test_bad_config_raises_before_compute(tmp_path, overrides, fragment):
    with pytest.raises(ValueError, match=fragment.replace("*", r"\*").replace(".", r"\.")):
        loop.train(tiny(**overrides), str(tmp_path / "bad"))
    assert not (tmp_path / "bad" / "checkpoints").exists()


def _cli(args, **kw):
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config",
                           os.path.join(ROOT, "configs", "llama_tiny.py"), *args],
                          capture_output=True, text=True, env=env, timeout=300, **kw)


def test_misspelled_override_without_config_is_one_line(tmp_path):
    """Without --config (the default config file) a misspelled field printed a 49-line
    traceback."""
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"),
                          "--config.sdp.varient=n-sdp", f"--workdir={tmp_path / 'w'}"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "unknown config field 'varient'" in out.stderr and "variant" in out.stderr


def test_an_incompatible_checkpoint_is_refused_in_one_line(tmp_path):
    """Many differing fields: one line, the first four in full, the others by name; a mask
    hash cut short; the masks folded into one item when other fields differ too (listed in
    full when they alone differ); the fix last."""
    import jax.numpy as jnp
    saved = {"config": {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6}, "workers": 8,
             "masks": {"mask_sha256": "e" * 64, "recipes": {"block": {"workers": 8}}}}
    m = ckpt_lib.CheckpointManager(str(tmp_path / "c"))
    m.save(1, {"w": jnp.zeros((4,))}, saved)
    m.close()
    m = ckpt_lib.CheckpointManager(str(tmp_path / "c"))
    now = {"config": {"a": 1, "b": 20, "c": 30, "d": 40, "e": 50, "f": 60}, "workers": 6,
           "masks": {"mask_sha256": "a" * 64, "recipes": {"block": {"workers": 6}}}}
    try:
        with pytest.raises(ValueError) as e:
            m.check_compatible(1, now)
        assert str(e.value) == (
            f"the checkpoint at step 1 in {tmp_path / 'c'} is incompatible with this run "
            "(written by another run config), so it is not loaded: b: checkpoint has 2, this "
            "run has 20; c: checkpoint has 3, this run has 30; d: checkpoint has 4, this run "
            "has 40; e: checkpoint has 5, this run has 50; and 3 more (f, workers, masks). Use "
            "a new --workdir for this config, or rerun with the checkpoint's values to resume "
            "it.")
        with pytest.raises(ValueError) as e:
            m.check_compatible(1, {**now, "config": saved["config"], "workers": 8})
        assert ("so it is not loaded: masks.mask_sha256: checkpoint has "
                "'eeeeeeeeeeeeeeeeeeeeeee…, this run has 'aaaaaaaaaaaaaaaaaaaaaaa…; "
                "masks.recipes.block.workers: checkpoint has 8, this run has 6. Use a new"
                ) in str(e.value)
    finally:
        m.close()


def test_checkpoint_of_another_layout_is_incompatible_not_damaged(tmp_path):
    """A readable checkpoint whose arrays do not fit this run is called incompatible (and
    never advised for deletion); a truncated one is damaged
    (test_damaged_checkpoint_is_reported_before_compute)."""
    import jax.numpy as jnp
    m = ckpt_lib.CheckpointManager(str(tmp_path / "c"))
    m.save(1, {"w": jnp.zeros((4,)), "b": jnp.zeros((2,))}, {"config": {}, "masks": {}})
    m.close()
    m = ckpt_lib.CheckpointManager(str(tmp_path / "c"))
    abstract = {"w": jax.ShapeDtypeStruct((5,), jnp.float32),
                "b": jax.ShapeDtypeStruct((2,), jnp.float32)}

    def no_read(*_, **__):   # refused from the metadata: no array read starts (one that fails
        raise AssertionError("a read started")   # part-way leaves orbax's others unfinished)
    real_restore, m._mngr.restore = m._mngr.restore, no_read
    with pytest.raises(ValueError) as e:
        m.restore(1, abstract)
    m._mngr.restore = real_restore
    np.testing.assert_array_equal(m.restore(1, {**abstract, "w": jax.ShapeDtypeStruct(
        (4,), jnp.float32)})["w"], np.zeros(4))   # the stored layout is read as before
    m.close()
    msg = str(e.value)
    assert msg == (f"the checkpoint at step 1 in {tmp_path / 'c'} is incompatible with this run: "
                   "it holds another parameter layout (['w']: checkpoint (4,), this run (5,)); "
                   "use a new --workdir for this run, or the code and config that wrote it to "
                   "resume it.")
    assert "damaged" not in msg and "delete" not in msg and "aside" not in msg
    # A checkpoint from before the resolved W was recorded (llama_1b had workers=8, now 0 =
    # every device): its explicit workers is compared with this run's W.
    m = ckpt_lib.CheckpointManager(str(tmp_path / "old"))
    m.save(1, {"w": jnp.zeros((4,))}, {"config": {"workers": 8, "seed": 0}, "masks": {}})
    m.close()
    m = ckpt_lib.CheckpointManager(str(tmp_path / "old"))
    try:
        m.check_compatible(1, {"config": {"workers": 0, "seed": 0}, "masks": {}, "workers": 8})
        with pytest.raises(ValueError, match="trained by W = 8 workers, this run has W = 4"):
            m.check_compatible(1, {"config": {"workers": 0, "seed": 0}, "masks": {},
                                   "workers": 4})
    finally:
        m.close()


@pytest.mark.slow
def test_cli_config_mistakes_are_one_line_errors(tmp_path):
    out = _cli(["--workdir", str(tmp_path / "a"), "--config.sdp.coverag=0.5"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unknown config field 'coverag'" in out.stderr and 'Did you mean "coverage"' in out.stderr
    out = _cli(["--workdir", str(tmp_path / "a"), "--config.optim.lr=-1"])
    assert out.returncode == 2 and "optim.lr=-1.0 must be a finite number in (0, " in out.stderr
    (tmp_path / "file").write_text("x")
    out = _cli(["--workdir", str(tmp_path / "file")])
    assert out.returncode == 2 and "is not a directory" in out.stderr
    bad = tmp_path / "bad_config.py"   # a value of the wrong type set in a config file
    bad.write_text(f"import sys\nsys.path.insert(0, {os.path.join(ROOT, 'configs')!r})\n"
                   "import llama_tiny\n\ndef get_config():\n    c = llama_tiny.get_config()\n"
                   "    c.seq_len = 32.0\n    return c\n")
    out = _cli(["--workdir", str(tmp_path / "a"), "--config", str(bad)])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "Could not override field 'seq_len'" in out.stderr


def _as_from_a_terminal():
    """Popen preexec_fn: SIGINT handled by default, as in a terminal (a background job, which
    pytest may be, ignores it, and train.py keeps a signal it was started ignoring)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_at(tmp_path, name, when, signals):
    """Start train.py, wait until ``when(stdout so far, workdir)`` holds, send ``signals``
    (0.3 s apart); returns (status, stdout, stderr)."""
    import selectors
    import time
    wd = tmp_path / name
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    args = [sys.executable, os.path.join(ROOT, "train.py"), "--config",
            os.path.join(ROOT, "configs", "llama_tiny.py"), "--workdir", str(wd),
            "--config.steps=400", "--config.checkpoint_every=0", "--config.eval_every=0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=_as_from_a_terminal)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    seen, deadline = "", time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None and not when(seen, wd):
            if sel.select(timeout=0.05):
                seen += proc.stdout.readline()
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.1)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, seen + out, err


@pytest.mark.parametrize("moment, signals", [
    ("start", [2]), ("data", [15]), ("compile", [2]), ("training, twice", [15, 15]),
])
def test_a_signal_at_any_moment_is_one_line(tmp_path, moment, signals):
    """Ctrl-C during data loading or compilation printed a 55-line traceback and then a
    segmentation fault (exit 139); now every moment gives at most one line and 128 + signal.
    (Twice in training: the second signal aborts with one line, unless the first one's stop
    and save were already done, which exits cleanly.) A fresh run stopped before its first step
    leaves no workdir (it used to leave .lock and an empty checkpoints/)."""
    import time
    t0 = time.time()
    when = {"start": lambda out, wd: time.time() - t0 > 1.0,
            "data": lambda out, wd: "data stdlib" in out,
            "compile": lambda out, wd: "mask graph" in out,
            # (a logged step: metrics.jsonl itself is created just before the loop's handler)
            "training, twice": lambda out, wd: (wd / "metrics.jsonl").exists() and bool(
                (wd / "metrics.jsonl").read_text().strip())}[moment]
    code, out, err = _signal_at(tmp_path, moment.split(",")[0], when, signals)
    assert code == 128 + signals[0], (out[-1000:], err[-2000:])
    assert "Traceback" not in err and "Segmentation" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln]
    if len(signals) == 1:
        assert len(lines) == 1 and "interrupted by SIG" in lines[0], err[-2000:]
        # stopped before its first step: the fresh workdir is not left behind (issue 47)
        assert not (tmp_path / moment).exists(), os.listdir(tmp_path / moment)
    else:
        assert len(lines) <= 1 and all("interrupted by SIGTERM" in ln for ln in lines), err
        assert "SIGTERM: stopping after this step" in out


@pytest.mark.slow
def test_sigint_saves_a_checkpoint_and_the_run_resumes(tmp_path):
    import signal
    import time
    wd = tmp_path / "run"
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    args = [sys.executable, os.path.join(ROOT, "train.py"), "--config",
            os.path.join(ROOT, "configs", "llama_tiny.py"), "--workdir", str(wd),
            "--config.steps=400", "--config.checkpoint_every=0", "--config.eval_every=0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=_as_from_a_terminal)
    metrics = wd / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "interrupted by SIGINT" in out
    m = ckpt_lib.CheckpointManager(str(wd / "checkpoints"))
    step = m.latest_step()
    m.close()
    assert step is not None and 3 <= step < 400
    assert read_jsonl(metrics)[-1]["step"] == step
    s = loop.train(tiny(steps=400, checkpoint_every=0, eval_every=0, stop_at_step=step + 2),
                      str(wd))
    assert s["steps"] == step + 2
    assert [r["step"] for r in read_jsonl(metrics)] == list(range(1, step + 3))


# Upstream (orbax-checkpoint 0.12.8), met only by a checkpoint damaged on purpose: a restore
# runs its reads in a fresh event loop (orbax/checkpoint/_src/asyncio_utils.py,
# _run_sync_via_new_loop: run_until_complete, then close) and gathers them with asyncio.gather
# (serialization.py, _read_and_create_array), which does not cancel the other reads when one
# fails. The loop is closed with those reads pending: their TensorStore callbacks then call
# call_soon_threadsafe on the closed loop ("Event loop is closed"), and when collected each
# turns its GeneratorExit into an Exception (`except BaseException` in
# _read_array_index_and_device_put): "Exception ignored in: <coroutine object ...>". A truncated
# file is found only by reading it; every other refusal of a checkpoint (another config, other
# masks, another parameter layout) is decided from its metadata before any read starts
# (sdp_jax.train.checkpoint.CheckpointManager.restore), and prints nothing of the kind.
@pytest.mark.filterwarnings("ignore:(?s)Exception ignored in. None.*Event loop is closed"
                            ":pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore:(?s)Exception ignored in. <coroutine object "
                            "_read_array_index_and_device_put:"
                            "pytest.PytestUnraisableExceptionWarning")
def test_damaged_checkpoint_is_reported_before_compute(tmp_path):
    wd = tmp_path / "run"   # stopped at step 4 of 6 (a finished run is not restored again)
    loop.train(tiny(steps=6, checkpoint_every=2, eval_every=0, stop_at_step=4), str(wd))
    state_dir = wd / "checkpoints" / "4" / "state" / "d"
    victim = sorted(state_dir.iterdir())[0]
    with open(victim, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError) as e:
        loop.train(tiny(steps=6, checkpoint_every=2, eval_every=0), str(wd))
    msg = str(e.value)
    assert "checkpoint at step 4" in msg and "is damaged" in msg and "delete" not in msg
    assert f"move {wd / 'checkpoints' / '4'} aside" in msg and "resume from step 2" in msg
    assert victim.stat().st_size == 100  # nothing rewritten
    gc.collect()   # orbax's abandoned reads are finalized here, under this test's filters


_GLOO = ("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] "
         "Connection closed by peer [127.0.0.1]:17545")


@pytest.mark.parametrize("item", ["meta", "state"])
def test_a_failed_collective_during_a_read_is_not_a_damaged_checkpoint(tmp_path, monkeypatch,
                                                                       item):
    """Issue 47: a read of an intact checkpoint that fails because the processes around it
    failed (a peer died: gloo's 'Connection closed by peer', orbax's TimeoutError waiting for
    a key, a reset connection) used to be reported as a damaged checkpoint, advising to move it
    aside. With several processes it is now ReadFailed, one line saying the files are intact,
    and nothing on disk changes; with one process, or for another error (out of memory), the
    error is raised as it is. A checkpoint whose own metadata does not parse is damaged,
    whatever the error was; the checkpoint then resumes."""
    import orbax.checkpoint as ocp
    wd = tmp_path / "run"
    loop.train(tiny(steps=6, checkpoint_every=2, eval_every=0, stop_at_step=4), str(wd))
    before = _files(wd / "checkpoints")
    real, raised = ocp.CheckpointManager.restore, []

    def failing(self, step, *a, args=None, **kw):
        if args is not None and item in args.keys():
            raise raised[-1]
        return real(self, step, *a, args=args, **kw)
    monkeypatch.setattr(ocp.CheckpointManager, "restore", failing)
    manager = ckpt_lib.CheckpointManager(str(wd / "checkpoints"))
    read = ((lambda: manager.read_meta(4)) if item == "meta" else
            (lambda: manager.restore(4, _state_of(wd))))
    peer_faults = [jax.errors.JaxRuntimeError(_GLOO),
                   TimeoutError("Timeout waiting for key 'orbax/restore/barrier' after 600 s"),
                   ConnectionResetError(104, "Connection reset by peer")]
    for processes in (2, 1):
        monkeypatch.setattr(ckpt_lib, "_processes", lambda n=processes: n)
        for err in peer_faults + [RuntimeError("RESOURCE_EXHAUSTED: out of memory")]:
            raised.append(err)
            if processes == 2 and err in peer_faults:
                with pytest.raises(ckpt_lib.ReadFailed) as e:
                    read()
                msg = str(e.value)
                assert msg.startswith("reading the checkpoint at step 4 in ") and "\n" not in msg
                assert f"({item}: {type(err).__name__}: {str(err).splitlines()[0][:40]}" in msg
                assert "the checkpoint is intact and kept: rerun to resume" in msg
                assert "damaged" not in msg and "aside" not in msg and "delete" not in msg
            else:   # one process, or not a failure of the processes: as it is
                with pytest.raises(type(err)) as e:
                    read()
                assert e.value is err
    manager.close()
    assert _files(wd / "checkpoints") == before   # nothing moved, written or removed
    monkeypatch.setattr(ckpt_lib, "_processes", lambda: 2)
    raised.append(peer_faults[0])
    # its own metadata unreadable: damaged, with the fallback, even after such an error
    name = "meta/metadata" if item == "meta" else "state/_METADATA"
    meta = wd / "checkpoints" / "4" / name
    text = meta.read_text()
    meta.write_text(text[: len(text) // 2])
    manager = ckpt_lib.CheckpointManager(str(wd / "checkpoints"))
    with pytest.raises(ValueError, match=r"checkpoint at step 4 .* is damaged \(" + item
                       + r": OSError: .*" + name.split("/")[1] + r": JSONDecodeError"):
        read()
    manager.close()
    meta.write_text(text)
    monkeypatch.undo()
    s = loop.train(tiny(steps=6, checkpoint_every=2, eval_every=0), str(wd))
    assert s["completed"] and s["steps"] == 6


def _state_of(wd):
    """The abstract train state of the tiny run's checkpoints in ``wd``."""
    run = resolve(tiny(steps=6), jax.device_count())
    return loop.make_step(run, loop.make_mesh(run)).abstract_state()


@pytest.mark.slow
@pytest.mark.parametrize("variant,extra", [
    ("n-sdp", {}), ("bb-sdp", {}), ("nb-sdp", {}),
    ("b-sdp", {"sdp.average": "parameters", "sdp.sync_every": 2}),
])
def test_loop_runs_every_variant(tmp_path, variant, extra):
    s = loop.train(tiny(steps=3, eval_every=0, **{"sdp.variant": variant,
                                                     "sdp.coverage": 0.5}, **extra),
                      str(tmp_path / variant))
    assert s["completed"] and s["variant"] == variant and s["coverage"] == 0.5
    assert s["regime"] == ("backward" if variant in ("bb-sdp", "nb-sdp") else "forward")
    assert s["spectral_gap"] > 0 and np.isfinite(s["final_val_loss"])
    again = loop.train(tiny(steps=3, eval_every=0, **{"sdp.variant": variant,
                                                         "sdp.coverage": 0.5}, **extra),
                          str(tmp_path / variant))
    assert again == s  # a finished run is not redone and keeps its figures


def test_sync_every_without_parameter_averaging_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sync_every=3 only applies with"):
        loop.train(tiny(**{"sdp.sync_every": 3}), str(tmp_path / "x"))


def test_config_without_a_schema_field_is_refused():
    """One schema (sdp_jax.train.config): a hand-written config that lacks a field is refused by the
    validation, naming the field, its default and where the schema comes from, instead of
    failing later with an AttributeError."""
    from sdp_jax.train.config import vision_config
    from sdp_jax.train.run import resolve
    c = tiny()
    del c.sdp["method"]
    with pytest.raises(ValueError, match=r"config\.sdp\.method is missing; build the run config "
                                         r"on sdp_jax\.train\.config\.base_config\(\) \(default "
                                         r"sdp\.method: 'auto'\)"):
        resolve(c, 8)
    v = vision_config("resnet18", "digits")
    del v["fsdp"]
    with pytest.raises(ValueError, match=r"config\.fsdp is missing; .*vision_config\(\)"):
        resolve(v, 8)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.sdp.__setattr__("coverge", 0.5), r"config\.sdp\.coverge is not a field of a "
                                                  r"language-model run config"),
    (lambda c: c.__setattr__("stepz", 3), r"config\.stepz is not a field"),
    (lambda c: c.model.__setattr__("name", "resnet18"),
     r"model\.name='resnet18' but the model section has fields of another model"),
    (lambda c: c.__setattr__("seed", 2**32 - 1), r"config\.seed=4294967295 must be an integer in \[0, 2147483648\)"),
    (lambda c: c.sdp.__setattr__("coverage", float("nan")), r"coverage=nan must be a number"),
])
def test_hand_written_config_mistakes_are_refused(edit, match):
    """What a typo or a switched model name in a get_config() file used to do silently (train
    with the field ignored, or with another model's defaults) is refused by the validation."""
    from sdp_jax.train.run import resolve
    c = tiny()
    edit(c)
    with pytest.raises(ValueError, match=match):
        resolve(c, 8)


def test_workdir_entries_of_the_wrong_kind_and_a_changed_worker_count(tmp_path):
    """A workdir whose checkpoints/ is a file is refused before compute; a checkpoint records
    the resolved worker count (config.workers=0 is every device, which can change between
    launches) and is refused under another one."""
    wd = tmp_path / "run"
    wd.mkdir()
    (wd / "checkpoints").write_text("x")
    with pytest.raises(ValueError, match="checkpoints' exists and is not a directory"):
        loop.train(tiny(steps=2, eval_every=2), str(wd))
    (wd / "checkpoints").unlink()
    loop.train(tiny(steps=2, eval_every=2), str(wd))
    from sdp_jax.train.run import resolve
    c = tiny(steps=2, eval_every=2)
    meta = loop._meta(c, resolve(c, 8))
    assert meta["workers"] == 4
    manager = ckpt_lib.CheckpointManager(str(wd / "checkpoints"))
    try:
        manager.check_compatible(2, meta)   # the same run resumes
        with pytest.raises(ValueError, match=r"trained by W = 4 workers, this run has W = 8 "
                                             r".*resume with --config.workers=4"):
            manager.check_compatible(2, {**meta, "workers": 8})
        # How W was asked for does not matter (workers=0 on 4 devices is W = 4 too).
        asked = {**meta, "config": {**meta["config"], "workers": 0}}
        manager.check_compatible(2, asked)
    finally:
        manager.close()


@pytest.mark.slow
def test_backward_masking_resumes_a_checkpoint_of_the_compact_optimizer_state(tmp_path):
    """Checkpoints of bb-sdp written before the sharded update (ZeRO-2: the optimizer state in
    layout S) stored each worker's compact optimizer state: they resume, converted, to the
    same result as the run that never stopped."""
    import shutil

    import orbax.checkpoint as ocp
    c = tiny(**{"sdp.variant": "bb-sdp", "sdp.coverage": 0.5, "steps": 6, "eval_every": 6,
                "checkpoint_every": 3, "stop_at_step": 3})
    a, b = tmp_path / "a", tmp_path / "b"
    loop.train(c, str(a))
    shutil.copytree(a, b)
    spec = resolve(c, 4)
    builder = loop.make_step(spec, loop.make_mesh(spec))
    (_, from_old), = migrations.layouts(builder)
    abstract = builder.abstract_state()
    path = b / "checkpoints" / "3" / "state"
    ck = ocp.StandardCheckpointer()
    state = ck.restore(path, abstract)
    mu = builder.full_params(state["opt_state"][0].mu, optimizer_layout=True)
    assert all(np.abs(x).max() > 0 for x in jax.tree.leaves(mu))
    # the same moments, compact: each worker's held components, as the earlier step stored them
    old_opt = compact_opt_state(builder, state)
    back = from_old({**state, "opt_state": old_opt})["opt_state"]
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(state["opt_state"]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))   # two holders: exact
    resume_from_old_layout(ck, path, {**state, "opt_state": old_opt}, abstract, c, a, b)


def _traces(wd):
    """The trace folders a run wrote (``plugins/profile/<time>``) and their files."""
    root = wd / "profile" / "process_0" / "plugins" / "profile"
    return {d.name: sorted(f.name for f in d.iterdir()) for d in root.iterdir()}


@pytest.mark.slow
def test_profile_window_writes_a_trace_also_when_the_run_stops_inside_it(tmp_path, capsys):
    """--config.profile_start/profile_stop: steps 2..3 of a tiny run traced into
    WORKDIR/profile/process_0 (TensorBoard's xplane.pb and a Perfetto trace, non-empty). The
    first invocation stops at step 2 (stop_at_step) inside the window: its trace is still
    written; the resumed invocation traces the rest of the window (step 3) in a second
    folder, and the steps' outputs are those of a run without profiling."""
    wd = tmp_path / "run"
    c = tiny(steps=4, eval_every=0, checkpoint_every=0, profile_start=2, profile_stop=3,
             stop_at_step=2)
    loop.train(c, str(wd))
    out = capsys.readouterr().out
    assert "profile: tracing steps 2..3" in out
    assert "profile of steps 2..2 (the run stopped inside the window 2..3) written to" in out
    first = _traces(wd)
    assert len(first) == 1
    files = next(iter(first.values()))
    assert "perfetto_trace.json.gz" in files and any(f.endswith(".xplane.pb") for f in files)
    folder = wd / "profile" / "process_0" / "plugins" / "profile" / next(iter(first))
    assert all((folder / f).stat().st_size > 0 for f in files)
    time.sleep(1.1)   # (jax names a trace folder by the second)
    c.stop_at_step = 0
    loop.train(c, str(wd))
    out = capsys.readouterr().out
    assert "profile: tracing steps 3..3" in out and "profile of steps 3..3 written to" in out
    assert len(_traces(wd)) == 2
    plain = tiny(steps=4, eval_every=0, checkpoint_every=0)
    loop.train(plain, str(tmp_path / "plain"))
    got, want = (read_jsonl(p / "metrics.jsonl") for p in (wd, tmp_path / "plain"))
    assert [r["train_loss"] for r in got] == [r["train_loss"] for r in want]
    assert not (tmp_path / "plain" / "profile").exists()


def test_profile_window_is_stopped_by_an_error_inside_it(tmp_path):
    """A step that raises inside the window leaves a written trace and no running profiler
    (a new trace can start)."""
    import jax.numpy as jnp
    from sdp_jax.train import profiling
    lines = []

    def one_step(state, batch, n):
        if n == 3:
            raise FloatingPointError("non-finite")
        return state @ state, {"x": jnp.sum(state)}

    with pytest.raises(FloatingPointError):
        with profiling.StepWindow(str(tmp_path), 2, 5, 0, lines.append) as window:
            step, state = window.wrap(one_step), jnp.eye(8)
            for n in (1, 2, 3):
                state, _ = step(state, None, n)
    assert lines[0] == f"profile: tracing steps 2..5 into {tmp_path}/profile/process_0"
    assert "profile of steps 2..2 (the run stopped inside the window 2..5)" in lines[1]
    run = profiling.latest_trace(profiling.trace_dir(str(tmp_path)))
    assert run and any(f.endswith(".xplane.pb") and os.path.getsize(os.path.join(run, f))
                       for f in os.listdir(run))
    jax.profiler.start_trace(str(tmp_path / "again"))   # the profiler was stopped
    jax.profiler.stop_trace()
