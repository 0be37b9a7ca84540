"""`ninfer train run`: train the default model on a built corpus and write the `.ninfer` file
and a JSON report.

A step: `batch` windows of `seq_len + 1` tokens drawn at seeded random offsets of the
training stream; the loss is the next-token cross-entropy plus `mtp_weight` times the mean
of the MTP head's draft-step losses (`forward.mtp_logits`, steps 0..mtp_depth-1, each
predicting the token two past its entry); AdamW (decay on matrices only), linear warmup then
cosine decay to `min_lr`, gradients clipped; bf16 autocast on CUDA, float32 on the CPU.

Either a fixed number of steps, or `minutes` of training: then the first steps are timed
and the step count is fixed from them (the schedule's length) before the warmup ends, and
the run also stops when the time is up; the report records the steps planned and done, and
`--steps <planned>` repeats the run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from ..model.bpe import added_ids
from ..model.hybrid import HybridModel
from . import forward, weights
from .corpus import Corpus
from .recipe import TrainSettings, trained_config

CALIBRATION_STEPS = 10  # timed steps (after two untimed) that fix the step count of a --minutes run
LOG_EVERY = 10
HELDOUT_WINDOWS = 16


def lr_at(step: int, total: int, s: TrainSettings) -> float:
    """Linear warmup to `lr` over `warmup` steps, then cosine to `min_lr` at `total`."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = min(1.0, (step - s.warmup) / max(1, total - s.warmup))
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


def losses(net: HybridModel, windows: Tensor, depth: int) -> tuple[Tensor, list[Tensor]]:
    """windows [B, T + 1] -> (next-token loss, [loss of draft step d for d < depth]), means
    over the positions where each has a target."""
    T = windows.shape[1] - 1
    hidden = forward.hidden(net, windows[:, :T])
    main = _cross_entropy(net.lm_logits(hidden), windows[:, 1:])
    steps = forward.mtp_logits(net, hidden, windows, depth) if depth else []
    # draft step d's entry p is meaningful from p = d; it predicts token p + 2
    return main, [_cross_entropy(lg[:, d:T - 1], windows[:, d + 2:]) for d, lg in
                  enumerate(steps)]


def _cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _param_groups(net: HybridModel, weight_decay: float) -> list[dict]:
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def _tokens(corpus: Corpus, name: str, device: torch.device) -> Tensor:
    return torch.tensor(corpus.ids(name), dtype=torch.int64, device=device)


class Windows:
    """Seeded random windows of a token stream: the same seed draws the same offsets.

    With `chats` (the stream's chat examples as (starts, ends) of their first and last
    token, `chat_spans`), a window drawn to start inside a chat example starts at that
    example's first token instead: every chat the model learns from is read from its system
    prompt on, as a served conversation is. Drawn anywhere, a quarter of the tool calls
    were learned with the listed tools cut off (bench/NOTES.md, stop 42): guessing a name
    from the request alone. Source files are cut anywhere as before."""

    def __init__(self, tokens: Tensor, length: int, seed: int,
                 chats: tuple[Tensor, Tensor] | None = None) -> None:
        if tokens.numel() <= length + 1:
            raise ValueError(f"{tokens.numel()} tokens: too few for windows of {length + 1}")
        self.tokens, self.length = tokens, length
        self.generator = torch.Generator().manual_seed(seed)
        self.span = torch.arange(length + 1, device=tokens.device)
        self.chats = None if chats is None else (chats[0].cpu(), chats[1].cpu())

    def next(self, batch: int) -> Tensor:
        starts = torch.randint(0, self.tokens.numel() - self.length - 1, (batch,),
                               generator=self.generator)
        if self.chats is not None and len(self.chats[0]):
            first, last = self.chats
            i = (torch.searchsorted(first, starts, right=True) - 1).clamp(min=0)
            inside = (first[i] <= starts) & (starts <= last[i])
            starts = torch.where(inside, first[i], starts)
        return self.tokens[starts.to(self.tokens.device)[:, None] + self.span]


def chat_spans(tokens: Tensor, *, endoftext: int, im_start: int) -> tuple[Tensor, Tensor]:
    """The chat examples of a stream of documents each ended by `endoftext`: the positions
    of their first token (`im_start`: a rendered conversation begins so, a source file
    never at its first token) and of their `endoftext`, both ascending."""
    tokens = tokens.cpu()
    ends = (tokens == endoftext).nonzero().squeeze(1)
    if not len(ends):   # (no document ends: no chat example either)
        return ends, ends
    starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
    chat = tokens[starts] == im_start
    return starts[chat], ends[chat]


def calls_cut_off(tokens: Tensor, chats: tuple[Tensor, Tensor], call: int, length: int,
                  whole: bool) -> float | None:
    """The expected share of tool calls (`call`: the `<tool_call>` id) learned in a window
    that starts after their conversation's first token, its listed tools cut off: drawn
    anywhere, a window holding a call at p tokens into its conversation starts inside it with
    probability min(p / length, 1); with whole chats, only where p is past the window's
    length. None: no calls."""
    tokens = tokens.cpu()
    at = (tokens == call).nonzero().squeeze(1)
    if not len(at) or not len(chats[0]):
        return None
    first = chats[0][(torch.searchsorted(chats[0], at, right=True) - 1).clamp(min=0)]
    into = (at - first).double()
    cut = (into >= length).double() if whole else (into / length).clamp(max=1.0)
    return float(cut.mean())


def heldout_windows(tokens: Tensor, length: int, count: int = HELDOUT_WINDOWS) -> Tensor:
    """The first `count` non-overlapping windows of the held-out stream (fewer if short)."""
    n = min(count, (tokens.numel() - 1) // length)
    if n <= 0:
        return tokens.new_zeros(0, length + 1)
    return torch.stack([tokens[i * length:(i + 1) * length + 1] for i in range(n)])


class Budget:
    """The run's length: `steps`, or (with `minutes`) the steps that fill the minutes at the
    pace of steps 2..2+CALIBRATION_STEPS (the first two allocate and compile), fixed then,
    before the warmup ends, so `--steps <that many>` repeats the run. A timed run also
    stops when the minutes are up. `sync` waits for the device before a clock is read."""

    def __init__(self, steps: int, minutes: float | None, sync: Callable[[], None]) -> None:
        self.total, self.minutes, self.sync = steps, minutes, sync
        self.seconds_per_step: float | None = None
        self.start = self.calibrating = time.perf_counter()

    def go_on(self, step: int) -> bool:
        """Whether to run `step` (fixing `total` when the calibration steps are done)."""
        if self.minutes is not None:
            first, last = 2, 2 + CALIBRATION_STEPS
            if step == first:
                self.sync()
                self.calibrating = time.perf_counter()
            elif step == last:
                self.sync()
                now = time.perf_counter()
                self.seconds_per_step = (now - self.calibrating) / CALIBRATION_STEPS
                left = self.minutes * 60 - (now - self.start)
                self.total = step + max(1, int(left / self.seconds_per_step))
            elif step > last and time.perf_counter() - self.start > self.minutes * 60:
                return False
        return step < self.total


def checkpoint_path(out: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` goes: beside `out`, `<stem>.step<step>.ninfer`."""
    out = Path(out)
    return out.with_name(f"{out.name.removesuffix('.ninfer')}.step{step}.ninfer")


def train(corpus: Corpus, out: str | Path, *, settings: TrainSettings, device: str = "cpu",
          minutes: float | None = None, config_overrides: dict | None = None,
          report_path: str | Path | None = None, progress: bool = True,
          compile_loss: bool = False, log: Callable[[str], None] = print) -> dict:
    """Train and write `out` (a `.ninfer`; every `checkpoint_every` steps another beside
    it, `checkpoint_path`) and the report (also returned). `minutes`: train for about that
    long instead of `settings.steps`."""
    t_start = time.perf_counter()
    s = settings
    dev = torch.device(device)
    torch.manual_seed(s.seed)
    ids = added_ids(corpus.tokenizer_json)
    config = trained_config(corpus.manifest["vocab_size"], endoftext=ids["<|endoftext|>"],
                            im_end=ids["<|im_end|>"], **(config_overrides or {}))
    net = weights.build(config, s.seed).to(dev)
    net.train()
    train_tokens = _tokens(corpus, "train.bin", dev)
    chats = chat_spans(train_tokens, endoftext=ids["<|endoftext|>"], im_start=ids["<|im_start|>"])
    windows = Windows(train_tokens, s.seq_len, s.seed, chats if s.whole_chats else None)
    held = heldout_windows(_tokens(corpus, "heldout.bin", dev), s.seq_len)
    optimizer = torch.optim.AdamW(_param_groups(net, s.weight_decay), lr=s.lr, betas=s.betas,
                                  fused=dev.type == "cuda")
    loss_fn = torch.compile(losses) if compile_loss else losses
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")

    def heldout_loss() -> float | None:
        if not len(held):
            return None
        net.eval()
        with torch.no_grad(), autocast:
            value = sum(float(loss_fn(net, held[i:i + 1], 0)[0]) for i in range(len(held)))
        net.train()
        return value / len(held)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    report: dict[str, Any] = {
        "config": config.to_dict(), "settings": dataclasses.asdict(s),
        "corpus": {"path": str(corpus.path), "sha256": corpus.sha256,
                   "files_sha256": corpus.manifest["files_sha256"],
                   "train_tokens": train_tokens.numel(), "heldout_tokens": held.numel(),
                   "tool_calls_cut_off": calls_cut_off(train_tokens, chats, ids["<tool_call>"],
                                                       s.seq_len, s.whole_chats)},
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
        or "cpu", "torch": torch.__version__, "minutes": minutes,
        "weight_bytes": weights.weight_bytes(config), "losses": [], "heldout": [],
        "checkpoints": []}
    budget = Budget(s.steps, minutes, sync)
    bar = tqdm(total=budget.total, unit="step", desc="training", disable=not progress)
    step = 0
    while budget.go_on(step):
        if budget.seconds_per_step is not None and bar.total != budget.total:
            bar.reset(total=budget.total)
            bar.update(step)
            log(f"{budget.seconds_per_step * 1e3:.1f} ms a step: {budget.total} steps in "
                f"{minutes} minutes")
        lr = lr_at(step, budget.total, s)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = windows.next(s.batch)
        with autocast:
            main, mtp = loss_fn(net, batch, s.mtp_depth)
            loss = main + s.mtp_weight * torch.stack(mtp).mean() if mtp else main
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), s.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0 or step == budget.total - 1:
            entry = {"step": step, "lr": lr, "loss": loss.item(), "main": main.item(),
                     "mtp": [x.item() for x in mtp], "grad_norm": grad_norm.item()}
            report["losses"].append(entry)
            bar.set_postfix(loss=f"{entry['main']:.3f}", lr=f"{lr:.2e}")
        step += 1
        if s.eval_every and step % s.eval_every == 0:
            report["heldout"].append({"step": step, "loss": heldout_loss()})
        if s.checkpoint_every and step % s.checkpoint_every == 0 and step < budget.total:
            saved = weights.save(net, corpus.tokenizer_json, checkpoint_path(out, step),
                                 corpus.chat_template)
            report["checkpoints"].append({"step": step, "path": str(saved)})
        bar.update(1)
    done = step
    sync()
    train_seconds = time.perf_counter() - budget.start
    bar.close()
    if not report["heldout"] or report["heldout"][-1]["step"] != done:
        report["heldout"].append({"step": done, "loss": heldout_loss()})
    path = weights.save(net, corpus.tokenizer_json, out, corpus.chat_template)
    report.update({
        "steps_planned": budget.total, "steps_done": done,
        "seconds_per_step_calibrated": budget.seconds_per_step, "tokens": done * s.tokens_per_step,
        "epochs": done * s.tokens_per_step / train_tokens.numel(),
        "train_seconds": train_seconds, "tokens_per_second": done * s.tokens_per_step
        / max(train_seconds, 1e-9), "seconds": time.perf_counter() - t_start,
        "out": str(path), "out_sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    if report_path is not None:
        Path(report_path).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report
