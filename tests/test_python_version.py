"""The installed packages import no standard-library module their `requires-python` lacks.

`pipedsl train --config` reads TOML with `tomllib` (Python 3.11) while pyproject.toml said
`>=3.10`: installed on 3.10, the command failed at import.  This test reads the minimum from
pyproject.toml and walks every import of the package folders with `ast`, against a table of
the standard-library modules added (or removed) since Python 3.8.  An import guarded by
`except ImportError` or by a `sys.version_info` test is a fallback, not a requirement.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipedsl", "runtime", "parallel", "models", "trainer", "visualize")

ADDED = {  # module: the first Python (major, minor) that has it
    "importlib.metadata": (3, 8), "graphlib": (3, 9), "zoneinfo": (3, 9), "tomllib": (3, 11),
    "wsgiref.types": (3, 11), "dbm.sqlite3": (3, 13), "annotationlib": (3, 14), "compression": (3, 14),
    "concurrent.interpreters": (3, 14), "string.templatelib": (3, 14),
}
REMOVED = {  # module: the first Python without it (PEP 594's dead batteries, distutils, imp, …)
    "distutils": (3, 12), "imp": (3, 12), "asynchat": (3, 12), "asyncore": (3, 12), "smtpd": (3, 12),
    **dict.fromkeys(("aifc", "audioop", "cgi", "cgitb", "chunk", "crypt", "imghdr", "mailcap", "msilib", "nis",
                     "nntplib", "ossaudiodev", "pipes", "sndhdr", "spwd", "sunau", "telnetlib", "uu", "xdrlib",
                     "lib2to3"), (3, 13)),
}


def minimum_python(text: str) -> tuple[int, int]:
    """(3, 11) for `requires-python = ">=3.11"`."""
    spec = tomllib.loads(text)["project"]["requires-python"]
    found = re.search(r">=\s*(\d+)\.(\d+)", spec)
    assert found, f"requires-python {spec!r}: no lower bound >=X.Y"
    return int(found.group(1)), int(found.group(2))


def _guarded(node: ast.AST) -> bool:
    """A try whose handlers catch ImportError, or an if on sys.version_info: what it imports is optional."""
    if isinstance(node, ast.Try):
        caught = [h.type for h in node.handlers]
        return any(t is None or "ImportError" in ast.unparse(t) or "ModuleNotFoundError" in ast.unparse(t)
                   for t in caught)
    return isinstance(node, ast.If) and "version_info" in ast.unparse(node.test)


def imports(source: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every unguarded absolute import; `from a import b` gives both `a` and `a.b`."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if not guarded and isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif not guarded and isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, guarded or _guarded(node))

    visit(ast.parse(source), False)
    return found


def problems(source: str, where: str, minimum: tuple[int, int]) -> list[str]:
    out = []
    for line, module in imports(source):
        parts = module.split(".")
        for name in {".".join(parts[:k]) for k in range(1, len(parts) + 1)}:
            if name in ADDED and ADDED[name] > minimum:
                out.append(f"{where}:{line}: imports {name} (Python {'.'.join(map(str, ADDED[name]))}+), but "
                           f"requires-python allows {'.'.join(map(str, minimum))}")
            if name in REMOVED:
                out.append(f"{where}:{line}: imports {name}, which Python {'.'.join(map(str, REMOVED[name]))} "
                           f"removed")
    return out


def test_the_packages_import_nothing_their_minimum_python_lacks() -> None:
    minimum = minimum_python((ROOT / "pyproject.toml").read_text())
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 20, "the package folders were not found"
    found = [msg for p in files for msg in problems(p.read_text(), str(p.relative_to(ROOT)), minimum)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("source", "minimum", "flagged"), [
    ("import tomllib\n", (3, 10), True),
    ("import tomllib\n", (3, 11), False),
    ("from importlib import metadata\n", (3, 7), True),
    ("def f():\n    import graphlib\n", (3, 8), True),
    ("try:\n    import tomllib\nexcept ImportError:\n    import tomli as tomllib\n", (3, 10), False),
    ("import sys\nif sys.version_info >= (3, 11):\n    import tomllib\n", (3, 10), False),
    ("import distutils.util\n", (3, 11), True),
    ("from . import tomllib\n", (3, 10), False),  # a module of the package, not the standard library's
])
def test_the_check_itself(source, minimum, flagged) -> None:
    assert bool(problems(source, "x.py", minimum)) == flagged


def test_the_minimum_is_read_from_pyproject() -> None:
    assert minimum_python('[project]\nrequires-python = ">=3.11"\n') == (3, 11)
    assert minimum_python('[project]\nrequires-python = ">= 3.12, <4"\n') == (3, 12)
