"""A custom tool's input grammar, rewritten as the grammar of that input inside a JSON string.

The model calls a Responses API `custom` tool as a function of one string parameter
(`{"name": ..., "arguments": {"input": "..."}}`), so it writes the input JSON-escaped. A
tool's `format` (`{"type": "grammar", "syntax": "lark" | "regex", "definition": ...}`)
describes the raw input: the Codex CLI's patch tool sends a Lark grammar of patches. To hold
the escaped text to it, `quoted_lark` and `quoted_regex` map a grammar of text to the grammar
of its escaping, character by character, the way `json.dumps(..., ensure_ascii=False)` and the
chat template write a string: `\\"`, `\\\\`, `\\n`, `\\r`, `\\t`, `\\b`, `\\f`, `\\u00XX` for the
other control characters, every other character as itself.

Escaping is a prefix code (no escape is a prefix of another, and a plain character never
starts one), so it maps each terminal's language to exactly the escaped strings of that
language and leaves the grammar's structure alone: string literals become their escaped
text, each regular expression's characters and classes become the alternatives of their
escapes, rules and everything else are kept. Terminals become rules, their characters
lexemes (see `quoted_regex`: the lexer is greedy, and escapes share their first byte).

Supported: Lark's rules, literals (and `"a".."z"` ranges), regexes with the `s` and `x`
flags, `%import common.NAME` of the common terminals below; not: `%ignore`, case-insensitive
matching, anchors, look-around and back-references, and llguidance's extensions (`%json`,
`%regex`, special tokens, sub-grammar references). Those raise ValueError naming them (the
client gets a 400).
"""

from __future__ import annotations

import ast
import json
import re
import re._constants as C  # noqa: N812 (the parser's opcodes)
import re._parser as sre

# the characters JSON escapes, and how
_SPECIAL = [chr(c) for c in range(0x20)] + ['"', "\\"]
_PLAIN_CLASS = r"\x{22}\x{5c}\x{0}-\x{1f}"   # a Rust-regex class body of the specials

# Lark's common terminals (lark/grammars/common.lark), as the regexes they define
COMMON = {
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[0-9a-fA-F]", "INT": r"[0-9]+",
    "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+",
    "FLOAT": r"[0-9]+[eE][+-]?[0-9]+|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?",
    "NUMBER": r"[0-9]+(?:[eE][+-]?[0-9]+)?|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?",
    "SIGNED_NUMBER": r"[+-]?(?:[0-9]+(?:[eE][+-]?[0-9]+)?|(?:[0-9]+\.[0-9]*|\.[0-9]+)"
                     r"(?:[eE][+-]?[0-9]+)?)",
    "ESCAPED_STRING": r'"(?:[^"\\\n]|\\.)*"',
    "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]", "LETTER": r"[a-zA-Z]",
    "WORD": r"[a-zA-Z]+", "CNAME": r"[_a-zA-Z][_a-zA-Z0-9]*",
    "WS_INLINE": r"[ \t]+", "WS": r"[ \t\f\r\n]+", "CR": r"\r", "LF": r"\n",
    "NEWLINE": r"(?:\r?\n)+", "SH_COMMENT": r"#[^\n]*", "CPP_COMMENT": r"//[^\n]*",
}


def escaped(text: str) -> str:
    """`text` as it stands inside a JSON string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def quoted_regex(pattern: str, *, dotall: bool = False, verbose: bool = False) -> str:
    """A Lark rule expression of the JSON escapings of `pattern`'s matches. Each character
    is a lexeme of its own (a literal run one string), the regex's structure is the rule's:
    a regex terminal would be lexed greedily, and an escaped character that continues it
    (`\\\\`) and one that ends it for the next (`\\n`) share their first byte.

    But a run of one class at the regex's end (`.*`, `[^\\n]+`: what patch and line
    grammars are made of) has its plain characters as one lexeme, each escape as one: a
    lexeme per character costs the matcher its time per token many times over on a large
    vocabulary. That run is greedy, as the regex's terminal would have been: it ends where
    its class does or an escape starts."""
    flags = C.SRE_FLAG_VERBOSE if verbose else 0
    try:
        parsed = sre.parse(pattern, flags)
    except re.error as e:
        raise ValueError(f"the regex {pattern!r} does not parse: {e}") from None
    if parsed.state.flags & C.SRE_FLAG_IGNORECASE:
        raise ValueError("case-insensitive regexes are not supported in a tool's grammar")
    expression = _sequence(parsed, dotall or bool(parsed.state.flags & C.SRE_FLAG_DOTALL),
                           tail=True)
    if not expression:
        raise ValueError(f"the regex {pattern!r} matches only the empty string")
    return expression


def _sequence(items, dotall: bool, tail: bool = False) -> str:
    """The items in a row ("" when they match only the empty string). `tail`: nothing of the
    regex follows them."""
    parts: list[str] = []
    run = ""
    for i, (op, av) in enumerate(items):
        if op is C.LITERAL:
            run += chr(av)
            continue
        if run:
            parts.append(json.dumps(escaped(run), ensure_ascii=False))
            run = ""
        part = _item(op, av, dotall, tail and i == len(items) - 1)
        if part:
            parts.append(part)
    if run:
        parts.append(json.dumps(escaped(run), ensure_ascii=False))
    return " ".join(parts)


def _item(op, av, dotall: bool, tail: bool) -> str:
    if op in (C.NOT_LITERAL, C.ANY, C.IN):
        plain, escapes = _charset(op, av, dotall)
        return f"/{plain}|{escapes}/" if escapes else f"/{plain}/"
    if op is C.BRANCH:
        branches = [_sequence(b, dotall, tail) for b in av[1]]
        alternatives = [b for b in branches if b]
        if not alternatives:
            return ""
        return "(" + " | ".join(alternatives) + ")" + ("?" if len(alternatives) < len(branches)
                                                        else "")
    if op is C.SUBPATTERN:
        _group, add, remove, body = av
        if add & C.SRE_FLAG_IGNORECASE:
            raise ValueError("case-insensitive groups are not supported in a tool's grammar")
        inner = (dotall or bool(add & C.SRE_FLAG_DOTALL)) and not remove & C.SRE_FLAG_DOTALL
        body = _sequence(body, inner, tail)
        return f"({body})" if body else ""
    if op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
        low, high, body = av
        if tail and low <= 1 and high == C.MAXREPEAT and len(body) == 1 and \
                body[0][0] in (C.NOT_LITERAL, C.ANY, C.IN):
            # a run of one class at the end (see quoted_regex): its plain characters one
            # greedy lexeme (none is a backslash: it ends where an escape starts)
            plain, escapes = _charset(*body[0], dotall)
            run = f"/({plain})+/" + (f" | /{escapes}/" if escapes else "")
            return f"({run})" + ("*" if low == 0 else "+")
        body = _sequence(body, dotall)
        if not body or high == 0:
            return ""
        times = {(0, C.MAXREPEAT): "*", (1, C.MAXREPEAT): "+", (0, 1): "?"}.get(
            (low, high), f"{{{low},}}" if high == C.MAXREPEAT else
            f"{{{low}}}" if low == high else f"{{{low},{high}}}")
        return f"({body}){times}"
    if op is C.ATOMIC_GROUP:
        body = _sequence(av, dotall, tail)
        return f"({body})" if body else ""
    raise ValueError(f"{_NAMES.get(op, str(op).lower())} are not supported in a tool's "
                     f"grammar's regexes")


_NAMES = {C.AT: "anchors", C.ASSERT: "look-arounds", C.ASSERT_NOT: "look-arounds",
          C.GROUPREF: "back-references", C.GROUPREF_EXISTS: "conditionals"}
_CATEGORIES = {C.CATEGORY_DIGIT: r"\d", C.CATEGORY_NOT_DIGIT: r"\D", C.CATEGORY_SPACE: r"\s",
               C.CATEGORY_NOT_SPACE: r"\S", C.CATEGORY_WORD: r"\w", C.CATEGORY_NOT_WORD: r"\W"}
_SHORT = {'"': '"', "\\": "\\", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}


def _charset(op, av, dotall: bool) -> tuple[str, str | None]:
    """One character of a class (sre's NOT_LITERAL, ANY or IN item) as the regexes of its
    escaping: the plain characters (a class, possibly empty), and the escapes (None when
    the class holds no character JSON escapes)."""
    if op is C.NOT_LITERAL:
        items = [(C.NEGATE, None), (C.LITERAL, av)]
    elif op is C.ANY:
        items = [] if dotall else [(C.NEGATE, None), (C.LITERAL, 10)]
    else:
        items = av
    everything = op is C.ANY and dotall
    negated = bool(items) and items[0][0] is C.NEGATE
    body_py, body_rs = [], []
    for item, value in items[1:] if negated else items:
        if item is C.LITERAL:
            body_py.append(re.escape(chr(value)))
            body_rs.append(f"\\x{{{value:x}}}")
        elif item is C.RANGE:
            body_py.append(f"{re.escape(chr(value[0]))}-{re.escape(chr(value[1]))}")
            body_rs.append(f"\\x{{{value[0]:x}}}-\\x{{{value[1]:x}}}")
        elif item is C.CATEGORY and value in _CATEGORIES:
            body_py.append(_CATEGORIES[value])
            body_rs.append(_CATEGORIES[value])
        else:
            raise ValueError(f"the character class item {item} is not supported in a tool's "
                             f"grammar")
    if everything:
        specials = _SPECIAL
        plain = f"[^{_PLAIN_CLASS}]"
    else:
        cls = re.compile("[" + ("^" if negated else "") + "".join(body_py) + "]")
        specials = [c for c in _SPECIAL if cls.fullmatch(c)]
        inner = ("[^" if negated else "[") + "".join(body_rs) + "]"
        plain = f"[{inner}&&[^{_PLAIN_CLASS}]]"   # may be empty, as for [\n]: harmless
    short = "".join(_SHORT[c] for c in specials if c in _SHORT)
    long = [f"{ord(c):02x}" for c in specials if c not in _SHORT]
    escapes = ([f"[{re.escape(short)}]"] if short else []) + \
        (["u00(?:" + "|".join(long) + ")"] if long else [])
    return plain, (r"\\(?:" + "|".join(escapes) + ")") if escapes else None


# --- Lark grammars -------------------------------------------------------------------------

_STRING = r'"(?:[^"\\\n]|\\.)*"'
_TOKENS = re.compile("|".join([
    r"(?P<comment>//[^\n]*|\#[^\n]*)",
    rf"(?P<range>(?P<lo>{_STRING})\s*\.\.\s*(?P<hi>{_STRING}))",
    rf"(?P<string>{_STRING})(?P<nocase>i?)",
    r"(?P<regex>/(?P<pattern>(?:[^/\\\n]|\\.)+)/(?P<flags>[imslux]*))",
    r"(?P<imports>%import\s+common\s*(?:\.\s*(?P<one>\w+)(?:\s*->\s*(?P<alias>\w+))?"
    r"|\((?P<many>[\w\s,]+)\)))",
    r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)",
    r"(?P<unsupported>%\w+|@\w+|<[^\s>]*>)",
    r"(?P<other>.|\n)",
]))
_TERMINAL = re.compile(r"_?[A-Z][_A-Z0-9]*")


def quoted_lark(grammar: str) -> str:
    """The Lark grammar of the JSON escapings of `grammar`'s sentences (see the module).
    Its terminals become rules (`tq_<name>`): a terminal is lexed greedily as a whole, which
    the escaping would break (see `quoted_regex`)."""
    out: list[str] = []
    imports: list[tuple[str, str]] = []
    for token in _TOKENS.finditer(grammar):
        kind = token.lastgroup if token.lastgroup not in ("lo", "hi", "nocase", "pattern",
                                                          "flags", "one", "alias", "many") \
            else _outer(token)
        if kind == "comment":
            continue
        if kind == "range":
            lo, hi = _decode(token.group("lo")), _decode(token.group("hi"))
            if len(lo) != 1 or len(hi) != 1:
                raise ValueError("a literal range needs one character at each end")
            out.append(quoted_regex(f"[{re.escape(lo)}-{re.escape(hi)}]"))
        elif kind == "string":
            if token.group("nocase"):
                raise ValueError("case-insensitive literals are not supported in a tool's "
                                 "grammar")
            text = _decode(token.group("string"))
            out.append(json.dumps(escaped(text), ensure_ascii=False) if text else "")
        elif kind == "regex":
            flags = token.group("flags")
            if "i" in flags:
                raise ValueError("case-insensitive regexes are not supported in a tool's "
                                 "grammar")
            pattern = token.group("pattern").replace("\\/", "/")
            out.append("(" + quoted_regex(pattern, dotall="s" in flags, verbose="x" in flags)
                       + ")")
        elif kind == "imports":
            if token.group("one"):
                imports.append((token.group("one"), token.group("alias") or token.group("one")))
            else:
                imports += [(n, n) for n in re.findall(r"\w+", token.group("many"))]
        elif kind == "name":
            out.append(_rule_name(token.group(0)))
        elif kind == "unsupported":
            raise ValueError(f"{token.group(0)!r} is not supported in a tool's grammar "
                             "(only rules, terminals, literals, regexes and "
                             "%import common.NAME are)")
        else:
            out.append(token.group(0))
    for name, alias in imports:
        if name not in COMMON:
            raise ValueError(f"common.{name} is not a known common terminal")
        out.append(f"\n{_rule_name(alias)}: {quoted_regex(COMMON[name])}\n")
    return "".join(out)


def _outer(token: re.Match) -> str:
    for kind in ("range", "string", "regex", "imports"):
        if token.group(kind) is not None:
            return kind
    raise AssertionError(token)


def _rule_name(name: str) -> str:
    """A terminal's name as the rule it becomes; a rule's as it is."""
    return f"tq_{name.lower()}" if _TERMINAL.fullmatch(name) else name


def _decode(literal: str) -> str:
    try:
        value = ast.literal_eval(literal)
    except (SyntaxError, ValueError):
        raise ValueError(f"the literal {literal} does not parse") from None
    return value
