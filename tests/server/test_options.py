"""`ninfer serve`'s options where their defaults depend on the machine."""

import argparse

from ninfer.server.serve import add_serve_parser, default_prefill_chunk, load


def _args(*argv: str) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    return add_serve_parser(sub).parse_args(list(argv))


def test_prefill_chunk_defaults_to_the_device_and_an_explicit_one_wins(tmp_path):
    # a GPU forward's host time does not grow with its tokens: bigger chunks there
    assert default_prefill_chunk("cpu") == 512
    assert default_prefill_chunk("cuda") == default_prefill_chunk("cuda:1") == 2048
    for argv, expected in (([], 512), (["--prefill-chunk", "48"], 48)):
        args = _args("--journal", str(tmp_path / f"j{expected}.db"), "--torch-threads", "1",
                     *argv)
        loaded = load(args)
        try:
            assert loaded.thread.engine.config.prefill_chunk == expected
        finally:
            loaded.thread.stop()
