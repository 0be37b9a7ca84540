"""A long conversation's journal, its rows naming earlier rows' lists (schema version 3)
against the same events written whole: bytes, and the time to write and read them back.

    .venv/bin/python bench/stop45/journal_growth.py --turns 60 --context 30000
"""
from __future__ import annotations

import argparse
import random
import time

from ninfer.lifecycle import events as ev
from ninfer.lifecycle.facts import CheckpointFacts, EndpointFacts
from ninfer.lifecycle.hashing import block_hashes, prefix_hash
from ninfer.lifecycle.journal import Journal


def turns(n: int, context: int, step: int = 60) -> list[ev.Event]:
    rng = random.Random(0)
    tokens, out = [rng.randrange(50_000) for _ in range(context)], []
    for _ in range(n):
        tokens += [rng.randrange(50_000) for _ in range(step)]
        prompt = tuple(tokens)
        out.append(ev.RequestQueued(seq=len(out) + 1, request=f"r{len(out)}", conversation="c",
                                    tenant="t", prompt_len=len(prompt),
                                    block_hashes=block_hashes(prompt), tokens=prompt))
        tokens += [rng.randrange(50_000) for _ in range(step // 2)]
        t = tuple(tokens)
        h = block_hashes(t)
        cp = CheckpointFacts(id=f"cp{len(out)}", position=len(t), block_hashes=h,
                             prefix_hash=prefix_hash(t, len(t), h), attn_kv=len(t),
                             recurrent_at=len(t), mtp_kv=len(t) - 1, hidden_at=len(t) - 1,
                             fenced=True, model="m", dtypes="d", tokens=t)
        out.append(ev.EndpointPublished(seq=len(out) + 1, request=f"r{len(out) - 1}",
                                        conversation="c", endpoint=EndpointFacts(
                                            id=f"ep{len(out)}", kind="private", tenant="t",
                                            session="c", checkpoint=cp)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=60)
    ap.add_argument("--context", type=int, default=30000)
    a = ap.parse_args()
    events = turns(a.turns, a.context)
    for name, whole in (("named", False), ("whole", True)):
        j = Journal.memory()
        t = time.perf_counter()
        for e in events:
            if whole:
                j._conn.execute("INSERT INTO events VALUES (?,?,?,?,?,?)", ev.to_row(e))
            else:
                j.append([e])
        wrote = time.perf_counter() - t
        size = sum(len(r[5]) for r in j.reader.rows())
        t = time.perf_counter()
        assert list(j.read()) == events
        read = time.perf_counter() - t
        print(f"{name}: {len(events)} rows, {size / 1e6:.1f} MB, written in {wrote * 1e3:.0f} "
              f"ms, read back in {read * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
