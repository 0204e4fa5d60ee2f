"""Evaluate a trained run's full model (the run's own evaluation, no training iterator).

    python -m sdp_jax.tools.evaluate --workdir runs/default                  # the latest checkpoint
    python -m sdp_jax.tools.evaluate --workdir runs/default --step 500       # a kept checkpoint
    python -m sdp_jax.tools.evaluate --export runs/default/export            # an export, loaded back
    python -m sdp_jax.tools.evaluate --workdir runs/mine --task my_model:MyTask  # a Task's run
    python -m sdp_jax.tools.evaluate --workdir runs/default --config.data.source=text \\
        --config.data.train_files='mytexts/*.txt'                      # other data

Prints one JSON object: the evaluation (language models ``val_loss`` nats/token and, for
byte-level data, ``val_bpb`` bits/byte; vision ``test_loss``, ``test_acc``), ``step`` and
``workdir`` or ``export``. ``--config.FIELD=VALUE`` overrides the run's config.json (its
evaluation data, ``eval_batches``...; the model and masks must stay the checkpoint's).
"""

from __future__ import annotations

import json

from sdp_jax.tools import trained as trained_lib
from sdp_jax.train import cli

PROG = "python -m sdp_jax.tools.evaluate"


def define(fv) -> None:
    """This tool's own flags on ``fv`` (besides --workdir and the config's)."""
    from absl import flags  # pylint: disable=g-import-not-at-top
    flags.DEFINE_integer("step", 0, "the checkpoint's step (0 = the latest)",
                         flag_values=fv)
    flags.DEFINE_string("export", None, "a folder python -m sdp_jax.tools.export wrote "
                        "(instead of --workdir)", flag_values=fv)
    flags.DEFINE_string("task", None, "module:Class of the run's sdp_jax.train.task.Task "
                        "(a run of your own model), e.g. my_model:MyTask", flag_values=fv)


def main(argv=None) -> dict:
    """The command line; returns the printed result."""
    fv, config = trained_lib.command(PROG, __doc__, argv, define)
    try:
        if fv.export:
            trained = trained_lib.from_export(fv.export, config)
        else:
            task = trained_lib.task_from(fv.task) if fv.task else None
            trained = trained_lib.load(fv.workdir, config, fv.step, task=task)
        out = trained_lib.evaluation(trained)
    except (ValueError, ImportError) as e:
        cli.error(PROG, str(e))
    out = {**out, "step": trained.step,
           **({"export": fv.export} if fv.export else {"workdir": fv.workdir})}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
