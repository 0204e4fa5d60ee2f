"""The package's layers (pyproject.toml's import-linter contracts; docs/design.md, "How SDP is laid
out"): kept, with teeth; no import cycles; no imports of the package's own modules inside
functions (which is how cycles hide); no function over 60 lines and no class over 400.

``python tests/test_layers.py`` prints the census: lines per layer, the largest classes and
functions."""

import ast
import collections
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import grimp

import sdp_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sdp_jax"
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--no-cache"]


def _lint(cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the ``sdp_jax`` found first on the path from ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(LINT, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_are_kept():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    kept = out.stdout.count(" KEPT")
    assert kept >= 6 and " BROKEN" not in out.stdout, out.stdout[-3000:]


def test_a_forbidden_import_breaks_a_contract(tmp_path):
    """The core importing the training layer (masks -> train.loop), a training module importing
    a tool, and a wing's lower piece importing a higher one of the same wing (the step's regime
    -> its facade; the data's documents -> token data) each fail CI."""
    shutil.copytree(PACKAGE, tmp_path / "sdp_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    added = {"spec/masks.py": "from sdp_jax.train import loop",
             "train/curves.py": "from sdp_jax.tools import plot",
             "step/regime.py": "from sdp_jax.step import sdp_step",
             "train/data/corpus.py": "from sdp_jax.train.data import tokens"}
    for path, line in added.items():
        f = tmp_path / "sdp_jax" / path
        f.write_text(f.read_text() + f"\n{line}  # noqa\n")
    out = _lint(tmp_path)
    assert out.returncode != 0
    assert "sdp_jax.step.regime is not allowed to import sdp_jax.step.sdp_step" in out.stdout, (
        out.stdout)
    assert "sdp_jax.train.data.corpus is not allowed to import sdp_jax.train.data.tokens" in (
        out.stdout), out.stdout
    assert "sdp_jax.spec is not allowed to import sdp_jax.train" in out.stdout, out.stdout
    assert "sdp_jax.train is not allowed to import sdp_jax.tools" in out.stdout, out.stdout


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycles():
    graph = grimp.build_graph("sdp_jax")
    assert len(graph.modules) > 30
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    graph = grimp.ImportGraph()
    for m in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(m)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert _cycles(graph) == [["a.x", "a.y"]]


def _inner_imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``file:line`` of each import of an ``sdp_jax`` module inside a function."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                own = (isinstance(node, ast.ImportFrom)
                       and (node.level or (node.module or "").startswith("sdp_jax"))) or (
                    isinstance(node, ast.Import)
                    and any(a.name.startswith("sdp_jax") for a in node.names))
                if own:
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_package_import_inside_a_function():
    assert [x for f in sorted(PACKAGE.rglob("*.py")) for x in _inner_imports(f)] == []


def test_the_inner_import_check_flags_one(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import jax\n\n\ndef f():\n    import numpy\n    from sdp_jax import masks\n"
                     "    from . import spec\n    return masks, spec, numpy, jax\n")
    assert _inner_imports(probe, tmp_path) == ["probe.py:6", "probe.py:7"]



# A wing's face (its __init__) -> the members whose public names it serves.
FACES = {"sdp_jax.spec": ["sdp_jax.spec.sdp_spec", "sdp_jax.spec.rules"],
         "sdp_jax.sync": ["sdp_jax.sync.collectives"],
         "sdp_jax.step": ["sdp_jax.step.sdp_step"],
         "sdp_jax.pipeline": ["sdp_jax.pipeline.schedules"],
         "sdp_jax.costs": ["sdp_jax.costs.comm", "sdp_jax.costs.program"],
         "sdp_jax.train.data": ["sdp_jax.train.data.tokens"],
         "sdp_jax.train.launch": ["sdp_jax.train.launch.launcher"],
         "sdp_jax.train.families": ["sdp_jax.train.families.language_model",
                                    "sdp_jax.train.families.vision",
                                    "sdp_jax.train.families.registry"]}


def _public_names(module: str) -> list[str]:
    """The functions, classes and UPPER_CASE constants a module defines without a leading
    underscore (what its wing's face serves)."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()]
    return [n for n in names if not n.startswith("_")]


def test_each_face_serves_its_members_public_names():
    """``from sdp_jax import spec`` then ``spec.Blocks`` (and every wing's face likewise) is the
    member's own object, and a public name added to a member is served by its face."""
    for face, members in FACES.items():
        mod = importlib.import_module(face)
        for member in members:
            names = _public_names(member)
            assert names, member
            assert sorted(set(names) - set(mod.__all__)) == [], (face, member)
            source = importlib.import_module(member)
            assert [n for n in names if getattr(mod, n) is not getattr(source, n)] == [], member


OLD_PATHS = """
import importlib, json, warnings
import sdp_jax
from sdp_jax import spec, step
found = {"faces": [spec.Blocks is importlib.import_module("sdp_jax.spec.rules").Blocks,
                   step.SDPStep.__module__]}
for old, new in sdp_jax.MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    found[old] = [module is importlib.import_module(new), module.__name__, module.__spec__.name,
                  [str(w.message) for w in caught if w.category is FutureWarning]]
from sdp_jax import costs, masks
from sdp_jax.train.peers import hold_signals
found["forms"] = [masks.__name__, hold_signals.__module__, costs.comm_bytes_per_device.__module__]
print(json.dumps(found))
"""


def test_old_module_paths_are_the_moved_modules():
    """Each module that moved into a wing is still imported by its old path (``import
    sdp_jax.placement``, ``from sdp_jax import masks``, ``from sdp_jax.train.peers import ...``):
    the same module object under its own name, with one FutureWarning that names the new path.
    A fresh interpreter, so that nothing was imported before."""
    out = subprocess.run([sys.executable, "-c", OLD_PATHS], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found.pop("faces") == [True, "sdp_jax.step.sdp_step"]
    assert found.pop("forms") == ["sdp_jax.spec.masks", "sdp_jax.train.launch.peers",
                                  "sdp_jax.costs.comm"]
    assert set(found) == set(sdp_jax.MOVED)
    for old, (same, name, spec_name, warned) in found.items():
        new = sdp_jax.MOVED[old]
        assert (same, name, spec_name) == (True, new, new), old
        assert len(warned) == 1 and f"{old} moved to {new}" in warned[0], (old, warned)


def test_the_launcher_command_runs_from_its_wing():
    """``python -m sdp_jax.train.launch`` (the documented command) is the wing's ``__main__``."""
    out = subprocess.run([sys.executable, "-m", "sdp_jax.train.launch", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: python -m sdp_jax.train.launch --processes N")


MAX_FUNCTION, MAX_CLASS = 60, 400   # lines from the def / class line to the last, docstring included


def _sizes(root: pathlib.Path = PACKAGE) -> list[tuple[int, str, str]]:
    """``(lines, "function" | "class", "file:name")`` of every function and class, largest
    first."""
    out = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                out.append((node.end_lineno - node.lineno + 1, kind,
                            f"{f.relative_to(root)}:{node.name}"))
    return sorted(out, reverse=True)


def test_no_function_or_class_past_its_size():
    """One job per piece (docs/design.md): split a function that outgrows 60 lines or a class
    that outgrows 400 by what its parts do."""
    limit = {"function": MAX_FUNCTION, "class": MAX_CLASS}
    assert [x for x in _sizes() if x[0] > limit[x[1]]] == []


def test_the_size_check_flags_one(tmp_path):
    (tmp_path / "probe.py").write_text("def f():\n" + "    x = 1\n" * 60 + "    return x\n")
    assert _sizes(tmp_path) == [(62, "function", "probe.py:f")]


def census() -> str:
    """Files and lines per wing (a sub-package; ``core`` is the modules at the top of the
    package), the five largest classes and functions, and imports of the package inside
    functions."""
    layers, files = collections.Counter(), collections.Counter()
    for f in PACKAGE.rglob("*.py"):
        wing = "/".join(f.relative_to(PACKAGE).parts[:-1]) or "core"
        layers[wing] += f.read_text().count("\n")
        files[wing] += 1
    sizes = _sizes()
    inner = sum(len(_inner_imports(f)) for f in PACKAGE.rglob("*.py"))
    return "\n".join([
        f"lines: {sum(layers.values())} in {sum(files.values())} files",
        "per wing (files, lines): " + ", ".join(f"{k} {files[k]} {v}"
                                                 for k, v in sorted(layers.items())),
        "largest classes: " + ", ".join([f"{w} {n}" for n, k, w in sizes if k == "class"][:5]),
        "largest functions: " + ", ".join([f"{w} {n}" for n, k, w in sizes
                                           if k == "function"][:5]),
        f"imports of sdp_jax inside functions: {inner}"])


if __name__ == "__main__":
    print(census())
