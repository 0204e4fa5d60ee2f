"""The documentation check: every command README.md and docs/ show is a command that works.

Each ``python train.py``, ``python -m sdp_jax.bench`` and ``python -m sdp_jax.study`` command of
a bash block or an inline code span is parsed with the tool's own flags (the one loader,
``sdp_jax.train.cli``) and its config goes through the run's whole validation (the checks that run
before any compute), so a renamed flag, a config field that does not exist or a setting the code
refuses fails here. What the checks do not do is run them: the short ones run in the tests of
their features (listed in RUN_ELSEWHERE), the long ones (hours, a 1B model, a pod slice) are
measured by hand, as the README says next to each figure.
"""

import functools
import importlib.util
import os
import re
import shlex

import pytest
from absl import flags

from sdp_jax.bench import device
from sdp_jax.bench import measure as bench
from sdp_jax.study import __main__ as study
from sdp_jax.tools import plot, trained
from sdp_jax.train import cli
from sdp_jax.train.run import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(
    os.path.relpath(os.path.join(d, f), ROOT)
    for d, _, files in os.walk(os.path.join(ROOT, "docs")) for f in files if f.endswith(".md"))
# Commands that are not ours to parse, and where they are exercised.
NOT_PARSED = {
    ("pip", "install"): "CI runs the README's install commands (.ci/run)",
    ("python", "-m", "pytest"): "CI runs the README's test command (.ci/run)",
    ("tfds", "build"): "TFDS's own command, with network; the reader is tested on files the "
                       "test writes (tests/test_vision_data.py)",
    ("cd",): "a shell built-in",
    ("bash", ".device/run"): "the prepared device command (on a lent GPU); its Python part runs "
                             "as a dry run in tests/test_bench_device.py",
    ("bash", ".device/wheels.sh"): "pip download of the wheels a device machine lacks (network)",
    ("python", "-m", "sdp_jax.tools.harness"): "lm-evaluation-harness's own command line (its flags); "
                                         "tests/test_trained.py runs the adapter through the "
                                         "harness on a local task",
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


def _check_train(argv: list[str], processes: int = 1) -> None:
    train = _train_module()
    fv = train.define_flags(flags.FlagValues(), argv)
    cli.parse(fv, argv, train.PROG, train.__doc__)
    config = fv.config
    devices = max(config.num_cpu_devices * processes, config.get("workers", 0) or 0)
    resolve(config, devices)


def _check_launch(cmd: list[str]) -> None:
    """``python -m sdp_jax.train.launch --processes N -- python train.py ...``: the launcher's flags
    and the train command, on N x num_cpu_devices devices (it runs in
    tests/test_multiprocess.py)."""
    cut = cmd.index("--")
    m = re.fullmatch(r"--processes[= ](\d+)", " ".join(cmd[3:cut]))
    assert m, f"launcher flags {cmd[3:cut]}"
    inner = cmd[cut + 1:]
    assert inner[:2] == ["python", "train.py"], inner
    _check_train(["train.py"] + inner[2:], processes=int(m.group(1)))


@pytest.mark.parametrize("path,cmd", COMMANDS,
                         ids=[f"{p}:{' '.join(c)[:70]}" for p, c in COMMANDS])
def test_documented_command_is_valid(sandbox, path, cmd):
    """One documented command: its flags parse and its config passes the run's validation."""
    for head, why in NOT_PARSED.items():
        if tuple(cmd[:len(head)]) == head:
            assert why
            return
    assert cmd[0] == "python", f"{path}: unknown command {' '.join(cmd)}"
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
    elif cmd[1:3] == ["-m", "sdp_jax.tools.plot"]:   # drawn from real runs in its own test
        assert plot.main(cmd[3:], check_only=True) is None
        assert "plot.main" in open(os.path.join(ROOT, "tests", "test_train_cli.py")).read()
    else:
        test = RUN_ELSEWHERE[cmd[1]]
        assert os.path.isfile(os.path.join(ROOT, cmd[1]))
        assert cmd[1].split("/")[-1] in open(os.path.join(ROOT, test)).read()


def test_a_wrong_documented_command_would_fail(sandbox, capsys):
    """The check has teeth: a renamed bench flag, an unknown config field and a refused
    setting each fail it."""
    with pytest.raises(SystemExit):
        bench.main(["--config", "configs/llama_tiny.py", "--coverage", "0.5"], check_only=True)
    assert "it is now --config.sdp.coverage" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _check_train(["train.py", "--config.sdp.coverag=0.5"])
    with pytest.raises(ValueError, match="coverage"):
        _check_train(["train.py", "--config.sdp.coverage=0.3"])


def _named(text: str) -> set[str]:
    """The package's names a page cites: ``from sdp_jax... import ...`` lines and dotted
    ``sdp_jax.module.name`` references."""
    lines = {ln.split("#")[0].strip() for ln in text.splitlines()
             if re.match(r"\s*(from sdp_jax[\w.]* import |import sdp_jax)", ln)}
    refs = set(re.findall(r"(?<![\w/])sdp_jax(?:\.\w+)+", text))
    return lines | refs


def _resolves(name: str) -> bool:
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


def test_every_name_the_docs_cite_exists():
    """Each import line and each dotted ``sdp_jax.…`` name in README.md and docs/ resolves, so
    a moved or renamed module or function cannot leave a page pointing nowhere."""
    missing = sorted(f"{path}: {n}" for path in DOCS
                     for n in _named(open(os.path.join(ROOT, path)).read()) if not _resolves(n))
    assert missing == []
    assert not _resolves("sdp_jax.pipeline.make_mesh")   # (the check has teeth)
    assert not _resolves("from sdp_jax import train_step")
