"""The one training loop of every run: checkpoints, progress, metrics, signals, finiteness checks
and the summary, written once for every model family.

A family (:mod:`sdp_jax.trainer` for language models and pipelines,
:mod:`sdp_jax.vision_trainer` for image classifiers) validates its config, builds its data and
its step, and hands :func:`run` a :class:`Run`: how to take one step from a host batch, how to
evaluate the full model, and what to add to the log and the summary. :func:`run` then

* refuses, before any compute, a ``workdir`` whose latest checkpoint another config wrote;
* restores the latest checkpoint (the train state and the grain iterator state) or initializes;
* trains with a tqdm progress bar, appending one JSON record per logged step to
  ``metrics.jsonl`` (truncated to the restored step on resume);
* saves orbax checkpoints every ``checkpoint_every`` steps, at ``stop_at_step``, at the end and
  when SIGINT / SIGTERM arrives (a second signal aborts without saving);
* never checkpoints a non-finite state (:func:`check_finite`);
* writes ``summary.json``; a finished run rerun only re-reads its summary.
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

from sdp_jax import checkpoint as ckpt_lib

# Fields that do not change the training trajectory: a checkpoint written under other values
# still resumes (remat: same results, may change).
RUN_CONTROL = ("eval_every", "eval_batches", "eval_limit", "eval_bn_batches", "log_every",
               "checkpoint_every", "keep_checkpoints", "stop_at_step", "num_cpu_devices",
               "remat")
FINITE_KEYS = ("train_loss", "grad_norm", "val_loss", "test_loss")


# ---------------------------------------------------------------------------- config checks

def positive_int(config, name: str) -> int:
    """``config[name]`` if it is a positive integer.

    Raises:
      ValueError: naming the field and its value."""
    v = config[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"config.{name}={v!r} must be a positive integer.")
    return v


def check_run_fields(config, positive, non_negative) -> None:
    """The run-control fields of a config: ``positive`` ones positive integers,
    ``non_negative`` ones integers >= 0, and ``data.worker_count`` an integer >= 0.

    Raises:
      ValueError: naming the first bad field and its value."""
    for name in positive:
        positive_int(config, name)
    for name in non_negative:
        v = config[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"config.{name}={v!r} must be an integer >= 0.")
    wc = config.data.worker_count
    if isinstance(wc, bool) or not isinstance(wc, int) or wc < 0:
        raise ValueError(f"config.data.worker_count={wc!r} must be an integer >= 0 "
                         "(0 = read data in the training process).")


def resolve_workers(config, device_count: int) -> int:
    """``W`` from ``config.workers`` (0 = every device).

    Raises:
      ValueError: not a positive integer, more than the devices, or not every device with
        several processes."""
    workers = config.workers or device_count
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"config.workers={config.workers!r} must be a positive integer or 0 "
                         "(= every device).")
    if workers > device_count:
        hint = (f", or simulate more CPU devices with --config.num_cpu_devices={workers}"
                if jax.devices()[0].platform == "cpu" else "")
        raise ValueError(f"config.workers={workers} but only {device_count} devices are "
                         f"available; lower --config.workers (0 = every device){hint}.")
    if jax.process_count() > 1 and workers != device_count:
        raise ValueError(f"with several processes every device is a worker: set "
                         f"--config.workers=0 (got {workers} of {device_count}).")
    return workers


def check_averaging(sdp) -> None:
    """Validate ``config.sdp.average`` and ``config.sdp.sync_every`` (every model family).

    Raises:
      ValueError: an unknown mode, a bad ``sync_every``, ``sync_every`` without parameter
        averaging, or parameter averaging with a backward-masking variant."""
    from sdp_jax import spec as spec_lib  # pylint: disable=g-import-not-at-top
    from sdp_jax import step as step_lib  # pylint: disable=g-import-not-at-top
    if sdp.average not in step_lib.AVERAGING:
        raise ValueError(f"config.sdp.average={sdp.average!r}; use gradients or parameters.")
    if isinstance(sdp.sync_every, bool) or not isinstance(sdp.sync_every, int) \
            or sdp.sync_every < 1:
        raise ValueError(f"config.sdp.sync_every={sdp.sync_every!r} must be a positive integer.")
    if sdp.average == "gradients" and sdp.sync_every != 1:
        raise ValueError(f"config.sdp.sync_every={sdp.sync_every} only applies with "
                         "--config.sdp.average=parameters (gradients are averaged every step); "
                         "set both or neither.")
    if sdp.average == "parameters" and sdp.variant in spec_lib.BACKWARD_VARIANTS:
        raise ValueError(f"config.sdp.average=parameters is not available for {sdp.variant} "
                         "(backward masking keeps every worker's full parameters identical); "
                         "use average=gradients or a forward variant (ddp, b-sdp, n-sdp).")


def check_step_fields(config, remat: tuple | None = None) -> None:
    """Validate the step's settings of a run config (every model family): ``sdp.average``,
    ``sdp.sync_every`` (:func:`check_averaging`), ``fsdp`` (absent = False), ``remat`` (one of
    ``remat``, default :data:`sdp_jax.step.REMAT`) and ``dtype``.

    Raises:
      ValueError: naming the bad value and the choices."""
    from sdp_jax import step as step_lib  # pylint: disable=g-import-not-at-top
    remat = tuple(remat or step_lib.REMAT)
    fsdp = config.get("fsdp", False)
    if not isinstance(fsdp, bool):
        raise ValueError(f"config.fsdp={fsdp!r} must be True or False.")
    if config.remat not in remat:
        raise ValueError(f"config.remat={config.remat!r}; use one of {', '.join(remat)} "
                         "(activation checkpointing of every block).")
    if config.dtype not in step_lib.DTYPES:
        raise ValueError(f"config.dtype={config.dtype!r}; use float32 or bfloat16.")
    if fsdp and config.sdp.average == "parameters":
        raise ValueError("config.sdp.average=parameters needs per-worker parameter copies, but "
                         "--config.fsdp=True stores one sharded copy; use average=gradients "
                         "or fsdp=False.")
    check_averaging(config.sdp)


def check_warmup(optim, total: int) -> None:
    """Raise ValueError if the warm-up is longer than the run."""
    if optim.warmup_steps > total:
        raise ValueError(f"optim.warmup_steps={optim.warmup_steps} is longer than the run "
                         f"({total} steps); lower --config.optim.warmup_steps.")


def canonical_dtype(config) -> None:
    """``bf16`` / ``fp32`` -> ``bfloat16`` / ``float32``, so that checkpoints record one name."""
    alias = {"bf16": "bfloat16", "fp32": "float32"}
    if config.dtype in alias:
        with config.unlocked():
            config.dtype = alias[config.dtype]


def trajectory_config(config) -> dict[str, Any]:
    """The parts of the config a checkpoint must agree with (plain JSON dict)."""
    d = json.loads(config.to_json())
    for k in RUN_CONTROL:
        d.pop(k, None)
    d.get("data", {}).pop("worker_count", None)
    return d


# ---------------------------------------------------------------------------- output

def log(msg: str) -> None:
    """Print on process 0 only."""
    if jax.process_index() == 0:
        print(msg, flush=True)


def fmt_bytes(n: float) -> str:
    """Bytes as ``12.3 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class Metrics:
    """Append-only JSONL writer (process 0), truncated to the restored step on resume."""

    def __init__(self, path: str, resume_step: int):
        self.path = path
        self.on = jax.process_index() == 0
        if not self.on:
            return
        kept = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if rec.get("step", 0) <= resume_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
        with open(path, "w") as f:
            f.writelines(kept)

    def write(self, rec: dict):
        if self.on:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")


class StopOnSignal:
    """While active, SIGINT (Ctrl-C) and SIGTERM (preemption) ask the loop to stop after the
    current step; the loop then saves a checkpoint and returns. A second signal aborts at once.
    Only installed in the main thread."""

    def __init__(self, flag: list):
        self.flag, self.old = flag, {}

    def _handler(self, signum, frame):
        if self.flag:
            raise KeyboardInterrupt
        self.flag.append(signal.Signals(signum).name)
        log(f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
            "(send again to abort without saving)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)
        return False


def progress(total: int, initial: int):
    """A tqdm progress bar over optimizer steps (process 0)."""
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                disable=jax.process_index() != 0, mininterval=1.0)


def check_finite(rec: dict, step: int, manager) -> None:
    """Stop before a non-finite state is checkpointed.

    Raises:
      FloatingPointError: naming the value, the step and the last checkpoint (which is kept).
    """
    bad = {k: v for k, v in rec.items() if k in FINITE_KEYS and not math.isfinite(v)}
    if bad:
        last = manager.latest_step()
        kept = (f"the last checkpoint (step {last}) is kept" if last is not None
                else "no checkpoint was written")
        what = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise FloatingPointError(
            f"non-finite {what} at step {step}: stopped without saving this state; {kept}. "
            "Lower --config.optim.lr (or keep --config.optim.grad_clip > 0) and start in a new "
            "--workdir: a changed optimizer is another trajectory.")


def previous_wall(summary_path: str, start: int) -> float:
    """Wall seconds of the invocations before a resumed one (0 for a fresh run)."""
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            prev = json.load(f)
        if prev.get("steps") == start:
            return float(prev.get("wall_s", 0.0))
    return 0.0


def log_stopped(step: int, total: int, interrupted: list) -> None:
    """The last line of a run that stopped before its end (it resumes from its checkpoint)."""
    why = f"interrupted by {interrupted[0]}" if interrupted else "stopped"
    how = ("rerun the same command" if interrupted else
           "rerun without --config.stop_at_step (or with a later step)")
    log(f"{why} at step {step} of {total} (checkpoint saved); {how} to resume.")


# ---------------------------------------------------------------------------- the run

def check_workdir_is_dir(workdir: str) -> None:
    """Raise ValueError if ``workdir`` exists and is not a directory."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir {workdir!r} exists and is not a directory; choose another.")


def open_checkpoints(config, workdir: str, meta: dict, defaults: dict | None = None):
    """Create ``workdir`` and its checkpoint manager; refuse (before compute) a latest
    checkpoint written under another config or other masks.

    Returns:
      ``(manager, latest step or None)``.
    Raises:
      ValueError: an uncreatable workdir, or an incompatible checkpoint (lists the fields)."""
    try:  # only now: a run refused earlier leaves no empty workdir behind
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create --workdir {workdir!r}: {e}; choose another.") from e
    manager = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                         keep=config.keep_checkpoints)
    latest = manager.latest_step()
    if latest is not None:
        try:
            manager.check_compatible(latest, meta, defaults=defaults)
        except ValueError:
            manager.close()
            raise
    return manager, latest


def restore_or_init(manager, latest, builder, train_iter, seed: int):
    """The latest checkpoint's state (and data iterator position), or a fresh one.

    A checkpoint in an earlier layout of the same run (``builder.legacy``: pairs of functions
    ``(current abstract state -> that layout's, restored state -> current)``) is read in that
    layout and converted.

    Returns:
      ``(state, start step)``. Raises ValueError for an unreadable checkpoint (before compute)."""
    if latest is None:
        return builder.init_state(seed), 0
    try:
        abstract = builder.abstract_state()
        try:
            state = manager.restore(latest, abstract, train_iter)
        except ValueError:
            for to_old, from_old in getattr(builder, "legacy", ()):
                try:
                    state = from_old(manager.restore(latest, to_old(abstract), train_iter))
                    break
                except ValueError:
                    continue
            else:
                raise
    except ValueError:
        manager.close()
        raise
    start = int(state["step"])
    log(f"resumed from {manager.directory} at step {start}")
    return state, start


@dataclasses.dataclass
class Run:
    """What a model family gives :func:`train`.

    Attributes:
      step: ``(state, host batch, step number (1-based)) -> (state, metrics)``: one optimizer
        step; the metrics are device scalars (``train_loss``, ``grad_norm`` at least).
      evaluate: ``state -> {name: float}`` full-model evaluation (``val_loss`` or
        ``test_loss``...).
      items_per_step: tokens or images per step, for the rate ``rate_key`` in the records.
      rate_key: ``tokens_per_s`` or ``images_per_s``.
      postfix: ``record -> {label: text}`` for the progress bar.
      summary: ``(steps done, last evaluation, last record, wall seconds) -> dict``: the
        family's ``summary.json`` fields.
      done_line / already_line: ``summary -> text``: the last log line of a finished run / of a
        rerun of one.
    """

    step: Callable
    evaluate: Callable
    items_per_step: int
    rate_key: str
    postfix: Callable
    summary: Callable
    done_line: Callable
    already_line: Callable


def run(config, workdir: str, family: Run, *, state, start: int, total: int, manager,
        meta: dict, train_iter, t_start: float) -> dict:
    """:func:`train`, then :func:`finish`: the whole run after set-up. Returns the summary."""
    state, step, last_eval, interrupted, last_rec = train(
        config, workdir, family, state=state, start=start, total=total, manager=manager,
        meta=meta, train_iter=train_iter)
    return finish(workdir, start=start, step=step, total=total, t_start=t_start,
                  summary=lambda wall: family.summary(step, last_eval, last_rec, wall),
                  evaluate=lambda: family.evaluate(state), last_eval=last_eval,
                  done_line=family.done_line, already_line=family.already_line,
                  interrupted=interrupted)


def train(config, workdir: str, family: Run, *, state, start: int, total: int, manager,
          meta: dict, train_iter) -> tuple[Any, int, dict, list, dict]:
    """The loop: steps ``start + 1 ..`` up to ``total`` (or ``config.stop_at_step``), with
    evaluation every ``config.eval_every`` steps and at the end, logging every
    ``config.log_every`` steps, checkpoints every ``config.checkpoint_every`` steps.

    Returns:
      ``(state, last step, last evaluation, interrupted signal names, last record)``.
    Raises:
      FloatingPointError: a non-finite loss or norm (nothing saved for that state).
    """
    stop = total if config.stop_at_step <= 0 else min(total, config.stop_at_step)
    metrics_log = Metrics(os.path.join(workdir, "metrics.jsonl"), start)
    last_eval: dict[str, float] = {}
    last_rec: dict = {}
    bar = progress(total, start)
    t_window, n_window, step = time.time(), 0, start
    interrupted: list = []
    with StopOnSignal(interrupted):
        try:
            while step < stop and not interrupted:
                state, m = family.step(state, next(train_iter), step + 1)
                # Waiting for each step keeps one step in flight (CPU collectives, DESIGN.md).
                rec = {k: float(v) for k, v in m.items()}
                last_rec = rec
                step += 1
                n_window += 1
                check_finite(rec, step, manager)
                is_eval = step == total or (config.eval_every > 0
                                            and step % config.eval_every == 0)
                if step % config.log_every == 0 or is_eval or step == stop or interrupted:
                    rec[family.rate_key] = family.items_per_step * n_window / max(
                        time.time() - t_window, 1e-9)
                    t_window, n_window = time.time(), 0
                    if is_eval:
                        last_eval = family.evaluate(state)
                        rec.update(last_eval)
                        check_finite(rec, step, manager)
                    rec["step"] = step
                    metrics_log.write(rec)
                    bar.set_postfix(family.postfix(rec), refresh=False)
                bar.update(1)
                every = config.checkpoint_every
                if (every and step % every == 0) or step == stop or interrupted:
                    manager.save(step, state, train_iter, meta)
        finally:
            bar.close()
            manager.close()  # waits for the last save
    return state, step, last_eval, interrupted, last_rec


def finish(workdir: str, *, start: int, step: int, total: int, t_start: float,
           summary: Callable[[float], dict], evaluate: Callable[[], dict], last_eval: dict,
           done_line: Callable[[dict], str], already_line: Callable[[dict], str],
           interrupted: list) -> dict:
    """Write ``summary.json`` (process 0) and the last log line.

    Args:
      summary: ``wall seconds -> summary dict`` (called with the run's total wall time; it
        reads the final evaluation passed through ``last_eval``).
      evaluate: full-model evaluation for a finished run that did not evaluate at its last step.
      done_line / already_line: the last line of a finished run / of a rerun of one.
    Returns:
      the summary; for a run that was already complete, its stored summary.
    """
    path = os.path.join(workdir, "summary.json")
    if start >= total and os.path.exists(path):
        with open(path) as f:  # nothing trained now: keep the run's own figures
            stored = json.load(f)
        log(already_line(stored) + f" (from {path})")
        return stored
    prev_wall = previous_wall(path, start)  # a resumed run adds the earlier time
    done = step >= total
    if done and not last_eval:
        last_eval.update(evaluate())
    out = summary(prev_wall + time.time() - t_start)
    out["interrupted_by"] = interrupted[0] if interrupted and not done else None
    if jax.process_index() == 0:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
    if done:
        log(done_line(out) + f"; summary in {path}")
    else:
        log_stopped(step, total, interrupted)
    return out
