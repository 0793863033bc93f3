"""flash_qla_cp: fused TileLang kernels for Gated DeltaNet with dual context parallelism."""

from .ops import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from .modules import GatedDeltaNet

__version__ = "0.1.0"

__all__ = ["GatedDeltaNet", "chunk_gated_delta_rule", "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd", "__version__"]
