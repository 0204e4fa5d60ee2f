"""Profiler traces of a window of training steps (``config.profile_start`` ..
``config.profile_stop``), written with :func:`jax.profiler.start_trace` into the run's folder.

Every process traces its own devices into its own folder, ``WORKDIR/profile/process_<i>/``
(processes on one host would otherwise write the same ``<host>.xplane.pb``), so a slow host or
a process waiting in a collective shows in its own trace. Each trace is jax's TensorBoard
layout, ``plugins/profile/<time>/<host>.xplane.pb`` (``tensorboard --logdir WORKDIR/profile``,
with the ``tensorboard-plugin-profile`` package), with a ``perfetto_trace.json.gz`` beside it
for https://ui.perfetto.dev. Every step of the window is a ``jax.profiler.StepTraceAnnotation``
named ``train`` with its step number (TensorBoard's step-time breakdown).
"""

from __future__ import annotations

import os
from typing import Callable

import jax

PROFILE_DIR = "profile"


def trace_dir(workdir: str, process: int | None = None) -> str:
    """``WORKDIR/profile/process_<i>``: where process ``i`` (default: this one) writes its
    traces."""
    i = jax.process_index() if process is None else process
    return os.path.join(workdir, PROFILE_DIR, f"process_{i}")


def latest_trace(folder: str) -> str | None:
    """The newest ``plugins/profile/<time>`` folder of a trace folder (one
    :func:`jax.profiler.stop_trace` wrote), or None when there is none."""
    runs = os.path.join(folder, "plugins", "profile")
    if not os.path.isdir(runs):
        return None
    found = [os.path.join(runs, d) for d in os.listdir(runs)]
    return max(found, key=os.path.getmtime) if found else None


class StepWindow:
    """Traces optimizer steps ``first .. last`` (inclusive; the step numbers of
    ``metrics.jsonl``) of a run into :func:`trace_dir`.

    Used as a context around the loop, with the loop's step function wrapped once::

        with StepWindow(workdir, first, last, resumed_at, log) as window:
            loop(..., window.wrap(one_step), ...)

    The trace starts before step ``first`` (or before the first step of a run resumed inside
    the window) and stops after step ``last``, once that step's results are computed; when the
    loop ends inside the window (``stop_at_step``, a signal, an error) leaving the context stops
    it, so what was traced is written (a second signal ends the process at once,
    :func:`sdp_jax.train.cli.exit_on_signal`: no trace). A failure of the profiler itself is
    logged and the run goes on without a trace.

    Args:
      workdir: the run's folder.
      first, last: the window; ``first = 0`` traces nothing.
      resumed_at: the step the run starts after (0 for a fresh run).
      log: prints one line (process 0's log).
    """

    def __init__(self, workdir: str, first: int, last: int, resumed_at: int,
                 log: Callable[[str], None]):
        self.folder, self.first, self.last, self.log = trace_dir(workdir), first, last, log
        self.active, self.started, self.done_step = False, 0, 0
        if first and last <= resumed_at:
            log(f"profile: steps {first}..{last} lie before the restored step {resumed_at}; "
                "no trace (a later --config.profile_start traces this invocation)")
            self.first = 0

    def wrap(self, one_step):
        """``one_step(state, batch, step) -> (state, metrics)`` that traces the window."""
        if not self.first:
            return one_step

        def step(state, batch, n: int):
            if not self.active and self.first <= n <= self.last and not self.done_step:
                self._start(n)
            if not self.active:
                return one_step(state, batch, n)
            with jax.profiler.StepTraceAnnotation("train", step_num=n):
                state, metrics = one_step(state, batch, n)
            self.done_step = n
            if n >= self.last:
                jax.block_until_ready((state, metrics))   # the step's work inside the trace
                self._stop("")
            return state, metrics
        return step

    def _start(self, n: int) -> None:
        try:
            os.makedirs(self.folder, exist_ok=True)
            jax.profiler.start_trace(self.folder, create_perfetto_trace=True)
        except (RuntimeError, OSError) as e:
            self.log(f"warning: profile of steps {self.first}..{self.last} not started "
                     f"({type(e).__name__}: {e}); training goes on without it")
            self.done_step = n
            return
        self.active, self.started = True, n
        self.log(f"profile: tracing steps {n}..{self.last} into {self.folder}")

    def _stop(self, why: str) -> None:
        self.active = False
        try:
            jax.profiler.stop_trace()
        except (RuntimeError, OSError, ValueError) as e:
            self.log(f"warning: profile not written ({type(e).__name__}: {e})")
            return
        run = latest_trace(self.folder)
        self.log(f"profile of steps {self.started}..{self.done_step}{why} written to {run} "
                 f"(tensorboard --logdir {os.path.dirname(self.folder)}; or open "
                 f"{os.path.join(run or '', 'perfetto_trace.json.gz')} at ui.perfetto.dev)")

    def __enter__(self) -> "StepWindow":
        return self

    def __exit__(self, *exc) -> bool:
        if self.active:   # the run stopped inside the window: keep what was traced
            self._stop(f" (the run stopped inside the window {self.first}..{self.last})")
        return False
