"""The torch model on its own: checkpoint names, loading, and exactness of state handling
in float64 (chunked prefill, verification rollback, mixed-position batches, paged KV)."""

import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ninfer.model.attention import ContiguousKV
from ninfer.model.config import expected_tensors
from ninfer.model.gdn import GDNState
from ninfer.model.hybrid import HybridModel, HybridState, LoadError, load_weights, loaded_model

from .hf_reference import random_tensor, tiny_config

EXACT = 1e-10  # float64: differences are rounding only
VARIANTS = [("qwen3_next", False), ("qwen3_next", True), ("qwen3_5", False), ("qwen3_5", True)]


def _weights(config, seed=0):
    return {n: random_tensor(n, s, seed) for n, s in expected_tensors(config).items()}


def _model(config, dtype=torch.float64, seed=0):
    model = HybridModel(config).eval()
    load_weights(model, _weights(config, seed))
    return model.to(dtype)


def _shapes(model):
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _positions(start, n, batch=2):
    return torch.arange(start, start + n).expand(batch, n)


@pytest.mark.parametrize("family,moe", VARIANTS)
@pytest.mark.parametrize("mtp", [True, False])
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_names_are_the_checkpoint_names(family, moe, mtp, tied):
    config = tiny_config(family, moe, tie_word_embeddings=tied)
    assert _shapes(HybridModel(config, mtp=mtp)) == expected_tensors(config, mtp=mtp)


def test_mixed_dense_and_moe_layers_and_two_mtp_layers():
    config = tiny_config("qwen3_next", True, decoder_sparse_step=2, mlp_only_layers=(3,),
                         mtp_num_hidden_layers=2)
    model = HybridModel(config)
    assert _shapes(model) == expected_tensors(config)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["MLP", "SparseMoE", "MLP", "MLP"]
    # the MTP layer's MLP follows the rule at index 0: dense here
    assert "mtp.layers.1.mlp.gate_proj.weight" in expected_tensors(config)


def test_load_weights_reports_missing_unexpected_and_misshapen():
    config = tiny_config("qwen3_5", False)
    weights = _weights(config)
    model = HybridModel(config)
    broken = dict(weights)
    del broken["model.layers.0.linear_attn.A_log"]
    broken["model.layers.0.linear_attn.in_proj_qkvz.weight"] = torch.zeros(3)
    broken["model.norm.weight"] = torch.zeros(65)
    with pytest.raises(LoadError) as info:
        load_weights(model, broken)
    message = str(info.value)
    assert "missing: model.layers.0.linear_attn.A_log" in message
    assert "unexpected: model.layers.0.linear_attn.in_proj_qkvz.weight" in message
    assert "model.norm.weight: (65,) != (64,)" in message


def test_load_weights_accepts_multimodal_prefix_and_skips_what_is_not_needed():
    config = tiny_config("qwen3_5", False, tie_word_embeddings=True)
    weights = _weights(config)
    renamed = {n.replace("model.", "model.language_model.", 1): t for n, t in weights.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    renamed["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied: redundant copy
    model = HybridModel(config, mtp=False)  # mtp.* present in the files, not wanted
    load_weights(model, renamed)
    assert torch.equal(model.model.norm.weight, weights["model.norm.weight"])
    ids = torch.tensor([[1, 2, 3]])
    out = model(ids, _positions(0, 3, 1), HybridState.initial(config, 1, torch.float32))
    embed = weights["model.embed_tokens.weight"]
    torch.testing.assert_close(out.logits, out.hidden @ embed.T)


class _Initialisers(TorchFunctionMode):
    """The tensor initialisers that reach it (those the modes above it let through)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("normal_", "uniform_", "kaiming_uniform_"):
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mtp,dtype", [(True, torch.bfloat16), (False, torch.float32)])
def test_a_loaded_model_takes_the_files_tensors_and_makes_no_weights_of_its_own(mtp, dtype):
    config = tiny_config("qwen3_next", True)
    weights = _weights(config)
    assert {t.dtype for t in weights.values()} == {torch.float32}
    with _Initialisers() as inits:
        model = loaded_model(config, weights, mtp=mtp, device="cpu", dtype=dtype)
    # none ran: no parameter was made and initialised only to be overwritten (seconds of a
    # large model's start-up), not even on the meta device (the first such op imports
    # torch._dynamo: 1.1 s)
    assert inits.seen == []
    assert _shapes(model) == expected_tensors(config, mtp=mtp)
    for name, param in model.named_parameters():
        assert param.dtype == dtype and param.device.type == "cpu"
        assert not param.requires_grad
        assert torch.equal(param, weights[name].to(dtype))
        # its own memory, not the file's pages
        assert param.data_ptr() != weights[name].data_ptr()
    with pytest.raises(LoadError, match="missing: model.norm.weight"):
        loaded_model(config, {n: t for n, t in weights.items() if n != "model.norm.weight"},
                     mtp=mtp, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("family,moe", [("qwen3_next", True), ("qwen3_5", False)])
def test_float64_chunked_prefill_is_exact_across_gdn_chunks(family, moe):
    """90 tokens (more than one 64-token GDN chunk) in one call == 70 + 1 + 19."""
    config = tiny_config(family, moe)
    model = _model(config)
    ids = torch.randint(0, 256, (2, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids, _positions(0, 90), HybridState.initial(config, 2, torch.float64))
        state, logits, start = HybridState.initial(config, 2, torch.float64), [], 0
        for n in (70, 1, 19):
            out = model(ids[:, start:start + n], _positions(start, n), state)
            logits.append(out.logits)
            state, start = out.state, start + n
    torch.testing.assert_close(torch.cat(logits, 1), whole.logits, rtol=0, atol=EXACT)
    for i, s in whole.state.gdn.items():
        assert s.recurrent.dtype == torch.float64
        torch.testing.assert_close(state.gdn[i].recurrent, s.recurrent, rtol=0, atol=EXACT)
        torch.testing.assert_close(state.gdn[i].conv, s.conv, rtol=0, atol=EXACT)


def test_verify_states_equal_shorter_prefills_and_input_state_is_untouched():
    config = tiny_config("qwen3_next", False)
    model = _model(config)
    ids = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pre = model(ids[:, :9], _positions(0, 9), HybridState.initial(config, 2, torch.float64))
        kept = {i: GDNState(s.conv.clone(), s.recurrent.clone()) for i, s in pre.state.gdn.items()}
        verify = model(ids[:, 9:14], _positions(9, 5), pre.state, all_states=True)
        for i, s in pre.state.gdn.items():  # a retry from pre.state stays possible
            assert torch.equal(s.recurrent, kept[i].recurrent) and torch.equal(s.conv, kept[i].conv)
        for j in range(5):
            fresh = model(ids[:, :10 + j], _positions(0, 10 + j),
                          HybridState.initial(config, 2, torch.float64))
            picked = verify.state_at(j)
            for i, s in fresh.state.gdn.items():
                torch.testing.assert_close(picked.gdn[i].recurrent, s.recurrent, rtol=0, atol=EXACT)
                torch.testing.assert_close(picked.gdn[i].conv, s.conv, rtol=0, atol=EXACT)
    last = verify.state_at(4)
    for i, s in verify.state.gdn.items():
        assert torch.equal(last.gdn[i].recurrent, s.recurrent)


def _stack_states(config, states):
    """One batch from single-row states: GDN parts concatenated, KV copied row by row."""
    gdn = {i: GDNState(torch.cat([s.gdn[i].conv for s in states]),
                       torch.cat([s.gdn[i].recurrent for s in states]))
           for i in config.linear_layers}
    kv = ContiguousKV()
    length = max(s.kv.k[i].shape[1] for s in states for i in s.kv.k)

    def padded(t):  # [1, L, H, D] -> [1, length, H, D]
        return torch.nn.functional.pad(t, (0, 0, 0, 0, 0, length - t.shape[1]))

    for i in config.attention_layers:
        kv.k[i] = torch.cat([padded(s.kv.k[i]) for s in states])
        kv.v[i] = torch.cat([padded(s.kv.v[i]) for s in states])
    return HybridState(gdn, kv)


def test_batch_rows_at_different_positions_equal_each_row_alone():
    config = tiny_config("qwen3_5", True)
    model = _model(config)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    lengths, singles, states = (7, 4), [], []
    with torch.no_grad():
        for row, n in enumerate(lengths):
            init = HybridState.initial(config, 1, torch.float64)
            states.append(model(ids[row:row + 1, :n], _positions(0, n, 1), init).state)
            singles.append(model(ids[row:row + 1, n:n + 3], _positions(n, 3, 1), states[-1]))
        batch = _stack_states(config, states)
        positions = torch.stack([torch.arange(n, n + 3) for n in lengths])
        tokens = torch.stack([ids[row, n:n + 3] for row, n in enumerate(lengths)])
        out = model(tokens, positions, batch)
    for row in range(2):
        torch.testing.assert_close(out.logits[row], singles[row].logits[0], rtol=0, atol=EXACT)


class PagedKV:
    """A block-table KVStore, as the engine's will be: fixed-size blocks in a shared pool,
    each row's positions mapped through its own (scattered) block list."""

    def __init__(self, block_size, tables):
        self.block_size, self.tables = block_size, torch.tensor(tables)  # [B, blocks per row]
        self.pool_k, self.pool_v = {}, {}

    def _slots(self, positions):
        rows = torch.arange(positions.shape[0])[:, None]
        blocks = self.tables[rows, positions // self.block_size]
        return blocks, positions % self.block_size

    def write(self, layer, positions, k, v):
        if layer not in self.pool_k:
            n = int(self.tables.max()) + 1
            self.pool_k[layer] = k.new_full((n, self.block_size, *k.shape[2:]), float("nan"))
            self.pool_v[layer] = self.pool_k[layer].clone()
        blocks, offsets = self._slots(positions)
        self.pool_k[layer][blocks, offsets] = k
        self.pool_v[layer][blocks, offsets] = v

    def read(self, layer, length):
        positions = torch.arange(length).expand(self.tables.shape[0], length)
        blocks, offsets = self._slots(positions)
        return self.pool_k[layer][blocks, offsets], self.pool_v[layer][blocks, offsets]


def test_paged_kv_store_gives_the_same_logits():
    config = tiny_config("qwen3_next", True)
    model = _model(config)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))
    results = []
    with torch.no_grad():
        for kv in (ContiguousKV(initial_capacity=2), PagedKV(4, [[5, 0, 3], [1, 4, 2]])):
            state = HybridState.initial(config, 2, torch.float64, kv=kv)
            pre = model(ids[:, :9], _positions(0, 9), state)
            results.append(model(ids[:, 9:], _positions(9, 2), pre.state).logits)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=EXACT)


def test_bf16_runs_and_stays_near_float64():
    config = tiny_config("qwen3_5", False)
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(4))
    logits = {}
    with torch.no_grad():
        for dtype in (torch.float64, torch.bfloat16):
            model = _model(config, dtype)
            out = model(ids, _positions(0, 30), HybridState.initial(config, 2, dtype))
            assert out.logits.dtype == dtype
            assert out.state.gdn[0].recurrent.dtype == torch.promote_types(dtype, torch.float32)
            logits[dtype] = out.logits.double()
    assert torch.isfinite(logits[torch.bfloat16]).all()
    assert (logits[torch.bfloat16] - logits[torch.float64]).abs().max() < 0.3
    agree = logits[torch.bfloat16].argmax(-1) == logits[torch.float64].argmax(-1)
    assert agree.float().mean() > 0.9


def test_model_without_mtp_refuses_mtp_forward():
    config = replace(tiny_config("qwen3_next", False), mtp_num_hidden_layers=0)
    model = HybridModel(config)
    assert not model.has_mtp and not any(k.startswith("mtp.") for k in model.state_dict())
    with pytest.raises(ValueError, match="MTP"):
        model.mtp_forward(torch.zeros(1, 1, 64), torch.zeros(1, 1, dtype=torch.long),
                          torch.zeros(1, 1, dtype=torch.long), ContiguousKV())


def test_a_prefill_chunk_in_half_precision_attends_as_the_float32_path():
    """`_prefill_chunk` (a bf16 / fp16 prefill chunk on the GPU) in bf16, here on the CPU:
    the KV heads shared by their query heads and the causal mask aligned to the chunk's
    end give what the float32 path (SDPA with a mask by position, GQA) makes of the same
    inputs, within bf16's rounding; its queries see the keys before the chunk, and a
    mask aligned to the top left would not."""
    from .nets import attention_chunk_case
    attn, q, store, positions = attention_chunk_case("cpu")
    x = torch.zeros(1, q.shape[1], 1)
    ref = attn._attend(x, q.float(), positions, store.to(torch.float32), 0)
    out = attn._prefill_chunk(q, store.keys, store.values)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2
    T, L = q.shape[1], store.keys.shape[1]
    chunk_alone = attn._attend(x, q.float(), torch.arange(T)[None], store.to(torch.float32), 0)
    assert ((chunk_alone - ref).abs().max() / ref.abs().max()).item() > 0.1
    assert L > T


def test_attention_over_several_rows_leaves_cudnn_out(monkeypatch):
    """SDPA over a batch's rows (several lanes' prefill) runs with cuDNN switched off: its
    shapes follow the requests, and cuDNN builds a plan per shape (a served prompt of a
    length not seen before paid ~45 ms for it on an H100, stop 47)."""
    from ninfer.model import attention
    seen = []

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return F.scaled_dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "F", types.SimpleNamespace(
        linear=F.linear, scaled_dot_product_attention=recording))
    config = tiny_config("qwen3_5", True)
    model = _model(config)
    tokens = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(tokens, _positions(0, 5, 2), HybridState.initial(config, 2, torch.float64))
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()
