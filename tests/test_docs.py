"""The documentation check: every command README.md and docs/ show is a command that works.

Each ``python train.py``, ``python -m sdp_jax.bench`` and ``python -m sdp_jax.study`` command of
a bash block or an inline code span is parsed with the tool's own flags (the one loader,
``sdp_jax.train.cli``) and its config goes through the run's whole validation (the checks that run
before any compute), so a renamed flag, a config field that does not exist or a setting the code
refuses fails here. ``python -m sdp_jax.train.launch`` commands are checked by the launcher's own
parser and their train command on processes x devices; ``python -m sdp_jax.tools.harness``
commands by lm-eval's parser and the model's arguments (``--help`` runs); ``python -m
sdp_jax.tools.prepare`` commands run, on a small corpus of the paths they name (the corpus kit,
which also holds the tokenizers and the Hugging Face folder that documented runs read). What the
other checks do not do is run them: the short ones run in the tests of their features (listed in RUN_ELSEWHERE and
next to each kind below), the long ones (hours, a 1B model, a pod slice) are measured by hand,
as the README says next to each figure.

Beyond the commands: the steps the docs ask of the default run are ones it keeps, the runs a
plot draws are trained before it, docs/configuration.md's field tables are generated from the
declarations (every field of every built-in config declared once), and every table of measured figures names the commit it was measured at.
"""

import ast
import functools
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from absl import flags

import sdp_jax
from sdp_jax.bench import device
from sdp_jax.bench import measure as bench
from sdp_jax.models.vision import MODELS as VISION_MODELS
from sdp_jax.study import __main__ as study
from sdp_jax.models import hf_llama
from sdp_jax.models.llama import LlamaConfig
from sdp_jax.tools import configdoc, harness, plot, prepare, trained
from sdp_jax.train import cli, fit
from sdp_jax.train.launch import launcher as launch
from sdp_jax.train import config as config_lib
from sdp_jax.train.config import vision_config
from sdp_jax.train.run import resolve, total_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(
    os.path.relpath(os.path.join(d, f), ROOT)
    for d, _, files in os.walk(os.path.join(ROOT, "docs")) for f in files if f.endswith(".md"))
# Commands that are not ours to parse, and where they are exercised.
NOT_PARSED = {
    ("pip", "install"): "CI runs the README's install commands (.ci/run)",
    ("python", "-m", "pytest"): "CI runs the README's test command (.ci/run), which holds the "
                                "fast tier's tests (-m 'not slow'; --strict-markers)",
    ("tfds", "build"): "TFDS's own command, with network; the reader is tested on files the "
                       "test writes (tests/test_vision_data.py)",
    ("cd",): "a shell built-in",
    ("bash", ".device/run"): "the prepared device command (on a lent GPU); its Python part runs "
                             "as a dry run in tests/test_bench_device.py",
    ("bash", ".device/wheels.sh"): "pip download of the wheels a device machine lacks (network)",
}
RUN_ELSEWHERE = {"examples/custom_model.py": "tests/test_custom_model.py",
                 "examples/custom_loop.py": "tests/test_custom_loop.py"}
# Commands the README shows as refused, with what the refusal says.
SHOWN_AS_REFUSED = {"python train.py --config.sdp.coverage=0.3": "nearest valid coverages"}


@functools.lru_cache(maxsize=None)
def _train_module():   # loaded once: it defines its flags on absl's global FLAGS
    spec = importlib.util.spec_from_file_location("_sdp_train_cli", os.path.join(ROOT,
                                                                                "train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _expand_loops(text: str) -> str:
    """``for v in a b; do CMD; done`` -> one CMD per value, ``$v`` substituted."""
    def expand(m):
        var, values, body = m.group(1), m.group(2).split(), m.group(3)
        return "\n".join(body.strip().replace(f"${var}", v) for v in values)
    return re.sub(r"for (\w+) in ([^;\n]+); do\n(.*?)\ndone", expand, text, flags=re.S)


def _commands(text: str) -> list[list[str]]:
    """Shell commands (token lists) of a bash block: continuation lines joined, comments
    dropped, ``&&`` chains split, leading ``VAR=value`` assignments dropped, and the command
    a ``gcloud ... --command "..."`` runs on every host."""
    text = _expand_loops(text.replace("\\\n", " "))
    out = []
    for line in text.splitlines():
        tokens = shlex.split(line, comments=True)
        if tokens[:1] == ["gcloud"]:
            inner = tokens[tokens.index("--command") + 1]
            out += _commands(inner)
            continue
        if tokens[:1] == ["srun"]:   # srun's own options, then the command every task runs
            tokens = tokens[tokens.index("python"):]
        cmd: list[str] = []
        for tok in tokens + ["&&"]:
            if tok == "&&":
                while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(tok)
    return out


def documented_commands() -> list[tuple[str, list[str]]]:
    """(file, tokens) of every command in bash blocks and inline ``python ...`` spans."""
    found = []
    for path in DOCS:
        text = open(os.path.join(ROOT, path)).read()
        for m in re.finditer(r"```(?:bash|sh)\n(.*?)```", text, re.S):
            found += [(path, c) for c in _commands(m.group(1))]
        for m in re.finditer(r"(?<!`)`(python [^`]+)`", text):
            found += [(path, c) for c in _commands(m.group(1).replace("\n", " "))]
    return found


COMMANDS = documented_commands()


def test_the_docs_show_the_commands_we_expect_to_check():
    """The extraction finds the README's commands of every kind (a broken pattern would check
    nothing)."""
    heads = {tuple(c[:3]) if c[:2] == ["python", "-m"] else tuple(c[:2]) for _, c in COMMANDS}
    assert {("python", "train.py"), ("python", "-m", "sdp_jax.bench"),
            ("python", "-m", "sdp_jax.study"), ("pip", "install")} <= heads
    assert sum(c[:2] == ["python", "train.py"] for _, c in COMMANDS) >= 15


@pytest.fixture()
def sandbox(tmp_path, monkeypatch):
    """A working folder with the repository's configs, so that commands write nothing into
    the checkout (``--out`` folders, ``--json`` files)."""
    for name in ("configs", "examples"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


KIT_DOCS = [f"def f{i}(x):\n    return x * {i}  # {'word ' * (i % 7)}\n" * 4 for i in range(60)]


@pytest.fixture(scope="module")
def corpus_kit(tmp_path_factory):
    """What the documented data commands read, made small: ``corpus/`` (Parquet with a
    ``text`` column, also split into ``train/`` and ``val/``, JSONL with a ``content`` field, a
    trained ``tokenizer.json``),
    ``corpus_bpe4k/`` (``prepare``'s shards and tokenizer) and ``runs/default/hf`` (a Hugging
    Face LLaMA folder of the default config's shape, as ``export --format hf`` writes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sdp_jax.train.data import corpus
    from sdp_jax.train.families import LanguageModel

    kit = tmp_path_factory.mktemp("kit")
    for sub in ("corpus/train", "corpus/val"):
        (kit / sub).mkdir(parents=True)
    for k in range(4):
        part = KIT_DOCS[k::4]
        pq.write_table(pa.table({"text": part}), kit / "corpus" / f"part_{k}.parquet")
        pq.write_table(pa.table({"text": part}),
                       kit / "corpus" / ("val" if k == 3 else "train") / f"part_{k}.parquet")
        (kit / "corpus" / f"part_{k}.jsonl").write_text(
            "".join(json.dumps({"content": t}) + "\n" for t in part))
    docs = corpus.Documents(corpus.file_pieces("parquet", sorted((kit / "corpus").glob("*.parquet"))))
    corpus.train_bpe(docs, 1024, str(kit / "corpus" / "tokenizer.json"))
    prepare.main(["--config.data.source=parquet", f"--config.data.train_files={kit}/corpus/*.parquet",
                  "--train_tokenizer", "--vocab_size=1024", f"--out={kit}/corpus_bpe4k"])
    cfg = LlamaConfig.from_config(cli_config("llama_small.py").model)
    hf = kit / "runs" / "default" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps(hf_llama.hf_config(cfg)))
    from safetensors.numpy import save_file
    save_file(hf_llama.to_hf(LanguageModel(cfg).init(0), cfg), str(hf / hf_llama.WEIGHTS))
    return kit


def _with_kit(cmd: list[str], kit) -> None:
    """Link the kit's inputs that ``cmd`` names into the working folder (not the outputs a
    ``prepare`` command writes itself)."""
    text = " ".join(cmd)
    outputs = {flag_value(cmd, "--out")} if cmd[1:3] == ["-m", "sdp_jax.tools.prepare"] else set()
    for name in ("corpus", "corpus_bpe4k", "runs/default/hf"):
        if name in text and name not in outputs and not os.path.exists(name):
            os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
            os.symlink(kit / name, name)


def cli_config(name: str):
    """A config file of configs/ as the commands load it."""
    spec = importlib.util.spec_from_file_location(name[:-3], os.path.join(ROOT, "configs", name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _check_train(argv: list[str], processes: int = 1) -> None:
    train = _train_module()
    fv = train.define_flags(flags.FlagValues(), argv)
    cli.parse(fv, argv, train.PROG, train.__doc__)
    config = fv.config
    per_worker = config.mesh.fsdp * config.mesh.tensor   # (a cluster command's W x F x T)
    devices = max(config.num_cpu_devices * processes, (config.get("workers", 0) or 0) * per_worker)
    # (coverage=auto: checked as --print_config checks it; the run compiles its candidates)
    (fit.check if fit.is_auto(config) else resolve)(config, devices)


def _check_launch(cmd: list[str]) -> None:
    """``python -m sdp_jax.train.launch [FLAGS] -- python train.py ...``: the launcher's flags
    by its own parser and the train command on ``--processes`` x num_cpu_devices devices (the
    README's command runs in tests/test_multiprocess.py); ``--help`` alone prints its help."""
    own = cmd[3:cmd.index("--")] if "--" in cmd else cmd[3:]
    if own == ["--help"]:
        with pytest.raises(SystemExit) as e:
            launch.parser().parse_args(own)
        assert e.value.code == 0
        return
    args = launch.parser().parse_args(own)
    launch.check_processes_per_worker(args.processes, args.processes_per_worker)
    inner = cmd[cmd.index("--") + 1:]
    assert inner[:2] == ["python", "train.py"], inner
    _check_train(["train.py"] + inner[2:], processes=args.processes)


@functools.lru_cache(maxsize=None)
def _harness_parser():
    cli_lib = pytest.importorskip("lm_eval._cli.harness")
    return cli_lib.HarnessCLI()


def _check_harness(args: list[str], monkeypatch) -> None:
    """``python -m sdp_jax.tools.harness ...``: ``--help`` prints this project's help; a run
    names the model ``sdp_jax`` with arguments it takes (``workdir`` or ``export``), its flags
    parse with lm-eval's own parser, and a local task's ``--include_path`` folder holds a YAML
    of every task it names; tests/test_trained.py runs docs/using.md's local task and the
    adapter through the harness."""
    if args in ([], ["--help"], ["-h"]):   # this project's help
        assert harness.main(args) is None
        return
    harness.check_model_args(args)
    assert args[args.index("--model") + 1] == harness.MODEL_NAME, args
    assert {"workdir", "export"} & set(harness.model_args(args)), args
    monkeypatch.setattr(sys, "argv", ["lm_eval"] + args)
    parsed = _harness_parser().parse_args()
    if parsed.include_path:
        folder = os.path.join(ROOT, parsed.include_path)
        declared = set()
        for name in os.listdir(folder):
            if name.endswith((".yaml", ".yml")):
                with open(os.path.join(folder, name)) as f:
                    declared |= set(re.findall(r"^task: *(\S+)", f.read(), re.M))
        assert set(parsed.tasks) <= declared, (parsed.tasks, declared)
        with open(os.path.join(ROOT, "tests", "test_trained.py")) as f:
            assert "documented_local_task_command" in f.read()


@pytest.mark.slow
@pytest.mark.parametrize("path,cmd", COMMANDS,
                         ids=[f"{p}:{' '.join(c)[:70]}" for p, c in COMMANDS])
def test_documented_command_is_valid(sandbox, monkeypatch, corpus_kit, path, cmd):
    """One documented command: its flags parse and its config passes the run's validation."""
    for head, why in NOT_PARSED.items():
        if tuple(cmd[:len(head)]) == head:
            assert why
            return
    assert cmd[0] == "python", f"{path}: unknown command {' '.join(cmd)}"
    _with_kit(cmd, corpus_kit)
    refusal = SHOWN_AS_REFUSED.get(" ".join(cmd))
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            _check_train(["train.py"] + cmd[2:])
    elif cmd[1] == "train.py":
        _check_train(["train.py"] + cmd[2:])
    elif cmd[1:3] == ["-m", "sdp_jax.train.launch"]:
        _check_launch(cmd)
    elif cmd[1:3] == ["-m", "sdp_jax.bench.device"]:   # its dry run: tests/test_bench_device.py
        assert device.main(cmd[3:], check_only=True) == 0
    elif cmd[1:3] == ["-m", "sdp_jax.bench"]:
        assert bench.main(cmd[3:], check_only=True) == []
    elif cmd[1:3] == ["-m", "sdp_jax.study"]:
        assert study.main(cmd[3:], check_only=True) == []
    elif cmd[1:3] in (["-m", "sdp_jax.tools.evaluate"], ["-m", "sdp_jax.tools.generate"],
                      ["-m", "sdp_jax.tools.export"]):
        # the tool's own flags parse here (its config overrides need a run's config.json);
        # tests/test_trained.py runs each tool on a trained run
        tool = importlib.import_module(cmd[2])
        trained.tool_flags(tool.define)([cmd[2]] + [a for a in cmd[3:]
                                                    if not a.startswith("--config.")])
        assert f"{cmd[2].rsplit('.', 1)[1]}.main" in open(
            os.path.join(ROOT, "tests", "test_trained.py")).read()
    elif cmd[1:3] == ["-m", "sdp_jax.tools.harness"]:
        _check_harness(cmd[3:], monkeypatch)
    elif cmd[1:3] == ["-m", "sdp_jax.tools.prepare"] and not cmd[3:]:   # named in prose
        with pytest.raises(SystemExit) as e:
            prepare.main(["--help"])
        assert e.value.code == 0
    elif cmd[1:3] == ["-m", "sdp_jax.tools.prepare"]:   # runs, on the kit's small corpus
        done = prepare.main(cmd[3:])
        assert done["train_tokens"] > 0 and os.path.isfile(done["train"][0])
    elif cmd[1:3] == ["-m", "sdp_jax.tools.configdoc"]:   # the page is current (--check)
        assert configdoc.main(["--check"]) == 0
    elif cmd[1:3] == ["-m", "sdp_jax.tools.plot"]:   # drawn from real runs in its own test
        assert plot.main(cmd[3:], check_only=True) is None
        assert "plot.main" in open(os.path.join(ROOT, "tests", "test_train_cli.py")).read()
    else:
        test = RUN_ELSEWHERE[cmd[1]]
        assert os.path.isfile(os.path.join(ROOT, cmd[1]))
        assert cmd[1].split("/")[-1] in open(os.path.join(ROOT, test)).read()


def test_a_wrong_documented_command_would_fail(sandbox, capsys, monkeypatch):
    """The check has teeth: a renamed bench flag, an unknown config field, a refused
    setting, a launcher flag that does not exist, an unknown model argument of the harness and
    a local task its folder does not define each fail it."""
    with pytest.raises(SystemExit):
        bench.main(["--config", "configs/llama_tiny.py", "--coverage", "0.5"], check_only=True)
    assert "it is now --config.sdp.coverage" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _check_train(["train.py", "--config.sdp.coverag=0.5"])
    with pytest.raises(ValueError, match="coverage"):
        _check_train(["train.py", "--config.sdp.coverage=0.3"])
    with pytest.raises(SystemExit):
        _check_launch(["python", "-m", "sdp_jax.train.launch", "--processes", "2", "--grace_s",
                       "3", "--", "python", "train.py"])
    harness_cmd = ["--model", "sdp_jax", "--model_args", "workdir=runs/default",
                   "--include_path", "examples/lm_eval_task", "--tasks"]
    _check_harness(harness_cmd + ["sdp_jax_python_choice"], monkeypatch)   # (as documented)
    with pytest.raises(AssertionError):
        _check_harness(harness_cmd + ["no_such_task"], monkeypatch)
    harness_cmd[3] = "workdir=runs/default,stepp=500"
    with pytest.raises(ValueError, match="unknown model argument.s. stepp"):
        _check_harness(harness_cmd + ["sdp_jax_python_choice"], monkeypatch)


def _named(text: str) -> set[str]:
    """The package's names a page cites: ``from sdp_jax... import ...`` lines and dotted
    ``sdp_jax.module.name`` references."""
    lines = {ln.split("#")[0].strip() for ln in text.splitlines()
             if re.match(r"\s*(from sdp_jax[\w.]* import |import sdp_jax)", ln)}
    refs = set(re.findall(r"(?<![\w/])sdp_jax(?:\.\w+)+", text))
    return lines | refs


def _old_path(name: str) -> bool:
    """Whether a cited name goes through a module's old path (``sdp_jax.MOVED``), which is
    served with a warning: the pages cite where a module lives now."""
    if name.startswith("from "):
        module, _, names = name[5:].partition(" import ")
        cited = [module] + [f"{module}.{n.split(' as ')[0].strip()}" for n in names.split(",")]
    else:
        parts = name.removeprefix("import ").split(" as ")[0].split(".")
        cited = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(c.strip() in sdp_jax.MOVED for c in cited)


def _resolves(name: str) -> bool:
    if _old_path(name):
        return False
    if name.startswith(("from ", "import ")):
        try:
            exec(name, {})   # an import line of a page's example
        except ImportError:
            return False
        return True
    parts = name.split(".")
    for i in range(len(parts), 0, -1):   # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_hf_extra_is_shown_with_the_cpu_build_of_torch_first():
    """docs/using.md installs torch from PyTorch's CPU wheel index before the ``hf`` extra (on
    Linux, PyPI's torch is the CUDA build with its nvidia wheels), as commands the check lets
    through (``pip install``, :data:`NOT_PARSED`); pyproject.toml's comment gives the same."""
    cpu = ["pip", "install", "torch", "--index-url", "https://download.pytorch.org/whl/cpu"]
    using = [c for p, c in COMMANDS if p == "docs/using.md"]
    assert cpu in using and ["pip", "install", "-e", ".[hf]"] in using
    assert using.index(cpu) + 1 == using.index(["pip", "install", "-e", ".[hf]"])
    assert any(cpu[:len(head)] == list(head) for head in NOT_PARSED)
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert " ".join(cpu) in f.read()


def test_the_readme_stays_under_300_lines_and_opens_with_its_two_commands():
    """README.md is the front page: under 300 lines (detail lives in docs/), opening with the
    install-and-train and the install-and-test commands."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert len(text.splitlines()) < 300
    first = _commands(re.search(r"```bash\n(.*?)```", text, re.S).group(1))
    assert first == [["pip", "install", "-e", "."], ["python", "train.py"],
                     ["pip", "install", "-e", ".[test]"], ["python", "-m", "pytest", "-q"]]


def test_every_name_the_docs_cite_exists():
    """Each import line and each dotted ``sdp_jax.…`` name in README.md and docs/ resolves, so
    a moved or renamed module or function cannot leave a page pointing nowhere."""
    missing = sorted(f"{path}: {n}" for path in DOCS
                     for n in _named(open(os.path.join(ROOT, path)).read()) if not _resolves(n))
    assert missing == []
    assert not _resolves("sdp_jax.pipeline.make_mesh")   # (the check has teeth)
    assert not _resolves("from sdp_jax import train_step")
    assert not _resolves("from sdp_jax import masks")   # an old path (sdp_jax.MOVED)
    assert not _resolves("sdp_jax.comm.shape_bytes")
    assert _resolves("from sdp_jax.spec import masks")
    assert _resolves("sdp_jax.costs.comm.shape_bytes")


# ------------------------------------------------------------------ the default run's checkpoints
def _default_run():
    """``python train.py``'s config and workdir (the default run), from train.py's flags."""
    train = _train_module()
    fv = train.define_flags(flags.FlagValues(), ["train.py"])
    cli.parse(fv, ["train.py"], train.PROG, train.__doc__)
    return fv.config, fv.workdir


def kept_steps(config) -> list[int]:
    """The checkpoints a finished run keeps: one every ``checkpoint_every`` steps and one at
    the end (0: only the end), the last ``keep_checkpoints`` of them (at least one)."""
    total, every = total_steps(config, config.sdp.coverage), config.checkpoint_every
    saved = sorted({*range(every, total + 1, every), total} if every else {total})
    return saved[-max(1, config.keep_checkpoints):]


def flag_value(cmd: list[str], flag: str) -> str | None:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``; the last one) in a command."""
    found = None
    for i, a in enumerate(cmd):
        if a == flag and i + 1 < len(cmd):
            found = cmd[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


def steps_shown(cmd: list[str], workdir: str) -> list[int]:
    """The checkpoint steps a command asks of the run in ``workdir``: ``--step N`` of a tool
    given ``--workdir`` that folder, or ``step=N`` beside ``workdir=`` in the harness's
    ``--model_args``."""
    args = harness.model_args(cmd)
    if os.path.normpath(args.get("workdir", "-")) == os.path.normpath(workdir) and "step" in args:
        return [int(args["step"])]
    wd, step = flag_value(cmd, "--workdir"), flag_value(cmd, "--step")
    if wd is not None and step is not None and os.path.normpath(wd) == os.path.normpath(workdir):
        return [int(step)]
    return []


def test_documented_steps_of_the_default_run_are_ones_it_keeps():
    """Every ``--step N`` (or ``step=N``) the docs ask of the default run's folder is a
    checkpoint that run keeps, computed from its config (steps, checkpoint_every,
    keep_checkpoints), so a changed default or a wrong step in the docs fails here."""
    config, workdir = _default_run()
    kept = kept_steps(config)
    shown = [(path, n) for path, cmd in COMMANDS for n in steps_shown(cmd, workdir)]
    assert shown, f"no documented command asks a step of {workdir}"
    assert [(path, n) for path, n in shown if n not in kept] == [], \
        f"the default run ({workdir}) keeps only steps {kept}"
    # (the check has teeth: the step the README once showed is not kept)
    assert steps_shown(shlex.split(f"python -m sdp_jax.tools.evaluate --workdir {workdir} "
                                   "--step 400"), workdir) == [400] and 400 not in kept
    assert steps_shown(["python", "-m", "sdp_jax.tools.harness", "--model_args",
                        f"workdir={workdir},step=100"], workdir) == [100] and 100 not in kept


# ------------------------------------------------------------------ plots of trained runs
def _blocks(path: str) -> list[list[list[str]]]:
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    return [_commands(m.group(1)) for m in re.finditer(r"```(?:bash|sh)\n(.*?)```", text, re.S)]


def untrained_plot_runs(block: list[list[str]], default_workdir: str) -> list[str]:
    """The run folders a ``sdp_jax.tools.plot`` command of a bash block reads that no
    ``python train.py`` command before it in the block trains (``python train.py`` without
    ``--workdir`` trains ``default_workdir``, which the README's first command does)."""
    trained_dirs, missing = {os.path.normpath(default_workdir)}, []
    for cmd in block:
        if cmd[:2] == ["python", "train.py"]:
            trained_dirs.add(os.path.normpath(flag_value(cmd, "--workdir") or default_workdir))
        elif cmd[1:3] == ["-m", "sdp_jax.tools.plot"]:
            fv = flags.FlagValues()
            flags.DEFINE_string("out", None, "", flag_values=fv)
            runs = fv(["plot"] + cmd[3:])[1:]
            missing += [r for r in runs if os.path.normpath(r) not in trained_dirs]
    return missing


def test_the_runs_a_documented_plot_reads_are_trained_before_it():
    """A plot command in the docs comes after the commands that train the runs it draws (in
    the same bash block), so a reader who runs the block in order has them: the README's
    comparison with DDP trains runs/ddp first."""
    _, default_workdir = _default_run()
    plots = [(path, block) for path in DOCS for block in _blocks(path)
             if any(c[1:3] == ["-m", "sdp_jax.tools.plot"] for c in block)]
    assert plots
    assert [(path, untrained_plot_runs(block, default_workdir)) for path, block in plots
            if untrained_plot_runs(block, default_workdir)] == []
    bare = _commands("python -m sdp_jax.tools.plot runs/default runs/ddp --out runs/compare")
    assert untrained_plot_runs(bare, default_workdir) == ["runs/ddp"]   # (teeth)


# ------------------------------------------------------------------ docs/configuration.md
def test_configuration_doc_is_generated_from_the_declarations(capsys):
    """docs/configuration.md's field tables are what the declarations give
    (``python -m sdp_jax.tools.configdoc --check``), and every field of every built-in run
    config is declared once (so every field has its row): a field added, renamed, re-documented
    or given another default fails here until the page is regenerated."""
    assert configdoc.main(["--check"]) == 0, capsys.readouterr().out
    lm = configdoc._llama_small()
    assert config_lib.undeclared(lm, config_lib.LANGUAGE_MODEL_DECLARED) == []
    for name in VISION_MODELS:
        assert config_lib.undeclared(vision_config(name, "digits"),
                                     config_lib.EVERY_RUN + config_lib.VISION_DECLARED) == []
    with open(os.path.join(ROOT, "docs", "configuration.md")) as f:
        text = f.read()
    rows = re.findall(r"^\| `([^`]+)` \|", text, re.M)
    assert len(rows) > 90 and {"sdp.coverage", "grad_accum", "model.window", "eval_limit"} <= set(
        rows)
    # (the check has teeth: an edited row, a new field and a missing marker are each caught)
    edited = text.replace("| `grad_accum` | 1 |", "| `grad_accum` | 2 |")
    assert configdoc.render(edited) == text != edited
    lm.sdp.new_field = 0
    assert config_lib.undeclared(lm, config_lib.LANGUAGE_MODEL_DECLARED) == ["sdp.new_field"]
    with pytest.raises(ValueError, match="has no marker '<!-- fields: vision -->'"):
        configdoc.render(text.replace("<!-- fields: vision -->", ""))


# ------------------------------------------------------------------ measured at a commit
# README.md and every page of docs/ but the field table (whose defaults are no measurements)
MEASURED = [p for p in DOCS if p != os.path.join("docs", "configuration.md")]
MEASURED_AT = re.compile(r"[Mm]easured at commit `?([0-9a-f]{7,40})`? \((\d{4}-\d\d-\d\d)")


FIGURE = re.compile(r"[*_]*[-+−]?\d[\d,]*(\.\d+|(\.\d+)? ?(MiB|GiB|GB|MB|ms|s)\b)")


def measured_tables(text: str) -> list[tuple[int, str]]:
    """``(line, text before the table since the previous heading or table)`` of every table
    of measured figures: at least four cells that start with a number with a decimal point
    or a unit (MiB, GiB, ms, s), as a loss, a ratio, a memory or a time does."""
    lines, out, start, i = text.splitlines(), [], 0, 0
    while i < len(lines):
        if lines[i].startswith("#"):
            start = i
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            cells = [c.strip() for ln in lines[i + 2:j] for c in ln.strip().strip("|").split("|")]
            if sum(bool(FIGURE.match(c)) for c in cells) >= 4:
                out.append((i + 1, "\n".join(lines[start:i])))
            start, i = j, j
        else:
            i += 1
    return out


def test_measured_tables_name_the_commit_they_were_measured_at():
    """Every table of measured figures in the README and the pages of results says, between
    its heading (or the table before it) and itself, the commit (and date) it was measured
    at, and that commit is one of this repository's."""
    missing, commits = [], set()
    for path in MEASURED:
        with open(os.path.join(ROOT, path)) as f:
            for line, before in measured_tables(f.read()):
                found = MEASURED_AT.findall(before)
                commits |= {c for c, _ in found}
                if not found:
                    missing.append(f"{path}:{line}")
    assert missing == []
    assert len(commits) >= 5
    table = "## h\n\n| a | b | c |\n|---|---|---|\n| x | 1.25 | 2 MiB |\n| y | 0.5 | 3 s |\n"
    assert measured_tables(table) == [(3, "## h\n")]   # (teeth: found, with nothing above it)
    assert measured_tables(table.replace("1.25", "`a`")) == []   # three figures: not measured
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "--git-dir"], capture_output=True,
                      check=False).returncode == 0:   # a git checkout (not an sdist)
        unknown = [c for c in sorted(commits) if subprocess.run(
            ["git", "-C", ROOT, "cat-file", "-e", f"{c}^{{commit}}"],
            capture_output=True, check=False).returncode != 0]
        assert unknown == []


# ------------------------------------------------------------------ docs/testing.md's tiers
def _tiers_of(path: str) -> set[str]:
    """The tiers of a test file from its source: ``slow`` when a test function, its ``Test``
    class or the module (``pytestmark``) carries ``pytest.mark.slow``, ``fast`` when none
    does."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())

    def slow(nodes) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "slow"
                   and ast.unparse(n).endswith("mark.slow")
                   for node in nodes for n in ast.walk(node))

    def marked(body) -> bool:   # a pytestmark = ... (or pytestmark: T = ...) holding slow
        return slow(n.value for n in body if isinstance(n, (ast.Assign, ast.AnnAssign))
                    and n.value is not None and "pytestmark" in
                    [getattr(t, "id", "") for t in getattr(n, "targets", [getattr(n, "target", None)])])

    def tests(body, above: bool):
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                yield from tests(node.body, above or slow(node.decorator_list)
                                 or marked(node.body))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name.startswith("test_"):
                yield "slow" if above or slow(node.decorator_list) else "fast"

    return set(tests(tree.body, marked(tree.body)))


def test_the_test_table_gives_every_file_its_tiers():
    """docs/testing.md's table has a row for every test file, and the row's tiers are the
    file's (``@pytest.mark.slow`` on a test function: the slow tier; unmarked: the fast
    tier, ``python -m pytest -q -m "not slow"``)."""
    with open(os.path.join(ROOT, "docs", "testing.md")) as f:
        rows = re.findall(r"^\| [^|]* \| `(tests/test_\w+\.py)` \|[^|]*\| ([a-z +]+) \|",
                          f.read(), re.M)
    files = sorted(os.path.join("tests", n) for n in os.listdir(os.path.join(ROOT, "tests"))
                   if n.startswith("test_") and n.endswith(".py"))
    assert sorted(p for p, _ in rows) == files
    wrong = [(p, t, sorted(_tiers_of(p))) for p, t in rows
             if set(t.split(" + ")) != _tiers_of(p)]
    assert wrong == []
    assert _tiers_of("tests/test_masks.py") == {"fast"}   # (the check has teeth)
    assert "slow" in _tiers_of("tests/test_multiprocess.py")
