"""`ninfer bench constrained`: what holding the output to a grammar costs.

Figures, each from the same run:
- the grammar's mask per token, for a JSON schema, at the random tiny model's vocabulary
  (4,096) and at a ~152K byte-level BPE trained here (standing in for Qwen's 151,643: the
  real size is what the mask's cost grows with), raw (llguidance's bitmask) and as the
  engine takes it (ninfer.engine.constraint.Constraint: the bitmask unpacked into a mask);
- the same for a custom tool's input held to a Lark grammar of patches, written inside the
  call's JSON string (quoted_grammar.py: each character a lexeme of its own);
- decode tokens/s of the embedded model at batch 1 and 8, unconstrained against held to a
  JSON schema, in the same run (greedy; the replies are long arrays of strings, so both
  decode the same number of tokens; alternated, the best of three each). The overhead is
  of the engine thread's CPU time (torch on one thread): on a shared machine wall time
  swings by 2x between runs, CPU time far less; the wall-clock rates are shown beside.

The 152K tokenizer is trained at the first run from the Python source on this machine (the
standard library's, then the installed packages': the same pre-tokenizer as the tiny
model's, Qwen's split) and cached in the user cache directory; it is never committed.
"""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..engine.constraint import Constraint
from ..engine.engine import Engine, EngineConfig, Submit, run_until_idle
from ..engine.grammar import Grammars
from ..lifecycle.request import SamplingParams
from ..model.bpe import train_bpe
from ..model.pools import BlockPool, SlotPool
from ..model.runtime import cache_dir, open_model
from ..model.tokenizer import Tokenizer
from ..server.quoted_grammar import escaped, quoted_lark
from ..server.reply_grammar import OutputFormat, reply_grammar
from .report import report

BIG_BPE = 151_643                  # Qwen2/3's BPE tokens (its added tokens come after them)
BIG_ROWS = 151_936                 # Qwen's embedding rows
CORPUS_BYTES = 150 * 2**20         # text the 152K BPE is trained on
FORWARD_S = 0.001                  # a decode step the masks are computed behind
TARGETS = {"overhead_b1": ("<=", 0.10)}
SCHEMA = {  # an agent's typical structured reply
    "type": "object", "additionalProperties": False,
    "required": ["title", "priority", "done", "tags", "steps"],
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "priority": {"enum": ["low", "medium", "high"]},
        "done": {"type": "boolean"},
        "estimate": {"type": "number", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "steps": {"type": "array", "maxItems": 8, "items": {
            "type": "object", "additionalProperties": False, "required": ["n", "what"],
            "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 99},
                           "what": {"type": "string", "maxLength": 80}}}}}}
DOCUMENT = {"title": "Rename the cache module and update its imports", "priority": "high",
            "done": False, "estimate": 2.5, "tags": ["refactor", "cache", "imports"],
            "steps": [{"n": i, "what": f"update the imports of module number {i} and rerun "
                                       "its tests"} for i in range(1, 9)]}
# a custom tool's input grammar (an agent's patch tool), and an input of it
PATCH_GRAMMAR = r'''
start: "*** Begin Patch" LF file+ "*** End Patch" LF?
file: "*** Update File: " PATH LF hunk+
hunk: "@@" CONTEXT? LF line+
line: (" " | "+" | "-") TEXT LF
PATH: /[^\n]+/
CONTEXT: / [^\n]*/
TEXT: /[^\n]*/
%import common.LF
'''
PATCH = ("*** Begin Patch\n*** Update File: ninfer/cache.py\n@@ def lookup(key):\n"
         "-    return _CACHE.get(key)\n+    value = _CACHE.get(key)\n"
         "+    if value is None:\n+        raise KeyError(f\"no entry for {key!r}\")\n"
         "+    return value\n*** End Patch\n")
# the decode figure's reply: long enough for any run (an array of strings without end)
LONG = {"type": "object", "required": ["lines"],
        "properties": {"lines": {"type": "array", "items": {"type": "string"}}}}


def big_tokenizer_json(rows: int = BIG_BPE) -> str:
    """tokenizer.json text of a byte-level BPE of `rows` tokens (fewer if the corpus runs
    out of merges) plus the Qwen-style added tokens, trained on the Python source of this
    interpreter's standard library and installed packages (up to CORPUS_BYTES of it: the
    standard library alone yields ~96K merges); cached."""
    path = cache_dir() / "bench" / f"python-bpe-{rows}.json"
    if path.exists():
        return path.read_text("utf-8")
    text = train_bpe(_python_source(), rows, exact=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, "utf-8")
    tmp.replace(path)
    return text


def _python_source():
    """The text of the .py files of the standard library, then of the installed packages,
    in a fixed order, up to CORPUS_BYTES."""
    paths = sysconfig.get_paths()
    stdlib = Path(paths["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py") if "site-packages" not in f.parts)
    if Path(paths["purelib"]) != stdlib:
        files += sorted(Path(paths["purelib"]).rglob("*.py"))
    total = 0
    for f in files:
        text = f.read_text("utf-8", errors="replace")
        total += len(text)
        if total > CORPUS_BYTES:
            return
        yield text


def mask_cost(tokenizer: Tokenizer, rows: int, reps: int = 3, *, grammar: str | None = None,
              text: str | None = None) -> dict:
    """Per token of `text` under `grammar` (default: a document of SCHEMA): llguidance's
    bitmask alone, the engine's mask
    (Constraint.masks: the bitmask unpacked), and what the engine still waits for when it
    is computed while a forward of FORWARD_S runs (prefetched, as the engine does from
    PREFETCH_VOCAB up; a sleep stands in for a GPU step, whose host waits on the device),
    in microseconds; and the compile time."""
    grammars = Grammars.for_tokenizer(tokenizer, rows)
    grammar = grammar or reply_grammar(OutputFormat("json_schema", SCHEMA, True))
    t0 = time.perf_counter()
    grammars.compile(grammar)
    compile_ms = (time.perf_counter() - t0) * 1e3
    tokens = tokenizer.encode(text or json.dumps(DOCUMENT))
    raw, engine, exposed = [], [], []
    for _ in range(reps):
        matcher = grammars.matcher(grammar)
        t0 = time.perf_counter()
        for t in tokens:
            matcher.compute_bitmask()
            matcher.consume_token(t)
        raw.append((time.perf_counter() - t0) / len(tokens))
        history: list[int] = []
        constraint = Constraint(grammars.matcher(grammar), history, after=None,
                                end_tokens=grammars.end_tokens, vocab_size=rows)
        t0 = time.perf_counter()
        for t in tokens:
            constraint.masks()
            history.append(t)
        engine.append((time.perf_counter() - t0) / len(tokens))
        # prefetched while a stand-in forward waits (a GPU step's host waits on the device)
        history = []
        constraint = Constraint(grammars.matcher(grammar), history, after=None,
                                end_tokens=grammars.end_tokens, vocab_size=rows, prefetch=True)
        waited = 0.0
        for t in tokens:
            constraint.prefetch(())
            time.sleep(FORWARD_S)
            t0 = time.perf_counter()
            constraint.masks()       # what the engine still waits for after the forward
            waited += time.perf_counter() - t0
            history.append(t)
        exposed.append(waited / len(tokens))
    return {"vocab": rows, "tokens": len(tokens), "compile_ms": compile_ms,
            "bitmask_us": min(raw) * 1e6, "engine_mask_us": min(engine) * 1e6,
            "exposed_behind_forward_us": min(exposed) * 1e6, "forward_ms": FORWARD_S * 1e3}


class Decode:
    """Decode rates of the embedded model, plain and constrained, in one process."""

    def __init__(self) -> None:
        self.om = open_model(None, dtype="float32", kv_capacity=40_000, num_slots=40)
        self.grammars = Grammars.for_tokenizer(self.om.tokenizer, self.om.model.vocab_size)
        self.prompt = tuple(self.om.tokenizer.encode(
            "<|im_start|>user\nList the lines of the report as JSON.<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"))
        self.grammar = reply_grammar(OutputFormat("json_schema", LONG))
        self.ids = 0

    def engine(self, batch: int) -> Engine:
        om = self.om
        engine = Engine(om.model, EngineConfig(max_concurrency=batch, prefill_chunk=512),
                        blocks=BlockPool(om.blocks.num_blocks, om.blocks.block_size),
                        slots=SlotPool(om.slots.num_slots), grammars=self.grammars)
        engine.recover()
        return engine

    def run(self, batch: int, tokens: int, constrained: bool) -> dict:
        engine = self.engine(batch)
        stops = tuple(sorted(self.grammars.end_tokens))
        params = SamplingParams(max_tokens=tokens, stop_tokens=stops,
                                grammar=self.grammar if constrained else None)
        ids = []
        for i in range(batch):
            self.ids += 1
            ids.append(f"d{self.ids}")
            # a token apart per lane, so the lanes' replies differ
            engine.submit(Submit(ids[-1], self.prompt + (i + 1,), f"s{self.ids}", "bench",
                                 params))
        while any(not engine.requests.get(r) or not engine.requests[r].outputs for r in ids):
            engine.step()  # prefill everyone first: this figure is decode only
        t0, c0 = time.perf_counter(), time.thread_time()
        run_until_idle(engine)
        seconds, cpu = time.perf_counter() - t0, time.thread_time() - c0
        done = sum(len(engine.requests[r].outputs) - 1 for r in ids)
        return {"tok_s": done / seconds, "cpu_tok_s": done / cpu, "tokens": done}


def main(json_path: str | None = None, quick: bool = False, tokens: int = 128) -> int:
    from ..model.runtime import benchmark_on_the_random_model
    benchmark_on_the_random_model()
    torch.set_num_threads(1)  # the tiny model decodes fastest on one thread
    results: dict = {}
    steps = []
    embedded = open_model(None, dtype="float32", kv_capacity=16, num_slots=1)
    patch = {"grammar": json.dumps({"grammars": [{"lark_grammar": quoted_lark(PATCH_GRAMMAR)}]}),
             "text": escaped(PATCH)}
    reps = 1 if quick else 3
    steps.append(("mask_embedded", lambda: mask_cost(embedded.tokenizer,
                                                     embedded.model.vocab_size, reps)))
    steps.append(("patch_embedded", lambda: mask_cost(embedded.tokenizer,
                                                      embedded.model.vocab_size, reps,
                                                      **patch)))
    if not quick:
        big_tok: list[Tokenizer] = []

        def big(**kw) -> dict:
            if not big_tok:
                big_tok.append(Tokenizer(big_tokenizer_json(), {}, source="stdlib BPE"))
            tok = big_tok[0]
            return {**mask_cost(tok, max(BIG_ROWS, tok.vocab_size), **kw),
                    "bpe_tokens": tok.vocab_size}
        steps.append(("mask_152k", big))
        steps.append(("patch_152k", lambda: big(**patch)))
    decode = Decode()
    for batch in (1, 8):
        n = 32 if quick else tokens
        for constrained in (False, True) * (1 if quick else 3):  # alternated, best of 3
            key = f"decode_b{batch}_{'json' if constrained else 'plain'}"
            steps.append((key, lambda b=batch, c=constrained, n=n: decode.run(b, n, c)))
    for name, run in tqdm(steps, desc="bench constrained", file=sys.stderr, leave=False):
        out = run()
        if name not in results or out.get("cpu_tok_s", 0) > results[name].get("cpu_tok_s", 0):
            results[name] = out
    flat = _flatten(results)
    rows = [("mask_us_4k", "JSON mask per token, 4,096 vocab (engine)", "µs", ".1f"),
            ("bitmask_us_4k", "  of which llguidance's bitmask", "µs", ".1f"),
            ("patch_mask_us_4k", "patch tool's input mask per token, 4,096 vocab (engine)",
             "µs", ".1f")]
    if "mask_152k" in results:
        rows += [("mask_us_152k", f"JSON mask per token, {flat['vocab_152k']:,} vocab "
                                  "(engine)", "µs", ".1f"),
                 ("bitmask_us_152k", "  of which llguidance's bitmask", "µs", ".1f"),
                 ("exposed_us_152k", "  still waited for after a 1 ms forward", "µs", ".1f"),
                 ("patch_mask_us_152k", "patch tool's input mask per token, 152K vocab "
                                        "(engine)", "µs", ".1f"),
                 ("patch_exposed_us_152k", "  still waited for after a 1 ms forward", "µs",
                  ".1f")]
    for b in (1, 8):
        rows += [(f"plain_tok_s_b{b}", f"decode, batch {b}, unconstrained", "tok/s", ",.0f"),
                 (f"json_tok_s_b{b}", f"decode, batch {b}, held to a JSON schema", "tok/s",
                  ",.0f"),
                 (f"plain_cpu_tok_s_b{b}", "  unconstrained, per CPU second", "tok/s", ",.0f"),
                 (f"json_cpu_tok_s_b{b}", "  held to the schema, per CPU second", "tok/s",
                  ",.0f"),
                 (f"overhead_b{b}", f"  overhead at batch {b} (CPU time)", "fraction", ".3f")]
    report("constrained", flat, rows, TARGETS, json_path,
           note=f"detail: {json.dumps(results)}")
    return 0


def _flatten(r: dict) -> dict:
    out = {"mask_us_4k": r["mask_embedded"]["engine_mask_us"],
           "bitmask_us_4k": r["mask_embedded"]["bitmask_us"],
           "patch_mask_us_4k": r["patch_embedded"]["engine_mask_us"]}
    if "mask_152k" in r:
        out.update(mask_us_152k=r["mask_152k"]["engine_mask_us"],
                   bitmask_us_152k=r["mask_152k"]["bitmask_us"],
                   exposed_us_152k=r["mask_152k"]["exposed_behind_forward_us"],
                   vocab_152k=r["mask_152k"]["vocab"],
                   compile_ms_152k=r["mask_152k"]["compile_ms"],
                   patch_mask_us_152k=r["patch_152k"]["engine_mask_us"],
                   patch_exposed_us_152k=r["patch_152k"]["exposed_behind_forward_us"])
    for b in (1, 8):
        plain, held = r[f"decode_b{b}_plain"], r[f"decode_b{b}_json"]
        out.update({f"plain_tok_s_b{b}": plain["tok_s"], f"json_tok_s_b{b}": held["tok_s"],
                    f"plain_cpu_tok_s_b{b}": plain["cpu_tok_s"],
                    f"json_cpu_tok_s_b{b}": held["cpu_tok_s"],
                    f"overhead_b{b}": plain["cpu_tok_s"] / held["cpu_tok_s"] - 1})
    return out
