"""Tiny models run fastest on one thread, and CI's two cores are shared with other work:
more threads only spin against each other."""

import pytest
import torch

from ninfer.model.tiny import make_tiny

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny model's files, made once; tests read them and copy before changing any."""
    return make_tiny(tmp_path_factory.mktemp("tiny") / "tiny")
