"""Every third-party module the code imports is declared in pyproject.toml: for `ninfer/` and
`kernels/`, a runtime dependency or one of the extras that serve the package's own commands
(`fuzz`, `bench`); for `tests/`, any of them or the `test` extra. Import names are mapped to
distribution names through the installed packages' metadata (`jinja2` is Jinja2's,
`sqlite_utils` is sqlite-utils'), so a module imported without being declared turns this red
instead of working here by the accident of being installed."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = {"ninfer", "kernels", "tests"}
# imported on purpose without being declared, and why
UNDECLARED = {
    "fla": "fla-core, the GPU benches' comparison baseline: carried to the GPU machine as a "
           "wheel, never installed here; every import of it is inside a bench function",
}
TEST_EXTRA = "test"


def canonical(name: str) -> str:
    """A distribution's name as the packaging standards compare names."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> tuple[str, tuple[str, ...]]:
    """The distribution a requirement string names, and the extras it asks for."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", requirement)
    extras = tuple(e.strip() for e in (match.group(2) or "").split(",") if e.strip())
    return canonical(match.group(1)), extras


def declared(project: dict, extras: tuple[str, ...]) -> set[str]:
    """Distributions of the runtime dependencies and of `extras`, the project's own extras
    that an extra names (`ninfer[fuzz]`) resolved."""
    own = canonical(project["name"])
    out: set[str] = set()
    todo = [*project["dependencies"]]
    for extra in extras:
        todo += project["optional-dependencies"][extra]
    seen: set[str] = set()
    while todo:
        name, wanted = requirement_name(todo.pop())
        if name != own:
            out.add(name)
            continue
        for extra in wanted:
            if extra not in seen:
                seen.add(extra)
                todo += project["optional-dependencies"][extra]
    return out


def imports(folder: Path) -> dict[str, set[str]]:
    """Top-level names of the absolute imports in the Python files under `folder`, each with
    the files that import it (at any depth: inside functions and `try` too)."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.partition(".")[0], set()).add(
                    str(path.relative_to(folder.parent)))
    return found


def undeclared(found: dict[str, set[str]], allowed: set[str]) -> dict[str, str]:
    """Each third-party module not provided by an `allowed` distribution, with what is
    wrong and where it is imported."""
    providers = packages_distributions()
    problems = {}
    for module, files in sorted(found.items()):
        if module in OURS or module in sys.stdlib_module_names or module in UNDECLARED:
            continue
        dists = {canonical(d) for d in providers.get(module, ())}
        if not dists & allowed:
            what = (f"from {', '.join(sorted(dists))}, not declared" if dists
                    else "not installed, so not declared")
            problems[module] = f"{what} (imported by {', '.join(sorted(files)[:3])})"
    return problems


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_package_declares_what_it_imports():
    meta = project()
    package_extras = tuple(e for e in meta["optional-dependencies"] if e != TEST_EXTRA)
    allowed = declared(meta, package_extras)
    found = imports(ROOT / "ninfer")
    for module, files in imports(ROOT / "kernels").items():
        found.setdefault(module, set()).update(files)
    # the scan sees what the package really imports (it would pass vacuously otherwise)
    assert {"torch", "pydantic", "starlette", "prometheus_client", "jinja2"} <= set(found)
    assert undeclared(found, allowed) == {}


def test_the_tests_import_only_what_is_declared():
    meta = project()
    allowed = declared(meta, (TEST_EXTRA,))
    found = imports(ROOT / "tests")
    assert {"pytest", "openai", "hypothesis"} <= set(found)
    assert undeclared(found, allowed) == {}


def test_what_only_the_tests_use_is_not_the_packages():
    """The package's allowed set leaves out the test extra's own tools (so `import openai`
    in `ninfer/` would be red), and the runtime set holds what the server needs directly,
    numpy included, which no import shows (torch's `Tensor.numpy()` needs it)."""
    meta = project()
    package = declared(meta, tuple(e for e in meta["optional-dependencies"] if e != TEST_EXTRA))
    assert {"pytest", "openai", "ruff"} <= declared(meta, (TEST_EXTRA,))
    assert {"pytest", "openai", "ruff"}.isdisjoint(package)
    assert {"numpy", "pydantic", "starlette", "prometheus-client"} <= declared(meta, ())


def test_an_undeclared_import_is_found(tmp_path):
    module = tmp_path / "pkg" / "mod.py"
    module.parent.mkdir()
    module.write_text("import json\nimport torch\n\ndef f():\n    import jinja2.sandbox\n"
                      "    from tqdm import tqdm\n    import not_a_real_module_anywhere\n")
    found = imports(tmp_path / "pkg")
    assert set(found) == {"json", "torch", "jinja2", "tqdm", "not_a_real_module_anywhere"}
    problems = undeclared(found, {"torch", "tqdm"})
    assert set(problems) == {"jinja2", "not_a_real_module_anywhere"}
    assert problems["jinja2"].startswith("from jinja2, not declared")
    assert problems["not_a_real_module_anywhere"].startswith("not installed")
