"""Every process of a multi-process run learns within seconds when another one ends or stops
making progress before the run does, and ends too with one line (``train.py`` starts this
through :func:`sdp_jax.train.launch.initialize`).

JAX's own health check is slow and loud: a process that dies or hangs is noticed by the
coordination service's heartbeat after 100 s, and the survivors then abort with a C++ check
failure, a stack dump and SIGABRT; when process 0 (which hosts the coordination service) ends,
the others abort at once, the same way (its client logs "Polled an error from coordination
service" and "Terminating process because the JAX distributed service detected fatal
errors"). So:

* process 0 listens on a TCP port of its own host (the coordinator's; the port is published in
  JAX's key-value store) and every other process connects to it. The kernel closes a process's
  connections however it ends (an exit, SIGKILL, a crash), so process 0 learns at once;
* a process that ends on purpose before the run is over (a signal before the loop agreed on a
  step, :func:`sdp_jax.train.cli.exit_on_signal`; an error) first sends its exit status
  (:func:`leaving`); one that finished the run says so (:func:`done`): its end is expected;
* every process sends a heartbeat each :data:`BEAT` second (from a thread: JAX releases the
  GIL while it compiles, restores, saves and runs steps) declaring how long the others may hear
  nothing from it before they take it as hung: ``--hang_timeout`` while it starts, restores,
  compiles, evaluates or saves (:func:`busy`), and once steps run a multiple of its slowest
  recent step (:func:`stepped`; never below :data:`HANG_FLOOR` s, or ``--hang_timeout`` when
  smaller), and its progress age (the seconds since it last ended a step or began or ended a
  busy phase). Process 0 watches every other process, the others watch process 0; one silent
  for longer than it declared is *hung* (stopped, frozen, its host gone), and so is, when no
  process has made progress within its bound although all are heard (a collective or a device
  that hangs), the one stuck the longest (:meth:`_Watch.verdict`): the others end as after a
  death, naming it, and it ends with :data:`TAKEN_AS_HUNG`;
* process 0 waits :data:`GRACE` seconds after an error or a death (a process hit by the same
  error as its peer reports its own), tells every other process to stop, waits up to
  :data:`DRAIN` seconds for them to end (so that none of them sees the coordination service
  vanish) and ends last. Each survivor prints one line and exits with the status the ended
  process sent (143 after SIGTERM, 2 after a usage error), or :data:`DEAD_PEER` when it ended
  without a word (killed, crashed) or hung;
* the other processes reach the coordination service through a relay of their own
  (:func:`relay`), which hides process 0's death from JAX's client until the watch has ended
  the process with its one line.

A survivor therefore ends within ``GRACE + DRAIN`` (7 s) of the other process's end (of its
bound, for a hung one); one whose collective failed first (the peer died during a step) waits
for that news rather than printing the failure's traceback (:func:`follow_lost_peer`,
``train.py``).

A SIGINT or SIGTERM that reaches a process of several before the watch exists (while Python
starts, JAX imports, or ``jax.distributed.initialize`` waits for the others) is held
(:func:`hold_signals`): the process goes on into the watch and leaves through it with
``128 + signal``, so that the others end with it; if the watch does not start within
:data:`HOLD` seconds of the signal the process ends anyway, and a second signal ends it at once.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time

DEAD_PEER = 75    # sysexits' EX_TEMPFAIL: another process died or hung; rerun to resume
TAKEN_AS_HUNG = 76  # this process was taken as hung by the others (its host or devices may be
                    # at fault): the elastic launcher restarts the run without it
GRACE = 2.0       # seconds process 0 waits before acting on another process's end
DRAIN = 5.0       # seconds process 0 waits for the others to end before it ends
HOLD = 20.0       # seconds a signal that came before the watch waits for it (schedulers
                  # send SIGKILL about 30 s after SIGTERM)
BEAT = 1.0        # seconds between heartbeats
HANG_FLOOR = 30.0  # seconds: the least bound once steps run (a loaded machine's noise)
HANG_STEPS = 20   # the bound once steps run follows the slowest of this many recent steps
STALL = 3.0       # a heartbeat thread that itself stood still this long (this process was
                  # stopped or starved) blames nobody for that silence (the least bound is 5 s)
HUNG = -2         # the news "status" of a process that went silent or stuck past its bound
SEND_WITHIN = 2.0  # seconds a message may wait for a peer's connection to take it
KEY = "sdp_jax/peers/address"


class _Watch:
    """This process's side: its connections (process 0: one per other process, by id; others:
    ``{0: the connection to process 0}``), what it hears on them and whether it is ending or
    done. ``hang``: ``(--hang_timeout, --hang_step_multiple)``."""

    def __init__(self, me: int, n: int, conns: dict, hang: tuple = (300.0, 10.0)):
        self.me, self.n, self.conns, self.hang = me, n, conns, hang
        self.ending = self.finished = False
        self.done_peers: set = set()
        self.gone: set = set()
        self.lock, self.news, self.sending = threading.Lock(), None, threading.RLock()
        now = time.monotonic()
        self.heard = {pid: now for pid in conns}     # when each peer was last heard
        self.bounds = {pid: float(hang[0]) for pid in conns}   # what each peer declared
        self.phases = {pid: "starting" for pid in conns}
        self.ages = {pid: (0.0, now) for pid in conns}   # each peer's progress age, heard when
        self.stuck: set = set()                      # peers whose connection took no message
        self.mine = (float(hang[0]), "starting")     # what this process declares
        self.steps: list = []                        # its recent step times (s)
        self.mark, self.first_step = now, True       # its last progress (a step, a phase)

    def send(self, message: str, to=None) -> None:
        """``message`` to the processes ``to`` (default: every one connected), whole, one
        sender at a time (reentrant: a signal handler may send while its thread sends), each
        connection given at most :data:`SEND_WITHIN` s to take it: a peer whose host vanished
        without closing the connection (a full send buffer) never blocks this process; that
        connection then takes no more messages (its silence is the peer's verdict)."""
        data = message.encode()
        with self.sending:
            for pid, conn in list(self.conns.items()):
                if (to is None or pid in to) and pid not in self.stuck:
                    if not _send_within(conn, data, SEND_WITHIN):
                        self.stuck.add(pid)

    def read(self, pid: int, conn) -> None:
        """A connection's reader thread: ``h BOUND PHASE`` (a heartbeat: take the sender as
        hung after BOUND s of silence, 0: never), ``d`` (that process finished the run),
        ``x STATUS ORIGIN`` (ORIGIN ended with STATUS; -1: without a word) or ``x -2 ORIGIN
        SECONDS BOUND PHASE`` (ORIGIN was silent SECONDS s, past its BOUND, while in PHASE),
        end of file."""
        buf = b""
        while chunk := _recv(conn, 256):
            self.heard[pid] = time.monotonic()
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                words = line.decode(errors="replace").split()
                if len(words) in (3, 4) and words[0] == "h":
                    self.bounds[pid], self.phases[pid] = float(words[1]), words[2]
                    if len(words) == 4:
                        self.ages[pid] = (float(words[3]), time.monotonic())
                elif words == ["d"]:
                    self.done_peers.add(pid)
                elif len(words) in (3, 7) and words[0] == "x":
                    self.ended(int(words[1]), int(words[2]), *words[3:])
        self.gone.add(pid)
        if pid not in self.done_peers:
            self.ended(-1, pid)

    def beat(self) -> None:
        """The heartbeat thread: every :data:`BEAT` s, look for a process to take as hung
        (:meth:`verdict`: :data:`HUNG` news), then tell the peers this process's bound, phase
        and progress age (``h BOUND PHASE AGE``)."""
        last = time.monotonic()
        while not (self.ending or self.finished or self.news):
            time.sleep(BEAT)
            now = time.monotonic()
            if now - last > STALL:   # this process stood still: its peers' silence is its own
                for pid in self.heard:
                    self.heard[pid] = now
            else:
                hung = self.verdict(now)
                if hung is not None:
                    origin, seconds, bound, phase, how = hung
                    self.ended(HUNG, origin, f"{seconds:.0f}", f"{bound:g}", phase, how)
                    return
            last = now
            bound, phase = self.mine
            self.send(f"h {bound:g} {phase} {now - self.mark:.1f}\n")

    def verdict(self, now: float):
        """``(process, seconds, its bound, its phase, how)`` of a process to take as hung, or
        None: a peer *silent* longer than the bound it declared (stopped, frozen, its host or
        link gone); or, seen by process 0, which hears every process, when every process is
        training (past its first step) and none has made progress (a step, a phase begun or
        ended) within its bound and ``--hang_timeout`` although all are alive (a collective or
        a device that hangs), the one *stuck* the longest, which the others then wait for.
        (Busy phases, a compile or a save of any length, are judged by silence alone.)"""
        live = [pid for pid in self.heard if pid not in self.gone | self.done_peers]
        for pid in live:
            silent, bound = now - self.heard[pid], self.bounds[pid]
            if bound > 0 and silent > bound:
                return pid, silent, bound, self.phases[pid], "silent"
        if self.me != 0 or not live:
            return None
        ages = {pid: (age + now - at, self.bounds[pid], self.phases[pid])
                for pid, (age, at) in self.ages.items() if pid in live}
        ages[self.me] = (now - self.mark, *self.mine)
        timeout = self.hang[0]   # (stuck: never sooner than --hang_timeout, and only while
        # every process trains: compiles, restores, saves of any length are not judged so)
        if timeout and all(phase == "training" and bound > 0 and age > max(bound, timeout)
                           for age, bound, phase in ages.values()):
            pid = max(ages, key=lambda p: ages[p][0])
            return (pid, *ages[pid], "stuck")
        return None

    def ended(self, status: int, origin: int, *hung: str) -> None:
        """Process ``origin`` ended before the run did (``status``, -1 when unknown) or hung
        (:data:`HUNG`; ``hung``: its silence, bound and phase): the first such news is acted
        on (:meth:`act`, in its own thread: the readers go on reading)."""
        with self.lock:
            if self.news is not None:
                return
            self.news = (status, origin, *hung)
        threading.Thread(target=self.act, args=self.news, daemon=True).start()

    def act(self, status: int, origin: int, *hung: str) -> None:
        """Unless this process is ending or done: (process 0; after :data:`GRACE` seconds
        when the process died without a word) tell the others and wait for them to end; then
        one line and ``status`` (or :data:`DEAD_PEER`). After another process's error
        (``0 < status < 128``) every process waits :data:`GRACE` seconds first, so that one
        hitting the same error (a config refused on every process) reports its own. A hung
        process is told too (it reads the news if it ever runs again)."""
        # (an error or a crash: this process may report its own; not after a signal (the
        # others would go on meanwhile) or a hang (it has had its time))
        if (self.me == 0 and status == -1) or 0 < status < 128:
            deadline = time.monotonic() + GRACE
            while time.monotonic() < deadline and not (self.ending or self.finished):
                time.sleep(0.05)
        if self.ending or self.finished:
            return
        news = f"x {status} {origin}{''.join(' ' + w for w in hung)}\n"
        if self.me == 0 and origin != 0:
            self.send(news, to=set(self.conns) - ({origin} if status != HUNG else set()))
            self.drain(origin)
        elif status == HUNG and origin == 0:
            self.send(news)   # process 0 reads why its peers left, if it runs again
        code = (status if status > 0 else TAKEN_AS_HUNG if origin == self.me
                else DEAD_PEER)
        see = "" if origin == self.me else f"see process {origin}'s output; "
        what = _what(status, origin, self.me, self.n, hung)
        _write_and_exit(f"{_after_bar()}stopping: {what} before the run finished; this is "
                        f"process {self.me}, exiting with status {code} ({see}checkpoints "
                        "already written are kept: rerun to resume)\n", code)

    def drain(self, origin: int) -> None:
        """(process 0) Wait up to :data:`DRAIN` seconds for the others (but ``origin``) to
        end."""
        deadline, others = time.monotonic() + DRAIN, set(self.conns) - {origin}
        while time.monotonic() < deadline and not others <= self.gone:
            time.sleep(0.05)

    def declare(self, bound: float, phase: str) -> None:
        """Take this process as hung after ``bound`` s of silence (0: never), while in
        ``phase`` (one word): said at once when the phase changes, else by the next
        heartbeat."""
        changed = phase != self.mine[1]
        self.mine = (float(bound), phase)
        if changed:
            self.send(f"h {float(bound):g} {phase} {time.monotonic() - self.mark:.1f}\n")


def _send_within(conn, data: bytes, seconds: float) -> bool:
    """Send ``data`` whole on ``conn`` unless it takes longer than ``seconds`` (a full send
    buffer: the peer stopped reading) or the connection breaks; whether it was sent."""
    deadline = time.monotonic() + seconds
    while data:
        try:
            data = data[conn.send(data, socket.MSG_DONTWAIT):]
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([], [conn], [], left)
        except OSError:
            return False
    return True


def _recv(conn, size: int) -> bytes:
    """``conn.recv(size)``; ``b""`` once the connection is closed or broken."""
    try:
        return conn.recv(size)
    except OSError:
        return b""


def _what(status: int, origin: int, me: int, n: int, hung) -> str:
    """What happened to process ``origin``, for the survivors' one line."""
    if status == HUNG:
        seconds, bound, phase, how = hung
        who = (f"this process ({me} of {n})" if origin == me else f"process {origin} of {n}")
        why = ("silent: stopped, frozen, or its host gone" if how == "silent" else
               "alive but stuck, and every other process waited for it past its bound: a "
               "collective or a device that hangs")
        return (f"{who} made no progress for {seconds} s (hung? {why}; its bound while "
                f"{phase} was {bound} s: --hang_timeout, --hang_step_multiple)")
    if status < 0:
        return f"process {origin} of {n} died without a word (killed or crashed)"
    return f"process {origin} of {n} ended with status {status}{_signal_name(status)}"


_WATCH: list = []   # the process's watch, once started


class _Held:
    """SIGINT and SIGTERM held until the watch starts (:func:`hold_signals`): the first one is
    kept, a second one or one after the release ends the process at once (``exit_fn``)."""

    def __init__(self, signals: set, exit_fn, bound: float):
        self.signals, self.exit_fn, self.bound = signals, exit_fn, bound
        self.lock = threading.Lock()
        self.released = False
        self.first = None   # (signal number, time.monotonic() of its arrival)

    def wait(self) -> None:
        """The thread that takes the held signals (they are blocked in every thread, so none
        runs a handler) and ends the process :data:`HOLD` s after the first one if the watch
        has not started by then."""
        while True:
            info = signal.sigtimedwait(self.signals, 0.1)
            with self.lock:
                now = time.monotonic()
                if info is not None and (self.released or self.first is not None):
                    self.exit_fn(info.si_signo)   # a second signal: at once (does not return)
                if info is not None:
                    self.first = (info.si_signo, now)
                elif self.released:
                    return
                elif self.first is not None and now - self.first[1] > self.bound:
                    name = signal.Signals(self.first[0]).name
                    _write_and_exit(
                        f"interrupted by {name}: stopped before the other processes could be "
                        f"told (they had not all joined within {self.bound:.0f} s of the "
                        "signal; each ends on its own signal or after --init_timeout; "
                        "checkpoints already written are kept: rerun the same command to "
                        "resume)\n", 128 + self.first[0])


_HELD: list = []   # the process's held signals, while held


def hold_signals(exit_fn, bound: float = HOLD) -> None:
    """Hold SIGINT and SIGTERM from now until :func:`release_signals` (the watch has started):
    for a process of several, whose end before the watch exists would leave the others waiting
    for it in ``jax.distributed.initialize``. Call it first thing, in the main thread (the
    signals are blocked there, so that every thread started later inherits the block; a thread
    of this module takes them). A signal the process was started ignoring stays ignored.

    The first signal is kept: :func:`release_signals` then ends the process with
    ``exit_fn(signum)`` (which tells the others through the watch), or ``bound`` seconds after
    the signal the process ends anyway with one line and ``128 + signum``; a second signal
    ends it at once with ``exit_fn``. Nothing outside the main thread or when already held."""
    if threading.current_thread() is not threading.main_thread() or _HELD:
        return
    signals = {s for s in (signal.SIGINT, signal.SIGTERM)
               if signal.getsignal(s) is not signal.SIG_IGN}
    if not signals:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    held = _Held(signals, exit_fn, bound)
    _HELD.append(held)
    threading.Thread(target=held.wait, daemon=True, name="sdp_jax-held-signals").start()


def release_signals() -> None:
    """The watch has started (or there is none to start): a signal held since
    :func:`hold_signals` ends the process now through ``exit_fn`` (which tells the others);
    else the signals reach the process's handlers again. Call it in the main thread; nothing
    when no signal is held."""
    if not _HELD or threading.current_thread() is not threading.main_thread():
        return
    held = _HELD.pop()
    with held.lock:
        held.released = True
        first = held.first
    if first is not None:
        held.exit_fn(first[0])
    signal.pthread_sigmask(signal.SIG_UNBLOCK, held.signals)


class _Relay:
    """(a process other than 0) This process's connections to JAX's coordination service (on
    process 0) pass through a port of its own, so that process 0's death reaches this process
    through the watch, in one line, and not through JAX, whose client logs the lost connection
    and aborts the process (``coordination_service_agent.cc ... Polled an error``, ``client.h
    ... Terminating process``: three lines and more before the watch's line, or none of it).
    When the coordinator's side closes, this side stays open for :data:`GRACE` +
    :data:`DRAIN` + 3 s (the watch ends the process meanwhile), then closes, so that a
    process without a watch still learns it from JAX."""

    def __init__(self, coordinator: str):
        host, _, port = coordinator.rpartition(":")
        self.coordinator = (host.strip("[]"), int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self.accept, daemon=True, name="sdp_jax-relay").start()

    def accept(self) -> None:
        """Pair each connection JAX opens with one to the coordinator (refused: closed, and
        JAX retries as it would)."""
        while True:
            try:
                mine, _ = self.server.accept()
            except OSError:
                return
            try:
                theirs = socket.create_connection(self.coordinator, timeout=10)
            except OSError:
                mine.close()
                continue
            pair = (mine, theirs)
            for conn in pair:
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for src, dst in (pair, pair[::-1]):
                threading.Thread(target=self.pump, args=(src, dst, theirs), daemon=True,
                                 name="sdp_jax-relay-pump").start()

    @staticmethod
    def pump(src, dst, theirs) -> None:
        """Copy ``src`` to ``dst`` until one side ends; when the coordinator's side
        (``theirs``) ended, wait before closing JAX's."""
        ended = src
        while data := _recv(src, 65536):
            try:
                dst.sendall(data)
            except OSError:
                ended = dst
                break
        if ended is theirs:
            time.sleep(GRACE + DRAIN + 3.0)
        for conn in (src, dst):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


def relay(coordinator: str) -> str:
    """The address (``127.0.0.1:PORT``) that a process other than 0 gives
    ``jax.distributed.initialize`` instead of ``coordinator`` (``HOST:PORT`` of process 0):
    a relay of this process's own (:class:`_Relay`), so that the coordinator's death is told by
    the watch alone."""
    return _Relay(coordinator).address


def _signal_name(status: int) -> str:
    """`` (SIGTERM)`` for status 143 and the like, else ``""``."""
    try:
        return f" ({signal.Signals(status - 128).name})" if status > 128 else ""
    except ValueError:
        return ""


_BAR: list = []   # [True] while this process shows a progress bar (:func:`bar_shown`)


def bar_shown(shown: bool) -> None:
    """This process shows a progress bar on stderr from now on (``shown``), or its bar has
    been closed (its last line ended): a line the watch writes starts on a new line meanwhile
    (``sdp_jax.train.loop`` calls it around its bar)."""
    _BAR[:] = [True] if shown else []


def _after_bar() -> str:
    """``"\n"`` while a progress bar (:func:`bar_shown`) may hold the current line, else
    ``""``."""
    return "\n" if _BAR else ""


def _write_and_exit(line: str, code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):
            pass
    try:
        os.write(2, line.encode())
    finally:
        os._exit(code)


def _listen(client, host: str, n: int, timeout: float) -> dict:
    """(process 0) Accept a connection from each other process (each first sends its id)."""
    try:
        server = socket.create_server((host, 0))
    except OSError:   # the coordinator's name is not an address of this host
        server = socket.create_server(("", 0))
    client.key_value_set(KEY, f"{host}:{server.getsockname()[1]}")
    conns, deadline = {}, time.monotonic() + timeout
    with server:
        while len(conns) < n - 1 and time.monotonic() < deadline:
            server.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = server.accept()
                conn.settimeout(timeout)
                conns[_read_id(conn)] = conn
            except (OSError, ValueError):
                continue
    return conns


def _read_id(conn) -> int:
    """The first line a process sends: its id (read byte by byte: its next message may follow
    at once)."""
    line = b""
    while not line.endswith(b"\n") and len(line) < 16:
        byte = conn.recv(1)
        if not byte:
            break
        line += byte
    return int(line.decode().strip())


def _connect(client, me: int, timeout: float) -> dict:
    """(another process) Connect to process 0's port and send this process's id."""
    address = client.blocking_key_value_get(KEY, int(timeout * 1000))
    host, _, port = address.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=timeout)
    conn.sendall(f"{me}\n".encode())
    return {0: conn}


def check_hang(timeout, multiple) -> None:
    """Check ``--hang_timeout`` (seconds, 0: never take a process as hung, else at least 5)
    and ``--hang_step_multiple`` (at least 2).

    Raises:
      ValueError: one line naming the bad value and the range it must be in."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or (
            timeout != 0 and not timeout >= 5):
        raise ValueError(f"--hang_timeout={timeout!r} must be 0 (never take a silent process "
                         "as hung) or at least 5 seconds")
    if isinstance(multiple, bool) or not isinstance(multiple, (int, float)) or not multiple >= 2:
        raise ValueError(f"--hang_step_multiple={multiple!r} must be at least 2 (a process is "
                         "taken as hung after that many times its slowest recent step)")


def start(client, process_id: int, num_processes: int, host: str, timeout: float = 60.0,
          hang_timeout: float = 300.0, hang_step_multiple: float = 10.0) -> str:
    """Start watching the other processes (call it in every process, right after
    ``jax.distributed.initialize``; ``client``: JAX's distributed client, ``host``: the
    coordinator's host, process 0's; ``timeout``: seconds to wait for the others to join;
    ``hang_timeout``, ``hang_step_multiple``: the bounds this process declares, see the module
    docstring and :func:`check_hang`).

    Returns:
      ``""``, or one line saying why the watch could not start (the run goes on; a process
      that dies is then noticed only by JAX's heartbeat)."""
    if num_processes < 2 or _WATCH:
        return ""
    check_hang(hang_timeout, hang_step_multiple)
    try:
        conns = (_listen(client, host, num_processes, timeout) if process_id == 0
                 else _connect(client, process_id, timeout))
    except Exception as e:  # noqa: BLE001 (socket errors, JAX's key-value store timing out)
        return (f"warning: process {process_id} could not join the other processes' watch "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); a process "
                "that dies is noticed only by JAX's own heartbeat, after --hang_timeout + 60 s")
    watch = _Watch(process_id, num_processes, conns, (hang_timeout, hang_step_multiple))
    _WATCH.append(watch)
    for pid, conn in conns.items():
        conn.settimeout(None)
        threading.Thread(target=watch.read, args=(pid, conn), daemon=True,
                         name=f"sdp_jax-peer-{pid}").start()
    threading.Thread(target=watch.beat, daemon=True, name="sdp_jax-heartbeat").start()
    missing = sorted(set(range(num_processes)) - set(conns) - {process_id})
    if process_id == 0 and missing:
        return (f"warning: processes {missing} did not join the watch within {timeout:.0f}s; "
                "if one of them dies, the others notice only by JAX's own heartbeat, after "
                "--hang_timeout + 60 s")
    return ""


@contextlib.contextmanager
def busy(phase: str):
    """While in this context (also a decorator) this process does work of no known length
    (``phase``, one word: restoring, compiling, evaluating, saving): the others take it as hung
    only after ``--hang_timeout`` seconds of silence. On leaving it, the clock of the next
    step (:func:`stepped`) starts. Nothing without a watch."""
    if _WATCH:
        _WATCH[0].mark = time.monotonic()   # (a phase begun is progress)
        _WATCH[0].declare(_WATCH[0].hang[0], phase)
    try:
        yield
    finally:
        if _WATCH:
            _WATCH[0].mark = time.monotonic()


def stepped() -> None:
    """A training step ended (its time: since the last step or :func:`busy` work ended): the
    others take this process as hung after ``--hang_step_multiple`` times its slowest of the
    last :data:`HANG_STEPS` steps of silence, at least :data:`HANG_FLOOR` s (or
    ``--hang_timeout`` when smaller; 0: never). The first step (the collectives' connections,
    the program's first run) counts as starting: ``--hang_timeout``. Nothing without a
    watch."""
    if not _WATCH:
        return
    watch, now = _WATCH[0], time.monotonic()
    timeout, multiple = watch.hang
    if watch.first_step:
        watch.first_step, watch.mark = False, now
        watch.declare(timeout, "training")
        return
    watch.steps, watch.mark = [*watch.steps[1 - HANG_STEPS:], now - watch.mark], now
    bound = max(min(HANG_FLOOR, timeout), multiple * max(watch.steps)) if timeout else 0.0
    watch.declare(round(bound, 1), "training")


def leaving(status: int) -> None:
    """This process ends now, before the run is over, with ``status``: tell the others
    (process 0 then waits up to :data:`DRAIN` seconds for them to end, so that they get this
    project's one line rather than JAX's abort). Safe in a signal handler; nothing without a
    watch or once the run is done."""
    if not _WATCH or _WATCH[0].finished or _WATCH[0].ending:
        return
    watch = _WATCH[0]
    watch.ending = True
    watch.send(f"x {int(status)} {watch.me}\n")
    if watch.me == 0:
        watch.drain(0)


def exit_now(status) -> None:
    """End the process with ``status`` (a ``SystemExit`` code) after :func:`leaving`, skipping
    the interpreter's teardown (JAX's would wait at a shutdown barrier for processes that are
    stopping); returns only without a watch or once the run is done."""
    if not _WATCH or _WATCH[0].finished:
        return
    code = status if isinstance(status, int) else (0 if status is None else 1)
    leaving(code)
    _write_and_exit("", code)


def watching() -> bool:
    """Whether this process watches others (several processes, the run not finished)."""
    return bool(_WATCH) and not _WATCH[0].finished


def follow_lost_peer(wait: float = GRACE + 1.0) -> None:
    """An error of this process's run (e.g. a collective that failed: ``Gloo all-reduce
    failed ... Connection reset by peer``) that another process's end caused: when news of such
    an end arrives within ``wait`` seconds, the watch ends this process with its one line and
    status (:data:`DEAD_PEER` for a peer killed) while this waits; else (an error of this
    process's own, or a watch that did not act because this process was already ending) it
    returns, and the caller prints the error."""
    if not _WATCH or _WATCH[0].finished:
        return
    watch, deadline = _WATCH[0], time.monotonic() + wait
    while watch.news is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if watch.news is None:
        return
    time.sleep(GRACE + DRAIN + 5.0)   # the watch's own thread exits the process meanwhile


def done() -> None:
    """Every process finished the run (each calls this after the loop's last collective):
    from now on another process's end is expected."""
    if _WATCH and not _WATCH[0].finished:
        _WATCH[0].finished = True
        _WATCH[0].send("d\n")


def reset() -> None:
    """Forget the watch (tests)."""
    _WATCH.clear()
