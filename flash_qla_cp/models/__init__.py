"""Models built from the library's layers: a small hybrid (Gated DeltaNet + softmax attention) LM."""

from .hybrid_lm import CausalSelfAttention, HybridLM, HybridLMConfig, RMSNorm, SwiGLU, TokenLayout

__all__ = ["HybridLM", "HybridLMConfig", "TokenLayout", "RMSNorm", "SwiGLU", "CausalSelfAttention"]
