"""Each held-out tool prompt a model fails, with the tools it listed and the call it made.

    .venv/bin/python bench/stop44/tool_failures.py build/v9w.ninfer build/corpus-v9 > out.txt
"""
import json
import sys

from ninfer.model.runtime import open_model
from ninfer.train.corpus import Corpus
from ninfer.train.evaluate import _prompt_ids, first_call, generate, tool_groups, tool_outcome

om = open_model(sys.argv[1], dtype="float32", device="cpu")
items = Corpus.open(sys.argv[2]).eval_items("tool_prompts")
replies = generate(om, _prompt_ids(om, items), max_tokens=96, concurrency=8)
for item, reply in zip(items, replies, strict=True):
    call = first_call(reply.text)
    outcome = tool_outcome(item, call)
    if outcome in ("valid", "valid_other_tool"):
        continue
    target = json.loads(item.reference)["name"]
    print(f"--- {outcome} {tool_groups(item)} target={target} "
          f"called={call.name if call else None} args={call.arguments if call else None}")
    print("    request:", item.messages[-1]["content"][:200])
    for t in item.tools or []:
        f = t["function"]
        print(f"    tool {f['name']}: {f['description'][:90]!r} "
              f"{list(f['parameters'].get('properties', {}))}")
