"""Parsing what the model writes: `<think>…</think>` into `reasoning_content`, Qwen's
`<tool_call>{"name": …, "arguments": …}</tool_call>` into OpenAI tool calls, and stop strings.

Everything works on a stream of text deltas and holds back only a tail that could still be
the start of a tag, so the same code serves streaming and non-streaming responses.

Whitespace is split off the way the chat template adds it back (one newline before
`</think>`, two after it, one before each tool call), so a conversation's history sent back
by the client re-renders to the text the model wrote, and its state is reused."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_GAP = "\n\n"   # the template's blank line between a turn's reasoning and its answer
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str   # a JSON object as text, as OpenAI sends it


@dataclass(frozen=True)
class Delta:
    kind: str                     # reasoning | content | tool_call
    text: str = ""
    call: ParsedCall | None = None


def merged(deltas: list[Delta]) -> list[Delta]:
    """Adjacent text deltas of one kind joined into one (a tool call stays its own)."""
    out: list[Delta] = []
    for d in deltas:
        if out and d.kind != "tool_call" and out[-1].kind == d.kind:
            out[-1] = Delta(d.kind, out[-1].text + d.text)
        else:
            out.append(d)
    return out


def _partial_tail(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


_CALL_SHAPE = re.compile(r'^\{"name": ("(?:[^"\\]|\\.)*"), "arguments": (.*)\}$', re.S)


def parse_tool_call(body: str) -> ParsedCall | None:
    """The JSON between the tool-call tags, or None when it is not a call. The arguments'
    text is kept as the model wrote it when the call has the template's own shape."""
    body = body.strip("\n")
    shaped = _CALL_SHAPE.match(body)
    if shaped:
        try:
            name, arguments = json.loads(shaped.group(1)), json.loads(shaped.group(2))
        except ValueError:
            shaped = None
        else:
            raw = shaped.group(2) if isinstance(arguments, dict) else None
    if not shaped:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        name, arguments, raw = obj.get("name"), obj.get("arguments", {}), None
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    text = raw if raw is not None else json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(f"call_{uuid.uuid4().hex[:24]}", name, text)


class OutputParser:
    """Turns text deltas into reasoning, content and tool-call deltas.

    `thinking`: the prompt ends inside an open `<think>` block (the template's generation
    prompt opened it), so output starts as reasoning. `tools`: parse tool-call markup."""

    def __init__(self, *, thinking: bool, tools: bool) -> None:
        self.mode = "reasoning" if thinking else "content"
        self.tools = tools
        self.buf = ""
        self.calls: list[ParsedCall] = []
        self._content_started = False   # leading "\n\n" after </think> is the template's
        self._strip_lead = ""           # what to strip at the start of the current mode

    def _tags(self) -> tuple[str, ...]:
        if self.mode == "reasoning":
            return (THINK_CLOSE,)
        if self.mode == "tool":
            return (CALL_CLOSE,)
        return (THINK_OPEN, CALL_OPEN) if self.tools else (THINK_OPEN,)

    def push(self, text: str) -> list[Delta]:
        self.buf += text
        if "<" not in self.buf and self.mode != "tool":
            # no tag, nor the start of one (every tag starts with "<"): what `_scan` finds
            # then, without its searches (most tokens' text)
            out: list[Delta] = []
            self._release(out)
            return out
        return self._scan()

    def _scan(self) -> list[Delta]:
        """The deltas the buffer releases: its tags closed, a tail that may start one kept."""
        out: list[Delta] = []
        while True:
            tags = self._tags()
            hits = [(self.buf.find(t), t) for t in tags if t in self.buf]
            if not hits:
                break
            at, tag = min(hits)
            before, self.buf = self.buf[:at], self.buf[at + len(tag):]
            self._close(before, tag, out)
        if self.mode != "tool":
            self._release(out, _partial_tail(self.buf, self._tags()))
        return out

    def _release(self, out: list[Delta], keep: int = 0) -> None:
        """Emit the buffer but its last `keep` characters (a tail that may start a tag) and
        a newline before them that may be the template's (before </think>, a tool call)."""
        newline_before_tag = self.mode == "reasoning" or (self.mode == "content"
                                                           and self.tools)
        if newline_before_tag and self.buf[:len(self.buf) - keep].endswith("\n"):
            keep += 1
        ready = self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]
        self._emit(ready, out)

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self.mode == "tool":
            self.mode = "content"
            self._emit(CALL_OPEN + self.buf, out)
        else:
            self._emit(self.buf, out)
        self.buf = ""
        return out

    def _strip(self, text: str) -> str:
        """Drop the template's whitespace at the start of a mode, across deltas."""
        lead = self._strip_lead
        if lead and text:
            n = 0
            while n < len(text) and n < len(lead) and text[n] == lead[n]:
                n += 1
            self._strip_lead = lead[n:] if n == len(text) else ""
            text = text[n:]
        return text

    def _emit(self, text: str, out: list[Delta]) -> None:
        if self.mode == "tool":
            return
        text = self._strip(text)
        if not text:
            return
        kind = "reasoning" if self.mode == "reasoning" else "content"
        if out and out[-1].kind == kind:
            out[-1] = Delta(kind, out[-1].text + text)
        else:
            out.append(Delta(kind, text))

    def _close(self, before: str, tag: str, out: list[Delta]) -> None:
        if tag == THINK_CLOSE:
            self._emit(before.removesuffix("\n"), out)
            self.mode, self._strip_lead = "content", ANSWER_GAP
        elif tag == THINK_OPEN:
            self._emit(before, out)
            self.mode, self._strip_lead = "reasoning", "\n"
        elif tag == CALL_OPEN:
            self._emit(before.removesuffix("\n"), out)
            self.mode = "tool"
        else:  # CALL_CLOSE
            call = parse_tool_call(before)
            self.mode = "content"
            if call is None:
                self._emit(CALL_OPEN + before + CALL_CLOSE, out)
            else:
                self.calls.append(call)
                out.append(Delta("tool_call", call=call))
                self._strip_lead = "\n"


class StopScanner:
    """Finds stop strings in a text stream; holds back a tail that could start one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.buf = ""
        self.hit = False
        self.fired: str | None = None   # the stop string found (Anthropic reports it)

    def push(self, text: str) -> str:
        """The text safe to release; after a hit, the text before the stop string only."""
        if self.hit:
            return ""
        if not self.stops:
            return text
        self.buf += text
        found = [(self.buf.find(s), s) for s in self.stops if s in self.buf]
        if found:
            at, self.fired = min(found)
            ready, self.buf, self.hit = self.buf[:at], "", True
            return ready
        keep = _partial_tail(self.buf, self.stops)
        ready, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return ready

    def finish(self) -> str:
        ready, self.buf = ("" if self.hit else self.buf), ""
        return ready
