"""Context parallelism for the GDN layer: inter-card (ranks), intra-card (partitions), dual."""

from .context import CPContext, CPError
from .conv_halo import exchange_conv_halo
from .cost_model import plan_partitions
from .dual import cp_chunk_gated_delta_rule
from .intra import IntraEngine, build_plan
from .transition import segment_transitions

__all__ = ["CPContext", "CPError", "cp_chunk_gated_delta_rule", "exchange_conv_halo", "plan_partitions",
           "IntraEngine", "build_plan", "segment_transitions"]
