"""The runner: a lane's device work (prefill chunks, MTP catch-up, speculative rounds) and
the storage of checkpoints (capture, hand-over, restore, release) over the pools."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..lifecycle.facts import CheckpointFacts, Mode
from ..lifecycle.hashing import block_hashes, extend_block_hashes, prefix_hash
from ..model.pools import BlockPool, OutOfMemory, SlotPool
from ..model.protocol import Lane, MissingStatePart, Model, MtpOut
from .choice import Choice
from .speculative import NgramIndex


class ReuseMismatch(AssertionError):
    """Restored state parts differ from a recomputation: reuse was not exact (invariant 3)."""


@dataclass(eq=False)
class Held:
    """A checkpoint's storage: references to KV blocks and a state slot of its own."""

    id: str
    position: int
    tokens: tuple[int, ...]
    attn_blocks: list[int]
    mtp_blocks: list[int]
    mtp_kv: int
    slot: int
    hidden_at: int | None
    role: str
    fence: int = 0       # Model.fence() when its parts were last written
    _hashes: tuple[int, ...] = field(default=(), repr=False)

    @property
    def hashes(self) -> tuple[int, ...]:
        """Block hashes of `tokens` (hashed once, unless given at capture)."""
        if not self._hashes and self.tokens:
            self._hashes = block_hashes(self.tokens)
        return self._hashes

    def facts(self, model: Model, journal_tokens: bool) -> CheckpointFacts:
        return CheckpointFacts(
            id=self.id, position=self.position, block_hashes=self.hashes,
            prefix_hash=prefix_hash(self.tokens, self.position, self.hashes),
            attn_kv=self.position, recurrent_at=self.position,
            mtp_kv=min(self.mtp_kv, max(self.position - 1, 0)), hidden_at=self.hidden_at,
            fenced=model.completed(self.fence), model=model.identity, dtypes=model.dtypes,
            tokens=self.tokens if journal_tokens else None)


@dataclass(frozen=True, slots=True)
class Round:
    """What a speculative round produced before truncation."""

    new_tokens: list[int]   # accepted drafts then the verifier's token
    drafted: int
    accepted: int
    forward: object         # the verify Forward, for picking the state after a prefix


class Runner:
    def __init__(self, model: Model, blocks: BlockPool, slots: SlotPool, mode: Mode) -> None:
        self.model, self.blocks, self.slots, self.mode = model, blocks, slots, mode
        self.mtp = mode.spec == "mtp"

    # --- storage -----------------------------------------------------------------------

    def new_lane(self) -> Lane:
        return Lane(slot=self.slots.alloc())

    def reserve(self, lane: Lane, attn_upto: int, mtp_upto: int = 0) -> None:
        """Make the lane's block tables cover positions [0, attn_upto) and [0, mtp_upto).
        Raises OutOfMemory having allocated nothing."""
        need_a = max(self.blocks.blocks_for(attn_upto) - len(lane.attn_blocks), 0)
        need_m = max(self.blocks.blocks_for(mtp_upto) - len(lane.mtp_blocks), 0)
        if need_a + need_m > self.blocks.free:
            raise OutOfMemory(f"need {need_a + need_m} KV blocks, {self.blocks.free} free")
        lane.attn_blocks.extend(self.blocks.alloc() for _ in range(need_a))
        lane.mtp_blocks.extend(self.blocks.alloc() for _ in range(need_m))

    def allocate_held(self, cp_id: str, tokens: tuple[int, ...], mtp_kv: int,
                      hidden_at: int | None) -> Held:
        """Empty storage for a checkpoint read back from disk (the caller fills it).
        Raises OutOfMemory having allocated nothing."""
        p = len(tokens)
        need = self.blocks.blocks_for(p) + self.blocks.blocks_for(mtp_kv)
        if need > self.blocks.free or self.slots.free == 0:
            raise OutOfMemory(f"need {need} KV blocks and a slot to restore {cp_id}")
        attn = [self.blocks.alloc() for _ in range(self.blocks.blocks_for(p))]
        mtp = [self.blocks.alloc() for _ in range(self.blocks.blocks_for(mtp_kv))]
        return Held(cp_id, p, tokens, attn, mtp, mtp_kv, self.slots.alloc(), hidden_at,
                    "frontier")

    def release_lane(self, lane: Lane) -> None:
        self.blocks.release(lane.attn_blocks)
        self.blocks.release(lane.mtp_blocks)
        if lane.slot >= 0:
            self.slots.release(lane.slot)
            lane.slot = -1

    def release_held(self, held: Held) -> None:
        self.blocks.release(held.attn_blocks)
        self.blocks.release(held.mtp_blocks)
        self.slots.release(held.slot)

    def _share(self, table: list[int], positions: int) -> list[int]:
        shared = table[:self.blocks.blocks_for(positions)]
        self.blocks.share(shared)
        return shared

    def capture(self, lane: Lane, cp_id: str, tokens: Sequence[int], role: str,
                hashes: tuple[int, ...] = (), state: tuple | None = None) -> Held:
        """Snapshot the lane at len(tokens) while it goes on: blocks shared by reference
        (positions below it are never rewritten), the slot copied: the lane's, at its
        frontier, or `state` (a recurrent state and hidden state `prefill` kept at a stop
        inside its forward). `hashes`: block hashes of `tokens` or of a prefix of them, when
        the caller has them."""
        p = len(tokens)
        slot = self.slots.alloc()
        if state is None:
            self.model.copy_slot(lane.slot, slot)
        else:
            self.model.accept(Lane(slot=slot), *state)
        return Held(cp_id, p, tuple(tokens), self._share(lane.attn_blocks, p),
                    self._share(lane.mtp_blocks, min(lane.mtp_valid, p - 1)),
                    min(lane.mtp_valid, p - 1), slot, self._hidden_at(lane, p), role,
                    self.model.fence(), _hashes=extend_block_hashes(tokens, hashes))

    def extend(self, held: Held, lane: Lane) -> None:
        """The MTP layer caught up: a capture of this lane now covers more MTP KV."""
        upto = min(lane.mtp_valid, held.position - 1)
        if upto <= held.mtp_kv:
            return
        have = len(held.mtp_blocks)
        for block in lane.mtp_blocks[have:self.blocks.blocks_for(upto)]:
            self.blocks.incref(block)
            held.mtp_blocks.append(block)
        held.mtp_kv = upto
        held.fence = lane.fence

    def hand_over(self, lane: Lane, cp_id: str, tokens: Sequence[int],
                  hashes: tuple[int, ...] = ()) -> Held:
        """The lane's own storage becomes the frontier checkpoint (the request is leaving).
        `hashes`: as for `capture`."""
        p = len(tokens)
        keep_a = self.blocks.blocks_for(p)
        keep_m = self.blocks.blocks_for(min(lane.mtp_valid, p - 1))
        self.blocks.release(lane.attn_blocks[keep_a:])
        self.blocks.release(lane.mtp_blocks[keep_m:])
        held = Held(cp_id, p, tuple(tokens), lane.attn_blocks[:keep_a], lane.mtp_blocks[:keep_m],
                    min(lane.mtp_valid, p - 1), lane.slot, self._hidden_at(lane, p), "frontier",
                    lane.fence, _hashes=extend_block_hashes(tokens, hashes))
        lane.attn_blocks, lane.mtp_blocks, lane.slot = [], [], -1
        return held

    def _hidden_at(self, lane: Lane, p: int) -> int | None:
        return p - 1 if self.mtp and (p - 1) in lane.hidden else None

    def restore(self, held: Held, lane: Lane, check: bool) -> None:
        """Materialize `held` into an empty lane: full blocks shared, the partial tail block
        copied, the slot copied; MTP KV and the last hidden state too under MTP."""
        p, bs = held.position, self.blocks.block_size
        mtp_kv = held.mtp_kv if self.mtp else 0
        tails = (p % bs != 0) + (self.mtp and mtp_kv % bs != 0)
        if tails > self.blocks.free:
            raise OutOfMemory("no free block for the checkpoint's tail")
        self.model.copy_slot(held.slot, lane.slot)
        lane.attn_blocks = self._share_full(held.attn_blocks, p)
        if self.mtp:
            lane.mtp_blocks = self._share_full(held.mtp_blocks, mtp_kv)
            lane.mtp_valid = mtp_kv
            hidden = self.model.load_hidden(lane.slot)
            lane.hidden = {p - 1: hidden} if hidden is not None else {}
        lane.fence = self.model.fence()
        if check:
            self.check_reuse(lane, held.tokens[:p])

    def _share_full(self, table: list[int], n: int) -> list[int]:
        full, rest = divmod(n, self.blocks.block_size)
        out = table[:full]
        self.blocks.share(out)
        if rest:
            tail = self.blocks.alloc()
            self.model.copy_block(table[full], tail, rest)
            out.append(tail)
        return out

    def check_reuse(self, lane: Lane, tokens: Sequence[int]) -> None:
        """Invariant 3: every part the mode needs, read from storage, equals a recomputation."""
        p = len(tokens)
        need_mtp = p - 1 if self.mtp else 0
        ref = self.model.reference_parts(tokens, self.mtp)
        try:
            got = self.model.read_parts(lane, p, need_mtp)
        except MissingStatePart as exc:
            raise ReuseMismatch(f"restored checkpoint at {p}: {exc}") from exc
        if not self.mtp:  # parts the mode does not need are not compared
            got, ref = got._replace(mtp_kv=(), hidden=None), ref._replace(mtp_kv=(), hidden=None)
        differs = self.model.parts_match(got, ref)
        if differs:
            raise ReuseMismatch(f"restored {differs} at position {p} differs from a recomputation")

    # --- device work -------------------------------------------------------------------

    def init_root(self, lane: Lane) -> None:
        self.model.init_slot(lane)
        lane.fence = self.model.fence()

    def prefill(self, lane: Lane, seq: Sequence[int], start: int, end: int,
                stops: Sequence[int] = ()) -> tuple[int, object, dict[int, tuple]]:
        """Feed seq[start:end] in one forward; return the greedy token after position
        end-1, the logits there (None for a model without logits), and for each position
        in `stops` (inside (start, end), at most `Model.keeps_states_up_to` tokens fed) the
        state there as `capture` takes it."""
        out = self.model.forward(lane, seq[start:end], start, per_position=bool(stops),
                                 reads=[p - start - 1 for p in stops])
        return self._prefilled(lane, start, stops, out)

    def prefill_steps(self, lane: Lane, seq: Sequence[int], start: int, end: int,
                      stops: Sequence[int] = ()):
        """`prefill` in the model's parts (`Model.forward_steps`); the lane's state is
        accepted after the last."""
        out = yield from self.model.forward_steps(lane, seq[start:end], start,
                                                  per_position=bool(stops),
                                                  reads=[p - start - 1 for p in stops])
        return self._prefilled(lane, start, stops, out)

    def _prefilled(self, lane: Lane, start: int, stops: Sequence[int], out
                   ) -> tuple[int, object, dict[int, tuple]]:
        lane.fence = self.model.fence()
        last_hidden = out.hidden[-1] if self.mtp else None
        self.model.accept(lane, out.states[-1], last_hidden)
        if self.mtp:
            for i, h in enumerate(out.hidden):
                lane.hidden[start + i] = h
        kept = {p: (out.states[p - start - 1], out.hidden[p - start - 1] if self.mtp else None)
                for p in stops}
        return out.greedy[-1], None if out.logits is None else out.logits[-1], kept

    def mtp_catch_up(self, lane: Lane, seq: Sequence[int], upto: int) -> MtpOut | None:
        """Write MTP KV entries [mtp_valid, upto) from verified hidden states; return the
        last forward's (draft, hidden) for chaining."""
        last = None
        start = lane.mtp_valid
        if upto > start:
            hiddens = [lane.hidden.get(pos) for pos in range(start, upto)]
            if any(h is None for h in hiddens):
                missing = start + next(i for i, h in enumerate(hiddens) if h is None)
                raise MissingStatePart(f"main hidden state at {missing} is missing for the MTP "
                                       "layer")
            last = self.model.mtp_span(lane, start, hiddens, list(seq[start + 1:upto + 1]))
            lane.mtp_valid = upto
            lane.fence = self.model.fence()
        for pos in [q for q in lane.hidden if q < lane.mtp_valid and q != upto - 1]:
            del lane.hidden[pos]
        return last

    def draft(self, lane: Lane, seq: Sequence[int], frontier: int, k: int, choice: Choice,
              ngrams: NgramIndex | None = None) -> tuple[list[int], list | None]:
        """k draft tokens continuing seq (whose last token, at `frontier`, is not fed yet),
        with the distributions they were drawn from (None for a deterministic drafter).
        `ngrams`: the lane's n-gram index, kept between its rounds."""
        if k <= 0:
            return [], None
        if self.mode.spec == "ngram":
            return (ngrams or NgramIndex()).draft(seq, k), None
        if not self.mtp:
            return [], None
        # the first draft comes from the MTP forward at frontier-1; run it even if its entry
        # is already written (same verified inputs, same entry)
        lane.mtp_valid = min(lane.mtp_valid, frontier - 1)
        last = self.mtp_catch_up(lane, seq, frontier)
        if last is None:
            raise MissingStatePart(f"no MTP forward at {frontier - 1} to draft from")
        drafts, probs = [], []
        for j in range(k):
            if j:  # chained: entries written here are overwritten after verify
                last = self.model.mtp(lane, frontier + j - 1, last.hidden, drafts[-1])
            token, q = choice.draft(last.token, last.logits, drafts)
            drafts.append(token)
            probs.append(q)
        return drafts, probs

    def forward_many(self, items: list[tuple[Lane, list[int], int]], ahead: bool = False,
                     logits: bool = True) -> list:
        """Verify forwards for several lanes, in one batched call. `ahead`: each lane
        that goes on will be fed its greedy token next (the model may start on that step
        before this returns). `logits` false: no lane reads the logits (greedy choices, no
        log-probabilities), so the model may leave them out, and the hidden states too
        unless the MTP head reads them."""
        outs = self.model.forward_batch(items, per_position=True, ahead=ahead,
                                        outputs=logits or self.mtp)
        for lane, _, _ in items:
            lane.fence = self.model.fence()
        return outs

    def judge(self, drafts: list[int], probs: list | None, out, choice: Choice) -> Round:
        accepted, token = choice.accept(drafts, out.greedy, out.logits, probs)
        return Round(drafts[:accepted] + [token], len(drafts), accepted, out)

    def commit(self, lane: Lane, rnd: Round, count: int, frontier: int, seq: Sequence[int],
               catch_up: bool = True) -> None:
        """Keep `count` positions of the round: roll every part back to the last accepted
        token (recurrent state picked, MTP entries past the frontier invalidated). With
        `catch_up` the MTP layer writes the committed positions' entries now; otherwise they
        wait, with their hidden states, for the next draft or the end of the turn."""
        out = rnd.forward
        hidden = out.hidden[count - 1] if self.mtp else None
        self.model.accept(lane, out.states[count - 1], hidden)
        if self.mtp:
            lane.mtp_valid = min(lane.mtp_valid, frontier)
            for i in range(count):
                lane.hidden[frontier + i] = out.hidden[i]
            if catch_up:
                self.mtp_catch_up(lane, seq, frontier + count - 1)

    def discard_round(self, lane: Lane, frontier: int) -> None:
        """A round cut between draft and verify: wait for the drafts in flight, then drop
        them (entries written while drafting are not valid)."""
        self.model.synchronize()
        lane.mtp_valid = min(lane.mtp_valid, frontier)

