"""Rank 0 of a 2-rank gloo run, as a script (a test runs it in its own process, so pytest's
process never joins a process group): the same protocol calls on a single-process model
and on the model sharded over 2 ranks, for each model directory given; prints one JSON
line per model with the largest differences and what must be equal.

    python -m tests.model.tp_check OUT.json MODEL_DIR...
"""

from __future__ import annotations

import json
import sys

import torch

from ninfer.model.protocol import Lane
from ninfer.model.ranks import launch
from ninfer.model.runtime import open_model

OPTIONS = dict(dtype="float32", kv_capacity=1024, block_size=8, num_slots=8, mtp=True)


class Diff:
    def __init__(self) -> None:
        self.worst: dict[str, float] = {}
        self.equal: dict[str, bool] = {}

    def close(self, name: str, a, b) -> None:
        d = float((a.float() - b.float()).abs().max())
        self.worst[name] = max(self.worst.get(name, 0.0), d)

    def same(self, name: str, a, b) -> None:
        self.equal[name] = self.equal.get(name, True) and a == b


def script(model, diff: Diff | None = None, other=None) -> dict:
    """Prefill in two chunks, a batched decode of two lanes, a verify rolled back, MTP
    drafts, a checkpoint exported and imported into a fresh lane and decoded from; returns
    what was computed (logits, greedy tokens) by name."""
    out: dict = {}
    a, b = Lane(0, [0, 1, 2, 3, 4], [15, 16, 17, 18, 19]), Lane(1, [5, 6, 7, 8, 9])
    prompt_a = [(i * 37 + 11) % 4000 for i in range(33)]
    prompt_b = [(i * 53 + 5) % 4000 for i in range(17)]
    for lane in (a, b):
        model.init_slot(lane)
    first = model.forward(a, prompt_a[:20], 0)
    model.accept(a, first.states[-1], first.hidden[-1])
    second = model.forward(a, prompt_a[20:], 20)
    model.accept(a, second.states[-1], second.hidden[-1])
    other_b = model.forward(b, prompt_b, 0)
    model.accept(b, other_b.states[-1], other_b.hidden[-1])
    out["prefill"] = (second.logits, second.greedy[-1])
    hidden_a = torch.cat([torch.as_tensor(first.hidden), torch.as_tensor(second.hidden)])
    na, nb = len(prompt_a), len(prompt_b)
    decode = model.forward_batch([(a, [second.greedy[-1]], na), (b, [other_b.greedy[-1]], nb)])
    out["decode"] = (torch.stack([decode[0].logits, decode[1].logits]),
                     [decode[0].greedy, decode[1].greedy])
    model.accept(a, decode[0].states[-1], decode[0].hidden[-1])
    verify = model.forward_batch([(a, [decode[0].greedy[0], 17, 99, 1234], na + 1)])[0]
    out["verify"] = (verify.logits, verify.greedy)
    model.accept(a, verify.states[1], verify.hidden[1])  # two kept: a rollback
    after = model.forward(a, [42], na + 3, per_position=True)
    out["after rollback"] = (after.logits, after.greedy)
    # MTP: the catch-up over the prompt's entries, then a chained draft
    span = model.mtp_span(a, 0, list(hidden_a[:-1]), prompt_a[1:])
    chained = model.mtp(a, na - 1, span.hidden, span.token)
    out["mtp span"] = (span.logits, span.token)
    out["mtp chained"] = (chained.logits, chained.token)
    model.synchronize()
    # a checkpoint of lane b at nb + 1 moved to a fresh lane: the same next step
    model.accept(b, decode[1].states[-1], decode[1].hidden[-1])
    held = _Held(nb + 1, b.attn_blocks, [], 0, b.slot)
    parts = model.export_parts(held)
    fresh = Lane(2, [10, 11, 12, 13, 14])
    model.import_parts(_Held(nb + 1, fresh.attn_blocks, [], 0, fresh.slot), parts)
    step_b = model.forward(b, [decode[1].greedy[0]], nb + 1)
    step_fresh = model.forward(fresh, [decode[1].greedy[0]], nb + 1)
    out["restored"] = (step_fresh.logits, step_fresh.greedy)
    out["restored equals original"] = (None, bool(torch.equal(step_b.logits,
                                                              step_fresh.logits)))
    model.synchronize()
    got = model.read_parts(fresh, nb + 1, 0)
    ref = model.reference_parts(prompt_b + [other_b.greedy[-1]], False)
    out["parts match a recomputation"] = (None, model.parts_match(
        got._replace(mtp_kv=(), hidden=None), ref._replace(mtp_kv=(), hidden=None)))
    out["generate"] = (None, model.reference_generate(prompt_a, 8))
    out["part names"] = (None, sorted(parts))
    return out


class _Held:
    def __init__(self, position, attn_blocks, mtp_blocks, mtp_kv, slot) -> None:
        self.position, self.attn_blocks, self.mtp_blocks = position, attn_blocks, mtp_blocks
        self.mtp_kv, self.slot = mtp_kv, slot


def compare(one: dict, two: dict) -> dict:
    diff = Diff()
    for name, (logits, value) in one.items():
        if logits is not None:
            diff.close(name, logits, two[name][0])
        if name != "part names":
            diff.same(name, value, two[name][1])
    return {"worst": diff.worst, "equal": diff.equal,
            "parts": {"one": one["part names"][1], "two": two["part names"][1]},
            "restored": two["restored equals original"][1],
            "match": two["parts match a recomputation"][1]}


def main(out_path: str, *dirs: str) -> int:
    torch.set_num_threads(1)
    ranks = launch(2, timeout=60)
    results = []
    try:
        for path in dirs:
            single = open_model(path, **OPTIONS).model
            sharded = open_model(path, **OPTIONS, ranks=ranks).model
            row = compare(script(single), script(sharded))
            row.update(model=path, identity=(single.identity, sharded.identity),
                       collectives=sharded.local.net.collectives.calls)
            results.append(row)
    finally:
        ranks.close()
    with open(out_path, "w") as f:
        json.dump(results, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
