"""Train a LLaMA-style language model or a vision model (ResNet-18, WRN-18, Swin-T) with DDP or SDP.

    python train.py                                   # default: configs/llama_small.py, ./runs/default
    python train.py --config configs/resnet18_digits.py --workdir runs/digits   # vision default
    python train.py --config configs/llama_tiny.py --workdir /tmp/run --config.steps=20
    python train.py --config.sdp.variant=b-sdp --config.sdp.coverage=0.5
    python train.py --config.sdp.variant=b-sdp --config.sdp.coverage=auto \
        --config.sdp.memory_budget_gib=40   # the largest C whose compiled step fits
    python train.py --config configs/llama_tiny.py --print_config   # the config, not a run

Rerunning the same command with the same --workdir resumes from the latest checkpoint.
Several processes (TPU pod slice, multi-GPU hosts): see README.md, "Multi-host".
"""

import os
import signal
import sys
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # run from a checkout without installing

# light: the standard library only
from sdp_jax.train.launch import launcher as launch  # noqa: E402
from sdp_jax.train.launch import peers  # noqa: E402


def _leave(signum: int) -> None:
    """A held signal's end: :func:`sdp_jax.train.cli.exit_on_signal` (tells the others)."""
    from sdp_jax.train import cli  # pylint: disable=g-import-not-at-top  (it may be importing)
    cli.exit_on_signal(signum)


# Several processes: a signal that comes before their watch has started is held until it has,
# then this process leaves through it and the others end too
# (sdp_jax.train.launch.peers.hold_signals).
if __name__ == "__main__" and launch.multi_process_env():   # (not when imported: tests)
    peers.hold_signals(_leave)

from sdp_jax.train import cli  # noqa: E402  (light: absl and ml_collections)

cli.exit_on_signals()   # a signal from here on: one line and 128 + signal, never a traceback

from absl import app, flags, logging  # noqa: E402

import jax  # noqa: E402  (the heavy imports after the signal handlers)

from sdp_jax import mesh as mesh_lib  # noqa: E402
from sdp_jax.train import checkpoint, fit, loop  # noqa: E402
from sdp_jax.train.run import resolve  # noqa: E402

PROG = "python train.py"
DEFAULT_CONFIG = os.path.join(_HERE, "configs", "llama_small.py")


def define_flags(fv: flags.FlagValues, argv=None) -> flags.FlagValues:
    """train.py's flags on ``fv``: ``--config`` (:func:`sdp_jax.train.cli.flag_values`; overrides
    read from ``argv``, default ``sys.argv``), ``--workdir``, ``--distributed``,
    ``--print_config``, ``--init_timeout``, ``--hang_timeout``, ``--hang_step_multiple``."""
    cli.flag_values(DEFAULT_CONFIG, argv, PROG, into=fv)
    flags.DEFINE_string("workdir", os.path.join("runs", "default"),
                        "Directory for checkpoints, config.json, metrics.jsonl, TensorBoard "
                        "events and summary.json.",
                        flag_values=fv)
    flags.DEFINE_enum("distributed", "auto", ["auto", "true", "false"],
                      "Call jax.distributed.initialize(): auto = when launched as several "
                      "processes (JAX_COORDINATOR_ADDRESS, SLURM or Open MPI with >1 task, or a "
                      "TPU pod slice).", flag_values=fv)
    flags.DEFINE_boolean("print_config", False,
                         "Print the run's config (the file with its --config.FIELD overrides) "
                         "as JSON, as a run writes it to WORKDIR/config.json, after checking "
                         "it, and exit without training.", flag_values=fv)
    flags.DEFINE_integer("init_timeout", 300,
                         "Seconds every process waits for the others to register with the "
                         "coordinator before giving up (with several processes).",
                         flag_values=fv)
    flags.DEFINE_integer("hang_timeout", 300,
                         "Seconds of silence after which the other processes take a process "
                         "as hung (stopped, frozen, its host gone) and end (status 75) while it "
                         "starts, restores, compiles, evaluates or saves; once steps run the "
                         "bound is --hang_step_multiple times its slowest recent step, at least "
                         "30 s (or this, when smaller). At least 5; 0: never (with several "
                         "processes).", flag_values=fv)
    flags.DEFINE_float("hang_step_multiple", 10.0,
                       "Once steps run, a process silent for this many times its slowest of "
                       "the last 20 steps is taken as hung (at least 2; see --hang_timeout).",
                       flag_values=fv)
    return fv


define_flags(flags.FLAGS)


def _parse_flags(argv):
    return cli.parse(flags.FLAGS, argv, PROG, __doc__)


def main(argv):
    if len(argv) > 1:
        cli.error(PROG, f"unexpected arguments {argv[1:]}; flags look like --config.FIELD=VALUE "
                  "or --workdir=DIR.")
    logging.set_verbosity(logging.WARNING)  # orbax and grain log every save at INFO
    config = flags.FLAGS.config
    n_cpu = config.num_cpu_devices
    if isinstance(n_cpu, bool) or not isinstance(n_cpu, int) or n_cpu < 1:
        cli.error(PROG, f"config.num_cpu_devices={n_cpu!r} must be a positive integer.")
    if flags.FLAGS.print_config:   # one process, no peers: checked against W devices
        peers.release_signals()   # (no watch to wait for)
        mesh_lib.simulate_cpu_devices(n_cpu)
        try:
            # (coverage=auto: checked, not picked; a run picks it by compiling)
            (fit.check if fit.is_auto(config) else resolve)(
                config, max(jax.device_count(), config.workers
                            * config.get("pipeline", {}).get("stages", 1)))
        except (ValueError, ImportError) as e:
            cli.error(PROG, str(e))
        print(config.to_json(indent=2))
        return
    try:
        launch.initialize(flags.FLAGS.distributed, flags.FLAGS.init_timeout,
                          hang_timeout=flags.FLAGS.hang_timeout,
                          hang_step_multiple=flags.FLAGS.hang_step_multiple)
    except ValueError as e:
        cli.error(PROG, str(e))
    # Simulated devices when the machine has only a CPU; ignored on GPU and TPU backends.
    mesh_lib.simulate_cpu_devices(n_cpu)

    try:
        summary = loop.train(config, flags.FLAGS.workdir)
    except (ValueError, FloatingPointError, ImportError) as e:
        cli.error(PROG, str(e))
    except checkpoint.ReadFailed as e:   # a peer ended during a read: the watch's line if so
        peers.follow_lost_peer()
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(peers.DEAD_PEER)
    if summary["interrupted_by"]:  # resumable, but not finished: tell the scheduler
        sys.exit(128 + int(getattr(signal, summary["interrupted_by"])))


if __name__ == "__main__":
    try:
        app.run(main, flags_parser=_parse_flags)
    except SystemExit as e:   # several processes, run unfinished: tell the others and end now
        peers.exit_now(e.code)
        raise
    except Exception:  # noqa: BLE001 (a traceback: printed, then the others told)
        if peers.watching():
            peers.follow_lost_peer()   # a collective failed as a peer died: its one line instead
            traceback.print_exc()
            peers.exit_now(1)
        raise
