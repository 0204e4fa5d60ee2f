"""Building frozen dataclasses from ``ml_collections.ConfigDict`` sections, and settings declared
once (:func:`setting`) with their config path, one-line doc, type and bounds."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


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
def setting(default, doc: str, *, path: str | None = None, kind: type = str,
            choices: tuple | None = None, low: float | None = None):
    """A dataclass field declared once with everything the rest of the package reads from it.

    Args:
      default: the default value.
      doc: one line (what the setting does; units; what 0 means), shown in error messages and
        in docs/configuration.md.
      path: the run config's field (dotted, e.g. ``sdp.average``; the command-line flag is
        ``--config.`` + path); None for a setting only a caller of the library sets.
      kind: ``bool``, ``int``, ``float`` or ``str``: the value's type (an ``int`` is accepted
        where ``float`` is declared; a ``bool`` never counts as a number).
      choices: the allowed values, or None.
      low: the smallest allowed number (``int`` / ``float``), or None.

    Returns:
      a ``dataclasses.field`` whose metadata :func:`check_settings` and :func:`settings`
      read."""
    return dataclasses.field(default=default, metadata={
        "doc": doc, "path": path, "kind": kind, "choices": choices, "low": low})


def settings(cls) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` (or of an instance) declared with :func:`setting`."""
    return [f for f in dataclasses.fields(cls) if "doc" in f.metadata]


def setting_name(f: dataclasses.Field) -> str:
    """How messages name a declared setting: ``config.`` + its path (the command-line flag is
    ``--config.`` + path), or the field's name when no run config sets it."""
    return f"config.{f.metadata['path']}" if f.metadata["path"] else f.name


def _bad(f: dataclasses.Field, value) -> str | None:
    """What is wrong with ``value`` for the declared setting ``f`` (None: nothing)."""
    m = f.metadata
    kind, low = m["kind"], m["low"]
    if value is None and f.default is None:   # (an optional setting left unset)
        return None
    if kind is bool:
        return None if isinstance(value, bool) else "must be True or False"
    if kind in (int, float):
        number = (int,) if kind is int else (int, float)
        what = "an integer" if kind is int else "a finite number"
        rule = ("a positive integer" if kind is int and low == 1 else
                what + ("" if low is None else f" >= {low:g}"))
        if isinstance(value, bool) or not isinstance(value, number) \
                or not math.isfinite(value) or (low is not None and value < low):
            return f"must be {rule}"
        return None
    if m["choices"] is not None and value not in m["choices"]:
        return "; use " + " or ".join(str(c) for c in m["choices"])
    return None


def check_settings(obj) -> None:
    """Refuse a dataclass instance whose declared settings (:func:`setting`) break their type,
    bounds or choices.

    Raises:
      ValueError: one line naming the first bad setting (:func:`setting_name`), its value,
        the rule and the setting's doc, e.g. ``config.grad_accum=0 must be a positive integer
        (microbatches per optimizer step; 1 = no accumulation).``"""
    for f in settings(obj):
        value = getattr(obj, f.name)
        bad = _bad(f, value)
        if bad is not None:
            raise ValueError(f"{setting_name(f)}={value!r}{'' if bad[0] == ';' else ' '}{bad} "
                             f"({f.metadata['doc']}).")


def read_settings(cls, config) -> dict[str, Any]:
    """``{field name: value}`` of the settings of ``cls`` that a run config sets, read from
    ``config`` (a ``ConfigDict`` or nested dict) at each setting's path."""
    out = {}
    for f in settings(cls):
        if f.metadata["path"]:
            node = config
            for part in f.metadata["path"].split("."):
                node = node[part]
            out[f.name] = node
    return out


def setting_defaults(cls) -> dict[str, Any]:
    """``{path: default}`` of the settings of ``cls`` that a run config sets, for building the
    config's fields from the declarations (:mod:`sdp_jax.train.config`)."""
    return {f.metadata["path"]: f.default for f in settings(cls) if f.metadata["path"]}
