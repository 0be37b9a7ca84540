"""SimModel: the Model protocol in exact integer arithmetic.

Every state part is a deterministic hash of what it covers, stored in slots and blocks
like a real tensor, and every forward reads the stored parts: a restore that brought back
a stale or missing part changes what the model computes or raises `MissingStatePart`.
The parts: recurrent state r (a chained hash, the "GDN matrix") and the conv tail (the
last K-1 tokens); attention KV kv(i) = H(r after i); hidden(i) = (r, S_i, conv) with S_i
the sum of kv over [0, i] read from storage; the MTP KV entry at i = H(hidden(i), t_{i+1}).

Built with `runs_ahead=True` it runs greedy one-token steps ahead of the engine as the
decode graphs do (the protocol's terms): the step is computed when it is promised, its KV
written at the next position of the lane's own blocks, and handed over only if the next
forward asks for exactly it. A promise the engine broke would hand over a stale step, and
the tokens would differ from `reference_generate`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .protocol import Forward, ForwardItem, KeptOnly, Lane, MissingStatePart, MtpOut, Parts

MASK = (1 << 61) - 1
CONV = 4
KEEPS_STATES_UP_TO = 32  # as TorchModel: the engine takes the same decisions
KV_TAG, OUT_TAG, MTP_TAG, NOISE_TAG = 11, 13, 17, 19
JUNK = 23  # what a forward left after its first part wrote (`forward_steps`)


def mix(a: int, b: int) -> int:
    x = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 29
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 32
    return x & MASK


def _hash_hidden(h: tuple) -> int:
    r, s, conv = h
    acc = mix(r, s)
    for t in conv:
        acc = mix(acc, t)
    return acc


class _AheadLane(NamedTuple):
    """One lane of a step run ahead: what it assumed, and what it made."""

    lane: Lane
    slot: int
    token: int            # the greedy token of the step before, fed at `start`
    start: int
    blocks: list[int]     # the lane's blocks up to the one holding `start`
    state: tuple          # the state it started from: the step before's last
    out: Forward


class _Ahead(NamedTuple):
    lanes: list[_AheadLane]
    outputs: bool         # made with hidden states (serves any caller), or without

    def asked_for(self, items: Sequence[ForwardItem], outputs: bool, slots: list) -> bool:
        """The protocol's terms: the same lanes in the same order and slots, each fed its
        greedy token at the next position over the same blocks, and each slot holding
        the state the step started from (the engine accepted the step before, and wrote
        nothing since)."""
        return len(items) == len(self.lanes) and (self.outputs or not outputs) and all(
            lane is a.lane and lane.slot == a.slot and list(tokens) == [a.token]
            and start == a.start and lane.attn_blocks[:len(a.blocks)] == a.blocks
            and slots[lane.slot] == a.state
            for (lane, tokens, start), a in zip(items, self.lanes, strict=True))


class SimModel:
    dtypes = "sim-int64"

    def __init__(self, *, num_blocks: int, block_size: int, num_slots: int,
                 vocab_size: int = 97, seed: int = 0, draft_quality: int = 4,
                 runs_ahead: bool = False) -> None:
        self.identity = f"sim-v1-seed{seed}-vocab{vocab_size}"
        self.vocab_size, self.block_size, self.seed = vocab_size, block_size, seed
        self.draft_quality = draft_quality  # 1 in draft_quality MTP drafts is wrong
        self.runs_ahead = runs_ahead
        self.keeps_states_up_to = KEEPS_STATES_UP_TO
        self._ahead: _Ahead | None = None
        self.adopted = self.dropped = 0   # steps run ahead, by fate (for tests)
        # storage: never cleared on free, like device memory
        self.kv: list[list] = [[None] * block_size for _ in range(num_blocks)]
        self.slots: list = [None] * num_slots          # recurrent state + conv tail
        self.hidden_slots: list = [None] * num_slots   # last hidden state (MTP only)
        self._launched = self._completed = 0

    # --- arithmetic -----------------------------------------------------------------------

    def _feed(self, state: tuple, token: int) -> tuple:
        r, conv = state
        window = conv + (token,)
        acc = r
        for t in window:
            acc = mix(acc, t + 1)
        return acc, window[1:]

    def _greedy(self, hidden: tuple) -> int:
        return mix(_hash_hidden(hidden), OUT_TAG) % self.vocab_size

    def _initial(self) -> tuple:
        return mix(self.seed, 1), (0,) * (CONV - 1)

    # --- storage access ---------------------------------------------------------------------

    def _read(self, blocks: list[int], position: int, what: str):
        block, offset = divmod(position, self.block_size)
        value = self.kv[blocks[block]][offset] if block < len(blocks) else None
        if value is None:
            raise MissingStatePart(f"{what} at position {position} was never written")
        return value

    def _write(self, blocks: list[int], position: int, value) -> None:
        block, offset = divmod(position, self.block_size)
        self.kv[blocks[block]][offset] = value

    def _slot(self, lane: Lane):
        state = self.slots[lane.slot]
        if state is None:
            raise MissingStatePart(f"state slot {lane.slot} holds no recurrent state")
        return state

    # --- the protocol ----------------------------------------------------------------------

    def forward(self, lane: Lane, tokens: Sequence[int], start: int,
                per_position: bool = False, reads: Sequence[int] | None = None) -> Forward:
        out = self.forward_batch([(lane, tokens, start)], per_position)[0]
        if per_position and reads is not None:  # as strict as a model that keeps only them
            return Forward([None] * (len(tokens) - 1) + out.greedy[-1:], out.hidden,
                           KeptOnly(out.states, {*reads, len(tokens) - 1}), out.logits)
        return out

    def forward_steps(self, lane: Lane, tokens: Sequence[int], start: int,
                      per_position: bool = False, reads: Sequence[int] | None = None):
        """Two parts, as a model of layers has several: the first writes junk KV at the
        positions fed (a model's first layers write theirs before the last layers run),
        the second is the forward. A forward left after its first part leaves that junk
        past the lane's frontier, which nothing may read."""
        for i in range(len(tokens)):
            self._write(lane.attn_blocks, start + i, mix(KV_TAG, JUNK))
        yield
        return self.forward(lane, tokens, start, per_position, reads)

    def forward_batch(self, items: Sequence[ForwardItem], per_position: bool = True,
                      ahead: bool = False, outputs: bool = True) -> list[Forward]:
        """Each lane in turn (exact arithmetic gains nothing from a batch); a step run
        ahead is handed over if this call asks for exactly it, dropped otherwise. What the
        protocol lets the caller leave out is left out: a prefill's greedy tokens but the
        last, and the hidden states without `outputs` (SimModel has no logits)."""
        self._launched += len(items)
        pending, self._ahead = self._ahead, None
        if pending is not None and pending.asked_for(items, outputs, self.slots):
            self.adopted += 1
            outs = [a.out for a in pending.lanes]
        else:
            if pending is not None:
                self.dropped += 1
            outs = [self._feed_lane(lane, tokens, start, self._slot(lane), per_position,
                                    outputs) for lane, tokens, start in items]
        if ahead and self.runs_ahead:
            self._run_ahead(items, outs, outputs)
        return outs

    def _feed_lane(self, lane: Lane, tokens: Sequence[int], start: int, state: tuple,
                   per_position: bool, outputs: bool) -> Forward:
        s = 0
        for pos in range(start):
            s = (s + self._read(lane.attn_blocks, pos, "attention KV")) & MASK
        greedy, hidden, states = [], [], []
        for i, token in enumerate(tokens):
            state = self._feed(state, token)
            self._write(lane.attn_blocks, start + i, mix(KV_TAG, state[0]))
            s = (s + self._read(lane.attn_blocks, start + i, "attention KV")) & MASK
            h = (state[0], s, state[1])
            greedy.append(self._greedy(h))
            hidden.append(h)
            states.append(state)
        if not per_position:
            greedy[:-1] = [None] * (len(greedy) - 1)
        return Forward(greedy, hidden if outputs else [None] * len(hidden), states)

    def _run_ahead(self, items: Sequence[ForwardItem], outs: list[Forward],
                   outputs: bool) -> None:
        """The next one-token step of every lane, fed its greedy token: only where each
        lane fed one token and already has the block of its next position."""
        if not items or any(len(tokens) != 1
                            or (start + 1) // self.block_size >= len(lane.attn_blocks)
                            for lane, tokens, start in items):
            return
        lanes = []
        for (lane, _, start), out in zip(items, outs, strict=True):
            token, state = out.greedy[-1], out.states[-1]
            step = self._feed_lane(lane, [token], start + 1, state, True, outputs)
            lanes.append(_AheadLane(lane, lane.slot, token, start + 1,
                                    lane.attn_blocks[:(start + 1) // self.block_size + 1],
                                    state, step))
        self._ahead = _Ahead(lanes, outputs)

    def accept(self, lane: Lane, state, hidden=None) -> None:
        self.slots[lane.slot] = state
        self.hidden_slots[lane.slot] = hidden

    def load_hidden(self, slot: int):
        return self.hidden_slots[slot]

    def init_slot(self, lane: Lane) -> None:
        self.slots[lane.slot] = self._initial()

    def mtp(self, lane: Lane, position: int, hidden: tuple, next_token: int) -> MtpOut:
        self._launched += 1
        entry = mix(MTP_TAG, mix(_hash_hidden(hidden), next_token))
        self._write(lane.mtp_blocks, position, entry)
        m = 0
        for pos in range(position + 1):
            m = (m + self._read(lane.mtp_blocks, pos, "MTP KV")) & MASK
        # the head predicts the main model's next step, wrong one time in draft_quality
        r, s, conv = hidden
        state = self._feed((r, conv), next_token)
        s2 = (s + mix(KV_TAG, state[0])) & MASK
        out = (state[0], s2, state[1])
        draft = self._greedy(out)
        if mix(m, NOISE_TAG) % self.draft_quality == 0:
            draft = (draft + 1) % self.vocab_size
        return MtpOut(draft, out)

    def mtp_span(self, lane: Lane, start: int, hidden: list, next_tokens: list) -> MtpOut:
        out = None
        for i, (h, token) in enumerate(zip(hidden, next_tokens, strict=True)):
            out = self.mtp(lane, start + i, h, token)
        return out

    def copy_slot(self, src: int, dst: int) -> None:
        self._launched += 1
        self.slots[dst] = self.slots[src]
        self.hidden_slots[dst] = self.hidden_slots[src]

    def copy_block(self, src: int, dst: int, n: int) -> None:
        self._launched += 1
        self.kv[dst][:n] = self.kv[src][:n]

    # Work "launches" with each call and completes at synchronize(), which the engine calls
    # when a step commits: parts written in the step in flight are not fenced yet.
    def fence(self) -> int:
        return self._launched

    def completed(self, marker: int) -> bool:
        return marker <= self._completed

    def synchronize(self) -> None:
        self._completed = self._launched

    def allocator_counts(self) -> None:
        return None

    # --- durable checkpoints ---------------------------------------------------------------

    def export_parts(self, held) -> dict:
        def entries(blocks, n):
            return [self.kv[blocks[p // self.block_size]][p % self.block_size] for p in range(n)]
        r, conv = self.slots[held.slot]
        hidden = self.hidden_slots[held.slot]
        return {"attn": entries(held.attn_blocks, held.position),
                "mtp": entries(held.mtp_blocks, held.mtp_kv),
                "slot": [r, list(conv)],
                "hidden": None if hidden is None else [hidden[0], hidden[1], list(hidden[2])]}

    def import_parts(self, held, parts: dict) -> None:
        self._launched += 1
        for blocks, values in ((held.attn_blocks, parts["attn"]), (held.mtp_blocks, parts["mtp"])):
            for p, value in enumerate(values):
                self._write(blocks, p, value)
        r, conv = parts["slot"]
        self.slots[held.slot] = (r, tuple(conv))
        h = parts["hidden"]
        self.hidden_slots[held.slot] = None if h is None else (h[0], h[1], tuple(h[2]))

    # --- exactness ------------------------------------------------------------------------

    def read_parts(self, lane: Lane, position: int, mtp_kv: int) -> Parts:
        attn = tuple(self._read(lane.attn_blocks, p, "attention KV") for p in range(position))
        mtp = tuple(self._read(lane.mtp_blocks, p, "MTP KV") for p in range(mtp_kv))
        return Parts(attn, self._slot(lane), mtp, self.hidden_slots[lane.slot])

    def reference_parts(self, tokens: Sequence[int], mtp: bool) -> Parts:
        state, s = self._initial(), 0
        attn, hiddens = [], []
        for token in tokens:
            state = self._feed(state, token)
            attn.append(mix(KV_TAG, state[0]))
            s = (s + attn[-1]) & MASK
            hiddens.append((state[0], s, state[1]))
        mtp_kv = ()
        if mtp:
            mtp_kv = tuple(mix(MTP_TAG, mix(_hash_hidden(hiddens[i]), tokens[i + 1]))
                           for i in range(len(tokens) - 1))
        return Parts(tuple(attn), state, mtp_kv, hiddens[-1] if mtp and hiddens else None)

    def parts_match(self, got: Parts, ref: Parts) -> str | None:
        """Exact arithmetic: the first part that differs at all, or None."""
        for name in Parts._fields:
            if getattr(got, name) != getattr(ref, name):
                return name
        return None

    def reference_generate(self, tokens: Sequence[int], max_tokens: int,
                           stop_tokens: Sequence[int] = ()) -> list[int]:
        """A plain Root run, no pools: the greedy continuation of `tokens`."""
        state, s = self._initial(), 0
        out: list[int] = []
        seq = list(tokens)
        i = 0
        while True:
            state = self._feed(state, seq[i])
            s = (s + mix(KV_TAG, state[0])) & MASK
            i += 1
            if i < len(seq):
                continue
            token = self._greedy((state[0], s, state[1]))
            out.append(token)
            seq.append(token)
            if len(out) >= max_tokens or token in stop_tokens:
                return out
