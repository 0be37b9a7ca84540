import sys, time
from ninfer.bench.turn import InProcessServer, server_options
from ninfer.bench.sized_prompts import PromptMaker
from ninfer.bench.timed_stream import stream_chat
from ninfer.model.runtime import benchmark_on_the_random_model
from ninfer.lifecycle import journal as J
old = sys.argv[1] == "old"
if old:   # SQLite's automatic checkpoint in the writer, no copier thread
    class NoMerge:
        def __init__(self, path): self.conn = None
        def close(self): pass
    J.WalMerge = NoMerge
    real_open = J.Journal.open.__func__
    def open_(cls, *a, **k):
        j = real_open(cls, *a, **k); j._conn.execute("PRAGMA wal_autocheckpoint=1000"); return j
    J.Journal.open = classmethod(open_)
benchmark_on_the_random_model()
prompts = PromptMaker.for_model(None)
times = []
orig = J.Journal.append
def append(self, events, *a, **k):
    t = time.perf_counter(); r = orig(self, events, *a, **k); times.append(time.perf_counter() - t); return r
J.Journal.append = append
with InProcessServer(server_options((32768,), 1)) as s:
    history = prompts.messages(32768, 1)
    t1 = stream_chat(s.url, history, session="p", max_tokens=16)
    history = [*history, {"role": "assistant", "content": t1.text}]
    worst, ttfts = [], []
    for i in range(16):
        times.clear()
        msgs = prompts.follow_up(history, 26, 100 + i)
        t2 = stream_chat(s.url, msgs, session="p", max_tokens=2)
        history = [*msgs, {"role": "assistant", "content": t2.text}]
        worst.append(max(times) * 1000); ttfts.append(t2.ttft * 1000)
    worst.sort(); ttfts.sort()
    print(sys.argv[1], "largest commit per turn, ms: median %.1f, max %.1f; all %s" % (worst[8], worst[-1], [round(w, 1) for w in worst]))
    print(sys.argv[1], "ttft ms: median %.1f max %.1f" % (ttfts[8], ttfts[-1]))
