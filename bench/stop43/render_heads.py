import time
from types import SimpleNamespace
from ninfer.model.runtime import benchmark_on_the_random_model, open_model
benchmark_on_the_random_model()
from ninfer.server.submission import encode, render_chat
from ninfer.server.unified import from_chat
from ninfer.server.reading import validate
from ninfer.server.schemas import ChatRequest
from ninfer.bench.sized_prompts import PromptMaker
om = open_model(None, kv_capacity=64, num_slots=1)
server = SimpleNamespace(tokenizer=om.tokenizer, template=om.template,
                         thread=SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(auto_anchors=2))))
pm = PromptMaker.for_model(None)
for n in (4096, 16384, 32768):
    msgs = pm.messages(n, 1)
    hist = pm.follow_up([*msgs, {"role": "assistant", "content": "fine."}], 26, 1)
    for label, m in (("one message", msgs), ("a next turn, cold", hist)):
        req = from_chat(validate(ChatRequest, {"model": "m", "messages": m, "chat_template_kwargs": {"enable_thinking": False}}), default_budget=None)
        enc = lambda t: encode(server.tokenizer, t)
        out = []
        for plain in (False, True):
            best = min((lambda t0: (render_chat(server, req, enc, plain=plain), time.perf_counter()-t0)[1])(time.perf_counter()) for _ in range(3))
            out.append(best*1e3)
        print(n, label, "heads encoded whole %.1f ms, from the ids %.1f ms" % tuple(out))
