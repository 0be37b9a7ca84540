"""Stop 43, one-off: does the tokenizer let go of the interpreter lock? While a worker
thread encodes ~56K tokens of code five times (the default model's tokenizer), this thread
counts its own turns; `tokenizers`' one-text call against its batch call.

    .venv/bin/python bench/stop43/tokenizer_lock.py
"""
import inspect
import threading
import time

from ninfer.model.runtime import open_model

back = open_model(None, kv_capacity=1024, num_slots=2).tokenizer._backend
text = open(inspect.__file__).read() * 2


def measure(fn, label: str) -> None:
    ticks = []
    worker = threading.Thread(target=lambda: [fn() for _ in range(5)])
    began = time.perf_counter()
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
        sum(range(2000))
    seconds = time.perf_counter() - began
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)] or [seconds]
    print(f"{label}: {seconds * 1e3:.0f} ms for 5; this thread's turns {len(ticks)}, "
          f"its longest wait {max(gaps) * 1e3:.1f} ms")


one = back.encode(text, add_special_tokens=False).ids
print(len(one), "tokens; the same ids both ways:",
      one == back.encode_batch([text], add_special_tokens=False)[0].ids)
measure(lambda: back.encode(text, add_special_tokens=False), "encode (one text)")
measure(lambda: back.encode_batch([text], add_special_tokens=False), "encode_batch")
