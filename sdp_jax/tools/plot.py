"""Training curves of finished (or stopped) runs: validation loss against steps, tokens (images)
and training FLOPs, the FLOP-matched view of the SDP paper (Singh et al., Sec. 5).

    python -m sdp_jax.tools.plot runs/default runs/ddp --out runs/compare

reads each run directory's ``metrics.jsonl`` and ``summary.json`` (written by
:func:`sdp_jax.train.loop.train`) and writes ``curves.png`` into ``--out`` (default: the first run's
directory). Every finished run writes its own ``curves.png`` this way.
"""

from __future__ import annotations

import sys

from sdp_jax.train import cli
from sdp_jax.train.curves import curves

PROG = "python -m sdp_jax.tools.plot"
def main(argv=None, check_only: bool = False) -> str | None:
    """The command line: run directories, then ``--out DIR``. Errors are one line (status
    2). ``check_only``: stop after parsing (the documentation check, ``tests/test_docs.py``).
    Returns the PNG's path."""
    from absl import flags  # pylint: disable=g-import-not-at-top

    argv = [PROG] + (sys.argv[1:] if argv is None else list(argv))
    fv = flags.FlagValues()
    flags.DEFINE_string("out", None, "folder for curves.png (default: the first run's)",
                        flag_values=fv)
    if cli.asks_help(argv):
        cli.exit_with_help(fv, __doc__)
    try:
        dirs = fv(argv)[1:]
    except flags.Error as e:
        cli.error(PROG, f"{e}; see {PROG} --help")
    if not dirs:
        cli.error(PROG, "give one or more run directories, e.g. "
                        f"{PROG} runs/default runs/ddp --out runs/compare")
    if check_only:
        return None
    try:
        path = curves(dirs, fv.out)
    except (ValueError, OSError) as e:
        cli.error(PROG, str(e))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
