"""GatedDeltaNet module: values against an independent composition, varlen, padding, decode cache,
gradients, GVA, negative eigenvalues, state_dict layout, the CP seam and bad input."""

import pytest
import torch
import torch.nn.functional as F

import flash_qla_cp
from flash_qla_cp.reference import naive_recurrent_gated_delta_rule
from flash_qla_cp.modules import GatedDeltaNet, GDNCache, ShortConvolution, causal_conv1d_varlen
from flash_qla_cp.testing import random_cu_seqlens, rel_err

D = 32


def _layer(H=2, HV=4, dk=8, dv=8, seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    m = GatedDeltaNet(D, H, HV, dk, dv, backend="torch", **kw).to(dtype)
    with torch.no_grad():  # larger than default init so every part of the layer matters
        m.in_proj_qkvz.weight.normal_(0, 0.4)
        m.in_proj_ba.weight.normal_(0, 0.4)
        m.conv1d.weight.normal_(0, 0.5)
        m.norm.weight.uniform_(0.5, 1.5)
        m.A_log.uniform_(-1.0, 1.0)
    return m


def _x(B, T, seed=1, dtype=torch.float64):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _reference(m: GatedDeltaNet, x):
    """The layer written out from its definition, one head at a time, with the token-by-token recurrence."""
    B, T, _ = x.shape
    H, HV, dk, dv = m.num_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    r = HV // H
    Wqkvz, Wba = m.in_proj_qkvz.weight, m.in_proj_ba.weight
    per = 2 * dk + 2 * r * dv
    q_rows, k_rows, v_rows, z_rows, b_rows, a_rows = [], [], [], [], [], []
    for h in range(H):
        base = h * per
        q_rows.append(Wqkvz[base: base + dk])
        k_rows.append(Wqkvz[base + dk: base + 2 * dk])
        v_rows.append(Wqkvz[base + 2 * dk: base + 2 * dk + r * dv])
        z_rows.append(Wqkvz[base + 2 * dk + r * dv: base + per])
        b_rows.append(Wba[h * 2 * r: h * 2 * r + r])
        a_rows.append(Wba[h * 2 * r + r: (h + 1) * 2 * r])
    qkv = x @ torch.cat(q_rows + k_rows + v_rows).T  # conv channels: all q, all k, all v
    K = m.conv_size
    qkv = F.silu(F.conv1d(qkv.transpose(1, 2), m.conv1d.weight, padding=K - 1, groups=qkv.shape[-1])[..., :T])
    qkv = qkv.transpose(1, 2)
    q = F.normalize(qkv[..., : H * dk].reshape(B, T, H, dk), dim=-1, eps=0)
    k = F.normalize(qkv[..., H * dk: 2 * H * dk].reshape(B, T, H, dk), dim=-1, eps=0)
    v = qkv[..., 2 * H * dk:].reshape(B, T, HV, dv)
    z = (x @ torch.cat(z_rows).T).reshape(B, T, HV, dv)
    b, a = x @ torch.cat(b_rows).T, x @ torch.cat(a_rows).T
    beta = torch.sigmoid(b) * (2.0 if m.allow_neg_eigval else 1.0)
    g = -torch.exp(m.A_log) * F.softplus(a + m.dt_bias)
    o, _ = naive_recurrent_gated_delta_rule(q, k, v, g, beta)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.norm_eps) * m.norm.weight * F.silu(z)
    return o.reshape(B, T, HV * dv) @ m.out_proj.weight.T


@pytest.mark.parametrize("H, HV, neg", [(2, 2, False), (2, 4, False), (1, 3, True)])
def test_matches_definition_shapes_and_gradients(H, HV, neg):
    m = _layer(H=H, HV=HV, allow_neg_eigval=neg)
    x = _x(2, 37).requires_grad_(True)
    out = m(x)
    assert out.shape == (2, 37, D) and out.dtype == x.dtype
    assert rel_err(out, _reference(m, x)) < 1e-6  # l2norm eps 1e-6 is the only difference
    out.square().sum().backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    assert set(grads) == {"in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log",
                          "norm.weight", "out_proj.weight"}
    for name, grad in grads.items():
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all()


def test_allow_neg_eigval_doubles_beta():
    m = _layer(allow_neg_eigval=True)
    b = torch.randn(1, 3, 4, dtype=torch.float64)
    _, beta = m._gates(b, torch.zeros_like(b))
    assert torch.allclose(beta, 2 * b.sigmoid()) and beta.max() > 1
    m.allow_neg_eigval = False
    assert torch.allclose(m._gates(b, torch.zeros_like(b))[1], b.sigmoid())


def test_state_dict_uses_hugging_face_names_and_round_trips():
    m = _layer(H=2, HV=4, dk=8, dv=6)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    C = 2 * 2 * 8 + 4 * 6
    assert shapes == {
        "in_proj_qkvz.weight": (2 * 2 * 8 + 2 * 4 * 6, D), "in_proj_ba.weight": (8, D), "conv1d.weight": (C, 1, 4),
        "dt_bias": (4,), "A_log": (4,), "norm.weight": (6,), "out_proj.weight": (D, 4 * 6),
    }
    other = GatedDeltaNet(D, 2, 4, 8, 6, backend="torch").double()
    other.load_state_dict(m.state_dict())
    x = _x(1, 9)
    assert torch.equal(other(x), m(x))


def test_short_conv_matches_conv1d_and_does_not_cross_sequences():
    torch.manual_seed(3)
    conv = ShortConvolution(6, 4).double()
    x = torch.randn(1, 12, 6, dtype=torch.float64)
    want = F.silu(F.conv1d(x.transpose(1, 2), conv.weight, padding=3, groups=6)[..., :12]).transpose(1, 2)
    assert torch.allclose(conv(x)[0], want)
    cu = random_cu_seqlens([2, 7, 3])
    y, state = conv(x, cu_seqlens=cu, output_final_state=True)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ys, ss = conv(x[:, s:e], output_final_state=True)
        assert torch.allclose(y[:, s:e], ys) and torch.allclose(state[n], ss[0])
    # a 2-token sequence's state: one zero column, then its two inputs
    assert torch.equal(state[0, :, 0], torch.zeros(6, dtype=torch.float64))
    assert torch.equal(state[0, :, 1:], x[0, :2].T)


def test_varlen_equals_separate_sequences():
    m = _layer()
    lengths = [5, 1, 9, 2, 30]
    cu = random_cu_seqlens(lengths)
    x = _x(1, sum(lengths))
    out, cache = m(x, cu_seqlens=cu, use_cache=True)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o, c = m(x[:, s:e], use_cache=True)
        assert rel_err(out[:, s:e], o) < 1e-12, n
        assert rel_err(cache.conv_state[n], c.conv_state[0]) < 1e-12
        assert rel_err(cache.recurrent_state[n], c.recurrent_state[0]) < 1e-12


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_equals_unpadded(side):
    m = _layer()
    lengths, T = [7, 12, 3], 12
    xs = [_x(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    x = torch.randn(len(lengths), T, D, dtype=torch.float64) * 5  # padding holds garbage
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        sl = slice(T - n, T) if side == "left" else slice(0, n)
        x[i, sl], mask[i, sl] = xs[i][0], 1
    out, cache = m(x, attention_mask=mask, use_cache=True)
    assert torch.all(out[mask == 0] == 0)
    for i, n in enumerate(lengths):
        sl = slice(T - n, T) if side == "left" else slice(0, n)
        o, c = m(xs[i], use_cache=True)
        assert rel_err(out[i, sl], o[0]) < 1e-12
        assert rel_err(cache.conv_state[i], c.conv_state[0]) < 1e-12
        assert rel_err(cache.recurrent_state[i], c.recurrent_state[0]) < 1e-12
    # and the padded batch decodes on like the separate sequences
    step = _x(len(lengths), 1, seed=99)
    o_next, _ = m(step, cache=cache, use_cache=True)
    for i in range(len(lengths)):
        o_full = m(torch.cat([xs[i], step[i: i + 1]], dim=1))
        assert rel_err(o_next[i], o_full[0, -1:]) < 1e-12


@pytest.mark.parametrize("splits", [[19, 1], [1, 1, 1, 17], [5, 2, 13]])
def test_decode_with_cache_equals_full_sequence(splits):
    m = _layer(H=1, HV=2)
    T = sum(splits)
    x = _x(2, T)
    full, full_cache = m(x, use_cache=True)
    cache, outs, s = None, [], 0
    for n in splits:
        o, cache = m(x[:, s: s + n], cache=cache, use_cache=True)
        outs.append(o)
        s += n
    assert rel_err(torch.cat(outs, dim=1), full) < 1e-12
    assert rel_err(cache.conv_state, full_cache.conv_state) < 1e-12
    assert rel_err(cache.recurrent_state, full_cache.recurrent_state) < 1e-12
    assert cache.seen_tokens == T


def test_varlen_prefill_then_batched_decode():
    m = _layer()
    lengths = [6, 2, 11]
    cu = random_cu_seqlens(lengths)
    x = _x(1, sum(lengths))
    _, cache = m(x, cu_seqlens=cu, use_cache=True)
    step = _x(3, 1, seed=5)
    o_step, _ = m(step, cache=cache, use_cache=True)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_full = m(torch.cat([x[:, s:e], step[n: n + 1]], dim=1))
        assert rel_err(o_step[n], o_full[0, -1:]) < 1e-12


def test_initial_state_tensor_equals_cache_with_empty_conv_history():
    m = _layer()
    x = _x(2, 9)
    h0 = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    zero_conv = torch.zeros(2, m.conv_dim, 3, dtype=torch.float64)
    a = m(x, initial_state=h0)
    b, _ = m(x, cache=GDNCache(zero_conv, h0), use_cache=True)
    assert rel_err(a, b) < 1e-12
    assert rel_err(a, m(x)) > 1e-3  # the state matters


def test_gradients_through_varlen_and_cache():
    m = _layer(dtype=torch.float32)
    cu = random_cu_seqlens([4, 10])
    x = _x(1, 14, dtype=torch.float32).requires_grad_(True)
    h0 = torch.randn(2, 4, 8, 8).requires_grad_(True)
    out, cache = m(x, cu_seqlens=cu, initial_state=h0, use_cache=True)
    (out.square().sum() + cache.recurrent_state.square().sum()).backward()
    for t in [x.grad, h0.grad] + [p.grad for p in m.parameters()]:
        assert t is not None and torch.isfinite(t).all()


def test_bfloat16_close_to_float32():
    m = _layer(dtype=torch.float32)
    x = _x(1, 20, dtype=torch.float32)
    ref = m(x)
    out = m.to(torch.bfloat16)(x.bfloat16())
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 3e-2


def test_training_calls_take_the_fused_layer_and_the_others_the_steps(monkeypatch):
    """Plain, packed and initial-state calls run the fused layer (`modules/fused_mixer.py`), and so
    do a mask without padding, inference with use_cache (a prefill, a cache continued) and a cache
    in with a backward but no states out; padding masks, states out with a backward to come and,
    on the torch backend, single tokens (decoding) take the step-by-step path."""
    import flash_qla_cp.modules.gated_deltanet as gdn_mod

    fused, steps = [], []
    real_fused, real_op = gdn_mod.fused_mixer, gdn_mod.chunk_gated_delta_rule
    real_with_states = gdn_mod.fused_mixer_with_states
    monkeypatch.setattr(gdn_mod, "fused_mixer", lambda *a, **kw: fused.append(1) or real_fused(*a, **kw))
    monkeypatch.setattr(gdn_mod, "fused_mixer_with_states",
                        lambda *a, **kw: fused.append(1) or real_with_states(*a, **kw))
    monkeypatch.setattr(gdn_mod, "chunk_gated_delta_rule", lambda *a, **kw: steps.append(kw) or real_op(*a, **kw))
    m = _layer()
    m(_x(2, 9))
    m(_x(1, 9), cu_seqlens=random_cu_seqlens([4, 5]))
    m(_x(2, 9), initial_state=torch.randn(2, 4, 8, 8, dtype=torch.float64))
    assert len(fused) == 3 and steps == []
    m(_x(2, 9), attention_mask=torch.ones(2, 9))  # no padding: nothing to mask
    assert len(fused) == 4 and steps == []
    m(_x(2, 9), attention_mask=torch.tensor([[0, 0] + [1] * 7, [1] * 9]))
    _, cache = m(_x(2, 9), use_cache=True)  # states out and a backward to come
    assert len(fused) == 4 and len(steps) == 2 and not any("cp_context" in kw for kw in steps)
    with torch.no_grad():
        m(_x(2, 9), use_cache=True)  # a prompt's prefill: states out, no backward
        assert len(fused) == 5 and len(steps) == 2
        m(_x(2, 9), cache=cache, use_cache=True)  # a cache in (its conv history)
        m(_x(1, 2), cu_seqlens=random_cu_seqlens([1, 1]), cache=cache, use_cache=True)  # packed single tokens
        assert len(fused) == 7 and len(steps) == 2
        m(_x(2, 1), cache=cache, use_cache=True)  # decoding: the torch backend's one-token recurrence
        m(_x(2, 1), use_cache=True)
        assert len(fused) == 7 and len(steps) == 2
    m(_x(2, 3), cache=cache)  # a cache in, a backward to come, no states out
    assert len(fused) == 8 and len(steps) == 2
    m(_x(2, 3), cache=cache, use_cache=True)  # states out and a backward to come
    assert len(fused) == 8 and len(steps) == 3


@pytest.mark.parametrize("kind", ["dense", "packed", "initial_state"])
def test_prefill_with_use_cache_runs_fused_and_matches_the_step_path(kind, monkeypatch):
    """use_cache=True without a cache under no_grad (a prompt's prefill) takes the fused layer; its
    output, conv state (last K - 1 conv inputs per sequence, zeros before short sequences' starts)
    and recurrent state equal the step path's, and decoding on from that cache matches decoding
    on from the step path's."""
    import flash_qla_cp.modules.gated_deltanet as gdn_mod

    fused = []
    real = gdn_mod.fused_mixer_with_states
    monkeypatch.setattr(gdn_mod, "fused_mixer_with_states", lambda *a, **kw: fused.append(1) or real(*a, **kw))
    m = _layer()
    kw = {}
    if kind == "packed":
        kw["cu_seqlens"] = random_cu_seqlens([4, 1, 0, 2, 30])
        x = _x(1, 37)
    else:
        x = _x(2, 9)
    if kind == "initial_state":
        kw["initial_state"] = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        out, cache = m(x, use_cache=True, **kw)
        assert fused == [1]
        m._fused_backend = lambda *args: None  # the step path
        want, want_cache = m(x, use_cache=True, **kw)
        N = cache.conv_state.shape[0]
        step = _x(N, 1)
        after, _ = m(step, cache=cache, use_cache=True)
        want_after, _ = m(step, cache=want_cache, use_cache=True)
    assert rel_err(out, want) < 1e-12
    assert torch.equal(cache.conv_state, want_cache.conv_state)
    assert rel_err(cache.recurrent_state, want_cache.recurrent_state) < 1e-12
    assert cache.recurrent_state.dtype == want_cache.recurrent_state.dtype
    assert cache.seen_tokens == want_cache.seen_tokens
    assert rel_err(after, want_after) < 1e-12


def _cache(m, N, seed):
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(N, m.conv_dim, m.conv_size - 1, generator=gen, dtype=torch.float64)
    state = torch.randn(N, m.num_v_heads, m.head_k_dim, m.head_v_dim, generator=gen, dtype=torch.float64)
    return GDNCache(conv, state)


@pytest.mark.parametrize("kind", ["dense", "decode", "packed"])
def test_continuing_a_cache_runs_fused_and_matches_the_step_path(kind, monkeypatch):
    """A cache in (a prompt in pieces, or a token per sequence packed: decoding as the TileLang
    backend runs it) takes the fused layer, its conv state as rows in front of each sequence:
    output and cache equal the step path's, and with a backward (no states out) so do the
    gradients of the input, the cache and the parameters."""
    import flash_qla_cp.modules.gated_deltanet as gdn_mod

    fused = []
    for name in ("fused_mixer", "fused_mixer_with_states"):
        real = getattr(gdn_mod, name)
        monkeypatch.setattr(gdn_mod, name, lambda *a, _real=real, **kw: fused.append(1) or _real(*a, **kw))
    m = _layer()
    kw = {}
    if kind == "dense":
        x, N = _x(3, 6), 3
    else:
        lengths = [4, 1, 0, 2, 30] if kind == "packed" else [1, 1, 1]
        kw["cu_seqlens"] = random_cu_seqlens(lengths)
        x, N = _x(1, sum(lengths)), len(lengths)
    cache = _cache(m, N, seed=7)

    def grads():
        m.zero_grad()
        xs = x.clone().requires_grad_(True)
        conv = cache.conv_state.clone().requires_grad_(True)
        state = cache.recurrent_state.clone().requires_grad_(True)
        m(xs, cache=GDNCache(conv, state), **kw).square().sum().backward()
        return [xs.grad, conv.grad, state.grad] + [p.grad.clone() for p in m.parameters()]

    with torch.no_grad():
        out, new_cache = m(x, cache=cache, use_cache=True, **kw)
    got = grads()
    assert fused == [1, 1]
    with monkeypatch.context() as patch:
        patch.setattr(GatedDeltaNet, "_fused_backend", lambda self, *args: None)  # the step path
        with torch.no_grad():
            want, want_cache = m(x, cache=cache, use_cache=True, **kw)
        want_grads = grads()
    assert fused == [1, 1]
    assert rel_err(out, want) < 1e-12
    assert torch.equal(new_cache.conv_state, want_cache.conv_state)
    assert rel_err(new_cache.recurrent_state, want_cache.recurrent_state) < 1e-12
    assert rel_err(out, m(x, **kw)) > 1e-3  # the cache matters
    for a, b in zip(got, want_grads):
        assert rel_err(a, b) < 1e-10


def test_save_states_option_reaches_the_op(monkeypatch):
    import flash_qla_cp.modules.fused_mixer as mixer_mod

    seen = []
    real = mixer_mod.chunk_gated_delta_rule_fwd

    def spy(*args, **kwargs):
        seen.append(kwargs.get("save_states"))
        return real(*args, **kwargs)

    monkeypatch.setattr(mixer_mod, "chunk_gated_delta_rule_fwd", spy)
    _layer()(_x(1, 5))
    _layer(save_states=False)(_x(1, 5))
    assert seen == [True, False]


@pytest.mark.parametrize("intra", ["off", 3])
def test_single_process_cp_context_matches_plain_forward(intra):
    from flash_qla_cp.parallel import CPContext

    m = _layer()
    cu = random_cu_seqlens([20, 70, 38])
    x = _x(1, 128).requires_grad_(True)
    want = m(x, cu_seqlens=cu)
    (gw,) = torch.autograd.grad(want.square().sum(), x)
    got = m(x, cu_seqlens=cu, cp_context=CPContext.single(cu, intra_cp=intra))
    (gg,) = torch.autograd.grad(got.square().sum(), x)
    assert rel_err(got, want) < 1e-10 and rel_err(gg, gw) < 1e-10
    with pytest.raises(ValueError, match="context parallelism"):
        m(x, cu_seqlens=cu, cp_context=CPContext.single(cu), use_cache=True)


def test_exported_from_package():
    assert flash_qla_cp.GatedDeltaNet is GatedDeltaNet


def test_bad_input_raises_clear_errors():
    m = _layer()
    x = _x(2, 5)
    cases = [
        (lambda: m(_x(2, 5)[..., :16]), "hidden_size=32"),
        (lambda: m(x[0]), "3-D"),
        (lambda: m(x.long()), "floating"),
        (lambda: m(x.float()), "hidden_states is torch.float32, the layer's parameters torch.float64"),
        (lambda: m(x.to("meta")), "hidden_states is on meta, the layer's parameters on cpu"),
        (lambda: m(x, attention_mask=torch.ones(2, 4)), "attention_mask"),
        (lambda: m(x[:1], attention_mask=torch.ones(1, 5), cu_seqlens=random_cu_seqlens([5])), "not both"),
        (lambda: m(x, cu_seqlens=random_cu_seqlens([2, 3])), "batch size must be 1"),
        (lambda: m(x[:1], cu_seqlens=random_cu_seqlens([2, 2])), "cu_seqlens must start at 0 and end at T=5"),
        (lambda: m(x[:1], cu_seqlens=torch.tensor([0, 3, 2, 5], dtype=torch.int32)), "cu_seqlens must be non-decreasing"),
        (lambda: m(x[:1], cu_seqlens=torch.tensor([0.0, 5.0])), "int32"),
        (lambda: m(x, initial_state=torch.zeros(3, 4, 8, 8, dtype=torch.float64)), "recurrent state"),
        (lambda: m(x, cache=GDNCache(torch.zeros(2, 5, 3), torch.zeros(2, 4, 8, 8))), "conv_state"),
        (lambda: m(x, cache=(1, 2)), "GDNCache"),
        (lambda: m(x, cache=GDNCache(torch.zeros(2, m.conv_dim, 3, dtype=torch.int64), torch.zeros(2, 4, 8, 8))),
         "conv_state must be floating point"),
        (lambda: m(x, cache=GDNCache(torch.zeros(2, m.conv_dim, 3, device="meta"), torch.zeros(2, 4, 8, 8))),
         "conv_state must be floating point on hidden_states' device cpu"),
        (lambda: m(x, initial_state=torch.zeros(2, 4, 8, 8, dtype=torch.int32)), "recurrent state must be floating"),
        (lambda: m(x, cache=GDNCache(torch.zeros(2, m.conv_dim, 3), torch.zeros(2, 4, 8, 8)),
                   initial_state=torch.zeros(2, 4, 8, 8)), "not both"),
        (lambda: GatedDeltaNet(D, 3, 4, 8, 8), "multiple"),
        (lambda: GatedDeltaNet(D, 2, 4, 8, 8, conv_size=1), "conv_size"),
        (lambda: GatedDeltaNet(D, 2, 4, 0, 8), "head_k_dim"),
        (lambda: GatedDeltaNet(D, 2, 4, 8, 8, backend="cuda"), "backend"),
        (lambda: GatedDeltaNet(D, 2, 4, 8, 8, proj_layout="llama"), "proj_layout"),
        (lambda: GatedDeltaNet(D, 2, 4, 8, 8, norm_eps=-1e-6), "norm_eps"),
        (lambda: GatedDeltaNet(D, 2, 4, 8, 8, norm_eps=float("nan")), "norm_eps"),
    ]
    for fn, words in cases:
        with pytest.raises(ValueError, match=words):
            fn()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (mixed dtypes are autocast's job there)
        assert _layer(dtype=torch.float32)(x.bfloat16()).dtype == torch.bfloat16


def test_conv_function_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_varlen(torch.zeros(1, 3, 2), torch.zeros(2, 4), activation="gelu")


def test_nan_in_padding_never_reaches_real_tokens():
    m = _layer()
    x = _x(2, 9)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 0, 0]])
    poisoned = x.clone()
    poisoned[0, :3] = float("nan")
    poisoned[1, 7:] = float("inf")
    want = m(x, attention_mask=mask)
    got = m(poisoned, attention_mask=mask)
    assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("mask, words", [
    ([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]], "one run of tokens"),
    ([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1]], "one run of tokens"),
    ([[0.5, 1, 1, 1, 1], [1, 1, 1, 1, 1]], "only 0"),
    ([[2, 2, 2, 2, 2], [1, 1, 1, 1, 1]], "only 0"),
])
def test_padding_mask_must_be_binary_and_contiguous(mask, words):
    with pytest.raises(ValueError, match=words):
        _layer()(_x(2, 5), attention_mask=torch.tensor(mask))


def test_padding_on_both_sides_and_all_padding_rows_work():
    m = _layer()
    x = _x(3, 6)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    out, cache = m(x, attention_mask=mask, use_cache=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # a row of padding only: no output, no state
    assert torch.equal(cache.conv_state[1], torch.zeros_like(cache.conv_state[1]))
    assert torch.equal(cache.recurrent_state[1], torch.zeros_like(cache.recurrent_state[1]))
    alone = m(x[:1, 1:4])  # the padded row equals its tokens on their own
    assert rel_err(out[:1, 1:4], alone) < 1e-12


def test_no_tokens_give_an_empty_output_and_hand_the_states_on():
    m = _layer()
    out, cache = m(_x(2, 0), use_cache=True)
    assert out.shape == (2, 0, D) and cache.seen_tokens == 0
    assert not cache.recurrent_state.any() and not cache.conv_state.any()
    x = _x(2, 7)
    _, after = m(x, use_cache=True)
    out2, again = m(_x(2, 0), cache=after, use_cache=True)
    assert torch.equal(again.recurrent_state, after.recurrent_state) and torch.equal(again.conv_state, after.conv_state)
    with pytest.raises(ValueError, match="batch size 0"):
        m(_x(0, 4))


def test_a_packed_call_refuses_cuda_graph_capture(monkeypatch):
    """A packed call is planned from cu_seqlens' values on the host (read back once per tensor):
    captured in a CUDA graph, its replays would keep that plan whatever cu_seqlens later holds, so
    the layer refuses the capture with an error that names the way out."""

    class OnGpu(torch.Tensor):  # (this machine may have no GPU: the check reads is_cuda)
        @property
        def is_cuda(self):
            return True

    m = GatedDeltaNet(64, 2, 4, 16, 16)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32).as_subclass(OnGpu)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="cannot be captured in a CUDA graph.*cu_seqlens_cpu"):
        m(torch.randn(1, 30, 64), cu_seqlens=cu)
