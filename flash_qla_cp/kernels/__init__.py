"""Kernels: TileLang Hopper kernels and the torch references they are checked against."""

from .reference_backward import chunk_gated_delta_rule_bwd_reference
from .reference_chunked import chunk_gated_delta_rule_torch
from .reference_recurrent import naive_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule_bwd_reference", "chunk_gated_delta_rule_torch", "naive_recurrent_gated_delta_rule"]
