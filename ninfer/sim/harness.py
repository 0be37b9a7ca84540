"""A SimModel engine with its journal, watched by every invariant after every event.

Used by the deterministic simulation (`ninfer fuzz sim`: simulation.py, clients.py), the
Hypothesis state machine (`ninfer fuzz stateful`) and the tests. Cheap to build: an
in-memory journal and a small SimModel.
"""

from __future__ import annotations

from dataclasses import replace

from ..engine.engine import Engine, EngineConfig, Submit, run_until_idle
from ..lifecycle import events as ev
from ..lifecycle import salvage
from ..lifecycle.checks import JournalChecker
from ..lifecycle.journal import Journal, chain
from ..lifecycle.request import SamplingParams
from ..lifecycle.store import ContinuationStore
from ..model.pools import BlockPool, SlotPool
from ..model.sim_model import SimModel

# The spec's predicate, bound at import: the oracle stays true when a test weakens the
# server's predicate (salvage.materializable) to prove the machine notices.
SPEC_PREDICATE = salvage.materializable


class Harness:
    def __init__(self, config: EngineConfig, *, num_blocks: int = 96, block_size: int = 4,
                 num_slots: int = 24, seed: int = 0, journal: Journal | None = None,
                 oracle: bool = True, model_factory=None, files_dir=None, clock=None,
                 grammars=None) -> None:
        """`model_factory(num_blocks, block_size, num_slots)` builds the model (SimModel by
        default); it is called again at a restart that loses tensors. `files_dir`: durable
        endpoints there (`EndpointFiles`), restored by a restart that loses tensors.
        `clock`: the engines' event clock (the simulator's virtual one); wall time if None.
        `grammars`: the engines' (ninfer.engine.grammar.Grammars), for constrained requests."""
        self.files_dir, self.clock, self.grammars = files_dir, clock, grammars
        self.config, self.seed = config, seed
        self.model_factory = model_factory or (
            lambda nb, bs, ns: SimModel(num_blocks=nb, block_size=bs, num_slots=ns, seed=seed))
        self.sizes = (num_blocks, block_size, num_slots)
        self._first_journal = journal if journal is not None else Journal.memory()
        self.oracle = oracle
        self.checker = JournalChecker()
        self.replica = ContinuationStore()
        self.checked_outputs: set[str] = set()
        self.ids = 0
        self.submitted: dict[str, Submit] = {}
        self.past: dict = {}                  # requests of engines before a restart
        self.misjudged: str | None = None     # the oracle's refusal of a publication
        self.engine = self._boot(None, config)

    def _boot(self, kept: tuple | None, config: EngineConfig,
              journal: Journal | None = None) -> Engine:
        num_blocks, block_size, num_slots = self.sizes
        if kept is None:
            model = self.model_factory(num_blocks, block_size, num_slots)
            blocks, slots, held = BlockPool(num_blocks, block_size), SlotPool(num_slots), None
        else:
            model, blocks, slots, held = kept
        files = None
        if self.files_dir is not None:
            from ..engine.durable import EndpointFiles
            files = EndpointFiles(self.files_dir)
        engine = Engine(model, config, blocks=blocks, slots=slots,
                        journal=self.journal if journal is None else journal,
                        held=held, endpoint_files=files, clock=self.clock,
                        grammars=self.grammars)
        engine.log.listeners.append(self.checker.feed)
        if self.oracle:  # each publication as it happens (a restore may follow in the step)
            engine.log.listeners.append(lambda e: self._judge(e, engine.mode))
        engine.recover()
        return engine

    @property
    def journal(self) -> Journal:
        """The journal file in use (the engine's: a rotation opens a new one)."""
        engine = getattr(self, "engine", None)
        return engine.journal if engine is not None else self._first_journal

    # --- driving -----------------------------------------------------------------------

    def submit(self, prompt, session: str | None, tenant: str = "t", *, max_tokens: int = 6,
               stop_tokens=(), boundaries=(), shared_prefix: int = 0) -> str:
        self.ids += 1
        rid = f"r{self.ids}"
        command = Submit(rid, tuple(prompt), session, tenant,
                         SamplingParams(max_tokens=max_tokens, stop_tokens=tuple(stop_tokens)),
                         tuple(boundaries), shared_prefix)
        self.engine.submit(command)
        self.submitted[rid] = command
        return rid

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self._driving(self.engine.step)

    def run(self, max_steps: int = 5_000) -> None:
        self._driving(lambda: run_until_idle(self.engine, max_steps))
        assert self.engine.idle(), f"engine not idle after {max_steps} steps (livelock?)"

    def request(self, rid: str):
        """The request, whether admitted yet or not, in this engine or one before a restart."""
        found = self.engine.requests.get(rid) or self.past.get(rid)
        return found if found is not None else self.submitted[rid]

    def outputs(self, rid: str) -> tuple[int, ...]:
        return tuple(getattr(self.request(rid), "outputs", ()))

    def restart(self, *, keep_tensors: bool, spec: str | None = None,
                journal: Journal | None = None, **options) -> None:
        """A crash and a restart on the same journal (`journal`: the same file reopened),
        possibly with another mode and other `EngineConfig` options."""
        engine = self.engine
        self.past.update(engine.requests)
        held = engine.close_for_restart()
        if engine.files is not None:
            engine.files.close()  # the writes in flight land (a crash that cuts one: a test)
        kept = (engine.model, engine.blocks, engine.slots, held) if keep_tensors else None
        config = replace(self.config, spec=spec or self.config.spec, **options)
        self.config = config
        self.engine = self._boot(kept, config, journal)

    def _unseen(self):
        """Journal events the replica has not folded yet, from files rotated away too."""
        start, current = self.replica.applied_seq + 1, self.journal
        if current.path != ":memory:" and current.first_seq > start:
            for path in chain(current.path)[:-1]:
                with Journal.open(path) as old:
                    yield from old.read(start)
        yield from current.read(start)

    # --- invariants --------------------------------------------------------------------

    def _judge(self, event, mode) -> None:
        """The oracle on a publication, as it happens: a refusal of the spec's predicate is
        kept and raised when the engine's step is over (raised inside the step, it would
        leave the engine torn), ahead of whatever else the step raised."""
        if isinstance(event, ev.EndpointPublished) and self.misjudged is None:
            decision = SPEC_PREDICATE(event.endpoint.checkpoint, mode)
            if not decision.ok:
                self.misjudged = (f"endpoint {event.endpoint.id} in the store (published): "
                                  f"{decision.reason}")

    def _driving(self, run) -> None:
        try:
            run()
        except Exception as exc:
            if self.misjudged is not None:
                raise AssertionError(self.misjudged) from exc
            raise
        assert self.misjudged is None, self.misjudged

    def check(self) -> None:
        """Every invariant that is not already checked event by event."""
        engine = self.engine
        engine.check_integrity()                                         # 6
        for event in self._unseen():  # 5
            self.replica.apply(event)
        assert self.replica == engine.store, "replayed store differs from the live store"
        if self.oracle:                                                  # 1
            for stored in engine.store.endpoints.values():
                decision = SPEC_PREDICATE(stored.facts.checkpoint, engine.mode)
                assert decision.ok, f"endpoint {stored.facts.id} in the store: {decision.reason}"
        for rid, request in engine.requests.items():                     # 3
            if rid in self.checked_outputs or not request.outputs or not _plain(request):
                continue
            ref = engine.model.reference_generate(request.prompt, request.params.max_tokens,
                                                  request.params.stop_tokens)
            assert request.outputs == ref[:len(request.outputs)], (
                f"{rid}: output differs from a Root run")
            if request.state in ("Finished", "Cancelled", "Failed"):
                self.checked_outputs.add(rid)


def _plain(request) -> bool:
    """Whether the request chooses its model's greedy tokens, as the Root run it is checked
    against does (not sampled, penalised, biased or held to a grammar)."""
    p = request.params
    return p.temperature <= 0 and not p.penalised and not p.shaped
