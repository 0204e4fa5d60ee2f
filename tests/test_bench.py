"""The memory benchmark compiles without training and shows B-SDP's per-device savings."""

import json
import os

import pytest

from sdp_jax import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "llama_tiny.py")


def test_bench_rows_and_ratios(tmp_path, capsys):
    out = tmp_path / "out.json"
    rows = bench.main(["--config", TINY, "--workers", "4", "--variants",
                       "ddp,b-sdp,n-sdp,bb-sdp,nb-sdp", "--coverage", "0.5", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved == rows
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
    # backward masking: full parameters, but compact optimizer state -> smaller arguments
    for v in ("bb-sdp", "nb-sdp"):
        assert by[v]["regime"] == "backward"
        assert by[v]["argument_bytes"] < 0.85 * ddp["argument_bytes"]
    assert abs(ddp["flops_per_device"] / ddp["model_flops_per_device"] - 1) < 0.5
    table = capsys.readouterr().out
    assert "| b-sdp | 0.5 | 4 | 2/4 blocks |" in table and "peak / DDP" in table


def test_bench_bad_input(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--workers", "4", "--variants", "ddp,q-sdp"])
    assert "unknown variants" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--workers", "4", "--coverage", "0.3"])
    assert "nearest valid coverages" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", "no_such.py"])
    assert "no_such.py" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", TINY, "--workers", "4", "--seq-len", "-5"])
    assert "--seq-len=-5 must be >= 1" in capsys.readouterr().err
