"""The one way the command lines load a run config: ``python train.py``, ``python -m
sdp_jax.bench`` and ``python -m sdp_jax.study``.

Each tool defines its flags on its own ``absl.flags.FlagValues`` (:func:`flag_values`): a
``--config`` file with ``get_config()`` (``ml_collections.config_flags``; any field overridden
as ``--config.FIELD=VALUE``, e.g. ``--config.sdp.coverage=0.5``) and the tool's own flags.
:func:`parse` turns every mistake into a one-line error before any compute.

Example::

    argv = ["prog", "--config.steps=20"]
    fv = cli.flag_values("configs/llama_tiny.py", argv)
    flags.DEFINE_integer("seeds", 1, "how many seeds", flag_values=fv)
    cli.parse(fv, argv, "python -m my_tool")
    config = fv.config
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

from absl import flags
from ml_collections import config_flags

from sdp_jax.train.launch import peers

# The repository's configs/ folder (the commands' default config files live there).
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "configs")


def config_file(name: str) -> str:
    """The path of ``configs/NAME`` in the checkout this package runs from."""
    return os.path.join(CONFIGS, name)


def flag_values(default_config: str, argv: list[str] | None = None, prog: str = "", *,
                into: flags.FlagValues | None = None, name: str = "config",
                help_text: str = "Run config (a get_config() file); override any field as "
                "--config.FIELD=VALUE.") -> flags.FlagValues:
    """``into`` (default: a new ``FlagValues``) with ``--config`` (a ``get_config()`` file,
    locked: an override of a field that does not exist is an error) defined; its overrides
    are read from ``argv`` (the command line :func:`parse` will get; default ``sys.argv``).
    Without ``--config`` in ``argv`` the default file is loaded and overridden here, so a
    mistake exits as in :func:`parse` (one line naming ``prog``, status 2)."""
    fv = flags.FlagValues() if into is None else into
    try:
        config_flags.DEFINE_config_file(name, default_config, help_text, flag_values=fv,
                                        lock_config=True, sys_argv=argv)
    except Exception as e:  # noqa: BLE001 (ml_collections' errors, as in parse)
        _config_error(prog or os.path.basename(sys.argv[0]), e)
    return fv


_AT_SIGNAL_EXIT: list = []   # what an exit on a signal does first (:func:`at_signal_exit`)


def at_signal_exit(cleanup) -> None:
    """Have :func:`exit_on_signal` call ``cleanup()`` before the process ends (e.g. remove a
    workdir that holds nothing yet); ``at_signal_exit(None)`` forgets it. One at a time."""
    _AT_SIGNAL_EXIT[:] = [] if cleanup is None else [cleanup]


def exit_on_signal(signum: int, what: str = "stopped (checkpoints already written are "
                   "kept: rerun the same command to resume)", after_bar: bool = False) -> NoReturn:
    """End the program now: one line on stderr, status ``128 + signum`` (130 for SIGINT, 143
    for SIGTERM). Safe inside a signal handler: the line goes out by ``os.write`` (a ``print``
    landing inside another write to the same stream raises ``RuntimeError: reentrant call``),
    and ``os._exit`` skips the interpreter's teardown, whose running XLA, grain and orbax
    threads made a Ctrl-C during compilation end in a segmentation fault. ``after_bar``: start
    on a new line (a progress bar is on the current one).

    A handler runs when the main thread is back in Python: during a long native call (a
    compilation, ``jax.distributed.initialize``) the exit waits for it to return. With several
    processes the others are told first (:func:`sdp_jax.train.launch.peers.leaving`): they end with
    one line and the same status (process 0 waits up to 5 s for them to end first). Then the
    cleanup of :func:`at_signal_exit`, if any, runs (its errors are ignored)."""
    line = ("\n" if after_bar else "") + (f"interrupted by {signal.Signals(signum).name}: "
                                          f"{what}\n")
    try:
        os.write(2, line.encode())
        peers.leaving(128 + int(signum))
        for cleanup in list(_AT_SIGNAL_EXIT):
            try:
                cleanup()
            except Exception:  # noqa: BLE001 (the exit goes on whatever the cleanup met)
                pass
    finally:
        os._exit(128 + int(signum))


def handle_signals(handler) -> dict:
    """Install ``handler`` for SIGINT and SIGTERM, except a signal the process was started
    ignoring (a background job's SIGINT, ``nohup``); returns the previous handlers."""
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, handler)
    return old


def exit_on_signals() -> dict:
    """From now on SIGINT and SIGTERM end the program with one line and status 128 + signal
    (:func:`exit_on_signal`), never a traceback; ``train.py`` calls it first thing. The
    training loop installs its own handlers while it runs (stop after the step and save).
    Returns the previous handlers."""
    return handle_signals(lambda signum, frame: exit_on_signal(signum))


def asks_help(argv: list[str]) -> bool:
    """Whether a command line (``argv[0]`` the program) asks for help: ``--help``, ``-h`` or
    ``--helpfull``."""
    return any(a in ("--help", "-h", "--helpfull") for a in argv[1:])


def exit_with_help(fv: flags.FlagValues, doc: str = "", note: str = "") -> NoReturn:
    """Print ``doc``, every flag of ``fv`` with its help and default (absl's listing, by
    module) and ``note``, then exit 0: the ``--help`` of every command line."""
    print((doc.strip() + "\n\n" if doc else "") + fv.get_help()
          + (f"\n\n{note}" if note else ""))
    sys.exit(0)


def error(prog: str, message: str) -> NoReturn:
    """Print ``prog: error: message`` to stderr and exit with status 2 (a usage error)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def seeds(prog: str, values: list[str]) -> list[int]:
    """The integers of a ``--seeds`` list flag (``DEFINE_list``: ``["0", "1", "2"]``).

    Raises:
      SystemExit: (2, one line on stderr naming the bad value) for a non-integer, a repeated
        seed, an empty list or a seed outside [0, 2**31) (what ``jax.random.key`` and numpy's
        generators take), before anything trains.
    """
    try:
        out = [int(x) for x in values if x]
    except ValueError:
        error(prog, f"--seeds={','.join(values)!r} must be integers like 0,1,2")
    if not out or len(set(out)) != len(out) or min(out) < 0 or max(out) >= 2**31:
        error(prog, f"--seeds={','.join(values)!r}: give distinct non-negative seeds below "
              "2**31, e.g. 0,1,2")
    return out


def _config_path(argv, name: str = "config") -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def parse(fv: flags.FlagValues, argv: list[str], prog: str, doc: str = "",
          renamed: dict[str, str] | None = None) -> list[str]:
    """Parse ``argv`` (``argv[0]`` is the program) into ``fv``.

    ``--help`` (or ``-h``) prints ``doc`` and the flags and exits 0. Errors are one line on
    stderr and exit status 2: a config file that does not exist, an unknown config field, a
    value of the wrong type, an unknown flag (``renamed`` maps an old flag name to a hint of
    its new form).

    Returns:
      the arguments that are not flags (``argv[0]`` first).
    """
    if asks_help(argv):
        exit_with_help(fv, doc)
    names = sorted({n for n in fv if isinstance(   # --config and its kin (study_sdp)
        fv[n].parser, config_flags.config_flags.ConfigFileFlagParser)})
    for name in names:
        path = _config_path(argv, name)
        if path is not None and not os.path.isfile(path.split(":", 1)[0]):
            error(prog, f"config file {path!r} (--{name}) does not exist; see configs/ for the "
                  "provided ones.")
    try:
        rest = fv(argv)
        for name in names:
            _check_config(fv[name].value, fv[name].config_filename, prog)
        return rest
    except flags.UnrecognizedFlagError as e:
        hint = (renamed or {}).get(e.flagname)
        error(prog, f"unknown flag --{e.flagname}"
              + (f": it is now {hint}" if hint else f"; see {prog} --help"))
    except Exception as e:  # noqa: BLE001 (ml_collections raises KeyError/AttributeError/...)
        _config_error(prog, e)


# Fields every run config has (sdp_jax.train.config.base_config and vision_config).
# What tells a run config from another ConfigDict; sdp_jax.train.run.resolve names any other
# missing field.
REQUIRED = ("model", "data", "sdp", "num_cpu_devices")   # (read before the validation)


def _check_config(config, path: str, prog: str) -> None:
    missing = ([] if not hasattr(config, "keys") else
               [k for k in REQUIRED if k not in config])
    if not hasattr(config, "keys") or missing:
        error(prog, f"config file {path!r}: get_config() must return a run config (a "
              "ConfigDict from sdp_jax.train.config.base_config() or vision_config())"
              + (f"; it lacks {', '.join(missing)}" if missing else
                 f", not {type(config).__name__}"))


def _config_error(prog: str, e: Exception) -> NoReturn:
    """One line for an error of loading or overriding a config."""
    key_error = e if isinstance(e, KeyError) else e.__cause__ or e.__context__
    if isinstance(key_error, KeyError):
        error(prog, f"unknown config field {' '.join(str(key_error.args[0]).split())}; see "
              f"{prog} --help")
    msg = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    cause = e.__cause__ or e.__context__
    while cause is not None:   # the first cause that says more, e.g. the field a file set wrongly
        line = (str(cause).strip().splitlines() or [""])[0].strip()
        if line and line not in msg and not line.startswith("Traceback"):
            msg = msg.rstrip(": ") + ": " + line
            break
        cause = cause.__cause__ or cause.__context__
    if msg.startswith("flag --"):   # absl could not parse a value
        msg += " (give a value of the field's type, e.g. True/False, 8, 0.5, bf16, \"(1,2)\")"
    error(prog, msg)


def command_flags(define, argv: list[str], prog: str, doc: str, example: str,
                  renamed: dict[str, str] | None = None):
    """The flags of a command line (the bench's and the studies'): ``define(argv)`` defines
    them (returns a ``FlagValues``), :func:`parse` reads ``argv`` (the program name first)
    into them.

    Returns:
      the parsed ``FlagValues``.
    Raises:
      SystemExit: (2, one line on stderr naming ``prog``) for a bad flag (see :func:`parse`;
        ``renamed``: old flag names with hints of their new form) or an argument that is not a
        flag (the message shows ``example``, e.g. ``--variants=ddp,b-sdp``).
    """
    fv = define(argv)
    rest = parse(fv, argv, prog, doc, renamed)
    if len(rest) > 1:
        error(prog, f"unexpected arguments {rest[1:]}; flags look like {example}")
    return fv
