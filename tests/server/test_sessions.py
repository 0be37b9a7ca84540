"""Conversations recognised without a header: a session key from `X-Session-Id`,
`session_id`, `prompt_cache_key`, else derived from the instructions and first user message
(on by default); several private endpoints per key, so conversations interleaved under one
key each reuse their whole previous turn."""

from __future__ import annotations

import argparse

import openai
import pytest
from pydantic import ValidationError

from ninfer.server import sessions
from ninfer.server.errors import ApiError
from ninfer.server.schemas import ChatRequest, CompletionRequest
from ninfer.server.serve import add_serve_parser, settings_from
from ninfer.server.submission import request_session_key
from ninfer.server.unified import from_chat, from_completion

MODEL = "tiny-qwen3-next-v1"
SYSTEM = {"role": "system", "content": "You are the dispatcher of a small harbour: answer "
                                       "in one line, name the berth, and keep to the tide "
                                       "table, the pilot roster and the cargo manifest."}
# long enough that the one token a next turn recomputes is under 1% of the previous turn
BRIEFING = " ".join(f"Berth {i} holds the ship Number {i * 7} until the {i}th tide."
                    for i in range(1, 13))


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def ask(client, messages, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                          temperature=0, reasoning_effort="none", **extra)


def reply(r) -> dict:
    return {"role": "assistant", "content": r.choices[0].message.content or ""}


def request_id(r) -> str:
    return r.id.split("-", 1)[1]


def whole_turn(r) -> int:
    """What the next turn may reuse of `r`: its prompt and output but the last token."""
    return r.usage.prompt_tokens + r.usage.completion_tokens - 1


def conversation_of(live, r) -> str | None:
    """The session key the journal files `r` under."""
    import contextlib
    import sqlite3
    with contextlib.closing(sqlite3.connect(f"file:{live.journal_path}?mode=ro",
                                            uri=True)) as db:
        return db.execute("SELECT conversation FROM events WHERE request = ? AND kind = "
                          "'RequestQueued'", (request_id(r),)).fetchone()[0]


def test_without_a_key_the_next_turn_reuses_the_whole_previous_turn(live, client):
    """Derived by default: the instructions and first user message name the conversation."""
    opening = [SYSTEM, {"role": "user", "content": "Which berth for the ferry? " + BRIEFING}]
    one = ask(client, opening)
    assert conversation_of(live, one).startswith("derived-")
    history = [*opening, reply(one), {"role": "user", "content": "And the tug?"}]
    two = ask(client, history)
    assert live.started(request_id(two))["plan"] == "PrivateEndpoint"
    assert two.usage.prompt_tokens_details.cached_tokens == whole_turn(one)
    three = ask(client, [*history, reply(two), {"role": "user", "content": "At what tide?"}])
    assert three.usage.prompt_tokens_details.cached_tokens == whole_turn(two)
    assert whole_turn(two) >= 0.99 * (two.usage.prompt_tokens + two.usage.completion_tokens)
    assert conversation_of(live, three) == conversation_of(live, one)


def test_with_no_derived_keys_a_request_without_one_reuses_only_shared_prefixes(live, client):
    with live.configured(derive_session_keys=False):
        opening = [SYSTEM, {"role": "user", "content": "Where does the barge go? " + BRIEFING}]
        one = ask(client, opening)
        assert conversation_of(live, one) is None
        two = ask(client, [*opening, reply(one), {"role": "user", "content": "Why?"}])
    assert live.started(request_id(two))["plan"] in ("SharedPrefix", "Root")
    assert two.usage.prompt_tokens_details.cached_tokens < one.usage.prompt_tokens // 2


def test_prompt_cache_key_names_the_conversation_in_chat_and_text_completions(live, client):
    with live.configured(derive_session_keys=False):  # the key, not a derivation, reuses
        key = {"prompt_cache_key": "codex-5f1c"}
        opening = [SYSTEM, {"role": "user", "content": "List the pilots. " + BRIEFING}]
        one = ask(client, opening, extra_body=key)
        two = ask(client, [*opening, reply(one), {"role": "user", "content": "Who is free?"}],
                  extra_body=key)
        assert conversation_of(live, two) == "cache-codex-5f1c"
        assert two.usage.prompt_tokens_details.cached_tokens == whole_turn(one)

        prompt = list(range(300, 420))
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                          temperature=0, extra_body={"prompt_cache_key": "t1"})
        output = [t for k, d, _ in live.events(request_id(first)) if k == "TokensCommitted"
                  for t in d["tokens"]]
        second = client.completions.create(model=MODEL, prompt=[*prompt, *output, 9],
                                           max_tokens=2, temperature=0,
                                           extra_body={"prompt_cache_key": "t1"})
        assert second.usage.prompt_tokens_details.cached_tokens == whole_turn(first)


@pytest.mark.parametrize("keyed", ["prompt_cache_key", "derived"])
def test_two_conversations_interleaved_under_one_key_each_reuse_their_previous_turn(
        live, client, keyed):
    """An agent's main loop and its sub-agent under one key (sent, or derived from the same
    instructions and first message): neither evicts the other."""
    extra = {"extra_body": {"prompt_cache_key": "agent-77"}} if keyed != "derived" else {}
    opening = [SYSTEM, {"role": "user", "content": f"Plan the day ({keyed}). " + BRIEFING}]
    first = ask(client, opening, **extra)
    talks = {name: [*opening, reply(first), {"role": "user", "content": ask_}]
             for name, ask_ in (("main", "Start with the ferry."),
                                ("sub", "Check the pilot roster for the ferry."))}
    last: dict[str, object] = {}
    for round_ in range(3):
        for name, messages in talks.items():
            r = ask(client, messages, **extra)
            key = conversation_of(live, r)
            assert key == conversation_of(live, first), key
            if round_:
                previous = last[name]
                assert r.usage.prompt_tokens_details.cached_tokens == whole_turn(previous)
                total = previous.usage.prompt_tokens + previous.usage.completion_tokens
                assert whole_turn(previous) >= 0.99 * total
            last[name] = r
            messages += [reply(r), {"role": "user", "content": f"Next step {round_} of {name}."}]
    live.integrity()


def _chat(**fields) -> ChatRequest:
    return ChatRequest.model_validate({"messages": [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}], **fields})


def test_the_first_source_found_wins_and_sources_never_collide():
    header = {"x-session-id": "abc"}

    def key(headers, body, derive):
        unified = (from_chat(body, default_budget=None) if isinstance(body, ChatRequest)
                   else from_completion(body))
        return request_session_key(headers, unified, derive=derive)

    full = _chat(session_id="abc", prompt_cache_key="abc")
    assert key(header, full, derive=True) == "id-abc"
    assert key({}, full, derive=True) == "id-abc"            # session_id: the header's name
    assert key({}, _chat(prompt_cache_key="abc"), derive=True) == "cache-abc"
    assert key({}, _chat(prompt_cache_key=""), derive=True).startswith("derived-")
    assert key({}, _chat(), derive=False) is None
    assert key({}, CompletionRequest(prompt="x"), derive=True) is None  # no messages
    assert key({}, CompletionRequest(prompt="x", prompt_cache_key="k"), derive=True) == "cache-k"
    derived = key({}, _chat(), derive=True)
    assert derived == "derived-" + sessions.derived_key(["sys"], "hi")
    # a client that sends the derived value itself as its key gets a key of its own
    assert key({}, _chat(prompt_cache_key=derived), derive=True) != derived
    # another adapter passes its own field among the sources (Anthropic's metadata.user_id)
    assert sessions.session_key([sessions.header_source({}), sessions.KeySource("id", None),
                                 sessions.KeySource("user", "u-1"),
                                 sessions.KeySource("derived", "d")]) == "user-u-1"
    with pytest.raises(ApiError):
        sessions.header_source({"x-session-id": "x" * 257})
    with pytest.raises(ValidationError):  # a key the journal could not store
        _chat(prompt_cache_key="\ud800")
    lone = ChatRequest.model_validate({"messages": [{"role": "user", "content": "\ud800"}]})
    assert key({}, lone, derive=True).startswith("derived-")  # the tokenizer refuses it


def _serve_args(*argv: str) -> argparse.Namespace:
    return add_serve_parser(argparse.ArgumentParser().add_subparsers()).parse_args(list(argv))


def test_serve_options_for_session_keys(live):
    assert settings_from(_serve_args()).derive_session_keys
    assert settings_from(_serve_args("--derive-session-keys")).derive_session_keys  # older
    assert not settings_from(_serve_args("--no-derive-session-keys")).derive_session_keys
    assert _serve_args().endpoints_per_session == 4
    assert _serve_args("--endpoints-per-session", "2").endpoints_per_session == 2
    assert live.engine.config.endpoints_per_session == 4


def test_history_keeps_each_branch_of_a_key_and_moves_a_branch_forward():
    from ninfer.server.history import History, Known

    def encode(text: str) -> list[int]:  # any tokenization other than the remembered one
        return [ord(c) + 1000 for c in text]

    h = History(capacity=5, per_session=2)
    h.remember("t", "k", [Known("ab", (1,)), Known("abXY", (1, 2))])
    h.remember("t", "k", [Known("ac", (3,)), Known("acZ", (3, 4))])
    enc = h.encoder(encode, "t", "k")
    assert enc("abXY!") == [1, 2, ord("!") + 1000] and enc("acZ") == [3, 4]
    assert h.encoder(encode, "t", "other")("abXY") == encode("abXY")
    h.remember("t", "k", [Known("abXY!", (1, 2, 5)), Known("abXY!?", (1, 2, 5, 6))])
    assert len(h) == 2                                # the ab branch moved forward
    assert h.encoder(encode, "t", "k")("acZ") == [3, 4]
    h.encoder(encode, "t", "k")("abXY!?")             # the ab branch is used: ac is older
    h.remember("t", "k", [Known("q", (9,))])
    enc = h.encoder(encode, "t", "k")
    assert enc("acZ") == encode("acZ") and enc("abXY!?") == [1, 2, 5, 6] and len(h) == 2
    for n in range(4):    # past the capacity in all: the least recently used key's oldest
        h.remember("t", f"k{n}", [Known("z", (n,))])
    enc = h.encoder(encode, "t", "k")
    assert len(h) == 5 and enc("q") == encode("q") and enc("abXY!?") == [1, 2, 5, 6]
    h.remember("t", "k4", [Known("z", (4,))])         # k was just used: k0 goes
    assert len(h) == 5 and h.encoder(encode, "t", "k0")("z") == encode("z")
    assert h.encoder(encode, "t", "k")("abXY!?") == [1, 2, 5, 6]


def test_a_turn_sent_again_with_another_message_still_splices_the_history_before_it():
    """A retry (the last user message edited, or the turn regenerated) starts with the
    history the previous attempt moved forward from, not with that attempt: it is spliced
    from the history's remembered ids, not encoded whole (a 16K conversation's whole
    encoding took 55 ms on the CPU, every retry)."""
    from ninfer.server.history import History, Known
    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return [ord(c) + 1000 for c in text]

    h = History()
    h.remember("t", "k", [Known("ab", (1,)), Known("abR", (1, 2))])
    assert h.encoder(encode, "t", "k")("abRu") == [1, 2, ord("u") + 1000]
    h.remember("t", "k", [Known("abRu", (1, 2, 7)), Known("abRuO", (1, 2, 7, 8))])
    calls.clear()
    assert h.encoder(encode, "t", "k")("abRv") == [1, 2, ord("v") + 1000]
    assert calls == ["v"] and len(h) == 1
    assert h.encoder(encode, "t", "k")("abRuOw") == [1, 2, 7, 8, ord("w") + 1000]
    # the next turn moves forward again: the kept entry is the turn before it, one only
    h.remember("t", "k", [Known("abRuOw", (1, 2, 7, 8, 9)), Known("abRuOwP", (1, 2, 7, 8, 9, 5))])
    assert [k.text for k in h._last[("t", "k")][0]] == ["abRuO", "abRuOw", "abRuOwP"]
