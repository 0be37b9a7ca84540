import dataclasses
import json

import pytest

from ninfer.lifecycle import events as ev
from ninfer.lifecycle.facts import EndpointFacts

from .factories import MTP, checkpoint

CP = checkpoint(range(20), cp_id="c1")
SAMPLES = [
    ev.RequestQueued(tenant="t", prompt_len=3, block_hashes=(1, 2), tokens=(5, 6, 7),
                     params={"max_tokens": 4, "stop_tokens": [0]}, boundaries=(2,),
                     shared_prefix=1),
    ev.RequestQueued(tenant="t", prompt_len=3, block_hashes=(), tokens=None),
    ev.RequestStarted(plan="PrivateEndpoint", endpoint="e", reuse_base=9, target=12),
    ev.PrefillCompleted(cursor=12, first_token=None),
    ev.StopReached(reason="stop_token"),
    ev.EndpointPublished(endpoint=EndpointFacts("e", "anchor", "t", "s", CP)),
    ev.PublicationRefused(checkpoint=None, position=0, reason="nothing committed"),
    ev.RequestFinished(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
    ev.RequestCancelled(at_state="Prefilling", completion_tokens=0),
    ev.RequestStarted(plan="Adopted", endpoint=None, reuse_base=40, target=60, adopted="r0"),
    ev.PrefillDetached(cursor=40, goal=59),
    ev.PrefillAdopted(by="r2", cursor=40),
    ev.RequestPreempted(at_state="Active", frontier=7),
    ev.RequestFailed(failure="interrupted", message="restart"),
    ev.PlanFallback(candidate="e", position=4, reason="covers the whole prompt"),
    ev.PrefillAdvanced(cursor=8),
    ev.CheckpointCaptured(checkpoint=CP),
    ev.TokensCommitted(tokens=(1, 2, 3), frontier=15, drafted=3, accepted=2),
    ev.EndpointEvicted(endpoint="e", reason="capacity"),
    ev.EndpointLost(endpoint="e", reason="tensors did not survive"),
    ev.ServerStarted(mode=MTP, max_concurrency=2, max_endpoints=8, options={"a": 1}),
    ev.TokensCommitted(tokens=None, frontier=15, count=3),
    ev.StoreSnapshotted(previous="journal.1-9.db",
                        store={"mode": dataclasses.asdict(MTP), "max_endpoints": 8,
                               "endpoints": []},
                        requests={"r1": {"tenant": "t", "session": None, "outputs": 2}},
                        max_concurrency=2),
]


def test_without_token_ids_keeps_the_count_and_nothing_else_changes():
    commit = ev.TokensCommitted(tokens=(4, 5), frontier=9, logprobs=({"token": 4},))
    bare = ev.without_token_ids(commit)
    assert (bare.tokens, bare.logprobs, bare.count, bare.committed) == (None, None, 2, 2)
    assert bare.frontier == 9 and commit.committed == 2
    assert ev.without_token_ids(SAMPLES[0]) is SAMPLES[0]


def test_samples_cover_every_kind():
    assert {type(s).kind for s in SAMPLES} == set(ev.EVENT_TYPES)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.kind)
def test_json_round_trip(event):
    stamped = ev.with_envelope(event, 42, 1.5)
    assert ev.from_row(*ev.to_row(stamped)) == stamped
    full = dataclasses.replace(stamped, request="r1", conversation="c")
    back = ev.from_row(*ev.to_row(full))
    assert back == full and back.kind == event.kind


def test_events_are_frozen():
    with pytest.raises(AttributeError):
        SAMPLES[2].reuse_base = 0


def test_unknown_kind_names_the_seq():
    with pytest.raises(ev.UnknownEventKind, match="seq 17"):
        ev.from_row(17, 0.0, None, None, "RequestTeleported", "{}")


# the journal's text, as `json.dumps` with compact separators writes it: non-ASCII escaped,
# floats (NaN and infinities too) as repr writes them, tuples as lists
ODD = [
    ev.RequestFailed(failure="internal", message="é ✓ \"quoted\" \n \u0000 😀"),
    ev.TokensCommitted(tokens=(7,), frontier=8, logprobs=(
        {"token": 7, "logprob": -0.1 / 3, "top": [[7, float("-inf")], [3, float("nan")]]},)),
    ev.ServerStarted(mode=MTP, max_concurrency=2, max_endpoints=8,
                     options={"ratio": 1e-300, "big": 2**70, "nested": {"b": [1.5, None]}}),
]


@pytest.mark.parametrize("event", SAMPLES + ODD, ids=lambda e: e.kind)
def test_payload_text_is_json_dumps_compact(event):
    def plain(obj):   # as json.dumps would write it, long token-id lists packed
        out = {n: getattr(obj, n) for n in ev._field_names(type(obj))}
        for name in ev._nested(type(obj)):
            out[name] = plain(out[name])
        for name, tag in ev._packed(type(obj)).items():
            out[name] = None if out[name] is None else ev.pack(out[name], tag)
        return out

    assert ev.to_json(event) == json.dumps(plain(event), separators=(",", ":"))


def test_long_token_ids_are_packed_and_a_version_1_list_still_reads():
    ids = (0, 1, 151_935, 2**32 - 1) + tuple(range(1000))
    hashes = (0, 7, 2**64 - 1)
    queued = ev.RequestQueued(seq=3, request="r", tenant="t", prompt_len=len(ids),
                              block_hashes=hashes, tokens=ids)
    packed_hashes = json.loads(ev.to_json(queued))["block_hashes"]
    assert packed_hashes.startswith("u64le:") and ev.token_ids(packed_hashes) == hashes
    published = ev.EndpointPublished(endpoint=EndpointFacts(
        "e", "anchor", "t", "s", dataclasses.replace(CP, tokens=ids)))
    for event, path in ((queued, ("tokens",)), (published, ("endpoint", "checkpoint", "tokens"))):
        payload = json.loads(ev.to_json(event))
        raw = payload
        for key in path:
            raw = raw[key]
        assert isinstance(raw, str) and raw.startswith("u32le:")
        assert ev.token_ids(raw) == ids
        row = ev.to_row(event)
        assert ev.from_row(*row) == event
        # a schema version 1 row: the same payload with the ids as a JSON list
        inner = payload
        for key in path[:-1]:
            inner = inner[key]
        inner[path[-1]] = list(ids)
        assert ev.from_row(*row[:5], json.dumps(payload)) == event
    # a round's few ids stay a list (journal scan counts them in SQL)
    committed = ev.TokensCommitted(seq=4, tokens=(5, 6), frontier=9)
    assert json.loads(ev.to_json(committed))["tokens"] == [5, 6]


def test_a_packed_list_without_its_prefix_is_refused():
    with pytest.raises(ValueError, match="u32le"):
        ev.token_ids("AQAAAA==")
    assert ev.token_ids(None) is None and ev.token_ids([1, 2]) == (1, 2)
