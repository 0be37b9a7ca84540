"""The simulated agent client of `ninfer bench agent`: what it sends and how it reads the reply.

A conversation is a system prompt and a tool list (the same for every conversation, as one
agent CLI's are), then turns: each request's messages are the previous request's messages,
the assistant's reply exactly as the server streamed it (text and tool calls), and one new
message (a tool result per tool call, else a user message) sized so that the prompt grows
evenly to the target context. Everything the client writes comes from a seeded generator,
so the same seed, model and server send the same bytes. Only the standard library talks
HTTP here, so the client can be cut at any byte: `send(..., cut=True)` closes the
connection as soon as the response headers arrive (ninfer sends them once the request has
started, after its first prefill step)."""

from __future__ import annotations

import http.client
import json
import random
import time
import urllib.parse
from typing import Any, NamedTuple

SYSTEM_PROMPT = (
    "You are a software engineering agent working in a user's repository through the tools "
    "listed below. Read before you write: open the files a change touches, run the tests "
    "that cover them, and keep each edit as small as the task allows. Explain what you are "
    "about to do in one or two sentences before each tool call, and after the last one say "
    "what changed, which tests ran and what is left. Never invent file contents or command "
    "output: if you have not read it, read it. Prefer the project's own conventions over "
    "your habits: its naming, its error handling, its test layout. When a command fails, "
    "read the error, form one hypothesis, and test it before trying another. Do not touch "
    "files outside the repository, do not commit unless asked, and stop to ask when the "
    "task is ambiguous in a way that changes the result. Answers are plain text; code goes "
    "in fenced blocks with the language named. Keep the user's time in mind: short "
    "messages, no repetition of what the tools already showed.")

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "path from the repository root"},
            "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_command", "description": "Run a shell command in the repository root.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string"},
            "timeout_s": {"type": "integer", "description": "seconds before it is killed"}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "edit_file", "description": "Replace one exact string in a file.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
            "required": ["path", "old", "new"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Find lines matching a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "glob": {"type": "string"}},
            "required": ["pattern"]}}},
]

_WORDS = ("cache", "handler", "request", "session", "parser", "buffer", "config", "worker",
          "journal", "index", "router", "schema", "token", "stream", "client", "server",
          "module", "record", "event", "store", "queue", "lease", "frame", "batch", "limit",
          "retry", "policy", "report", "layout", "signal")
_ASKS = ("Now look at the failing test and tell me why it fails.",
         "Good. Check the other callers of that function before you change it.",
         "Run the whole test module again and summarise the result.",
         "That is not what I meant: keep the old behaviour for empty input.",
         "Here is the output of the command you asked for.",
         "Read the module below and say where the state is kept.")


def filler(rng: random.Random, chars: int) -> str:
    """About `chars` characters of what an agent's context fills with: file listings, code,
    test logs and prose, in whole lines (ASCII, so its tokenization is stable)."""
    lines: list[str] = []
    size = 0
    while size < chars:
        a, b, c, d = (rng.choice(_WORDS) for _ in range(4))
        n = rng.randrange(100)
        line = rng.choice((
            f"src/{a}/{b}_{n}.py  {rng.randrange(1, 90)}.{rng.randrange(10)}K",
            f"    def {a}_{b}(self, {c}): return self.{d}[{n}]",
            f"tests/test_{a}.py::test_{b}_{c}_{n} {rng.choice(('PASSED', 'FAILED', 'PASSED'))}",
            f"The {a} {b} calls the {c} before the {d} is ready (line {n}).",
        ))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Reply(NamedTuple):
    """One streamed request as the client saw it. A cut request has only its id and the
    time its headers came; `usage` is None."""

    request_id: str | None
    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    usage: Usage | None
    headers_s: float           # send to response headers
    ttft_s: float | None       # send to the first chunk after the role chunk
    total_s: float


class BenchError(Exception):
    """The server answered what a benchmark run cannot go on from (an HTTP error, a stream
    without usage)."""


def _connection(url: str) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname, parts.port, timeout=600), parts.path.rstrip("/")


def get_json(url: str, path: str) -> dict:
    return _json_call(url, "GET", path)


def post_json(url: str, path: str, body: dict) -> dict:
    return _json_call(url, "POST", path, body)


def _json_call(url: str, method: str, path: str, body: dict | None = None) -> dict:
    """One request; its JSON answer (BenchError unless HTTP 200)."""
    conn, base = _connection(url)
    try:
        if body is None:
            conn.request(method, base + path)
        else:
            conn.request(method, base + path, body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise BenchError(f"{method} {path}: HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def send(url: str, body: dict, headers: dict[str, str], *, cut: bool = False) -> Reply:
    """POST a streaming chat completion and read it to `[DONE]`, or, with `cut`, close the
    connection the moment the response headers arrive (an agent cancelling)."""
    conn, base = _connection(url)
    start = time.perf_counter()
    try:
        conn.request("POST", base + "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        headers_s = time.perf_counter() - start
        request_id = resp.getheader("x-request-id")
        if resp.status != 200:
            raise BenchError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        if cut:
            resp.close()  # the socket closes with the connection below: the server sees EOF
            return Reply(request_id, "", "", (), None, headers_s, None,
                         time.perf_counter() - start)
        return _read_stream(resp, request_id, start, headers_s)
    finally:
        conn.close()


def _read_stream(resp: http.client.HTTPResponse, request_id: str | None, start: float,
                 headers_s: float) -> Reply:
    content, reasoning = [], []
    calls: dict[int, dict[str, str]] = {}
    usage, ttft = None, None
    for raw in resp:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise BenchError(f"error event in the stream: {chunk['error']}")
        if chunk.get("usage"):
            u = chunk["usage"]
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            usage = Usage(u["prompt_tokens"], u["completion_tokens"], cached)
        if not chunk.get("choices"):
            continue
        delta = chunk["choices"][0].get("delta") or {}
        if "role" in delta:
            continue
        if ttft is None:
            ttft = time.perf_counter() - start
        content.append(delta.get("content") or "")
        reasoning.append(delta.get("reasoning_content") or "")
        for call in delta.get("tool_calls") or ():
            entry = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
            function = call.get("function") or {}
            entry["id"] += call.get("id") or ""
            entry["name"] += function.get("name") or ""
            entry["arguments"] += function.get("arguments") or ""
    if usage is None:
        raise BenchError(f"request {request_id}: the stream ended without usage")
    tool_calls = tuple(ToolCall(c["id"], c["name"], c["arguments"])
                       for _, c in sorted(calls.items()))
    return Reply(request_id, "".join(content), "".join(reasoning), tool_calls, usage,
                 headers_s, ttft, time.perf_counter() - start)


class Conversation:
    """One agent session: its messages so far and how its next message is sized.

    `chars_per_token` converts a token budget into characters of `filler`; `name` goes into
    the first user message, so conversations never share more than the system prompt and
    tools (nor one run's with another's on a long-running server)."""

    def __init__(self, name: str, seed: int, chars_per_token: float) -> None:
        self.name = name
        self.rng = random.Random(f"{seed}/{name}")
        self.chars_per_token = chars_per_token
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
        self.context = 0  # prompt + completion tokens of the last reply (0 before the first)

    def fixed_tokens(self) -> int:
        """An estimate of the system prompt's and tool list's tokens."""
        return round((len(SYSTEM_PROMPT) + len(json.dumps(TOOLS))) / self.chars_per_token)

    def _text(self, tokens: int) -> str:
        return filler(self.rng, max(round(tokens * self.chars_per_token), 40))

    def first(self, tokens: int) -> None:
        """The first user message, about `tokens` long."""
        self.messages.append({"role": "user", "content": (
            f"Task {self.name}: the build of this repository fails on a clean checkout. "
            f"Find out why and fix it. The log so far:\n{self._text(tokens)}")})

    def answer(self, reply: Reply, tokens: int) -> None:
        """Append the assistant's reply as streamed, then about `tokens` of new context: a
        tool result for each tool call it made, else a user message."""
        usage = reply.usage
        if usage is None:
            raise ValueError("a cut request has no reply to answer")
        message: dict[str, Any] = {"role": "assistant",
                                   "content": reply.content or (None if reply.tool_calls else "")}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in reply.tool_calls]
        self.messages.append(message)
        self.context = usage.prompt_tokens + usage.completion_tokens
        if reply.tool_calls:
            share = tokens // len(reply.tool_calls)
            self.messages += [{"role": "tool", "tool_call_id": c.id, "content": self._text(share)}
                              for c in reply.tool_calls]
        else:
            ask = self.rng.choice(_ASKS)
            self.messages.append({"role": "user", "content": f"{ask}\n{self._text(tokens)}"})


def calibrate(url: str, model: str, seed: int) -> float:
    """Characters of `filler` per token of the server's tokenizer: one text completion of a
    seeded sample, its prompt_tokens read back (one token generated)."""
    sample = filler(random.Random(f"{seed}/calibration"), 4000)
    usage = post_json(url, "/v1/completions", {"model": model, "prompt": sample,
                                               "max_tokens": 1, "temperature": 0})["usage"]
    return len(sample) / usage["prompt_tokens"]
