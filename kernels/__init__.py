"""Compute kernels: torch references (always available) beside any device kernels."""

from .gdn_reference import (
    causal_conv1d_update,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

__all__ = ["causal_conv1d_update", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]
