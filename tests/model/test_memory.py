"""The KV pool sized from a GPU's free memory: what the pools take past the weights."""

import pytest

from ninfer.model.config import ModelConfig
from ninfer.model.memory import (
    KV_SHARE,
    MIN_POSITIONS,
    kv_bytes_per_position,
    kv_capacity_for,
    slot_bytes,
)
from ninfer.model.runtime import DEFAULT_KV_CAPACITY, open_model

from .nets import TINY


@pytest.fixture
def tiny_config() -> ModelConfig:
    return ModelConfig.from_dict(TINY)


def test_the_pool_takes_its_share_of_what_the_slots_leave(tiny_config):
    c = tiny_config
    per = kv_bytes_per_position(c, 2, mtp=True)
    assert per == (len(c.attention_layers) + c.mtp_num_hidden_layers) * 2 \
        * c.num_key_value_heads * c.head_dim * 2
    assert kv_bytes_per_position(c, 2, mtp=False) < per
    free = 8 * 2**30
    n = kv_capacity_for(free, c, dtype_bytes=2, mtp=True, num_slots=96, block_size=16)
    room = free - slot_bytes(c, 2, 96, twins=True)
    assert n % 16 == 0 and n * per <= KV_SHARE * room < (n + 16) * per
    fewer = kv_capacity_for(free, c, dtype_bytes=2, mtp=True, num_slots=4096, block_size=16)
    assert fewer < n   # more slots, less KV


def test_a_small_gpu_is_refused_with_what_to_give(tiny_config):
    with pytest.raises(ValueError, match="--kv-capacity"):
        kv_capacity_for(2**20, tiny_config, dtype_bytes=2, mtp=True, num_slots=8,
                        block_size=16)
    assert MIN_POSITIONS >= 16
    # the threshold itself: just enough memory for MIN_POSITIONS is taken, a block less not
    c, slots = tiny_config, 8
    need = slot_bytes(c, 2, slots, twins=True) + -(-MIN_POSITIONS * kv_bytes_per_position(
        c, 2, mtp=True) // KV_SHARE) + 1
    assert kv_capacity_for(need, c, dtype_bytes=2, mtp=True, num_slots=slots,
                           block_size=16) == MIN_POSITIONS
    with pytest.raises(ValueError, match=f"{MIN_POSITIONS - 16:,} KV positions"):
        kv_capacity_for(need - 16 * kv_bytes_per_position(c, 2, mtp=True), c, dtype_bytes=2,
                        mtp=True, num_slots=slots, block_size=16)


def test_off_a_gpu_no_capacity_means_the_default():
    om = open_model(None, kv_capacity=None, num_slots=2)
    assert om.blocks.num_blocks * om.blocks.block_size == DEFAULT_KV_CAPACITY
    assert om.model.scratch_block == om.blocks.num_blocks
