"""A next turn's short delta is prefilled in one forward, its anchors picked from the states
that forward kept (`Model.keeps_states_up_to`), where it used to take a forward per piece
between checkpoints; a delta longer than that still goes piece by piece. The anchors are
exact: a branch restored from one equals a recomputation (check_reuse) and a Root run."""

import pytest

from ninfer.engine.engine import EngineConfig
from ninfer.sim.harness import Harness

from ..model.nets import agree_until_tie, reference, torch_factory

FIRST = tuple((i * 7 + 3) % 90 + 1 for i in range(21))


class Forwards:
    """The model's forwards while a request prefills: (tokens fed, per_position)."""

    def __init__(self, model) -> None:
        self.seen: list[tuple[int, bool]] = []
        inner = model.forward_batch

        def forward_batch(items, per_position=True, ahead=False, outputs=True, **reads):
            self.seen.extend((len(tokens), per_position) for _, tokens, _ in items)
            return inner(items, per_position, ahead, outputs, **reads)
        model.forward_batch = forward_batch


def _turns(h, message: tuple[int, ...]):
    """Turn 1 (boundaries after the system part and the prompt), then turn 2: its sequence,
    a message and a 3-token generation prompt, with boundaries at the reply's end and the
    message's end, as the server renders a next turn. Returns turn 2, its prefill forwards
    and its boundaries."""
    rid = h.submit(FIRST, "s", max_tokens=4, boundaries=(7, len(FIRST)))
    h.run()
    h.check()
    first = h.request(rid)
    reply_end = len(first.sequence) + 1          # the reply's last token, then one more
    prompt = first.sequence + (5,) + message + (8, 9, 10)
    bounds = (7, len(FIRST), reply_end, reply_end + len(message))
    forwards = Forwards(h.engine.model)
    rid = h.submit(prompt, "s", max_tokens=4, boundaries=bounds)
    h.run()
    h.check()
    return h.request(rid), forwards.seen, bounds


def _prefill_forwards(seen, delta):
    """The forwards before decoding began: those that fed more than one token, or the first
    (decode steps feed one token each)."""
    fed, out = 0, []
    for n, per_position in seen:
        if fed >= delta:
            break
        out.append((n, per_position))
        fed += n
    return out


def _captured(h, rid):
    return sorted(e.checkpoint.position for e in h.journal.read()
                  if e.kind == "CheckpointCaptured" and e.request == rid)


@pytest.mark.parametrize("factory", [None, torch_factory], ids=["sim", "torch"])
def test_a_short_next_turn_is_one_forward_with_its_anchors_inside(factory):
    h = Harness(EngineConfig(prefill_chunk=64, auto_anchors=2, check_reuse=True),
                model_factory=factory)
    message = (11, 12, 13, 14, 15, 16)
    second, seen, bounds = _turns(h, message)
    delta = len(second.prompt) - second.plan.reuse_base
    assert second.plan.kind == "PrivateEndpoint" and delta <= h.engine.model.keeps_states_up_to
    assert _prefill_forwards(seen, delta) == [(delta, True)]
    assert {bounds[-2], bounds[-1]} <= set(_captured(h, second.id))
    # a branch at the message's end restores the anchor picked from inside the forward
    branch = second.prompt[:bounds[-1]] + (40, 41, 42)
    rid = h.submit(branch, "s", max_tokens=5, boundaries=bounds)
    h.run()
    h.check()  # (check_reuse: every restored part equals a recomputation)
    third = h.request(rid)
    assert (third.plan.kind, third.plan.reuse_base) == ("PrivateAnchor", bounds[-1])
    if factory is not None:
        ref, gaps = reference(branch, 5)
        assert agree_until_tie(third.outputs, ref, gaps)


def test_a_long_delta_goes_piece_by_piece():
    """Past keeps_states_up_to tokens the forward would keep too many states: a forward
    per piece, each captured at its end."""
    h = Harness(EngineConfig(prefill_chunk=128, auto_anchors=2, check_reuse=True))
    message = tuple(range(20, 20 + 40))
    second, seen, bounds = _turns(h, message)
    delta = len(second.prompt) - second.plan.reuse_base
    assert delta > h.engine.model.keeps_states_up_to
    pieces = [bounds[-2] - second.plan.reuse_base, bounds[-1] - bounds[-2],
              len(second.prompt) - bounds[-1]]
    assert _prefill_forwards(seen, delta) == [(n, False) for n in pieces]
    assert {bounds[-2], bounds[-1]} <= set(_captured(h, second.id))
