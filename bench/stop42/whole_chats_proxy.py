"""One-off CPU proxy (not product code): fine-tune v6 for a few steps on its own corpus's
stream (corpus-v5), windows drawn anywhere or whole chats, lr annealed; then the 200
held-out tool prompts."""
import json, math, sys, time
import torch
from ninfer.model.bpe import added_ids
from ninfer.model.config import ModelConfig
from ninfer.model.fileformat import read_ninfer
from ninfer.model.runtime import open_model
from ninfer.train import weights, loop
from ninfer.train.corpus import Corpus
from ninfer.train import evaluate as E

arm, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
torch.manual_seed(0)
f = read_ninfer("build/v6.ninfer")
config = ModelConfig.from_dict(f.header["config"])
net = weights.build(config, 0)
net.load_state_dict({k: v.float() for k, v in f.tensors.items()}, strict=False)
net.train()
corpus = Corpus.open("build/corpus-v5")
ids = added_ids(corpus.tokenizer_json)
tokens = torch.tensor(corpus.ids("train.bin"), dtype=torch.int64)
chats = loop.chat_spans(tokens, endoftext=ids["<|endoftext|>"], im_start=ids["<|im_start|>"]) if arm == "whole" else None
windows = loop.Windows(tokens, 1024, 11, chats)
opt = torch.optim.AdamW(loop._param_groups(net, 0.1), lr=3e-4, betas=(0.9, 0.95))
t0 = time.time()
for step in range(steps):
    for g in opt.param_groups:
        g["lr"] = 3e-5 + 0.5 * (3e-4 - 3e-5) * (1 + math.cos(math.pi * step / steps))
    main, mtp = loop.losses(net, windows.next(4), 1)
    (main + 0.6 * mtp[0]).backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    if step % 10 == 0:
        print(arm, step, round(main.item(), 3), round(time.time() - t0), file=sys.stderr, flush=True)
weights.save(net, corpus.tokenizer_json, out, corpus.chat_template)
om = open_model(out, device="cpu", dtype="float32")
r = E.tool_share(om, corpus.eval_items("tool_prompts"))
r.pop("examples")
print(json.dumps({"arm": arm, "steps": steps, **r}), flush=True)
