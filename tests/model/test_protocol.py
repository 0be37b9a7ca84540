"""One model protocol: SimModel and the torch model both have every member of
`ninfer.model.protocol.Model`, with its kind and its parameters; the protocol, the pools and
SimModel import no torch; ninfer/model imports nothing of ninfer/engine; the engine probes
no model for a capability."""

import ast
import inspect
import subprocess
import sys
import typing
from pathlib import Path

from ninfer.model.protocol import Model
from ninfer.model.sim_model import SimModel

from .nets import torch_factory

PACKAGE = Path(__file__).resolve().parents[2] / "ninfer"
HINTS = typing.get_type_hints(Model)
METHODS = sorted(name for name, value in vars(Model).items()
                 if inspect.isfunction(value) and not name.startswith("_"))


def mismatches(model) -> list[str]:
    """What `model` lacks of the protocol: an attribute missing or of another type, a method
    missing, or one whose parameters do not start with the protocol's (same names, kinds
    and defaults) or that needs more than the protocol passes."""
    out = []
    for name, kind in HINTS.items():
        if not isinstance(getattr(model, name, None), kind):
            out.append(f"{name}: not a {kind.__name__}")
    for name in METHODS:
        method = getattr(model, name, None)
        if not callable(method):
            out.append(f"{name}: no method")
            continue
        want = list(inspect.signature(getattr(Model, name)).parameters.values())[1:]
        have = list(inspect.signature(method).parameters.values())
        same = len(have) >= len(want) and all(
            (h.name, h.kind, h.default) == (w.name, w.kind, w.default)
            for h, w in zip(have, want, strict=False))
        if not same or any(h.default is inspect.Parameter.empty for h in have[len(want):]):
            out.append(f"{name}: parameters {[p.name for p in have]}, the protocol's "
                       f"{[p.name for p in want]}")
    return out


def test_the_protocol_declares_what_the_engine_uses():
    # the capabilities once probed with getattr, and the members the runner calls
    assert {"runs_ahead": bool, "identity": str, "vocab_size": int}.items() <= HINTS.items()
    assert {"forward", "forward_batch", "mtp", "mtp_span", "copy_slot", "copy_block",
            "export_parts", "import_parts", "read_parts", "reference_parts", "parts_match",
            "fence", "completed", "synchronize"} <= set(METHODS)


def test_simmodel_and_the_torch_model_satisfy_the_protocol():
    for model in (SimModel(num_blocks=4, block_size=4, num_slots=2),
                  SimModel(num_blocks=4, block_size=4, num_slots=2, runs_ahead=True),
                  torch_factory(4, 4, 2)):
        assert isinstance(model, Model)
        assert mismatches(model) == [], type(model).__name__


def test_a_model_short_of_the_protocol_is_told_apart():
    class Unbatched(SimModel):
        def forward_batch(self, items):  # no per_position, ahead, outputs
            return [self.forward(lane, tokens, start) for lane, tokens, start in items]

    class Untold(SimModel):
        def __init__(self, **kw) -> None:
            super().__init__(**kw)
            del self.runs_ahead

    got = mismatches(Unbatched(num_blocks=4, block_size=4, num_slots=2))
    assert [m.split(":")[0] for m in got] == ["forward_batch"]
    assert mismatches(Untold(num_blocks=4, block_size=4, num_slots=2)) == [
        "runs_ahead: not a bool"]


def test_the_protocol_the_pools_and_simmodel_import_no_torch():
    code = ("import sys; import ninfer.model, ninfer.model.protocol, ninfer.model.pools, "
            "ninfer.model.sim_model; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]"


def _imports(path: Path) -> list[str]:
    """The absolute names of the modules `path` (a module of ninfer) imports."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                if node.level else []
            names.append(".".join(base + ([node.module] if node.module else [])))
    return names


def test_ninfer_model_imports_nothing_of_the_engine():
    found = {str(p.relative_to(PACKAGE.parent)): name
             for p in sorted((PACKAGE / "model").glob("*.py")) for name in _imports(p)
             if name == "ninfer.engine" or name.startswith("ninfer.engine.")}
    assert found == {}
    # the resolution itself: a runner's relative imports name the engine's modules
    assert "ninfer.engine.choice" in _imports(PACKAGE / "engine" / "runner.py")


def test_the_engine_probes_no_model_for_a_capability():
    probes = []
    for path in sorted((PACKAGE / "engine").glob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr") and node.args \
                    and "model" in ast.get_source_segment(source, node.args[0]):
                probes.append(f"{path.name}:{node.lineno}")
    assert probes == []
