"""Hugging Face Qwen3-Next: our layer loads a `linear_attn` state_dict unchanged and matches transformers'
Qwen3NextGatedDeltaNet (torch fallback path); swapping every such layer keeps a model's logits,
its cached generation and its gradients.

transformers computes the layer in fp32 internally even for a float64 model, so float64 agrees only
to fp32 rounding (~1e-7), not better.
"""

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

from flash_qla_cp.modules import GatedDeltaNet, Qwen3NextGatedDeltaNetFlash, replace_qwen3_next_gdn  # noqa: E402
from flash_qla_cp.testing import rel_err  # noqa: E402

TOL = 1e-5
HF_KERNEL_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                   "causal_conv1d_update")


@pytest.fixture(autouse=True)
def hf_torch_reference(monkeypatch):
    """transformers binds fla / causal-conv1d kernels at import when installed (Triton, GPU only);
    the reference here is its plain torch path, so put the undecorated functions back."""
    for name in ("qwen3_next.modeling_qwen3_next", "qwen3_5.modeling_qwen3_5"):
        try:
            mod = __import__(f"transformers.models.{name}", fromlist=["_"])
        except ImportError:
            continue
        for func in HF_KERNEL_FUNCS:
            if hasattr(mod, func):
                monkeypatch.setattr(mod, func, inspect.unwrap(getattr(mod, func)))


def _config(num_v_heads=4):
    return transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
        linear_num_key_heads=2, linear_num_value_heads=num_v_heads, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
        mlp_only_layers=[0, 1],  # dense MLPs: the MoE grouped matmul has no float64 kernel on CPU
        max_position_embeddings=256,
    )


def _randomise(module, seed):
    """Non-trivial values everywhere (transformers' init leaves norms at 1, conv small, ...)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float64) * 2 - 1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3 + ("norm" in name))


def _hf_layer(dtype, num_v_heads=4, seed=0):
    layer = modeling.Qwen3NextGatedDeltaNet(_config(num_v_heads), layer_idx=0).to(dtype)
    _randomise(layer, seed)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_v_heads", [2, 4])
def test_layer_matches_transformers(dtype, num_v_heads):
    hf = _hf_layer(dtype, num_v_heads)
    x = torch.randn(2, 70, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = hf(x)
    # from the layer (parameters shared) and from config + state_dict (copied)
    shared = GatedDeltaNet.from_qwen3_next(hf, backend="torch")
    copied = GatedDeltaNet.from_qwen3_next(_config(num_v_heads), state_dict=hf.state_dict(), backend="torch")
    assert shared.in_proj_qkvz.weight is hf.in_proj_qkvz.weight
    for ours in (shared, copied):
        assert rel_err(ours(x), want) < TOL
        assert ours.state_dict().keys() == hf.state_dict().keys()
        for key, val in ours.state_dict().items():
            assert torch.equal(val, hf.state_dict()[key]), key


def test_load_state_dict_unchanged_into_plain_module():
    hf = _hf_layer(torch.float32)
    ours = GatedDeltaNet(64, 2, 4, 16, 8, conv_size=4, backend="torch")
    ours.load_state_dict(hf.state_dict())  # strict: same names, same shapes
    x = torch.randn(1, 9, 64)
    assert rel_err(ours(x), hf(x)) < TOL


def test_adapter_keeps_packed_sequences_apart():
    """transformers passes packed-batch offsets as `cu_seq_lens_q`; each sequence must match its own run."""
    hf = _hf_layer(torch.float64)
    ours = Qwen3NextGatedDeltaNetFlash.from_qwen3_next(hf, backend="torch")
    lengths = [7, 2, 20]
    cu = torch.tensor([0, 7, 9, 29], dtype=torch.int32)
    x = torch.randn(1, sum(lengths), 64, dtype=torch.float64)
    out = ours(x, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=20, max_length_k=20)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert rel_err(out[:, s:e], hf(x[:, s:e])) < TOL


def _models(dtype, seed=0):
    torch.manual_seed(seed)
    ref = transformers.Qwen3NextForCausalLM(_config()).to(dtype).eval()
    for layer in ref.model.layers:
        if hasattr(layer, "linear_attn"):
            _randomise(layer.linear_attn, seed)
    swapped = transformers.Qwen3NextForCausalLM(_config()).to(dtype).eval()
    swapped.load_state_dict(ref.state_dict())
    n = replace_qwen3_next_gdn(swapped, backend="torch")
    return ref, swapped, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_model_logits_match_after_swap(dtype):
    ref, swapped, n = _models(dtype)
    assert n == 1
    assert isinstance(swapped.model.layers[0].linear_attn, Qwen3NextGatedDeltaNetFlash)
    assert swapped.state_dict().keys() == ref.state_dict().keys()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(swapped(ids).logits, ref(ids).logits) < TOL
        # left padding, as generation pads
        mask = torch.ones_like(ids)
        mask[0, :11] = 0
        a = swapped(ids, attention_mask=mask).logits
        b = ref(ids, attention_mask=mask).logits
        assert rel_err(a[mask.bool()], b[mask.bool()]) < TOL


def test_cached_decoding_matches_transformers():
    ref, swapped, _ = _models(torch.float64)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    outs = []
    for model in (ref, swapped):
        with torch.no_grad():
            out = model(ids[:, :9], use_cache=True)
            cache, logits = out.cache if hasattr(out, "cache") else out.past_key_values, [out.logits]
            for t in range(9, 12):  # one token at a time, then the cached state must carry everything
                out = model(ids[:, t: t + 1], cache=cache, use_cache=True)
                logits.append(out.logits)
        outs.append(torch.cat(logits, dim=1))
    full = swapped(ids).logits
    assert rel_err(outs[1], outs[0]) < TOL
    assert rel_err(outs[1], full) < TOL


def test_generate_matches_transformers():
    ref, swapped, _ = _models(torch.float32)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(swapped.generate(ids, **kw), ref.generate(ids, **kw))


def test_gradients_flow_and_match_after_swap():
    ref, swapped, _ = _models(torch.float64)
    ref.train(), swapped.train()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))
    for model in (ref, swapped):
        model(ids, labels=ids).loss.backward()
    got = dict(swapped.named_parameters())
    for name, p in ref.named_parameters():
        if p.grad is None:
            continue
        g = got[name].grad
        assert g is not None and torch.isfinite(g).all(), name
        assert rel_err(g, p.grad) < 1e-4, name
    assert got["model.layers.0.linear_attn.A_log"].grad.abs().sum() > 0


# ---------------------------------------------------------------- Qwen3.5: same layer, separate projections
def _qwen3_5_config():
    return transformers.Qwen3_5TextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, max_position_embeddings=256,
    )


def test_qwen3_5_layer_and_model_match_transformers():
    m35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    hf = m35.Qwen3_5GatedDeltaNet(_qwen3_5_config(), layer_idx=0)
    _randomise(hf, 0)
    x = torch.randn(2, 30, 64, generator=torch.Generator().manual_seed(1))
    want = hf(x)
    copied = GatedDeltaNet.from_hf(_qwen3_5_config(), state_dict=hf.state_dict(), backend="torch")
    assert copied.proj_layout == "qwen3_5" and copied.state_dict().keys() == hf.state_dict().keys()
    assert rel_err(GatedDeltaNet.from_hf(hf, backend="torch")(x), want) < TOL
    assert rel_err(copied(x), want) < TOL

    torch.manual_seed(0)
    ref = m35.Qwen3_5ForCausalLM(_qwen3_5_config()).eval()
    _randomise(ref.model.layers[0].linear_attn, 2)
    swapped = m35.Qwen3_5ForCausalLM(_qwen3_5_config()).eval()
    swapped.load_state_dict(ref.state_dict())
    assert replace_qwen3_next_gdn(swapped, backend="torch") == 1
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(swapped(ids).logits, ref(ids).logits) < TOL
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(swapped.generate(ids[:1, :6], **kw), ref.generate(ids[:1, :6], **kw))
