import sys
import time, torch
t0 = time.perf_counter()
from ninfer.model.loader import load_files
from ninfer.model.hybrid import HybridModel, load_weights
t1 = time.perf_counter()
files = load_files(sys.argv[1])
t2 = time.perf_counter()
net = HybridModel(files.config, mtp=False)
t3 = time.perf_counter()
load_weights(net, files.tensors)
t4 = time.perf_counter()
net = net.to(dtype=torch.bfloat16)
t5 = time.perf_counter()
print(f"import {t1-t0:.2f} files {t2-t1:.2f} build {t3-t2:.2f} load {t4-t3:.2f} to-bf16 {t5-t4:.2f}")
