"""The prepared device command (python -m sdp_jax.bench.device, issue 37): its dry run on tiny
models here, so that the command a lent GPU runs cannot rot; its flags' one-line errors."""

import json
import os
import subprocess
import sys

import pytest

from sdp_jax.bench import device, measure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_dry_run_writes_every_table(tmp_path):
    """Every section on tiny models (the CPU's one device): ours against plain jit, the worker
    floor (8 and 11 of 16 blocks), the attention implementations (cudnn named as not run
    here), the FLOP-matched pair with 8 emulated workers; the tables and rows written."""
    out = tmp_path / "device"
    proc = subprocess.run([sys.executable, "-m", "sdp_jax.bench.device", "--dry_run",
                           "--out", str(out), "--budget_s", "600"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == sorted(device.FILES)
    rows = json.loads((out / "device_rows.json").read_text())
    jit = {r["setting"]: r for r in rows["jit"]}
    assert set(jit) == {"ours-ddp", "jit-ddp", "jit-ddp 8/16", "jit-ddp 11/16"}
    for r in jit.values():
        assert len(r["step_times_s"]) == device.DRY.steps and r["compiled_peak_bytes"] > 0
    full = jit["jit-ddp"]
    for k in (8, 11):   # a worker of k blocks: fewer FLOPs and bytes than the whole model
        r = jit[f"jit-ddp {k}/16"]
        assert k / 16 < r["model_flops_per_step"] / full["model_flops_per_step"] < 1
        assert r["compiled_peak_bytes"] < full["compiled_peak_bytes"]
    attention = {r["attention"]: r for r in rows["attention"]}
    assert set(attention) == set(device.ATTENTION)
    assert "GPU" in attention["cudnn"]["error"] and "step_time_s" not in attention["cudnn"]
    assert attention["chunked"]["step_time_s"] > 0 and attention["dot_product"]["error"] is None
    ddp, bsdp = rows["pair"]
    assert (ddp["setting"], bsdp["setting"]) == ("ddp", "b-sdp")
    assert ddp["completed"] and bsdp["completed"] and bsdp["steps"] == 2 * ddp["steps"]
    assert ddp["workers"] == bsdp["workers"] == 8
    assert 0.9 < bsdp["model_flops"] / ddp["model_flops"] < 1.2   # FLOP-matched
    text = (out / "device_tables.md").read_text()
    for title in ("Our DDP step against plain jax.jit", "Worker floor", "measured peak",
                  "Attention implementations", "FLOP-matched pair"):
        assert title in text
    assert "| llama_500m | 8/16 | 0.5 |" in text and "not run: ValueError" in text
    assert "jax 0." in text


def test_a_section_without_time_is_skipped_and_said(tmp_path, capsys):
    assert device.main(["--dry_run", "--out", str(tmp_path), "--budget_s", "1"]) == 0
    text = (tmp_path / "device_tables.md").read_text()
    assert "- jit: skipped" in text and "- pair: skipped" in text
    env = (tmp_path / "environment.txt").read_text()   # read in a child process
    assert "jax 0." in env and "flax" in env and "jaxlib" in env


def test_no_accelerator_without_dry_run_is_one_line(tmp_path, capsys):
    """The full-size models on a CPU would run out of memory: refused after the environment
    is read (in a child; this process starts no backend for the command)."""
    with pytest.raises(SystemExit) as e:
        device.main(["--out", str(tmp_path), "--sections", "jit"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "no accelerator: JAX's backend is cpu" in err[-1] and "--dry_run" in err[-1]
    assert (tmp_path / "environment.txt").exists() and not (tmp_path / "device_rows.json").exists()


@pytest.mark.parametrize("args,fragment", [
    (["--budget_s", "0"], "--budget_s=0.0 must be a positive number"),
    (["--budget_s", "1e9"], "at most 86400"),
    (["--sections", "jit,gpu"], "--sections=jit,gpu: choose each at most once from"),
    (["--sections", "jit,jit"], "--sections=jit,jit: choose each at most once from"),
    ([], "--out is required"),
])
def test_bad_flags_are_one_line_errors(tmp_path, capsys, args, fragment):
    argv = (["--out", str(tmp_path)] if args else []) + args
    with pytest.raises(SystemExit) as e:
        device.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


def test_the_bench_refuses_emulated_workers(capsys):
    """python -m sdp_jax.bench reads per-device figures of W devices: emulation is one line."""
    with pytest.raises(SystemExit) as e:
        measure.main(["--config", os.path.join(ROOT, "configs", "llama_tiny.py"), "--variants",
                      "ddp", "--config.emulate_workers=True"], check_only=True)
    assert e.value.code == 2
    assert "config.emulate_workers=True (from the config file or a flag): the bench reads" \
        in capsys.readouterr().err
