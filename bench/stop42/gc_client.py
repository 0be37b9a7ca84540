import sys, time
from ninfer.bench.sized_prompts import PromptMaker
from ninfer.bench.timed_stream import stream_chat
url = sys.argv[1]
prompts = PromptMaker.for_model(None)
history = prompts.messages(32768, 1)
t1 = stream_chat(url, history, session="p", max_tokens=16)
history = [*history, {"role": "assistant", "content": t1.text}]
print("TURNS", file=sys.stderr, flush=True)
for i in range(10):
    msgs = prompts.follow_up(history, 26, 100 + i)
    t2 = stream_chat(url, msgs, session="p", max_tokens=2)
    history = [*msgs, {"role": "assistant", "content": t2.text}]
    print(f"turn {i} ttft {t2.ttft*1000:.1f} at {time.time():.2f}", file=sys.stderr, flush=True)
