"""coverage=auto picks the largest realizable C whose compiled step fits a per-device budget;
python -m sdp_jax.bench --fit prints the same measurement as a table (sdp_jax/train/fit.py)."""

import os

import numpy as np
import pytest

from sdp_jax.bench import measure as bench
from sdp_jax.train import checkpoint as ckpt_lib
from sdp_jax.train import fit, loop
from sdp_jax.train import run as run_lib
from sdp_jax.train.cli import config_file

TINY = config_file("llama_tiny.py")


def tiny(variant="b-sdp", workers=4, **sdp):
    """configs/llama_tiny.py with ``coverage='auto'`` (W = ``workers``)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("llama_tiny", TINY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.workers, c.sdp.variant = workers, variant
    c.sdp.update(sdp)
    fit.set_coverage(c, "auto")
    return c


def fake_peaks(monkeypatch, calls):
    """compiled_peak -> C * 1000 bytes (no compile), recording each C asked."""
    def peak(run, mesh):
        calls.append(run.plan.coverage)
        return {"peak_bytes_per_device": int(run.plan.coverage * 1000)}
    monkeypatch.setattr(fit, "compiled_peak", peak)


def test_candidates_are_the_realizable_coverages():
    # W = 2, L = 4: C = 1/2 splits the workers (spectral gap 0), 3/4 makes W*C = 1.5
    assert fit.coverages(tiny(workers=2), 8)[1] == [1.0]
    assert fit.coverages(tiny(workers=2, allow_nonuniform=True), 8)[1] == [1.0, 0.75]
    assert fit.coverages(tiny(workers=2, allow_nonuniform=True, allow_disconnected=True),
                         8)[1] == [1.0, 0.75, 0.5]
    assert fit.coverages(tiny(), 8)[1] == [1.0, 0.75, 0.5]
    assert fit.coverages(tiny("n-sdp"), 8)[1] == [1.0, 0.5]   # 2 kv-groups per block
    assert fit.coverages(tiny("ddp"), 8)[1] == [1.0]


def test_auto_picks_the_largest_that_fits_or_refuses_in_one_line(monkeypatch, capsys):
    calls = []
    fake_peaks(monkeypatch, calls)
    c = tiny(memory_budget_gib=800 / fit.GIB)
    run = fit.resolve(c, 8)
    assert run.plan.coverage == 0.75 and c.sdp.coverage == 0.75   # recorded as a number
    assert calls == [1.0, 0.75]   # largest first, stopping at the first that fits
    out = capsys.readouterr().out
    assert "C=1 (4/4 blocks): peak 1000.0 B per device" in out and ", over " in out
    assert "coverage auto: C=0.75 (3/4 blocks), the largest that fits" in out
    with pytest.raises(ValueError) as e:
        fit.resolve(tiny(memory_budget_gib=100 / fit.GIB), 8)
    msg = str(e.value)
    assert "\n" not in msg and "the smallest, C=0.5" in msg and fit.BUDGET_FLAG in msg
    calls.clear()
    with pytest.raises(ValueError, match="on a CPU needs a per-device budget: add "
                       "--config.sdp.memory_budget_gib=GIB"):
        fit.resolve(tiny(), 8)
    assert calls == []   # refused before any compile
    with pytest.raises(ValueError, match="memory_budget_gib=-1.0 must be a finite number >= 0"):
        fit.resolve(tiny(memory_budget_gib=-1.0), 8)
    with pytest.raises(ValueError, match="this command needs a number: give "
                       "--config.sdp.coverage=C"):
        run_lib.resolve(tiny(memory_budget_gib=1.0), 8)


def test_a_resumed_auto_run_keeps_its_checkpoints_coverage(tmp_path, monkeypatch, capsys):
    calls = []
    fake_peaks(monkeypatch, calls)
    c = tiny(memory_budget_gib=10.0)   # (every candidate would fit: C = 1 if picked again)
    meta = {"config": run_lib.trajectory_config(fit.with_coverage(c, 0.5))}
    manager = ckpt_lib.CheckpointManager(str(tmp_path / "checkpoints"))
    manager.save(3, {"x": np.zeros(2, np.float32)}, meta)
    manager.close()
    run = fit.resolve(c, 8, workdir=str(tmp_path))
    assert run.plan.coverage == 0.5 and c.sdp.coverage == 0.5 and calls == []
    assert "C=0.5, as the checkpoint of step 3" in capsys.readouterr().out
    assert "memory_budget_gib" not in meta["config"]["sdp"]   # no part of the trajectory
    # an elastic resume (another slice) picks again: here every candidate fits, so C = 1
    again = tiny(memory_budget_gib=10.0)
    again.elastic = True
    assert fit.resolve(again, 8, workdir=str(tmp_path)).plan.coverage == 1.0 and calls == [1.0]


def test_train_picks_the_coverage_before_training(tmp_path, monkeypatch, capsys):
    calls = []
    fake_peaks(monkeypatch, calls)

    def stop(run):
        raise RuntimeError(f"stopped at the mesh, C={run.plan.coverage}")
    monkeypatch.setattr(loop, "make_mesh", stop)
    c = tiny(memory_budget_gib=600 / fit.GIB)
    with pytest.raises(RuntimeError, match="C=0.5"):
        loop.train(c, str(tmp_path / "run"))
    assert c.sdp.coverage == 0.5 and calls == [1.0, 0.75, 0.5]
    assert "coverage auto: compiling b-sdp at its 3 realizable coverages" in \
        capsys.readouterr().out


def test_candidates_with_workers_of_several_devices():
    """mesh.tensor = 2 skips a coverage whose held count it does not divide (llama_tiny's 2
    key/value groups: N-SDP at C = 1/2 holds 1), before any compile."""
    c = tiny("n-sdp", workers=2)
    c.mesh.fsdp, c.mesh.tensor = 2, 2
    c.batch_per_worker = 4
    c.sdp.allow_disconnected = True
    assert fit.coverages(c, 8)[1] == [1.0]
    c.mesh.tensor = 1
    assert fit.coverages(c, 8)[1] == [1.0, 0.5]


@pytest.mark.slow
def test_auto_compiles_the_steps_of_workers_of_several_devices(capsys):
    """coverage=auto on W = 2 workers of fsdp x tensor = 2 x 2 (8 devices) compiles each
    candidate on that mesh: its peaks are the per-device ones of 4-device workers (below the
    one-device workers' at the same C), and it picks the largest C whose peak fits."""
    def config(fsdp, tensor):
        c = tiny(workers=2, allow_nonuniform=True, allow_disconnected=True)
        c.mesh.fsdp, c.mesh.tensor, c.batch_per_worker = fsdp, tensor, 4
        return c
    peaks = {}
    for inner in ((1, 1), (2, 2)):
        for cov in (1.0, 0.5):
            c = fit.with_coverage(config(*inner), cov)
            run = run_lib.resolve(c, 8)
            peaks[inner, cov] = fit.compiled_peak(run, loop.make_mesh(run))[
                "peak_bytes_per_device"]
    assert peaks[(2, 2), 1.0] < peaks[(1, 1), 1.0] and peaks[(2, 2), 0.5] < peaks[(1, 1), 0.5]
    assert peaks[(2, 2), 0.5] < peaks[(2, 2), 1.0]
    c = config(2, 2)
    c.sdp.memory_budget_gib = (peaks[(2, 2), 0.5] + peaks[(2, 2), 1.0]) / 2 / fit.GIB
    run = fit.resolve(c, 8)
    assert run.plan.coverage < 1.0 and run.mesh_shape.fsdp * run.mesh_shape.tensor == 4
    out = capsys.readouterr().out
    assert "C=1 (4/4 blocks): peak" in out and "the largest that fits" in out, out


class _Accelerator:
    """A device as JAX shows an accelerator: its platform, kind and memory limit."""
    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    def memory_stats(self):
        return {"bytes_limit": 80 * fit.GIB}


def test_a_step_that_cannot_fit_is_refused_in_one_line(monkeypatch):
    """Every run's check before its first step (fit.check_peak, the rule of coverage=auto):
    the peak against memory_budget_gib, an accelerator's bytes_limit, and on a CPU the host's
    memory over the process's devices; one line with the peak, the limit and the settings not
    yet in effect that lower it."""
    import jax
    c = tiny()
    fit.set_coverage(c, 0.5)
    cpus = jax.devices()[:4]
    monkeypatch.setattr(fit, "host_memory_bytes", lambda: 8 * fit.GIB)
    fit.check_peak(2 * fit.GIB, c, cpus)   # 8 GiB over 4 devices: 2 GiB each fits
    with pytest.raises(ValueError) as e:
        fit.check_peak(2 * fit.GIB + 1, c, cpus)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the compiled train step peaks at 2.0 GiB per "
                                             "device, over this host's memory (8.0 GiB of RAM "
                                             "and swap for the 4 devices of the run in this "
                                             "process, 2.0 GiB each): it cannot run")
    assert msg.endswith("lower its memory with a coverage below 0.5 (--config.sdp.coverage=auto "
                        "--config.sdp.memory_budget_gib=GIB picks the largest that fits), "
                        "--config.remat=full, --config.fsdp=True, --config.grad_accum=2.")
    c.sdp.memory_budget_gib = 1.0
    with pytest.raises(ValueError, match=r"peaks at 1.5 GiB per device, over "
                       r"--config.sdp.memory_budget_gib=1: it cannot run"):
        fit.check_peak(int(1.5 * fit.GIB), c, cpus)
    c.sdp.memory_budget_gib = 0.0
    fit.check_peak(79 * fit.GIB, c, [_Accelerator()])   # (not the host's memory: the device's)
    c.update(dict(remat="full", fsdp=True, grad_accum=2, emulate_workers=True, workers=8))
    with pytest.raises(ValueError, match=r"peaks at 89.0 GiB per device, over the NVIDIA H100 "
                       r"80GB HBM3's memory \(80.0 GiB, bytes_limit\): it cannot run; lower its "
                       r"memory with a coverage below 0.5 .*fits\), fewer emulated workers "
                       r"\(--config.workers below 8\)\.$"):
        fit.check_peak(89 * fit.GIB, c, [_Accelerator()])
    monkeypatch.undo()
    assert fit.host_memory_bytes() > 0   # (Linux: /proc/meminfo)


@pytest.mark.slow
def test_bench_fit_table_reads_the_compiled_peaks(capsys):
    rows = bench.main(["--fit", "--budget_gib=100,1e-6", "--config", TINY, "--variants",
                       "b-sdp", "--config.workers=4"])
    assert [r["coverage"] for r in rows] == [1.0, 0.75, 0.5]
    peaks = [r["peak_bytes_per_device"] for r in rows]
    assert peaks[0] > peaks[1] > peaks[2] > 0   # forward masking prunes
    out = capsys.readouterr().out
    assert "| b-sdp | none | no | 0.75 | 3/4 blocks |" in out
    assert "| b-sdp | none | no | 1 | none |" in out   # largest C fitting 100 GiB; 1e-6: none
    c = tiny()
    fit.set_coverage(c, 1.0)
    row = bench.measure(c, "b-sdp", 4, 1.0, bench._mesh(4), flops=False)
    assert row["peak_bytes_per_device"] == peaks[0]   # the one measurement of the bench


def test_bench_fit_flags_are_checked(capsys):
    for argv, msg in (
            (["--budget_gib=40"], "--budget_gib applies with --fit only"),
            (["--fit"], "--fit needs budgets of GiB per device > 0"),
            (["--fit", "--budget_gib=forty"], "--budget_gib=forty: give numbers"),
            (["--fit", "--budget_gib=40", "--fit_fsdp=maybe"], "--fit_fsdp=maybe"),
            (["--fit", "--budget_gib=40", "--measure_time"], "drop --measure_time"),
            (["--fit", "--budget_gib=40", "--fit_remat=everything"], "remat='everything'")):
        with pytest.raises(SystemExit):
            bench.main(["--config", TINY, *argv], check_only=True)
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, (argv, err)
    assert bench.main(["--config", TINY, "--fit", "--budget_gib=1", "--fit_remat=none,full",
                       "--fit_fsdp=false,true", "--config.sdp.coverage=auto"],
                      check_only=True) == []
    assert os.path.isfile(TINY)


def test_host_memory_is_capped_by_the_process_cgroups(tmp_path, monkeypatch):
    """The host's memory for the CPU check: MemTotal + SwapTotal, with the RAM capped by the
    root cgroup's and the process's own cgroups' limits (v2 memory.max, v1
    memory.limit_in_bytes; a scheduler's cgroup seen without a namespace), "max" meaning none."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16777216 kB\nSwapTotal:       1048576 kB\n")
    root = tmp_path / "cgroup"
    (root / "slurm" / "job_7").mkdir(parents=True)
    (root / "memory" / "batch").mkdir(parents=True)
    (root / "memory.max").write_text("max\n")
    own = tmp_path / "self_cgroup"
    own.write_text("0::/slurm/job_7\n4:memory:/batch\n3:cpuset:/elsewhere\n")
    monkeypatch.setattr(fit, "MEMINFO", str(meminfo))
    monkeypatch.setattr(fit, "CGROUP", str(root))
    real = fit._cgroup_limit_files
    monkeypatch.setattr(fit, "_cgroup_limit_files", lambda: real(str(own)))
    assert fit.host_memory_bytes() == 17 * fit.GIB      # no limit: 16 GiB RAM + 1 GiB swap
    (root / "slurm" / "job_7" / "memory.max").write_text(str(4 * fit.GIB))
    assert fit.host_memory_bytes() == 5 * fit.GIB       # the job's v2 limit
    (root / "memory" / "batch" / "memory.limit_in_bytes").write_text(str(2 * fit.GIB))
    assert fit.host_memory_bytes() == 3 * fit.GIB       # the v1 memory controller's, smaller
