"""The import rules of ARCHITECTURE.md, enforced: which part may import which, and which
parts must load no torch. Each rule is a row below; ARCHITECTURE.md names the same rows."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imports(package: str) -> dict[str, set[str]]:
    """Every module of `package` (a folder at the root) -> the modules it imports anywhere
    in its text (at import time or lazily in a function), relative imports resolved, with
    `from x import y` counted as x and x.y."""
    out: dict[str, set[str]] = {}
    base = ROOT / package
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_init = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_init else parts)
        here = module.split(".") if is_init else module.split(".")[:-1]
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                prefix = here[:len(here) - node.level + 1] if node.level else []
                source = ".".join([*prefix, *([node.module] if node.module else [])])
                names.add(source)
                names.update(f"{source}.{alias.name}" for alias in node.names)
        out[module] = names
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


# (who, what it may not import, except these) — ARCHITECTURE.md's "Import rules"
RULES = [
    ("ninfer.lifecycle", "ninfer", ("ninfer.lifecycle",)),
    ("ninfer.engine.scheduler", "ninfer",
     ("ninfer.lifecycle", "ninfer.model.pools", "ninfer.engine.scheduler")),
    ("ninfer.model", "ninfer.engine", ()),
    ("ninfer.model", "ninfer.server", ()),
    ("ninfer.model", "ninfer.tools", ()),
    ("ninfer.server", "ninfer.model", ("ninfer.model.template", "ninfer.model.tokenizer")),
    ("ninfer.server", "kernels", ()),
    ("ninfer.server", "torch", ()),
    ("ninfer.tools", "ninfer.server", ()),
    ("kernels", "ninfer", ("ninfer.flags",)),
    ("ninfer.model", "ninfer.train", ()),
    ("ninfer.engine", "ninfer.train", ()),
    ("ninfer.train", "ninfer.server", ()),
    ("ninfer.train", "ninfer.tools", ()),
    ("ninfer.train", "ninfer.bench", ()),
    ("ninfer.train", "kernels", ()),
    ("ninfer", "tests", ()),
    ("ninfer", "pytest", ()),
]
# the composition root loads the model it serves and sets torch's threads; nothing else of
# the server touches either
COMPOSITION_ROOT = ("ninfer.server.serve", ("ninfer.model.runtime", "torch"))


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, names in graph.items():
        for who, banned, allowed in RULES:
            if not _under(module, who):
                continue
            for name in sorted(names):
                root, may = COMPOSITION_ROOT
                if module == root:
                    allowed = (*allowed, *may)
                if _under(name, banned) and not any(_under(name, a) for a in allowed):
                    found.append(f"{module} imports {name} ({who} may not import {banned})")
    return found


def test_every_part_imports_only_what_architecture_md_allows():
    graph = {**imports("ninfer"), **imports("kernels")}
    assert len(graph) > 80
    assert violations(graph) == []


def test_the_rules_catch_a_forbidden_import():
    graph = {"ninfer.lifecycle.store": {"ninfer.engine.pools", "ninfer.lifecycle.facts"},
             "ninfer.server.app": {"ninfer.model.torch_model", "ninfer.model.template"},
             "ninfer.server.serve": {"ninfer.model.runtime"},
             "ninfer.server.generation": {"ninfer.model.runtime"},
             "ninfer.engine.scheduler": {"ninfer.model.pools", "ninfer.engine.runner"},
             "ninfer.model.sim_model": {"ninfer.model.protocol"}}
    assert violations(graph) == [
        "ninfer.lifecycle.store imports ninfer.engine.pools "
        "(ninfer.lifecycle may not import ninfer)",
        "ninfer.server.app imports ninfer.model.torch_model "
        "(ninfer.server may not import ninfer.model)",
        "ninfer.server.generation imports ninfer.model.runtime "
        "(ninfer.server may not import ninfer.model)",
        "ninfer.engine.scheduler imports ninfer.engine.runner "
        "(ninfer.engine.scheduler may not import ninfer)",
    ]


TORCH_FREE = ["ninfer.lifecycle.machine", "ninfer.lifecycle.store", "ninfer.lifecycle.planner",
              "ninfer.lifecycle.checks", "ninfer.lifecycle.reader", "ninfer.lifecycle.journal",
              "ninfer.engine.scheduler", "ninfer.engine.pacing", "ninfer.model.protocol",
              "ninfer.model.pools", "ninfer.model.sim_model", "ninfer.tools.journal",
              "ninfer.model.bpe",
              "ninfer.train.sources", "ninfer.train.examples", "ninfer.train.corpus",
              "ninfer.train.recipe", "ninfer.train.cli"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_bookkeeping_loads_no_torch(module):
    """Imported alone, in a fresh process, these load neither torch nor triton: the
    lifecycle, store, planner and scheduler test in microseconds."""
    code = (f"import sys, {module}; "
            "print(','.join(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "", f"{module} loads {out.stdout.strip()}"
