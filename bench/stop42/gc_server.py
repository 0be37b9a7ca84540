import gc, sys, time
pauses = []
t0 = [0.0]
def cb(phase, info):
    if phase == "start": t0[0] = time.perf_counter()
    else:
        d = (time.perf_counter() - t0[0]) * 1000
        if d > 0.5: print(f"GC t={time.time():.2f} gen{info['generation']} {d:.1f} ms collected {info['collected']} counts {gc.get_count()} frozen {gc.get_freeze_count()}", file=sys.stderr, flush=True)
gc.callbacks.append(cb)
from ninfer.server.serve import main
sys.exit(main(sys.argv[1:]))
