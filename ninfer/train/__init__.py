"""Training the default model: a small Qwen3.5-layout hybrid with its MTP head, learnt from
this machine's Python standard library.

Torch-free (CPU, this machine's Python 3.11): `sources` (the stdlib files, their manifest,
the held-out modules, the functions in a file), `examples` (chat examples rendered as the
server renders a conversation), `corpus` (building and reading the corpus directory, the
tokenizer trained on it). With torch: `recipe` (the shape and the training settings),
`forward` (the differentiable forward the training runs), `loop` (`ninfer train run`),
`evaluate` (`ninfer train eval`). The corpus is built once, here, and carried to the GPU
machine; it is never rebuilt there.
"""
