"""Every process of a multi-process run learns within seconds when another one ends before the
run does, and ends too with one line (``train.py`` starts this through
:func:`sdp_jax.train.launch.initialize`).

JAX's own health check is slow and loud: a process that dies before the others is noticed by
the coordination service's heartbeat after 100 s, and the survivors then abort with a C++
check failure, a stack dump and SIGABRT; when process 0 (which hosts the coordination service)
ends, the others abort at once, the same way. So:

* process 0 listens on a TCP port of its own host (the coordinator's; the port is published in
  JAX's key-value store) and every other process connects to it. The kernel closes a process's
  connections however it ends (an exit, SIGKILL, a crash), so process 0 learns at once;
* a process that ends on purpose before the run is over (a signal before the loop agreed on a
  step, :func:`sdp_jax.train.cli.exit_on_signal`; an error) first sends its exit status
  (:func:`leaving`); one that finished the run says so (:func:`done`): its end is expected;
* process 0 waits :data:`GRACE` seconds (a process hit by the same error as its peer reports its
  own), tells every other process to stop, waits up to :data:`DRAIN` seconds for them to end
  (so that none of them sees the coordination service vanish) and ends last. Each survivor
  prints one line and exits with the status the ended process sent (143 after SIGTERM, 2 after a
  usage error), or :data:`DEAD_PEER` when it ended without a word (killed, crashed).

A survivor therefore ends within ``GRACE + DRAIN`` (7 s) of the other process's end; one whose
collective failed first (the peer died during a step) waits for that news rather than printing
the failure's traceback (:func:`follow_lost_peer`, ``train.py``). Not
covered: process 0 itself dying without a word (the others then get JAX's abort at once), and a
process that hangs without ending (JAX's heartbeat ends everyone after 100 s).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

DEAD_PEER = 75    # sysexits' EX_TEMPFAIL: another process died; rerun to resume
GRACE = 2.0       # seconds process 0 waits before acting on another process's end
DRAIN = 5.0       # seconds process 0 waits for the others to end before it ends
KEY = "sdp_jax/peers/address"


class _Watch:
    """This process's side: its connections (process 0: one per other process, by id; others:
    ``{0: the connection to process 0}``) and whether it is ending or done."""

    def __init__(self, me: int, n: int):
        self.me, self.n, self.conns = me, n, {}
        self.ending = self.finished = False
        self.done_peers: set = set()
        self.gone: set = set()
        self.lock, self.news = threading.Lock(), None

    def send(self, message: str, to=None) -> None:
        for pid, conn in list(self.conns.items()):
            if to is None or pid in to:
                try:
                    conn.sendall(message.encode())
                except OSError:
                    pass

    def read(self, pid: int, conn) -> None:
        """A connection's reader thread: ``d`` (that process finished the run), ``x STATUS
        ORIGIN`` (ORIGIN ended with STATUS; -1: without a word), end of file."""
        buf = b""
        while True:
            try:
                chunk = conn.recv(256)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                words = line.decode().split()
                if words == ["d"]:
                    self.done_peers.add(pid)
                elif len(words) == 3 and words[0] == "x":
                    self.ended(int(words[1]), int(words[2]))
        self.gone.add(pid)
        if pid not in self.done_peers:
            self.ended(-1, pid)

    def ended(self, status: int, origin: int) -> None:
        """Process ``origin`` ended before the run did (``status``, -1 when unknown): the first
        such news is acted on (:meth:`act`, in its own thread: the readers go on reading)."""
        with self.lock:
            if self.news is not None:
                return
            self.news = (status, origin)
        threading.Thread(target=self.act, args=self.news, daemon=True).start()

    def act(self, status: int, origin: int) -> None:
        """Unless this process is ending or done: (process 0, after :data:`GRACE` seconds)
        tell the others and wait for them to end; then one line and ``status`` (or
        :data:`DEAD_PEER`). After another process's error (``0 < status < 128``) every process
        waits :data:`GRACE` seconds first, so that one hitting the same error (a config refused
        on every process) reports its own."""
        if self.me == 0 or 0 < status < 128:   # an error: this process may report its own
            deadline = time.monotonic() + GRACE
            while time.monotonic() < deadline and not (self.ending or self.finished):
                time.sleep(0.05)
        if self.ending or self.finished:
            return
        if self.me == 0:
            self.send(f"x {status} {origin}\n", to=set(self.conns) - {origin})
            self.drain()
        code = status if status > 0 else DEAD_PEER
        how = (f"ended with status {status}{_signal_name(status)}" if status >= 0
               else "died without a word (killed or crashed)")
        _write_and_exit(f"stopping: process {origin} of {self.n} {how} before the run "
                        f"finished; this is process {self.me}, exiting with status {code} (see "
                        f"process {origin}'s output; checkpoints already written are kept: "
                        "rerun to resume)\n", code)

    def drain(self) -> None:
        """(process 0) Wait up to :data:`DRAIN` seconds for the others to end."""
        deadline = time.monotonic() + DRAIN
        while time.monotonic() < deadline and len(self.gone) < len(self.conns):
            time.sleep(0.05)


_WATCH: list = []   # the process's watch, once started


def _signal_name(status: int) -> str:
    """`` (SIGTERM)`` for status 143 and the like, else ``""``."""
    try:
        return f" ({signal.Signals(status - 128).name})" if status > 128 else ""
    except ValueError:
        return ""


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


def start(client, process_id: int, num_processes: int, host: str,
          timeout: float = 60.0) -> str:
    """Start watching the other processes (call it in every process, right after
    ``jax.distributed.initialize``; ``client``: JAX's distributed client, ``host``: the
    coordinator's host, process 0's).

    Returns:
      ``""``, or one line saying why the watch could not start (the run goes on; a process
      that dies is then noticed only by JAX's heartbeat)."""
    if num_processes < 2 or _WATCH:
        return ""
    try:
        conns = (_listen(client, host, num_processes, timeout) if process_id == 0
                 else _connect(client, process_id, timeout))
    except Exception as e:  # noqa: BLE001 (socket errors, JAX's key-value store timing out)
        return (f"warning: process {process_id} could not join the other processes' watch "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); a process "
                "that dies is noticed only by JAX's heartbeat (100 s)")
    watch = _Watch(process_id, num_processes)
    watch.conns = conns
    _WATCH.append(watch)
    for pid, conn in conns.items():
        conn.settimeout(None)
        threading.Thread(target=watch.read, args=(pid, conn), daemon=True,
                         name=f"sdp_jax-peer-{pid}").start()
    missing = sorted(set(range(num_processes)) - set(conns) - {process_id})
    if process_id == 0 and missing:
        return (f"warning: processes {missing} did not join the watch within {timeout:.0f}s; "
                "if one of them dies, the others notice only by JAX's heartbeat (100 s)")
    return ""


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
        watch.drain()


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
