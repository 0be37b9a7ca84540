"""Chat templates render as transformers' apply_chat_template does, and the tiny model's
template keeps conversation prefixes stable token for token."""

import json
import shutil

import pytest

from ninfer.model.template import ChatTemplate, ChatTemplateError, special_token_variables
from ninfer.model.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city (°C) <b>now</b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALL_DICT = {"type": "function", "function": {"name": "now", "arguments": {"tz": "Europe/Zürich"}}}

CONVERSATIONS = {
    "plain": ([{"role": "user", "content": "Hi there é 😀"}], None),
    "system": ([{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": [{"type": "text", "text": "Two "},
                                             {"type": "text", "text": "parts"}]}], None),
    "tools": ([{"role": "system", "content": "You help with weather."},
               {"role": "user", "content": "Weather in Paris, and the time?"},
               {"role": "assistant", "content": None, "reasoning_content": "Need tools.",
                "tool_calls": [CALL, CALL_DICT]},
               {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
               {"role": "tool", "content": "12:00"},
               {"role": "assistant", "content": "21 °C at noon.", "reasoning": "Easy."},
               {"role": "user", "content": "Thanks"}], [WEATHER, CLOCK]),
    "tools_no_system": ([{"role": "user", "content": "Time?"},
                         {"role": "assistant", "content": "Let me check.",
                          "tool_calls": [CALL_DICT]},
                         {"role": "tool", "content": "12:00"}], [CLOCK]),
    "reasoning": ([{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                   {"role": "user", "content": "3+3?"},
                   {"role": "assistant", "content": "6", "thinking": ""},
                   {"role": "user", "content": "And 4+4?"}], None),
}


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("gen", [True, False])
def test_matches_transformers(tiny_dir, hf, name, thinking, gen):
    messages, tools = CONVERSATIONS[name]
    extra = {} if thinking is None else {"enable_thinking": thinking}
    want = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                  add_generation_prompt=gen, **extra)
    got = ChatTemplate.from_dir(tiny_dir).render(messages, tools=tools,
                                                 add_generation_prompt=gen, **extra)
    assert got == want


CUSTOM = """{{ bos_token }}{% for m in messages %}{% generation %}[{{ m.role | upper }}]
    {{- m.content | tojson }}{% endgeneration %}
{% if loop.index == 2 %}{% break %}{% endif %}{% endfor %}
{%- if tools %}{{ tools | tojson(indent=2) }}{% endif %}
{{ strftime_now('%Y') }}|{{ answer_style }}|{{ eos_token }}|{{ think_token }}"""


def test_environment_matches_transformers(tiny_dir, tmp_path):
    # named special tokens as variables (bos/eos and a model-specific one), tojson without
    # HTML escaping and with options, {% generation %}, loop controls, strftime_now, kwargs
    from transformers import AutoTokenizer

    d = shutil.copytree(tiny_dir, tmp_path / "m")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.update(bos_token="<|endoftext|>", chat_template=CUSTOM, think_token="<think>")
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "<a href='x'>é</a>"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "3rd"}]
    want = AutoTokenizer.from_pretrained(d).apply_chat_template(
        messages, tools=[CLOCK], tokenize=False, answer_style="short")
    got = ChatTemplate.from_dir(d).render(messages, tools=[CLOCK], answer_style="short")
    assert got == want
    assert got.startswith("<|endoftext|>[USER]") and got.endswith("|short|<|im_end|>|<think>")


def test_special_token_variables():
    # older tokenizer_config.json files write tokens as AddedToken objects
    config = {"eos_token": {"__type": "AddedToken", "content": "</s>"}, "unk_token": None,
              "extra_special_tokens": {"image_token": "<img>"}, "model_max_length": 8}
    assert special_token_variables(config) == {"eos_token": "</s>", "image_token": "<img>"}


def test_named_templates_and_jinja_file(tiny_dir, tmp_path):
    named = ChatTemplate({"default": "D", "tool_use": "T{{ (tools or []) | length }}"},
                         special_tokens={}, source="test")
    assert named.render([]) == "D"
    assert named.render([], tools=[CLOCK]) == "T1"
    assert named.render([], template_name="tool_use") == "T0"
    # chat_template.jinja beside tokenizer_config.json wins, as in transformers
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text("J:{{ messages[0].content }}")
    assert ChatTemplate.from_dir(d).render([{"role": "user", "content": "x"}]) == "J:x"


def test_refusals():
    t = ChatTemplate.from_tokenizer_config({"chat_template": "x"}, source="test")
    with pytest.raises(ChatTemplateError, match="bad role"):
        ChatTemplate("{{ raise_exception('bad role') }}", special_tokens={},
                     source="t").render([])
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json"):
        ChatTemplate("{% for %}", special_tokens={}, source="tokenizer_config.json")
    with pytest.raises(ChatTemplateError, match="missing"):
        ChatTemplate.from_tokenizer_config({}, source="tokenizer_config.json")
    assert t.render([]) == "x"


def test_tiny_template_refuses_a_late_system_message(tiny_dir):
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="system"):
        ChatTemplate.from_dir(tiny_dir).render(messages)


TURNS = [  # (enable_thinking, the text the model generates, the message a client sends back)
    (True, "Think about it.\n</think>\n\nThe answer is 4.",
     {"role": "assistant", "reasoning_content": "Think about it.", "content": "The answer is 4."}),
    (False, "Paris, mostly — café weather ☕.",
     {"role": "assistant", "content": "Paris, mostly — café weather ☕."}),
    (False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     {"role": "assistant", "content": "", "tool_calls": [CALL]}),
    (True, 'Use the tool.\n</think>\n\nChecking.\n<tool_call>\n{"name": "now", "arguments": '
           '{"tz": "Europe/Zürich"}}\n</tool_call>',
     {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
      "tool_calls": [CALL_DICT]}),
]


@pytest.mark.parametrize("name", ["tools", "reasoning", "system"])
@pytest.mark.parametrize("turn", range(len(TURNS)))
def test_history_reproduces_generated_tokens(tiny_dir, name, turn):
    # The server reuses a conversation's cached prefix only if re-rendering the history gives
    # exactly the ids it computed: the prompt, the reply as generated, then <|im_end|>.
    tok, template = Tokenizer.from_dir(tiny_dir), ChatTemplate.from_dir(tiny_dir)
    messages, tools = CONVERSATIONS[name]
    thinking, generated, reply = TURNS[turn]
    prompt_ids = tok.encode(template.render(messages, tools=tools, add_generation_prompt=True,
                                            enable_thinking=thinking))
    computed = prompt_ids + tok.encode(generated) + [tok.special.im_end]
    history = messages + [reply]
    assert tok.encode(template.render(history, tools=tools))[:len(computed)] == computed
    follow_up = template.render(history + [{"role": "user", "content": "More?"}], tools=tools,
                                add_generation_prompt=True, enable_thinking=thinking)
    assert tok.encode(follow_up)[:len(computed)] == computed
