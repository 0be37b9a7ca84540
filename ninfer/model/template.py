"""Chat templates: the Jinja template a checkpoint ships, rendered as transformers'
`apply_chat_template(..., tokenize=False)` renders it.

The environment matches transformers': sandboxed (immutable), `trim_blocks` and
`lstrip_blocks`, the loop-controls extension, a `{% generation %}` tag (rendered as its body),
`raise_exception(msg)`, `strftime_now(fmt)` and a `tojson` filter that is plain `json.dumps`
(no HTML escaping, keys in their order, `ensure_ascii=False`). The variables: `messages`,
`tools`, `documents`, `add_generation_prompt`, the tokenizer's named special tokens
(`bos_token`, `eos_token`, ... from tokenizer_config.json) and any keyword arguments, e.g.
`enable_thinking`. Messages are prepared the same way: keys whose value is None are dropped,
and reasoning given as `reasoning_content`, `thinking` or `reasoning` is visible under both
`reasoning_content` and `thinking`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokenizer import read_tokenizer_config

# The names reasoning arrives under; the first is the one templates read.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A template that does not compile, or a conversation the template refuses to render."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    rendering keeps the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def special_token_variables(tokenizer_config: dict) -> dict[str, str]:
    """The `*_token` entries of tokenizer_config.json (and `extra_special_tokens` given as a
    mapping) as strings: the template variables transformers passes."""
    items = dict(tokenizer_config)
    extra = items.get("extra_special_tokens")
    if isinstance(extra, dict):
        items.update(extra)
    out = {}
    for key, value in items.items():
        if isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            out[key] = value
    return out


def _prepare(message: Any) -> dict:
    if not isinstance(message, dict):
        raise ChatTemplateError(f"a message must be a dict, got {type(message).__name__}")
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class ChatTemplate:
    """One checkpoint's chat template(s), compiled once; `source` names where they came from.

    `templates` is a template string, or named templates (transformers' rule picks one: the
    name asked for, else `tool_use` when tools are given, else `default`)."""

    def __init__(self, templates: str | dict[str, str], *, special_tokens: dict[str, str],
                 source: str) -> None:
        self.source = source
        self.templates = templates
        self.special_tokens = dict(special_tokens)
        named = templates if isinstance(templates, dict) else {"default": templates}
        env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}
        for name, text in named.items():
            try:
                self._compiled[name] = env.from_string(text)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"{source}: chat template {name!r}: {e}") from e

    @classmethod
    def from_tokenizer_config(cls, tokenizer_config: dict, *, jinja_text: str | None = None,
                              source: str) -> ChatTemplate:
        """From tokenizer_config.json's `chat_template` (a string or a list of {name, template}),
        unless `jinja_text` (a chat_template.jinja file's text) is given, which wins."""
        templates: Any = jinja_text if jinja_text is not None else tokenizer_config.get(
            "chat_template")
        if isinstance(templates, list):
            try:
                templates = {t["name"]: t["template"] for t in templates}
            except (TypeError, KeyError) as e:
                raise ChatTemplateError(f"{source}: field 'chat_template': a list entry lacks "
                                        f"'name' or 'template'") from e
        if not isinstance(templates, (str, dict)):
            raise ChatTemplateError(f"{source}: field 'chat_template': missing")
        return cls(templates, special_tokens=special_token_variables(tokenizer_config),
                   source=source)

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate:
        """chat_template.jinja if present, else tokenizer_config.json's `chat_template`."""
        path = Path(path)
        config = read_tokenizer_config(path)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.exists():
            return cls.from_tokenizer_config(config, jinja_text=jinja_file.read_text("utf-8"),
                                             source=str(jinja_file))
        return cls.from_tokenizer_config(config, source=str(path / "tokenizer_config.json"))

    def _pick(self, name: str | None, tools: Any) -> jinja2.Template:
        if name is not None:
            if name not in self._compiled:
                raise ChatTemplateError(f"{self.source}: no chat template named {name!r}")
            return self._compiled[name]
        if tools is not None and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        raise ChatTemplateError(f"{self.source}: several chat templates and none is 'default': "
                                f"{sorted(self._compiled)}")

    def render(self, messages: list[dict], *, tools: list[dict] | None = None,
               documents: list[dict] | None = None, add_generation_prompt: bool = False,
               enable_thinking: bool | None = None, template_name: str | None = None,
               **kwargs: Any) -> str:
        """The prompt text for `messages`. `enable_thinking=None` leaves the variable undefined
        (the template's default applies). Raises ChatTemplateError for a conversation the
        template refuses (`raise_exception`) or cannot render."""
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        variables = {**self.special_tokens, **kwargs}
        template = self._pick(template_name, tools)
        prepared = [_prepare(m) for m in messages]
        try:
            return template.render(messages=prepared, tools=tools,
                                   documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise ChatTemplateError(f"chat template: {e}") from e


# A Qwen3-style template written for ninfer's tiny models. Its one departure from Qwen3's own:
# an assistant turn always renders as the generation prompt + what the model wrote +
# <|im_end|> (past reasoning kept, an empty think block when there was none), so re-rendering
# a conversation's history reproduces the exact tokens of earlier turns and prefixes are reused.
QWEN3_STYLE_TEMPLATE = r"""
{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is mapping -%}
        {{- raise_exception('message content must be a string or a list of parts') -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('only text content parts are supported') -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(start=0, system='') -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set ns.start = 1 -%}
    {%- set ns.system = text(messages[0].content) -%}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if ns.system -%}
        {{- ns.system ~ '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call the functions below. '
        ~ 'Their JSON schemas are inside <tools></tools>:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' ~ (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, write a JSON object with its name and arguments '
        ~ 'between <tool_call></tool_call> tags:\n<tool_call>\n'
        ~ '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif ns.start -%}
    {{- '<|im_start|>system\n' ~ ns.system ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
    {%- if message.role == 'user' -%}
        {{- '<|im_start|>user\n' ~ text(message.content) ~ '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = message.reasoning_content
                if message.reasoning_content is string else '' -%}
        {%- set content = text(message.content) -%}
        {{- '<|im_start|>assistant\n<think>\n' ~ reasoning ~ '\n</think>\n\n' ~ content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}
                {{- '\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n{"name": ' ~ (fn.name | tojson) ~ ', "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- (fn.arguments if fn.arguments is defined else {}) | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' ~ text(message.content) ~ '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('unexpected role ' ~ (message.role | tojson)
                            ~ ' (a system message may only come first)') -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n<think>\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()

# The same template with thinking off unless a request turns it on (`enable_thinking=True`):
# the generation prompt closes an empty think block, so a model trained without reasoning
# (the trained default model) answers at once, in `content`.
QWEN3_STYLE_TEMPLATE_THINKING_OFF = QWEN3_STYLE_TEMPLATE.replace(
    "{%- if enable_thinking is defined and not enable_thinking -%}",
    "{%- if not enable_thinking -%}")

# The same with each listed function's description before its name (and its parameters
# last): a small model told what a function does finds the name that follows the matching
# description more easily than the one before it (`ninfer train corpus --tool-order`).
# Keys other than these three are left out of the list.
_TOOL_AS_GIVEN = "{{- '\\n' ~ (tool | tojson) -}}"
_TOOL_DESCRIPTION_FIRST = r"""{%- set fn = tool.function if tool.function is defined else tool -%}
        {{- '\n{"type": "function", "function": {"description": '
            ~ ((fn.description if fn.description is defined else '') | tojson)
            ~ ', "name": ' ~ (fn.name | tojson) ~ ', "parameters": '
            ~ ((fn.parameters if fn.parameters is defined else {}) | tojson) ~ '}}' -}}"""
QWEN3_STYLE_TEMPLATE_THINKING_OFF_DESCRIPTION_FIRST = QWEN3_STYLE_TEMPLATE_THINKING_OFF.replace(
    _TOOL_AS_GIVEN, _TOOL_DESCRIPTION_FIRST)
