"""Hypothesis profiles. CI sets CI=true, which selects Hypothesis's built-in `ci` profile
(derandomized, no example database); we extend it rather than replace it."""

import os
import tempfile

import pytest

# the random tiny model is generated into NINFER_HOME: keep tests out of ~/.cache
os.environ.setdefault("NINFER_HOME", os.path.join(tempfile.gettempdir(), "ninfer-test-home"))
# tests run on the random tiny model (deterministic and fast; later default models change
# nothing), not on the trained default: those that test the shipped file name it
os.environ.setdefault("NINFER_MODEL", "tiny-qwen3-next-v1")
# Triton kernels run on the CPU only in its interpreter, chosen when a kernel is decorated:
# set before any kernel module is imported (a machine with a GPU runs them for real)
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", settings.get_profile("ci"), max_examples=300, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "fuzz", max_examples=100_000, deadline=None, derandomize=False,
    suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(autouse=True)
def _seeded_torch():
    """Every test draws the same random tensors on every run: a test's pass must not depend
    on the draw (tests that need several draws seed or loop on their own)."""
    torch.manual_seed(0)
