"""The warm-up before ready: its requests go through the whole engine (a next turn from a
stored state among them), nothing it published stays, and the graph shapes it captures
cover every batch size and width a server of that size replays."""

from types import SimpleNamespace

import pytest

from ninfer.engine.engine import EngineConfig
from ninfer.engine.thread import EngineThread
from ninfer.lifecycle.checks import JournalChecker
from ninfer.model.graphs import SIZES, WIDTHS, graph_shapes
from ninfer.model.spec_graphs import MAX_TOKENS
from ninfer.model.torch_model import VERIFY_STATES_UP_TO
from ninfer.model.turn_graphs import TOKENS
from ninfer.server.warmup import LARGEST, NEW_TURN, TENANT, Planned, planned, warm_up
from ninfer.sim.harness import Harness


def _server(config: EngineConfig):
    h = Harness(config)
    h.engine.log.listeners.clear()   # the checker reads the journal afterwards instead
    thread = EngineThread(h.engine).start()
    return h, SimpleNamespace(thread=thread, boot=1)


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_the_full_warm_up_runs_each_planned_request_and_leaves_nothing(spec):
    h, server = _server(EngineConfig(spec=spec, max_concurrency=3, prefill_chunk=32,
                                     max_context=512))
    report = warm_up(server, verify_tokens=4 if spec == "mtp" else 0, full=True)
    server.thread.stop()
    assert server.thread.error is None
    assert report.requests == sum(map(len, planned(32, 512))) == 20
    assert report.reused == 7     # the next turns and the one-token turn restored a state
    # each batch of requests sent together is timed, every request named once
    names = [n for names, _ in report.batches for n in names.split(" + ")]
    assert sorted(names) == sorted(p.name for batch in planned(32, 512) for p in batch)
    assert [s for _, s in report.slowest(len(report.batches))] == \
        sorted((s for _, s in report.batches), reverse=True)
    assert 0 < sum(s for _, s in report.batches) <= report.requests_s
    assert report.graphs is None  # (a model without CUDA graphs)
    started = [e for e in h.journal.read() if e.kind == "RequestStarted"]
    assert len(started) == 20
    # a served next turn's anchors: captured at the reply's end and the message's end
    turn = next(e for e in started if e.request.endswith("-its-next-turn"))
    captured = {e.checkpoint.position for e in h.journal.read()
                if e.kind == "CheckpointCaptured" and e.request == turn.request}
    assert {turn.reuse_base + 1, turn.reuse_base + 1 + NEW_TURN - 3} <= captured
    # a first turn's too, as a served chat request's: its message's end (its prefill stops
    # there, the shapes a served prompt's kernels meet); a completion's none
    def captures(name: str) -> set[int]:
        rid = next(e.request for e in started if e.request.endswith(f"-{name}"))
        return {e.checkpoint.position for e in h.journal.read()
                if e.kind == "CheckpointCaptured" and e.request == rid}
    assert 16 - 3 in captures("half-chunk")   # planned(32, 512): a half chunk of 16
    assert 64 - 3 not in captures("one-tile")
    assert not [s for s in h.engine.store.endpoints.values() if s.facts.tenant == TENANT]
    JournalChecker().feed_all(h.journal.read())
    h.engine.check_integrity()
    assert not h.engine.store.endpoints and h.engine.blocks.free == h.engine.blocks.num_blocks


def test_the_full_warm_up_prepares_the_prefill_chunks_before_its_requests():
    """The chunk attention's plans (`TorchModel.prepare_prefill`) are built for the
    server's chunk and context before any warm-up request runs, and reported; the short
    warm-up (the CPU's) prepares nothing."""
    h, server = _server(EngineConfig(max_concurrency=2, prefill_chunk=32, max_context=512))
    calls = []

    def prepare_prefill(*, chunk, max_context):
        calls.append((chunk, max_context, h.engine.steps))
        return {"shapes": [(32, 32)], "seconds": 0.0}

    h.engine.model.prepare_prefill = prepare_prefill
    report = warm_up(server, full=True)
    assert calls == [(32, 512, calls[0][2])] and report.prefill["shapes"] == [(32, 32)]
    steps_before = calls[0][2]
    assert h.engine.steps > steps_before + report.requests   # every request came after
    calls.clear()
    server.boot = 2   # (another start's request ids)
    assert warm_up(server, full=False).prefill is None and calls == []
    server.thread.stop()


def test_a_small_context_leaves_out_the_turns_that_would_not_fit():
    h, server = _server(EngineConfig(max_concurrency=2, prefill_chunk=16, max_context=48))
    report = warm_up(server, full=True)
    server.thread.stop()
    assert 0 < report.requests < 16
    assert not [s for s in h.engine.store.endpoints.values() if s.facts.tenant == TENANT]


def test_the_short_warm_up_is_one_request():
    h, server = _server(EngineConfig())
    report = warm_up(server, full=False)
    server.thread.stop()
    assert report.requests == 1 and report.reused == 0


def test_graph_shapes_cover_the_lanes_and_the_context():
    shapes = graph_shapes(max_context=65_536, block_size=16, lanes=3, verify_tokens=4,
                          mtp=True)
    sizes = {s for s, _ in shapes["decode"]}
    widths = {w for _, w in shapes["decode"]}
    assert sizes == {1, 2, 4}                       # up to the size that holds 3 lanes
    assert widths == {w for w in WIDTHS if w <= 4096}  # 4096 blocks of 16
    assert max(widths) * 16 >= 65_536
    assert {t for _, t, _ in shapes["verify"]} == {2, 3, 4}
    assert len(shapes["verify"]) == 3 * 3 * len(widths)
    assert {t for t, _ in shapes["mtp"]} >= {1, 2, 3, 4}
    assert shapes["turn"] == [(w,) for w in sorted(widths)]   # with or without speculation
    plain = graph_shapes(max_context=100, block_size=16, lanes=SIZES[-1] + 5)
    assert plain["verify"] == plain["mtp"] == []
    assert plain["turn"] == [(WIDTHS[0],)]
    assert {s for s, _ in plain["decode"]} == set(SIZES)   # lanes past the largest: all
    assert {w for _, w in plain["decode"]} == {WIDTHS[0]}


def _forwards(p, chunk: int) -> list[tuple[int, bool]]:
    """(tokens, keeps states) of each forward of a first turn's prefill, as `Prefill.step`
    cuts it: a chunk at most, stopping at a boundary inside unless the piece is short enough
    to keep the states there in one forward (`keeps_states_up_to`)."""
    stops, start, out = sorted(set(p.bounds(0))), 0, []
    while start < p.prompt:
        end = min(start + chunk, p.prompt)
        inside = [s for s in stops if start < s < end]
        if inside and end - start > VERIFY_STATES_UP_TO:
            end, inside = inside[0], []
        out.append((end - start, bool(inside)))
        start = end
    return out


def _eager_pieces(chunk: int) -> list[int]:
    """The first turns' plain pieces an eager forward runs: more than one token (one takes
    the recurrent step), nothing kept inside, and not of a turn graph's lengths."""
    return [n for batch in planned(chunk, 4 * chunk + 1024) for p in batch if not p.after
            for n, kept in _forwards(p, chunk)
            if n > 1 and not kept and not MAX_TOKENS < n <= TOKENS]


def test_a_served_chat_prompts_forwards():
    """The cut the tests below assume, on what the H100 run of stop 46 logged: a served
    1,024-token prompt ran 1,015 tokens, then the 9 of the generation prompt."""
    assert _forwards(Planned("p", 1024, 1, tail=9), 8192) == [(1015, False), (9, False)]
    assert _forwards(Planned("p", 15, 1, first=12), 8192) == [(15, True)]
    assert _forwards(Planned("p", 80, 1, first=12), 8192) == [(12, False), (65, False),
                                                              (3, False)]


@pytest.mark.parametrize("chunk", [8192, 4096, 2048])   # the GPU default and others
def test_first_turns_cover_the_gdn_kernels_length_classes(chunk):
    """Triton specialises an integer argument on being 1, a multiple of 16 or neither: the
    GDN prefill kernels' T (a piece's tokens) and NT (its 64-token chunks). The warm-up's
    first turns, cut where a served prompt's prefill stops (its chunks and its messages'
    ends), meet every class an eagerly run piece of a served prompt can: a piece of 9 .. 32
    tokens replays a turn graph, one of 2 .. 8 has one chunk and a length 16 does not
    divide."""
    def classes(n: int) -> tuple:
        return tuple("one" if x == 1 else "x16" if x % 16 == 0 else "other"
                     for x in (n, -(-n // 64)))

    met = {classes(n) for n in _eager_pieces(chunk)}
    assert met == {(t, nt) for t in ("x16", "other") for nt in ("one", "x16", "other")}


@pytest.mark.parametrize("chunk", [8192, 2048])
def test_first_turns_cover_the_convs_tile_classes(chunk):
    """The conv update takes a piece's length to the next power of two below its tile of
    64 (2 at least) as a constexpr: a variant each. The first turns' eager pieces meet
    every class one can be in: 2, 4 and 8 (a chat prompt's system message alone, a
    generation prompt of 3 or 5 tokens) and the tile (16 and 32 are turn graphs'). The
    H100 run of stop 46 compiled the 16's after ready for a generation prompt of 9 tokens,
    which a turn graph now replays."""
    def tile(n: int) -> int:
        return 64 if n > 64 else max(2, 1 << (n - 1).bit_length())

    assert {tile(n) for n in _eager_pieces(chunk)} == {2, 4, 8, 64}


def test_after_capturing_graphs_the_largest_prefill_runs_again():
    """Capturing a CUDA graph empties the allocator's cache (`torch.cuda.graph` does), so
    the warm-up runs its largest prefill again after the captures: the first request after
    ready then finds its forward's memory cached. A model without graphs needs none."""
    h, server = _server(EngineConfig(max_concurrency=2, prefill_chunk=32, max_context=512))
    order = []
    h.engine.log.listeners.append(
        lambda e: order.append(e.request) if e.kind == "RequestStarted" else None)

    def capture_graphs(*, max_context, lanes, verify_tokens):
        order.append("captured")
        return {"count": 3, "decode": 3, "verify": 0, "mtp": 0, "turn": 0, "seconds": 0.0,
                "memory_bytes": 0}

    h.engine.model.capture_graphs = capture_graphs
    report = warm_up(server, full=True)
    server.thread.stop()
    assert server.thread.error is None
    assert report.requests == sum(map(len, planned(32, 512))) + 1
    after = order[order.index("captured") + 1:]
    assert [r.rsplit("-", 1)[-1] for r in after] == ["refill"]
    first = next(p for batch in planned(32, 512) for p in batch if p.name == LARGEST)
    prompts = {e.request: e.prompt_len for e in h.journal.read() if e.kind == "RequestQueued"}
    # (the largest forward there is: a whole chunk, then its rest)
    assert prompts[after[0]] == first.prompt > 32
    assert not [s for s in h.engine.store.endpoints.values() if s.facts.tenant == TENANT]
