"""flash_qla_cp: fused TileLang kernels for Gated DeltaNet with dual context parallelism."""

from .api import chunk_gated_delta_rule
from .modules import GatedDeltaNet, replace_qwen3_next_gdn
from .ops import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from .options import KernelOptions
from .parallel import CPContext, CPError

__version__ = "0.1.0"

__all__ = ["CPContext", "CPError", "GatedDeltaNet", "KernelOptions", "chunk_gated_delta_rule",
           "chunk_gated_delta_rule_bwd", "chunk_gated_delta_rule_fwd", "replace_qwen3_next_gdn", "__version__"]
