"""Hugging Face adapter (Qwen3-Next, and Qwen3.5 whose layer differs only in its projections): build our
GatedDeltaNet from a `linear_attn` layer or config, and swap every such layer of a transformers model
for it, weights kept.

transformers is imported lazily; nothing here needs it at import time. The adapter speaks the
transformers >= 5 cache API (`get_conv_state` / `update_conv_state` / ... on the model's Cache).
"""

from __future__ import annotations

import torch.nn as nn

from .gated_deltanet import GatedDeltaNet

HF_GDN_CLASSES = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")


class Qwen3NextGatedDeltaNetFlash(GatedDeltaNet):
    """Our GatedDeltaNet with the call signature of transformers' `Qwen3NextGatedDeltaNet` (and Qwen3.5's):
    forward(hidden_states, cache=None, attention_mask=None, **kwargs) -> output.

    Packed sequences come in as `cu_seq_lens_q` (transformers' flash-attention kwargs); `cp_context`
    may come in through the same kwargs.
    """

    def forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, cache_position=None,
                **kwargs):
        cache = cache if cache is not None else cache_params  # older name of the same argument
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        cp_context = kwargs.get("cp_context")
        if attention_mask is not None and attention_mask.dim() != 2:
            attention_mask = None  # a 4-D attention mask carries no padding signal for a recurrent layer
        conv_state = recurrent_state = None
        if cache is not None:
            if not hasattr(cache, "get_conv_state"):
                raise NotImplementedError(
                    "Qwen3NextGatedDeltaNetFlash: this cache has no get_conv_state/update_conv_state "
                    "(transformers >= 5 cache API); use transformers >= 5 or call GatedDeltaNet directly"
                )
            conv_state = cache.get_conv_state(self.layer_idx)
            recurrent_state = cache.get_recurrent_state(self.layer_idx)
            if conv_state is not None:
                # the cache updates its tensor in place below; keep our own copy of the history
                conv_state = conv_state[..., conv_state.shape[-1] - (self.conv_size - 1):].clone()
        out, _, new_state, mixed = self._mix(
            hidden_states, attention_mask, cu_seqlens, conv_state, recurrent_state,
            output_final_state=cache is not None, cp_context=cp_context, conv_inputs=cache is not None,
        )
        if cache is not None:
            # hand the cache the raw conv inputs: it keeps the last K itself (and the whole past when it
            # records for speculative decoding), exactly as the transformers layer does
            cache.update_conv_state(mixed.transpose(1, 2), self.layer_idx, conv_kernel_size=self.conv_size)
            cache.update_recurrent_state(new_state, self.layer_idx)
        return out


def _is_hf_gdn(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ in HF_GDN_CLASSES and cls.__module__.startswith("transformers.")


def replace_qwen3_next_gdn(model: nn.Module, backend: str = "auto") -> int:
    """Replace every transformers `Qwen3NextGatedDeltaNet` (or Qwen3.5 / Qwen3.5-MoE `...GatedDeltaNet`)
    in `model` by `Qwen3NextGatedDeltaNetFlash`,
    in place, sharing the same Parameter objects (state_dict keys and values unchanged). Returns how
    many layers were replaced. Do it before building the optimizer or wrapping the model (FSDP, DDP)."""
    targets = [(name, mod) for name, mod in model.named_modules() if _is_hf_gdn(mod)]
    for name, old in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = Qwen3NextGatedDeltaNetFlash.from_qwen3_next(old, backend=backend)
        setattr(parent, child, new)
    return len(targets)
