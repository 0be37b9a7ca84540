"""Prefill paced beside decoding lanes: while any lane decodes, a long prompt's prefill chunk
is sized from measured step times so that a decoding client's gap between tokens (one
decode step, plus the prefill work run in the same step) stays within `gap` decode steps.
(A prompt of one chunk goes in whole: one longer gap, once.) Since stop 47 a paced chunk's
forward runs in parts (`Model.forward_steps`: a layer each on the GPU or the CPU), one a
step, and each of those steps counts as one of a chunk of that size: the size settles where
a part's time meets the target, so a forward's fixed host cost (~20-75 ms of launches on a
GPU, whatever its length) is spread over the decode steps instead of landing in one gap.

The chunk whose time meets the target is found by proportion: the next size is the last one
scaled by the target over the last chunk's time (a chunk's time grows with its length, so
this settles where the time equals the target), within [`smallest`, the engine's chunk].
Torch-free; the clock is injected, so tests drive it."""

from __future__ import annotations

from collections.abc import Callable

SMOOTHING = 0.2   # weight of a new decode step's time in the running figure


class PrefillPacing:
    def __init__(self, gap: float, largest: int, *, smallest: int = 16,
                 clock: Callable[[], float]) -> None:
        """`gap`: the most decode steps a decoding client may wait between tokens (> 1);
        `largest`: the engine's prefill chunk (a prefill alone always takes it)."""
        if gap <= 1:
            raise ValueError("the decode gap must be more than one step")
        self.gap, self.largest, self.smallest = gap, largest, min(smallest, largest)
        self.clock = clock
        self.size = self.smallest       # a long prompt's chunk beside decoding lanes (a
        #                                 prefill alone takes `largest`), grown from below
        self.decode_s: float | None = None  # a decode step's time, running figure
        self._began = 0.0
        self._slowest = 0.0   # the slowest part so far of the chunk being prefilled

    @property
    def target_s(self) -> float | None:
        """The time a prefill chunk may take beside decoding lanes: the gap less the decode
        step itself, three quarters of it (a quarter left for the machine's noise)."""
        return None if self.decode_s is None else 0.75 * (self.gap - 1) * self.decode_s

    def begin(self) -> None:
        self._began = self.clock()

    def end(self, decoded: bool, prefilled: int, chunk_done: bool = True) -> None:
        """The step ran: whether lanes decoded in it, the prompt tokens it prefilled (for a
        part of a chunk's forward, the chunk's), and whether that chunk's forward is done.
        A chunk's parts differ (an attention layer over a long context costs more than a
        GDN layer), so its slowest part is what the size answers for, once the chunk is
        done."""
        seconds = self.clock() - self._began
        if not decoded:
            return
        if not prefilled:
            self.decode_s = seconds if self.decode_s is None else (
                (1 - SMOOTHING) * self.decode_s + SMOOTHING * seconds)
            return
        target = self.target_s
        if target is None:
            return
        self._slowest = max(self._slowest, seconds - self.decode_s)
        if not chunk_done:
            return
        chunk_s, self._slowest = max(self._slowest, 1e-6), 0.0
        if prefilled != self.size:  # a prompt's tail says less
            return
        scale = min(max(target / chunk_s, 0.5), 2.0)   # one noisy step moves it little
        self.size = min(max(round(prefilled * scale), self.smallest), self.largest)
