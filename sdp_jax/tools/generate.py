"""Sample text from a trained language-model run's full model.

    python -m sdp_jax.tools.generate --workdir runs/default --prompt "def " --length 200
    python -m sdp_jax.tools.generate --workdir runs/default --prompt "import " --temperature 0.8 \\
        --top_k 40 --seed 1
    python -m sdp_jax.tools.generate --export runs/default/export --prompt "def "

``--prompt`` is text, encoded by the run's tokenizer (bytes, or the Hugging Face tokenizer of
``data.tokenizer``); runs on llm.c token shards without ``data.tokenizer`` take
``--prompt_ids 1,2,3`` and print token ids. The same seed, prompt and checkpoint
give the same sample. Tokens are decoded with a key/value cache
(:func:`sdp_jax.tools.trained.sample`); the time per token goes to stderr
(``N tokens in X s, Y ms/token``).
"""

from __future__ import annotations

import sys

from sdp_jax.tools import trained as trained_lib
from sdp_jax.train import cli

PROG = "python -m sdp_jax.tools.generate"


def define(fv) -> None:
    """This tool's own flags on ``fv`` (besides --workdir and the config's)."""
    from absl import flags  # pylint: disable=g-import-not-at-top
    flags.DEFINE_integer("step", 0, "the checkpoint's step (0 = the latest)",
                         flag_values=fv)
    flags.DEFINE_string("prompt", None, "the prompt's text (runs with a tokenizer)",
                        flag_values=fv)
    flags.DEFINE_list("prompt_ids", None, "the prompt's token ids (token-shard runs)",
                      flag_values=fv)
    flags.DEFINE_integer("length", 100, "new tokens to sample", flag_values=fv)
    flags.DEFINE_float("temperature", 1.0, "softmax temperature (0 = greedy)",
                       flag_values=fv)
    flags.DEFINE_integer("top_k", 0, "sample among the k likeliest tokens (0 = all)",
                         flag_values=fv)
    flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=fv)
    flags.DEFINE_string("export", None, "a folder python -m sdp_jax.tools.export wrote "
                        "(instead of --workdir)", flag_values=fv)


def main(argv=None) -> str | list[int]:
    """The command line; prints and returns the sample (text, or token ids)."""
    fv, config = trained_lib.command(PROG, __doc__, argv, define)
    try:
        trained_lib.language_model(config, "generate")
    except ValueError as e:
        cli.error(PROG, str(e))
    if (fv.prompt is None) == (fv.prompt_ids is None):
        cli.error(PROG, "give --prompt=TEXT or --prompt_ids=1,2,3")
    try:
        tok = trained_lib.tokenizer(config)
    except ValueError as e:
        cli.error(PROG, str(e))
    if fv.prompt is not None and tok is None:
        cli.error(PROG, "this run trained on llm.c token shards without data.tokenizer: give "
                        "--prompt_ids=1,2,3, or the tokenizer that wrote them with "
                        "--config.data.tokenizer=PATH")
    try:
        prompt = (tok.encode(fv.prompt) if fv.prompt is not None
                  else [int(t) for t in fv.prompt_ids])
    except ValueError:
        cli.error(PROG, f"--prompt_ids={','.join(fv.prompt_ids)!r} must be integers")
    try:
        trained_lib.sample(config, {}, prompt, fv.length, temperature=fv.temperature,
                           top_k=fv.top_k, seed=fv.seed, check_only=True)
        params = (trained_lib.read_export(fv.export)[1] if fv.export
                  else trained_lib.load(fv.workdir, config, fv.step).full_params())
        took: dict = {}
        ids = trained_lib.sample(config, params, prompt, fv.length,
                                 temperature=fv.temperature, top_k=fv.top_k, seed=fv.seed,
                                 timings=took)
    except ValueError as e:
        cli.error(PROG, str(e))
    out = tok.decode(prompt + ids) if fv.prompt is not None else ids
    print(out if isinstance(out, str) else ",".join(map(str, out)))
    sys.stdout.flush()
    print(f"{len(ids)} tokens in {took['decode_s']:.3f} s, "
          f"{1e3 * took['decode_s'] / len(ids):.2f} ms/token (KV cache, prompt prefill "
          f"included; compiled in {took['compile_s']:.1f} s)", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
