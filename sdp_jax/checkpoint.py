"""Orbax checkpoints of a run: train state, grain iterator state and the run's recipe.

Each step directory holds three items:

* ``state``: ``{params, opt_state, step}`` in the compact SDP layout (each worker's blocks; a
  block appears once per holder), saved and restored sharded by orbax;
* ``data``: the grain iterator state, one JSON file per process (grain's own orbax handler);
* ``meta``: JSON with the trajectory-defining config, the mask recipes and a SHA-256 of every
  mask matrix (docs/design.md invariant 7), checked before anything is restored.

Orbax writes each step into a temporary directory and renames it when complete, so a run that dies
while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
from typing import Any

import grain
import orbax.checkpoint as ocp


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]}: checkpoint has {a!r}, this run has {b!r}"]


def _with_defaults(saved: Any, defaults: Any) -> Any:
    """``saved`` with the keys it lacks taken from ``defaults``, section by section."""
    if not isinstance(saved, dict) or not isinstance(defaults, dict):
        return saved
    out = dict(defaults)
    for k, v in saved.items():
        out[k] = _with_defaults(v, defaults.get(k))
    return out


class CheckpointManager:
    """Thin wrapper over ``orbax.checkpoint.CheckpointManager`` for SDP runs.

    Args:
      directory: where step directories go (created if missing).
      keep: number of most recent checkpoints kept.
    """

    def __init__(self, directory: str, keep: int = 2):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max(1, int(keep)), create=True)
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "data": grain.checkpoint.CheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def _unreadable(self, step: int, what: str, err: Exception) -> ValueError:
        older = [s for s in self._mngr.all_steps() if s < step]
        fix = (f"delete {os.path.join(self.directory, str(step))} to resume from step "
               f"{max(older)}" if older else
               f"delete {os.path.join(self.directory, str(step))} to start afresh")
        return ValueError(f"the checkpoint at step {step} in {self.directory} is unreadable "
                          f"({what}: {type(err).__name__}: {str(err)[:300]}); {fix}, or use "
                          "a new --workdir.")

    def read_meta(self, step: int) -> dict:
        """The ``meta`` item of ``step``. Raises ValueError naming the step if unreadable."""
        try:
            return self._mngr.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax/json/OS errors of a damaged checkpoint
            raise self._unreadable(step, "meta", e) from e

    def check_compatible(self, step: int, meta: dict, defaults: dict | None = None) -> None:
        """Refuse a checkpoint written by a different run config.

        Args:
          defaults: config fields newer than some checkpoints (nested like the config), with
            the value the older runs implicitly used (a field missing from the saved config, at
            any depth, is taken as this).

        Raises:
          ValueError: listing every differing field, with the fix (another ``--workdir``, or
            the original values).
        """
        saved = self.read_meta(step)
        diffs = _diff(_with_defaults(saved.get("config", {}), defaults or {}), meta["config"])
        diffs += _diff(saved.get("masks", {}), meta["masks"], "masks.")
        if "workers" in saved and "workers" in meta:   # W, recorded since config.workers=0
            diffs += _diff(saved["workers"], meta["workers"], "workers (resolved).")
        if diffs:
            shown = "\n  ".join(diffs[:20])
            raise ValueError(
                f"the checkpoint at step {step} in {self.directory} was written by a different "
                f"run config, so it is not loaded:\n  {shown}\nUse a new --workdir for this "
                "config, or rerun with the checkpoint's values to resume it.")

    def save(self, step: int, state: Any, data_iter: Any, meta: dict) -> None:
        """Save ``state`` (pytree of sharded arrays), the iterator and ``meta`` at ``step``."""
        self._mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iter),
            meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, abstract_state: Any, data_iter: Any) -> Any:
        """Restore the state into ``abstract_state``'s shapes and shardings and the iterator in
        place. Returns the state.

        Raises:
          ValueError: the checkpoint is damaged (names the step and how to fall back).
        """
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=grain.checkpoint.CheckpointRestore(data_iter)))
        except Exception as e:  # truncated tensors, missing items, bad iterator JSON
            raise self._unreadable(step, "state or data iterator", e) from e
        return out["state"]

    def close(self) -> None:
        """Finish pending saves and release orbax's background threads."""
        self._mngr.close()
