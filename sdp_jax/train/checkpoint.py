"""Orbax checkpoints of a run: train state and the run's recipe.

Each step directory holds two items:

* ``state``: ``{params, opt_state, step}`` in the compact SDP layout (each worker's blocks; a
  block appears once per holder), saved and restored sharded by orbax onto whatever process
  layout the resuming run has;
* ``meta``: JSON with the trajectory-defining config, the mask recipes, a SHA-256 of every
  mask matrix (docs/design.md invariant 7) and the resolved worker count, checked before
  anything is restored.

The data position is the step itself (:func:`sdp_jax.train.data.iterate`), so nothing per process is
stored and a checkpoint resumes on another number of processes, devices or grain workers when
the worker count ``W`` is the same (docs/design.md invariant 8). Checkpoints of earlier releases
also hold a ``data`` item (grain's iterator state per process); it is not read.

Orbax writes each step into a temporary directory and renames it when complete, so a run that dies
while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import orbax.checkpoint as ocp

# How TensorStore and orbax word a fault of a checkpoint's own files (a byte range past a
# truncated file's end, a missing or undecodable file): found in a read error's message.
_FILE_FAULT = re.compile(r"local file|Error (reading|opening|decoding)|byte range|No such file"
                         r"|DATA_LOSS|[Cc]orrupt|[Tt]runcat|[Ii]ncomplete")
# The errors of a file that cannot be read: missing, a folder, not readable, not decodable.
_FILE_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
                json.JSONDecodeError, UnicodeDecodeError)
# How gloo, JAX's coordination service and orbax's multi-process signals word a failure of
# the processes around a read (a peer that died or hung: a closed connection, a barrier or a
# key that timed out).
_PEER_FAULT = re.compile(r"Gloo|UNAVAILABLE|DEADLINE_EXCEEDED|[Bb]arrier|coordination service"
                         r"|Connection (closed|reset|refused)|[Tt]ime(d )?out waiting|"
                         r"[Tt]imed out")


class ReadFailed(RuntimeError):
    """Reading a checkpoint failed for a reason outside its files: a collective or JAX's
    coordination service failed (another process ended or hung during the read). The
    checkpoint is intact and kept; rerunning once every process runs resumes it."""


def _chain(err: BaseException):
    """``err`` and the errors it was raised from (``raise ... from``: ``__cause__``)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__


def _file_fault(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) says that a file could not be read:
    missing, a folder, not readable, undecodable JSON or text (:data:`_FILE_ERRORS`; not a
    ``TimeoutError`` or ``ConnectionError``, also ``OSError`` errors), or TensorStore's words for
    a truncated or missing file (:data:`_FILE_FAULT`)."""
    return any(isinstance(e, _FILE_ERRORS) or _FILE_FAULT.search(str(e)) for e in _chain(err))


def _processes() -> int:
    """The processes of the run (``jax.process_count()``)."""
    import jax  # pylint: disable=g-import-not-at-top
    return jax.process_count()


def _peer_fault(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) is a failure of the processes around
    a read: a ``TimeoutError`` or ``ConnectionError``, or the words of gloo, JAX's
    coordination service or a barrier (:data:`_PEER_FAULT`); only with several processes."""
    if _processes() < 2:
        return False
    return any(isinstance(e, (TimeoutError, ConnectionError)) or _PEER_FAULT.search(str(e))
               for e in _chain(err))


def _short(value: Any, limit: int = 32) -> str:
    """``repr(value)``, cut to ``limit`` characters (a mask hash, a long list) with ``…``."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 8] + "…"


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]}: checkpoint has {_short(a)}, this run has "
                              f"{_short(b)}"]


def _name(line: str) -> str:
    """The field (or leaf) a difference line is about: its text before the first ``": "``."""
    return line.split(": ", 1)[0]


def _inline(lines: list[str], shown: int = 4) -> str:
    """Differences as one line: the first ``shown`` in full, joined by ``"; "``, then how many
    more and their names (:func:`_name`; the first 8)."""
    rest = [_name(ln) for ln in lines[shown:]]
    more = (f"; and {len(rest)} more ({', '.join(rest[:8])}{', …' if len(rest) > 8 else ''})"
            if rest else "")
    return "; ".join(lines[:shown]) + more


def _within(path: str, fields: tuple[str, ...]) -> bool:
    """Whether the dotted ``path`` is one of ``fields`` or under a prefix ``"x."`` of them."""
    return any(path == f or (f.endswith(".") and path.startswith(f)) for f in fields)


def with_defaults(saved: Any, defaults: Any) -> Any:
    """``saved`` with the keys it lacks taken from ``defaults``, section by section."""
    if not isinstance(saved, dict) or not isinstance(defaults, dict):
        return saved
    out = dict(defaults)
    for k, v in saved.items():
        out[k] = with_defaults(v, defaults.get(k))
    return out


def _leaf_shapes(tree: Any) -> dict[tuple, tuple[str, tuple]]:
    """``{path: (printed path, shape)}`` of a state tree's leaves, the path as plain names
    and indices: orbax's metadata stores a named tuple (optax's states) as a dict and a tuple
    as a list, which ``jax.tree_util.keystr`` prints otherwise."""
    import jax  # pylint: disable=g-import-not-at-top
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        plain = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
        out[plain] = (jax.tree_util.keystr(path), tuple(getattr(x, "shape", ()) or ()))
    return out


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def latest_step_in(directory: str) -> int | None:
    """The step of the latest finished checkpoint in ``directory`` (a run's
    ``checkpoints/``), or None: none there, or no such folder (which is not created)."""
    if not os.path.isdir(directory):
        return None
    manager = CheckpointManager(directory)
    try:
        return manager.latest_step()
    finally:
        manager.close()


def _masks_last(diffs: list[str]) -> list[str]:
    """The differences with the masks' (``masks.*``) after the others and, when other fields
    differ too (the masks follow from them), folded into one line naming them."""
    masks = [d for d in diffs if _name(d).startswith("masks.")]
    others = [d for d in diffs if d not in masks]
    if not others or not masks:
        return others + masks
    names = ", ".join(_name(d)[len("masks."):] for d in masks)
    return others + [f"masks: differ too ({names})"]


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
                           "meta": ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of the checkpoints kept, ascending."""
        return sorted(self._mngr.all_steps())

    def _damaged(self, step: int, what: str, err: Exception) -> ValueError:
        """The error for a checkpoint whose files cannot be read (truncated, missing): it
        names the step and how to fall back (moving it aside, nothing is deleted)."""
        path = os.path.join(self.directory, str(step))
        older = [s for s in self._mngr.all_steps() if s < step]
        fix = (f"move {path} aside (e.g. to {path}.damaged) to resume from step {max(older)}"
               if older else f"move {path} aside to start afresh")
        return ValueError(f"the checkpoint at step {step} in {self.directory} is damaged "
                          f"({what}: {type(err).__name__}: {_first_line(err)[:300]}); {fix}, "
                          "or use a new --workdir.")

    def _own_files_fault(self, step: int, what: str) -> str:
        """What is wrong with the files of item ``what`` (``meta`` or ``state``) of the
        checkpoint at ``step``, read on this host alone (no collective): ``""`` when its
        metadata files are present and parse."""
        item = os.path.join(self.directory, str(step), what)
        name = "metadata" if what == "meta" else "_METADATA"
        path = os.path.join(item, name)
        try:
            with open(path) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            return f"{path}: {type(e).__name__}: {_first_line(e)[:200]}"
        return ""

    def _read_error(self, step: int, what: str, err: Exception) -> Exception | None:
        """The error for a failed read of item ``what`` of the checkpoint at ``step``:
        *damaged* (:meth:`_damaged`, with the fallback) only when the checkpoint's own files
        are shown unreadable (its metadata does not parse on this host, or the error is a
        file's: :func:`_file_fault`); :class:`ReadFailed` when the processes around the read
        failed (:func:`_peer_fault`: the checkpoint is intact); None for any other error
        (e.g. out of memory), which the caller raises as it is."""
        fault = self._own_files_fault(step, what)
        if fault:
            return self._damaged(step, what, OSError(fault))
        if _file_fault(err):
            return self._damaged(step, what, err)
        if not _peer_fault(err):
            return None
        return ReadFailed(
            f"reading the checkpoint at step {step} in {self.directory} failed, but not "
            f"because of its files ({what}: {type(err).__name__}: {_first_line(err)[:200]}): "
            "a collective or the coordination service failed around the read (another "
            "process ended or hung?); the checkpoint is intact and kept: rerun to resume once "
            "every process runs.")

    def read_meta(self, step: int) -> dict:
        """The ``meta`` item of ``step``.

        Raises:
          ValueError: its files are unreadable (damaged: names the step and the fallback).
          ReadFailed: the read failed around the files (a peer process ended).
          Any other error of the read as it is (:meth:`_read_error`)."""
        try:
            return self._mngr.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 (orbax/json/OS errors, or a failed collective)
            known = self._read_error(step, "meta", e)
            if known is None:
                raise
            raise known from e

    def check_compatible(self, step: int, meta: dict, defaults: dict | None = None,
                         may_grow: tuple[str, ...] = (), hints: dict | None = None,
                         elastic: tuple[str, ...] = (), allow_elastic: bool = False,
                         elastic_hint: str = "") -> list[str]:
        """Refuse a checkpoint written by a different run config.

        Args:
          defaults: config fields newer than some checkpoints (nested like the config), with
            the value the older runs implicitly used (a field missing from the saved config, at
            any depth, is taken as this).
          may_grow: top-level numeric config fields that may be larger in this run than in the
            checkpoint (e.g. ``steps`` of a run whose schedule allows extension).
          hints: {top-level field: text} appended to that field's line when it differs.
          elastic: the fields an elastic resume may change (dotted, or prefixes ending in
            ``.``; ``masks.``: the mask recipes; :mod:`sdp_jax.train.elastic`); allow_elastic:
            accept changes of those alone; elastic_hint: ends a refusal of those alone.

        Returns:
          the lines of the accepted elastic changes ([] when none).

        Raises:
          ValueError: in one line, the differing fields (the first four in full, values cut
            short, then the others' names; the masks' folded into one when other fields
            differ too), then the fix (another ``--workdir``, or the original values).
        """
        saved = self.read_meta(step)
        diffs = _diff(saved.get("masks", {}), meta["masks"], "masks.")
        saved_config = with_defaults(saved.get("config", {}), defaults or {})
        config = meta["config"]
        if "workers" in meta and ("workers" in saved or (
                config.get("workers") == 0 and saved_config.get("workers"))):
            # The resolved W decides the trajectory, not how it was asked for (0 = every
            # device): 1 process x 4 devices and 2 x 2 with workers=0 are the same run. (A
            # checkpoint from before W was recorded compares its explicit workers with W.)
            saved_w = saved.get("workers", saved_config.get("workers"))
            saved_config = {k: v for k, v in saved_config.items() if k != "workers"}
            config = {k: v for k, v in config.items() if k != "workers"}
            if saved_w != meta["workers"]:
                diffs.append(f"workers: the checkpoint was trained by W = {saved_w} workers, "
                             f"this run has W = {meta['workers']} (a different W is a "
                             f"different trajectory: resume with --config.workers={saved_w}, "
                             f"with several processes on exactly {saved_w} devices)")
        for k in may_grow:
            if k in saved_config and k in config and config[k] >= saved_config[k]:
                config = {**config, k: saved_config[k]}
        diffs = [d + (f" ({hints[_name(d)]})" if _name(d) in (hints or {}) else "")
                 for d in _diff(saved_config, config)] + diffs
        only_elastic = all(_within(_name(d), elastic) for d in diffs)
        if allow_elastic and only_elastic:
            return diffs
        if diffs:
            hint = f" {elastic_hint}" if elastic_hint and only_elastic else ""
            raise ValueError(
                f"the checkpoint at step {step} in {self.directory} is incompatible with this "
                f"run (written by another run config), so it is not loaded: "
                f"{_inline(_masks_last(diffs))}. Use a new --workdir for this config, or rerun "
                f"with the checkpoint's values to resume it.{hint}")
        return []

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Save ``state`` (pytree of sharded arrays) and ``meta`` at ``step`` (asynchronously;
        :meth:`close` waits)."""
        self._mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

    def _layout_mismatch(self, step: int, abstract_state: Any) -> list[str]:
        """Leaves whose stored shape differs from ``abstract_state``'s (or that only one of
        them has): a readable checkpoint of another parameter layout. Read from the
        checkpoint's metadata (no array is read); [] when that is unreadable (a damaged
        checkpoint, which the restore then reports)."""
        try:
            stored = self._mngr.item_metadata(step)["state"]
        except Exception:  # noqa: BLE001 (no readable metadata: not a layout question)
            return []
        if stored is None:
            return []
        want = _leaf_shapes(abstract_state)
        have = _leaf_shapes(dict(stored) if hasattr(stored, "keys") else stored)
        shown = {k: name for k, (name, _) in {**have, **want}.items()}
        return [f"{shown[k]}: checkpoint {have.get(k, (0, '<absent>'))[1]}, "
                f"this run {want.get(k, (0, '<absent>'))[1]}"
                for k in sorted(set(want) | set(have), key=str)
                if have.get(k, (0, None))[1] != want.get(k, (0, None))[1]]

    def _incompatible(self, step: int, mismatch: list[str]) -> ValueError:
        """The one-line refusal of a readable checkpoint of another parameter layout
        (``mismatch``: :meth:`_layout_mismatch`'s lines, :func:`_inline`)."""
        return ValueError(
            f"the checkpoint at step {step} in {self.directory} is incompatible with this run: "
            f"it holds another parameter layout ({_inline(mismatch)}); use a new --workdir for "
            "this run, or the code and config that wrote it to resume it.")

    def restore(self, step: int, abstract_state: Any) -> Any:
        """Restore the state into ``abstract_state``'s shapes and shardings (any process
        layout). Returns the state.

        The stored shapes are compared with ``abstract_state``'s first (from the checkpoint's
        metadata, no array read), so that another layout (an earlier one that
        :func:`sdp_jax.train.loop.restore_or_init` then tries) is refused before orbax starts
        reading: a read that fails part-way leaves orbax's other reads of that restore
        unfinished in an event loop it has closed (orbax 0.12: ``asyncio_utils.
        _run_sync_via_new_loop``), and each of them prints "Exception ignored in: <coroutine
        ...>" when it is collected.

        Raises:
          ValueError: the checkpoint holds another parameter layout (incompatible: names the
            leaves) or its files cannot be read (damaged: names the step and how to fall
            back).
          ReadFailed: the read failed around the files (a collective; the checkpoint is kept).
          Any other error of the read as it is (e.g. out of memory; :meth:`_read_error`).
        """
        mismatch = self._layout_mismatch(step, abstract_state)
        if mismatch:
            raise self._incompatible(step, mismatch)
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))
        except Exception as e:  # noqa: BLE001 (truncated tensors, missing items, a collective)
            known = self._read_error(step, "state", e)
            if known is None:
                raise
            raise known from e
        return out["state"]

    def close(self) -> None:
        """Finish pending saves and release orbax's background threads."""
        self._mngr.close()
