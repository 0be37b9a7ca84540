"""`ninfer train eval MODEL --corpus DIR`: the figures of issue 31, on the corpus's held-out
modules, greedy, without constrained decoding.

- bpb: bits per byte of the held-out source files, against `xz -9` (lzma preset 9) on the
  same bytes joined into one stream. Each file is <|endoftext|> and its tokens, read in
  windows of `window` tokens from a fresh state that overlap by `window - stride`: a window
  scores only the tokens no earlier window scored, so every token is predicted once, and
  with at least `window - stride` tokens of the file before it where the file has them
  (the usual sliding-window measure).
- docstrings: of the held-out docstring prompts, the share of greedy answers (at most 256
  tokens) that `ast.parse` accepts, the answer being the reply's text as a client receives
  it (the generation prompt closes the think block: the whole reply is content).
- tools: of the held-out tool prompts, the share whose reply holds a well-formed call
  (`<tool_call>` JSON with a name and an arguments object, closed) to a listed tool, with
  arguments that validate against its schema: every required parameter, no parameter the
  schema does not list, each of its JSON type. Also the share calling the requested tool,
  each reply's outcome (no call, an unlisted or another tool, bad arguments) and the share
  by how many tools are listed and whether the request names the function.
- drafting: held-out code continuations (raw text, no chat template) decoded at batch 1 by
  the engine, as served: tokens per verify with `--spec mtp` at draft lengths 1, 2, 3 and
  with n-gram drafting at 3, each length fixed (what the drafter is worth: every round
  drafts k); then `mtp` at up to 3 with adaptive drafting, as the server runs it (the
  length follows acceptance), and its decode speed-up over `none`.

Generation goes through the engine (`ninfer.engine`) over `ninfer.model.runtime`'s model,
the serving path; only the bits per byte read the model's forward directly. `goals` judges
the figures against issue 31's goals (`ninfer train eval` prints them as a table).
"""

from __future__ import annotations

import ast
import json
import lzma
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..engine.engine import Engine, EngineConfig, Submit, run_until_idle
from ..lifecycle.request import SamplingParams
from ..model.hybrid import HybridState
from ..model.pools import BlockPool, SlotPool
from ..model.runtime import OpenModel
from . import examples as ex
from .corpus import Corpus

PARTS = ("bpb", "docstrings", "tools", "drafting")
MAX_TOKENS = 256
CONTINUATION_PROMPT = 256   # tokens of each continuation prompt
CONTINUATION_TOKENS = 128   # tokens decoded after it
DRAFTS = (("mtp", 1), ("mtp", 2), ("mtp", 3), ("ngram", 3))   # at fixed lengths


# --- bits per byte ---------------------------------------------------------------------------

def scored_windows(length: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """Over a sequence of `length` tokens whose first is only context: (begin, end, first)
    for each window `[begin, end)` of at most `window` tokens, which scores the predictions
    of tokens `[first, end)`: every token but the first exactly once, with at least
    `window - stride` tokens before it in its window (all there are, at the start)."""
    if not 0 < stride < window:
        raise ValueError(f"need 0 < stride < window, got stride {stride}, window {window}")
    out, first = [], 1
    while first < length:
        begin = max(0, first - (window - stride))
        end = min(length, begin + window)
        out.append((begin, end, first))
        first = end
    return out


@torch.inference_mode()
def bits_per_byte(om: OpenModel, texts: Sequence[str], window: int = 1024,
                  stride: int | None = None, progress: bool = False) -> dict:
    """The model's bits per byte over `texts` (see the module docstring) beside xz's;
    `stride` defaults to half the window."""
    net, tok = om.model.net, om.tokenizer
    stride = stride or window // 2
    device = next(net.parameters()).device
    nats, tokens, data = 0.0, 0, b""
    pieces: list[tuple[list[int], int]] = []   # a window's tokens, and how many it scores
    for text in texts:
        ids = [tok.special.endoftext, *tok.encode(text)]
        tokens += len(ids) - 1
        data += text.encode("utf-8")
        pieces += [(ids[begin:end], end - first)
                   for begin, end, first in scored_windows(len(ids), window, stride)]
    for piece, scored in tqdm(pieces, desc="bits per byte", unit="window",
                              disable=not progress):
        ids = torch.tensor([piece], device=device)
        state = HybridState.initial(net.config, 1, next(net.parameters()).dtype, device)
        logits = net.forward(ids, torch.arange(len(piece), device=device)[None], state).logits
        nats += float(F.cross_entropy(logits[0, -scored - 1:-1].float(), ids[0, -scored:],
                                      reduction="sum"))
    model_bpb = nats / math.log(2) / len(data)
    xz_bpb = 8 * len(lzma.compress(data, preset=9)) / len(data)
    return {"bits_per_byte": model_bpb, "xz_bits_per_byte": xz_bpb,
            "ratio_to_xz": model_bpb / xz_bpb, "bytes": len(data), "tokens": tokens,
            "files": len(texts), "window": window, "stride": stride}


# --- generation through the engine -----------------------------------------------------------

class Generated(NamedTuple):
    text: str
    tokens: int
    finished: bool       # ended on a stop token, not at max_tokens


def _engine(om: OpenModel, *, spec: str = "none", draft_tokens: int = 3,
            concurrency: int = 1, adaptive: bool = True) -> Engine:
    config = EngineConfig(max_concurrency=concurrency, prefill_chunk=512, spec=spec,
                          draft_tokens=draft_tokens, adaptive_drafting=adaptive,
                          max_context=8192, max_endpoints=4, auto_anchors=0)
    engine = Engine(om.model, config, blocks=BlockPool(om.blocks.num_blocks,
                                                       om.blocks.block_size),
                    slots=SlotPool(om.slots.num_slots))
    engine.recover()
    return engine


def generate(om: OpenModel, prompts: Sequence[Sequence[int]], *, max_tokens: int = MAX_TOKENS,
             concurrency: int = 8, progress: bool = False) -> list[Generated]:
    """Greedy replies to token prompts, decoded as the server decodes them (stop tokens
    end a reply and are not part of its text)."""
    engine = _engine(om, concurrency=concurrency)
    stops = tuple(sorted(om.tokenizer.special.stop_ids))
    ids = [f"eval-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.submit(Submit(rid, tuple(prompt), None, "eval",
                             SamplingParams(max_tokens=max_tokens, stop_tokens=stops)))
    bar = tqdm(total=len(ids), desc="generating", unit="reply", disable=not progress)
    done = 0
    while not engine.idle():
        engine.step()
        now = sum(engine.requests[r].state in ("Finished", "Cancelled", "Failed") for r in ids)
        bar.update(now - done)
        done = now
    bar.close()
    out = []
    for rid in ids:
        tokens = list(engine.requests[rid].outputs)
        finished = bool(tokens) and tokens[-1] in stops
        text = om.tokenizer.decode(tokens[:-1] if finished else tokens)
        out.append(Generated(text, len(tokens), finished))
    return out


def _prompt_ids(om: OpenModel, items: Sequence[ex.Example]) -> list[list[int]]:
    return [om.tokenizer.encode(ex.render_prompt(om.template, item)) for item in items]


# --- docstrings ------------------------------------------------------------------------------

def parses(text: str) -> bool:
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):  # ValueError: a NUL byte in the source
        return False
    return True


def docstring_share(om: OpenModel, items: Sequence[ex.Example], *, concurrency: int = 8,
                    max_tokens: int = MAX_TOKENS, progress: bool = False) -> dict:
    replies = generate(om, _prompt_ids(om, items), max_tokens=max_tokens,
                       concurrency=concurrency, progress=progress)
    ok = [parses(r.text) for r in replies]
    return {"prompts": len(items), "parsed": sum(ok), "share": sum(ok) / max(len(ok), 1),
            "finished": sum(r.finished for r in replies),
            "examples": [{"request": items[i].messages[-1]["content"], "reply": replies[i].text,
                          "parses": ok[i]} for i in range(min(3, len(items)))]}


# --- tools -----------------------------------------------------------------------------------

_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def validates(arguments: Any, schema: dict) -> bool:
    """Whether `arguments` satisfies a tool's `parameters` schema as the corpus writes them
    (an object of typed properties, some required), parameters it does not list refused."""
    if not isinstance(arguments, dict):
        return False
    properties = schema.get("properties", {})
    if any(name not in arguments for name in schema.get("required", ())):
        return False
    for name, value in arguments.items():
        if name not in properties:
            return False
        kind = properties[name].get("type")
        if kind is not None and not _TYPES.get(kind, lambda _: False)(value):
            return False
    return True


class Call(NamedTuple):
    name: str
    arguments: Any


def first_call(text: str) -> Call | None:
    """The reply's first tool call, if it is well formed: `<tool_call>` JSON `</tool_call>`
    with a string name and an arguments object."""
    start = text.find("<tool_call>")
    end = text.find("</tool_call>", start)
    if start < 0 or end < 0:
        return None
    try:
        body = json.loads(text[start + len("<tool_call>"):end])
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) \
            or not isinstance(body.get("arguments"), dict):
        return None
    return Call(body["name"], body["arguments"])


def tool_share(om: OpenModel, items: Sequence[ex.Example], *, concurrency: int = 8,
               max_tokens: int = MAX_TOKENS, progress: bool = False) -> dict:
    replies = generate(om, _prompt_ids(om, items), max_tokens=max_tokens,
                       concurrency=concurrency, progress=progress)
    valid = right = formed = 0
    outcomes: dict[str, int] = {}
    groups: dict[str, list[int]] = {}   # a group's [valid, prompts]
    for item, reply in zip(items, replies, strict=True):
        outcome = tool_outcome(item, first_call(reply.text))
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        formed += outcome != "no_call"
        valid += outcome in ("valid", "valid_other_tool")
        right += outcome == "valid"
        for group in tool_groups(item):
            counts = groups.setdefault(group, [0, 0])
            counts[0] += outcome in ("valid", "valid_other_tool")
            counts[1] += 1
    n = max(len(items), 1)
    return {"prompts": len(items), "well_formed": formed, "valid": valid,
            "share": valid / n, "requested_tool_share": right / n,
            "outcomes": dict(sorted(outcomes.items())),
            "share_by_group": {g: {"prompts": c[1], "share": c[0] / c[1]}
                               for g, c in sorted(groups.items())},
            "examples": [{"request": items[i].messages[-1]["content"], "reply": replies[i].text}
                         for i in range(min(3, len(items)))]}


def tool_outcome(item: ex.Example, call: Call | None) -> str:
    """What a reply did with a tool prompt: no_call (no well-formed call), unlisted_tool
    (a name not among the tools), other_tool (another listed tool, its arguments not
    valid for it), bad_arguments (the requested tool, arguments not valid), valid (the
    requested tool, valid), valid_other_tool (another listed tool with valid arguments:
    counted valid, as the figure's definition says)."""
    if call is None:
        return "no_call"
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in item.tools or []}
    if call.name not in tools:
        return "unlisted_tool"
    requested = call.name == json.loads(item.reference)["name"]
    if validates(call.arguments, tools[call.name]):
        return "valid" if requested else "valid_other_tool"
    return "bad_arguments" if requested else "other_tool"


def tool_groups(item: ex.Example) -> tuple[str, str]:
    """The groups a tool prompt falls in: how many tools are listed, and whether the
    request names the function or only says what it does."""
    name = json.loads(item.reference)["name"]
    asks = "names_it" if name in item.messages[-1]["content"] else "describes_it"
    return f"tools_listed_{len(item.tools or [])}", asks


# --- drafting --------------------------------------------------------------------------------

def _decode_run(om: OpenModel, prompts: Sequence[Sequence[int]], spec: str, k: int,
                max_tokens: int, adaptive: bool = False) -> dict:
    """Each prompt decoded alone (batch 1) under `spec`: verify rounds, tokens, decode time."""
    rounds = tokens = drafted = accepted = 0
    seconds = 0.0
    for i, prompt in enumerate(prompts):
        engine = _engine(om, spec=spec, draft_tokens=k, adaptive=adaptive)
        rid = f"draft-{i}"
        engine.submit(Submit(rid, tuple(prompt), None, "eval",
                             SamplingParams(max_tokens=max_tokens)))
        while not engine.requests.get(rid) or not engine.requests[rid].outputs:
            engine.step()  # the prefill and its first token: not part of decoding
        events: list = []
        engine.log.listeners.append(events.append)
        t0 = time.perf_counter()
        run_until_idle(engine)
        seconds += time.perf_counter() - t0
        commits = [e for e in events if e.kind == "TokensCommitted"]
        rounds += len(commits)
        tokens += sum(e.committed for e in commits)
        drafted += sum(e.drafted for e in commits)
        accepted += sum(e.accepted for e in commits)
    return {"spec": spec, "k": k, "adaptive": adaptive, "verifies": rounds, "tokens": tokens,
            "tokens_per_verify": tokens / max(rounds, 1), "drafted": drafted,
            "accepted": accepted, "acceptance": accepted / max(drafted, 1),
            "decode_seconds": seconds, "tok_s": tokens / max(seconds, 1e-9)}


def drafting(om: OpenModel, prompts: Sequence[str], *,
             max_tokens: int = CONTINUATION_TOKENS, progress: bool = False) -> dict:
    ids = [om.tokenizer.encode(p)[:CONTINUATION_PROMPT] for p in prompts]
    runs = [("none", 0), *DRAFTS]
    results = {}
    runs.append(("mtp", 3, True))
    for spec, k, *adaptive in tqdm(runs, desc="drafting", disable=not progress):
        name = f"{spec}{k if k else ''}{'_adaptive' if adaptive else ''}"
        results[name] = _decode_run(om, ids, spec, k, max_tokens, bool(adaptive))
    none, mtp = results["none"], results["mtp3_adaptive"]
    return {"prompts": len(ids), "runs": results,
            "mtp_adaptive_speedup_over_none": mtp["tok_s"] / max(none["tok_s"], 1e-9)}


# --- the goals ------------------------------------------------------------------------

# (the figure's path in the report, what it is, "<=" or ">=", the goal)
GOALS = (
    (("bpb", "ratio_to_xz"), "bits per byte / xz -9's", "<=", 0.7),
    (("docstrings", "share"), "docstring replies that parse", ">=", 0.6),
    (("tools", "share"), "tool calls valid", ">=", 0.8),
    (("drafting", "runs", "mtp3", "tokens_per_verify"), "MTP tokens per verify, k = 3",
     ">=", 2.5),
)


def goals(figures: dict) -> list[dict]:
    """Each goal whose figure the report holds: the figure, its goal, and whether it is
    met. (The served speed-up of `--spec mtp`, the last goal, is `ninfer bench drafting`'s.)"""
    out = []
    for path, what, op, goal in GOALS:
        value: Any = figures
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            continue
        met = value <= goal if op == "<=" else value >= goal
        out.append({"figure": ".".join(path), "what": what, "value": value, op: goal,
                    "met": met})
    return out


def goals_table(rows: list[dict]) -> str:
    """The goals as a table a person reads."""
    lines = [f"{'figure':<36} {'value':>8}  {'goal':>8}  met"]
    for row in rows:
        op = "<=" if "<=" in row else ">="
        lines.append(f"{row['what']:<36} {row['value']:>8.3f}  {op} {row[op]:<5}  "
                     f"{'yes' if row['met'] else 'NO'}")
    return "\n".join(lines)


# --- all of it -------------------------------------------------------------------------------

def evaluate(om: OpenModel, corpus: Corpus, *, parts: Sequence[str] = PARTS,
             limit: int | None = None, window: int = 1024, stride: int | None = None,
             concurrency: int = 8,
             max_tokens: int = MAX_TOKENS, continuation_tokens: int = CONTINUATION_TOKENS,
             progress: bool = True) -> dict:
    """The figures of `parts` for the model `om` on `corpus`'s held-out set; `limit` caps
    the prompts (and files) of each part, for a quick look (and `max_tokens`,
    `continuation_tokens` the replies and continuations, for tests)."""
    held = corpus.heldout
    out: dict[str, Any] = {"corpus_sha256": corpus.sha256, "limit": limit}
    cut = slice(None, limit)
    if "bpb" in parts:
        out["bpb"] = bits_per_byte(om, [s["text"] for s in held["sources"][cut]], window,
                                   stride, progress=progress)
    if "docstrings" in parts:
        out["docstrings"] = docstring_share(om, corpus.eval_items("docstring_prompts")[cut],
                                            concurrency=concurrency, max_tokens=max_tokens,
                                            progress=progress)
    if "tools" in parts:
        out["tools"] = tool_share(om, corpus.eval_items("tool_prompts")[cut],
                                  concurrency=concurrency, max_tokens=max_tokens,
                                  progress=progress)
    if "drafting" in parts:
        out["drafting"] = drafting(om, [c["prompt"] for c in held["continuations"][cut]],
                                   max_tokens=continuation_tokens, progress=progress)
    return out
