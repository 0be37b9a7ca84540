"""The corpus: a stable manifest of the stdlib files it read, held-out modules kept out of
training, chat examples rendered exactly as the server renders the same conversation, and a
tokenizer that round-trips."""

import hashlib
import json
import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer

from ninfer.model.template import ChatTemplate
from ninfer.server.schemas import ChatRequest
from ninfer.server.unified import from_chat
from ninfer.train import examples as ex
from ninfer.train.corpus import Corpus, CorpusError, build, trained_template
from ninfer.train.sources import HELD_OUT, files_sha256, functions, scan, stdlib_root

from .conftest import SLICE, SLICE_VOCAB


def test_the_manifest_names_every_file_by_its_sha256(slice_corpus):
    m = slice_corpus.manifest
    root = stdlib_root()
    assert {f["path"].split("/")[0].removesuffix(".py") for f in m["files"]} == set(SLICE)
    for f in m["files"]:
        data = (root / f["path"]).read_bytes()
        assert f["sha256"] == hashlib.sha256(data).hexdigest() and f["bytes"] == len(data)
        assert f["split"] == ("held_out" if f["path"].split("/")[0].removesuffix(".py")
                              in HELD_OUT else "train")
    listing = "".join(f"{f['sha256']}  {f['path']}\n" for f in m["files"])
    assert m["files_sha256"] == hashlib.sha256(listing.encode()).hexdigest()
    assert not any("/test/" in f["path"] or "/tests/" in f["path"] for f in m["files"])


def test_the_same_sources_build_byte_identical_corpora(slice_corpus, tmp_path):
    again = Corpus.open(build(tmp_path / "again", modules=SLICE, vocab_size=SLICE_VOCAB))
    assert again.sha256 == slice_corpus.sha256
    for name in ("manifest.json", "tokenizer.json", "train.bin", "heldout.bin", "heldout.json"):
        assert (again.path / name).read_bytes() == (slice_corpus.path / name).read_bytes()
    other = Corpus.open(build(tmp_path / "other", modules=SLICE, vocab_size=SLICE_VOCAB, seed=1))
    assert other.sha256 != slice_corpus.sha256  # the seed is part of the corpus's name


def test_a_file_that_does_not_match_the_manifest_is_refused(slice_corpus, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in slice_corpus.path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    Corpus.open(copy)
    data = bytearray((copy / "train.bin").read_bytes())
    data[10] ^= 1
    (copy / "train.bin").write_bytes(bytes(data))
    with pytest.raises(CorpusError, match="train.bin: sha256"):
        Corpus.open(copy)


def test_held_out_modules_are_neither_trained_on_nor_made_into_training_examples(
        slice_corpus):
    backend = BackendTokenizer.from_str(slice_corpus.tokenizer_json)
    train_text = backend.decode(list(slice_corpus.ids("train.bin")), skip_special_tokens=False)
    held = [f for f in scan(modules=SLICE) if f.split == "held_out"]
    assert {f.top for f in held} == {"textwrap", "shlex", "fnmatch", "colorsys"}
    for f in held:
        for fn in functions(f):
            if len(fn.source) > 200:  # a long body is its module's own
                assert fn.source not in train_text, fn.qualname
    held_sources = "".join(f.text for f in held)
    for kind in ("docstring_prompts", "tool_prompts"):
        items = slice_corpus.eval_items(kind)
        assert items
        for item in items:
            if kind == "docstring_prompts":
                body = item.reference.splitlines()[-1].strip()
                assert body in held_sources and item.reference not in train_text
            else:
                names = {t["function"]["name"] for t in item.tools}
                assert json.loads(item.reference)["name"] in names


def test_the_tokenizer_round_trips_sources_and_chats(slice_corpus):
    backend = BackendTokenizer.from_str(slice_corpus.tokenizer_json)
    assert backend.get_vocab_size() == SLICE_VOCAB
    template = trained_template()
    texts = [s["text"] for s in slice_corpus.heldout["sources"]]
    texts += [ex.render_prompt(template, item) for item in slice_corpus.eval_items("tool_prompts")]
    for text in texts:
        ids = backend.encode(text, add_special_tokens=False).ids
        assert backend.decode(ids, skip_special_tokens=False) == text
    chat = backend.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False).ids
    assert chat[0] == backend.token_to_id("<|im_start|>")
    assert chat[-1] == backend.token_to_id("<|im_end|>")


def _as_server_sees(messages, tools):
    """The messages and tools as the server hands them to the template."""
    body = ChatRequest.model_validate({"messages": messages, "tools": tools})
    unified = from_chat(body, default_budget=None)  # the path every request takes
    return unified.template_messages(), unified.template_tools()


def test_examples_are_what_the_server_renders_for_the_same_conversation():
    files = scan(modules=("json", "textwrap"))
    fns = [fn for f in files for fn in functions(f)]
    rng = random.Random(0)
    pool = [fn for fn in fns if ex.usable_as_tool(fn)]
    chats = [ex.docstring_example(fn, rng) for fn in fns[:20]]
    chats += ex.tool_examples(pool, 20, rng) + ex.tool_examples(pool, 20, rng, made_up=1.0)
    template = trained_template()
    for chat in chats:
        messages, tools = _as_server_sees(chat.messages, chat.tools)
        assert (messages, tools) == (chat.messages, chat.tools)
        whole = ex.render(template, chat)
        # the server's prompt for the assistant's first turn is the rendering up to it
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = template.render(messages[:first], tools=tools, add_generation_prompt=True)
        assert whole.startswith(prompt)
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_trained_template_has_thinking_off_unless_asked():
    template = trained_template()
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages, add_generation_prompt=True).endswith("</think>\n\n")
    on = template.render(messages, add_generation_prompt=True, enable_thinking=True)
    assert on.endswith("<think>\n")
    assert isinstance(template, ChatTemplate)


def test_files_sha256_is_the_digest_of_a_sha256sum_listing():
    files = scan(modules=("json",))
    listing = "".join(f"{hashlib.sha256(f.text.encode()).hexdigest()}  {f.path}\n"
                      for f in files)
    assert files_sha256(files) == hashlib.sha256(listing.encode()).hexdigest()


def test_the_test_suites_are_source_but_not_those_of_held_out_modules(tmp_path):
    """A stdlib folder of our own: the test suites are read (marked as suites), except a
    test named for a held-out module, a file not in UTF-8 and site-packages."""
    files = {"csv.py": "x = 1\n", "json/__init__.py": "y = 2\n",
             "test/test_json.py": "def test_a():\n    pass\n",
             "test/test_csv.py": "import csv\n", "test/test_string_literals.py": "s = ''\n",
             "test/datetimetester.py": "import datetime\n",
             "site-packages/pkg/mod.py": "z = 3\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "test" / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    got = {f.path: (f.split, f.suite) for f in scan(tmp_path)}
    assert got == {"csv.py": ("held_out", False), "json/__init__.py": ("train", False),
                   "test/test_json.py": ("train", True)}


def test_made_up_tools_keep_what_functions_do_and_take_but_no_name_of_theirs():
    """Renamed tools: the docstring and each parameter's type and requiredness kept, every
    name made up (none a real function's or parameter's), distinct, and the call names
    the target as listed, with its renamed parameters."""
    files = scan(modules=("json", "textwrap", "shlex"))
    pool = [fn for f in files for fn in functions(f) if ex.usable_as_tool(fn)]
    real = {fn.name for fn in pool} | {p.name for fn in pool for p in fn.params}
    for seed in range(20):
        rng = random.Random(seed)
        chosen = rng.sample(pool, 4)
        renamed = ex.renamed(chosen, rng)
        assert len({fn.name for fn in renamed}) == 4
        for old, new in zip(chosen, renamed, strict=True):
            assert new.name not in real and new.docstring == old.docstring
            assert [(p.json_type, p.required) for p in new.params] == \
                [(p.json_type, p.required) for p in old.params]
            assert len({p.name for p in new.params}) == len(new.params)
            assert not {p.name for p in new.params} & real
    made = ex.tool_examples(pool, 30, random.Random(1), made_up=1.0)
    for chat in made:
        listed = {t["function"]["name"]: t["function"]["parameters"] for t in chat.tools}
        call = json.loads(chat.reference)
        assert not set(listed) & real and call["name"] in listed
        assert set(call["arguments"]) <= set(listed[call["name"]]["properties"])


def _without_and_with(pool, count: int, seed: int, option: str, share: float):
    """The tool examples without `option` and with it at `share`, after checking that at 0
    it draws what the examples before it drew, and that either way the main stream's next
    draw (the held-out prompts') is the same: the option draws from a stream of its own."""
    rng = random.Random(seed)
    plain = ex.tool_examples(pool, count, rng)
    after = rng.random()
    rng = random.Random(seed)
    assert ex.tool_examples(pool, count, rng, **{option: 0.0}) == plain
    assert rng.random() == after
    rng = random.Random(seed)
    changed = ex.tool_examples(pool, count, rng, **{option: share})
    assert rng.random() == after
    return plain, changed


def test_no_made_up_tools_draws_what_corpora_before_them_drew():
    """`made_up` 0 takes no draw of its own: the corpus the shipped model was trained on
    builds again byte for byte."""
    files = scan(modules=("json", "textwrap"))
    pool = [fn for f in files for fn in functions(f) if ex.usable_as_tool(fn)]
    plain, some = _without_and_with(pool, 40, 5, "made_up", 0.5)
    assert some != plain


def test_made_up_names_from_words_recombine_real_names_parts_and_copy_as_listed():
    """With `pieces`, a renamed function's name is two parts of real names (joined by "_"
    or not) and each parameter's one part or more, none one of the functions' real names;
    the call names what is listed."""
    files = scan(modules=("json", "textwrap", "shlex"))
    pool = [fn for f in files for fn in functions(f) if ex.usable_as_tool(fn)]
    pieces = ex.name_pieces(pool)
    assert "dedent" in pieces and "split" in pieces and "" not in pieces

    def made_of_pieces(name: str) -> bool:   # pieces joined by "_" or nothing, 2 or more
        ends = {0: 0}                        # end of a prefix -> pieces in it
        for i in range(len(name) + 1):
            if i in ends:
                at = i + (name[i:i + 1] == "_" and i > 0)
                for piece in pieces:
                    if name.startswith(piece, at):
                        ends[at + len(piece)] = max(ends.get(at + len(piece), 0), ends[i] + 1)
        return ends.get(len(name), 0) >= 2
    real = {fn.name for fn in pool} | {p.name for fn in pool for p in fn.params}
    for seed in range(20):
        rng = random.Random(seed)
        chosen = rng.sample(pool, 4)
        renamed = ex.renamed(chosen, rng, pieces)
        own = {fn.name for fn in chosen} | {p.name for fn in chosen for p in fn.params}
        assert len({fn.name for fn in renamed}) == 4
        for old, new in zip(chosen, renamed, strict=True):
            assert new.name not in own and new.docstring == old.docstring
            assert made_of_pieces(new.name), new.name
            assert len({p.name for p in new.params}) == len(new.params)
            assert all(p.name.split("_")[0] in pieces for p in new.params)
            assert not {p.name for p in new.params} & own
    made = ex.tool_examples(pool, 30, random.Random(1), made_up=1.0, pieces=pieces)
    assert any(not set(t["function"]["name"] for t in c.tools) <= real for c in made)
    for chat in made:
        listed = {t["function"]["name"]: t["function"]["parameters"] for t in chat.tools}
        call = json.loads(chat.reference)
        assert call["name"] in listed
        assert set(call["arguments"]) <= set(listed[call["name"]]["properties"])


def test_an_unknown_way_of_making_names_is_refused_before_anything_is_read(tmp_path):
    with pytest.raises(CorpusError, match="made-up names"):
        build(tmp_path / "c", modules=("json",), made_up_names="letters")
    assert not (tmp_path / "c").exists()


def test_near_tools_list_the_targets_module_and_draw_nothing_from_the_main_stream():
    """`near` 1: every example with other tools lists the target's module's functions
    first (as many as it has, distinct names), the call still the target's; `near` takes
    its draws from its own stream, so what follows (the held-out prompts) is alike, and
    `near` 0 is the corpus before it byte for byte."""
    files = scan(modules=("json", "textwrap", "shlex", "colorsys"))
    pool = [fn for f in files for fn in functions(f) if ex.usable_as_tool(fn)]
    module_of = {fn.name: fn.module for fn in pool}
    by_module: dict[str, set[str]] = {}
    for fn in pool:
        by_module.setdefault(fn.module, set()).add(fn.name)
    plain, near = _without_and_with(pool, 60, 7, "near", 1.0)
    same = spread = 0
    for chat, before in zip(near, plain, strict=True):
        names = [t["function"]["name"] for t in chat.tools]
        call = json.loads(chat.reference)["name"]
        assert call == json.loads(before.reference)["name"] and call in names
        assert len(names) == len(before.tools) == len(set(names))
        others = [n for n in names if n != call]
        home = by_module[module_of[call]] - {call}
        # the module's functions come first: as many of the others as it can give
        assert sum(module_of[n] == module_of[call] for n in others) == min(len(others),
                                                                           len(home))
        same += sum(module_of[n] == module_of[call] for n in others)
        spread += sum(module_of[n] == module_of[call]
                      for n in (t["function"]["name"] for t in before.tools) if n != call)
    assert same > 2 * spread   # the plain draw seldom lists a neighbour


def test_description_first_lists_each_tool_with_its_description_before_its_name():
    """The same prompt but for the tools' lines: each holds the function's description,
    name and parameters in that order (keys beyond them left out)."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": 'Say "it" rains.', "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "bare"}}]
    messages = [{"role": "user", "content": "weather?"}]
    given = trained_template("name-first").render(messages, tools=tools,
                                                  add_generation_prompt=True)
    first = trained_template("description-first").render(messages, tools=tools,
                                                          add_generation_prompt=True)
    lines = [line for line in first.splitlines() if line.startswith('{"type"')]
    assert [list(json.loads(line)["function"]) for line in lines] == \
        [["description", "name", "parameters"]] * 2
    assert json.loads(lines[0])["function"] == {k: v for k, v in tools[0]["function"].items()
                                                if k != "strict"}
    assert json.loads(lines[1])["function"] == {"description": "", "name": "bare",
                                                "parameters": {}}
    rest = [line for line in given.splitlines() if not line.startswith('{"type"')]
    assert rest == [line for line in first.splitlines() if not line.startswith('{"type"')]
    assert given != first


def test_a_description_first_corpus_renders_its_chats_so_and_names_its_template(tmp_path):
    from ninfer.model.loader import load_files
    from ninfer.train import loop
    from ninfer.train.recipe import smoke_shape

    from .test_recipe import SMOKE
    corpus = Corpus.open(build(tmp_path / "c", modules=("json", "textwrap"), vocab_size=512,
                               tool_order="description-first"))
    assert corpus.manifest["rules"]["tool_order"] == "description-first"
    text = BackendTokenizer.from_str(corpus.tokenizer_json).decode(corpus.ids("train.bin"),
                                                                   skip_special_tokens=False)
    assert '{"type": "function", "function": {"description": ' in text
    assert '{"type": "function", "function": {"name": ' not in text
    import dataclasses
    out = loop.train(corpus, tmp_path / "m.ninfer", config_overrides=smoke_shape(),
                     settings=dataclasses.replace(SMOKE, steps=1, eval_every=0,
                                                  checkpoint_every=0), progress=False)["out"]
    assert load_files(out, verify=False).template.templates == corpus.chat_template
    with pytest.raises(CorpusError, match="tool order"):
        build(tmp_path / "d", modules=("json",), tool_order="alphabetical")
    assert not (tmp_path / "d").exists()
