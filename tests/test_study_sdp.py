"""python -m sdp_jax.study sdp on the tiny config: outputs, resume, skipping finished runs and
unrealizable coverages, one-line errors; the spectral-gap arm's schemes."""

import json
import os

import numpy as np
import pytest

from sdp_jax.spec import masks
from sdp_jax.study import __main__ as study
from sdp_jax.study import sdp as study_sdp
from sdp_jax.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [f"--lm_config={os.path.join(ROOT, 'configs', 'llama_tiny.py')}",
        "--lm_config.steps=4", "--lm_config.eval_every=2", "--lm_config.checkpoint_every=2",
        "--lm_config.optim.warmup_steps=1", "--arms=lm", "--variants=ddp,b-sdp",
        "--coverages=0.5", "--seeds=0", "--align_every=2"]


@pytest.mark.slow
@pytest.mark.xdist_group("study_sdp")
def test_study_writes_resumes_and_skips_finished_runs(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "study")
    # 1: stopped inside the first run (as if preempted at step 2): it exits, asking for a rerun
    train = loop.train

    def preempted(c, where):
        with c.unlocked():
            c.stop_at_step = 2
        return train(c, where)
    monkeypatch.setattr(loop, "train", preempted)
    with pytest.raises(SystemExit) as e:
        study.main(["sdp", *TINY, f"--out={out}"])
    monkeypatch.setattr(loop, "train", train)
    assert e.value.code == 1
    assert "rerun the same command to resume" in capsys.readouterr().err
    ddp = os.path.join(out, "lm", "seed0", "ddp")
    assert json.load(open(os.path.join(ddp, "summary.json")))["steps"] == 2
    # 2: the same command resumes the stopped run at step 2 and trains the rest
    rows = study.main(["sdp", *TINY, f"--out={out}"])
    steps = [json.loads(line)["step"] for line in open(os.path.join(ddp, "metrics.jsonl"))]
    assert steps == [1, 2, 3, 4]   # resumed after step 2, nothing trained twice
    assert [(r["variant"], r["budget"], r["steps"]) for r in rows] == [
        ("ddp", "step", 4), ("b-sdp", "step", 4), ("b-sdp", "flop", 8)]
    by = {(r["variant"], r["budget"]): r for r in rows}
    # DDP's gradient is the full model's; B-SDP's subnetworks' is not
    assert by["ddp", "step"]["grad_alignment"] == pytest.approx(1.0, abs=1e-5)
    assert by["ddp", "step"]["update_alignment"] == pytest.approx(1.0, abs=1e-5)
    assert by["b-sdp", "step"]["grad_alignment"] < 0.999
    # FLOP-matched: twice the steps at C = 1/2; the FLOPs of the run are counted, not assumed
    assert by["b-sdp", "flop"]["flops"] == pytest.approx(2 * by["b-sdp", "step"]["flops"])
    assert by["b-sdp", "step"]["flops"] < by["ddp", "step"]["flops"]
    assert by["b-sdp", "step"]["peak_bytes_per_device"] < by["ddp", "step"]["peak_bytes_per_device"]
    assert [c[0] for c in by["b-sdp", "flop"]["curve"]] == [2, 4, 6, 8]
    for name in ("study_sdp.json", "study_sdp.md", "lm_loss_vs_flops.png", "lm_pareto.png",
                 "lm_alignment.png"):
        assert os.path.getsize(os.path.join(out, name)) > 100, name
    table = open(os.path.join(out, "study_sdp.md")).read()
    loss = by["b-sdp", "flop"]["loss"]
    assert (f"| b-sdp | 0.5 | flop | 8 | {loss:.4f} | "
            f"{loss - by['ddp', 'step']['loss']:+.4f} |") in table
    assert json.load(open(os.path.join(out, "study_sdp.json")))[2]["loss"] == loss
    # 3: every run finished: nothing compiles or trains; an unrealizable coverage is skipped
    monkeypatch.setattr(loop, "make_step", lambda *a: pytest.fail("compiled a finished run"))
    again = study.main(["sdp", *TINY, "--coverages=0.5,0.375", f"--out={out}"])
    assert [r["loss"] for r in again if not r.get("skipped")] == [r["loss"] for r in rows]
    skipped = [r for r in again if r.get("skipped")]
    assert [(r["variant"], r["coverage"], r["budget"]) for r in skipped] == [
        ("b-sdp", 0.375, "step"), ("b-sdp", 0.375, "flop")]
    assert "C*G=1.5 components per worker for G=4" in skipped[0]["skipped"]
    assert "| b-sdp | 0.375 | step | - | skipped: " in open(os.path.join(out, "study_sdp.md")).read()


@pytest.mark.parametrize("flags, message", [
    (["--arms=lm,foo"], "--arms='lm,foo': choose distinct values from lm, digits, gap"),
    (["--coverages=0"], "--coverages='0': give distinct values in (0, 1), e.g. 0.5,0.375"),
    (["--coverages=1"], "--coverages='1': give distinct values in (0, 1)"),
    (["--seeds=0,0"], "--seeds='0,0': give distinct non-negative seeds"),
    (["--budgets=steps"], "--budgets='steps': choose distinct values from step, flop"),
    (["--arms=digits", f"--vision_config={os.path.join(ROOT, 'configs', 'llama_tiny.py')}"],
     "is not a vision config (the digits arm)"),
    (["--lm_config.sdp.scheme=zigzag"], "--lm_config: --lm_config.sdp.scheme='zigzag'; use one of "
     "cyclic, random, grouped"),
    (["--arms=lm", "--variants=b-sdp", "--lm_config.sdp.scheme=zigzag"],
     "--lm_config: --lm_config.sdp.scheme='zigzag'; use one of cyclic"),   # not a skipped run
    (["--arms=lm", "--variants=b-sdp", "--coverages=0.375"],
     "the lm arm: no variant of --variants is realizable at --coverages=0.375"),
    (["--arms=lm", "--lm_config.fsdp=True"], "--lm_config: --align_every=4: the gradient "
     "alignment is not built for FSDP"),
])
def test_bad_flags_are_one_line_errors(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        study.main(["sdp", *TINY[:-5], *flags, f"--out={tmp_path}"], check_only=True)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_plan_and_gap_schemes():
    """The gap arm's three schemes at one coverage: cyclic, random (mask seed = the seed)
    and grouped, whose mask graph is disconnected (gap 0) and needs allow_disconnected."""
    runs = study_sdp.plan(["lm", "gap"], ["ddp", "n-sdp"], [0.5], ["step", "flop"], [3], 0.5)
    assert [r["name"] for r in runs] == ["ddp", "n-sdp_c0.5_step", "n-sdp_c0.5_flop",
                                         "bb-sdp_c0.5_cyclic", "bb-sdp_c0.5_random",
                                         "bb-sdp_c0.5_grouped"]
    from sdp_jax.train import config as config_lib
    base = config_lib.base_config()
    c = study_sdp.run_config(base, runs[-1], 25)
    assert (c.sdp.scheme, c.sdp.mask_seed, c.sdp.allow_disconnected, c.seed) == (
        "grouped", 0, True, 3)   # (the mask seed is the random scheme's only)
    assert c.align_every == 25 and study_sdp.run_config(base, runs[2], 25).flop_matched
    g = masks.build_mask("grouped", 8, 8, 0.5)
    assert g.sum(1).tolist() == [4] * 8 and g.sum(0).tolist() == [4] * 8
    assert masks.spectral_gap(g) == 0.0 and masks.spectral_gap(
        masks.build_mask("cyclic", 8, 8, 0.5)) > 0.5
    assert np.array_equal(g[:4], np.tile([True] * 4 + [False] * 4, (4, 1)))
    with pytest.raises(ValueError, match="grouped scheme needs"):
        masks.build_mask("grouped", 8, 8, 0.375)


@pytest.mark.parametrize("flags, message", [
    (["--lm_config.stop_at_step=2"], "--lm_config.stop_at_step=2: the study trains every run "
     "to its end"),
    (["--arms=lm", "--variants=bb-sdp", "--budgets=flop"], "nothing to run: "),
    (["--arms=gap", "--gap_coverage=0.75"], "--gap_coverage=0.75: the grouped scheme needs"),
    (["--seeds=2147483648"], "give distinct non-negative seeds below 2**31"),
])
def test_refused_before_training(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        study.main(["sdp", *TINY[:-5], *flags, f"--out={tmp_path}"], check_only=True)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err


def test_subcommand_after_flags_is_named(capsys):
    with pytest.raises(SystemExit):
        study.main(["--out", "/tmp/x", "sdp"], check_only=True)
    assert "the subcommand comes first" in capsys.readouterr().err


def _fake_train(seen, diverge=()):
    """loop.train's stand-in: records the folder, writes the files a finished run leaves."""
    def train(c, where):
        seen.append(where)
        if c.sdp.scheme in diverge:
            raise FloatingPointError("non-finite train_loss at step 3")
        os.makedirs(where, exist_ok=True)
        loss = 2.0 + c.sdp.coverage + 0.01 * c.seed
        with open(os.path.join(where, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": c.steps, "val_loss": loss, "grad_alignment": 1.0}) + "\n")
        s = {"completed": True, "steps": c.steps, "final_val_loss": loss, "final_val_bpb": 3.0,
             "peak_bytes_per_device": 2**20, "model_flops_per_step": 1e9, "spectral_gap": 0.5,
             "wall_s": 1.0}
        with open(os.path.join(where, "summary.json"), "w") as f:
            json.dump(s, f)
        return s
    return train


def test_gap_arm_reuses_the_lm_run_and_pieces_add_up(tmp_path, monkeypatch):
    """The gap arm's cyclic run is the lm arm's bb-sdp step run (one folder); a diverged run
    is recorded and the study goes on; a later piece keeps the earlier pieces' rows."""
    seen = []
    monkeypatch.setattr(loop, "train", _fake_train(seen, diverge=("grouped",)))
    out = tmp_path / "s"
    study.main(["sdp", *TINY[:-5], "--arms=lm,gap", "--variants=ddp,bb-sdp", "--coverages=0.5",
                "--seeds=0", f"--out={out}"])
    lm, gap = out / "lm" / "seed0", out / "gap" / "seed0"
    assert seen == [str(lm / "ddp"), str(lm / "bb-sdp_c0.5_step"), str(lm / "bb-sdp_c0.5_step"),
                    str(gap / "bb-sdp_c0.5_random"), str(gap / "bb-sdp_c0.5_grouped")]
    table = (out / "study_sdp.md").read_text()
    assert "| grouped | 0.5 |  |  | diverged | 0 (1 diverged) |" in table
    study.main(["sdp", *TINY[:-5], "--arms=lm", "--variants=ddp", f"--out={out}",
                "--seeds=1"])
    rows = json.loads((out / "study_sdp.json").read_text())
    assert sorted((r["arm"], r["seed"], r["name"]) for r in rows) == [
        ("gap", 0, "bb-sdp_c0.5_cyclic"), ("gap", 0, "bb-sdp_c0.5_grouped"),
        ("gap", 0, "bb-sdp_c0.5_random"), ("lm", 0, "bb-sdp_c0.5_step"), ("lm", 0, "ddp"),
        ("lm", 1, "ddp")]
    assert "| ddp | 1 | - | 4 | 3.0050 [3.0000, 3.0100] |" in (out / "study_sdp.md").read_text()

    # rows of another config of the same arm, or a damaged file: refused before training
    with pytest.raises(SystemExit) as e:
        study.main(["sdp", *TINY[:-5], "--arms=lm", "--variants=ddp", f"--out={out}",
                    "--seeds=1", "--lm_config.optim.lr=0.01"])
    assert e.value.code == 2 and len(seen) == 6
    (out / "study_sdp.json").write_text('[{"arm": "lm"}]')
    with pytest.raises(SystemExit) as e:
        study.main(["sdp", *TINY[:-5], "--arms=lm", "--variants=ddp", f"--out={out}"])
    assert e.value.code == 2 and len(seen) == 6
