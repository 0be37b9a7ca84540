"""The engine keeps several private endpoints per session key: two branches of one key both
reuse their own previous turn; a branch moving forward evicts only its predecessor
(`superseded`); past `endpoints_per_session` the least recently used goes (`session_bound`),
also when a restart lowers the bound. The journal replays to the live store and passes
journal check, with token ids and without."""

import pytest

from ninfer.engine.engine import Engine, EngineConfig, Submit, make_sim_engine, run_until_idle
from ninfer.lifecycle import events as ev
from ninfer.lifecycle.checks import JournalChecker
from ninfer.lifecycle.journal import Journal
from ninfer.lifecycle.request import SamplingParams
from ninfer.lifecycle.store import ContinuationStore

SYSTEM = tuple(range(1, 24))


class Conversations:
    """A SimModel engine with an in-memory journal; turns under session keys."""

    def __init__(self, **config):
        self.journal = Journal.memory()
        self.engine = make_sim_engine(EngineConfig(check_reuse=True, **config),
                                      journal=self.journal)
        self.n = 0

    def turn(self, prompt, session="k", max_tokens=5):
        self.n += 1
        rid = f"r{self.n}"
        self.engine.submit(Submit(rid, tuple(prompt), session, "t",
                                  SamplingParams(max_tokens=max_tokens)))
        run_until_idle(self.engine)
        return self.engine.requests[rid]

    def then(self, request, user):
        """The next turn of `request`'s branch: its prompt, its output, a new message."""
        return self.turn(request.prompt + tuple(request.outputs) + tuple(user),
                         request.session)

    def started(self, request) -> ev.RequestStarted:
        return next(e for e in self.journal.read() if e.kind == "RequestStarted"
                    and e.request == request.id)

    def private_of(self, request) -> str:
        """The id of the private endpoint `request` published."""
        return next(e.endpoint.id for e in self.journal.read() if e.kind == "EndpointPublished"
                    and e.request == request.id and e.endpoint.kind == "private")

    def evicted(self) -> list[tuple[str, str]]:
        return [(e.endpoint, e.reason) for e in self.journal.read()
                if e.kind == "EndpointEvicted"]

    def branches(self, session="k") -> list[int]:
        """Positions of the key's private endpoints, in publication order."""
        return [p.facts.position for p in self.engine.store.private("t", session)]

    def check(self) -> None:
        self.engine.check_integrity()
        assert ContinuationStore.from_journal(self.journal) == self.engine.store
        JournalChecker().feed_all(self.journal.read())


def whole_turn(request) -> int:
    """What the next turn of this request's branch may reuse: all but its last token."""
    return len(request.prompt) + len(request.outputs) - 1


@pytest.mark.parametrize("journal_tokens", [True, False])
def test_two_branches_of_one_key_both_reuse_their_previous_turn(journal_tokens):
    c = Conversations(spec="mtp", journal_tokens=journal_tokens)
    main = c.turn(SYSTEM + (40, 41, 42))
    side = c.turn(SYSTEM + (50, 51))          # a sub-agent under the same key
    assert c.branches() == [whole_turn(main), whole_turn(side)]
    main2 = c.then(main, (43, 44))
    side2 = c.then(side, (52,))
    assert (c.started(main2).endpoint, c.started(main2).reuse_base) == (
        c.private_of(main), whole_turn(main))
    assert (c.started(side2).endpoint, c.started(side2).reuse_base) == (
        c.private_of(side), whole_turn(side))
    assert c.started(main2).plan == c.started(side2).plan == "PrivateEndpoint"
    # each branch moved forward: its own predecessor went, nothing else did
    assert [reason for _, reason in c.evicted()] == ["superseded", "superseded"]
    assert c.branches() == [whole_turn(main2), whole_turn(side2)]
    c.check()


def test_past_the_bound_the_least_recently_used_branch_goes():
    c = Conversations(endpoints_per_session=2)
    a = c.turn(SYSTEM + (40,))
    b = c.turn(SYSTEM + (50,))
    a2 = c.then(a, (41,))                     # a is used again: b is now the oldest
    assert c.branches() == [whole_turn(b), whole_turn(a2)]
    z = c.turn(SYSTEM + (60,))
    assert c.evicted()[-1][1] == "session_bound"
    assert c.branches() == [whole_turn(a2), whole_turn(z)]
    assert c.then(a2, (42,)).plan.kind == "PrivateEndpoint"
    assert c.then(b, (51,)).plan.kind == "Root"   # its endpoint is gone
    other = c.turn(SYSTEM + (70,), session="another key")
    assert c.branches("another key") == [whole_turn(other)]
    assert len(c.branches()) == 2
    c.check()


def test_a_restart_with_a_lower_bound_evicts_down_to_it():
    c = Conversations(endpoints_per_session=3)
    for user in (40, 50, 60):
        c.turn(SYSTEM + (user,))
    assert len(c.branches()) == 3
    old = c.engine
    held = old.close_for_restart()
    engine = Engine(old.model, EngineConfig(endpoints_per_session=1), blocks=old.blocks,
                    slots=old.slots, journal=c.journal, held=held)
    engine.recover()
    c.engine = engine
    assert [reason for _, reason in c.evicted()] == ["session_bound", "session_bound"]
    assert len(c.branches()) == 1
    c.check()
