"""What the Responses API's tests share: the SDK's types checked strictly (as test_bodies does
for chat completions) and the journal's view of a response."""

from __future__ import annotations

import copy
import json
import typing

import httpx
from openai.types.responses import Response, ResponseStreamEvent

from .test_bodies import no_unknown_fields

MODEL = "tiny-qwen3-next-v1"
EVENT_TYPES = {typing.get_args(kind.model_fields["type"].annotation)[0]: kind
               for kind in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
# the error code the issue asks for and the Codex CLI reads (it compacts its history on it);
# the SDK's `ResponseError.code` literal lacks it
CONTEXT_CODE = "context_length_exceeded"


def _plain(body: dict) -> dict:
    """`body` with this server's one departure from the SDK's literals put back: a failed
    response's context_length_exceeded code (checked on its own) as `invalid_prompt`."""
    checked = copy.deepcopy(body)
    response = checked.get("response", checked)
    error = response.get("error") if isinstance(response, dict) else None
    if error and error.get("code") == CONTEXT_CODE:
        error["code"] = "invalid_prompt"
    return checked


def strict_response(body: dict) -> Response:
    """A whole response body validated strictly as the SDK's `Response`; nothing unknown to
    it, and it dumps back to exactly the body."""
    checked = _plain(body)
    model = Response.model_validate(checked, strict=True)
    no_unknown_fields(model)
    assert model.model_dump(mode="json", exclude_unset=True, by_alias=True) == checked
    return model


def strict_event(event: dict):
    """One stream event validated strictly as the SDK's class for its `type`."""
    kind = EVENT_TYPES[event["type"]]
    checked = _plain(event)
    model = kind.model_validate(checked, strict=True)
    no_unknown_fields(model)
    assert model.model_dump(mode="json", exclude_unset=True, by_alias=True) == checked
    return model


def events_of(response: httpx.Response) -> list[dict]:
    """The SSE events of a stream, each checked: its `event:` line names its type, sequence
    numbers count from 0."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        event = json.loads(lines[1].removeprefix("data: "))
        assert lines[0].removeprefix("event: ") == event["type"]
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def request_id(response_id: str) -> str:
    return response_id.removeprefix("resp_")


def queued_tokens(live, response_id: str) -> list[int]:
    return [d for k, d, _ in live.events(request_id(response_id))
            if k == "RequestQueued"][0]["tokens"]


def output_tokens(live, response_id: str) -> list[int]:
    return [t for k, d, _ in live.events(request_id(response_id)) if k == "TokensCommitted"
            for t in d["tokens"]]
