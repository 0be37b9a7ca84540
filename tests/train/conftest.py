"""A slice of the corpus (a few stdlib modules, a small vocabulary), built once per session."""

import pytest

from ninfer.train.corpus import Corpus, build

# mostly training modules, and four held-out ones (textwrap, shlex, fnmatch, colorsys)
SLICE = ("json", "base64", "copy", "queue", "sched", "bisect", "textwrap", "shlex", "fnmatch",
         "colorsys")
SLICE_VOCAB = 1024


@pytest.fixture(scope="session")
def slice_corpus(tmp_path_factory) -> Corpus:
    return Corpus.open(build(tmp_path_factory.mktemp("corpus") / "c", modules=SLICE,
                             vocab_size=SLICE_VOCAB))
