"""Rows that name an earlier row's list (schema version 3): a conversation's turns write
their new tokens, not their whole context again, and read back as they were written."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ninfer.lifecycle import events as ev
from ninfer.lifecycle import listrefs
from ninfer.lifecycle.hashing import HASH_BLOCK, block_hashes
from ninfer.lifecycle.journal import Journal, JournalError
from ninfer.lifecycle.listrefs import Referrer, chained_prefix
from ninfer.lifecycle.reader import JournalReader, UnreadableEvent

from .factories import endpoint


def queued(seq: int, tokens, *, content: bool = True) -> ev.RequestQueued:
    tokens = tuple(tokens)
    return ev.RequestQueued(seq=seq, time=float(seq), request=f"r{seq}", conversation="c",
                            tenant="t", prompt_len=len(tokens),
                            block_hashes=block_hashes(tokens),
                            tokens=tokens if content else None)


def published(seq: int, tokens, *, content: bool = True) -> ev.EndpointPublished:
    return ev.EndpointPublished(seq=seq, time=float(seq), request=f"r{seq - 1}",
                                conversation="c",
                                endpoint=endpoint(tokens, ep_id=f"ep{seq}", content=content))


def conversation(turns: int, first: int = 2000, step: int = 40, *, seed: int = 0,
                 content: bool = True) -> list[ev.Event]:
    """Each turn: the prompt (all before it, and new tokens) queued, then its endpoint
    (the prompt and a reply) published."""
    rng = random.Random(seed)
    context, out = [rng.randrange(50_000) for _ in range(first)], []
    for _ in range(turns):
        context += [rng.randrange(50_000) for _ in range(step)]
        out.append(queued(len(out) + 1, context, content=content))
        context += [rng.randrange(50_000) for _ in range(step // 2)]
        out.append(published(len(out) + 1, context, content=content))
    return out


def written(events) -> tuple[Journal, list[tuple]]:
    journal = Journal.memory()
    for e in events:
        journal.append([e])
    return journal, list(journal.reader.rows())


def test_a_turn_writes_its_new_tokens_and_reads_back_whole():
    events = conversation(listrefs.MAX_DEPTH // 2)
    journal, rows = written(events)
    assert list(journal.read()) == events
    # the first row is whole; every later one names the row before it, and holds about
    # its new tokens: no more bytes at the last turn than at the second
    assert "@" not in rows[0][5] and all("le@" in r[5] for r in rows[1:])
    sizes = [len(r[5]) for r in rows]
    assert sizes[0] > 8_000 and max(sizes[2:]) < 1_500
    tokens = json.loads(rows[2][5])["tokens"]
    assert tokens.startswith(f"u32le@2+{events[1].endpoint.position}:")


def test_without_token_ids_the_hashes_are_named_all_the_same():
    events = conversation(6, content=False)
    journal, rows = written(events)
    assert list(journal.read()) == events
    assert all("u64le@" in r[5] and "u32le" not in r[5] for r in rows[1:])


def test_a_next_turn_names_its_conversation_after_others_wrote_between():
    mine = conversation(2, seed=1)
    others = [dataclasses.replace(e, seq=len(mine) + i + 1, conversation=f"other{i}")
              for i, e in enumerate(conversation(listrefs.RECENT, seed=2))]
    later = dataclasses.replace(queued(0, mine[-1].endpoint.checkpoint.tokens + (7, 8, 9)),
                                seq=len(mine) + len(others) + 1)
    journal, rows = written([*mine, *others, later])
    assert json.loads(rows[-1][5])["tokens"].startswith(f"u32le@{mine[-1].seq}+")
    assert list(journal.read())[-1] == later


def test_a_reference_chain_is_cut_at_the_depth_a_reader_may_follow():
    events = conversation(2 * listrefs.MAX_DEPTH)
    journal, rows = written(events)
    whole = [r[0] for r in rows if "le@" not in r[5]]
    assert whole[0] == 1 and len(whole) >= 2
    assert all(b - a <= listrefs.MAX_DEPTH for a, b in zip(whole, whole[1:], strict=False))
    assert list(journal.read()) == events


def test_a_hash_that_agrees_over_other_ids_is_not_trusted():
    """Block hashes that collide: the ids a reference would stand for are compared, so the
    row is written whole and reads back as it was."""
    first = queued(1, range(1000, 1400))
    other = tuple(range(5000, 5400))
    forged = ev.RequestQueued(seq=2, time=2.0, request="r2", conversation="c", tenant="t",
                              prompt_len=len(other), block_hashes=first.block_hashes,
                              tokens=other)
    journal, rows = written([first, forged])
    assert "u32le@" not in rows[1][5]
    assert list(journal.read())[1].tokens == other


def test_rows_rolled_back_are_not_named(tmp_path):
    """A transaction that failed wrote nothing: the next rows at its seqs must not name
    lists the writer remembers from it."""
    journal = Journal.open(tmp_path / "j.db")
    a = queued(1, range(2000))
    journal._conn.execute("CREATE TEMP TRIGGER no_two BEFORE INSERT ON events WHEN "
                          "NEW.seq = 2 BEGIN SELECT RAISE(ABORT, 'refused'); END")
    with pytest.raises(JournalError):
        journal.append([a, published(2, range(2050))])
    journal._conn.execute("DROP TRIGGER no_two")
    again = [queued(1, range(7000, 9000)), published(2, range(2050))]
    journal.append(again)
    assert list(journal.read()) == again
    journal.close()


def test_a_list_that_names_a_row_is_read_only_with_its_journal():
    events = conversation(2)
    _, rows = written(events)
    text = json.loads(rows[1][5])["endpoint"]["checkpoint"]["tokens"]
    with pytest.raises(ValueError, match="needs its journal"):
        ev.token_ids(text)


def test_export_writes_named_lists_whole(tmp_path, capsys):
    from ninfer.tools.journal import main
    events = conversation(4)
    journal = Journal.open(tmp_path / "j.db")
    for e in events:
        journal.append([e])
    journal.close()
    assert main(["journal", "export", str(tmp_path / "j.db"), "-o",
                 str(tmp_path / "out.jsonl")]) == 0
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [tuple(d["data"]["tokens"]) for d in lines if d["kind"] == "RequestQueued"] == \
        [e.tokens for e in events if e.kind == "RequestQueued"]


def test_a_row_holds_at_most_one_list_of_each_packing():
    for cls in ev.EVENT_TYPES.values():
        paths = ev.list_paths(cls)
        assert len(set(paths.values())) == len(paths)
    assert ev.list_paths(ev.EndpointPublished) == {
        "packed u32": ("endpoint", "checkpoint", "tokens"),
        "packed u64": ("endpoint", "checkpoint", "block_hashes")}


@given(st.lists(st.integers(0, 3), min_size=0, max_size=60),
       st.lists(st.integers(0, 3), min_size=0, max_size=60))
def test_chained_prefix_is_where_two_hash_chains_part(a, b):
    ha, hb = block_hashes([x for x in a for _ in range(HASH_BLOCK)]), \
        block_hashes([x for x in b for _ in range(HASH_BLOCK)])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert chained_prefix(ha, hb) == n


def test_short_shared_prefixes_are_written_whole():
    refs = Referrer()
    a = queued(1, range(100))
    refs.packer(a)
    b = queued(2, [*range(3 * HASH_BLOCK), *range(900, 960)])
    assert "@" not in ev.to_json(b, refs.packer(b))


def test_a_damaged_row_that_names_itself_is_refused_not_followed_round():
    events = conversation(2)
    journal, rows = written(events)
    seq, time, request, conversation_, kind, data = rows[2]
    looped = data.replace("u32le@2+", "u32le@3+")
    with pytest.raises(UnreadableEvent, match="not one before it"):
        journal.reader.decode((seq, time, request, conversation_, kind, looped))


def test_the_journal_tools_read_a_served_conversation_whose_rows_name_earlier_ones(
        tmp_path, capsys):
    """Three turns of one conversation through the engine (SimModel): its rows name the
    turn before's, and check, replay, show, stats and redrive read them as they read whole
    rows."""
    from ninfer.engine.engine import EngineConfig
    from ninfer.sim.harness import Harness
    from ninfer.tools.journal import main
    path = tmp_path / "j.db"
    journal = Journal.open(path)
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=64, max_context=2048), journal=journal,
                num_blocks=1024)
    prompt = tuple(1 + i % 90 for i in range(300))
    for turn in range(3):
        rid = h.submit(prompt, "s", max_tokens=6)
        h.run()
        assert len(h.outputs(rid)) == 6
        prompt = prompt + h.outputs(rid) + tuple(range(10 + turn, 40 + turn))
    journal.close()
    with JournalReader.open(path) as reader:
        rows = list(reader.rows(kinds=("RequestQueued", "EndpointPublished")))
    queued = [r for r in rows if r[4] == "RequestQueued"]
    assert "u32le@" not in queued[0][5] and all("u32le@" in r[5] for r in queued[1:])
    for command in ("check", "replay", "stats", "redrive"):
        assert main(["journal", command, str(path)]) == 0, command
    assert main(["journal", "show", str(path), "--conversation", "s"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("damage, why", [
    ("u32le@2+999999:", "names 999999 items of row 2's"),
    ("u32le@0+", "names row 0, which this file lacks")])
def test_a_reference_past_what_the_journal_holds_is_an_unreadable_row(damage, why):
    events = conversation(2)
    journal, rows = written(events)
    seq, time, request, conversation_, kind, data = rows[2]
    bad = data.replace("u32le@2+", damage.split("+")[0] + "+") if damage.endswith("+") \
        else re.sub(r"u32le@2\+\d+:", damage, data)
    with pytest.raises(UnreadableEvent, match=re.escape(why)):
        journal.reader.decode((seq, time, request, conversation_, kind, bad))


def test_the_writer_keeps_a_bounded_number_of_rows_and_conversations(monkeypatch):
    monkeypatch.setattr(listrefs, "CONVERSATIONS", 3)
    refs = Referrer()
    for i in range(10):
        e = dataclasses.replace(queued(i + 1, range(i, i + 200)), conversation=f"c{i}")
        refs.packer(e)
    assert len(refs.recent) == listrefs.RECENT
    assert list(refs.conversations) == ["c7", "c8", "c9"]
