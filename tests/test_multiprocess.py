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
import threading
import time

import numpy as np
import pytest

from sdp_jax.train.launch import launcher as launch
from sdp_jax.train.launch import peers

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
    x 2 devices, or ``processes`` of them) with more flags (absl: a flag given again takes the
    last value)."""
    extra = [*BASE, *args, f"--workdir={workdir}"]
    if stop:
        extra.append(f"--config.stop_at_step={stop}")
    env = _env()
    if processes > 1:
        readme_env, cmd = readme_launch_command()
        env.update(readme_env)
        cmd[4] = str(processes)   # (--processes 2 in README.md)
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


@pytest.mark.slow
def test_two_processes_equal_one_and_resume_as_one(tmp_path, reference):
    """ddp: 2 processes train steps 1-3 and checkpoint; 1 process resumes to step 6."""
    wd = tmp_path / "run"
    out = train(wd, [], processes=2, stop=3)
    assert "devices: 4 x cpu (2 process(es))" in out.stdout
    out = train(wd, [], stop=6)
    assert "devices: 4 x cpu (1 process(es))" in out.stdout and "at step 3" in out.stdout
    same_trajectory(metrics(wd), reference[:6])


@pytest.mark.slow
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


INNER = ["--config.workers=0", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
         "--config.batch_per_worker=4"]


@pytest.fixture(scope="module")
def inner_reference(tmp_path_factory):
    """1 process x 8 devices, W = 2 workers of fsdp x tensor = 2 x 2, up to step 6."""
    wd = tmp_path_factory.mktemp("mp") / "inner_ref"
    train(wd, INNER + ["--config.num_cpu_devices=8"], stop=6)
    return metrics(wd)


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [
    ((2, 4), (1, 8, "--config.mesh.fsdp=4", "--config.mesh.tensor=1")),
    ((4, 2), (2, 4)),
], ids=["a-worker-per-process", "a-worker-over-two-processes"])
def test_workers_of_four_devices_on_several_processes_equal_one_process(tmp_path, first, then,
                                                                       inner_reference):
    """Issue 49, W = 2 workers of ``fsdp x tensor = 2 x 2`` devices over several processes,
    equal to 1 process x 8 devices step by step, then resumed from the checkpoint of step 3 in
    another layout. Laid out like two nodes: 2 processes x 4 devices, ``data`` across the
    processes, resumed in 1 process with workers of 4 ``fsdp`` devices (the same W, another
    layout inside the workers). And a worker of several hosts (a multi-host TPU slice, or
    one process per GPU): 4 processes x 2 devices, each worker's devices over 2 processes
    that load the same rows and each write their own shards of the checkpoint, resumed as 2
    processes x 4 devices, a worker per process."""
    wd = tmp_path / "run"
    out = train(wd, INNER + [f"--config.num_cpu_devices={first[1]}"], processes=first[0],
                stop=3)
    assert f"devices: 8 x cpu ({first[0]} process(es))" in out.stdout
    assert "2 workers of 4 devices each (mesh data x fsdp x tensor = 2 x 2 x 2)" in out.stdout
    out = train(wd, INNER + [f"--config.num_cpu_devices={then[1]}", *then[2:]],
                processes=then[0], stop=6)
    assert "at step 3" in out.stdout and f"devices: 8 x cpu ({then[0]} process(es))" in out.stdout
    shape = "2 x 4 x 1" if then[2:] else "2 x 2 x 2"
    assert f"(mesh data x fsdp x tensor = {shape})" in out.stdout
    same_trajectory(metrics(wd), inner_reference)


@pytest.mark.slow
def test_pipeline_across_processes(tmp_path):
    """A 2-stage MAPL pipeline (W = 2 x 2 stages) over 2 processes, checkpointed and resumed,
    equals the 1-process run (it used to crash after compiling: 'Invalid host data')."""
    ref = tmp_path / "ref"
    train(ref, PIPELINE + ["--config.workers=2"], stop=6)
    wd = tmp_path / "run"
    train(wd, PIPELINE, processes=2, stop=3)
    out = train(wd, PIPELINE, processes=2, stop=6)
    assert "devices: 4 x cpu (2 process(es))" in out.stdout and "at step 3" in out.stdout
    same_trajectory(metrics(wd), metrics(ref))


@pytest.mark.slow
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


@pytest.mark.slow
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

def _pair(workdir, devices=(2, 2), extra=()):
    """``python train.py`` as processes 0 and 1 of 2 (``devices``: each one's simulated CPU
    devices; ``extra``: more flags, the last of a flag given twice wins), started by hand as on
    a cluster; stdout and stderr in files beside ``workdir``."""
    port, procs = launch.free_port(), []
    for i, n in enumerate(devices):
        out = {s: open(f"{workdir}.{i}.{s}", "w") for s in ("out", "err")}
        procs.append(subprocess.Popen(
            [sys.executable, "train.py", *BASE, f"--config.num_cpu_devices={n}",
             "--config.workers=0", "--config.stop_at_step=5", f"--workdir={workdir}", *extra],
            cwd=ROOT, env=launch.process_env(i, 2, port, _env()), stdout=out["out"],
            stderr=out["err"]))
    return procs


def _text(workdir, i, stream):
    with open(f"{workdir}.{i}.{stream}") as f:
        return f.read()


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("processes, per_worker, devices, inner", [
    (3, 1, 2, ()),
    (6, 2, 2, ("--config.mesh.fsdp=2", "--config.mesh.tensor=2", "--config.batch_per_worker=4")),
])
def test_elastic_launcher_carries_on_after_a_sigkill(tmp_path, processes, per_worker, devices,
                                                    inner):
    """``launch --elastic`` on a cluster's layout (issue 47): process 1 (2 devices each) is
    killed with SIGKILL once the checkpoint of step 5 exists; the others end in one line each
    (status 75), and the launcher starts the run again as the processes left, which re-lay out
    that checkpoint on their devices (--config.elastic=True: each process computes the layout
    on its own CPU device and places only its own shares; it used to crash in process 1 and
    call the checkpoint damaged in process 0) and finish. The data carry on in examples: the
    stream after the switch starts at the first example the first run had not read.

    Two layouts: 3 processes of one-device workers (W = 6 -> 4); and 6 processes of 2 devices
    whose workers of fsdp x tensor = 2 x 2 span 2 processes each (issue 49, W = 3 -> 2,
    ``--processes-per-worker 2``): of the 5 processes left the launcher restarts 4, whole
    workers."""
    wd = tmp_path / "run"
    cmd = [sys.executable, "-m", "sdp_jax.train.launch", "--processes", str(processes),
           "--elastic", f"--processes-per-worker={per_worker}", f"--timeout={TIMEOUT - 60}",
           "--", "python", "train.py", *BASE[:2], "--config.steps=30",
           "--config.checkpoint_every=5", "--config.eval_every=100", "--config.eval_batches=1",
           f"--config.num_cpu_devices={devices}", "--config.workers=0", *inner,
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
        pids = re.search(rf"{processes} process\(es\), pids ([\d ]+),", err_path.read_text())
        os.kill(int(pids.group(1).split()[1]), signal.SIGKILL)   # the launcher's own child
        assert proc.wait(timeout=TIMEOUT) == 0, err_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = err_path.read_text()
    for survivor in set(range(processes)) - {1}:
        assert (f"process 1 of {processes} died without a word (killed or crashed) before the "
                f"run finished; this is process {survivor}, exiting with status 75") in log, log
    statuses = [137 if i == 1 else 75 for i in range(processes)]
    assert f"exit statuses {statuses}" in log, log
    left = processes - per_worker
    who = (f"the {left} process(es) left" if per_worker == 1 else
           f"{left} of the {processes - 1} process(es) left (whole workers of 2 processes)")
    assert f"process(es) 1 lost; restarting the run as {who}" in log, log
    assert "damaged" not in log and "Traceback" not in log.split("restarting")[1], log
    with open(wd / "summary.json") as f:
        summary = json.load(f)
    per = 1 if per_worker == 1 else 4   # devices per worker
    before, after = processes * devices // per, left * devices // per
    rows = 2 if per_worker == 1 else 4   # batch_per_worker
    assert summary["completed"] and summary["steps"] == 30 and summary["workers"] == after
    (switch,) = summary["elastic"]
    s = switch["step"]
    assert s % 5 == 0 and s >= 5 and switch["from"]["workers"] == before
    assert switch["to"] == {**switch["from"], "workers": after, "global_batch": after * rows}
    meta = _checkpoint_meta(wd, 30)
    assert meta["workers"] == after and meta["elastic"] == [switch]
    # s steps of `before` workers x `rows` windows were read
    assert meta["data_origin"] == [s, s * before * rows]
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("before, after, devices, variant", [
    (3, 2, 4, "b-sdp"), (6, 4, 2, "b-sdp"), (2, 1, 4, "ddp")])
def test_elastic_resume_on_fewer_processes_keeps_the_workers_devices(tmp_path, before, after,
                                                                    devices, variant):
    """Issue 49: workers of fsdp x tensor = 2 x 2 stop at step 3; fewer processes carry on
    with --config.elastic=True as fewer workers of the same 2 x 2. Laid out as 3 processes x 4
    devices (a worker per process) then 2 x 4, as 6 processes x 2 devices (a worker spans 2
    processes) then 4 x 2, and (ddp) as 2 processes x 4 devices then one worker of 4 devices
    in 1 process (plain FSDP and tensor parallelism). The re-laid-out state, gathered and
    joined again, equals the checkpoint's full state bit for bit (tests/elastic_probe.py, in
    every process), and train.py continues the run through the switch."""
    wd = tmp_path / "run"
    inner = ["--config.mesh.fsdp=2", "--config.mesh.tensor=2", "--config.batch_per_worker=4",
             f"--config.sdp.variant={variant}"]
    w0, w1 = before * devices // 4, after * devices // 4
    _elastic_run(wd, before, devices, inner, stop=3)
    probe = _probe(wd, after, devices, inner)
    assert probe["step"] == 3 and probe["workers"] == w1 and probe["processes"] == after
    assert probe["leaves"] >= 3 * 9   # the parameters and both Adam moments of every leaf
    out = _elastic_run(wd, after, devices, [*inner, "--config.elastic=True"], stop=5)
    assert f"elastic resume (--config.elastic) at step 3: workers {w0} -> {w1}" in out, \
        out[-2000:]
    many = f"{w1} workers of 4 devices each" if w1 > 1 else "1 worker of 4 devices"
    assert f"{many} (mesh data x fsdp x tensor = {w1} x 2 x 2)" in out
    assert [r["step"] for r in metrics(wd)] == list(range(1, 6))


def _listening(port: int) -> set:
    """The local addresses with a TCP socket listening on ``port`` (``/proc/net/tcp`` and
    ``tcp6``: ``127.0.0.1``, ``0.0.0.0``, ``::``, ...; an IPv4-mapped one as IPv4)."""
    import ipaddress
    out = set()
    for name, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/net/{name}") as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hexport = local.partition(":")
                if state == "0A" and int(hexport, 16) == port:   # 0A: LISTEN
                    raw = bytes.fromhex(address)
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    ip = ipaddress.ip_address(words)
                    out.add(str(getattr(ip, "ipv4_mapped", None) or ip))   # ::ffff:a.b.c.d
    return out


@pytest.mark.slow
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
        # JAX's coordination service (process 0) listens on 127.0.0.1 alone, not [::]
        with open(f"/proc/{procs[0].pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        port = int(env[b"JAX_COORDINATOR_ADDRESS"].rsplit(b":", 1)[1])
        assert env[b"JAX_COORDINATOR_BIND_ADDRESS"] == f"127.0.0.1:{port}".encode()
        assert _listening(port) == {"127.0.0.1"}, _listening(port)
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


# ---------------------- issue 47: a signal before the watch, a hung process, a killed coordinator

INTERRUPTED = ("interrupted by SIGTERM: stopped (checkpoints already written are kept: rerun "
               "the same command to resume)")
LAUNCH = [sys.executable, "-m", "sdp_jax.train.launch", "--processes", "2"]
TRAIN = ["python", "train.py", *BASE, "--config.num_cpu_devices=2", "--config.workers=0"]


def _launcher_pids(err_path, deadline):
    """The pids the launcher printed (its first stderr line), once it has."""
    while time.monotonic() < deadline:
        found = re.search(r"process\(es\), pids ([\d ]+),", err_path.read_text())
        if found:
            return [int(p) for p in found.group(1).split()]
        time.sleep(0.05)
    raise AssertionError(err_path.read_text())


def _holds_sigterm(pid: int) -> bool:
    """Whether process ``pid``'s main thread blocks SIGTERM (``SigBlk`` in /proc): it has
    reached :func:`sdp_jax.train.launch.peers.hold_signals`, the first thing ``train.py`` does,
    so a signal from now on is the held kind. On 2 busy cores a process may take longer than
    the test's 0.5 s to get there; before it, SIGTERM kills any Python program outright."""
    try:
        with open(f"/proc/{pid}/status") as f:
            blocked = next(ln for ln in f if ln.startswith("SigBlk:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(blocked, 16) >> (signal.SIGTERM - 1) & 1)


def _note_ends(procs: dict, ended: dict) -> None:
    """``ended[key]``: when each of ``procs`` (by key) was first seen ended."""
    for key, p in procs.items():
        if key not in ended and p.poll() is not None:
            ended[key] = time.monotonic()


def _end_all(procs) -> None:
    """(finally) SIGCONT and SIGKILL each of ``procs`` (``Popen``s of this test) still
    running."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def _end_children(launcher, pids):
    """(finally) SIGCONT and SIGKILL the launcher's children still running (checked to be its
    children by their parent pid), then the launcher."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != launcher.pid:
                    continue
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()


@pytest.mark.slow
@pytest.mark.parametrize("cases,under_launcher", [
    ({"p0_0.5s": (0, 0.5), "p1_1.5s": (1, 1.5)}, False),
    ({"p1_init": (1, None)}, True)], ids=["early", "after-init-and-launcher"])
def test_a_signal_before_the_watch_ends_every_process_in_one_line(tmp_path, cases,
                                                                   under_launcher):
    """Issue 47: SIGTERM to one process before ``jax.distributed.initialize`` made it exit 143
    at once while the other waited --init_timeout (300 s) without a word. Now the signal is
    held until the processes' watch has started and the process leaves through it: both end
    with one line each and status 143, within seconds of each other and before the hold's
    bound (peers.HOLD), and nothing is written. SIGTERM to process 0 at 0.5 s and to process 1
    at 1.5 s (two runs at once); then to process 1 right after initialization (process 0 logs
    its data) and, under the launcher, to process 1 at 0.5 s (two runs at once: more would
    start too slowly on 2 cores for the hold's bound). A timed signal waits, if need be, until
    its process holds signals (:func:`_holds_sigterm`), long before its watch starts."""
    runs = {k: tmp_path / k for k in [*cases, "launcher"]}
    err_path = tmp_path / "launcher.err"
    launcher, pids = None, []
    if under_launcher:
        with open(err_path, "w") as err:
            launcher = subprocess.Popen(
                [*LAUNCH, f"--timeout={TIMEOUT - 60}", "--", *TRAIN, "--config.stop_at_step=5",
                 f"--workdir={runs['launcher']}"], cwd=ROOT, env=_env(),
                stdout=subprocess.DEVNULL, stderr=err)
    t0 = time.monotonic()
    pairs = {k: _pair(str(runs[k])) for k in cases}
    procs = {(k, i): p for k, ps in pairs.items() for i, p in enumerate(ps)}
    if launcher is not None:
        procs["launcher", 0] = launcher
    deadline, sent, ended = t0 + TIMEOUT, {}, {}
    try:
        if launcher is not None:
            pids = _launcher_pids(err_path, deadline)
        t_launch = time.monotonic()
        while time.monotonic() < deadline and len(ended) < len(procs):
            now = time.monotonic()
            for k, (victim, at) in cases.items():
                due = (now - t0 >= at and _holds_sigterm(pairs[k][victim].pid)
                       if at is not None else "data " in _text(runs[k], 0, "out"))
                if k not in sent and due:
                    pairs[k][victim].send_signal(signal.SIGTERM)
                    sent[k] = time.monotonic()
            if (launcher is not None and "launcher" not in sent and now - t_launch >= 0.5
                    and _holds_sigterm(pids[1])):
                os.kill(pids[1], signal.SIGTERM)   # the launcher's own child, by pid
                sent["launcher"] = time.monotonic()
            _note_ends(procs, ended)
            time.sleep(0.02)
    finally:
        _end_all([p for ps in pairs.values() for p in ps])
        if launcher is not None:
            _end_children(launcher, pids)
    for k, (victim, _) in cases.items():
        status = [p.returncode for p in pairs[k]]
        err = [_text(runs[k], i, "err").strip() for i in (0, 1)]
        assert status == [143, 143], (k, status, err)
        assert err[victim] == INTERRUPTED, (k, err)
        other = err[1 - victim]
        assert other.startswith(f"stopping: process {victim} of 2 ended with status 143 "
                                "(SIGTERM) before the run finished"), (k, err)
        assert "\n" not in other, (k, err)
        # through the watch: not the hold's bound, nor --init_timeout
        assert max(ended[k, 0], ended[k, 1]) - sent[k] < peers.HOLD, (k, ended, sent)
        if victim == 1 and k == "p1_init":
            assert not (runs[k] / "metrics.jsonl").exists()
        else:
            assert not runs[k].exists(), k
    if launcher is None:
        return
    log = err_path.read_text()
    assert launcher.returncode == 143 and "exit statuses [143, 143]" in log, log
    lines = [ln for ln in log.splitlines() if ln and not ln.startswith(launch.PROG)]
    assert sorted(lines)[0] == INTERRUPTED, log
    assert sorted(lines)[1].startswith("stopping: process 1 of 2 ended with status 143"), log
    assert len(lines) == 2, log
    assert ended["launcher", 0] - sent["launcher"] < peers.HOLD
    assert not runs["launcher"].exists()


HOLDER = """
import os, signal, sys, time
from sdp_jax.train.launch import peers
def leave(signum):
    os.write(2, f"left through the watch: {signum}\\n".encode())
    os._exit(128 + signum)
signal.signal(signal.SIGTERM, lambda signum, frame: leave(signum))
peers.hold_signals(leave, bound=float(sys.argv[1]))
print("held", flush=True)
time.sleep(float(sys.argv[2]))   # jax.distributed.initialize and the watch's start
peers.release_signals()
print("released", flush=True)
time.sleep(60)
"""


def test_a_held_signal_leaves_through_the_watch_or_after_its_bound(tmp_path):
    """peers.hold_signals, four processes at once (no JAX): a SIGTERM held until the release
    leaves then (through ``exit_fn``, which tells the others); a second one ends the process at
    once; without a release it ends after its bound with one line; after the release a
    signal reaches the handler at once."""
    cases = {   # (bound s, release after s, signals at s after "held")
        "released": (10, 2.0, [0.2]), "twice": (10, 30, [0.2, 1.0]),
        "bound": (1.5, 30, [0.2]), "after": (10, 0.1, [1.0])}
    procs = {k: subprocess.Popen([sys.executable, "-c", HOLDER, str(b), str(r)], cwd=ROOT,
                                 env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for k, (b, r, _) in cases.items()}
    try:
        for p in procs.values():
            assert p.stdout.readline() == "held\n"
        t0, sent, ended = time.monotonic(), {}, {}
        while len(ended) < len(procs) and time.monotonic() - t0 < 60:
            for k, (_, _, at) in cases.items():
                for t in at[len(sent.get(k, [])):][:1]:
                    if time.monotonic() - t0 >= t:
                        procs[k].send_signal(signal.SIGTERM)
                        sent.setdefault(k, []).append(time.monotonic())
                if k not in ended and procs[k].poll() is not None:
                    ended[k] = time.monotonic()
            time.sleep(0.01)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    out = {k: p.communicate() for k, p in procs.items()}
    assert all(p.returncode == 143 for p in procs.values()), out
    left = "left through the watch: 15\n"
    assert out["released"] == ("", left) and 1.0 < ended["released"] - sent["released"][0] < 5
    assert out["twice"] == ("", left) and ended["twice"] - sent["twice"][1] < 1.0
    assert ended["twice"] - sent["twice"][0] > 0.7   # (the first was held)
    assert out["bound"][1].startswith("interrupted by SIGTERM: stopped before the other "
                                      "processes could be told (they had not all joined "
                                      "within 2 s of the signal") and out["bound"][0] == ""
    assert out["bound"][1].count("\n") == 1 and 1.4 < ended["bound"] - sent["bound"][0] < 5
    assert out["after"] == ("released\n", left) and ended["after"] - sent["after"][0] < 1.0


def _script(processes, body, capfd, **kw):
    """``launch.run`` of a small Python program (no JAX) as ``processes`` processes, elastic:
    ``(status, seconds, the launcher's stderr)``."""
    t0 = time.monotonic()
    status = launch.run([sys.executable, "-c", "import os, signal, sys, time\n" + body],
                        processes, env=_env(), elastic=True, **kw)
    return status, time.monotonic() - t0, capfd.readouterr().err


def test_the_elastic_launcher_restarts_whole_workers_of_several_processes(capfd):
    """``--processes-per-worker 2`` (workers that span 2 processes): 6 processes of which
    process 3 is lost (status 76) restart as 4, not 5; with one worker of 2 processes, losing
    one leaves none to restart, and with two, the one worker left restarts; a --processes it
    does not divide is refused. (No JAX.)"""
    body = ("if os.environ['JAX_NUM_PROCESSES'] != '6': sys.exit(0)\n"
            "time.sleep(0.5)\n"
            "sys.exit(76 if os.environ['JAX_PROCESS_ID'] == '3' else 75)\n")
    status, _, err = _script(6, body, capfd, restarts=1, grace=1.0, processes_per_worker=2)
    assert status == 0 and "exit statuses [75, 75, 75, 76, 75, 75]" in err, err
    assert ("process(es) 3 lost; restarting the run as 4 of the 5 process(es) left (whole "
            "workers of 2 processes)") in err, err
    assert "4 process(es), pids" in err, err
    status, _, err = _script(2, body.replace("'6'", "'2'").replace("'3'", "'1'"), capfd,
                             restarts=1, grace=1.0, processes_per_worker=2)
    assert status == 75 and ("process(es) 1 lost; not restarting (no whole worker of 2 "
                             "processes left)") in err, err
    status, _, err = _script(4, body.replace("'6'", "'4'"), capfd, restarts=1, grace=1.0,
                             processes_per_worker=2)
    assert status == 0 and ("process(es) 3 lost; restarting the run as 2 of the 3 process(es) "
                            "left (whole workers of 2 processes)") in err, err
    with pytest.raises(ValueError, match="--processes-per-worker=4 must be at least 1 and "
                                         "divide --processes=6"):
        launch.run(["true"], 6, processes_per_worker=4)


# Process 1 never ends, process 0 ends with 75 (its peer hung); a restart of 1 process ends 0.
_HUNG_ONE = ("if os.environ['JAX_NUM_PROCESSES'] == '1': sys.exit(0)\n"
             "time.sleep(120) if os.environ['JAX_PROCESS_ID'] == '1' else time.sleep(1)\n"
             "sys.exit(75)\n")


@pytest.mark.slow
def test_the_launcher_takes_a_process_left_running_by_a_lost_peer_as_hung(tmp_path, capfd):
    """Process 0 ends with status 75 (its peer hung) while process 1 never ends: the launcher
    kills process 1 (SIGKILL) launch.HUNG_AFTER s later and counts it lost, so that --elastic
    restarts the run as the 1 process left (which finishes), also with a --grace shorter than
    that. A process that ends with 76 (peers.TAKEN_AS_HUNG: its peers took it as stuck) is
    lost too; one killed before the others' watch started has them ended
    launch.UNTOLD_AFTER s later (they were never told). And a process ended by SIGTERM before it could handle it has the signal passed
    on twice to the others. (No JAX.)"""
    status, took, err = _script(2, _HUNG_ONE, capfd, restarts=1)
    assert status == 0 and 1 + launch.HUNG_AFTER < took < 30, (took, err)
    assert ("process(es) 1 still running 5s after the others ended with status 75 (a peer "
            "lost or hung): taken as hung, killed (SIGKILL)") in err, err
    assert "exit statuses [75, 137]" in err
    assert "process(es) 1 lost; restarting the run as the 1 process(es) left" in err, err
    status, _, err = _script(2, _HUNG_ONE, capfd, restarts=1, grace=1.0)
    assert status == 0 and "process(es) 1 lost; restarting" in err, err   # (hung first)
    status, _, err = _script(3, "if os.environ['JAX_NUM_PROCESSES'] == '2': sys.exit(0)\n"
                                "time.sleep(1)\n"
                                "sys.exit(76 if os.environ['JAX_PROCESS_ID'] == '2' else 75)\n",
                             capfd, restarts=1, grace=1.0)
    assert status == 0 and "exit statuses [75, 75, 76]" in err, err
    assert "process(es) 2 lost; restarting the run as the 2 process(es) left" in err, err
    # process 1 killed before the others' watch started (they hold a SIGTERM until it has):
    # the launcher ends them launch.UNTOLD_AFTER s later, and restarts as the 1 process left
    status, took, err = _script(2, "if os.environ['JAX_NUM_PROCESSES'] == '1': sys.exit(0)\n"
                                   "if os.environ['JAX_PROCESS_ID'] == '1':\n"
                                   "    time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)\n"
                                   "got = []\n"
                                   "def held(signum, frame):\n"
                                   "    got.append(signum)\n"
                                   "    if len(got) == 2: os._exit(128 + signum)\n"
                                   "signal.signal(signal.SIGTERM, held)\n"
                                   "time.sleep(120)\n", capfd, restarts=1)
    assert status == 0 and launch.UNTOLD_AFTER < took < launch.UNTOLD_AFTER + 15, (took, err)
    assert ("process(es) 1 lost (SIGKILL) and process(es) 0 still running 10s later, not told "
            "(it died before their watch started): ending them") in err, err
    assert "exit statuses [143, 137]" in err, err
    assert "process(es) 1 lost; restarting the run as the 1 process(es) left" in err, err
    status, took, err = _script(2, "if os.environ['JAX_PROCESS_ID'] == '1':\n"
                                   "    time.sleep(1); os.kill(os.getpid(), signal.SIGTERM)\n"
                                   "got = []\n"
                                   "def held(signum, frame):\n"
                                   "    got.append(signum)\n"
                                   "    if len(got) == 2: os._exit(128 + signum)\n"
                                   "signal.signal(signal.SIGTERM, held)\n"
                                   "time.sleep(60)\n", capfd)
    assert status == 143 and took < 10, err
    assert ("process 1 was ended by SIGTERM before it could handle it; passing it on to the "
            "others") in err and "exit statuses [143, 143]" in err, err
    assert "restarting" not in err   # a signal is not a lost process


def test_a_process_declares_its_hang_bound(monkeypatch):
    """The bound the heartbeats carry: --hang_timeout while busy (restoring, compiling,
    evaluating, saving) and through the first step, then --hang_step_multiple times the slowest
    of the last 20 steps, at least min(30 s, --hang_timeout); 0 turns it off. Bad values are
    refused in one line before anything starts."""
    watch = peers._Watch(1, 2, {}, (60.0, 10.0))
    monkeypatch.setattr(peers, "_WATCH", [watch])

    def step(seconds):
        watch.mark = time.monotonic() - seconds
        peers.stepped()
        return watch.mine

    with peers.busy("compiling"):
        assert watch.mine == (60.0, "compiling")
    assert step(9.0) == (60.0, "training")     # the first step: still starting
    assert step(0.5) == (30.0, "training")     # 10 x 0.5 s, floor 30 s
    assert step(4.0)[0] == pytest.approx(40.0, abs=0.2)
    for _ in range(19):
        assert step(0.1)[0] == pytest.approx(40.0, abs=0.2)   # the slowest of the last 20
    assert step(0.1) == (30.0, "training")
    with peers.busy("saving"):
        assert watch.mine == (60.0, "saving")
    watch.hang = (8.0, 10.0)
    assert step(0.1) == (8.0, "training")      # the floor: --hang_timeout when below 30 s
    watch.hang = (0, 10.0)
    assert step(0.1) == (0.0, "training")      # 0: never taken as hung
    for bad, match in [((3, 10), "--hang_timeout=3 must be 0"), ((-1, 10), "--hang_timeout=-1"),
                       ((300, 1.5), "--hang_step_multiple=1.5 must be at least 2")]:
        with pytest.raises(ValueError, match=match):
            launch.initialize("false", 300, hang_timeout=bad[0], hang_step_multiple=bad[1])


def test_the_verdict_names_a_silent_or_a_stuck_process():
    """Process 0's verdict (no processes: a watch of 3 fed by hand). A peer silent past the
    bound it declared is hung ("silent"). A peer that is heard but whose progress age (sent in
    its heartbeats, ``h BOUND PHASE AGE``) is past its bound is hung ("stuck") only when every
    process, process 0 included, trains and is past its own bound and --hang_timeout: then the
    one stuck the longest is named (the others waited for it); one process within its bound or
    --hang_timeout, one in a busy phase (compiling), a bound of 0, or a process other than 0
    (which hears only process 0) gives no stuck verdict. A peer that stops reading never
    blocks a send: the message is given up after SEND_WITHIN s and that connection takes no
    more."""
    import socket
    pairs = [socket.socketpair() for _ in range(2)]
    watch = peers._Watch(0, 3, {1: pairs[0][0], 2: pairs[1][0]}, (20.0, 10.0))
    now = time.monotonic()
    assert watch.verdict(now) is None
    watch.heard[2], watch.bounds[2], watch.phases[2] = now - 45, 40.0, "training"
    assert watch.verdict(now) == (2, pytest.approx(45), 40.0, "training", "silent")
    watch.heard[2] = now
    for pid, (mine, theirs) in enumerate(pairs, 1):   # the reader threads, as start() runs
        threading.Thread(target=watch.read, args=(pid, mine), daemon=True).start()
        theirs.sendall(f"h 30 training {60 - 10 * pid}\n".encode())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and watch.ages[2][0] != 40.0:
        time.sleep(0.01)
    assert watch.bounds == {1: 30.0, 2: 30.0} and watch.ages[1][0] == 50.0
    now = time.monotonic()
    watch.heard = {1: now, 2: now}
    watch.mark, watch.mine = now - 35, (30.0, "training")   # process 0 waits too, past 30 s
    assert watch.verdict(now) == (1, pytest.approx(50, abs=1), 30.0, "training", "stuck")
    watch.mark = now - 10                                   # process 0 within its bound
    assert watch.verdict(now) is None
    watch.mark, watch.hang = now - 35, (40.0, 10.0)         # never before --hang_timeout
    assert watch.verdict(now) is None
    watch.hang, watch.phases[2] = (20.0, 10.0), "compiling"  # a busy phase: silence alone
    assert watch.verdict(now) is None
    watch.phases[2], watch.mine = "training", (0.0, "training")   # 0: never
    assert watch.verdict(now) is None
    other = peers._Watch(1, 3, {0: pairs[0][0]}, (60.0, 10.0))
    other.ages[0], other.mark = (500.0, now), now - 500
    assert other.verdict(now) is None                        # only process 0 judges progress
    full, t0 = b"x" * (1 << 20), time.monotonic()
    sent = next((k for k in range(64) if not peers._send_within(pairs[1][0], full, 0.3)), None)
    assert sent is not None and time.monotonic() - t0 < 10   # a full buffer: given up
    peers_within, peers.SEND_WITHIN = peers.SEND_WITHIN, 0.2
    try:
        watch.send("h 1 training 0\n", to={2})
        assert 2 in watch.stuck
    finally:
        peers.SEND_WITHIN = peers_within
    watch.ending = True   # (so that the readers' end of file acts on nothing: no exit here)
    for a, b in pairs:
        a.close()
        b.close()


HANG = ["--hang_timeout=8", "--hang_step_multiple=3", "--config.stop_at_step=400"]


def _logged(workdir) -> bool:
    """Whether the run has logged a step (metrics.jsonl is created empty when the loop
    starts)."""
    path = workdir / "metrics.jsonl"
    return path.exists() and bool(path.read_text().strip())


@pytest.mark.slow
def test_a_hung_process_or_a_killed_coordinator_ends_the_others_in_one_line(tmp_path):
    """Issue 47, five runs at once, with --hang_timeout=8 and --hang_step_multiple=3 (the
    bound: 8 s here). Four pairs, each acted on once steps run (process 0 logged step 3):

    * SIGSTOP to process 1 (a hung process): process 0 used to wait 100 s without a word, and
      process 1, continued, aborted with a C++ check failure (134). Now process 0 ends within
      seconds of the bound with one line naming process 1 and status 75; process 1, continued
      after that, ends with one line and 75;
    * SIGSTOP to process 0: process 1 names it the same way;
    * SIGSTOP to process 1 for 3 s, below the bound (a slow process): both finish (status 0);
    * SIGKILL to process 0 (the coordinator): process 1's stderr is the watch's one line, not
      JAX's "Polled an error from coordination service" and fatal "Terminating process"
      lines before it (peers.relay).

    And ``launch --elastic`` with process 1 of 2 stopped once the checkpoint of step 10
    exists: process 0 names it hung and ends (75), the launcher kills it (SIGKILL, its own
    child) launch.HUNG_AFTER s later and counts it lost, and restarts the run as the 1 process
    left, which resumes with --config.elastic=True and finishes (the hung process used to
    stall the run, then abort with 134: no restart)."""
    cases = ("hung1", "hung0", "slow1", "kill0")
    runs = {k: tmp_path / k for k in [*cases, "elastic"]}
    err_path = tmp_path / "launcher.err"
    with open(err_path, "w") as err:
        launcher = subprocess.Popen(
            [*LAUNCH, "--elastic", f"--timeout={TIMEOUT - 60}", "--", *TRAIN[:4],
             "--config.steps=40", "--config.checkpoint_every=5", "--config.eval_every=100",
             "--config.eval_batches=1", "--config.num_cpu_devices=2", "--config.workers=0",
             *HANG[:2], f"--workdir={runs['elastic']}"], cwd=ROOT, env=_env(),
            stdout=subprocess.DEVNULL, stderr=err)
    pairs = {k: _pair(str(runs[k]), extra=[*HANG, "--config.stop_at_step=12"] if k == "slow1"
                      else HANG) for k in cases}
    victim = {"hung1": 1, "hung0": 0, "slow1": 1, "kill0": 0}
    deadline, acted, ended, conted, pids = time.monotonic() + TIMEOUT, {}, {}, {}, []
    try:
        pids = _launcher_pids(err_path, deadline)
        while time.monotonic() < deadline and len(ended) < 2 * len(cases) + 1:
            now = time.monotonic()
            for k in cases:
                p = pairs[k][victim[k]]
                if k not in acted and _logged(runs[k]):
                    p.send_signal(signal.SIGKILL if k == "kill0" else signal.SIGSTOP)
                    acted[k] = now
                other_ended = (k, 1 - victim[k]) in ended
                if k in acted and k not in conted and k != "kill0" and (
                        other_ended or (k == "slow1" and now - acted[k] > 3)):
                    p.send_signal(signal.SIGCONT)
                    conted[k] = now
            if "elastic" not in acted and (runs["elastic"] / "checkpoints" / "10").is_dir():
                os.kill(pids[1], signal.SIGSTOP)   # the launcher's own child, by pid
                acted["elastic"] = now
            procs = {(k, i): p for k, ps in pairs.items() for i, p in enumerate(ps)}
            _note_ends({**procs, ("elastic", 0): launcher}, ended)
            time.sleep(0.05)
    finally:
        _end_all([p for ps in pairs.values() for p in ps])
        _end_children(launcher, pids)
    status = {k: [p.returncode for p in procs] for k, procs in pairs.items()}
    err = {k: [_text(runs[k], i, "err").rstrip() for i in (0, 1)] for k in cases}
    last = {k: [e.split("\n")[-1] for e in errs] for k, errs in err.items()}
    for k in ("hung1", "hung0"):
        v = victim[k]
        assert status[k] == [76 if i == v else 75 for i in (0, 1)], (k, status[k], err[k])
        assert last[k][1 - v].startswith(f"stopping: process {v} of 2 made no progress for "), (
            k, err[k])
        assert "(hung? silent: stopped, frozen, or its host gone; its bound while training " \
               "was " in last[k][1 - v]
        assert last[k][v].startswith(f"stopping: this process ({v} of 2) made no progress "), (
            k, err[k])
        assert ended[k, 1 - v] - acted[k] < 8 + 20   # the bound and a heartbeat; JAX's: 100 s
        for e in err[k]:
            assert "Check failure" not in e and "coordination_service" not in e, (k, e)
            assert e.count("stopping:") == 1, (k, e)
    assert not err["hung1"][1].count("\n") and not err["hung0"][1].count("\n"), err
    assert status["slow1"] == [0, 0], err["slow1"]
    assert json.loads((runs["slow1"] / "summary.json").read_text())["steps"] == 12
    assert status["kill0"] == [-signal.SIGKILL, 75], err["kill0"]
    assert err["kill0"][1] == ("stopping: process 0 of 2 died without a word (killed or "
                               "crashed) before the run finished; this is process 1, exiting "
                               "with status 75 (see process 0's output; checkpoints already "
                               "written are kept: rerun to resume)"), err["kill0"]
    assert ended["kill0", 1] - acted["kill0"] < 10
    log = err_path.read_text()
    assert launcher.returncode == 0, log[-3000:]
    assert "stopping: process 1 of 2 made no progress for" in log, log
    assert "process(es) 1 still running 5s after the others ended with status 75" in log
    assert "exit statuses [75, 137]" in log
    assert "process(es) 1 lost; restarting the run as the 1 process(es) left" in log
    summary = json.loads((runs["elastic"] / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 40 and summary["workers"] == 2
    (switch,) = summary["elastic"]
    assert switch["step"] >= 10 and switch["from"]["workers"] == 4
