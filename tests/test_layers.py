"""The package's layers (pyproject.toml's import-linter contracts; docs/design.md, "How SDP is laid
out"): kept, with teeth; no import cycles; no imports of the package's own modules inside
functions (which is how cycles hide); no function over 60 lines and no class over 400.

``python tests/test_layers.py`` prints the census: lines per layer, the largest classes and
functions."""

import ast
import collections
import os
import pathlib
import shutil
import subprocess
import sys

import grimp

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
    """The core importing the training layer (masks -> train.loop) and a training module
    importing a tool each fail CI."""
    shutil.copytree(PACKAGE, tmp_path / "sdp_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    masks = tmp_path / "sdp_jax" / "masks.py"
    masks.write_text(masks.read_text() + "\nfrom sdp_jax.train import loop  # noqa\n")
    curves = tmp_path / "sdp_jax" / "train" / "curves.py"
    curves.write_text(curves.read_text() + "\nfrom sdp_jax.tools import plot  # noqa\n")
    out = _lint(tmp_path)
    assert out.returncode != 0
    assert "sdp_jax.masks is not allowed to import sdp_jax.train" in out.stdout, out.stdout
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
    """Lines per layer (the core: the top-level modules), the five largest classes and
    functions, and imports of the package inside functions."""
    layers = collections.Counter()
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE).parts
        layers[parts[0] if len(parts) > 1 else "core"] += f.read_text().count("\n")
    sizes = _sizes()
    inner = sum(len(_inner_imports(f)) for f in PACKAGE.rglob("*.py"))
    return "\n".join([
        f"lines: {sum(layers.values())} ({', '.join(f'{k} {v}' for k, v in layers.items())})",
        "largest classes: " + ", ".join([f"{w} {n}" for n, k, w in sizes if k == "class"][:5]),
        "largest functions: " + ", ".join([f"{w} {n}" for n, k, w in sizes
                                           if k == "function"][:5]),
        f"imports of sdp_jax inside functions: {inner}"])


if __name__ == "__main__":
    print(census())
