"""A model that runs greedy steps ahead of the engine (decode graphs) gets the next
position's KV block a step early, when the pool has it to spare; a pool without it costs
nothing but the step run ahead."""

from __future__ import annotations

from ninfer.engine.engine import EngineConfig, Submit
from ninfer.lifecycle.request import SamplingParams
from ninfer.model.sim import SimModel
from ninfer.testing.harness import Harness


class AheadSim(SimModel):
    runs_ahead = True


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
    """Records, per batched forward, whether the engine asked for logits and hidden states."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.asked: list[bool] = []

    def forward_batch(self, items, per_position=True, ahead=False, outputs=True):
        if items:
            self.asked.append(outputs)
        return [self.forward(lane, tokens, start) for lane, tokens, start in items]


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
