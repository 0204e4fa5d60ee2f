"""Building frozen dataclasses from ``ml_collections.ConfigDict`` sections."""

from __future__ import annotations

import dataclasses
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
