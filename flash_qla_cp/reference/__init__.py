"""Every torch form of the algorithm: the token recurrence (ground truth), the chunked forward
and its hand-written backward (together the torch backend), and torch forms of single kernel
steps used as test oracles."""

from .backward import chunk_gated_delta_rule_bwd_reference
from .chunked import chunk_gated_delta_rule_torch
from .recurrent import naive_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule_bwd_reference", "chunk_gated_delta_rule_torch", "naive_recurrent_gated_delta_rule"]
