"""The one training loop of every run, for every model family, for pipelines and for a user's
own model.

:func:`train` validates the config (:func:`sdp_jax.train.run.resolve`), builds the data, the mesh
and the step through the run's model family, a :class:`sdp_jax.train.task.Family` (a built-in
one, :func:`sdp_jax.train.families.family_of`, or a user's :class:`sdp_jax.train.task.Task`
given as ``task``: the spec, the data, the :class:`sdp_jax.step.SDPStep`, the evaluation and
the family's log and summary fields), and then, written once for every family:

* refuses, before any compute, a ``workdir`` whose latest checkpoint another config wrote,
  and, before the workdir exists, a fresh run's faulty starting files (``init_from``:
  :meth:`sdp_jax.train.task.Family.check_start`);
* restores the latest checkpoint (the train state; the data position is the step) or
  initializes (``steps=0``: saves that state as the checkpoint of step 0 and stops);
* refuses a compiled step that cannot fit the memory before the first step
  (:func:`sdp_jax.train.fit.check_peak`), and an allocation that fails anyway in one line;
  a workdir that this invocation created and left with nothing to read is removed
  (:func:`remove_unwritten`);
* writes the run's config to ``config.json`` (once its step is compiled);
* trains with a tqdm progress bar, appending one JSON record per logged step to
  ``metrics.jsonl`` and TensorBoard event files (:class:`Metrics`; truncated to the restored
  step on resume);
* saves orbax checkpoints every ``checkpoint_every`` steps, at ``stop_at_step``, at the end and
  when SIGINT / SIGTERM arrives (a second signal aborts without saving);
* never checkpoints a non-finite state (:func:`check_finite`);
* traces steps ``profile_start`` .. ``profile_stop`` with JAX's profiler into
  ``workdir/profile/`` (:class:`sdp_jax.train.profiling.StepWindow`);
* writes ``summary.json`` and the run's ``curves.png`` (:mod:`sdp_jax.train.curves`); a finished run
  rerun only re-reads its summary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from sdp_jax.costs import program as costs
from sdp_jax.costs.program import fmt_bytes, memory_stats
from sdp_jax.step import sdp_step as step_lib
from sdp_jax.train import checkpoint as ckpt_lib
from sdp_jax.train import cli, curves, elastic, fit, migrations, profiling
from sdp_jax.train import optimizer as optim_lib
from sdp_jax.train import run as run_lib
from sdp_jax.train.data import tokens as data_lib
from sdp_jax.train.launch import peers
from sdp_jax.train.run import make_mesh  # (the run's mesh; also loop.make_mesh)
from sdp_jax.train.task import Family

FINITE_KEYS = ("train_loss", "grad_norm", "val_loss", "test_loss")


# ---------------------------------------------------------------------------- output

def log(msg: str) -> None:
    """Print on process 0 only."""
    if jax.process_index() == 0:
        print(msg, flush=True)


def write_config(workdir: str, config) -> None:
    """The run's resolved config as ``workdir/config.json`` (process 0), for people and the
    tools; written once the run's step is compiled and fits, so that a run refused before
    leaves an earlier run's file as it was."""
    if jax.process_index() == 0:
        write_atomically(os.path.join(workdir, "config.json"), config.to_json(indent=2))


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: a reader (or a
    run killed meanwhile) sees the old file or the new one, never a truncated one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Metrics:
    """Process 0's metric writers: ``metrics.jsonl`` (one JSON record per logged step) and
    TensorBoard event files in the same directory (``tensorboardX``; tags are the record's
    keys, the config is the text ``config``). On resume both drop what lies after the
    restored step: the JSONL is truncated, and the event files' later steps are purged.

    Args:
      workdir: the run's directory.
      resume_step: the restored step (0 for a fresh run).
      config_text: the run's config (JSON) for TensorBoard's text tab, or None.
      once: scalars written to TensorBoard at ``resume_step`` ({tag: value}).
    """

    def __init__(self, workdir: str, resume_step: int, config_text: str | None = None,
                 once: dict | None = None):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.on = jax.process_index() == 0
        self.tb = None
        if not self.on:
            return
        kept = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if rec.get("step", 0) <= resume_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
        write_atomically(self.path, "".join(kept))
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
        # purge_step: events of a step after the restored one (a killed invocation's, or a
        # run started afresh in the same folder) are dropped by TensorBoard's readers
        # (the file name adds the restored step and the pid to tensorboardX's seconds and
        # host: two invocations within a second would otherwise write one file)
        self.tb = SummaryWriter(workdir, purge_step=resume_step + 1, flush_secs=30,
                                filename_suffix=f".step{resume_step}.pid{os.getpid()}")
        if config_text is not None:   # indented: TensorBoard renders text as markdown
            self.tb.add_text("config", "    " + config_text.replace("\n", "\n    "),
                             resume_step)
        for tag, value in (once or {}).items():
            self.scalar(tag, float(value), resume_step)

    def scalar(self, tag: str, value: float, step: int) -> None:
        """One TensorBoard scalar (process 0)."""
        if self.tb is not None and math.isfinite(value):
            self.tb.add_scalar(tag, value, step)

    def write(self, rec: dict):
        """Append ``rec`` (with ``step``) to the JSONL and its numbers to TensorBoard."""
        if self.on:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.scalar(k, float(v), rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class StopOnSignal:
    """While active, SIGINT (Ctrl-C) and SIGTERM (preemption) ask the loop to stop after the
    current step; the loop then saves a checkpoint and returns. A second signal aborts at once.
    Only installed in the main thread."""

    def __init__(self, flag: list):
        self.flag, self.old = flag, {}

    def _handler(self, signum, frame):
        if self.flag:
            cli.exit_on_signal(signum, "a second signal: aborted without saving the current "
                               "step (the last checkpoint is kept)", after_bar=True)
        self.flag.append(signal.Signals(signum).name)
        if jax.process_index() == 0:   # os.write: a print here could land inside another
            os.write(1, f"\n{signal.Signals(signum).name}: stopping after this step and saving "
                        "a checkpoint (send again to abort without saving)\n".encode())

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = cli.handle_signals(self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)
        return False


def agreed_stop(received: list) -> list:
    """The stop signal every process agrees on: ``[name]`` when any process has received a
    signal (``received``, filled by :class:`StopOnSignal`), else ``[]``; the same answer on
    every process.

    With several processes each one reports the signal it has received so far in one small
    all-gather per step, and all adopt the first reported name, so they stop after the same
    step, save the same checkpoint and exit with the same status (docs/design.md invariant 9).
    With one process there is no collective."""
    mine = list(received[:1])   # a snapshot: a signal arriving now is agreed on next step
    if jax.process_count() == 1:
        return mine
    code = int(getattr(signal, mine[0])) if mine else 0
    got = np.asarray(multihost_utils.process_allgather(np.int32(code))).reshape(-1)
    sent = [int(g) for g in got if g]
    if sent and not mine:
        log(f"\n{signal.Signals(sent[0]).name} reached another process: every process stops "
            "after this step and saves a checkpoint")
    return [signal.Signals(sent[0]).name] if sent else []


def progress(total: int, initial: int):
    """A tqdm progress bar over optimizer steps (process 0); the peer watch is told, so that
    a line it writes meanwhile starts on a line of its own (:func:`close_progress` ends it)."""
    from tqdm.auto import tqdm
    bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
               disable=jax.process_index() != 0, mininterval=1.0)
    peers.bar_shown(not bar.disable)
    return bar


def close_progress(bar) -> None:
    """Close :func:`progress`'s ``bar`` (its last line ended), and tell the peer watch."""
    bar.close()
    peers.bar_shown(False)


def _kept(manager) -> str:
    """What a run stopped for a non-finite value leaves behind."""
    last = manager.latest_step()
    return (f"the last checkpoint (step {last}) is kept" if last is not None
            else "no checkpoint was written")


def check_finite(rec: dict, step: int, manager) -> None:
    """Stop before a non-finite state is checkpointed.

    Raises:
      FloatingPointError: naming the value, the step and the last checkpoint (which is kept).
    """
    bad = {k: v for k, v in rec.items() if k in FINITE_KEYS and not math.isfinite(v)}
    if bad:
        kept = _kept(manager)
        what = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise FloatingPointError(
            f"non-finite {what} at step {step}: stopped without saving this state; {kept}. "
            "Lower --config.optim.lr (or keep --config.optim.grad_clip > 0) and start in a new "
            "--workdir: a changed optimizer is another trajectory.")


@jax.jit
def _all_finite(state) -> jax.Array:
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(state)
             if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def check_state_finite(state, step: int, manager) -> None:
    """Refuse to checkpoint a state with a non-finite parameter or optimizer value (an update
    can overflow after a finite loss and gradient norm, e.g. a huge SGD learning rate).

    Raises:
      FloatingPointError: naming the step and the last checkpoint (which is kept)."""
    if bool(_all_finite(state)):
        return
    kept = _kept(manager)
    raise FloatingPointError(
        f"non-finite parameters or optimizer state after step {step} (the update overflowed): "
        f"stopped without saving this state; {kept}. Lower --config.optim.lr (or keep "
        "--config.optim.grad_clip > 0) and start in a new --workdir.")


def previous_wall(summary_path: str, start: int, manager=None) -> float:
    """Wall seconds of the invocations before a resumed one (0 for a fresh run): the
    ``wall_s`` its checkpoint at ``start`` recorded (so a run killed without writing a
    summary still counts), else the summary's of a run that ended at ``start``."""
    if manager is not None and start:
        wall = manager.read_meta(start).get("wall_s")
        if wall is not None:
            return float(wall)
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            prev = json.load(f)
        if prev.get("steps") == start:
            return float(prev.get("wall_s", 0.0))
    return 0.0


def log_stopped(step: int, total: int, interrupted: list, trained: bool = True,
                stop_at: int = 0) -> None:
    """The last line of a run that stopped before its end at ``step`` (it resumes from its
    checkpoint of that step). ``trained``: whether this invocation trained up to ``step`` and
    saved it; when not, ``stop_at`` (``--config.stop_at_step``) was not after the step of the
    checkpoint it resumed, and the line says that nothing was trained or saved."""
    how = ("rerun the same command" if interrupted else
           "rerun without --config.stop_at_step (or with a later step)")
    if not trained:
        log(f"stopped at step {step} of {total} without training: --config.stop_at_step="
            f"{stop_at} is not after the checkpoint's step {step}, so no step ran and no "
            f"checkpoint was written (step {step}'s is the latest); {how} to go on.")
        return
    why = f"interrupted by {interrupted[0]}" if interrupted else "stopped"
    log(f"{why} at step {step} of {total} (checkpoint saved); {how} to resume.")


# ---------------------------------------------------------------------------- the run

def check_workdir_is_dir(workdir: str) -> None:
    """Raise ValueError if ``workdir`` (or its ``checkpoints``, ``summary.json``,
    ``metrics.jsonl``) exists with the wrong kind (a file for a directory or the reverse)."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir {workdir!r} exists and is not a directory; choose another.")
    if os.path.exists(os.path.join(workdir, "model.safetensors")):
        raise ValueError(f"--workdir {workdir!r} holds an export (model.safetensors); train in "
                         "another folder.")
    for name, want_dir in (("checkpoints", True), ("summary.json", False),
                           ("metrics.jsonl", False)):
        path = os.path.join(workdir, name)
        if os.path.exists(path) and os.path.isdir(path) != want_dir:
            raise ValueError(f"{path!r} exists and is not a "
                             + ("directory" if want_dir else "file")
                             + " as a run writes it; use another --workdir.")


def open_checkpoints(config, workdir: str, meta: dict, compat: dict | None = None,
                     run: run_lib.RunSpec | None = None, lock: WorkdirLock | None = None):
    """Create ``workdir`` and its checkpoint manager; refuse (before compute) a latest
    checkpoint written under another config or other masks (``compat``: the keyword
    arguments of :func:`sdp_jax.train.migrations.compatibility`). Logs an extension
    (``steps`` grown under ``wsd``; ``run``: the resolved run, for its lengths; ``lock``:
    taken once the workdir exists).

    Returns:
      ``(manager, latest step or None, the config changes an elastic resume accepts: []
      without one)``.
    Raises:
      ValueError: an uncreatable workdir, or an incompatible checkpoint (lists the fields)."""
    try:  # only now: a run refused earlier leaves no empty workdir behind
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create --workdir {workdir!r}: {e}; choose another.") from e
    if lock is not None:
        lock.acquire()
    manager = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                         keep=config.keep_checkpoints)
    latest, changes = manager.latest_step(), []
    if latest is not None:
        try:
            changes = manager.check_compatible(latest, meta, **(compat or {}))
            before = (manager.read_meta(latest).get("config", {}).get("steps")
                      if run is not None else None)
        except ValueError:
            manager.close()
            raise
        if before is not None and before < config.steps:
            old, new = (run_lib.total_steps(config, run.plan.coverage, n)
                        for n in (before, config.steps))
            log(f"extending the run from {old} to {new} optimizer steps (wsd schedule: the "
                f"stable rate until the last {config.optim.cooldown_fraction:g} of them)"
                + (f"; the checkpoint at step {latest} is past the cool-down start of the "
                   f"{old}-step schedule, so the rate steps back up to the stable one"
                   if latest > optim_lib.cooldown_start(run.optim, old) else ""))
    return manager, latest, changes


def restore_or_init(manager, latest, builder, seed: int, announce: bool = True,
                    initial: Callable[[], dict] | None = None):
    """The latest checkpoint's state, or a fresh one (``initial()``, default
    ``builder.init_state(seed)``).

    A checkpoint in an earlier layout of the same run (:func:`sdp_jax.train.migrations.layouts`: pairs of functions
    ``(current abstract state -> that layout's, restored state -> current)``) is read in that
    layout and converted.

    Returns:
      ``(state, start step)``. Raises ValueError for an unreadable checkpoint (before compute)."""
    if latest is None:
        return (builder.init_state(seed) if initial is None else initial()), 0
    try:
        abstract = builder.abstract_state()
        try:
            state = manager.restore(latest, abstract)
        except ValueError:
            for to_old, from_old in migrations.layouts(builder):
                try:
                    state = from_old(manager.restore(latest, to_old(abstract)))
                    break
                except ValueError:
                    continue
            else:
                raise
    except ValueError:
        manager.close()
        raise
    start = int(state["step"])
    if announce:
        log(f"resumed from {manager.directory} at step {start}")
    return state, start



def process_rows(mesh, run: run_lib.RunSpec) -> tuple[int, int]:
    """``(first, count)``: the rows of every global batch this process loads
    (:func:`sdp_jax.train.data.sharding_rows` of the batch's sharding on ``mesh``)."""
    return data_lib.sharding_rows(step_lib.batch_sharding(mesh), run.global_batch)


def batch_putter(builder):
    """``put(host rows, global ShapeDtypeStruct) -> global array`` of this process's rows of
    a batch, sharded as ``builder``'s batches are (every process calls it alike)."""
    sharding = builder.batch_sharding()

    def put(x, shape):
        return jax.make_array_from_process_local_data(sharding, x, shape.shape)
    return put


def make_step(run: run_lib.RunSpec, mesh):
    """The :class:`sdp_jax.step.SDPStep` of a resolved run (``run`` from
    :func:`sdp_jax.train.run.resolve`, ``mesh`` from :func:`make_mesh`)."""
    return run.family.step(run, mesh)


def _meta(config, run: run_lib.RunSpec) -> dict:
    """What a checkpoint records to refuse another run: the trajectory config, the masks and
    the resolved worker count (``config.workers=0`` is every device, which can change)."""
    return {"config": run_lib.trajectory_config(config),
            "masks": run.family.record(run.plan), "workers": run.workers}


def _compatibility(run: run_lib.RunSpec) -> dict:
    """:func:`sdp_jax.train.migrations.compatibility` with the fields an elastic resume may
    change (accepted with ``config.elastic``, named in the refusal otherwise)."""
    return {**migrations.compatibility(run), "elastic": elastic.FIELDS,
            "allow_elastic": bool(run.config.get("elastic", False)),
            "elastic_hint": elastic.HINT}


def check_workdir(config, workdir: str, run: run_lib.RunSpec | None = None) -> None:
    """Refuse, before any compute, a ``workdir`` whose latest checkpoint another config wrote.

    Raises:
      ValueError: listing the differing fields (see
        :meth:`sdp_jax.train.checkpoint.CheckpointManager.check_compatible`)."""
    path = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(path):
        return
    run = run or run_lib.resolve(config, jax.device_count())
    manager = ckpt_lib.CheckpointManager(path, keep=config.keep_checkpoints)
    try:
        latest = manager.latest_step()
        if latest is not None:
            manager.check_compatible(latest, _meta(config, run), **_compatibility(run))
    finally:
        manager.close()


class WorkdirLock:
    """One run per workdir: process 0 holds an exclusive ``flock`` on ``WORKDIR/.lock`` (with
    its host and pid in it) while it trains. The kernel releases it when the process ends,
    even by SIGKILL, so a lock is never stale. Filesystems without ``flock`` run unlocked."""

    def __init__(self, workdir: str):
        self.path, self.file = os.path.join(workdir, ".lock"), None

    def acquire(self) -> None:
        """Take the lock (process 0; ``workdir`` exists).

        Raises:
          ValueError: another process holds it (naming its host and pid)."""
        import fcntl  # pylint: disable=g-import-not-at-top
        import socket  # pylint: disable=g-import-not-at-top
        if jax.process_index() != 0 or self.file is not None:
            return
        f = open(self.path, "a+")  # noqa: SIM115 (held open while the run lasts)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise ValueError(f"--workdir {os.path.dirname(self.path)!r} is in use by another "
                             f"run ({holder}); wait for it to end, or use another --workdir.")
        except OSError:   # no flock on this filesystem: unlocked
            f.close()
            return
        f.truncate(0)
        f.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
        f.flush()
        self.file = f

    def release(self) -> None:
        if self.file is not None:
            self.file.close()   # closing the descriptor releases the flock
            self.file = None


def train(config, workdir: str, task: Family | None = None) -> dict[str, Any]:
    """Train (or resume) the run ``config`` (any model family; pipelined or not) in ``workdir``.

    Validates the config (:func:`sdp_jax.train.run.resolve`), the data and the checkpoint's
    compatibility before any compute, builds the mesh and the step (the family's
    :class:`sdp_jax.step.SDPStep`), restores or initializes, compiles, and runs the loop.

    ``task``: the model family, a :class:`sdp_jax.train.task.Family`; a user's model is a
    :class:`sdp_jax.train.task.Task` (``config`` then from its ``config()``); default: the
    built-in family of ``config.model.name`` (LLaMA or a vision model).

    Writes ``workdir/metrics.jsonl`` (one record per logged step: ``step``, ``train_loss``,
    ``grad_norm``, ``lr``, the family's metrics and rate: language models ``tokens_per_s`` and,
    on evaluation steps, ``val_loss`` nats/token and for byte-level data ``val_bpb``
    bits/byte; vision ``train_acc``, ``images_per_s``, ``test_loss`` nats and ``test_acc``;
    a :class:`~sdp_jax.train.task.Task` ``examples_per_s`` and, with validation batches,
    ``val_loss``;
    language models also ``model_flops_per_s_per_device`` and, where the device's peak is
    known, ``mfu``; with ``config.align_every``, every that many steps ``grad_alignment`` and
    ``update_alignment``, :meth:`sdp_jax.step.SDPStep.alignment_fn`), TensorBoard events
    beside it, ``workdir/config.json``,
    ``workdir/checkpoints/`` (orbax; each records the run's wall seconds so far),
    ``workdir/summary.json`` and, when the run is complete, ``workdir/curves.png``.

    Returns:
      the summary dict (``interrupted_by``: the signal's name when a signal stopped it before
      the end) and ``signal`` (not in the file): a signal that stopped the loop, also when it
      came during the last step, or None.

    Raises:
      ValueError: invalid config or data, a faulty ``config.init_from`` folder (before the
        workdir is created), a checkpoint in ``workdir`` from another config, or a compiled
        step that cannot fit the memory (all before any training step); an allocation that
        failed anyway (XLA's ``RESOURCE_EXHAUSTED``), in one line naming the settings that
        lower the memory. A workdir this call created is removed when it holds nothing to
        read after such an error (:func:`remove_unwritten`).
      ImportError: a dataset's optional dependency is missing.
      FloatingPointError: a non-finite loss or norm (that state is not saved).
    """
    lock = WorkdirLock(workdir)   # one run per workdir (:class:`WorkdirLock`)
    fresh = not os.path.exists(workdir)
    if fresh:   # a signal before the first step leaves no folder either (os._exit: no except)
        cli.at_signal_exit(lambda: _remove_if_ours(workdir, lock))
    try:
        try:
            return _train(config, workdir, lock, task)
        except jax.errors.JaxRuntimeError as e:   # an allocation that failed anyway
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise ValueError(fit.allocation_failure(e, config)) from e
    except BaseException:
        if fresh and lock.file is not None:   # (held: the folder is this invocation's)
            remove_unwritten(workdir)
        raise
    finally:
        cli.at_signal_exit(None)
        lock.release()


def _remove_if_ours(workdir: str, lock: WorkdirLock) -> None:
    """(a signal's exit) :func:`remove_unwritten` of a fresh ``workdir`` when ``lock`` is
    held, or can be taken now (the signal may come between the folder's creation and the
    lock's): never a folder that another run holds."""
    if lock.file is None:
        try:
            lock.acquire()
        except (ValueError, OSError):   # another run holds it, or there is no folder
            return
    if lock.file is not None:
        remove_unwritten(workdir)


def remove_unwritten(workdir: str) -> None:
    """Remove the ``workdir`` that a failed invocation created (process 0) when it holds
    nothing a user reads: no checkpoint, no summary, no metric record (so a run refused before
    its first step leaves no folder). Only what a run writes is removed (its ``.lock``,
    ``config.json``, an empty ``checkpoints/`` and ``metrics.jsonl``, TensorBoard files), and
    the folder itself when that empties it."""
    ckpts, metrics = os.path.join(workdir, "checkpoints"), os.path.join(workdir, "metrics.jsonl")
    if jax.process_index() != 0 or (os.path.isdir(ckpts) and os.listdir(ckpts)) \
            or os.path.exists(os.path.join(workdir, "summary.json")) \
            or (os.path.isfile(metrics) and os.path.getsize(metrics)):
        return
    for name in os.listdir(workdir):
        path = os.path.join(workdir, name)
        if name in (".lock", "config.json", "metrics.jsonl") \
                or name.startswith("events.out.tfevents."):
            os.remove(path)
        elif name == "checkpoints":
            os.rmdir(path)
    try:
        os.rmdir(workdir)
    except OSError:   # something else is in it: kept
        pass


def _train(config, workdir: str, lock: WorkdirLock, task: Family | None) -> dict[str, Any]:
    """:func:`train`, with ``lock`` taken once ``workdir`` exists."""
    t_start = time.time()
    import matplotlib  # noqa: F401  (the writers of the end: a broken install fails now)
    import tensorboardX  # noqa: F401
    check_workdir_is_dir(workdir)
    # what a fresh run starts from (init_from) is checked before any compile or folder
    fresh = ckpt_lib.latest_step_in(os.path.join(workdir, "checkpoints")) is None
    start_from = fit.check_start(config, jax.device_count(), task) if fresh else None
    # coverage=auto: the checkpoint's, or the largest whose compiled step fits the budget
    run = fit.resolve(config, jax.device_count(), task, workdir, log)
    mesh = make_mesh(run)
    # bad data fails here, before any compile
    stream, eval_data = run.family.data(run, process_rows(mesh, run), log)
    meta = _meta(config, run)
    manager, latest, changes = open_checkpoints(config, workdir, meta, _compatibility(run),
                                                run, lock)
    try:   # the run's checkpoint manager: closed by the loop, or here on any error
        saved = _saved_meta(manager, latest, run, stream, changes)
        # (what the run started from, kept by every checkpoint: export --format hf reads it)
        meta["init_from"] = start_from if saved is None else saved.get("init_from")
        path = os.path.join(workdir, "summary.json")
        if latest is not None and latest >= run.total_steps and os.path.exists(path):
            return _already_complete(run, manager, path)
        builder = make_step(run, mesh)
        _log_run(run, builder, mesh)
        # Restore before compiling: an unreadable checkpoint is reported before any compute.
        state, start = _start_state(run, builder, manager, latest, saved, changes)
        prev_wall = previous_wall(path, start, manager)  # a resumed run adds the earlier time
        wall = lambda: prev_wall + time.time() - t_start  # noqa: E731
        train_iter = _data_from(stream, saved, start, run, meta, changes)
        if run.total_steps == 0:   # nothing to train: the initial state is the run
            return _save_initial(run, builder, state, manager, latest, meta, eval_data,
                                 workdir, wall)
        prog = _Program.compile(run, builder, eval_data)
        write_config(workdir, run.config)   # (once the step fits: a refused run leaves none)
        return _train_compiled(run, prog, workdir, manager, meta, state, start, train_iter,
                               wall)
    except BaseException:
        manager.close()
        raise


def _train_compiled(run: run_lib.RunSpec, prog: "_Program", workdir: str, manager, meta: dict,
                    state, start: int, train_iter, wall: Callable[[], float]) -> dict[str, Any]:
    """:func:`train` once its program is compiled: the loop from step ``start + 1`` (within
    the profiler's window), the last evaluation, ``summary.json`` and the last line."""
    config, mesh = run.config, prog.builder.mesh
    devices, per_item = list(mesh.devices.flat), prog.flops_per_item
    # steps profile_start..profile_stop traced (stopped however the loop ends)
    with profiling.StepWindow(workdir, config.profile_start, config.profile_stop, start,
                              log) as window:
        state, step, last_eval, interrupted, last_rec = _loop(
            config, workdir, run.family, window.wrap(prog.one_step), prog.evaluate, prog.items,
            state=state, start=start, total=run.total_steps, manager=manager, meta=meta,
            train_iter=train_iter, wall=wall,
            flops_per_item=None if per_item is None else per_item / len(devices),
            peak=costs.peak_flops(devices[0].device_kind, config.peak_flops),
            once={"peak_bytes_per_device": prog.memory["peak_bytes_per_device"]})
    if jax.process_count() > 1:   # every process waits for the others' last writes
        multihost_utils.sync_global_devices("sdp_jax.train.loop.train: end")
    done = step >= run.total_steps
    if done and not last_eval:
        last_eval = prog.evaluate(state)
    peers.done()   # the last collective is behind: the other processes' ends are expected
    out = _summary(run, prog.builder, prog, step, last_eval, last_rec, wall())
    out["interrupted_by"] = interrupted[0] if interrupted and not done else None
    out["elastic"] = meta["elastic"]
    _finish(run, workdir, os.path.join(workdir, "summary.json"), out, interrupted,
            trained=step > start)
    # (not in summary.json) a signal that came during the last step: a caller that runs
    # several trainings in turn (python -m sdp_jax.study) stops after this one
    return {**out, "signal": interrupted[0] if interrupted else None}


def _already_complete(run: run_lib.RunSpec, manager, path: str) -> dict[str, Any]:
    """A finished run rerun: its summary (``path``) read back, nothing compiled."""
    manager.close()   # nothing to train: keep the run's own figures, compile nothing
    peers.done()   # every process takes this path: no collective follows
    with open(path) as f:
        stored = json.load(f)
    log(f"already complete: {stored['steps']} steps; {run.family.done_line(stored)} "
        f"(from {path})")
    return {**stored, "signal": None}


def _save_initial(run: run_lib.RunSpec, builder, state, manager, latest, meta: dict,
                  eval_data, workdir: str, wall: Callable[[], float]) -> dict[str, Any]:
    """``config.steps=0``: the initial state (``config.init_from``'s model laid out under the
    run's masks, or the initializer's) saved as the checkpoint of step 0 (once,
    :func:`_save`) and evaluated, with no train step compiled; ``config.json`` and
    ``summary.json`` written (:func:`_summary`, :func:`_finish`). How a Hugging Face LLaMA
    becomes a run that ``export --format hf`` writes back unchanged.

    Returns:
      :func:`train`'s summary (``steps`` 0, ``completed``)."""
    if latest is None:
        _save(manager, state, 0, {**meta, "wall_s": wall()})
    manager.close()   # waits for the save
    write_config(workdir, run.config)
    evaluate = run.family.evaluator(run, builder, eval_data, batch_putter(builder), log)
    last_eval = peers.busy("evaluating")(evaluate)(state)
    peers.done()   # the last collective is behind
    out = {**_summary(run, builder, None, 0, last_eval, {}, wall()), "interrupted_by": None,
           "elastic": meta["elastic"]}
    _finish(run, workdir, os.path.join(workdir, "summary.json"), out, [], trained=False)
    if meta["init_from"]:
        log(f"config.steps=0: the Hugging Face LLaMA in {meta['init_from']['folder']}, laid "
            f"out under the run's masks, is the checkpoint of step 0 in {manager.directory}; "
            f"python -m sdp_jax.tools.export --workdir {workdir} --format hf --out DIR writes "
            "it back")
    return {**out, "signal": None}


@peers.busy("restoring")   # (the others allow it --hang_timeout)
def _start_state(run: run_lib.RunSpec, builder, manager, latest, saved, changes: list):
    """``(state, start step)``: the latest checkpoint's, rebuilt and laid out under the new
    masks for an elastic switch (``changes``, :func:`sdp_jax.train.elastic.rebuild`), or
    :func:`restore_or_init`'s."""
    if changes:
        return elastic.rebuild(manager, latest, saved, run, builder, log), latest
    return restore_or_init(manager, latest, builder, run.config.seed,
                           initial=lambda: run.family.initial_state(run, builder, log))


def _saved_meta(manager, latest, run: run_lib.RunSpec, stream, changes: list) -> dict | None:
    """The latest checkpoint's ``meta`` (None without one), its config with the family's
    defaults for newer fields; an elastic switch (``changes``) is checked here, before any
    compute (:func:`sdp_jax.train.elastic.check`)."""
    if latest is None:
        return None
    saved = manager.read_meta(latest)
    saved["config"] = ckpt_lib.with_defaults(saved.get("config", {}),
                                             run.family.added_fields())
    if changes:
        elastic.check(run, saved, stream)
    return saved


def _data_from(stream, saved: dict | None, start: int, run: run_lib.RunSpec, meta: dict,
               changes: list):
    """The training iterator from step ``start + 1`` (the data position is the step, any
    process layout, within a stream that begins at :func:`sdp_jax.train.elastic.origin`);
    records the stream's origin and the elastic switches so far (``changes``: this resume's)
    in ``meta``."""
    origin = (data_lib.Origin() if saved is None
              else elastic.origin(saved, start, run, stream, bool(changes)))
    meta["data_origin"] = list(origin)
    history = [] if saved is None else list(saved.get("elastic", []))
    if changes:
        history.append({"step": start, "from": elastic.describe(
                            saved["config"], elastic.saved_workers(saved)),
                        "to": elastic.describe(run.config, run.workers)})
    meta["elastic"] = history
    return stream(start, origin) if isinstance(stream, data_lib.Stream) else stream(start)


def _log_run(run: run_lib.RunSpec, builder, mesh) -> None:
    """The run's opening lines: devices, masks and settings, the family's lines, the mask
    graph and the parameter counts."""
    devices, mask_info = list(mesh.devices.flat), run.plan.summary()
    log(f"devices: {len(devices)} x {devices[0].platform} ({jax.process_count()} "
        f"process(es)); {run.plan.describe()}"
        + run.options.describe(run.workers, run.config.batch_per_worker))
    if builder.describe_placement():
        log(builder.describe_placement())
    for extra in run.family.describe(run):
        log(extra)
    mult = ", ".join(f"{k} {v['multiplicity_min']}..{v['multiplicity_max']}"
                     for k, v in mask_info["kinds"].items())
    log(f"mask graph: spectral gap {mask_info['spectral_gap']:.4f}; multiplicity {mult}; "
        "params: total "
        f"{run.family.param_count(run):,}, stored per device "
        f"{builder.per_device_param_count():,}")


@dataclasses.dataclass
class _Program:
    """What a run compiles before its first step: the train step (and its memory and the
    family's figures read from it), the evaluation and, with ``align_every``, the gradient
    alignment; :meth:`one_step` runs one step of them."""

    run: run_lib.RunSpec
    builder: Any
    shapes: Any
    step_fns: dict          # {sync step: the compiled train step}
    memory: dict
    from_compiled: dict
    put: Any
    evaluate: Any
    align: Any
    items: int              # tokens / images / examples per step
    flops_per_item: Any     # the family's model FLOPs per item, or None

    @classmethod
    @peers.busy("compiling")   # (the others allow it --hang_timeout)
    def compile(cls, run: run_lib.RunSpec, builder, eval_data) -> "_Program":
        """Compile the run's programs, logging their compile times and the peak memory; a
        step that cannot fit is refused (:func:`sdp_jax.train.fit.check_peak`)."""
        family, t0 = run.family, time.time()
        shapes = family.batch_shapes(run)
        compiled = builder.compiled_train_step(shapes)
        mem = memory_stats(compiled)
        log(f"compiled train step in {time.time() - t0:.1f}s: peak "
            f"{fmt_bytes(mem['peak_bytes_per_device'])} per device")
        # a step that cannot fit is refused now, in one line, not by the allocator at step 1
        fit.check_peak(mem["peak_bytes_per_device"], run.config, [
            d for d in builder.mesh.devices.flat if d.process_index == jax.process_index()])
        lines, from_compiled = family.compiled(run, compiled)
        for line in lines:
            log(line)
        put = batch_putter(builder)
        evaluate = peers.busy("evaluating")(family.evaluator(run, builder, eval_data, put, log))
        align = None
        if run.config.align_every:   # compiled now, so that no step's time includes it
            t0 = time.time()
            sharded = jax.tree.map(lambda s: jax.ShapeDtypeStruct(
                s.shape, s.dtype, sharding=builder.batch_sharding()), shapes)
            align = builder.alignment_fn().lower(builder.abstract_state(), sharded).compile()
            log(f"compiled the gradient alignment (every {run.config.align_every} steps) in "
                f"{time.time() - t0:.1f}s")
        return cls(run, builder, shapes, {True: compiled}, mem, from_compiled, put, evaluate,
                   align, family.items_per_step(run), family.model_flops_per_item(run))

    def one_step(self, state, batch, step: int):
        """``(state, metrics)`` after optimizer step ``step`` on the host ``batch`` (with the
        gradient alignment measured first on its own parameters and batch every
        ``align_every`` steps)."""
        sync_now = self.builder.is_sync_step(step)   # periodic parameter averaging
        if sync_now not in self.step_fns:
            self.step_fns[sync_now] = self.builder.train_step_fn(sync_now)
        batch = jax.tree.map(self.put, batch, self.shapes)
        every = self.run.config.align_every
        # measured before the step (which donates the state and batch)
        cosines = self.align(state, batch) if self.align and step % every == 0 else {}
        state, m = self.step_fns[sync_now](state, batch)
        return state, {**m, **cosines}


def _summary(run: run_lib.RunSpec, builder, prog: _Program | None, step: int,
             last_eval: dict, last_rec: dict, wall: float) -> dict:
    """``summary.json``: the family's fields and the run's own (settings, steps, wall
    seconds, memory, parameter counts, masks, throughput unit and model FLOPs); ``prog``:
    the compiled program (None when nothing was compiled, ``steps=0``: no memory figures)."""
    family = run.family
    mask_info = run.plan.summary()
    mem = None if prog is None else prog.memory
    items = family.items_per_step(run) if prog is None else prog.items
    per_item = family.model_flops_per_item(run) if prog is None else prog.flops_per_item
    return {
        **family.summary(run, step, last_eval, last_rec),
        "variant": run.config.sdp.variant, "regime": run.plan.regime,
        "coverage": run.plan.coverage,
        "workers": run.workers, "scheme": run.config.sdp.scheme,
        **run.options.record(),   # average, sync_every, method, fsdp, remat, dtype, ...
        "steps": step, "total_steps": run.total_steps,
        "completed": step >= run.total_steps, "wall_s": wall,
        "peak_bytes_per_device": None if mem is None else mem["peak_bytes_per_device"],
        "memory": mem, "params_total": family.param_count(run),
        "params_per_device": builder.per_device_param_count(),
        "masks": mask_info, "spectral_gap": mask_info["spectral_gap"],
        "platform": list(builder.mesh.devices.flat)[0].platform,
        "devices": builder.mesh.devices.size,
        "item": family.rate_key.split("_per_s")[0],
        "items_per_step": items, "model_flops_per_step": (
            None if per_item is None else per_item * items),
        **({} if prog is None else prog.from_compiled)}


def _finish(run: run_lib.RunSpec, workdir: str, path: str, out: dict,
            interrupted: list, trained: bool) -> None:
    """Write ``summary.json`` (process 0), draw ``curves.png`` when the run is complete, and
    log the run's last line (``trained``: whether this invocation ran a step,
    :func:`log_stopped`)."""
    if jax.process_index() == 0:
        write_atomically(path, json.dumps(out, indent=2))
    if not out["completed"]:
        log_stopped(out["steps"], run.total_steps, interrupted, trained,
                    run.config.stop_at_step)
        return
    drawn = bool(out["steps"])   # (steps=0: no curve to draw)
    if jax.process_index() == 0 and drawn:
        try:
            curves.curves([workdir])
        except (ValueError, OSError, RuntimeError) as e:   # the run itself is complete
            log(f"warning: curves.png not drawn ({type(e).__name__}: {e})")
    log(f"done: {out['steps']} steps in {out['wall_s']:.0f}s; {run.family.done_line(out)}; "
        f"summary in {path}"
        + (f", curves in {os.path.join(workdir, 'curves.png')}" if drawn else ""))


def _loop(config, workdir: str, family, one_step, evaluate, items_per_step: int, *, state,
          start: int, total: int, manager, meta: dict, train_iter, wall, flops_per_item=None,
          peak=None, once=None):
    """The loop: steps ``start + 1 ..`` up to ``total`` (or ``config.stop_at_step``), with
    evaluation every ``config.eval_every`` steps and at the end, logging every
    ``config.log_every`` steps (and at every gradient-alignment measurement,
    ``config.align_every``), checkpoints every ``config.checkpoint_every`` steps (each
    recording ``wall()``, the run's wall seconds so far). ``flops_per_item``: model FLOPs per
    token (image) per device, giving ``model_flops_per_s_per_device`` and, with ``peak``
    (FLOP/s), ``mfu``; ``once``: scalars written to TensorBoard at ``start``.

    Returns:
      ``(state, last step, last evaluation, interrupted signal names, last record)``.
    Raises:
      FloatingPointError: a non-finite loss or norm (nothing saved for that state).
    """
    stop = total if config.stop_at_step <= 0 else min(total, config.stop_at_step)
    metrics_log = Metrics(workdir, start, config.to_json(indent=2), once)
    last_eval, last_rec = {}, {}
    bar = progress(total, start)
    t_window, n_window, step = time.time(), 0, start
    received: list = []      # this process's signals
    interrupted: list = []   # the signal every process agreed to stop on
    with StopOnSignal(received):
        try:
            while step < stop and not interrupted:
                state, m = one_step(state, next(train_iter), step + 1)
                # Waiting for each step keeps one step in flight (CPU collectives, docs/design.md).
                rec = last_rec = {k: float(v) for k, v in m.items()}
                step, n_window = step + 1, n_window + 1
                check_finite(rec, step, manager)
                # Every process stops at the same step (docs/design.md invariant 9).
                interrupted = agreed_stop(received)
                peers.stepped()   # the others' bound on its silence follows its step time
                is_eval = step == total or (config.eval_every > 0
                                            and step % config.eval_every == 0)
                if (step % config.log_every == 0 or is_eval or step == stop or interrupted
                        or "grad_alignment" in rec):
                    rec.update(_throughput(family.rate_key, items_per_step * n_window,
                                           time.time() - t_window, flops_per_item, peak))
                    t_window, n_window = time.time(), 0
                    if is_eval:
                        last_eval = evaluate(state)
                        rec.update(last_eval)
                        check_finite(rec, step, manager)
                    rec["step"] = step
                    metrics_log.write(rec)
                    bar.set_postfix(_postfix(family, last_eval, rec), refresh=False)
                if step < stop:
                    bar.update(1)
                else:   # shown once, by close()
                    bar.n = step
                every = config.checkpoint_every
                if (every and step % every == 0) or step == stop or interrupted:
                    _save(manager, state, step, {**meta, "wall_s": wall()})
        finally:
            close_progress(bar)
            metrics_log.close()
            manager.close()  # waits for the last save
    return state, step, last_eval, interrupted, last_rec


def _save(manager, state, step: int, meta: dict) -> None:
    """Save ``state`` as the checkpoint of ``step`` (never one that holds NaN:
    :func:`check_state_finite`), the other processes allowing it ``--hang_timeout``."""
    check_state_finite(state, step, manager)
    with peers.busy("saving"):
        manager.save(step, state, meta)


def _throughput(rate_key: str, items: int, seconds: float, flops_per_item, peak) -> dict:
    """The window's rate ``{rate_key: items / seconds}`` and, with ``flops_per_item`` (model
    FLOPs per item per device), ``model_flops_per_s_per_device`` and, with ``peak`` (FLOP/s),
    ``mfu``."""
    out = {rate_key: items / max(seconds, 1e-9)}
    if flops_per_item is not None:
        flops = out["model_flops_per_s_per_device"] = out[rate_key] * flops_per_item
        if peak:
            out["mfu"] = flops / peak
    return out


def _postfix(family, last_eval: dict, rec: dict) -> dict:
    """The progress bar's fields: the family's (the last evaluation's values stay) and MFU."""
    post = family.postfix({**last_eval, **rec})
    if "mfu" in rec:
        post["mfu"] = f"{rec['mfu']:.1%}"
    return post
