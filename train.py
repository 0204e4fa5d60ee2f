"""Train a LLaMA-style language model or a vision model (ResNet-18, WRN-18, Swin-T) with DDP or SDP.

    python train.py                                   # default: configs/llama_small.py, ./runs/default
    python train.py --config configs/resnet18_digits.py --workdir runs/digits   # vision default
    python train.py --config configs/llama_tiny.py --workdir /tmp/run --config.steps=20
    python train.py --config.sdp.variant=b-sdp --config.sdp.coverage=0.5

Rerunning the same command with the same --workdir resumes from the latest checkpoint.
Several processes (TPU pod slice, multi-GPU hosts): see README.md, "Multi-host".
"""

import os
import signal
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # run from a checkout without installing

config_flags.DEFINE_config_file(
    "config", os.path.join(_HERE, "configs", "llama_small.py"), "Run config (a get_config() file).",
    lock_config=True)
flags.DEFINE_string("workdir", os.path.join("runs", "default"),
                    "Directory for checkpoints, metrics.jsonl and summary.json.")
flags.DEFINE_enum("distributed", "auto", ["auto", "true", "false"],
                  "Call jax.distributed.initialize(): auto = when launched as several processes "
                  "(JAX_COORDINATOR_ADDRESS, SLURM or Open MPI with >1 task, or a TPU pod slice).")


def _multi_process_env() -> bool:
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return True
    for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(env.get(key, "1") or 1) > 1:
            return True
    return "," in env.get("TPU_WORKER_HOSTNAMES", "")


def _config_path(argv):
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _parse_flags(argv):
    """absl flag parsing with one-line errors (unknown config keys, missing config files)."""
    path = _config_path(argv)
    if path is not None and not os.path.isfile(path.split(":", 1)[0]):
        print(f"error: config file {path!r} does not exist; see configs/ for the provided ones.",
              file=sys.stderr)
        sys.exit(2)
    try:
        return flags.FLAGS(argv)
    except Exception as e:  # ml_collections raises KeyError/AttributeError/ValueError here
        key_error = e if isinstance(e, KeyError) else e.__cause__ or e.__context__
        if isinstance(key_error, KeyError):
            msg = f"unknown config field {key_error.args[0]}"
        else:
            msg = str(e)
        print(f"error: {msg}\nsee: python train.py --helpfull", file=sys.stderr)
        sys.exit(2)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; use --config.FIELD=VALUE.")
    logging.set_verbosity(logging.WARNING)  # orbax and grain log every save at INFO
    import jax

    config = flags.FLAGS.config
    mode = flags.FLAGS.distributed
    if mode == "true" or (mode == "auto" and _multi_process_env()):
        env = os.environ
        kwargs = {}
        if env.get("JAX_COORDINATOR_ADDRESS"):
            kwargs = dict(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                          num_processes=int(env["JAX_NUM_PROCESSES"]),
                          process_id=int(env["JAX_PROCESS_ID"]))
        jax.distributed.initialize(**kwargs)
    n_cpu = config.num_cpu_devices
    if isinstance(n_cpu, bool) or not isinstance(n_cpu, int) or n_cpu < 1:
        print(f"error: config.num_cpu_devices={n_cpu!r} must be a positive integer.",
              file=sys.stderr)
        sys.exit(2)
    # Simulated devices when the machine has only a CPU; ignored on GPU and TPU backends.
    jax.config.update("jax_num_cpu_devices", n_cpu)

    from sdp_jax import vision_trainer
    if vision_trainer.is_vision(config):
        train = vision_trainer.train
    else:
        from sdp_jax.trainer import train
    try:
        summary = train(config, flags.FLAGS.workdir)
    except (ValueError, FloatingPointError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if summary["interrupted_by"]:  # resumable, but not finished: tell the scheduler
        sys.exit(128 + int(getattr(signal, summary["interrupted_by"])))


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
