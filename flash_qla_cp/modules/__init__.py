"""nn.Modules: the Gated DeltaNet layer, its short conv and gated norm, and the Qwen3-Next adapter."""

from .gated_deltanet import GatedDeltaNet, GDNCache, recurrent_step
from .norm import GatedRMSNorm, gated_rms_norm
from .qwen3_next import Qwen3NextGatedDeltaNetFlash, replace_qwen3_next_gdn
from .short_conv import ShortConvolution, causal_conv1d_varlen

__all__ = [
    "GatedDeltaNet",
    "GDNCache",
    "GatedRMSNorm",
    "Qwen3NextGatedDeltaNetFlash",
    "ShortConvolution",
    "causal_conv1d_varlen",
    "gated_rms_norm",
    "recurrent_step",
    "replace_qwen3_next_gdn",
]
