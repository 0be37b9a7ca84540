"""Tiny models run fastest on one thread, and CI's two cores are shared with other work:
more threads only spin against each other."""

import torch

torch.set_num_threads(1)
