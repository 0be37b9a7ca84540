"""Prefill paced beside decoding lanes: the engine runs at most one prefill chunk per step
while a lane decodes, so a decoding lane commits between any two prefill chunks of other
requests; the chunk's size follows measured step times (a clock the test drives)."""

from __future__ import annotations

import pytest

from ninfer.engine.engine import EngineConfig, Submit, make_sim_engine
from ninfer.engine.pacing import PrefillPacing
from ninfer.lifecycle.request import SamplingParams


def _run(decode_gap: float) -> list:
    engine = make_sim_engine(EngineConfig(max_concurrency=3, prefill_chunk=8, max_context=512,
                                          decode_gap=decode_gap), num_blocks=512)
    engine.submit(Submit("decoder", tuple(range(10, 20)), None, "t",
                         SamplingParams(max_tokens=200)))
    for _ in range(3):
        engine.step()
    assert engine.requests["decoder"].state == "Active"
    for name in ("long-a", "long-b"):
        engine.submit(Submit(name, tuple(i % 90 + 3 for i in range(100)), None, "t",
                             SamplingParams(max_tokens=2)))
    events = []
    for _ in range(500):
        events += engine.step()
        if all(n in engine.requests and engine.requests[n].state not in ("Queued", "Prefilling")
               for n in ("long-a", "long-b")):
            break
    assert engine.requests["decoder"].state == "Active"  # decoding all along
    return events


def _chunks_without_a_decode_between(events) -> int:
    """Prefill chunks of other requests that followed another with no commit of the
    decoder in between."""
    since_decode, count = 0, 0
    for e in events:
        if e.kind == "TokensCommitted" and e.request == "decoder":
            since_decode = 0
        elif e.kind == "PrefillAdvanced":
            since_decode += 1
            count += since_decode > 1
    return count


def test_a_decoding_lane_commits_between_any_two_prefill_chunks():
    events = _run(decode_gap=3.0)
    assert sum(e.kind == "PrefillAdvanced" for e in events) >= 4
    assert _chunks_without_a_decode_between(events) == 0


def test_unpaced_prefills_run_side_by_side():  # the rule above is the pacing's doing
    assert _chunks_without_a_decode_between(_run(decode_gap=0.0)) > 0


def test_a_long_prompt_beside_a_decoding_lane_takes_chunks_of_the_pacings_size():
    """The size PrefillPacing chose is the chunk the engine runs (a clock that never moves
    keeps it at its smallest, 16, against the engine's chunk of 64)."""
    config = EngineConfig(max_concurrency=2, prefill_chunk=64, max_context=512,
                          decode_gap=3.0)
    steps, engine = _chunks_of_a_long_prompt(config, 200, decoding=True)
    assert engine.requests["decoder"].state == "Active" and sum(steps) >= 199
    assert len(steps) >= 12 and max(steps) <= engine.pacing.size == 16


def _chunks_of_a_long_prompt(config: EngineConfig, length: int, *, decoding: bool):
    """The tokens each prefill step took of a `length`-token prompt (beside a decoding lane
    when `decoding`), with a pacing clock that never moves; and the engine."""
    engine = make_sim_engine(config, num_blocks=512)
    engine.pacing.clock = lambda: 0.0
    if decoding:
        engine.submit(Submit("decoder", tuple(range(10, 20)), None, "t",
                             SamplingParams(max_tokens=400)))
        for _ in range(3):
            engine.step()
    engine.submit(Submit("long", tuple(i % 90 + 3 for i in range(length)), None, "t",
                         SamplingParams(max_tokens=2)))
    cursors = [0]
    for _ in range(100):
        cursors += [e.cursor for e in engine.step()
                    if e.kind == "PrefillAdvanced" and e.request == "long"]
        if engine.requests["long"].state not in ("Queued", "Prefilling"):
            break
    return [b - a for a, b in zip(cursors[:-1], cursors[1:], strict=True)], engine


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _step(pacing: PrefillPacing, clock: Clock, seconds: float, decoded: bool,
          prefilled: int, chunk_done: bool = True) -> None:
    pacing.begin()
    clock.now += seconds
    pacing.end(decoded, prefilled, chunk_done)


def test_the_chunk_beside_decoding_lanes_settles_where_its_time_meets_the_target():
    clock = Clock()
    pacing = PrefillPacing(3.0, 512, smallest=16, clock=clock)
    assert pacing.largest == 512 and pacing.size == 16
    _step(pacing, clock, 0.010, True, 0)          # a decode step: 10 ms
    assert pacing.target_s == pytest.approx(0.015)
    for _ in range(40):                             # a chunk costs 1 ms + 0.1 ms a token
        size = pacing.size
        _step(pacing, clock, 0.010 + 0.001 + 0.0001 * size, True, size)
    assert pacing.size == pytest.approx(140, abs=3)
    size = pacing.size
    _step(pacing, clock, 0.011, True, 5)            # a prompt's short tail moves nothing
    assert pacing.size == size
    _step(pacing, clock, 1.0, False, 512)           # a prefill alone moves nothing either
    assert pacing.size == size


def test_a_chunk_in_parts_is_sized_by_its_slowest_part():
    """A chunk's forward in parts, a part a step: an attention layer over a long context
    (1 ms + 0.1 ms a token) beside cheaper GDN layers (1 ms + 0.02 ms a token). The size
    settles where the slowest part meets the target (15 ms: 140 tokens), wherever that
    part falls in the chunk, not where the chunk's last part does (700)."""
    for slow_at in (0, 3):
        clock = Clock()
        pacing = PrefillPacing(3.0, 1024, smallest=16, clock=clock)
        _step(pacing, clock, 0.010, True, 0)                       # a decode step: 10 ms
        for _ in range(40):
            size = pacing.size
            for part in range(4):
                per_token = 0.0001 if part == slow_at else 0.00002
                _step(pacing, clock, 0.010 + 0.001 + per_token * size, True, size,
                      chunk_done=part == 3)
                if part < 3:
                    assert pacing.size == size   # a chunk's size moves once it is done
        assert pacing.size == pytest.approx(140, abs=3), slow_at


def test_a_gap_of_one_step_or_less_is_refused():
    with pytest.raises(ValueError):
        PrefillPacing(1.0, 512, clock=Clock())


def test_paced_from_paces_prompts_past_it_in_chunks_of_it_and_leaves_a_lone_prompt_whole():
    """`paced_from` (a GPU's 2048, here 32 against a chunk of 128): beside a decoding lane,
    a prompt of more than 32 tokens prefills 32 a step (a clock that never moves would
    shrink a chunk below 32), not a whole chunk of 128; alone, a prompt takes whole
    chunks."""
    def chunks(decoding: bool, length: int = 300) -> list[int]:
        config = EngineConfig(max_concurrency=2, prefill_chunk=128, max_context=1024,
                              decode_gap=3.0, paced_from=32)
        return _chunks_of_a_long_prompt(config, length, decoding=decoding)[0]

    beside, alone = chunks(True), chunks(False)
    assert max(beside) == 32 and len(beside) >= 9
    assert max(alone) == 128 and len(alone) <= 3
    # a prompt past 32 but within one chunk is paced too
    assert max(chunks(True, 100)) == 32 and chunks(False, 100) == [100]
    with pytest.raises(ValueError):
        EngineConfig(prefill_chunk=64, paced_from=65)


def test_a_slow_step_is_logged_with_where_its_time_went_and_what_it_did(caplog):
    """With a threshold every step at least that long is logged: its phases' times, the
    prompt tokens it prefilled by request, the lanes it decoded; without one, none is."""
    import logging
    import re
    for threshold in (0.0, None):
        engine = make_sim_engine(EngineConfig(max_concurrency=2, prefill_chunk=8,
                                              max_context=512, slow_step_s=threshold),
                                 num_blocks=64)
        engine.submit(Submit("a", tuple(range(10, 30)), None, "t", SamplingParams(max_tokens=3)))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ninfer.engine"):
            for _ in range(6):
                engine.step()
        lines = [r.getMessage() for r in caplog.records if "slow step" in r.getMessage()]
        if threshold is None:
            assert lines == []
            continue
        assert len(lines) == 6
        assert re.match(r"slow step 1: [\d.]+ ms \(admitting [\d.]+, launching [\d.]+, device "
                        r"wait [\d.]+, publishing [\d.]+, journal [\d.]+\); prefilled 8 of req#a; "
                        r"0 lanes decoding; \d+ events$", lines[0])
        assert "prefilled 4 of req#a" in lines[2]   # 20 tokens in chunks of 8: 8, 8, 4
        assert "prefilled nothing; 1 lanes decoding" in lines[3]


def test_a_slow_step_names_the_device_memory_it_allocated(caplog):
    """A model with allocator counts (CUDA's): the step that grew them says by how much;
    steps that did not, say nothing of it."""
    import logging
    engine = make_sim_engine(EngineConfig(max_concurrency=2, prefill_chunk=8, max_context=512,
                                          slow_step_s=0.0), num_blocks=64)
    counts = iter([(5, 0), (7, 1), (7, 1), (7, 1)])
    engine.model.allocator_counts = lambda: next(counts)
    engine.submit(Submit("a", tuple(range(10, 30)), None, "t", SamplingParams(max_tokens=3)))
    with caplog.at_level(logging.INFO, logger="ninfer.engine"):
        engine.step()
        engine.step()
    first, second = (r.getMessage() for r in caplog.records if "slow step" in r.getMessage())
    assert first.endswith("; device memory: 2 segments allocated, 1 allocations retried "
                          "after freeing the cache")
    assert "device memory" not in second


def _beside_a_decoder(decode_gap: float, cut_after: int | None = None):
    """A 120-token prompt (prefill chunk 64, so paced) beside a decoding lane, in a harness
    that checks every invariant; with `cut_after`, the prompt is cancelled once that many
    of its forward's parts ran. The harness, the prompt's id, and each step's (decoder
    commits, prompt's forward pending)."""
    from ninfer.sim.harness import Harness
    h = Harness(EngineConfig(max_concurrency=2, prefill_chunk=64, max_context=512,
                             decode_gap=decode_gap), num_blocks=256)
    if h.engine.pacing is not None:
        h.engine.pacing.clock = lambda: 0.0   # chunks stay at 16 tokens a step
    decoder = h.submit(tuple(range(10, 20)), "d", max_tokens=300)
    h.step(3)
    long = h.submit(tuple(i % 90 + 3 for i in range(120)), "s", max_tokens=3)
    trace, parts = [], 0
    for _ in range(200):
        before = len(h.request(decoder).outputs)
        h.step()
        live = h.engine.live.get(long)
        pending = live is not None and live.pending is not None
        parts += pending
        trace.append((len(h.request(decoder).outputs) - before, pending))
        if cut_after is not None and parts >= cut_after:
            forward = live.pending.steps
            h.engine.cancel(long)
            h.step()
            assert forward.gi_frame is None   # closed at once, not left to the collector
            break
        if h.request(long).state not in ("Queued", "Prefilling"):
            break
    return h, long, trace


def test_a_paced_chunks_forward_runs_in_parts_with_the_decoder_stepping_between():
    """Beside a decoding lane a long prompt's chunk is a forward in parts (SimModel's two):
    a step ends with the forward pending, the decoder commits a token in it, and the next
    step finishes the chunk; the prompt's tokens are those of an unpaced run."""
    h, long, trace = _beside_a_decoder(3.0)
    pending_steps = [commits for commits, pending in trace if pending]
    assert len(pending_steps) >= 7   # 120 tokens in chunks of 16: one part pending each
    assert all(commits == 1 for commits in pending_steps)
    h.run()
    h.check()
    unpaced, long_unpaced, _ = _beside_a_decoder(0.0)
    assert not any(pending for _, pending in _)
    unpaced.run()
    assert h.request(long).outputs == unpaced.request(long_unpaced).outputs


def test_a_prompt_cut_between_its_forwards_parts_publishes_only_what_was_accepted():
    """Cancelled while a chunk's forward is pending: the forward is dropped, what the prompt
    publishes is at or before its cursor (the slot was never written by the dropped part),
    and the same prompt sent again answers as it does on a fresh engine."""
    h, long, _ = _beside_a_decoder(3.0, cut_after=3)
    request = h.request(long)
    assert request.state == "Cancelled" and 0 < request.cursor < 120
    assert long not in h.engine.live
    published = [e for e in h.journal.read() if e.kind == "EndpointPublished"
                 and e.request == long]
    assert [e.endpoint.position for e in published] == [request.cursor]
    again = h.submit(tuple(i % 90 + 3 for i in range(120)), "s", max_tokens=3)
    h.run()
    h.check()
    assert h.request(again).plan.reuse_base == request.cursor   # (JUNK past it unread)
    fresh, fresh_long, _ = _beside_a_decoder(0.0)
    fresh.run()
    assert h.request(again).outputs == fresh.request(fresh_long).outputs
