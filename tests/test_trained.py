"""Using a trained run (issue 15 item 4): evaluate, generate and export from its folder, without
the training iterator; an export loads back to the same validation loss."""

import glob
import inspect
import json
import os
import re
import shlex
import sys

import numpy as np
import pytest

# the harness's datasets library reads the test's local JSON only: never the network
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from sdp_jax.tools import evaluate, export, generate, harness, trained
from sdp_jax.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
import llama_tiny  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    c = llama_tiny.get_config()
    c.steps, c.eval_every, c.checkpoint_every = 4, 0, 2
    c.sdp.variant, c.sdp.coverage = "b-sdp", 0.5
    wd = str(tmp_path_factory.mktemp("trained") / "run")
    return wd, loop.train(c, wd)


def test_evaluate_reproduces_the_runs_final_loss(run, tmp_path, capsys):
    wd, summary = run
    out = evaluate.main(["--workdir", wd])
    assert out["step"] == 4
    np.testing.assert_allclose(out["val_loss"], summary["final_val_loss"], rtol=1e-6)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
    earlier = evaluate.main([f"--workdir={wd}", "--step=2"])   # a kept checkpoint
    assert earlier["step"] == 2 and earlier["val_loss"] > out["val_loss"]
    fewer = evaluate.main([f"--workdir={wd}", "--config.eval_batches=1"])   # an override
    assert fewer["val_loss"] != out["val_loss"]
    text = tmp_path / "other.txt"   # other evaluation data: not another trajectory
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 600)
    other = evaluate.main([f"--workdir={wd}", "--config.data.source=text",
                           f"--config.data.train_files={text}", f"--config.data.val_files={text}"])
    assert other["step"] == 4 and other["val_loss"] != out["val_loss"]
    for argv, fragment in ((["--workdir", wd, "--step=3"], "keeps the checkpoints of steps"),
                           (["--workdir", wd, "--export", wd], "give one of"),
                           (["--workdir", os.path.dirname(wd)], "config.json"),
                           (["--workdir", wd, "--config.model.d_model=64"],
                            "model.d_model: checkpoint has 32"),
                           ([], "give --workdir")):
        with pytest.raises(SystemExit) as e:
            evaluate.main(argv)
        assert e.value.code == 2 and fragment in capsys.readouterr().err


def test_evaluate_is_the_documented_recipe(run):
    """docs/data.md's recipe reproduces ``evaluate``: windows of ``seq_len + 1`` tokens of the
    validation split stepping by ``seq_len``, the first ``eval_batches * G`` in order, the mean
    next-token cross-entropy of the full model (a plain forward pass here) over them, and
    ``val_bpb = val_loss / ln 2`` for bytes."""
    import math

    import jax
    from flax import nnx

    from sdp_jax.train.data import tokens as data_lib
    from sdp_jax.train.families import LanguageModel
    wd, _ = run
    with open(os.path.join(ROOT, "docs", "data.md")) as f:
        doc = " ".join(f.read().split())
    for fact in ("Window `i` of a split of `n` tokens is tokens `i * seq_len` to `i * seq_len + "
                 "seq_len` (inclusive)", "over the first `eval_batches * G` validation windows",
                 "`val_bpb = val_loss / ln 2`"):
        assert fact in doc, fact
    t = trained.load(wd)
    want = trained.evaluation(t)
    c, G = t.config, t.run.global_batch
    tokens = np.asarray(data_lib.load_tokens(c.data, "val", c.model.vocab_size), np.int32)
    T = c.seq_len
    windows = np.stack([tokens[i * T:i * T + T + 1] for i in range(c.eval_batches * G)])
    model = nnx.merge(LanguageModel(trained.language_model(c, "test")).graphdef,
                      jax.tree.map(np.asarray, t.full_params()))
    logits = np.asarray(model(windows[:, :-1]), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    loss = -np.take_along_axis(logp, windows[:, 1:, None], -1).mean()
    np.testing.assert_allclose(want["val_loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(want["val_bpb"], loss / math.log(2), rtol=1e-5)


@pytest.mark.slow
def test_generate_is_deterministic_for_a_seed(run, capsys):
    wd, _ = run
    args = ["--workdir", wd, "--prompt", "def ", "--length", "12"]
    a = generate.main(args + ["--seed", "1"])
    assert a == generate.main(args + ["--seed", "1"])
    assert a.startswith("def ")
    c = trained.read_config(wd)
    params = trained.load(wd, c).full_params()
    ids = trained.sample(c, params, list(b"def "), 12, seed=1)
    assert len(ids) == 12 and all(0 <= t < 256 for t in ids)
    assert ids != trained.sample(c, params, list(b"def "), 12, seed=2)
    greedy = trained.sample(c, params, list(b"x"), 5, temperature=0)
    assert greedy == trained.sample(c, params, list(b"x"), 5, temperature=0, seed=9)
    assert trained.sample(c, params, list(b"x"), 5, top_k=1, seed=4) == greedy
    assert "12 tokens in " in capsys.readouterr().err   # the time per token
    assert greedy == full_recompute(c, params, list(b"x"), 5, temperature=0)
    capsys.readouterr()
    for bad in ("--temperature=-1", "--temperature=nan"):
        with pytest.raises(SystemExit):
            generate.main(["--workdir", wd, "--prompt", "x", bad])
        assert "temperature >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main(["--workdir", wd, "--config.nonexistent=1"])
    assert "unknown config field" in capsys.readouterr().err


def full_recompute(config, params, prompt, length, temperature=1.0, top_k=0, seed=0):
    """The sampling of before the key/value cache, the reference: for every new token a full
    forward pass over the last ``seq_len`` tokens (at positions 0.., zero-padded to
    ``seq_len``), token ``i`` drawn with ``fold_in(key(seed), i)``."""
    import jax
    from flax import nnx

    from sdp_jax.train.families import LanguageModel
    window, graphdef = trained.context(config), LanguageModel(
        trained.language_model(config, "test")).graphdef

    @jax.jit
    def next_token(params, buf, last, key):
        logits = nnx.merge(graphdef, params)(buf)[0, last]
        return trained.pick_token(logits, key, temperature, top_k)

    tokens, key = list(prompt), jax.random.key(seed)
    for i in range(length):
        ctx = tokens[-window:]
        buf = np.zeros((1, window), np.int32)
        buf[0, :len(ctx)] = ctx
        tokens.append(int(next_token(params, buf, len(ctx) - 1, jax.random.fold_in(key, i))))
    return tokens[len(prompt):]


def _random_model(attention="dot_product", window=16):
    """A tiny config (4 query heads, 2 key/value heads) with seq_len ``window`` and randomly
    initialised parameters, spread (init_std 0.3) so that the likeliest tokens are far apart."""
    import llama_tiny as tiny
    from sdp_jax.train.families import LanguageModel
    c = tiny.get_config()
    c.seq_len, c.model.init_std, c.model.attention = window, 0.3, attention
    cfg = trained.language_model(c, "test")
    return c, cfg, LanguageModel(cfg).init(3)


@pytest.mark.parametrize("attention", ["dot_product", "chunked"])
def test_cached_decoding_logits_equal_the_full_forward(attention):
    """Llama.decode: a 5-token prefill, a 2-token step and five 1-token steps into a cache
    of 12 positions give every position's logits of the full forward pass of the 12 tokens
    (float32, 1e-5; 3e-5 against chunked attention), for two sequences at once (grouped-query attention, K=2 < H=4); the
    cache's rows past the decoded position (noise here) are never seen."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sdp_jax.models import llama
    from sdp_jax.train.families import LanguageModel
    _, cfg, params = _random_model(attention)
    model = nnx.merge(LanguageModel(cfg).graphdef, params)
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, cfg.vocab_size)
    full = model(tokens)
    empty = llama.init_cache(cfg, 2, 12)
    assert empty.k.shape == (cfg.n_layers, 2, 12, cfg.n_kv_heads, cfg.head_dim)
    cache = llama.KVCache(*(jax.random.normal(jax.random.key(i), empty.k.shape)
                            for i in (1, 2)))
    step = jax.jit(model.decode)
    got, at = [], 0
    for n in (5, 2, 1, 1, 1, 1, 1):
        logits, cache = step(tokens[:, at:at + n], cache, jnp.int32(at))
        got.append(logits)
        at += n
    # (chunked attention's full forward is itself 1.7e-5 from dot_product's on these logits
    # of up to 6.3: the cache attends by XLA's dot-product attention)
    tol = {"dot_product": 1e-5, "chunked": 3e-5}[attention]
    np.testing.assert_allclose(np.concatenate(got, 1), full, atol=tol, rtol=0)
    assert float(jnp.max(jnp.abs(full[:, 1:] - full[:, :-1]))) > 0.1   # (not all alike)
    with pytest.raises(ValueError, match=r"need a cache of batch 1 and at least 13"):
        model.decode(jnp.zeros((1, 13), jnp.int32), llama.init_cache(cfg, 1, 12), 0)
    with pytest.raises(ValueError, match="size <= model.max_seq_len=64"):
        llama.init_cache(cfg, 1, 65)


@pytest.mark.slow
def test_cached_sampling_equals_full_recompute(run):
    """trained.sample (one compiled loop with a key/value cache) draws the tokens of the
    full forward pass per token (the sampling of before; same seed, temperature, top_k):
    greedy and sampled, a prompt that the new tokens push past the 16-token context (the
    window then slides, as before) and one longer than it; and on the trained run's model.
    The cached loop is no slower than the full recompute's."""
    import time

    c, _, params = _random_model()
    for prompt, length, temperature, top_k in (([1, 2, 3], 30, 0, 0),
                                               ([1, 2, 3], 30, 1.0, 0),
                                               (list(range(40, 60)), 8, 0.8, 5)):
        args = dict(temperature=temperature, top_k=top_k, seed=1)
        cached = trained.sample(c, params, prompt, length, **args)
        assert cached == full_recompute(c, params, prompt, length, **args), args
        assert len(set(cached)) > 3
    wd, _ = run
    config = trained.read_config(wd)
    params = trained.load(wd, config).full_params()
    took = {}
    ids = trained.sample(config, params, list(b"def "), 40, temperature=0, timings=took)
    assert ids == full_recompute(config, params, list(b"def "), 40, temperature=0)
    assert set(took) == {"compile_s", "decode_s"} and took["compile_s"] > 0
    again = {}
    trained.sample(config, params, list(b"import "), 40, temperature=0, timings=again)
    assert again["compile_s"] == 0.0   # one program for every prompt of the context
    t0 = time.perf_counter()
    full_recompute(config, params, list(b"import "), 40, temperature=0)
    assert again["decode_s"] < time.perf_counter() - t0


def test_export_loads_back_to_the_same_validation_loss(run, tmp_path, capsys):
    wd, summary = run
    out = str(tmp_path / "export")
    path = export.main(["--workdir", wd, "--out", out])
    assert os.path.isfile(path) and os.path.isfile(os.path.join(out, "config.json"))
    config, params = trained.read_export(out)
    full = trained.load(wd).full_params()
    for (k, x), y in zip(sorted(trained.flatten_export(full).items()),
                         [v for _, v in sorted(trained.flatten_export(params).items())]):
        np.testing.assert_array_equal(x, y, err_msg=k)
    back = evaluate.main(["--export", out])
    np.testing.assert_allclose(back["val_loss"], summary["final_val_loss"], rtol=1e-6)
    args = ["--prompt", "def ", "--length", "6", "--seed", "2"]
    assert generate.main(["--export", out] + args) == generate.main(["--workdir", wd] + args)
    capsys.readouterr()
    for argv, fragment in ((["--workdir", wd, "--out", os.path.join(wd, "checkpoints", "x")],
                            "inside a run's checkpoints/"),
                           (["--workdir", wd, "--out", wd], "training run's folder")):
        with pytest.raises(SystemExit):
            export.main(argv)
        assert fragment in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main(["--export", out, "--step", "2"])
    assert "an export has one step" in capsys.readouterr().err
    with pytest.raises(ValueError, match="holds an export"):   # never trained into
        loop.train(trained.read_config(out), out)
    before = os.path.getmtime(path)
    with pytest.raises(SystemExit):
        export.main(["--workdir", wd, "--out", out])
    assert "never overwritten" in capsys.readouterr().err and os.path.getmtime(path) == before


@pytest.mark.slow
def test_lm_eval_adapter_scores_a_local_two_choice_task(run, tmp_path):
    """lm-evaluation-harness runs a two-choice task the test writes (local JSON, no download)
    on the adapter; its choice is the likelier continuation as the full model scores it
    directly (one document whose target is the likelier choice, one whose target is not:
    accuracy 1/2), and loglikelihood equals that direct score."""
    lm_eval = pytest.importorskip("lm_eval")
    import jax
    from flax import nnx
    from lm_eval.tasks import TaskManager

    from sdp_jax.tools.harness import SDPJaxLM
    from sdp_jax.train.families import LanguageModel
    wd, _ = run
    model = SDPJaxLM(workdir=wd, batch_size=4)
    cfg, params = model.cfg, model.params

    def direct(ctx: str, cont: str) -> float:   # unpadded full-model forward pass
        ids = list((ctx + cont).encode())
        lp = jax.nn.log_softmax(nnx.merge(LanguageModel(cfg).graphdef, params)(
            np.asarray([ids[:-1]], np.int32))[0], -1)
        n = len(cont.encode())
        return float(sum(lp[len(ids) - 1 - n + i, t] for i, t in enumerate(ids[-n:])))

    docs = [("def f(x):\n    return", [" x", " }{"]), ("import", [" os", "))("])]
    rows = []
    for i, (q, choices) in enumerate(docs):
        scores = [direct(q, c) for c in choices]
        likelier = int(np.argmax(scores))
        rows.append({"q": q, "choices": choices, "label": likelier if i == 0 else 1 - likelier})
        got = [ll for ll, _ in model.score([(list(q.encode()), list(c.encode()))
                                            for c in choices])]
        np.testing.assert_allclose(got, scores, rtol=1e-4)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tiny_choice.yaml").write_text(
        "task: tiny_choice\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n")
    out = lm_eval.simple_evaluate(model=model, tasks=["tiny_choice"],
                                  task_manager=TaskManager(include_path=str(tmp_path)))
    assert out["results"]["tiny_choice"]["acc,none"] == pytest.approx(0.5)
    # past the trained context (seq_len tokens) only the last ones condition; the rolling
    # log-likelihood of a string is the sum over its windows; generation stops at `until`
    long_ctx = "x = 1\n" * 40
    assert model.window == 32 and len(long_ctx) > model.window
    np.testing.assert_allclose(model.score([(list(long_ctx.encode()), list(b" y"))])[0][0],
                               direct(long_ctx[-31:], " y"), rtol=1e-4)

    class Req:
        def __init__(self, *args):
            self.args = args
    s = "abc" * 20   # 60 bytes: two windows
    rolling = model.loglikelihood_rolling([Req(s)])[0]
    # windows of 32 predicted bytes, each seeing only the model's 32 positions: the second
    # (28 bytes) is conditioned on the 5 bytes before it that still fit
    np.testing.assert_allclose(rolling, direct("\n", s[:32]) + direct(s[27:32], s[32:]),
                               rtol=1e-4)
    free = model.generate_until([Req("def ", {"max_gen_toks": 8})])[0]
    assert free and len(free) <= 8
    stop = free[len(free) // 2]
    cut = model.generate_until([Req("def ", {"until": [stop], "max_gen_toks": 8})])[0]
    assert cut == free[:free.index(stop)]


def test_harness_help_names_the_models_arguments(capsys):
    """``python -m sdp_jax.tools.harness --help`` (or no arguments) prints this project's help,
    not lm-eval's generic one: every argument of the model (``SDPJaxLM``'s parameters) and how
    to run a task, a local one included; an unknown model argument is refused in one line."""
    params = [p for p in inspect.signature(harness.SDPJaxLM.__init__).parameters
              if p not in ("self", "_")]
    assert list(harness.MODEL_ARGS) == params
    for argv in (["--help"], ["-h"], [], ["--model", "sdp_jax", "--help"]):
        harness.main(argv)
        out = capsys.readouterr().out
        assert out.startswith("usage: python -m sdp_jax.tools.harness --model sdp_jax")
        for key in params:
            default = inspect.signature(harness.SDPJaxLM.__init__).parameters[key].default
            line = re.search(rf"^  {key} +\S.*$", out, re.M)
            assert line, key
            assert line.group(0).endswith(f" (default: {default})") == (default is not None)
        assert "--include_path" in out and "--tasks" in out and "run --help" in out
    pytest.importorskip("lm_eval")
    with pytest.raises(SystemExit) as e:
        harness.main(["--model", "sdp_jax", "--model_args", "workdir=runs/x,stepp=3",
                      "--tasks", "boolq"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unknown model argument(s) stepp" in err
    assert "takes workdir, export, step, batch_size" in err
    assert harness.model_args(["--model_args", "workdir=a,step=2", "batch_size=4", "--tasks",
                               "t", "--model_args=export=b"]) == {
        "workdir": "a", "step": "2", "batch_size": "4", "export": "b"}


def _help_blocks(out: str) -> dict:
    """``{flag name: its lines}`` of absl's flag listing in a ``--help`` output."""
    blocks, name = {}, None
    for line in out.splitlines():
        m = re.match(r"  --(?:\[no\])?([\w.]+):", line)
        if m:
            name = m.group(1)
            blocks[name] = line
        elif name and line.startswith("    "):
            blocks[name] += "\n" + line
        else:
            name = None
    return blocks


@pytest.mark.parametrize("tool", ["evaluate", "generate", "export", "prepare", "plot"])
def test_help_lists_every_flag_with_its_default(tool, capsys):
    """``--help`` of each command prints its docstring and every flag of its own with the
    flag's help and default (the use tools also how to override the run's config); nothing
    is read, status 0."""
    from sdp_jax.tools import plot, prepare
    module = {"evaluate": evaluate, "generate": generate, "export": export, "prepare": prepare,
              "plot": plot}[tool]
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(module.__doc__.strip().splitlines()[0])
    if tool == "plot":
        flags = {"out": None}
    else:
        fv = prepare._define([prepare.PROG]) if tool == "prepare" else trained.tool_flags(
            module.define)
        flags = {n: fv[n].default_as_str for n in fv if n not in ("flagfile", "undefok")}
    blocks = _help_blocks(out)
    assert len(flags) >= (1 if tool == "plot" else 3)
    for name, default in flags.items():
        assert name in blocks, name
        assert (f"(default: {default})" in blocks[name]) == (default is not None), name
    assert (trained.CONFIG_HELP in out) == (tool in ("evaluate", "generate", "export"))


def documented_local_task_command() -> list[str]:
    """docs/using.md's command that runs the local task (``--include_path``), as tokens."""
    with open(os.path.join(ROOT, "docs", "using.md")) as f:
        text = f.read()
    lines = [ln for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for ln in block.splitlines()
             if ln.startswith("python -m sdp_jax.tools.harness") and "--include_path" in ln]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def test_documented_local_task_runs_on_a_trained_run(run, tmp_path, monkeypatch, capsys):
    """docs/using.md's local-task command, run by ``harness.main`` (lm-eval's command line) on
    a 4-step run instead of runs/default: the harness reads the task YAML from
    ``--include_path`` and its local data, and its accuracy is the share of documents whose
    right choice the adapter scores likelier."""
    pytest.importorskip("lm_eval")
    import lm_eval.tasks
    wd, _ = run
    cmd = documented_local_task_command()
    assert cmd[:3] == ["python", "-m", "sdp_jax.tools.harness"]
    args = cmd[3:]
    i = args.index("--model_args")
    assert harness.model_args(args) == {"workdir": "runs/default"}, args[i + 1]
    args[i + 1] = f"workdir={wd}"
    include = args[args.index("--include_path") + 1]
    task = args[args.index("--tasks") + 1]
    out_dir = tmp_path / "results"
    # Indexing lm-eval's ~15,000 built-in task YAMLs takes about 30 s of CPU; this command
    # needs only the folder it includes.
    class IncludedOnly(lm_eval.tasks.TaskManager):
        def __init__(self, *a, **k):
            super().__init__(*a, **{**k, "include_defaults": False})
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", IncludedOnly)
    monkeypatch.chdir(ROOT)   # the task YAML's data path is relative to the repository root
    harness.main(args + ["--output_path", str(out_dir)])
    assert task in capsys.readouterr().out   # the harness's results table
    [path] = glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True)
    with open(path) as f:
        acc = json.load(f)["results"][task]["acc,none"]
    model = harness.SDPJaxLM(workdir=wd)
    with open(os.path.join(ROOT, include, "python_choice.jsonl")) as f:
        docs = [json.loads(ln) for ln in f]
    right = 0
    for d in docs:
        scores = [ll for ll, _ in model.score([model.encode_pair(d["context"], c)
                                              for c in d["choices"]])]
        right += int(np.argmax(scores)) == d["label"]
    assert len(docs) == 8 and acc == pytest.approx(right / len(docs))
