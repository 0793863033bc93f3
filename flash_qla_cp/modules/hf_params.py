"""Building our GatedDeltaNet from a Hugging Face Qwen3-Next / Qwen3.5 `linear_attn` layer or
config: constructor arguments read off the layer or config, and parameters shared with the
layer (no copy). transformers is not imported here.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def kwargs_from_config(config, state_dict=None) -> dict:
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
        kwargs = {**kwargs_from_config(hf_layer_or_config, state_dict), "backend": backend, **overrides}
    if state_dict is None:
        return cls(**kwargs)
    some = next(iter(state_dict.values()))
    module = cls(**kwargs, device=some.device, dtype=some.dtype)
    module.load_state_dict(state_dict)
    return module
