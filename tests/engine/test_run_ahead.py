"""A model that runs greedy steps ahead of the engine (decode graphs) gets the next
position's KV block a step early, when the pool has it to spare; a pool without it costs
nothing but the step run ahead."""

from __future__ import annotations

from ninfer.engine.engine import EngineConfig, Submit
from ninfer.lifecycle.request import SamplingParams
from ninfer.model.protocol import Lane
from ninfer.model.sim_model import SimModel
from ninfer.sim.harness import Harness


class AheadSim(SimModel):
    """SimModel running greedy steps ahead of the engine, as the decode graphs do."""

    def __init__(self, **kw) -> None:
        super().__init__(runs_ahead=True, **kw)


def _decode_until(h: Harness, rid: str, frontier: int) -> object:
    while h.engine.requests[rid].cursor < frontier:
        h.step()
    return h.engine.live[rid].lane


def _harness(ahead: bool, num_blocks: int) -> Harness:
    model = AheadSim if ahead else SimModel
    return Harness(EngineConfig(max_concurrency=1), num_blocks=num_blocks, block_size=4,
                   model_factory=lambda nb, bs, ns: model(num_blocks=nb, block_size=bs,
                                                          num_slots=ns, seed=0))


def test_the_block_of_the_step_run_ahead_is_reserved_with_the_step_before():
    for ahead in (False, True):
        h = _harness(ahead, 96)
        rid = h.submit(tuple(range(1, 8)), "s", max_tokens=12)
        h.step()  # the prompt's 7 positions
        # the step that fed position 11 (a block's last) reserved [0, 12), and with a step
        # run ahead [0, 13): the block of position 12 too
        lane = _decode_until(h, rid, 12)
        assert len(lane.attn_blocks) == (4 if ahead else 3)
        h.run()
        h.check()
        assert len(h.outputs(rid)) == 12


def test_a_pool_with_no_block_to_spare_still_decodes_every_token():
    h = _harness(True, 3)  # exactly [0, 12): the step ahead's block is never there
    rid = h.submit(tuple(range(1, 8)), "s", max_tokens=5)
    h.run()
    h.check()
    assert len(h.outputs(rid)) == 5 and h.request(rid).state == "Finished"


class OutputsSim(AheadSim):
    """Records, per verify forward (the runner's batched ones; a prefill chunk goes through
    `forward_batch` too, not per position), whether the engine asked for logits and hidden
    states, and whether it let the model run the next step ahead."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.asked: list[bool] = []
        self.aheads: list[tuple[int, bool]] = []  # (lanes, ahead) per decode forward

    def forward_batch(self, items, per_position=True, ahead=False, outputs=True):
        if items and per_position:
            self.asked.append(outputs)
            if all(len(tokens) == 1 for _, tokens, _ in items):
                self.aheads.append((len(items), ahead))
        return super().forward_batch(items, per_position, ahead, outputs)


def test_no_step_runs_ahead_of_a_lanes_last_token():
    # two greedy lanes, 4 and 6 tokens: every decode step runs the next ahead but the one
    # that makes a lane's last token (the step ahead would be wasted, and the work queued
    # after it would wait for it)
    h = Harness(EngineConfig(max_concurrency=2), num_blocks=96, block_size=4,
                model_factory=lambda nb, bs, ns: OutputsSim(num_blocks=nb, block_size=bs,
                                                            num_slots=ns, seed=0))
    for rid, n in (("a", 4), ("b", 6)):
        h.engine.submit(Submit(rid, tuple(range(1, 8)), "s", "t", SamplingParams(max_tokens=n)))
    h.run()
    h.check()
    assert len(h.outputs("a")) == 4 and len(h.outputs("b")) == 6
    # the prompts make token 1 of each; then decode steps of both lanes for tokens 2..4
    # (the last of them a's last token), then b alone for 5..6
    assert h.engine.runner.model.aheads == [(2, True), (2, True), (2, False), (1, True),
                                            (1, False)]


def test_greedy_decode_without_logprobs_leaves_the_logits_out_and_only_that():
    # each batched forward of one request: greedy and no log-probabilities reads only the
    # greedy tokens (a graph step then copies nothing else out); log-probabilities or
    # sampling read the logits
    for params, wanted in ((SamplingParams(max_tokens=5), False),
                           (SamplingParams(max_tokens=5, logprobs=2), True),
                           (SamplingParams(max_tokens=5, temperature=0.7, seed=1), True)):
        h = Harness(EngineConfig(max_concurrency=1), num_blocks=96, block_size=4,
                    model_factory=lambda nb, bs, ns: OutputsSim(num_blocks=nb, block_size=bs,
                                                                num_slots=ns, seed=0))
        h.engine.submit(Submit("r", tuple(range(1, 8)), "s", "t", params))
        h.run()
        h.check()
        assert len(h.outputs("r")) == 5
        asked = h.engine.runner.model.asked
        assert asked and set(asked) == {wanted}, (params, asked)


class RoundsSim(AheadSim):
    """Its MTP head drafts the token after the right one (always rejected); records every
    verify forward's tokens per lane and whether the engine let the model run the next
    step ahead."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.rounds: list[tuple[int, bool]] = []  # (tokens fed, ahead) per verify forward

    def forward_batch(self, items, per_position=True, ahead=False, outputs=True):
        if items and per_position:
            self.rounds.append((len(items[0][1]), ahead))
        return super().forward_batch(items, per_position, ahead, outputs)

    def mtp(self, lane, position, hidden, next_token):
        out = super().mtp(lane, position, hidden, next_token)
        return out._replace(token=(out.token + 1) % self.vocab_size)


def test_with_drafting_paused_a_plain_round_runs_the_next_ahead():
    # the simulated MTP head's drafts are rejected, so drafting pauses: a round without
    # drafts whose next round drafts none is a plain greedy step, and runs the next ahead;
    # one before a probe (a round with a draft) or a lane's last token does not
    h = Harness(EngineConfig(max_concurrency=1, spec="mtp", draft_tokens=3), num_blocks=96,
                block_size=4, model_factory=lambda nb, bs, ns: RoundsSim(
                    num_blocks=nb, block_size=bs, num_slots=ns, seed=0))
    rid = h.submit(tuple(range(1, 8)), "s", max_tokens=60)
    h.run()
    h.check()  # the same tokens as a plain greedy run (the harness's oracle)
    assert len(h.outputs(rid)) == 60
    rounds = h.engine.runner.model.rounds
    assert any(fed > 1 for fed, _ in rounds)  # it drafted, then paused
    aheads = [i for i, (_, ahead) in enumerate(rounds) if ahead]
    assert len(aheads) > 20
    for i in aheads:  # only plain rounds followed by plain rounds
        assert rounds[i][0] == 1 and i + 1 < len(rounds) and rounds[i + 1][0] == 1, rounds
    probes = [i for i, (fed, _) in enumerate(rounds) if fed > 1 and i > 0]
    assert probes and all(not rounds[i - 1][1] for i in probes)


def test_steps_run_ahead_are_adopted_and_decode_a_plain_runs_tokens():
    # one greedy lane, 12 tokens: the prompt makes the first, then 11 decode steps; each but
    # the last (a lane's last token) runs the next ahead, and the next step adopts it
    h = _harness(True, 96)
    rid = h.submit(tuple(range(1, 8)), "s", max_tokens=12)
    h.run()
    h.check()  # the tokens of a plain Root run (the harness's oracle)
    model = h.engine.runner.model
    assert len(h.outputs(rid)) == 12
    assert (model.adopted, model.dropped) == (10, 0)


def test_a_simmodel_step_run_ahead_is_adopted_only_when_asked_for_and_leaves_nothing():
    """Two lanes decoded by a SimModel that runs ahead and by one that does not: mostly
    greedy steps (adopted), every fifth step tokens of our own (dropped), a slot written
    by the engine between two steps (dropped: the step ran from the state before), and
    positions past the lanes' last block (not run). Every step's outputs and the parts
    left in storage are the same in both."""
    fast, plain = (SimModel(num_blocks=16, block_size=4, num_slots=4, runs_ahead=ahead)
                   for ahead in (True, False))
    lanes = {m: [Lane(slot=i, attn_blocks=list(range(8 * i, 8 * i + 8))) for i in (0, 1)]
             for m in (fast, plain)}
    tokens = {}
    for m in (fast, plain):
        m.init_slot(Lane(slot=2))
        for lane, prompt in zip(lanes[m], ([3, 1, 4, 1, 5], [9, 2, 6, 5, 3]), strict=True):
            m.init_slot(lane)
            out = m.forward(lane, prompt, 0)
            m.accept(lane, out.states[-1])
            tokens[m] = tokens.get(m, []) + [out.greedy[-1]]
    for step, pos in enumerate(range(5, 32)):  # 32 positions a lane: the last has no next
        if step == 7:  # the engine writes a lane's slot: a step run ahead from it is stale
            for m in (fast, plain):
                m.copy_slot(2, lanes[m][1].slot)
        outs = {}
        for m in (fast, plain):
            fed = tokens[m] if step % 5 != 4 else [7, 8]
            outs[m] = m.forward_batch([(lane, [t], pos) for lane, t in zip(lanes[m], fed,
                                                                           strict=True)],
                                      ahead=m is fast)
            for lane, out in zip(lanes[m], outs[m], strict=True):
                m.accept(lane, out.states[-1])
            tokens[m] = [out.greedy[-1] for out in outs[m]]
        assert outs[fast] == outs[plain], step
    for a, b in zip(lanes[fast], lanes[plain], strict=True):
        assert fast.read_parts(a, 32, 0) == plain.read_parts(b, 32, 0)
    # 27 steps, each but the last ran the next ahead; the 5 after tokens of our own and the
    # one after the slot was written dropped theirs
    assert (fast.adopted, fast.dropped) == (20, 6)
    assert (plain.adopted, plain.dropped) == (0, 0)
