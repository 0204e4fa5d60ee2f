"""Building frozen dataclasses from ``ml_collections.ConfigDict`` sections, and settings declared
once (:func:`setting`) with their config path, one-line doc, type and bounds."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np


def from_section(cls, cfg: Any, section: str, note: str = ""):
    """``cls(**cfg)`` for a dataclass ``cls`` and a config section (ConfigDict or dict).

    Raises:
      ValueError: keys that are not fields of ``cls``, naming the section, the unknown keys and
        the valid ones (``note`` is added after the section name); plus ``cls``'s own checks."""
    d = dict(cfg)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown {section} config keys {unknown}{note}; valid keys: "
                         f"{sorted(names)}.")
    return cls(**d)


# ----------------------------------------------------------------------------------------------
# Declared settings: a dataclass field with its config path, one-line doc and rule
# ----------------------------------------------------------------------------------------------
KINDS = (bool, int, float, str, tuple, object)
_SAME = object()   # run_default not given: a run config's default is the declaration's


def setting(default, doc: str, *, path: str | None = "", kind: type | None = None,
            choices: tuple | None = None, low: float | None = None, high: float | None = None,
            open_low: bool = False, open_high: bool = False, control: bool = False,
            run_default=_SAME, rule: str = ""):
    """A dataclass field declared once with everything the rest of the package reads from it.

    Args:
      default: the default value.
      doc: one line (what the setting does; units; what 0 means), shown in error messages and
        in docs/configuration.md.
      path: the run config's field, dotted (``sdp.average``; the command-line flag is
        ``--config.`` + path); ``""`` (the default): the class's ``SECTION`` and the field's
        name (``SECTION = "optim"``: ``optim.lr``; no ``SECTION``: the name at the top level);
        None: a setting only a caller of the library sets.
      kind: ``bool``, ``int``, ``float``, ``str``, ``tuple`` or ``object`` (anything: the
        class checks it); default the default's type. An ``int`` is accepted where ``float``
        is declared, a list where ``tuple`` is; a ``bool`` never counts as a number.
      choices: the allowed values, or None.
      low, high: bounds of a number (inclusive, or exclusive with ``open_low`` /
        ``open_high``), or None.
      control: the setting does not change the training trajectory (how often to log, how
        the same function is computed): a checkpoint written under another value resumes.
      run_default: the default of a run config when it differs from a library caller's
        (``optim.grad_clip``: a run clips at 1, ``StepOptions()`` does not clip).
      rule: the rule in words where the declared kind does not say it (an ``object`` field,
        a value the class replaces), for messages and docs/configuration.md.

    Returns:
      a ``dataclasses.field`` whose metadata :func:`check_settings`, :func:`read_settings`,
      :func:`setting_defaults` and :func:`setting_rows` read.

    Raises:
      ValueError: a kind this module does not check."""
    kind = type(default) if kind is None else kind
    if kind not in KINDS:
        raise ValueError(f"setting kind {kind!r}: declare one of {KINDS} (give kind=).")
    return dataclasses.field(default=default, metadata={
        "doc": doc, "path": path, "kind": kind, "choices": choices, "low": low, "high": high,
        "open_low": open_low, "open_high": open_high, "control": control,
        "run_default": default if run_default is _SAME else run_default, "rule": rule})


def settings(cls) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` (or of an instance) declared with :func:`setting`."""
    return [f for f in dataclasses.fields(cls) if "doc" in f.metadata]


def config_path(cls, f: dataclasses.Field) -> str | None:
    """The run config's field of the declared setting ``f`` of ``cls`` (see :func:`setting`),
    or None when no run config sets it."""
    path = f.metadata["path"]
    if path != "":
        return path
    section = getattr(cls, "SECTION", "")
    return f"{section}.{f.name}" if section else f.name


def setting_name(cls, f: dataclasses.Field) -> str:
    """How messages name a declared setting: ``config.`` + its path (the command-line flag is
    ``--config.`` + path), or the field's name when no run config sets it."""
    path = config_path(cls, f)
    return f"config.{path}" if path else f.name


def rule(f: dataclasses.Field) -> str:
    """The declared rule of ``f`` in words, e.g. ``a positive integer``, ``a finite number in
    [0, 1)``, ``one of none, full, dots`` (empty for ``object`` or a ``str`` without
    choices)."""
    m = f.metadata
    if m["rule"]:
        return m["rule"]
    if m["choices"] is not None:
        return ("" if len(m["choices"]) == 1 else "one of ") + ", ".join(map(str, m["choices"]))
    kind, low, high = m["kind"], m["low"], m["high"]
    if kind in (bool, tuple, str, object):
        return {bool: "True or False", tuple: "a tuple or list", str: "a string",
                object: ""}[kind]
    what = "an integer" if kind is int else "a finite number"
    low, high = (None if b is None else str(int(b)) if float(b).is_integer() and abs(b) < 1e15
                 else f"{b:g}" for b in (low, high))
    if kind is int and low == "1" and high is None:
        return "a positive integer"
    if low is not None and high is not None:
        return (f"{what} in {'(' if m['open_low'] else '['}{low}, {high}"
                f"{')' if m['open_high'] else ']'}")
    if low is not None:
        return f"{what} {'>' if m['open_low'] else '>='} {low}"
    if high is not None:
        return f"{what} {'<' if m['open_high'] else '<='} {high}"
    return what


def _fits(f: dataclasses.Field, value) -> bool:
    """Whether ``value`` keeps the declared type, bounds and choices of ``f``."""
    m = f.metadata
    kind = m["kind"]
    if value is None and f.default is None:   # (an optional setting left unset)
        return True
    if m["choices"] is not None:
        return any(value == c and type(value) is type(c) for c in m["choices"])
    if kind is object:
        return True
    if kind is bool:
        return isinstance(value, (bool, np.bool_))
    if kind is tuple:
        return isinstance(value, (tuple, list))
    if kind is str:
        return isinstance(value, str)
    number = numbers.Integral if kind is int else numbers.Real   # (numpy scalars too)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, number):
        return False
    if not math.isfinite(value):
        return False
    low, high = m["low"], m["high"]
    return not ((low is not None and (value <= low if m["open_low"] else value < low))
                or (high is not None and (value >= high if m["open_high"] else value > high)))


def check_settings(obj) -> None:
    """Refuse a dataclass instance whose declared settings (:func:`setting`) break their type,
    bounds or choices.

    Raises:
      ValueError: one line naming the first bad setting (:func:`setting_name`), its value,
        the rule and the setting's doc, e.g. ``config.sdp.sync_every=0 must be a positive
        integer (H, the steps between parameter averagings (sdp.average=parameters)).``"""
    for f in settings(obj):
        value = getattr(obj, f.name)
        if not _fits(f, value):
            words = rule(f)
            choices = f.metadata["choices"] or ()
            words = ("; use " + (" or ".join(map(str, choices)) if len(choices) == 2 else words)
                     if choices else " must be " + words)
            raise ValueError(f"{setting_name(type(obj), f)}={value!r}{words} "
                             f"({f.metadata['doc']}).")


def _at(config, path: str):
    for part in path.split("."):
        config = config[part]
    return config


def read_settings(cls, config) -> dict[str, Any]:
    """``{field name: value}`` of the settings of ``cls`` that a run config sets, read from
    ``config`` (a ``ConfigDict`` or nested dict) at each setting's path."""
    return {f.name: _at(config, config_path(cls, f)) for f in settings(cls)
            if config_path(cls, f)}


def setting_defaults(cls) -> dict[str, Any]:
    """``{path: a run config's default}`` of the settings of ``cls`` that a run config sets,
    for building the config's fields from the declarations (:mod:`sdp_jax.train.config`)."""
    return {config_path(cls, f): f.metadata["run_default"] for f in settings(cls)
            if config_path(cls, f)}


def control_paths(*classes) -> tuple[str, ...]:
    """The config paths of the settings of ``classes`` declared ``control=True`` (see
    :func:`setting`)."""
    return tuple(dict.fromkeys(config_path(cls, f) for cls in classes for f in settings(cls)
                               if f.metadata["control"] and config_path(cls, f)))


def setting_rows(cls) -> list[tuple[str, str, str]]:
    """``(path, rule, doc)`` of every setting of ``cls`` that a run config sets, in declaration
    order (the rows of docs/configuration.md)."""
    return [(config_path(cls, f), rule(f), f.metadata["doc"]) for f in settings(cls)
            if config_path(cls, f)]
