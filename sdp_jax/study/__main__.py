"""``python -m sdp_jax.study [sdp | mapl] FLAGS``: the studies' one command.

``sdp`` runs the SDP study of every variant against DDP (:mod:`sdp_jax.study.sdp`); ``mapl``, or
no subcommand, the MAPL study of compressed pipeline boundaries (:mod:`sdp_jax.study.mapl`).
"""

from __future__ import annotations

import sys

from sdp_jax.study import mapl, sdp
from sdp_jax.train import cli

SUBCOMMANDS = ("sdp", "mapl")


def main(argv=None, check_only: bool = False) -> list[dict]:
    """Dispatch ``argv`` (without the program name; default ``sys.argv[1:]``) to a study.

    Returns the study's rows. A subcommand written after a flag, or not in lowercase, exits
    with status 2 and a one-line error (``--out sdp`` is a flag's value, not a subcommand).
    ``check_only``: stop after the validation (the documentation check, ``tests/test_docs.py``).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["sdp"]:
        return sdp.main(args[1:], check_only=check_only)
    if args[:1] == ["mapl"]:
        args = args[1:]
    elif any(a.lower() in SUBCOMMANDS and not (i and args[i - 1].startswith("--")
                                               and "=" not in args[i - 1])
             for i, a in enumerate(args)):
        cli.error(mapl.PROG, "the subcommand comes first, before any flag: python -m "
                  "sdp_jax.study sdp --out ... (or mapl); lowercase")
    return mapl.main(args, check_only=check_only)


if __name__ == "__main__":
    main()
