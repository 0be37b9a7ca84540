"""`python -m ninfer.train run` works on the GPU machine, whose Python has torch, triton,
tokenizers, safetensors, jinja2 and tqdm but none of the server's or the journal's packages:
the training path imports none of them."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ABSENT_THERE = ("transitions", "sqlite_utils", "pydantic", "fastapi", "starlette", "uvicorn",
                "prometheus_client", "httpx")


@pytest.mark.parametrize("module", ["ninfer.train.cli", "ninfer.train.loop",
                                    "ninfer.train.weights", "ninfer.train.corpus"])
def test_the_training_path_needs_nothing_the_gpu_machine_lacks(module):
    code = (f"import sys, {module}; "
            f"print(','.join(m for m in {ABSENT_THERE!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "", f"{module} loads {out.stdout.strip()}"
