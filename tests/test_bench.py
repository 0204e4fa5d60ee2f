"""The memory benchmark compiles without training and shows B-SDP's per-device savings."""

import json
import os
import re
import subprocess
import sys

import pytest

from sdp_jax.bench import measure as bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "llama_tiny.py")


@pytest.mark.slow
def test_bench_rows_and_ratios(tmp_path, capsys):
    out = tmp_path / "out.json"
    common = ["--config", TINY, "--config.workers=4", "--config.sdp.coverage=0.5"]
    rows = bench.main([*common, "--variants", "ddp,b-sdp,n-sdp", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved == rows
    table = capsys.readouterr().out
    # (no FLOP count, the unrolled compile, for the backward variants: nothing below reads it)
    rows += bench.main([*common, "--variants", "bb-sdp,nb-sdp", "--noflops"])
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["ddp", "b-sdp", "n-sdp", "bb-sdp", "nb-sdp"]
    ddp = by["ddp"]
    for key in ("variant", "coverage", "workers", "argument_bytes", "temp_bytes",
                "peak_bytes_per_device", "flops_per_device"):
        assert key in ddp
    assert by["b-sdp"]["held_per_worker"] == "2/4 blocks" and ddp["held_per_worker"] == "4/4 blocks"
    assert by["n-sdp"]["held_per_worker"] == "32/64 neurons, 1/2 kv-groups"
    # forward masking: everything per device shrinks
    for v in ("b-sdp", "n-sdp"):
        assert by[v]["argument_bytes"] < 0.75 * ddp["argument_bytes"]
        assert by[v]["peak_bytes_per_device"] < 0.8 * ddp["peak_bytes_per_device"]
        # the unrolled FLOP count sees every block: half the blocks / neurons, fewer FLOPs
        assert by[v]["flops_per_device"] < 0.8 * ddp["flops_per_device"]
    # backward masking: full parameters, the blocks' update on shards (ZeRO-2): their AdamW
    # moments are 1/W of theirs (block arguments (1 + 2/W) / 3 of DDP's; the always-kept
    # embedding and head, a large part of this tiny model, keep whole moments), the gradient
    # goes to the owners (all_to_all of the held parts) and the new shards come back by one
    # all-gather: about (1 + C) / 2 of DDP's all-reduce bytes for the blocks
    for v in ("bb-sdp", "nb-sdp"):
        assert by[v]["regime"] == "backward"
        assert by[v]["argument_bytes"] < 0.75 * ddp["argument_bytes"]
        assert by[v]["comm_bytes_per_device"] < 0.85 * ddp["comm_bytes_per_device"]
        assert {"all-to-all", "all-gather"} <= set(by[v]["comm_by_op"])
    assert abs(ddp["flops_per_device"] / ddp["model_flops_per_device"] - 1) < 0.5
    # communication: forward variants exchange only what they hold (issue 4)
    for v in ("b-sdp", "n-sdp"):
        assert by[v]["comm_bytes_per_device"] < 0.8 * ddp["comm_bytes_per_device"]
        assert by[v]["comm_by_op"]["all-to-all"] > 0
    assert set(ddp["comm_by_op"]) == {"all-reduce"}
    for r in rows:   # one device per worker: every byte crosses the data axis
        assert r["comm_by_axis"] == {"data": pytest.approx(r["comm_bytes_per_device"])}, r
    assert "| b-sdp | 0.5 | 4 | 2/4 blocks |" in table and "comm / DDP" in table


@pytest.mark.slow
def test_bench_in_a_fresh_process_simulates_its_workers(tmp_path):
    """``python -m sdp_jax.bench`` as a user runs it: JAX starts with one CPU device, and the
    bench raises the simulated count to its workers (4 here) before the validation touches a backend
    (it once failed with "jax_num_cpu_devices config should be updated before backends are
    initialized")."""
    out = subprocess.run([sys.executable, "-m", "sdp_jax.bench", "--config", TINY, "--variants",
                          "ddp", "--noflops", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "XLA_FLAGS": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())[0]["workers"] == 4   # llama_tiny


@pytest.mark.slow
def test_bench_fsdp_remat_bf16_and_measured_time(capsys):
    rows = bench.main(["--config", TINY, "--variants", "ddp,b-sdp", "--config.sdp.coverage=0.5",
                       "--config.fsdp=True", "--config.remat=full", "--config.dtype=bf16",
                       "--noflops", "--measure_time", "--time_steps", "3"])
    by = {r["variant"]: r for r in rows}
    assert [r["setting"] for r in rows] == ["ddp+fsdp+ac", "b-sdp+fsdp+ac"]
    assert all(r["workers"] == 4 and r["dtype"] == "bfloat16" for r in rows)  # config's W
    # FSDP: DDP's baseline all-gathers and reduce-scatters; B-SDP gathers its held blocks
    assert {"all-gather", "reduce-scatter"} <= set(by["ddp"]["comm_by_op"])
    assert by["b-sdp"]["comm_by_op"]["all-to-all"] > 0
    assert by["b-sdp"]["comm_bytes_per_device"] < by["ddp"]["comm_bytes_per_device"]
    for r in rows:
        assert len(r["step_times_s"]) == 3 and r["step_time_s"] > 0
        assert r["flops_per_device"] is None
    out = capsys.readouterr().out
    assert "time / DDP" in out and "| ddp+fsdp+ac |" in out


@pytest.mark.slow
def test_reference_is_plain_jit_of_the_same_step():
    """The plain-jit DDP reference (sdp_jax/bench/jit_reference.py) takes the SDP step's DDP steps: the
    same loss, gradient norm and parameters after 3 steps (activation checkpointing on, so the
    shared loss's chunked path runs outside shard_map too)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdp_jax.bench import jit_reference as reference
    from sdp_jax.models import llama
    from sdp_jax.models.llama import LlamaConfig
    from sdp_jax.options import StepOptions
    from sdp_jax.train import families
    from sdp_jax.train import optimizer as optim_lib
    model = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=16)
    optim = optim_lib.OptimConfig(lr=1e-2, warmup_steps=1)
    options = StepOptions(total_steps=10, remat="full", grad_clip=0.5)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    ref = reference.JitDDP(model, optim, mesh, options)
    ddp = families.language_model_step(model, llama.make_plan("ddp", model, 4, 1.0), optim, mesh,
                                       options)
    a, b = ref.init_state(0), ddp.init_state(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(3):
        tokens = rng.integers(0, 64, (8, 17)).astype(np.int32)
        a, ma = ref.train_step_fn()(a, jax.device_put(tokens, ref.batch_sharding()))
        b, mb = ddp.train_step_fn()(b, jax.device_put(jnp.asarray(tokens), ddp.batch_sharding()))
        np.testing.assert_allclose(float(ma["train_loss"]), float(mb["train_loss"]), rtol=1e-6)
        np.testing.assert_allclose(float(ma["grad_norm"]), float(mb["grad_norm"]), rtol=1e-5)
    assert float(ma["grad_norm"]) > 0.5   # clipping was active
    full = ddp.full_params(b)
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(full)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    # ... and all-reduces each block's gradients as jit does, inside the backward loop: the
    # matmuls' own products (sdp_jax.sync.cotangent_orders), not transposed copies in the
    # weights' axis order
    batch = jax.ShapeDtypeStruct((8, 17), np.int32)

    def in_loop(builder):   # the operand shapes of the all-reduce of the most leaves
        text = builder.compiled_train_step(batch).as_text()
        return max((re.findall(r"f32\[[\d,]+\]", line.split(" all-reduce(")[0])
                    for line in text.splitlines() if " all-reduce(" in line), key=len)
    jit_shapes = in_loop(ref)
    assert in_loop(ddp) == jit_shapes and len(jit_shapes) == 9
    # w_down's product [d, f] (the weight is [f, d]); w_gate's and w_up's are [f, d]
    assert jit_shapes[5:8] == ["f32[32,64]", "f32[64,32]", "f32[64,32]"]


@pytest.mark.slow
def test_bench_reference_rows(capsys):
    rows = bench.main(["--config", TINY, "--variants", "ddp", "--reference", "--noflops",
                       "--measure_time", "--time_steps", "2"])
    assert [r["setting"] for r in rows] == ["jit-ddp", "ddp"]
    jit, ddp = rows
    assert jit["regime"] == "jit" and jit["params_per_device"] == ddp["params_per_device"]
    # the same gradient bytes: one all-reduce of every parameter per step
    assert abs(jit["comm_bytes_per_device"] / ddp["comm_bytes_per_device"] - 1) < 0.01
    assert set(jit["comm_by_op"]) == {"all-reduce"} and len(jit["step_times_s"]) == 2
    # XLA's SPMD partitioner averages inside the backward scan (per block, overlappable), and
    # so does our step (sdp_jax.sync.mean_in_backward): the same bytes in the loop
    assert jit["comm_in_backward_loop"] > 0.5 * jit["comm_bytes_per_device"]
    assert ddp["comm_in_backward_loop"] == pytest.approx(jit["comm_in_backward_loop"], rel=0.01)
    assert ddp["peak_bytes_per_device"] <= 1.002 * jit["peak_bytes_per_device"]
    out = capsys.readouterr().out
    assert "| jit-ddp | 1 | 4 | all |" in out
    assert "ddp / jit-ddp: peak " in out and "step time " in out and "within a round" in out


@pytest.mark.slow
def test_reference_counts_its_flops():
    """--reference with FLOPs (no --noflops): the plain-jit row's XLA count, the blocks
    unrolled, is the DDP step's within 2% (the same model; the steps differ only in their
    collectives and the clipping's few elementwise FLOPs)."""
    config = _tiny_config()
    mesh = bench._mesh(4)
    jit = bench.measure_reference(config, 4, mesh)
    ddp = bench.measure(config, "ddp", 4, 1.0, mesh)
    assert jit["flops_per_device"] > 0
    assert jit["flops_per_device"] == pytest.approx(ddp["flops_per_device"], rel=0.02)


def _tiny_config():
    import importlib.util
    module_spec = importlib.util.spec_from_file_location("llama_tiny", TINY)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config()


def test_reference_of_a_b_sdp_workers_blocks():
    """With b-sdp, --reference adds plain jit of the model cut to a worker's k blocks (B-SDP's
    parameters per device), and B-SDP's paired step-time ratio to it (rows made here)."""
    config = _tiny_config()
    mesh = bench._mesh(4)
    sub = bench.reference_step(config, mesh, "none", "float32", blocks=2)
    bsdp, _ = bench.lm_step(config, "b-sdp", 4, 0.5, mesh, fsdp=False, remat="none",
                            dtype="float32")
    assert sub.cfg.n_layers == 2 and sub.per_device_param_count() == \
        bsdp.per_device_param_count() < bench.reference_step(
            config, mesh, "none", "float32").per_device_param_count()

    def row(setting, times, blocks=None):
        return {"variant": setting.split()[0], "setting": setting, "blocks": blocks,
                "peak_bytes_per_device": 1, "comm_bytes_per_device": 1,
                "flops_per_device": None, "step_times_s": times,
                "step_time_s": sorted(times)[1]}
    lines = bench.reference_lines([row("jit-ddp", [2.0, 4.0, 2.0]),
                                   row("jit-ddp 2/4", [1.0, 2.0, 1.0], blocks=2),
                                   row("b-sdp", [1.1, 2.2, 1.1])])
    assert lines[-1] == ("b-sdp / jit-ddp 2/4 (plain jit of a worker's blocks): step time "
                         "1.100")
    assert "b-sdp / jit-ddp: " in lines[1] and "step time 0.550" in lines[1]


def test_paired_ratio_cancels_load_that_changes_between_rounds():
    # round 2 ran while something else loaded the machine (both variants 10x slower), and in
    # round 3 a step of the first variant was hit alone: the ratio within rounds is 1.1, where
    # the ratio of the medians would be 5
    assert bench.paired_ratio([1.1, 11.0, 5.0], [1.0, 10.0, 1.0]) == pytest.approx(1.1)
    with pytest.raises(ValueError, match="2 and 3 step times"):
        bench.paired_ratio([1.0, 1.0], [1.0, 1.0, 1.0])


def test_paper_table_and_chart(tmp_path):
    rows = []
    for (label, variant, fsdp, remat), peak, comm in zip(
            bench.PAPER_SETTINGS, (70e9, 11e9, 49e9, 9.5e9), (3.1e9, 4.4e9, 2.2e9, 3.1e9)):
        rows.append({"label": label, "variant": variant, "fsdp": fsdp, "remat": remat,
                     "peak_bytes_per_device": peak, "comm_bytes_per_device": comm})
    table = bench.paper_table(rows)
    assert "| B-SDP + FSDP + AC |" in table and "9.7 GB" in table and "2,253.0 MB" in table
    assert "B-SDP + FSDP + AC vs FSDP + AC: peak memory 0.864 (paper 0.882)" in table
    png = tmp_path / "chart.png"
    bench.paper_chart(rows, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_bad_input(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--variants", "ddp,q-sdp"])
    assert "unknown variants" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--config.sdp.coverage=0.3"])
    assert "nearest valid coverages" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", "no_such.py"])
    assert "no_such.py" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--config.seq_len=-5"])
    assert "seq_len=-5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--config.remat=everything"])
    assert "remat='everything'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--config.dtype=fp16"])
    assert "dtype='fp16'" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # the argparse options before configs came by flags
        bench.main(["--config", TINY, "--fsdp"])
    assert "unknown flag --fsdp: it is now --config.fsdp=True" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--config.sdp.coverag=0.5"])
    assert "unknown config field" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--json", os.path.dirname(TINY)])
    assert "is a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--variants", "ddp,ddp"])
    assert "names a variant twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # before any compile
        bench.main(["--paper", "--config", TINY, "--out", os.path.dirname(TINY)])
    assert "needs 0.6875 x n_layers whole" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--reference", "--config.fsdp=True"])
    assert "--reference is plain-jit DDP" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", os.path.join(ROOT, "configs", "resnet18_digits.py"),
                    "--reference"])
    assert "language models only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--paper", "--config.fsdp=True"])
    assert "drop --config.fsdp" in capsys.readouterr().err


def test_bench_outputs_never_overwrite_by_default(tmp_path, capsys, monkeypatch):
    """`python -m sdp_jax.bench --paper --out docs/bench`, as the README showed it, rewrote
    the files tracked in the repository."""
    docs = os.path.join(ROOT, "docs", "bench")
    with pytest.raises(SystemExit):
        bench.main(["--paper", "--out", docs], check_only=True)
    assert "already holds paper_table.md" in capsys.readouterr().err
    assert bench.main(["--paper", "--out", docs, "--overwrite"], check_only=True) == []
    (tmp_path / "rows.json").write_text("[]")
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--json", str(tmp_path / "rows.json")], check_only=True)
    assert "exists; give another file name, or add --overwrite" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)   # the default --out is runs/paper, under the working folder
    assert bench.main(["--paper"], check_only=True) == []
    assert (tmp_path / "runs" / "paper").is_dir()
