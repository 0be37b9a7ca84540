"""The served schema: `/openapi.json` and `/docs`, every route with its real models; and a
schema-driven fuzzer (schemathesis) against it: valid and invalid requests drawn from the
schema, a small bounded number per run, none answered with a 5xx, a status the schema does
not list, or a body outside the schema."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from ninfer.server.errors import ErrorBody
from ninfer.server.messages_bodies import AnthropicError
from ninfer.server.openapi import ROUTES

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
EXAMPLES = 25   # drawn requests per route and mode
# output limits the fuzzer's requests are held to: each valid request runs the model
LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@pytest.fixture(scope="module")
def document(live) -> dict:
    r = httpx.get(live.url + "/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return r.json()


def test_every_route_is_described_with_its_models(document):
    paths = document["paths"]
    schemas = document["components"]["schemas"]
    for route in ROUTES:
        operation = paths[route.path][route.method]
        if route.request is not None:
            ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            named = schemas[ref.rsplit("/", 1)[1]]
            assert set(named["properties"]) == set(route.request.model_fields)
        ok = operation["responses"]["200"]["content"]
        if route.ok is not None:
            ref = ok["application/json"]["schema"]["$ref"]
            assert set(schemas[ref.rsplit("/", 1)[1]]["properties"]) == set(
                route.ok.model_fields)
        assert ("text/event-stream" in ok) == (route.event is not None)
        for status in route.errors:
            ref = operation["responses"][str(status)]["content"]["application/json"]["schema"]
            assert ref["$ref"].endswith("/" + route.error.__name__)
        assert "422" not in operation["responses"]


def test_no_route_is_left_out(document):
    """The document's paths are FastAPI's own list of the routes; each is in ROUTES (the
    schema is refused otherwise) and each of ROUTES is served."""
    operations = {(path, method) for path, item in document["paths"].items()
                  for method in item}
    assert operations == {(r.path, r.method) for r in ROUTES}


def test_docs_page(live):
    r = httpx.get(live.url + "/docs")
    assert r.status_code == 200 and "/openapi.json" in r.text


def test_error_bodies_are_the_documented_model(live):
    for r in (httpx.post(live.url + "/v1/responses", content=b"{", headers={
                  "content-type": "application/json"}),
              httpx.get(live.url + "/v1/nothing"),
              httpx.post(live.url + "/v1/chat/completions", json={"messages": []})):
        ErrorBody.model_validate(r.json(), strict=True)
    for r in (httpx.post(live.url + "/v1/messages", content=b"{", headers={
                  "content-type": "application/json"}),
              httpx.post(live.url + "/v1/messages/count_tokens", json={"messages": []})):
        assert r.status_code == 400
        AnthropicError.model_validate(r.json(), strict=True)


def _held(case) -> None:
    """Hold a drawn request to a short reply (each valid one runs the model); on the Messages
    API, name a model it serves (a drawn name is a 404, and nothing behind it would be
    fuzzed)."""
    if isinstance(case.body, dict):
        if case.operation.path.startswith("/v1/messages") and isinstance(
                case.body.get("model"), str):
            case.body["model"] = "claude-fuzz"
        for name in LIMITS:
            if isinstance(case.body.get(name), int) and case.body[name] > 2:
                case.body[name] = 2
        if case.operation.path == "/v1/responses" and LIMITS[2] not in case.body:
            case.body[LIMITS[2]] = 2   # (without one, a reply may run to the context's end)


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("route", ROUTES, ids=[f"{r.method} {r.path}" for r in ROUTES])
def test_schema_driven_fuzzing(live, document, route, mode):
    if route.request is None and mode == "negative":
        pytest.skip("no request body or parameter to get wrong")
    operation = schemathesis.openapi.from_dict(document)[route.path][route.method.upper()]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    statuses = []

    @settings(max_examples=EXAMPLES if route.request else 3, deadline=None, database=None,
              derandomize=True, suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case):
        _held(case)
        response = case.call(base_url=live.url, timeout=60)
        statuses.append(response.status_code)
        case.validate_response(response, checks=CHECKS)

    with live.configured(max_body_bytes=64 * 2**10):
        check()
    if mode == "negative":
        assert set(statuses) <= {400, 404, 413}, statuses
    live.integrity()


SERVED = {   # a request each route serves (drawn ones are often refused for their meaning)
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "Once upon", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2,
                      "include": ["reasoning.encrypted_content"]},
    # thinking on, with a budget: a thinking block (closed by the server) and a text block
    "/v1/messages": {"model": "claude-fuzz", "max_tokens": 4,
                     "thinking": {"type": "enabled", "budget_tokens": 1},
                     "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "claude-fuzz",
                                  "messages": [{"role": "user", "content": "hi"}]},
}
STREAMED = {r.path for r in ROUTES if r.event is not None}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(SERVED))
def test_served_answers_conform_to_the_schema(live, document, path, stream):
    """The answers of served requests, whole and streamed, checked as the fuzzer checks
    them."""
    if stream and path not in STREAMED:
        pytest.skip("the route does not stream")
    operation = schemathesis.openapi.from_dict(document)[path]["POST"]
    body = {**SERVED[path], "stream": stream} if path in STREAMED else SERVED[path]
    case = operation.Case(body=body, media_type="application/json")
    response = case.call(base_url=live.url, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"][0].startswith(
        "text/event-stream" if stream else "application/json")
    case.validate_response(response, checks=CHECKS)
