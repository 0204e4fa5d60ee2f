"""Export a trained language-model run's full model as safetensors, with its config beside it.

    python -m sdp_jax.tools.export --workdir runs/default --out runs/default/export
    python -m sdp_jax.tools.evaluate --export runs/default/export       # loaded back and evaluated
    python -m sdp_jax.tools.export --workdir runs/default --format hf --out runs/default/hf

``--format sdp_jax`` (default) writes ``OUT/model.safetensors`` (flat keys such as
``blocks.attn.wq``; the block leaves stacked ``[L, ...]``; float32; every component as the
workers that hold it keep it) and ``OUT/config.json`` (the run's). ``--format hf`` writes a
Hugging Face ``transformers`` LLaMA folder (``LlamaForCausalLM.from_pretrained(OUT)`` loads it;
its config, parameter names and layouts; the run's tokenizer files when it had a Hugging Face
tokenizer; :func:`sdp_jax.tools.trained.export_hf`), from which a run can also start
(``--config.init_from=OUT``). An existing export is never overwritten.
"""

from __future__ import annotations

from sdp_jax.tools import trained as trained_lib
from sdp_jax.train import cli

PROG = "python -m sdp_jax.tools.export"


def define(fv) -> None:
    """This tool's own flags on ``fv`` (besides --workdir and the config's)."""
    from absl import flags  # pylint: disable=g-import-not-at-top
    flags.DEFINE_integer("step", 0, "the checkpoint's step (0 = the latest)",
                         flag_values=fv)
    flags.DEFINE_string("out", None, "the export's folder", flag_values=fv)
    flags.DEFINE_enum("format", "sdp_jax", ["sdp_jax", "hf"], "sdp_jax: this package's "
                      "layout; hf: a Hugging Face transformers LLaMA folder", flag_values=fv)


def main(argv=None) -> str:
    """The command line; returns the written file's path."""
    fv, config = trained_lib.command(PROG, __doc__, argv, define)
    if not fv.out:
        cli.error(PROG, "give --out=DIR, the export's folder")
    try:
        trained_lib.language_model(config, "export")
        trained_lib.export_target(fv.out)   # refused before the checkpoint is read
        write = trained_lib.export_hf if fv.format == "hf" else trained_lib.export
        path = write(trained_lib.load(fv.workdir, config, fv.step), fv.out)
    except ValueError as e:
        cli.error(PROG, str(e))
    print(f"wrote {path} and its config.json"
          + (" (a Hugging Face LlamaForCausalLM folder)" if fv.format == "hf" else ""))
    return path


if __name__ == "__main__":
    main()
