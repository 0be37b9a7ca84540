"""Tensor parallelism: one thread of decisions, N of work.

Rank 0 runs the engine; its model is a `ShardedModel`, which implements the Model protocol
by sending each call to the follower ranks as a small command (the call's name and its
arguments: token ids, positions, slot and block ids, hidden states) and then running it on
its own shard. Every rank runs the same calls in the same order on its own shard of the
pools, so the pools agree by construction (rank 0's scheduler picks every block and slot
id); the all-reduces inside the forward combine the partial results (`shard.py`).

What must answer for every rank is a collective that reports each rank's outcome
(`ACKNOWLEDGED`): `synchronize` (the fence the predicate reads: rank 0's model says work
has completed only once every rank said so), `export_parts` / `read_parts` /
`reference_parts` (each rank's parts gathered; a rank's failure fails the whole) and
`import_parts` (each rank writes its own parts; one missing fails the whole). A rank that
dies or hangs makes a collective fail or time out: rank 0 raises `ModelLost` then and on
every later call.

The recurrent states a forward returns stay on the rank that made them: rank 0 hands the
engine references (`StateRef`) that each rank resolves in its own record of recent
forwards when `accept` picks one."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .protocol import Forward, Lane, MissingStatePart, ModelLost, MtpOut, Parts
from .torch_model import TorchModel

log = logging.getLogger("ninfer.model.tp")

ACKNOWLEDGED = frozenset({"open", "synchronize", "export_parts", "import_parts", "read_parts",
                          "reference_parts"})
KEPT_MODELS = 4  # models a follower keeps open (a server opens one; tests a few)
# forwards whose states `accept` may still pick: a step's (a prefill per lane and one
# verify; the engine accepts within the step that made them), with room to spare
KEPT_FORWARDS = 16


class StateRef(NamedTuple):
    """The recurrent state after position `index` of item `item` of forward `call`."""

    call: int
    item: int
    index: int


class _StateRefs(Sequence):
    def __init__(self, call: int, item: int, n: int) -> None:
        self.call, self.item, self.n = call, item, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return StateRef(self.call, self.item, range(self.n)[i])


class LaneIds(NamedTuple):
    """What a model reads of a lane: where its parts are stored."""

    slot: int
    attn_blocks: tuple[int, ...]
    mtp_blocks: tuple[int, ...]

    @classmethod
    def of(cls, lane: Lane) -> LaneIds:
        return cls(lane.slot, tuple(lane.attn_blocks), tuple(lane.mtp_blocks))

    def lane(self) -> Lane:
        return Lane(self.slot, list(self.attn_blocks), list(self.mtp_blocks))


@dataclass(frozen=True)
class HeldIds:
    """A checkpoint's storage (the protocol's HeldStorage), as sent to the ranks."""

    position: int
    attn_blocks: list[int]
    mtp_blocks: list[int]
    mtp_kv: int
    slot: int

    @classmethod
    def of(cls, held) -> HeldIds:
        return cls(held.position, list(held.attn_blocks), list(held.mtp_blocks), held.mtp_kv,
                   held.slot)


class Command(NamedTuple):
    name: str
    args: tuple
    model: int = 0   # which of the models opened in this run (`open_sharded` numbers them)


class Executor:
    """Runs commands on one rank's shard (rank 0's and every follower's alike)."""

    def __init__(self, model: TorchModel, rank: int) -> None:
        self.model, self.rank = model, rank
        self.forwards: OrderedDict[int, list[Forward]] = OrderedDict()
        self.calls = 0

    def run(self, command: Command) -> Any:
        args = command.args
        if self.model.device.type != "cpu":  # what came over the channel is on the CPU
            args = _on(args, self.model.device)
        return getattr(self, "_" + command.name)(*args)

    def _forward_batch(self, items, per_position: bool, outputs: bool) -> list[Forward]:
        self.calls += 1
        out = self.model.forward_batch([(ids.lane(), tokens, start)
                                        for ids, tokens, start in items],
                                       per_position=per_position, outputs=outputs)
        self.forwards[self.calls] = out
        while len(self.forwards) > KEPT_FORWARDS:
            self.forwards.popitem(last=False)
        return out

    def _accept(self, ids: LaneIds, ref: StateRef, hidden) -> None:
        forward = self.forwards.get(ref.call)
        if forward is None:
            raise MissingStatePart(f"the state of forward {ref.call} is no longer kept")
        self.model.accept(ids.lane(), forward[ref.item].states[ref.index], hidden)

    def _init_slot(self, ids: LaneIds) -> None:
        self.model.init_slot(ids.lane())

    def _mtp(self, ids: LaneIds, position: int, hidden, next_token: int) -> MtpOut:
        return self.model.mtp(ids.lane(), position, hidden, next_token)

    def _mtp_span(self, ids: LaneIds, start: int, hidden, next_tokens: list) -> MtpOut:
        return self.model.mtp_span(ids.lane(), start, hidden, next_tokens)

    def _copy_slot(self, src: int, dst: int) -> None:
        self.model.copy_slot(src, dst)

    def _copy_block(self, src: int, dst: int, n: int) -> None:
        self.model.copy_block(src, dst, n)

    def _export_parts(self, held: HeldIds) -> dict:
        return _cpu(self.model.export_parts(held))

    def _import_parts(self, held: HeldIds, parts: dict) -> None:
        prefix = f"rank{self.rank}/"
        mine = {k.removeprefix(prefix): v for k, v in parts.items() if k.startswith(prefix)}
        if not mine:
            raise KeyError(f"the parts hold nothing of rank {self.rank}")
        self.model.import_parts(held, mine)

    def _read_parts(self, ids: LaneIds, position: int, mtp_kv: int) -> Parts:
        return _cpu(self.model.read_parts(ids.lane(), position, mtp_kv))

    def _reference_parts(self, tokens: list[int], mtp: bool) -> Parts:
        return _cpu(self.model.reference_parts(tokens, mtp))

    def _reference_generate(self, tokens: list[int], max_tokens: int, stop_tokens) -> list:
        return self.model.reference_generate(tokens, max_tokens, stop_tokens)

    def _synchronize(self) -> None:
        self.model.synchronize()


def _cpu(value):
    """Tensors moved to the CPU, in the structure given (what a gather pickles)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if type(value) in (tuple, list):
        return type(value)(_cpu(v) for v in value)
    if isinstance(value, tuple):  # a NamedTuple (Parts, LaneIds, ...)
        return type(value)(*(_cpu(v) for v in value))
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    return value


def _on(value, device):
    """`_cpu`'s inverse: tensors moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if type(value) in (tuple, list):
        return type(value)(_on(v, device) for v in value)
    if isinstance(value, tuple):
        return type(value)(*(_on(v, device) for v in value))
    if isinstance(value, dict):
        return {k: _on(v, device) for k, v in value.items()}
    return value


class Wire:
    """How the ranks of one run talk: `channel` (rank 0's commands, `channel.py`),
    `control` (gloo: the acknowledgements and the parts gathered) and `compute` (the
    forward's all-reduces: gloo on the CPU, NCCL on GPUs); the process groups time out
    after the run's timeout, which bounds how long a stalled rank can stall the others."""

    def __init__(self, rank: int, world: int, channel, control, compute) -> None:
        self.rank, self.world = rank, world
        self.channel, self.control, self.compute = channel, control, compute
        self.sent = 0
        self.send_seconds = 0.0
        self.opened = 0  # models opened in this run (tests open several)

    def send(self, command: Command) -> None:
        import time
        t0 = time.perf_counter()
        self.channel.send(command._replace(args=_cpu(command.args)))
        self.send_seconds += time.perf_counter() - t0
        self.sent += 1

    def stop(self) -> None:
        """Rank 0: the followers are told to stop (they exit); quietly, if they are gone."""
        try:
            self.send(Command("stop", ()))
        except Exception as exc:
            log.info("the followers are gone already: %r", exc)

    def receive(self) -> Command:
        return self.channel.receive()

    def report(self, outcome: tuple[Any, str | None]) -> list[tuple[Any, str | None]] | None:
        """Each rank's (result, error) gathered on rank 0 (None on the others)."""
        import torch.distributed as dist
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(outcome, gathered, dst=0, group=self.control)
        return gathered


class ShardedModel:
    """Rank 0's model: the Model protocol over N ranks' shards (see the module docstring).
    `runs_ahead` is false: CUDA graphs do not hold the collectives."""

    runs_ahead = False
    graphs = None  # (as a TorchModel without CUDA graphs)

    def __init__(self, local: TorchModel, wire: Wire, identity: str, number: int = 0) -> None:
        self.local, self.wire, self.number = local, wire, number
        self.executor = Executor(local, 0)
        self.identity, self.dtypes = identity, local.dtypes
        self.vocab_size, self.block_size = local.vocab_size, local.block_size
        self.keeps_states_up_to = local.keeps_states_up_to
        self.world = wire.world
        self._completed = 0
        self.lost: ModelLost | None = None

    @property
    def net(self):
        return self.local.net

    # --- the wire ---------------------------------------------------------------------

    def _call(self, name: str, *args) -> Any:
        """Send the command, then run it here (a collective inside waits for the others)."""
        if self.lost is not None:
            raise self.lost
        command = Command(name, args, self.number)
        try:
            self.wire.send(command)
            if name not in ACKNOWLEDGED:
                return self.executor.run(command)
            try:
                outcome = (self.executor.run(command), None)
                failure: Exception | None = None
            except Exception as exc:  # the others still report: then it is raised
                outcome, failure = (None, repr(exc)), exc
            gathered = self.wire.report(outcome)
        except (MissingStatePart, KeyError, IndexError, ValueError):
            raise  # the engine's own mistakes: every rank made the same one
        except Exception as exc:  # a collective failed or timed out: a rank is gone
            self.lost = ModelLost(f"tensor-parallel rank lost during {name}: {exc}")
            log.critical("%s", self.lost)
            raise self.lost from exc
        if failure is not None:
            raise failure
        errors = [f"rank {r}: {err}" for r, (_, err) in enumerate(gathered) if err]
        if errors:
            raise RuntimeError(f"{name} failed on {'; '.join(errors)}")
        return [result for result, _ in gathered]

    # --- the protocol -----------------------------------------------------------------

    def forward(self, lane: Lane, tokens: Sequence[int], start: int,
                per_position: bool = False, reads: Sequence[int] | None = None) -> Forward:
        # the ranks keep every position's state (no graphs): `reads` narrows nothing
        return self.forward_batch([(lane, tokens, start)], per_position)[0]

    def forward_steps(self, lane: Lane, tokens: Sequence[int], start: int,
                      per_position: bool = False, reads: Sequence[int] | None = None):
        """One part: the ranks run a forward as one call."""
        return self.forward(lane, tokens, start, per_position, reads)
        yield  # (a generator)

    def forward_batch(self, items, per_position: bool = True, ahead: bool = False,
                      outputs: bool = True) -> list[Forward]:
        wire_items = [(LaneIds.of(lane), list(tokens), start) for lane, tokens, start in items]
        out = self._call("forward_batch", wire_items, per_position, outputs)
        call = self.executor.calls
        return [Forward(f.greedy, f.hidden, _StateRefs(call, i, len(f.states)), f.logits)
                for i, f in enumerate(out)]

    def accept(self, lane: Lane, state, hidden=None) -> None:
        if not isinstance(state, StateRef):
            raise TypeError(f"a sharded model accepts its own forwards' states, not {state!r}")
        self._call("accept", LaneIds.of(lane), state, hidden)

    def init_slot(self, lane: Lane) -> None:
        self._call("init_slot", LaneIds.of(lane))

    def load_hidden(self, slot: int):
        return self.local.load_hidden(slot)  # whole and equal on every rank

    def mtp(self, lane: Lane, position: int, hidden, next_token: int) -> MtpOut:
        return self._call("mtp", LaneIds.of(lane), position, hidden, next_token)

    def mtp_span(self, lane: Lane, start: int, hidden, next_tokens: list[int]) -> MtpOut:
        return self._call("mtp_span", LaneIds.of(lane), start, list(hidden), list(next_tokens))

    def copy_slot(self, src: int, dst: int) -> None:
        self._call("copy_slot", src, dst)

    def copy_block(self, src: int, dst: int, n: int) -> None:
        self._call("copy_block", src, dst, n)

    def export_parts(self, held) -> dict[str, Any]:
        """Every rank's parts, keyed `rank{r}/{part}`: a checkpoint file holds them all."""
        per_rank = self._call("export_parts", HeldIds.of(held))
        return {f"rank{r}/{k}": v for r, parts in enumerate(per_rank) for k, v in parts.items()}

    def import_parts(self, held, parts: dict[str, Any]) -> None:
        missing = [r for r in range(self.world)
                   if not any(k.startswith(f"rank{r}/") for k in parts)]
        if missing:  # refused before any rank writes anything
            raise KeyError(f"the parts hold nothing of rank(s) {missing}")
        self._call("import_parts", HeldIds.of(held), dict(parts))

    def read_parts(self, lane: Lane, position: int, mtp_kv: int) -> Parts:
        return _joined(self._call("read_parts", LaneIds.of(lane), position, mtp_kv))

    def reference_parts(self, tokens: Sequence[int], mtp: bool) -> Parts:
        return _joined(self._call("reference_parts", list(tokens), mtp))

    def parts_match(self, got: Parts, ref: Parts) -> str | None:
        return self.local.parts_match(got, ref)

    def reference_generate(self, tokens: Sequence[int], max_tokens: int,
                           stop_tokens: Sequence[int] = ()) -> list[int]:
        return self._call("reference_generate", list(tokens), max_tokens, tuple(stop_tokens))

    def fence(self) -> int:
        return self.local.fence()

    def completed(self, marker: int) -> bool:
        """Completed on every rank: rank 0 counts work done only once all said so."""
        return marker <= self._completed

    def synchronize(self) -> None:
        marker = self.local.fence()
        self._call("synchronize")
        self._completed = marker

    def allocator_counts(self) -> tuple[int, int] | None:
        """Rank 0's (each rank allocates alike)."""
        return self.local.allocator_counts()

    # --- measurement --------------------------------------------------------------------

    def collective_seconds(self) -> float:
        """Seconds rank 0 spent in the forward's all-reduces and gathers so far."""
        return self.local.net.collectives.seconds


def _joined(per_rank: list[Parts]) -> Parts:
    """One Parts of every rank's, rank by rank (the hidden state is whole on each)."""
    return Parts(tuple(t for p in per_rank for t in p.attn_kv),
                 tuple(t for p in per_rank for t in p.recurrent),
                 tuple(t for p in per_rank for t in p.mtp_kv), per_rank[0].hidden)


def open_sharded(wire: Wire, factory: str, options: dict,
                 local: Callable[[], TorchModel]) -> ShardedModel:
    """Rank 0: every rank opens its shard (the followers by `factory(ranks, **options)`,
    this one by `local()`); one that fails fails the whole."""
    wire.opened += 1
    command = Command("open", (factory, options), wire.opened)
    wire.send(command)
    try:
        model, error, failure = local(), None, None
    except Exception as exc:
        model, error, failure = None, repr(exc), exc
    gathered = wire.report((None, error))
    if failure is not None:
        raise failure
    errors = [f"rank {r}: {err}" for r, (_, err) in enumerate(gathered) if err]
    if errors:
        raise RuntimeError(f"opening the model failed on {'; '.join(errors)}")
    return ShardedModel(model, wire, model.identity, wire.opened)


def follow(wire: Wire, open_shard: Callable[[str, dict], TorchModel]) -> None:
    """A follower's loop: receive a command, run it on this rank's shard (`open` makes a
    fresh one by `open_shard(factory, options)`), report where the call is acknowledged;
    until rank 0 says stop (or is gone, which raises)."""
    executors: OrderedDict[int, Executor] = OrderedDict()
    while True:
        command = wire.receive()
        if command.name == "stop":
            return
        try:
            if command.name == "open":
                executors[command.model] = Executor(open_shard(*command.args), wire.rank)
                while len(executors) > KEPT_MODELS:  # the oldest, long unused
                    executors.popitem(last=False)
                result = None
            elif command.model not in executors:
                raise RuntimeError(f"model {command.model} is not open here")
            else:
                result = executors[command.model].run(command)
            outcome = (result, None)
        except Exception as exc:  # rank 0 made the same call: it hears of it if it asks
            log.warning("rank %d: %s failed: %r", wire.rank, command.name, exc)
            outcome = (None, repr(exc))
        if command.name in ACKNOWLEDGED:
            wire.report((outcome[0] if command.name != "import_parts" else None, outcome[1]))
