"""Downstream evaluation through lm-evaluation-harness (``pip install -e '.[eval]'``).

:class:`SDPJaxLM` serves a trained language-model run (its latest checkpoint, or
an export of :mod:`sdp_jax.tools.export`) to the harness as the model ``sdp_jax``: ``loglikelihood``
(multiple-choice tasks: the paper's ARC-Easy, BoolQ, HellaSwag, OpenBookQA, SciQ),
``loglikelihood_rolling`` (perplexity tasks) and greedy ``generate_until``. This module runs
the harness's own command line with that model registered:

    python -m sdp_jax.tools.harness --model sdp_jax --model_args workdir=runs/default \\
        --tasks arc_easy,boolq,hellaswag,openbookqa,sciq --batch_size 16

(the harness downloads the tasks' datasets, or reads them from its cache; any of its flags
apply). ``--help`` prints this project's model arguments (:data:`MODEL_ARGS`) and how to run a
task, a local one included (a task YAML in a folder given to ``--include_path``;
``examples/lm_eval_task``); ``run --help`` prints the harness's own flags. From Python:
``lm_eval.simple_evaluate(model=SDPJaxLM(workdir=...), tasks=[...])``. Text is encoded by the
run's tokenizer (:func:`sdp_jax.tools.trained.tokenizer`: UTF-8 bytes, or the Hugging Face
tokenizer of ``data.tokenizer``); a run on llm.c token shards without ``data.tokenizer`` has
none and is refused.
"""

from __future__ import annotations

import inspect
import os
import sys

import numpy as np

from sdp_jax import mesh as mesh_lib
from sdp_jax.tools import trained
from sdp_jax.train.families import LanguageModel

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:   # the optional extra is missing: the class below says so when built
    LM = object

    def register_model(*_):
        return lambda cls: cls

MODEL_NAME = "sdp_jax"
PROG = "python -m sdp_jax.tools.harness"
# The model's arguments (``--model_args key=value,...``): SDPJaxLM's parameters.
MODEL_ARGS = {
    "workdir": "a training run's folder (train.py --workdir): its latest checkpoint",
    "export": "instead of workdir, a folder python -m sdp_jax.tools.export wrote",
    "step": "with workdir, the checkpoint of this step (one the run keeps; 0 = the latest)",
    "batch_size": "sequences per forward pass (the harness's --batch_size sets it)",
}
_EXAMPLE = f"{PROG} --model {MODEL_NAME} --model_args workdir=runs/default"


@register_model(MODEL_NAME)
class SDPJaxLM(LM):
    """A trained sdp_jax run as an lm-evaluation-harness model (one device, full model).

    Args:
      workdir: a training run's folder (its latest checkpoint, or ``step``).
      export: instead, a folder :mod:`sdp_jax.tools.export` wrote.
      step: the checkpoint's step (0: the latest).
      batch_size: sequences per forward pass (each padded to the run's ``seq_len``).

    Raises:
      ImportError: lm-eval is not installed (with the install command).
      ValueError: neither or both of ``workdir`` / ``export``; a run that is not a language
        model, or has no tokenizer (llm.c shards without ``data.tokenizer``).
    """

    def __init__(self, workdir: str | None = None, export: str | None = None, step: int = 0,
                 batch_size: int | str = 8, **_):
        if LM is object:
            raise ImportError("the lm-eval adapter needs lm-evaluation-harness: "
                              "pip install -e '.[eval]'")
        super().__init__()
        import jax  # pylint: disable=g-import-not-at-top
        import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
        from flax import nnx  # pylint: disable=g-import-not-at-top

        if (workdir is None) == (export is None):
            raise ValueError("give model_args workdir=RUN_DIR or export=EXPORT_DIR (one).")
        if export is not None:
            config, params = trained.read_export(export)
        else:
            config = trained.read_config(workdir)
            mesh_lib.simulate_cpu_devices(config.num_cpu_devices)   # restoring needs the run's W devices
            params = trained.load(workdir, config, int(step)).full_params()
        cfg = trained.language_model(config, "the lm-eval adapter")
        self.tok = trained.tokenizer(config)
        if self.tok is None:
            raise ValueError("this run trained on llm.c token shards without data.tokenizer, so "
                             "the harness's text cannot be encoded; name the tokenizer that "
                             "wrote them in the run's config.json (data.tokenizer).")
        self.cfg, self.config = cfg, config
        self.window = trained.context(config)
        self.batch = max(1, int(batch_size) if str(batch_size).isdigit() else 8)
        self.params = jax.tree.map(jnp.asarray, params)
        graphdef = LanguageModel(cfg).graphdef

        @jax.jit
        def logprobs(params, tokens):
            logits = nnx.merge(graphdef, params)(tokens).astype(jnp.float32)
            return jax.nn.log_softmax(logits, axis=-1)
        self._logprobs = logprobs

    # ------------------------------------------------------------------ tokens
    def encode(self, text: str) -> list[int]:
        """The run's tokens of ``text`` (:func:`sdp_jax.tools.trained.tokenizer`: UTF-8 bytes,
        or the run's Hugging Face tokenizer)."""
        return self.tok.encode(text)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """``(context ids, continuation ids)`` as training tokenized ``context + continuation``:
        the whole string is encoded and cut after the context's ids, with the context's
        trailing spaces moved to the continuation (as lm-eval's own models do), so a
        subword tokenizer's merges across the boundary are the text's. An empty context is the
        end-of-text token (the document separator of training). For bytes the plain
        concatenation."""
        n = len(context) - len(context.rstrip(" "))
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = self.encode(context)
        whole = self.encode(context + continuation)
        return (ctx or [self.tok.eot_id]), whole[len(ctx):]

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context) in nats, whether every continuation token
        is the most likely one)`` per ``(context ids, continuation ids)``; the input is cut
        to its last ``seq_len`` tokens (the continuation's tail if it alone is longer)."""
        out = []
        for start in range(0, len(pairs), self.batch):
            chunk = pairs[start:start + self.batch]
            buf = np.zeros((self.batch, self.window), np.int32)
            spans = []
            for row, (ctx, cont) in enumerate(chunk):
                seq = (ctx + cont)[-(self.window + 1):]
                n = min(len(cont), len(seq) - 1)
                buf[row, :len(seq) - 1] = seq[:-1]
                spans.append((len(seq) - 1 - n, len(seq) - 1, seq[len(seq) - n:]))
            lp = np.asarray(self._logprobs(self.params, buf))
            for row, (a, b, target) in enumerate(spans):
                rows = lp[row, a:b]
                picked = rows[np.arange(len(target)), target]
                out.append((float(picked.sum()), bool(np.all(rows.argmax(-1) == target))))
        return out

    # ------------------------------------------------------------------ lm-eval's API
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """lm-eval: ``(context, continuation)`` requests -> ``(log-likelihood, is greedy)``.
        An empty context conditions on the end-of-text token (the document separator of
        training: a newline for byte-level runs)."""
        pairs = [self.encode_pair(ctx, cont) for ctx, cont in (r.args for r in requests)]
        return self.score(pairs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        """lm-eval: the log-likelihood of each whole string: disjoint windows of ``seq_len``
        predicted tokens, each conditioned on what fits before it in the model's ``seq_len``
        positions (the first on the end-of-text token, the document separator of training)."""
        out = []
        for (text,) in (r.args for r in requests):
            ids = self.encode(text)
            pairs = [(([self.tok.eot_id] + ids)[max(0, s - self.window + 1):s + 1],
                      ids[s:s + self.window])
                     for s in range(0, len(ids), self.window)]
            out.append(sum(ll for ll, _ in self.score(pairs)))
        return out

    def generate_until(self, requests) -> list[str]:
        """lm-eval: greedy continuation of each context, up to ``max_gen_toks`` (default 64)
        tokens, cut at the first of the ``until`` strings (decoded with a key/value cache by
        :func:`sdp_jax.tools.trained.sample`, as ``python -m sdp_jax.tools.generate``)."""
        out = []
        for ctx, kw in (r.args for r in requests):
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = trained.sample(self.config, self.params, self.encode(ctx) or [self.tok.eot_id],
                                 int(kw.get("max_gen_toks", 64)), temperature=0)
            text = self.tok.decode(ids)
            cut = min([text.find(u) for u in until if u and u in text] or [len(text)])
            out.append(text[:cut])
        return out


def _default(arg: str) -> str:
    """`` (default: X)`` of a model argument (:class:`SDPJaxLM`'s parameter), or ``""`` when it
    has none (``None``)."""
    value = inspect.signature(SDPJaxLM.__init__).parameters[arg].default
    return "" if value is None else f" (default: {value})"


HELP = "\n".join([
    (f"usage: {PROG} --model {MODEL_NAME} --model_args workdir=RUN[,step=N] "
     "--tasks TASK[,TASK...] [lm-eval flags]"),
    "",
    "Runs lm-evaluation-harness (lm_eval; pip install -e '.[eval]') on a trained sdp_jax",
    "language model (its text encoded by the run's tokenizer: bytes, or data.tokenizer's;",
    "the full model on one device), registered as the",
    f"harness's model '{MODEL_NAME}'.",
    "",
    "model arguments (--model_args key=value,key=value):",
    *(f"  {k:<12}{v}{_default(k)}" for k, v in MODEL_ARGS.items()),
    "",
    "tasks:",
    "  --tasks arc_easy,boolq        the harness's tasks (it downloads their datasets, or reads",
    "                                its cache)",
    "  --tasks NAME --include_path DIR",
    "                                a local task: DIR holds a YAML with 'task: NAME' (its data",
    "                                may be a local JSON file); examples/lm_eval_task/ is one",
    "                                (its data path is relative: run it from the repository's",
    "                                root; docs/using.md)",
    f"  {PROG} ls tasks",
    "                                the tasks the harness knows",
    "",
    "examples:",
    f"  {_EXAMPLE} --tasks arc_easy,boolq --batch_size 16",
    f"  {_EXAMPLE},step=500 --include_path examples/lm_eval_task --tasks sdp_jax_python_choice",
    "",
    "The harness's own flags (--limit, --num_fewshot, --output_path, --log_samples, ...):",
    f"  {PROG} run --help",
])


def model_args(argv: list[str]) -> dict[str, str]:
    """The ``--model_args`` of a harness command line (``key=value,key=value`` or several
    ``key=value`` words, as lm-eval takes them) as a dict."""
    out, taking = {}, False
    for arg in argv:
        if arg.startswith("-"):
            flag, eq, value = arg.partition("=")
            taking = flag in ("--model_args", "-a")
            if not (taking and eq):
                continue
            arg = value
        elif not taking:
            continue
        for pair in filter(None, arg.split(",")):
            key, _, value = pair.partition("=")
            out[key.strip()] = value
    return out


def check_model_args(argv: list[str]) -> None:
    """Refuse, before the harness loads anything, ``--model_args`` keys the model ``sdp_jax``
    does not take (lm-eval would pass them on and the model ignore them).

    Raises:
      ValueError: one line naming the key and the arguments the model takes."""
    if MODEL_NAME not in argv and f"--model={MODEL_NAME}" not in argv:
        return   # another model's arguments are lm-eval's business
    unknown = sorted(set(model_args(argv)) - set(MODEL_ARGS))
    if unknown:
        raise ValueError(f"unknown model argument(s) {', '.join(unknown)} in --model_args; the "
                         f"model {MODEL_NAME} takes {', '.join(MODEL_ARGS)} (see {PROG} --help)")


def check_model_folders(argv: list[str]) -> None:
    """Refuse, before the harness loads anything, a ``workdir`` that holds no run's config.json
    or an ``export`` that holds no export (the model would fail inside lm-eval, with a
    traceback).

    Raises:
      ValueError: one line naming the argument and what it must name."""
    given = model_args(argv) if MODEL_NAME in argv or f"--model={MODEL_NAME}" in argv else {}
    for key, name in (("workdir", "config.json"), ("export", trained.EXPORT_FILE)):
        if key in given and not os.path.isfile(os.path.join(given[key], name)):
            raise ValueError(f"--model_args {key}={given[key]}: no {name} there; give "
                             + ("a training run's folder (train.py --workdir)" if key == "workdir"
                                else "a folder python -m sdp_jax.tools.export wrote"))


def main(argv=None) -> None:
    """The harness's own command line (``lm_eval``), with the model ``sdp_jax`` registered.
    No arguments, ``-h`` or ``--help`` (without a subcommand) print :data:`HELP`: this
    project's model arguments and how to run a task."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or (args[0] not in ("run", "ls", "validate")
                    and any(a in ("-h", "--help") for a in args)):
        print(HELP)
        return
    if LM is object:
        print(f"{PROG}: error: lm-evaluation-harness is not installed: "
              "pip install -e '.[eval]'", file=sys.stderr)
        sys.exit(2)
    try:
        check_model_args(args)
        check_model_folders(args)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    from lm_eval.__main__ import cli_evaluate  # pylint: disable=g-import-not-at-top
    sys.argv = ["lm_eval"] + args
    cli_evaluate()


if __name__ == "__main__":
    main()
