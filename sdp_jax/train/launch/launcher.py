"""Start a command as several JAX processes on this machine (``jax.distributed`` on 127.0.0.1).

    python -m sdp_jax.train.launch --processes 2 -- python train.py --config configs/llama_tiny.py \\
        --config.num_cpu_devices=2 --config.workers=0 --workdir runs/two

Each process gets ``JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT`` (a free port unless ``--port``),
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, which ``train.py`` (``--distributed=auto``) passes
to ``jax.distributed.initialize``; on a CPU each process simulates
``--config.num_cpu_devices`` devices and collectives between processes go through gloo. This is
the layout the tests run (docs/design.md invariants 8 and 9); on a cluster a scheduler (SLURM,
a TPU pod slice) starts the processes instead (README.md, *Multi-host*).

The processes run in their own session, so a terminal's Ctrl-C reaches only the launcher, which
forwards SIGINT, SIGTERM and SIGHUP (a closed terminal) to every process: on the first, each process
stops with the others after the same step and saves a checkpoint; a second aborts. When a process
ends (with an error, or early), the others get ``--grace`` seconds to finish and are then
terminated; a process still running :data:`HUNG_AFTER` s after every process that ended did so with
status 75 (its peers took it as hung, :mod:`sdp_jax.train.launch.peers`) is killed (SIGKILL) and
lost. The exit status is the first non-zero status of a process (0 when all succeed). Only the
launcher's own child processes are ever signalled.

With ``--elastic`` the launcher carries on when processes are lost (killed by SIGKILL, which it
sends while the run goes only to a hung process: the out-of-memory killer, a reclaimed device,
a silent process; or ended with status 76, taken as stuck by its peers): once every process
has ended, it starts the command again as the processes that are left, with
``--config.elastic=True`` appended, so that the run resumes from its latest checkpoint on the devices that remain, under
masks drawn for the new worker count (:mod:`sdp_jax.train.elastic`; at most ``--restarts``
times). With workers that span several processes (``--processes-per-worker G``) it restarts
whole workers only: the largest multiple of ``G`` not above the processes left.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from sdp_jax.train.launch import peers

PROG = "python -m sdp_jax.train.launch"
# Seconds after the last process ended with status 75 (a peer lost) before the ones still
# running are taken as hung: a live process told of the loss ends at once, process 0 last
# after waiting for the others (peers.DRAIN at most); the others end within a heartbeat of
# each other when process 0 itself hung.
HUNG_AFTER = peers.DRAIN
# Seconds after a process was lost (SIGKILL) before the ones still running are taken as never
# told (it died before their watch started: they wait in jax.distributed.initialize): a
# process that the watch told ends within peers.GRACE + peers.DRAIN.
UNTOLD_AFTER = peers.GRACE + peers.DRAIN + 3.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(process_id: int, processes: int, port: int,
                base: dict | None = None) -> dict:
    """The environment of process ``process_id`` of ``processes``: ``base`` (default
    ``os.environ``) plus the three ``JAX_*`` variables ``train.py`` reads, and
    ``JAX_COORDINATOR_BIND_ADDRESS`` (JAX's coordination service in process 0 would otherwise
    listen on every interface, ``[::]:PORT``: here it listens on 127.0.0.1 alone)."""
    env = dict(os.environ if base is None else base)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
               JAX_PROCESS_ID=str(process_id), JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")
    return env


def run(command: Sequence[str], processes: int, *, port: int = 0, grace: float = 60.0,
        timeout: float = 0.0, env: dict | None = None, cwd: str | None = None,
        elastic: bool = False, restarts: int = 3, processes_per_worker: int = 1) -> int:
    """Run ``command`` as ``processes`` processes (see the module docstring) and wait.

    Args:
      command: the program and its arguments, e.g. ``["python", "train.py", ...]``.
      processes: number of processes (>= 1).
      port: coordinator port on 127.0.0.1 (0: a free one; a restart of ``elastic`` takes a
        free one).
      grace: seconds the other processes get after one ends, before they are terminated
        (SIGTERM, then SIGKILL 10 s later; the status is then 1 if all that ended succeeded).
      timeout: seconds after which every process is terminated (0: none; each attempt).
      env, cwd: base environment and working directory of the processes.
      elastic: when processes are lost (killed by SIGKILL, which the launcher sends while the
        run goes only to a hung process: the out-of-memory killer, a scheduler reclaiming a
        device, a process its peers took as hung), start
        the command again as the processes that are left, with
        ``--config.elastic=True`` appended, so that the run resumes from its latest
        checkpoint on the devices that remain (:mod:`sdp_jax.train.elastic`); at most
        ``restarts`` times.
      processes_per_worker: ``G``, the processes one worker spans (a worker of
        ``mesh.fsdp x mesh.tensor`` devices over processes of fewer devices each, e.g. a
        multi-host TPU slice or one process per GPU): ``processes`` must be a multiple of it,
        and an elastic restart starts the largest multiple of ``G`` not above the processes
        left (a worker that lost a process is lost whole).

    Returns:
      the first non-zero exit status of a process (signals as ``128 + signal``) of the last
      attempt, else 0; 124 when ``timeout`` ended it.

    Raises:
      ValueError: ``processes < 1``, ``restarts < 0``, ``processes`` not a multiple of
        ``processes_per_worker`` or an empty command.
    """
    if processes < 1:
        raise ValueError(f"--processes={processes} must be at least 1.")
    check_processes_per_worker(processes, processes_per_worker)
    if restarts < 0:
        raise ValueError(f"--restarts={restarts} must be at least 0.")
    if not command:
        raise ValueError("no command: give it after --, e.g. -- python train.py --workdir runs/x")
    signalled: list[int] = []
    status, lost = _attempt(list(command), processes, port, grace, timeout, env, cwd, signalled)
    done = 0
    while elastic and lost:   # (lost is [] once the launcher forwarded a signal)
        left = _restart(processes, lost, processes_per_worker,
                        "--timeout reached" if status == 124
                        else f"--restarts={restarts} used" if done == restarts else "")
        if not left:
            break
        processes, done = left, done + 1
        if "--config.elastic=True" not in command:
            command = [*command, "--config.elastic=True"]
        status, lost = _attempt(command, processes, 0, grace, timeout, env, cwd, signalled)
    return status


def check_processes_per_worker(processes: int, per_worker: int) -> None:
    """The one rule of ``--processes-per-worker``: at least 1, dividing ``--processes``.

    Raises:
      ValueError: one line naming both and the fix."""
    if per_worker < 1 or processes % per_worker:
        raise ValueError(f"--processes-per-worker={per_worker} must be at least 1 and divide "
                         f"--processes={processes}; give a worker's processes (mesh.fsdp x "
                         "mesh.tensor / devices per process).")


def _restart(processes: int, lost: list, per_worker: int, why: str) -> int:
    """The processes an elastic restart starts after ``lost`` of ``processes``: the largest
    multiple of ``per_worker`` (a worker that lost a process is lost whole) not above those
    left, or 0 when none can restart (``why``, or none left); says which in one line."""
    alive = processes - len(lost)
    left = alive - alive % per_worker
    why = ("no process left" if alive < 1 else f"no whole worker of {per_worker} processes "
           "left" if left < 1 else why)
    who = (f"the {left} process(es) left" if left == alive else
           f"{left} of the {alive} process(es) left (whole workers of {per_worker} processes)")
    print(f"{PROG}: process(es) {', '.join(map(str, lost))} lost; "
          + (f"not restarting ({why})" if why else
             f"restarting the run as {who}, from its latest checkpoint (--config.elastic=True)"),
          file=sys.stderr, flush=True)
    return 0 if why else left


def _attempt(command: list, processes: int, port: int, grace: float, timeout: float,
             env: dict | None, cwd: str | None, signalled: list) -> tuple[int, list]:
    """One start of ``processes`` processes (:func:`run`): ``(status, the ids of the processes
    lost: killed by SIGKILL, which the launcher sends while a run is going only to a hung
    process (:func:`_wait`), or ended with :data:`sdp_jax.train.launch.peers.TAKEN_AS_HUNG` (its
    peers took it as stuck); a crash of the program itself, e.g. SIGSEGV or SIGABRT, is not a
    lost process)``."""
    port = port or free_port()
    children: list[subprocess.Popen] = []

    def forward(signum, frame):  # noqa: ARG001
        signalled.append(signum)
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for i in range(processes):
            # Own session: a terminal's Ctrl-C reaches the launcher only, which forwards it.
            # SIGINT handled by default in the process even if the launcher was started
            # ignoring it (a background job), so that a forwarded Ctrl-C works.
            children.append(subprocess.Popen(
                command, env=process_env(i, processes, port, env), cwd=cwd,
                start_new_session=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)))
        print(f"{PROG}: {processes} process(es), pids "
              f"{' '.join(str(c.pid) for c in children)}, coordinator 127.0.0.1:{port}",
              file=sys.stderr, flush=True)
        stopped: list[int] = []
        status = _wait(children, grace, timeout, signalled, stopped)
        lost = [i for i, c in enumerate(children) if i not in stopped and c.returncode in (
            -signal.SIGKILL, peers.TAKEN_AS_HUNG)]
        return status, ([] if signalled else lost)
    finally:
        for c in children:   # never leave a process of ours behind
            if c.poll() is None:
                c.kill()
                c.wait()
        for s, h in old.items():
            signal.signal(s, h)


def _status(code: int) -> int:
    return 128 - code if code < 0 else code   # Popen reports death by signal N as -N


def _stop(children: list, grace_kill: float = 10.0, stopped: list | None = None) -> None:
    """Terminate (then kill) the children still running; their ids go to ``stopped``."""
    for i, c in enumerate(children):
        if c.poll() is None:
            c.terminate()
            if stopped is not None:
                stopped.append(i)
    deadline = time.monotonic() + grace_kill
    for c in children:
        try:
            c.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()


def _wait(children: list, grace: float, timeout: float, signalled: list,
          stopped: list | None = None) -> int:
    """Wait for ``children`` (:func:`_attempt`): the first non-zero status, 124 after
    ``timeout``. After a process ends, the others get ``grace`` seconds, then are stopped
    (their ids go to ``stopped``); a process ended by SIGINT / SIGTERM itself (before it could
    handle it) has that signal passed on to the others; and once every process that ended did so
    with :data:`sdp_jax.train.launch.peers.DEAD_PEER` (or was killed) and :data:`HUNG_AFTER` s went
    by, the ones still running are hung: killed with SIGKILL, and lost (not in ``stopped``);
    once a process was killed (SIGKILL) and :data:`UNTOLD_AFTER` s went by with none ending
    with DEAD_PEER, the ones still running were never told (it died before their watch
    started): they are ended (SIGTERM twice) and stopped."""
    start, ended_at, first_bad, ends = time.monotonic(), None, 0, {}
    while True:
        codes = [c.poll() for c in children]
        now = time.monotonic()
        for i, code in enumerate(codes):
            if code is None or i in ends:
                continue
            ends[i] = now
            if ended_at is None and len(children) > 1:
                ended_at = now
                if code and not signalled:
                    print(f"{PROG}: process {i} exited with status {_status(code)}; the others "
                          f"get {grace:.0f}s to finish", file=sys.stderr, flush=True)
            if code in (-signal.SIGINT, -signal.SIGTERM) and not signalled:
                print(f"{PROG}: process {i} was ended by {signal.Signals(-code).name} before "
                      "it could handle it; passing it on to the others", file=sys.stderr,
                      flush=True)
                signalled.append(-code)
                _pass_on(children, -code)
            if code not in (None, 0) and not first_bad:
                first_bad = _status(code)
        if all(code is not None for code in codes):
            if first_bad and len(children) > 1:
                print(f"{PROG}: exit statuses {[_status(c) for c in codes]}", file=sys.stderr,
                      flush=True)
            return first_bad
        lost_peer = not signalled and _lost_peer([codes[i] for i in ends])
        if not signalled and _end_lost(children, codes, ends, now, lost_peer, stopped):
            continue
        if ended_at is not None and now - ended_at > grace and not lost_peer:   # (hung first)
            print(f"{PROG}: a process ended {grace:.0f}s ago; terminating the ones still "
                  "running", file=sys.stderr, flush=True)
            _stop(children, stopped=stopped)
            return first_bad or 1
        if timeout and now - start > timeout:
            print(f"{PROG}: --timeout={timeout:.0f}s reached; terminating every process",
                  file=sys.stderr, flush=True)
            _stop(children, stopped=stopped)
            return 124
        time.sleep(0.2)


def _lost_peer(ended: list) -> bool:
    """Whether the processes that ended (``ended``: their return codes) did so as after a
    lost peer: one with :data:`sdp_jax.train.launch.peers.DEAD_PEER`, every one with it, with
    :data:`sdp_jax.train.launch.peers.TAKEN_AS_HUNG` or killed."""
    return peers.DEAD_PEER in ended and all(
        code in (peers.DEAD_PEER, peers.TAKEN_AS_HUNG, -signal.SIGKILL) for code in ended)


def _end_lost(children: list, codes: list, ends: dict, now: float, lost_peer: bool,
              stopped: list | None) -> bool:
    """(:func:`_wait`, no signal forwarded) End the processes still running that a lost one
    leaves waiting: hung ones (``lost_peer`` and :data:`HUNG_AFTER` s since the last end:
    killed, lost), or ones never told (a process killed :data:`UNTOLD_AFTER` s ago, before
    their watch started: SIGTERM twice, stopped). Whether it ended any."""
    running = ", ".join(str(i) for i, code in enumerate(codes) if code is None)
    if lost_peer and now - max(ends.values()) > HUNG_AFTER:
        print(f"{PROG}: process(es) {running} still running {HUNG_AFTER:.0f}s after the others "
              f"ended with status {peers.DEAD_PEER} (a peer lost or hung): taken as hung, "
              "killed (SIGKILL)", file=sys.stderr, flush=True)
        for i, code in enumerate(codes):
            if code is None:
                children[i].kill()
                children[i].wait()
        return True
    killed = [i for i in ends if codes[i] == -signal.SIGKILL]
    if killed and not lost_peer and now - max(ends[i] for i in killed) > UNTOLD_AFTER:
        print(f"{PROG}: process(es) {', '.join(map(str, killed))} lost (SIGKILL) and "
              f"process(es) {running} still running {UNTOLD_AFTER:.0f}s later, not told (it "
              "died before their watch started): ending them", file=sys.stderr, flush=True)
        _pass_on(children, signal.SIGTERM)   # (twice: a held first one waits for the watch)
        _stop(children, stopped=stopped)
        return True
    return False


def _pass_on(children: list, signum: int) -> None:
    """Send ``signum`` twice, 0.5 s apart, to the children still running: a process ended by
    it before it could handle it never joins the others' watch, so they would hold the first
    one (:func:`sdp_jax.train.launch.peers.hold_signals`) in vain; the second ends them at once."""
    for _ in range(2):
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)
        time.sleep(0.5)


def _scheduler_tasks(env) -> int:
    """Tasks SLURM or Open MPI started (1 without a scheduler or with an unreadable count)."""
    counts = [env.get(k, "1") or "1" for k in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")]
    return max(int(c) if c.isdigit() else 1 for c in counts)


def multi_process_env(env: dict | None = None) -> bool:
    """Whether the environment says this is one of several processes: a
    ``JAX_COORDINATOR_ADDRESS``, SLURM or Open MPI with more than one task, or a TPU pod
    slice."""
    env = os.environ if env is None else env
    if env.get("JAX_COORDINATOR_ADDRESS") or _scheduler_tasks(env) > 1:
        return True
    return "," in env.get("TPU_WORKER_HOSTNAMES", "")


def coordinator_args(env: dict | None = None) -> dict:
    """``jax.distributed.initialize`` arguments from ``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (``{}`` without the address: JAX then detects
    SLURM, Open MPI or a TPU pod slice itself).

    Raises:
      ValueError: one line naming the missing or bad variable and what it must hold."""
    env = os.environ if env is None else env
    address = env.get("JAX_COORDINATOR_ADDRESS", "")
    if not address:
        return {}
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"JAX_COORDINATOR_ADDRESS={address!r} must be HOST:PORT of process 0, "
                         "e.g. 10.0.0.1:1234")
    if not (env.get("JAX_NUM_PROCESSES") or env.get("JAX_PROCESS_ID")) \
            and _scheduler_tasks(env) > 1:
        return dict(coordinator_address=address)   # SLURM / Open MPI give the count and id
    values = {}
    for key in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        raw = env.get(key)
        if raw is None or not raw.strip().isdigit():
            got = "is not set" if raw is None else f"is {raw!r}"
            raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {key} {got}; set "
                             "JAX_NUM_PROCESSES (the number of processes) and JAX_PROCESS_ID "
                             "(0 .. JAX_NUM_PROCESSES-1, each once) in every process, or launch "
                             f"with {PROG}")
        values[key] = int(raw)
    n, pid = values["JAX_NUM_PROCESSES"], values["JAX_PROCESS_ID"]
    if n < 1 or not 0 <= pid < n:
        raise ValueError(f"JAX_PROCESS_ID={pid} must be in 0 .. JAX_NUM_PROCESSES-1 = {n - 1}")
    return dict(coordinator_address=address, num_processes=n, process_id=pid)


def _reachable(address: str, seconds: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=seconds):
            return True
    except OSError:
        return False


def _missing_peers(kwargs: dict, where: str) -> str:
    """Which peers an initialization that timed out waited for, as far as this process can tell.

    JAX reports no registrations before every process has registered, so: a process other
    than 0 that cannot reach the coordinator names process 0; with two processes the missing
    peer is the other one; with more, every process that did start prints this line, so the
    process ids absent from the logs are the missing ones.
    """
    n, me = kwargs.get("num_processes"), kwargs.get("process_id", 0)
    if kwargs and me != 0 and not _reachable(where):
        return (f"the coordinator (process 0) at {where} is not reachable: start process 0, or "
                "fix JAX_COORDINATOR_ADDRESS")
    fix = ("start it (each JAX_PROCESS_ID once, the same JAX_NUM_PROCESSES), check its log, or "
           "raise --init_timeout")
    if n == 2:
        return (f"process {1 - me} did not register with the coordinator at {where}; {fix}")
    return (f"not every one of the {n or 'expected'} processes registered with the coordinator "
            f"at {where}; each process that started prints this line, so a process id missing "
            f"from these lines did not: {fix}")


def initialize(mode: str = "auto", timeout: int = 300, env: dict | None = None,
               hang_timeout: float = 300, hang_step_multiple: float = 10) -> bool:
    """Call ``jax.distributed.initialize`` when ``mode`` is ``true``, or ``auto`` and the
    environment is that of several processes (:func:`multi_process_env`), and start the processes'
    watch (:func:`sdp_jax.train.launch.peers.start`: a process that ends before the run does, or
    goes silent past the bound it declared, ``hang_timeout`` seconds while it starts,
    compiles, evaluates or saves and ``hang_step_multiple`` times its slowest recent step once
    steps run, ends the others within seconds, with one line).

    JAX aborts the process with a C++ stack trace when the processes do not all register
    in time; a watchdog instead prints one line after ``timeout`` seconds (which process, the
    coordinator's address, whether it is reachable, what to check) and exits with status 1
    (JAX's own deadline is 10 s later). JAX's own heartbeat, which aborts every process with a
    stack dump, is set beyond ``hang_timeout`` so that the watch speaks first.

    The process's signal handlers hold throughout: SIGINT and SIGTERM are blocked from before
    the call until the watch has started (one arriving meanwhile is handled then), JAX's
    preemption service (which installs its own SIGTERM handler over the project's and would
    swallow a scheduler's SIGTERM) is turned off (``jax_enable_preemption_service``), and the Python
    handlers are installed again after the call, whatever it installed. A signal held since the
    process started (:func:`sdp_jax.train.launch.peers.hold_signals`, ``train.py``) ends it once the
    watch has started, through the watch (:func:`sdp_jax.train.launch.peers.release_signals`).

    Returns:
      whether JAX was initialized for several processes.
    Raises:
      ValueError: a bad launch environment (:func:`coordinator_args`), ``mode=true`` with no
        cluster environment, ``timeout < 1`` or a bad hang bound
        (:func:`sdp_jax.train.launch.peers.check_hang`).
    """
    env = os.environ if env is None else env
    if mode not in ("auto", "true", "false"):
        raise ValueError(f"--distributed={mode!r} must be auto, true or false")
    peers.check_hang(hang_timeout, hang_step_multiple)
    if mode == "false" or (mode == "auto" and not multi_process_env(env)):
        peers.release_signals()
        return False
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
        raise ValueError(f"--init_timeout={timeout!r} must be a positive number of seconds")
    _join(coordinator_args(env), timeout, hang_timeout, hang_step_multiple)
    peers.release_signals()   # a signal held since the start: leave through the watch now
    return True


def _join(kwargs: dict, timeout: int, hang_timeout: float, hang_step_multiple: float) -> None:
    """:func:`initialize`'s work: ``jax.distributed.initialize`` (:func:`_initialize`) with
    SIGINT and SIGTERM blocked, then the watch (:func:`sdp_jax.train.launch.peers.start`)."""
    from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
    main = threading.current_thread() is threading.main_thread()
    held = (signal.SIGINT, signal.SIGTERM)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, held) if main else None
    try:
        # JAX's heartbeat (it aborts every process) after the watch's bound (one line)
        _initialize(kwargs, timeout, max(100, int(hang_timeout) + 60))
        for sig in held if main else ():   # ours again, whatever the call installed
            handler = signal.getsignal(sig)
            if handler is not None:
                signal.signal(sig, handler)
        state = jax_distributed.global_state
        warning = peers.start(state.client, state.process_id, state.num_processes,
                              state.coordinator_address.rpartition(":")[0].strip("[]"),
                              timeout=float(min(timeout, 60)), hang_timeout=hang_timeout,
                              hang_step_multiple=hang_step_multiple)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    finally:
        if main:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _initialize(kwargs: dict, timeout: int, heartbeat: int = 100) -> None:
    """``jax.distributed.initialize(**kwargs)`` with JAX's preemption service off and its
    heartbeat timeout ``heartbeat`` seconds, under the ``timeout`` watchdog of
    :func:`initialize`; a process other than 0 reaches the coordinator through
    :func:`sdp_jax.train.launch.peers.relay`.

    Raises:
      ValueError: JAX found no cluster environment (``kwargs`` empty)."""
    done = threading.Event()
    where = kwargs.get("coordinator_address", "the detected coordinator")
    who = (f"process {kwargs['process_id']} of {kwargs['num_processes']}" if kwargs
           else "this process")

    def watchdog():   # fires at `timeout`; JAX itself would abort 10 s later
        if done.wait(timeout):
            return
        print(f"error: {who} waited {timeout}s in jax.distributed.initialize: "
              f"{_missing_peers(kwargs, where)}.", file=sys.stderr, flush=True)
        os._exit(1)

    import jax  # pylint: disable=g-import-not-at-top  (the launcher itself never imports JAX)

    threading.Thread(target=watchdog, daemon=True).start()
    jax.config.update("jax_enable_preemption_service", False)
    call = dict(kwargs)
    if kwargs.get("process_id"):   # not process 0 (it hosts the coordination service): its
        # death is told by the watch in one line, not by JAX's client (peers.relay)
        call["coordinator_address"] = peers.relay(kwargs["coordinator_address"])
    try:
        jax.distributed.initialize(initialization_timeout=timeout + 10,
                                   heartbeat_timeout_seconds=heartbeat, **call)
    except ValueError as e:
        if not kwargs:
            raise ValueError(
                "--distributed=true but no cluster environment was found "
                f"({str(e).splitlines()[0][:200]}); set JAX_COORDINATOR_ADDRESS, "
                "JAX_NUM_PROCESSES and JAX_PROCESS_ID, or launch with "
                f"{PROG}, srun or mpirun, or on a TPU pod slice") from e
        raise
    finally:
        done.set()


def parser() -> argparse.ArgumentParser:
    """The launcher's own flags (those before ``--``): ``--processes``, ``--port``, ``--grace``,
    ``--timeout``, ``--elastic``, ``--restarts``, ``--processes-per-worker``."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                usage=f"{PROG} --processes N [options] -- COMMAND ...")
    p.add_argument("--processes", type=int, required=True, help="number of processes")
    p.add_argument("--port", type=int, default=0,
                   help="coordinator port on 127.0.0.1 (default: a free one); with --elastic "
                        "a restart takes a free port")
    p.add_argument("--grace", type=float, default=60.0,
                   help="seconds the others get after a process ends (default 60)")
    p.add_argument("--timeout", type=float, default=0.0,
                   help="terminate every process after this many seconds (0: never)")
    p.add_argument("--elastic", action="store_true",
                   help="when processes are lost (killed by SIGKILL, or hung), restart the run "
                        "as the processes left, from its latest checkpoint "
                        "(--config.elastic=True)")
    p.add_argument("--restarts", type=int, default=3,
                   help="with --elastic, restarts at most (default 3)")
    p.add_argument("--processes-per-worker", type=int, default=1,
                   help="the processes one worker spans (mesh.fsdp x mesh.tensor / devices per "
                        "process; default 1): --processes is a multiple of it, and --elastic "
                        "restarts as whole workers (without --elastic it is only checked)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sdp_jax.train.launch --processes N [options] -- COMMAND ...`` (the module
    docstring); returns the exit status of :func:`run`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1:]
    else:
        own, command = argv, []
    own_flags = parser()
    args = own_flags.parse_args(own)
    if command and command[0].endswith(".py"):
        command = [sys.executable, *command]
    elif command and command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]   # the launcher's interpreter
    try:
        return run(command, args.processes, port=args.port, grace=args.grace,
                   timeout=args.timeout, elastic=args.elastic, restarts=args.restarts,
                   processes_per_worker=args.processes_per_worker)
    except ValueError as e:
        own_flags.error(str(e))
    except OSError as e:   # the command cannot be started
        own_flags.error(f"cannot start {command[0]!r}: {e}")
    return 2
