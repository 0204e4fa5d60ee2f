"""The field tables of docs/configuration.md, generated from the declarations.

    python -m sdp_jax.tools.configdoc            # rewrite the tables in docs/configuration.md
    python -m sdp_jax.tools.configdoc --check    # exit 1 when they differ from the declarations

Every field of a run config is declared once (:func:`sdp_jax.fields.setting`: its path,
default, rule and one-line doc) in the classes of
:data:`sdp_jax.train.config.LANGUAGE_MODEL_DECLARED` and
:data:`sdp_jax.train.config.VISION_DECLARED`; this tool writes one table row per field, with
the default of ``configs/llama_small.py`` (the default run) for the language models and of
``vision_config`` for the vision models, between the page's ``<!-- fields: ... -->`` markers.
The prose around the tables is hand-written. ``tests/test_docs.py`` runs ``--check``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from absl import flags

from sdp_jax.models.vision import MODELS
from sdp_jax.train import cli
from sdp_jax.train import config as config_lib

PROG = "python -m sdp_jax.tools.configdoc"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join("docs", "configuration.md")
HEADER = "| field | default{} | rule | meaning |\n|---|---|---|---|\n"


def _value(v) -> str:
    """A default as the table shows it: strings in backticks (``''`` when empty), others as
    Python writes them."""
    if isinstance(v, str):
        return f"`{v}`" if v else "`''`"
    return repr(tuple(v)) if isinstance(v, (tuple, list)) else repr(v)


def table(classes: tuple, configs: list, default_of: str) -> str:
    """The markdown table of the fields ``classes`` declare, defaults read from ``configs``
    (:func:`sdp_jax.train.config.declared_rows`); a field declared ``control`` (one a resumed
    run may change) says so."""
    rows = []
    for path, default, rule, doc in config_lib.declared_rows(classes, configs):
        resumable = " (may change on resume)" if path in config_lib.control_paths() else ""
        rows.append(f"| `{path}` | {_value(default)} | {rule.replace('|', '/')} | "
                    f"{doc.replace('|', '/')}{resumable} |\n")
    return HEADER.format(f" ({default_of})") + "".join(rows)


def _llama_small():
    spec = importlib.util.spec_from_file_location(
        "_llama_small", os.path.join(ROOT, "configs", "llama_small.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def tables() -> dict[str, str]:
    """``{marker name: table}`` of the page: ``language-model`` and ``vision``."""
    vision = [config_lib.vision_config(name, "digits") for name in MODELS]
    return {"language-model": table(config_lib.LANGUAGE_MODEL_DECLARED, [_llama_small()],
                                    "`llama_small`"),
            "vision": table(config_lib.VISION_DECLARED, vision, "`vision_config`")}


def render(text: str) -> str:
    """``text`` (the page) with each ``<!-- fields: NAME -->`` ... ``<!-- end fields -->``
    region replaced by its generated table.

    Raises:
      ValueError: a marker missing from the page (naming it)."""
    for name, body in tables().items():
        begin, end = f"<!-- fields: {name} -->\n", "<!-- end fields -->"
        if begin not in text:
            raise ValueError(f"{PAGE} has no marker {begin.strip()!r}; put it above the table "
                             "of that family's fields, and '<!-- end fields -->' below it.")
        i = text.index(begin) + len(begin)
        j = text.index(end, i)
        text = text[:i] + body + text[j:]
    return text


def _flags(argv) -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_boolean("check", False, "only compare; exit 1 when the page is out of date",
                         flag_values=fv)
    return fv


def main(argv=None) -> int:
    """The command line (see the module docstring). Returns 0, or 1 when ``--check`` finds
    the page out of date; a missing marker is a one-line error (status 2)."""
    argv = [PROG] + (sys.argv[1:] if argv is None else list(argv))
    fv = cli.command_flags(_flags, argv, PROG, __doc__, "--check")
    path = os.path.join(ROOT, PAGE)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        new = render(text)
    except ValueError as e:
        cli.error(PROG, str(e))
    if fv.check:
        if new != text:
            print(f"{PAGE} is out of date with the declarations: run {PROG}")
            return 1
        print(f"{PAGE} is current")
        return 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
    print(f"wrote the field tables of {PAGE}" if new != text else f"{PAGE} was current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
