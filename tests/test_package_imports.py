"""The package ships no test code: no module of `ninfer/` imports, when it is imported, the
tests, test-only libraries (pytest, hypothesis) or the old `ninfer.testing`. One exception:
the state machine of `ninfer fuzz stateful` imports hypothesis; the command imports it only
when it runs (tests/test_fuzz_command.py)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("tests", "ninfer.testing", "hypothesis", "pytest")
ALLOWED = {("ninfer.fuzz.stateful", "hypothesis")}


def forbidden_imports(package: Path = ROOT / "ninfer") -> list[str]:
    """`module: imported name` for each import that runs when a module of `package` is
    imported (any not inside a function) and names one of FORBIDDEN or below it."""
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        here = module.split(".") if parts[-1] == "__init__" else module.split(".")[:-1]
        pending = list(ast.parse(path.read_text(), str(path)).body)
        while pending:
            node = pending.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue  # imported when called: lazily
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):  # (`from . import x` may import a module x)
                base = here[:len(here) - node.level + 1] if node.level else []
                source = ".".join([*base, *([node.module] if node.module else [])])
                names = [source, *(f"{source}.{alias.name}" for alias in node.names)]
            else:
                pending.extend(ast.iter_child_nodes(node))
                continue
            hits = [(name, f) for name in names for f in FORBIDDEN
                    if (name == f or name.startswith(f + ".")) and (module, f) not in ALLOWED]
            if hits:
                found.append(f"{module}: {hits[0][0]}")
    return found


def test_no_module_of_the_package_imports_test_code():
    assert forbidden_imports() == []


def test_the_check_finds_such_imports(tmp_path):
    package = tmp_path / "ninfer"
    (package / "fuzz").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "fuzz" / "__init__.py").write_text("from ..testing import harness\n")
    (package / "fuzz" / "command.py").write_text("from .. import testing\n")
    (package / "fuzz" / "stateful.py").write_text("import hypothesis.stateful\n")
    (package / "served.py").write_text(
        "import os\ntry:\n    import pytest\nexcept ImportError:\n    pass\n\n\n"
        "class A:\n    from tests.sim import helpers\n\n\n"
        "def lazy():\n    import hypothesis\n")
    assert sorted(forbidden_imports(package)) == [
        "ninfer.fuzz.command: ninfer.testing", "ninfer.fuzz: ninfer.testing",
        "ninfer.served: pytest", "ninfer.served: tests.sim"]
