"""No import circles among the package's modules nor between its folders (function-level imports count too: a
lazy import still ties two modules together; imports under ``if TYPE_CHECKING:`` do not, they never run -- the hook
specs' parameter types), and no package module imports the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
#: import name -> folder (the setuptools package-dir mapping)
ROOTS = {
    "mrl_plugins": REPO_ROOT / "mrl_plugins",
    "mrl_plugins.hookspecs": REPO_ROOT / "hookspecs",
    "mrl_plugins.adapters": REPO_ROOT / "adapters",
    "mrl_plugins.configs": REPO_ROOT / "configs",
}


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, root in ROOTS.items():
        for f in root.rglob("*.py"):
            parts = [p for p in f.relative_to(root).with_suffix("").parts if p != "__init__"]
            out[".".join([prefix, *parts])] = f
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a module's own package is no edge back
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_among_the_package_modules():
    assert _cycles(_graph()) == []


#: the package's folders; a module directly in mrl_plugins/ (config, manager, upstream, run, ...) is a node of its own
FOLDERS = ("rollout", "weight_sync", "comm", "device", "cli", "demo", "hookspecs", "adapters", "configs")


def _folder(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[1] in FOLDERS else module


def test_no_import_circle_between_folders():
    """Folders stack (a stage never imports a module that imports the stage back, by any path): the rollout stage
    opens the other stages' ends in its workers through the plugin manager's ``factory``, never by importing the
    manager, which imports the config, which imports each stage's config."""
    folders: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        folders.setdefault(_folder(module), set()).update(_folder(d) for d in deps if _folder(d) != _folder(module))
    assert _cycles(folders) == []


def test_the_checker_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: the command-line layer; the stage packages, the adapter and the core modules must not import it
COMMAND_LAYERS = ("mrl_plugins.cli",)


def test_no_package_module_imports_the_cli():
    offenders = {
        m: sorted(d for d in deps if d.startswith(COMMAND_LAYERS))
        for m, deps in _graph().items()
        if not m.startswith(COMMAND_LAYERS) and any(d.startswith(COMMAND_LAYERS) for d in deps)
    }
    assert offenders == {}


def _raw_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
    return out


def test_the_package_never_imports_the_lab():
    """``benchmarks/`` (the repository's lab, ``python -m benchmarks``) uses the package, never the other way."""
    offenders = {
        m: sorted(i for i in _raw_imports(p) if i.split(".")[0] == "benchmarks")
        for m, p in _modules().items()
        if any(i.split(".")[0] == "benchmarks" for i in _raw_imports(p))
    }
    assert offenders == {}
    assert not (REPO_ROOT / "mrl_plugins" / "bench").exists()
