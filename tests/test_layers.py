"""The folders are layers and nothing imports upward (docs/architecture.md):

    pipedsl (the language, plan/ included)  <-  parallel, visualize  <-  runtime  <-  models  <-  trainer

Every import is walked, function-level and type-checking ones included; the only links upward are the
names in pipedsl/registry.py, which are checked to resolve.
"""

from __future__ import annotations

import ast
from importlib import import_module
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"pipedsl": "pipedsl", "parallel": "pipedsl.parallel", "visualize": "pipedsl.visualize",
           "runtime": "pipedsl.runtime", "models": "pipedsl.models", "trainer": "pipedsl.trainer"}
LAYER = {"pipedsl": 0, "parallel": 1, "visualize": 1, "runtime": 2, "models": 3, "trainer": 4}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYER else "pipedsl"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every pipedsl import in `path`, at any depth, relative ones resolved."""
    me = _module(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(line, m) for line, m in found if m == "pipedsl" or m.startswith("pipedsl.")]


def _sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_the_walk_sees_every_folder_and_function_level_imports() -> None:
    sources = _sources()
    assert {p.relative_to(ROOT).parts[0] for p in sources} == set(FOLDERS)
    cli = ROOT / "pipedsl" / "plan" / "cli.py"  # imports inside functions count too
    assert any(m.startswith("pipedsl.registry") for _, m in _imports(cli))


def test_nothing_imports_upward() -> None:
    upward = []
    for path in _sources():
        here = _folder(_module(path))
        for line, module in _imports(path):
            there = _folder(module)
            if there != here and LAYER[there] >= LAYER[here]:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {here} imports {module} ({there})")
    assert not upward, "\n".join(upward)


def test_process_management_needs_no_executor() -> None:
    """runtime/launch/ is below the executor core: it starts processes, it knows no pipeline."""
    found = [f"{p.relative_to(ROOT)}:{line}: {m}" for p in sorted((ROOT / "runtime" / "launch").glob("*.py"))
             for line, m in _imports(p)
             if m.startswith("pipedsl.runtime.") and not m.startswith("pipedsl.runtime.launch")]
    assert not found, "\n".join(found)


def _upper_names_in(path: Path) -> list[str]:
    """String constants (not docstrings) in `path` that name a module of a layer above the language."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    upper = tuple(f"pipedsl.{f}" for f in LAYER if f != "pipedsl")
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings and n.value.startswith(upper)]


def test_the_language_names_the_upper_layers_only_in_its_registry() -> None:
    found = {str(p.relative_to(ROOT)): names for p in sorted((ROOT / "pipedsl").rglob("*.py"))
             if (names := _upper_names_in(p)) and p.name != "registry.py"}
    assert not found
    assert _upper_names_in(ROOT / "pipedsl" / "registry.py")  # the check can see them


@pytest.mark.parametrize("name", sorted(__import__("pipedsl.registry").registry.API))
def test_every_lent_name_resolves(name: str) -> None:
    from pipedsl.registry import lend

    assert lend(name) is not None


@pytest.mark.parametrize("name", sorted(__import__("pipedsl.registry").registry.COMMANDS))
def test_every_lent_command_resolves(name: str) -> None:
    from pipedsl.registry import COMMANDS

    command = COMMANDS[name]
    module = import_module(command.module)
    assert callable(getattr(module, command.add_parser)) and callable(getattr(module, command.run))


@pytest.mark.parametrize("package, name", sorted((p, n) for p, names in
                                                __import__("pipedsl.registry").registry.MOVED.items() for n in names))
def test_names_that_moved_up_a_layer_still_resolve_where_they_were(package: str, name: str) -> None:
    """`pipedsl.runtime.causal_lm_stages` and the like keep working, with a warning that names the new home, which
    exports the same object."""
    with pytest.warns(DeprecationWarning, match=rf"{package}\.{name} moved to pipedsl\.\w+\.{name}") as caught:
        old = getattr(import_module(package), name)
    new_home = str(caught[0].message).rpartition(" ")[2].rpartition(".")[0]
    assert getattr(import_module(new_home), name) is old
