"""Hugging Face adapter (Qwen3-Next, and Qwen3.5 whose layer differs only in its projections): build our
GatedDeltaNet from a `linear_attn` layer or config, and swap every such layer of a transformers model
for it, weights kept.

transformers is imported lazily; nothing here needs it at import time. The adapter speaks the
transformers >= 5 cache API (`get_conv_state` / `update_conv_state` / ... on the model's Cache).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .gated_deltanet import GatedDeltaNet

HF_GDN_CLASSES = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")


def _kwargs_from_config(config, state_dict=None) -> dict:
    if not hasattr(config, "linear_num_key_heads") and hasattr(config, "get_text_config"):
        config = config.get_text_config()  # multimodal Qwen3.5 configs nest the language model's
    if state_dict is not None:
        layout = "qwen3_5" if any(k.startswith("in_proj_qkv.") for k in state_dict) else "qwen3_next"
    else:
        layout = "qwen3_5" if str(getattr(config, "model_type", "")).startswith("qwen3_5") else "qwen3_next"
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"GatedDeltaNet: the short conv uses SiLU, but the config asks for hidden_act={act!r}")
    return dict(
        hidden_size=config.hidden_size,
        num_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads,
        head_k_dim=config.linear_key_head_dim,
        head_v_dim=config.linear_value_head_dim,
        conv_size=config.linear_conv_kernel_dim,
        norm_eps=config.rms_norm_eps,
        proj_layout=layout,
    )


def _kwargs_from_layer(layer) -> dict:
    act = getattr(layer, "activation", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"GatedDeltaNet: the short conv uses SiLU, but the layer uses {act!r}")
    return dict(
        hidden_size=layer.hidden_size,
        num_heads=layer.num_k_heads,
        num_v_heads=layer.num_v_heads,
        head_k_dim=layer.head_k_dim,
        head_v_dim=layer.head_v_dim,
        conv_size=layer.conv_kernel_size,
        norm_eps=layer.layer_norm_epsilon,
        layer_idx=layer.layer_idx,
        proj_layout="qwen3_5" if hasattr(layer, "in_proj_qkv") else "qwen3_next",
    )


def _share_parameters(dst: nn.Module, src: nn.Module):
    """Point every parameter of dst at src's Parameter object of the same name (no copy: optimizers,
    tied references and devices stay as they were)."""
    src_params = dict(src.named_parameters())
    dst_names = [name for name, _ in dst.named_parameters()]
    if sorted(src_params) != sorted(dst_names):
        raise ValueError(
            f"GatedDeltaNet: parameter names differ from the Hugging Face layer: ours {sorted(dst_names)}, "
            f"theirs {sorted(src_params)}"
        )
    for name in dst_names:
        owner_path, _, leaf = name.rpartition(".")
        owner = dst.get_submodule(owner_path) if owner_path else dst
        mine = getattr(owner, leaf)
        if mine.shape != src_params[name].shape:
            raise ValueError(f"GatedDeltaNet: {name} is {tuple(src_params[name].shape)} in the Hugging Face layer, "
                             f"{tuple(mine.shape)} here")
        setattr(owner, leaf, src_params[name])


def gdn_from_qwen3_next(cls, hf_layer_or_config, state_dict=None, backend="auto", **overrides):
    """See `GatedDeltaNet.from_qwen3_next`. `overrides` replace constructor arguments (e.g. layer_idx)."""
    if isinstance(hf_layer_or_config, nn.Module):
        layer = hf_layer_or_config
        kwargs = {**_kwargs_from_layer(layer), "backend": backend, **overrides}
        if state_dict is None:
            # build without allocating, then adopt the layer's own parameters
            with torch.device("meta"):
                module = cls(**kwargs)
            _share_parameters(module, layer)
            module.train(layer.training)
            if hasattr(layer, "layer_type"):
                module.layer_type = layer.layer_type
            return module
    else:
        kwargs = {**_kwargs_from_config(hf_layer_or_config, state_dict), "backend": backend, **overrides}
    if state_dict is None:
        return cls(**kwargs)
    some = next(iter(state_dict.values()))
    module = cls(**kwargs, device=some.device, dtype=some.dtype)
    module.load_state_dict(state_dict)
    return module


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
            output_final_state=cache is not None, cp_context=cp_context,
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
