"""CUDA graphs of the one-token forward: a decode step of up to 64 lanes as one replay,
and the step after it launched ahead of the engine.

A graph is captured per (batch size, block-table width) at the warm-up
(`TorchModel.capture_graphs`) or on first use: batch sizes 1, 2, 4, .., 64 (a smaller
batch is padded: padding lanes have slot -1, which the kernels neither read
nor write, and a block table pointing at the scratch block, where their KV lands), widths
from 64 blocks up. Inputs reach the graph through one static int64 buffer (token, position,
slot the GDN state is read from, slot it is written to, block table of every lane) filled
with a single host-to-device copy; the graph's first kernel (`kernels.greedy.decode_start`)
gathers the embedding rows and makes the rotary angles; the GDN state is updated in the
slot pools by the kernels (`SlotGDNState`), the KV is written into the blocks, and the
logits and last hidden states come back in static outputs, copied out before the next
replay. The LM head folds each lane's greedy token into a key (`kernels.greedy`) inside
the graph, so no argmax runs between replays.

Zero-copy staging (`FLAGS.zero_copy`, read at each capture: on unless NINFER_ZERO_COPY=0,
`ninfer.flags`). The copy of the inputs before a replay and of the greedy keys after it
would be stream operations of their own between two replays (batch-1 decode through the
engine was 0.85% slower with them on the H100, three runs each in turn). Instead the host
stages each launch's inputs in a row of a pinned ring, the row's first word the launch's
number; the graph's first kernel reads the row of the device's turn over the bus and copies
it into the static buffer, and its last kernel (`kernels.greedy.publish_keys`) writes the
keys into the host's ring, with the number of the launch whose row it read, and moves the
turn on. Every replay of such a graph must be launched here (`_launch` counts them): a row
staged for another launch is not used (the ring's neutral last row is: padding lanes only)
and reading that step's tokens raises (`OutOfStep`; the turn is then set back to the
host's, so the next step runs). (A benchmark that replays the graph itself captures it with
the flag off.) The kernels of the step read the staged inputs before their PDL wait, so the
first kernel fences them (`kernels.pdl.fence`: the GEMM after it lets nothing start before
it has finished).

Running ahead. Between two decode steps the host has work of its own (reading the greedy
tokens, the engine's bookkeeping, the journal): with one replay at a time the GPU idles
through it. When the caller says it will feed each lane its greedy token next (`ahead`),
`run` launches that next step before it returns, its tokens taken from the greedy keys
this step left on the device (the host stages -1 for them), and the next `run` adopts it
if it asks for exactly that step: the same lanes in the same order, each lane's greedy
token, the next position, the same KV blocks.
Anything else drops it. A step run ahead must leave nothing behind when it is dropped:
- its GDN states go to the lanes' twin slots (`TorchModel.twin`); adopting it flips the
  lanes to them, dropping it leaves the states where they were;
- its KV lands at the next position of the lane's own blocks, past every position the lane
  has committed: nothing reads it there, and whatever the engine launches later writes
  over it in stream order;
- it is launched only where that position's block is already the lane's (the engine
  reserves it a step early when the pool can spare it: `TorchModel.runs_ahead`).
The engine writing a lane's state itself (`TorchModel._writing`) drops the step; waiting
for the engine's work (`TorchModel.synchronize`) does not wait for it. `FLAGS.run_ahead`
false turns running ahead off (the benchmark's "before").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kernels import device_kernels
from kernels.greedy import KEY_NONE, publish_keys, token_of

from ..flags import FLAGS
from .gdn import SlotGDNState
from .hybrid import HybridState
from .layers import _inv_freq

SIZES = (1, 2, 4, 8, 16, 32, 64)   # batch sizes (serve's MAX_LANES the largest)
WIDTHS = (64, 256, 1024, 4096, 16384)   # block-table columns (x block_size positions)
RING = 4   # pinned staging buffers per graph (a power of two): reused once their step completed


def bucket(values: tuple[int, ...], n: int) -> int:
    """The smallest of `values` (ascending) that holds `n`; the largest when none does."""
    return next((v for v in values if v >= n), values[-1])


def graph_shapes(*, max_context: int, block_size: int, lanes: int, verify_tokens: int = 0,
                 mtp: bool = False) -> dict[str, list[tuple[int, ...]]]:
    """Every graph shape a server of `lanes` lanes and `max_context` positions a lane can
    replay: decode (S, W), verify (S, T, W) for T = 2 .. `verify_tokens` (none below 2),
    with `mtp` the MTP head's (T, W) for T = 1 .. `FLAGS.mtp_graph_span` (a draft, a
    round's catch-up), and a next turn's delta (W,) (`turn_graphs`). S runs up to the batch
    size that holds `lanes`, W up to the width that holds a lane at `max_context` (a block
    the engine reserves early past it, for a step that never comes, and a delta whose
    padding reaches past it, are left to a capture on first use)."""
    from .spec_graphs import MAX_TOKENS
    sizes = [s for s in SIZES if s <= bucket(SIZES, lanes)]
    widths = [w for w in WIDTHS if w <= bucket(WIDTHS, -(-max_context // block_size))]
    spans = range(2, min(verify_tokens, MAX_TOKENS) + 1)
    return {"decode": [(S, W) for S in sizes for W in widths],
            "verify": [(S, T, W) for S in sizes for T in spans for W in widths],
            "mtp": [(T, W) for T in range(1, FLAGS.mtp_graph_span + 1) for W in widths]
            if mtp and verify_tokens >= 2 else [],
            "turn": [(W,) for W in widths]}


def warm_and_capture(forward, pool):
    """(graph, what forward() returned in it): forward run twice first on a side stream
    (Triton compiles, cuBLAS picks its kernels: not inside a capture), then captured into
    the memory pool `pool`. Every tensor a replay reads must be the graph's own or kept
    alive by the caller: one made outside and dropped after the capture is freed, and its
    memory handed to others while replays still read it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    S: int
    W: int
    inputs: Tensor        # [4 * S + S * W] int64: ids, positions, slots, dests, tables
    logits: Tensor        # [S, 1, V]
    hidden: Tensor        # [S, 1, D]
    keys: Tensor          # [S] int64: the greedy keys (shared by the graphs of S lanes)
    turn: Tensor | None   # zero-copy staging's device turn (None: copies between replays)
    # pinned host twins of the inputs and of the greedy tokens, with the step that used
    # them last (its event: the buffer is free again once it has completed)
    staging: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    used_by: list[torch.cuda.Event | None] = field(default_factory=list)
    launches: int = 0     # replays launched (zero-copy: the device's turn is the next's)


class OutOfStep(RuntimeError):
    """A zero-copy replay ran on the ring's neutral row, not on the launch staged for it."""


@dataclass
class _Step:
    """One launched replay's outputs (copies, in launch order on the stream)."""

    logits: Tensor | None  # [B, V] (None: not copied out)
    hidden: Tensor | None  # [B, D] (likewise)
    keys_host: Tensor     # pinned copy of the greedy keys (valid once `done` has completed)
    done: torch.cuda.Event
    lanes: int
    # zero-copy: (the keys' row, the launch's turn, its graph)
    echo: tuple[Tensor, int, _Captured] | None = None

    def greedy(self) -> list[int]:
        self.done.synchronize()
        if self.echo is not None and int(self.echo[0][0]) != self.echo[1]:
            raise OutOfStep(
                f"zero-copy staging out of step: launch {self.echo[1]} did not run on the "
                "inputs staged for it (the graph's turn was not its; a replay not launched "
                "by DecodeGraphs?): it ran on padding lanes only")
        return token_of(self.keys_host[:self.lanes]).tolist()


@dataclass
class _Ahead:
    """A step launched before it was asked for, and what it assumed."""

    step: _Step
    after: _Step          # the step whose greedy tokens it feeds
    lanes: list           # the Lane objects, in order
    slots: list[int]      # their engine slots at launch
    starts: list[int]     # the positions it feeds
    blocks: list[list[int]]  # each lane's blocks up to the one holding that position
    launched: int         # the model's launch count when it went out


class DecodeGraphs:
    """Replays of `net.forward` for one token per lane over `model`'s storage (a
    TorchModel on CUDA whose net has no MoE layer: routing syncs with the host)."""

    def __init__(self, model, compile: bool = False) -> None:
        """`compile`: torch.compile the forward before capture (fuses its elementwise
        chains; minutes of compilation at start-up)."""
        self.model = model
        self.pool = torch.cuda.graph_pool_handle()  # replays are sequential: one pool
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.keys: dict[int, Tensor] = {}  # per batch size: the greedy keys its graphs fold
        self.forward = torch.compile(model.net.forward, dynamic=False) if compile \
            else model.net.forward
        self.ahead: _Ahead | None = None
        self.adopted = self.dropped = 0   # steps run ahead, by fate (for tests and benches)

    @staticmethod
    def fits(lanes) -> bool:
        return len(lanes) <= SIZES[-1] and max(len(x.attn_blocks) for x in lanes) <= WIDTHS[-1]

    def run(self, lanes, tokens: list[int], starts: list[int], ahead: bool = False,
            outputs: bool = True) -> tuple[Tensor | None, Tensor | None, list[int]]:
        """Logits [B, V] and hidden states [B, D] (copies) and greedy tokens of one token
        per lane; with `ahead`, the next step is launched before this returns. `outputs`
        false: the caller reads only the greedy tokens, and logits and hidden states are
        not copied out (None): each copy is a kernel between two replays."""
        pending, self.ahead = self.ahead, None
        if pending is not None and self._asks_for(pending, lanes, tokens, starts) \
                and (pending.step.logits is not None or not outputs):
            for lane in lanes:  # its states are the lanes' states now
                self.model.flip[lane.slot] ^= 1
            step = pending.step
            self.adopted += 1
        else:
            if pending is not None:
                self.dropped += 1
            step = self._launch(lanes, starts, tokens, None, outputs)
        if ahead and FLAGS.run_ahead:
            self._run_ahead(step, lanes, starts, outputs)
        try:
            return step.logits, step.hidden, step.greedy()
        except OutOfStep:  # this step fails; the next runs: the turn is the host's again
            self.drop_ahead()  # (fed from this step's keys)
            cap = step.echo[2]
            cap.turn[0].fill_(cap.launches)  # after every replay launched, in stream order
            raise

    def drop_ahead(self, slot: int | None = None) -> None:
        """Forget the step run ahead (if it reads `slot`, when one is given)."""
        if self.ahead is not None and (slot is None or slot in self.ahead.slots):
            self.ahead = None
            self.dropped += 1

    def done_before_ahead(self, launched: int) -> torch.cuda.Event | None:
        """The event that ends the engine's work when the step run ahead is the only work
        launched after it (`launched`: the model's launch count now); None otherwise."""
        a = self.ahead
        return a.after.done if a is not None and a.launched == launched else None

    def _asks_for(self, a: _Ahead, lanes, tokens: list[int], starts: list[int]) -> bool:
        if len(lanes) != len(a.lanes) or starts != a.starts \
                or any(x is not y or x.slot != s for x, y, s in zip(lanes, a.lanes, a.slots,
                                                                     strict=True)):
            return False
        if tokens != a.after.greedy():
            return False
        return all(lane.attn_blocks[:len(b)] == b for lane, b in zip(lanes, a.blocks,
                                                                     strict=True))

    def _run_ahead(self, step: _Step, lanes, starts: list[int], outputs: bool) -> None:
        bs = self.model.block_size
        nxt = [p + 1 for p in starts]
        if any(p // bs >= len(lane.attn_blocks) for lane, p in zip(lanes, nxt, strict=True)):
            return  # a lane's next position needs a block the engine has not given it yet
        dests = [self.model.twin(lane.slot) for lane in lanes]
        ahead = self._launch(lanes, nxt, None, dests, outputs)
        self.ahead = _Ahead(ahead, step, list(lanes), [lane.slot for lane in lanes], nxt,
                            [lane.attn_blocks[:p // bs + 1] for lane, p in
                             zip(lanes, nxt, strict=True)], self.model.fence())

    def _launch(self, lanes, starts: list[int], tokens: list[int] | None,
                dests: list[int] | None, outputs: bool = True) -> _Step:
        """Stage the inputs, replay, and copy the outputs out (logits and hidden states
        only with `outputs`). `tokens` None: each lane's greedy token of the replay before
        (its key, left on the device); `dests` (None: in place) are where the GDN states
        go."""
        B = len(lanes)
        S = bucket(SIZES, B)
        W = bucket(WIDTHS, max(len(x.attn_blocks) for x in lanes))
        cap = self.graphs.get((S, W))
        if cap is None:
            if tokens is None:  # a capture would reset the keys that feed this step
                raise RuntimeError("a step fed from the greedy keys replays its step's graph")
            cap = self._capture(S, W)
        seq = cap.launches  # counted once launched: staging that fails launches nothing
        i = seq % RING
        if cap.used_by[i] is not None:  # its last copies may still be in flight
            cap.used_by[i].synchronize()
        staged, keys_host = cap.staging[i]
        # the pinned buffer written through numpy: a torch op per element costs microseconds
        # of host time, and the GPU idles for all of it
        host = staged.numpy()
        if cap.turn is not None:  # zero-copy: the row's first word is the launch it is for
            host[0] = seq
            host = host[1:]
        host[:2 * S] = 0
        host[2 * S:4 * S] = -1                       # padding lanes: no slot
        tables = host[4 * S:].reshape(S, W)
        tables.fill(self.model.scratch_block)
        at = self.model._at
        for b, (lane, start) in enumerate(zip(lanes, starts, strict=True)):
            host[S + b], host[2 * S + b] = start, at(lane.slot)
            host[3 * S + b] = at(lane.slot) if dests is None else dests[b]
            host[b] = -1 if tokens is None else tokens[b]
            tables[b, :len(lane.attn_blocks)] = lane.attn_blocks
        if cap.turn is None:  # (zero-copy: the graph reads them there, writes the keys)
            cap.inputs.copy_(staged, non_blocking=True)
        cap.launches += 1  # (zero-copy: the device's turn moves on with this replay)
        cap.graph.replay()
        logits = cap.logits[:B, 0].clone() if outputs else None
        hidden = cap.hidden[:B, 0].clone() if outputs else None
        echo = None
        if cap.turn is None:
            keys_host[:B].copy_(cap.keys[:B], non_blocking=True)
        else:  # the graph wrote them, after the launch its inputs were staged for
            echo, keys_host = (keys_host, seq, cap), keys_host[1:]
        done = torch.cuda.Event()
        done.record()
        cap.used_by[i] = done
        return _Step(logits, hidden, keys_host, done, B, echo)

    def _capture(self, S: int, W: int) -> _Captured:
        m = self.model
        inputs = torch.zeros(4 * S + S * W, dtype=torch.long, device=m.device)
        ids, positions = inputs[:S].view(S, 1), inputs[S:2 * S].view(S, 1)
        slots, dests = inputs[2 * S:3 * S], inputs[3 * S:4 * S]
        tables = inputs[4 * S:].view(S, W)
        slots.fill_(-1)
        dests.fill_(-1)
        tables.fill_(m.scratch_block)
        from .torch_model import PagedKV
        gdn = {i: SlotGDNState(m.conv[i], m.recurrent[i], slots, dests) for i in m.conv}
        if S not in self.keys:
            self.keys[S] = torch.full((S,), KEY_NONE, dtype=torch.long, device=m.device)
        keys = self.keys[S]
        net, c = m.net, m.config
        inv_freq = _inv_freq(c.rotary_dim, float(c.rope_theta),
                             torch.promote_types(m.dtype, torch.float32), m.device)
        start = device_kernels().decode_start
        # zero-copy staging: the pinned ring the host stages into (a row a launch, its
        # first word the launch it is for; the last row neutral, read where a row's turn is
        # not the device's: the warm-up's) and reads the keys from, and the device's turn
        ring = keys_ring = turn = None
        if FLAGS.zero_copy:
            row = torch.cat([torch.tensor([-1]), inputs.cpu()])
            ring = torch.stack([row] * (RING + 1)).pin_memory()
            keys_ring = torch.zeros(RING, 1 + S, dtype=torch.long).pin_memory()
            turn = torch.zeros(2, dtype=torch.long, device=m.device)
        fetch = {"fetch": (ring, turn, inputs)} if ring is not None else {}

        def forward():
            h, cos, sin = start(ids, positions, keys, net.model.embed_tokens.weight, inv_freq,
                                **fetch)
            kv = PagedKV(m.kv_k, m.kv_v, m.block_size, tables)
            out = self.forward(ids, positions, HybridState(gdn, kv), embedded=(h, (cos, sin)),
                               greedy=keys)
            if ring is not None:
                publish_keys(keys, keys_ring, turn)
            return out

        # (the warm-up resets the keys: a step fed from them never captures, in _launch)
        graph, out = warm_and_capture(forward, self.pool)
        cap = _Captured(graph, S, W, inputs, out.logits, out.hidden, keys, turn)
        for i in range(RING):
            cap.staging.append((ring[i], keys_ring[i]) if ring is not None else
                               (torch.zeros_like(inputs, device="cpu").pin_memory(),
                                torch.zeros(S, dtype=torch.long).pin_memory()))
            cap.used_by.append(None)
        if turn is not None:  # the warm-up moved it: in step with the host's next launch
            turn[0].fill_(cap.launches)
        self.graphs[(S, W)] = cap
        return cap
