import sys
import time, torch
from ninfer.model.loader import load_files
from ninfer.model.hybrid import loaded_model
t1 = time.perf_counter()
files = load_files(sys.argv[1])
t2 = time.perf_counter()
net = loaded_model(files.config, files.tensors, mtp=False, device="cpu", dtype=torch.bfloat16)
t3 = time.perf_counter()
print(f"files {t2-t1:.2f} loaded_model {t3-t2:.2f}", {p.dtype for p in net.parameters()}, any(p.is_meta for p in net.parameters()))
