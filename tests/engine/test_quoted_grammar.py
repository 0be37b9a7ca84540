"""A custom tool's input grammar held inside a JSON string (ninfer/server/quoted_grammar.py):
the quoted grammar accepts exactly the escapings of the sentences the raw grammar accepts,
for regexes (checked against Python's `re` on generated text) and Lark grammars, and
what it cannot rewrite is refused by name. Matched on the embedded model's tokenizer."""

from __future__ import annotations

import functools
import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ninfer.server.quoted_grammar import escaped, quoted_lark, quoted_regex
from ninfer.server.reply_grammar import InputGrammar, ToolCalls, ToolFormat, reply_grammar

from .embedded import grammars, tokenizer


def accepts(grammar: str, text: str) -> bool:
    """Whether llguidance's matcher of `grammar` (its whole text) takes `text` to an end."""
    matcher = grammars().matcher(grammar)
    for token in tokenizer().encode(text):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


@functools.cache
def lark(body: str) -> str:
    return json.dumps({"grammars": [{"lark_grammar": body}]})


# the characters JSON escapes (quote, backslash, controls) among ones it keeps
ALPHABET = st.sampled_from(list('ab z09_"\\/\n\t\r\x01\x1f\x7fé'))
PATTERNS = [r".+", r"(?s:.*)", r'[a-z"\\]+', r"[^a\n]*z", r"\d{1,3}( \w+)?", r'a|b\n|"',
            r"[\t-\r]+", r'(ab|"z)*\\', r"[\x00-\x1f]?é"]


@pytest.mark.parametrize("pattern", PATTERNS)
@given(text=st.text(ALPHABET, max_size=8))
def test_a_quoted_regex_accepts_exactly_the_escaped_matches(pattern, text):
    quoted = lark("start: " + quoted_regex(pattern))
    assert accepts(quoted, escaped(text)) == bool(re.fullmatch(pattern, text))


# a patch-like grammar of our own, with what agents' grammars use: literals, regex
# terminals, a common import, an alias, a literal range, bounded repetition, comments
PATCH = r'''
// a small patch language
start: "*** Begin\n" change{1,3} "*** End" LF?
change: ("+" | "-") TEXT LF -> changed
    | "@" DIGIT+ LF      # a line number
TEXT: /[^\n]{0,12}/
DIGIT: "0".."9"
%import common.LF
'''
PATCH_RE = r"\*\*\* Begin\n(?:[+-][^\n]{0,12}\n|@[0-9]+\n){1,3}\*\*\* End\n?"


@given(lines=st.lists(st.one_of(st.tuples(st.sampled_from("+-@ "), st.text(ALPHABET,
                                                                          max_size=14))),
                      min_size=0, max_size=4),
       end=st.sampled_from(["*** End", "*** End\n", "*** Ende", ""]))
def test_a_quoted_lark_grammar_accepts_exactly_the_escaped_sentences(lines, end):
    text = "*** Begin\n" + "".join(mark + body + "\n" for mark, body in lines) + end
    assert accepts(lark(quoted_lark(PATCH)), escaped(text)) == bool(re.fullmatch(PATCH_RE, text))


def test_the_raw_text_is_not_its_own_escaping():
    text = '*** Begin\n+say "hi"\n*** End\n'
    assert re.fullmatch(PATCH_RE, text)
    assert accepts(lark(quoted_lark(PATCH)), escaped(text))
    assert not accepts(lark(quoted_lark(PATCH)), text)
    assert accepts(lark(PATCH), text)   # the grammar as written, for comparison


@pytest.mark.parametrize("grammar,words", [
    ('start: %json {"type": "object"}', "%json"),
    ("start: /^a/", "anchors"),
    ('start: "a"i', "case-insensitive"),
    ("start: /(a)\\1/", "back-references"),
    ("start: @other", "@other"),
    ("start: <|im_end|>", "<|im_end|>"),
    ("start: FOO\n%import common.FOO", "common.FOO"),
    ("start: WS\n%ignore WS", "%ignore"),
    ('start: "ab".."c"', "one character"),
    ("start: /(?i:a)/", "case-insensitive"),
])
def test_what_cannot_be_quoted_is_refused_by_name(grammar, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        quoted_lark(grammar)


PATCH_TOOL = ToolFormat("patch", {"type": "object", "properties": {"input": {"type": "string"}},
                                  "required": ["input"]}, input=InputGrammar("lark", PATCH))


def call(text: str) -> str:
    arguments = json.dumps({"input": text}, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "patch", "arguments": {arguments}}}\n</tool_call>'


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
def test_a_custom_tools_input_is_held_in_every_tool_choice_mode(mode):
    grammar = reply_grammar(calls=ToolCalls((PATCH_TOOL,), mode))
    assert grammar is not None
    good = '*** Begin\n+x = "\\t"\n@12\n*** End\n'
    assert accepts(grammar, call(good))
    assert not accepts(grammar, call("*** Begin\n*** End\n"))         # no change
    assert not accepts(grammar, call('*** Begin\n+a "long" line, too long\n*** End'))
    assert accepts(grammar, "No patch needed.") == (mode == "auto")


def test_a_regex_input_grammar():
    tool = PATCH_TOOL._replace(input=InputGrammar("regex", r'[a-z]+ "[^"\n]*"'))
    grammar = reply_grammar(calls=ToolCalls((tool,), "required"))
    assert accepts(grammar, call('say "hi there"'))
    assert not accepts(grammar, call('say "hi\nthere"'))
    assert not accepts(grammar, call("say hi"))


# lines of any text (runs of one class at each regex's end: one lexeme a run, not one a
# character; still exactly the escaped sentences)
LINES = r'''
start: "<<" NAME LF line+ ">>"
line: ("+" | " ") TEXT LF
NAME: /[^\n]+/
TEXT: /.*/
%import common.LF
'''
LINES_RE = r"<<[^\n]+\n(?:[+ ][^\n]*\n)+>>"


@given(name=st.text(ALPHABET, max_size=6),
       lines=st.lists(st.tuples(st.sampled_from("+ -"), st.text(ALPHABET, max_size=10)),
                      max_size=3))
def test_runs_at_a_regexs_end_are_held_exactly(name, lines):
    text = "<<" + name + "\n" + "".join(m + t + "\n" for m, t in lines) + ">>"
    assert accepts(lark(quoted_lark(LINES)), escaped(text)) == bool(re.fullmatch(LINES_RE, text))
