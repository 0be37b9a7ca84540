"""What a decode round's reads of the context cost at `--size` tokens on this CPU: the copy
of prompt + outputs a round made three times (now a view, `Request.so_far`), and n-gram
drafting's scan back for the tail (random ids: the tail has not occurred) against
`NgramIndex` (its first round, which builds it, and a round after 4 new tokens).

    .venv/bin/python bench/stop45/round_reads.py --size 32768
"""
from __future__ import annotations

import argparse
import random
import timeit

from ninfer.engine.speculative import NgramIndex, ngram_draft
from ninfer.lifecycle.request import TokensSoFar


def best_ms(fn, number: int) -> float:
    return 1e3 * min(timeit.repeat(fn, number=number, repeat=5)) / number


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=32768)
    a = ap.parse_args()
    rng = random.Random(0)
    prompt = tuple(rng.randrange(1, 100_000) for _ in range(a.size))
    outputs = [rng.randrange(1, 100_000) for _ in range(200)]
    view = TokensSoFar(prompt, outputs)
    print(f"prompt + outputs copied: {best_ms(lambda: prompt + tuple(outputs), 200):.4f} ms; "
          f"the view's last token and a 4-token slice: "
          f"{best_ms(lambda: (view[-1], view[-5:-1]), 2000):.4f} ms")
    whole = prompt + tuple(outputs)   # (the tuple a round handed the scan before)
    print(f"ngram_draft's scan: {best_ms(lambda: ngram_draft(whole, 3), 5):.3f} ms")
    print(f"NgramIndex, its first round: {best_ms(lambda: NgramIndex().draft(view, 3), 5):.3f} ms")
    index = NgramIndex()
    index.draft(view, 3)
    grown = TokensSoFar(prompt, outputs + [7, 8, 9, 10])

    def next_round():
        index.upto -= 4   # the 4 tokens a round added, indexed again each time
        return index.draft(grown, 3)
    print(f"NgramIndex, a round after 4 new tokens: {best_ms(next_round, 2000):.4f} ms")


if __name__ == "__main__":
    main()
