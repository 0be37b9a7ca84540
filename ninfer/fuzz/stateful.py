"""The lifecycle under Hypothesis: submit, step, cancel at any moment (a cut prefill goes
on detached when the engine detaches, and a retry may adopt it), exhaust the pools, evict,
restart, across modes none / mtp / ngram; every invariant after every engine step.

The machine of `ninfer fuzz stateful` (`run_round`) and of the stateful tests. The one
module of the package that imports hypothesis: `ninfer.fuzz.command` imports it only when
the command runs."""

from __future__ import annotations

from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ..engine.engine import EngineConfig
from ..sim.harness import Harness

VOCAB = 97
tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)


class LifecycleMachine(RuleBasedStateMachine):
    """Conversations is a bundle of session keys; each remembers its last request."""

    conversations = Bundle("conversations")
    oracle = True          # the spec predicate checked on every stored endpoint
    model_factory = None   # SimModel unless a subclass names another (the torch model)

    def __init__(self) -> None:
        super().__init__()
        self.h: Harness | None = None
        self.last: dict[str, str] = {}      # session -> its latest request id
        self.tenant: dict[str, str] = {}
        self.sessions = 0

    @initialize(spec=st.sampled_from(["mtp", "none", "ngram"]), chunk=st.integers(2, 9),
                lanes=st.integers(1, 3), blocks=st.sampled_from([40, 96, 400]),
                draft=st.integers(1, 4), detach=st.booleans())
    def boot(self, spec, chunk, lanes, blocks, draft, detach):
        config = EngineConfig(max_concurrency=lanes, prefill_chunk=chunk, spec=spec,
                              draft_tokens=draft, max_endpoints=8, endpoints_per_session=2,
                              check_reuse=True, detach_prefills=detach)
        self.h = Harness(config, num_blocks=blocks, num_slots=3 * lanes + 10,
                         oracle=self.oracle, model_factory=type(self).model_factory)

    # --- requests ----------------------------------------------------------------------

    def _submit(self, session, prompt, max_tokens, boundaries=(), shared=0):
        rid = self.h.submit(prompt, session, self.tenant[session], max_tokens=max_tokens,
                            stop_tokens=(0,), boundaries=boundaries, shared_prefix=shared)
        self.last[session] = rid
        return rid

    @rule(target=conversations, system=tokens, user=tokens, tenant=st.sampled_from("ab"),
          max_tokens=st.integers(1, 8), share=st.booleans())
    def new_conversation(self, system, user, tenant, max_tokens, share):
        self.sessions += 1
        session = f"s{self.sessions}"
        self.tenant[session] = tenant
        prompt = system + user
        self._submit(session, prompt, max_tokens, boundaries=(len(system),),
                     shared=len(system) if share else 0)
        return session

    @rule(session=conversations, user=tokens, max_tokens=st.integers(1, 8))
    def continue_conversation(self, session, user, max_tokens):
        """The next turn: the last prompt, what was generated, a new message."""
        prev = self.h.request(self.last[session])
        history = prev.prompt + self.h.outputs(prev.id)
        self._submit(session, history + tuple(user), max_tokens,
                     boundaries=(len(prev.prompt), len(history)))

    @rule(session=conversations, data=st.data(), user=tokens)
    def rewrite_earlier_turn(self, session, data, user):
        prev = self.h.request(self.last[session])
        cut = data.draw(st.integers(1, len(prev.prompt)), label="cut")
        self._submit(session, prev.prompt[:cut] + tuple(user), 4, boundaries=(cut,))

    @rule(session=conversations)
    def retry(self, session):
        """The same messages again (the seed's second request)."""
        prev = self.h.request(self.last[session])
        self._submit(session, prev.prompt, prev.params.max_tokens, boundaries=prev.boundaries)

    @rule(target=conversations, session=conversations)
    def same_messages_other_tenant(self, session):
        """Another tenant sends the very same prompt (a shared system prompt and task):
        nothing of the first tenant's, endpoint or detached prefill, may serve it."""
        prev = self.h.request(self.last[session])
        self.sessions += 1
        other = f"s{self.sessions}"
        self.tenant[other] = "b" if self.tenant[session] == "a" else "a"
        self._submit(other, prev.prompt, prev.params.max_tokens, boundaries=prev.boundaries)
        return other

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):  # the invariants after every engine step, not only every rule:
            self.h.step()   # a bad endpoint is caught before a later step plans from it
            self.h.check()

    def _live(self):
        return [r for r in self.h.engine.requests.values()
                if r.state not in ("Finished", "Cancelled", "Failed")]

    @precondition(lambda self: self.h is not None and self._live())
    @rule(data=st.data())
    def cancel(self, data):
        """A client disconnect, in whatever state the request is in now."""
        request = data.draw(st.sampled_from(self._live()), label="request")
        self.h.engine.cancel(request.id)
        self.h.step()

    @precondition(lambda self: self.h is not None and any(
        r.session in self.last for r in self._live()))
    @rule(data=st.data(), steps=st.integers(0, 3))
    def cancel_then_retry(self, data, steps):
        """The seed's client: cut a request, send the same messages again at once."""
        request = data.draw(st.sampled_from([r for r in self._live() if r.session in self.last]),
                            label="request")
        self.h.engine.cancel(request.id)
        self.h.step()
        self._submit(request.session, request.prompt, request.params.max_tokens,
                     boundaries=request.boundaries)
        self.h.step(steps)

    @precondition(lambda self: self.h is not None and any(
        r.state == "Active" for r in self._live()))
    @rule(data=st.data())
    def cancel_between_draft_and_verify(self, data):
        active = [r for r in self._live() if r.state == "Active"]
        target = data.draw(st.sampled_from(active), label="request")
        self.h.engine.draft_hook = lambda request: request is target
        self.h.step()
        self.h.engine.draft_hook = None

    @precondition(lambda self: self.h is not None and any(
        x.request.state in ("Prefilling", "Active") for x in self.h.engine.live.values()))
    @rule(data=st.data())
    def preempt(self, data):
        """Memory pressure picks this lane: salvage, back to the queue, re-plan."""
        lanes = [x for x in self.h.engine.live.values()
                 if x.request.state in ("Prefilling", "Active")]
        self.h.engine.preempt(data.draw(st.sampled_from(lanes), label="lane").request.id)
        self.h.step()

    @precondition(lambda self: self.h is not None and self.h.engine.store.endpoints)
    @rule(data=st.data())
    def evict(self, data):
        endpoint = data.draw(st.sampled_from(sorted(self.h.engine.store.endpoints)),
                             label="endpoint")
        self.h.engine.evict(endpoint)

    @rule(session=consumes(conversations), size=st.integers(40, 90))
    def exhaust_pools(self, session, size):
        """A long prompt that the small pools cannot hold beside the others."""
        self._submit(session, [(i * 7) % VOCAB for i in range(size)], 3)

    @precondition(lambda self: self.h is not None)
    @rule(keep=st.booleans(), spec=st.sampled_from(["mtp", "none", "ngram"]))
    def restart(self, keep, spec):
        self.h.restart(keep_tensors=keep, spec=spec)

    # --- invariants --------------------------------------------------------------------

    @invariant()
    def invariants_hold(self):
        if self.h is not None:
            self.h.check()

    def teardown(self):
        if self.h is not None:
            self.h.run()        # everything submitted ends; no livelock
            self.h.check()


def run_round(round_seed: int, max_examples: int, steps: int = 60) -> None:
    """`max_examples` runs of the machine from Hypothesis's seed `round_seed`, up to `steps`
    rules each, no example database; raises what the first failing example raised."""
    machine = type("FuzzedLifecycle", (LifecycleMachine,), {})
    seed(round_seed)(machine)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None, database=None,
        derandomize=False, suppress_health_check=list(HealthCheck)))
