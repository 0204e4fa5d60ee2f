"""Several processes on one machine, as README.md's *Multi-host* section launches them:
``python -m sdp_jax.train.launch --processes 2 -- python train.py ... --config.num_cpu_devices=2``
(``jax.distributed`` on 127.0.0.1, gloo collectives between the processes).

The 2-process runs equal the 1-process runs of the same config step by step (docs/design.md
invariant 8), checkpoints resume across the two layouts, and SIGTERM reaching one process stops
both at the same step with a checkpoint (invariant 9).
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from sdp_jax.train import launch

# One pytest-xdist worker runs these in turn (the module's reference run is shared, and two
# multi-process launches at once would each get half the CPU).
pytestmark = pytest.mark.xdist_group("multiprocess")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A long schedule (the cosine depends on `steps`), stopped early with stop_at_step.
BASE = ["--config", "configs/llama_tiny.py", "--config.steps=400", "--config.eval_every=3",
        "--config.checkpoint_every=0"]
PIPELINE = ["--config.pipeline.stages=2", "--config.pipeline.microbatches=2",
            "--config.pipeline.method=mapl", "--config.pipeline.ratio=2"]
TIMEOUT = 300


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "XLA_FLAGS"):
        env.pop(key, None)
    return env


def readme_launch_command():
    """README.md's local launch command (*Multi-host*) as ``(environment, tokens)``."""
    with open(os.path.join(ROOT, "README.md")) as f:
        line = next(ln for ln in f if "python -m sdp_jax.train.launch" in ln)
    tokens = shlex.split(line)
    env = dict(t.split("=", 1) for t in tokens[:tokens.index("python")])
    cmd = tokens[tokens.index("python"):]
    assert cmd[3:5] == ["--processes", "2"] and cmd[5] == "--", cmd
    assert cmd[6:10] == ["python", "train.py", "--config", "configs/llama_tiny.py"], cmd
    # The same command, bounded: the launcher ends its processes after --timeout seconds.
    return env, cmd[:5] + [f"--timeout={TIMEOUT - 20}"] + cmd[5:]


def train(workdir, args, processes=1, stop=None):
    """``python train.py`` (1 process, 4 devices), or README.md's launch command (2 processes
    x 2 devices) with more flags (absl: a flag given again takes the last value)."""
    extra = [*BASE, *args, f"--workdir={workdir}"]
    if stop:
        extra.append(f"--config.stop_at_step={stop}")
    env = _env()
    if processes > 1:
        readme_env, cmd = readme_launch_command()
        env.update(readme_env)
        cmd = [sys.executable, *cmd[1:], *extra[2:]]   # (its --config is BASE's)
    else:
        cmd = [sys.executable, "train.py", *extra]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    return out


def metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def same_trajectory(a, b, tol=2e-5):
    """Step by step equal losses (and validation losses where both evaluated)."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        np.testing.assert_allclose(x["train_loss"], y["train_loss"], rtol=tol, atol=tol)
        np.testing.assert_allclose(x["grad_norm"], y["grad_norm"], rtol=1e-4, atol=1e-5)
        if "val_loss" in x or "val_loss" in y:
            np.testing.assert_allclose(x["val_loss"], y["val_loss"], rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 process x 4 devices, uninterrupted, up to step 40 (ddp)."""
    wd = tmp_path_factory.mktemp("mp") / "ref"
    train(wd, [], stop=40)
    return metrics(wd)


def test_two_processes_equal_one_and_resume_as_one(tmp_path, reference):
    """ddp: 2 processes train steps 1-3 and checkpoint; 1 process resumes to step 6."""
    wd = tmp_path / "run"
    out = train(wd, [], processes=2, stop=3)
    assert "devices: 4 x cpu (2 process(es))" in out.stdout
    out = train(wd, [], stop=6)
    assert "devices: 4 x cpu (1 process(es))" in out.stdout and "at step 3" in out.stdout
    same_trajectory(metrics(wd), reference[:6])


def test_one_process_checkpoint_resumes_as_two(tmp_path):
    """b-sdp (C = 1/2): 1 process trains steps 1-3; 2 processes resume to step 6, equal to the
    uninterrupted 1-process run."""
    args = ["--config.sdp.variant=b-sdp", "--config.sdp.coverage=0.5"]
    ref = tmp_path / "ref"
    train(ref, args, stop=6)
    wd = tmp_path / "run"
    train(wd, args, stop=3)
    out = train(wd, args, processes=2, stop=6)
    assert "resumed from" in out.stdout and "at step 3" in out.stdout
    same_trajectory(metrics(wd), metrics(ref))


def test_pipeline_across_processes(tmp_path):
    """A 2-stage MAPL pipeline (W = 2 x 2 stages) over 2 processes equals the 1-process run
    (it used to crash after compiling: 'Invalid host data'). (Checkpoints across process
    layouts: the ddp and b-sdp tests above.)"""
    ref = tmp_path / "ref"
    train(ref, PIPELINE + ["--config.workers=2"], stop=6)
    wd = tmp_path / "run"
    out = train(wd, PIPELINE, processes=2, stop=6)
    assert "devices: 4 x cpu (2 process(es))" in out.stdout
    same_trajectory(metrics(wd), metrics(ref))


def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path, reference):
    wd = tmp_path / "run"
    readme_env, cmd = readme_launch_command()
    cmd = [sys.executable, *cmd[1:], *BASE[2:], "--config.eval_every=0", f"--workdir={wd}",
           "--config.stop_at_step=40"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**_env(), **readme_env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        path = wd / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and len(path.read_text().splitlines()) >= 2:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        pids = []
        while not pids and time.monotonic() < deadline:   # the launcher's first stderr line
            line = proc.stderr.readline()
            pids = [int(p) for p in re.findall(r"pids ([\d ]+),", line)[0].split()] if (
                "pids" in line) else []
        os.kill(pids[1], signal.SIGTERM)   # process 1 only
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, (out[-2000:], err[-3000:])
    assert "exit statuses [143, 143]" in err          # both stopped on the signal
    assert "SIGTERM reached another process" in out   # process 0 learned it from process 1
    step = int(re.search(r"interrupted by SIGTERM at step (\d+)", out).group(1))
    assert 2 <= step < 38 and sorted(os.listdir(wd / "checkpoints")) == [str(step)]
    assert metrics(wd)[-1]["step"] == step
    # The checkpoint both processes saved resumes (as 1 process) on the same trajectory.
    train(wd, ["--config.eval_every=0"], stop=step + 2)
    got = metrics(wd)
    assert [r["step"] for r in got] == list(range(1, step + 3))
    for x, y in zip(got, reference[:step + 2]):
        np.testing.assert_allclose(x["train_loss"], y["train_loss"], rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------ launch environment errors

@pytest.mark.parametrize("env, match", [
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES is not set"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "two",
      "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES is 'two'"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2",
      "JAX_PROCESS_ID": "2"}, r"JAX_PROCESS_ID=2 must be in 0 .. JAX_NUM_PROCESSES-1 = 1"),
    ({"JAX_COORDINATOR_ADDRESS": "nohost", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     "must be HOST:PORT"),
])
def test_bad_launch_environment_is_one_line(env, match):
    with pytest.raises(ValueError, match=match):
        launch.coordinator_args(env)


def test_train_py_launch_errors_are_one_line(tmp_path):
    """A missing JAX_NUM_PROCESSES was a KeyError traceback, --distributed=true without a
    cluster a ValueError traceback; a peer that never arrives hung for 300 s and then aborted
    with a C++ stack trace."""
    base = [sys.executable, "train.py", "--config", "configs/llama_tiny.py",
            f"--workdir={tmp_path / 'w'}"]
    env = dict(_env(), JAX_COORDINATOR_ADDRESS="127.0.0.1:1", JAX_PROCESS_ID="0")
    out = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "JAX_NUM_PROCESSES is not set" in out.stderr
    out = subprocess.run(base + ["--distributed=true"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no cluster environment" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    env = dict(_env(), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{launch.free_port()}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0")
    t0 = time.monotonic()
    out = subprocess.run(base + ["--init_timeout=6"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and time.monotonic() - t0 < 60
    assert ("process 0 of 2 waited 6s in jax.distributed.initialize: process 1 did not "
            "register with the coordinator") in out.stderr
    assert "Check failure" not in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "w").exists()


def test_init_timeout_names_the_missing_peers():
    where = f"127.0.0.1:{launch.free_port()}"   # nothing listens there
    args = {"coordinator_address": where, "num_processes": 4, "process_id": 2}
    assert "the coordinator (process 0) at 127.0.0.1" in launch._missing_peers(args, where)
    args["process_id"] = 0
    msg = launch._missing_peers(args, where)
    assert "not every one of the 4 processes" in msg and "a process id missing" in msg
    args["num_processes"] = 2
    assert launch._missing_peers(args, "h:1").startswith("process 1 did not register")


def test_launcher_reports_the_first_failure_and_ends_the_others(tmp_path):
    """Process 1 fails at once; process 0 would run for 120 s: it is terminated after the
    grace period and the launcher returns process 1's status."""
    code = ("import os, sys, time\n"
            "sys.exit(3) if os.environ['JAX_PROCESS_ID'] == '1' else time.sleep(120)\n")
    t0 = time.monotonic()
    status = launch.run([sys.executable, "-c", code], 2, grace=1.0, env=_env())
    assert status == 3 and time.monotonic() - t0 < 30
    with pytest.raises(ValueError, match="at least 1"):
        launch.run([sys.executable, "-c", "pass"], 0)


def test_unequal_devices_per_process_are_refused_in_one_line(monkeypatch):
    """Processes holding 3 and 1 devices (issue 39) are refused when the run is resolved,
    before any checkpoint code, naming each process's count; equal counts pass."""
    import types

    import jax

    from sdp_jax import mesh as mesh_lib
    from sdp_jax.train import config as config_lib
    from sdp_jax.train.run import resolve

    def devices(*counts):
        return [types.SimpleNamespace(process_index=p, platform="cpu")
                for p, n in enumerate(counts) for _ in range(n)]
    with pytest.raises(ValueError, match=r"unequal numbers of devices \(process 0: 3, "
                                         r"process 1: 1\); give every process the same"):
        mesh_lib.check_devices_per_process(devices(3, 1))
    mesh_lib.check_devices_per_process(devices(2, 2))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "devices", lambda *a: devices(3, 1))
    config = config_lib.base_config()
    config.update(dict(num_cpu_devices=4))
    with pytest.raises(ValueError, match="process 0: 3, process 1: 1"):
        resolve(config, 4)


# ------------------------------------------- before the first step: signals, a dead peer, devices

def _pair(workdir, devices=(2, 2)):
    """``python train.py`` as processes 0 and 1 of 2 (``devices``: each one's simulated CPU
    devices), started by hand as on a cluster; stdout and stderr in files beside ``workdir``."""
    port, procs = launch.free_port(), []
    for i, n in enumerate(devices):
        out = {s: open(f"{workdir}.{i}.{s}", "w") for s in ("out", "err")}
        procs.append(subprocess.Popen(
            [sys.executable, "train.py", *BASE, f"--config.num_cpu_devices={n}",
             "--config.workers=0", "--config.stop_at_step=5", f"--workdir={workdir}"],
            cwd=ROOT, env=launch.process_env(i, 2, port, _env()), stdout=out["out"],
            stderr=out["err"]))
    return procs


def _text(workdir, i, stream):
    with open(f"{workdir}.{i}.{stream}") as f:
        return f.read()


def test_before_the_first_step_a_signal_or_a_dead_peer_ends_every_process_in_one_line(tmp_path):
    """Issue 39, three pairs of processes at once, each acted on once process 0 has logged its
    devices (after jax.distributed.initialize, before the step is compiled):

    * SIGTERM to process 0 only: JAX's preemption handler used to swallow it (the run trained
      to the end and exited 0); now both processes end with one line each and status 143;
    * SIGKILL to process 1: process 0 used to abort after JAX's 100 s heartbeat with a C++
      stack dump; now it ends within seconds with one line and status 75 (peers.DEAD_PEER);
    * processes of 3 and 1 devices: both refused in one line naming the counts, status 2,
      before any checkpoint code (no workdir is created)."""
    runs = {k: str(tmp_path / k) for k in ("term", "kill", "unequal")}
    pairs = {k: _pair(wd, (3, 1) if k == "unequal" else (2, 2)) for k, wd in runs.items()}
    deadline, acted, ended = time.monotonic() + TIMEOUT, {}, {}
    try:
        while time.monotonic() < deadline and len(ended) < 6:
            for k in ("term", "kill"):
                if k not in acted and "devices: 4 x cpu" in _text(runs[k], 0, "out"):
                    victim = pairs[k][0 if k == "term" else 1]
                    victim.send_signal(signal.SIGTERM if k == "term" else signal.SIGKILL)
                    acted[k] = time.monotonic()
            for k, procs in pairs.items():
                for i, p in enumerate(procs):
                    if p.poll() is not None and (k, i) not in ended:
                        ended[k, i] = time.monotonic()
            time.sleep(0.05)
    finally:
        for p in (p for procs in pairs.values() for p in procs):
            if p.poll() is None:
                p.kill()
                p.wait()
    status = {k: [p.returncode for p in procs] for k, procs in pairs.items()}
    err = {k: [_text(wd, i, "err").strip() for i in (0, 1)] for k, wd in runs.items()}
    assert status["term"] == [143, 143], (status, err["term"])
    assert err["term"][0] == ("interrupted by SIGTERM: stopped (checkpoints already written "
                              "are kept: rerun the same command to resume)"), err["term"]
    assert err["term"][1].startswith("stopping: process 0 of 2 ended with status 143 "
                                     "(SIGTERM) before the run finished"), err["term"]
    assert len(err["term"][1].splitlines()) == 1, err["term"]
    assert not os.path.exists(os.path.join(runs["term"], "metrics.jsonl"))
    assert status["kill"] == [75, -signal.SIGKILL], (status, err["kill"])
    assert err["kill"][0].startswith("stopping: process 1 of 2 died without a word (killed "
                                     "or crashed)") and "\n" not in err["kill"][0], err["kill"]
    assert ended["kill", 0] - acted["kill"] < 30   # GRACE + DRAIN = 7 s; JAX's heartbeat: 100 s
    assert status["unequal"] == [2, 2], (status, err["unequal"])
    for line in err["unequal"]:
        assert line == ("python train.py: error: the processes hold unequal numbers of devices "
                        "(process 0: 3, process 1: 1); give every process the same number (the "
                        "same CUDA_VISIBLE_DEVICES count, or --config.num_cpu_devices on a CPU)")
    assert not os.path.exists(runs["unequal"])


def _checkpoint_meta(workdir, step):
    """The ``meta`` item of ``workdir``'s checkpoint at ``step`` (its JSON file, read
    directly: no JAX in the test process is needed)."""
    with open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")) as f:
        return json.load(f)


def test_elastic_launcher_carries_on_as_two_processes_after_a_sigkill(tmp_path):
    """``launch --elastic`` on a cluster's layout (issue 47): process 1 of 3 (2 devices each,
    W = 6) is killed with SIGKILL once the checkpoint of step 5 exists; processes 0 and 2 end
    in one line each (status 75), and the launcher starts the run again as the 2 processes
    left, which re-lay out that checkpoint on their 4 devices (W = 4, --config.elastic=True:
    each process computes the layout on its own CPU device and places only its own shares;
    it used to crash in process 1 and call the checkpoint damaged in process 0) and finish.
    The data carry on in examples: the stream after the switch starts at the first example the
    3-process run had not read."""
    wd = tmp_path / "run"
    cmd = [sys.executable, "-m", "sdp_jax.train.launch", "--processes", "3", "--elastic",
           f"--timeout={TIMEOUT - 60}", "--", "python", "train.py", *BASE[:2],
           "--config.steps=30", "--config.checkpoint_every=5", "--config.eval_every=100",
           "--config.eval_batches=1", "--config.num_cpu_devices=2", "--config.workers=0",
           f"--workdir={wd}"]
    err_path = tmp_path / "launcher.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                                stderr=err)
    try:
        deadline = time.monotonic() + TIMEOUT - 60
        while not (wd / "checkpoints" / "5").is_dir() and time.monotonic() < deadline:
            assert proc.poll() is None, err_path.read_text()[-3000:]
            time.sleep(0.2)
        pids = re.search(r"3 process\(es\), pids (\d+) (\d+) (\d+)", err_path.read_text())
        os.kill(int(pids.group(2)), signal.SIGKILL)   # the launcher's own child, by pid
        assert proc.wait(timeout=TIMEOUT) == 0, err_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = err_path.read_text()
    for survivor in (0, 2):
        assert (f"process 1 of 3 died without a word (killed or crashed) before the run "
                f"finished; this is process {survivor}, exiting with status 75") in log, log
    assert "exit statuses [75, 137, 75]" in log, log
    assert "process(es) 1 lost; restarting the run as the 2 process(es) left" in log, log
    assert "damaged" not in log and "Traceback" not in log.split("restarting")[1], log
    with open(wd / "summary.json") as f:
        summary = json.load(f)
    assert summary["completed"] and summary["steps"] == 30 and summary["workers"] == 4
    (switch,) = summary["elastic"]
    s = switch["step"]
    assert s % 5 == 0 and s >= 5 and switch["from"]["workers"] == 6
    assert switch["to"] == {**switch["from"], "workers": 4, "global_batch": 8}
    meta = _checkpoint_meta(wd, 30)
    assert meta["workers"] == 4 and meta["elastic"] == [switch]
    assert meta["data_origin"] == [s, s * 12]   # s steps of 6 workers x 2 windows were read
    assert [r["step"] for r in metrics(wd)] == list(range(1, 31))


def _probe(workdir, processes, devices, args):
    """tests/elastic_probe.py launched as ``processes`` x ``devices`` with the config flags
    ``args``: the latest checkpoint of ``workdir`` re-laid out and joined again, bit for bit
    equal to the checkpoint's full state in every process. Returns process 0's JSON line."""
    out = subprocess.run(
        [sys.executable, "-m", "sdp_jax.train.launch", "--processes", str(processes),
         f"--timeout={TIMEOUT - 60}", "--", "python", "tests/elastic_probe.py", str(workdir),
         *BASE[:2], "--config.steps=20", f"--config.num_cpu_devices={devices}",
         "--config.workers=0", *args],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    return json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("{")))


def _elastic_run(workdir, processes, devices, args, stop):
    """``train.py`` with ``args`` as ``processes`` x ``devices`` (the launcher when several),
    W = every device, stopped with a checkpoint at step ``stop``; returns its stdout."""
    run = [*BASE[:2], "--config.steps=20", "--config.eval_every=0",
           "--config.checkpoint_every=0", f"--config.num_cpu_devices={devices}",
           "--config.workers=0", f"--config.stop_at_step={stop}", *args, f"--workdir={workdir}"]
    cmd = ([sys.executable, "-m", "sdp_jax.train.launch", "--processes", str(processes),
            f"--timeout={TIMEOUT - 60}", "--", "python", "train.py", *run] if processes > 1
           else [sys.executable, "train.py", *run])
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    return out.stdout


def test_elastic_resume_on_several_processes_is_exact(tmp_path):
    """Issue 47: elastic resumes whose new layout spans several processes. 1 process x 2
    devices (W = 2, ddp) grows to 2 processes x 2 devices (W = 4, b-sdp C = 1/2), whose
    checkpoint is then resumed by 4 processes x 1 device (W = 4, b-sdp C = 3/4). Each time
    the re-laid-out state, gathered from every process and joined again, equals the
    checkpoint's full parameters and Adam moments bit for bit (tests/elastic_probe.py, in
    every process), and train.py then continues the run through the switch, with the data
    stream carried on in examples."""
    wd = tmp_path / "run"
    half = ["--config.sdp.variant=b-sdp", "--config.sdp.coverage=0.5", "--config.elastic=True"]
    _elastic_run(wd, 1, 2, [], stop=2)
    probe = _probe(wd, 2, 2, half)
    assert probe["step"] == 2 and probe["workers"] == 4 and probe["processes"] == 2
    assert probe["leaves"] >= 3 * 9   # the parameters and both Adam moments of every leaf
    out = _elastic_run(wd, 2, 2, half, stop=4)
    assert ("elastic resume (--config.elastic) at step 2: workers 2 -> 4, variant ddp -> "
            "b-sdp, coverage 1.0 -> 0.5, global_batch 4 -> 8") in out, out[-2000:]
    assert _checkpoint_meta(wd, 4)["data_origin"] == [2, 2 * 4]
    three_quarters = [half[0], "--config.sdp.coverage=0.75"]
    probe = _probe(wd, 4, 1, three_quarters)
    assert probe["step"] == 4 and probe["processes"] == 4
    assert probe["change"] == "coverage 0.5 -> 0.75"
    out = _elastic_run(wd, 4, 1, [*three_quarters, "--config.elastic=True"], stop=6)
    assert "at step 4: coverage 0.5 -> 0.75" in out, out[-2000:]
    meta = _checkpoint_meta(wd, 6)
    assert meta["workers"] == 4 and meta["data_origin"] == [2, 8]   # G = 8 since step 2
    assert [e["step"] for e in meta["elastic"]] == [2, 4]
    assert [r["step"] for r in metrics(wd)] == list(range(1, 7))


def test_a_peer_killed_during_a_resume_leaves_the_checkpoint_as_it_is(tmp_path):
    """Issue 47: process 1 of 2 is killed with SIGKILL while the pair resumes a checkpoint
    (once process 0 has loaded its data, before it reads the checkpoint): process 0 ends
    within seconds with the one line naming process 1 and status 75; nothing calls the
    checkpoint damaged, and its files are as they were (nothing moved aside or rewritten)."""
    wd = tmp_path / "run"
    train(wd, [], stop=2)   # 1 process x 4 devices, W = 4
    checkpoints = wd / "checkpoints"
    files = {p: (p.stat().st_size, p.stat().st_mtime_ns)
             for p in checkpoints.rglob("*") if p.is_file()}
    procs = _pair(str(wd))   # 2 processes x 2 devices, W = 4: a plain resume
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline and "data " not in _text(str(wd), 0, "out"):
            assert procs[0].poll() is None, _text(str(wd), 0, "err")[-3000:]
            time.sleep(0.02)
        procs[1].kill()
        killed = time.monotonic()
        procs[0].wait(timeout=60)
        ended = time.monotonic()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    err = _text(str(wd), 0, "err").strip()
    assert procs[0].returncode == 75, err[-3000:]
    assert err.splitlines()[-1].startswith("stopping: process 1 of 2 died without a word"), err
    assert "damaged" not in err and "aside" not in err and ended - killed < 30
    assert sorted(os.listdir(checkpoints)) == ["2"]
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns)
            for p in checkpoints.rglob("*") if p.is_file()} == files
