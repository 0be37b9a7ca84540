"""How many KV positions a GPU holds: the KV pool sized from the memory free once the
weights are on the device, when no `--kv-capacity` is given.

The pools a model allocates past its weights are the KV blocks (attention and MTP layers,
K and V, every position), the recurrent-state slots (conv and GDN state per slot, twice
with decode graphs: `TorchModel.twin`) and the last hidden state per slot. What is left
must also hold a prefill chunk's activations, the CUDA graphs' pool and the allocator's
slack: the KV pool takes `KV_SHARE` of the memory free after the slots.
"""

from __future__ import annotations

from .config import ModelConfig

KV_SHARE = 0.6             # of the memory free after the weights and the state slots
MIN_POSITIONS = 16_384     # below this a GPU is too small to be worth serving from


def kv_bytes_per_position(c: ModelConfig, dtype_bytes: int, mtp: bool) -> int:
    """Bytes one KV position takes over every attention layer (and the MTP layers')."""
    layers = len(c.attention_layers) + (c.mtp_num_hidden_layers if mtp else 0)
    return layers * 2 * c.num_key_value_heads * c.head_dim * dtype_bytes


def slot_bytes(c: ModelConfig, dtype_bytes: int, num_slots: int, twins: bool) -> int:
    """Bytes of the recurrent-state pools: conv state in the model's dtype, the GDN state in
    float32 (at least), per slot (twice with decode graphs), and a hidden state per slot."""
    per_slot = len(c.linear_layers) * (
        c.conv_dim * (c.linear_conv_kernel_dim - 1) * dtype_bytes
        + c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        * max(4, dtype_bytes))
    return num_slots * (per_slot * (2 if twins else 1) + c.hidden_size * dtype_bytes)


def kv_capacity_for(free_bytes: int, c: ModelConfig, *, dtype_bytes: int, mtp: bool,
                    num_slots: int, block_size: int, twins: bool = True) -> int:
    """KV positions (whole blocks) for `free_bytes` free with the weights loaded. Raises
    ValueError when fewer than MIN_POSITIONS fit: a --kv-capacity must be given then."""
    room = free_bytes - slot_bytes(c, dtype_bytes, num_slots, twins)
    positions = int(max(room, 0) * KV_SHARE) // kv_bytes_per_position(c, dtype_bytes, mtp)
    positions -= positions % block_size
    if positions < MIN_POSITIONS:
        raise ValueError(
            f"{free_bytes / 2**30:.1f} GiB free on the device holds {positions:,} KV "
            f"positions beside {num_slots} state slots, fewer than {MIN_POSITIONS:,}: give "
            "--kv-capacity (and fewer --state-slots) explicitly")
    return positions
