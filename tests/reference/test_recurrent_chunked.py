"""The two torch references agree with each other, in values and in gradients (float64)."""

import pytest
import torch

from flash_qla_cp import chunk_gated_delta_rule
from flash_qla_cp.reference import chunk_gated_delta_rule_torch, naive_recurrent_gated_delta_rule
from flash_qla_cp.testing import make_gdn_inputs, outputs_and_grads, random_cu_seqlens, rel_err


def _inputs(seed, **kw):
    return make_gdn_inputs(generator=torch.Generator().manual_seed(seed), **kw)


@pytest.mark.parametrize(
    "batch, seq_len, heads, v_heads, dk, dv",
    [(1, 64, 1, 1, 16, 16), (2, 150, 2, 4, 32, 16), (1, 200, 2, 2, 16, 32), (1, 7, 1, 3, 8, 8)],
)
def test_chunked_matches_recurrent(batch, seq_len, heads, v_heads, dk, dv):
    x = _inputs(batch + seq_len, batch=batch, seq_len=seq_len, num_heads=heads, num_v_heads=v_heads,
                head_k_dim=dk, head_v_dim=dv)
    h0 = torch.randn(batch, v_heads, dk, dv, dtype=torch.float64)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(**x, initial_state=h0, output_final_state=True)
    o, s = chunk_gated_delta_rule_torch(**x, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) < 1e-10
    assert rel_err(s, s_ref) < 1e-10


def test_chunk_size_does_not_change_the_result():
    x = _inputs(3, seq_len=100, num_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    o64, s64 = chunk_gated_delta_rule_torch(**x, output_final_state=True, chunk_size=64)
    o16, s16 = chunk_gated_delta_rule_torch(**x, output_final_state=True, chunk_size=16)
    assert rel_err(o16, o64) < 1e-10 and rel_err(s16, s64) < 1e-10


def test_varlen_equals_separate_sequences():
    lengths = [37, 64, 1, 130, 77]
    cu = random_cu_seqlens(lengths)
    x = _inputs(5, seq_len=sum(lengths), num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)
    h0 = torch.randn(len(lengths), 4, 16, 16, dtype=torch.float64)
    o, s = chunk_gated_delta_rule_torch(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n in range(len(lengths)):
        a, b = cu[n].item(), cu[n + 1].item()
        part = {name: t[:, a:b] for name, t in x.items()}
        o_n, s_n = naive_recurrent_gated_delta_rule(**part, initial_state=h0[n : n + 1], output_final_state=True)
        assert rel_err(o[:, a:b], o_n) < 1e-10
        assert rel_err(s[n : n + 1], s_n) < 1e-10


def test_gva_reads_the_grouped_qk_head():
    """HV = 2H must equal running each v head against its qk head (i // 2) explicitly."""
    x = _inputs(7, seq_len=70, num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)
    o, _ = chunk_gated_delta_rule_torch(**x)
    expanded = dict(x, q=x["q"].repeat_interleave(2, dim=2), k=x["k"].repeat_interleave(2, dim=2))
    o_full, _ = naive_recurrent_gated_delta_rule(**expanded)
    assert rel_err(o, o_full) < 1e-10


def test_state_chaining_two_halves_equal_the_whole():
    x = _inputs(11, seq_len=190, num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    o, s = chunk_gated_delta_rule_torch(**x, output_final_state=True)
    first = {n: t[:, :97] for n, t in x.items()}
    second = {n: t[:, 97:] for n, t in x.items()}
    o1, s1 = chunk_gated_delta_rule_torch(**first, output_final_state=True)
    o2, s2 = chunk_gated_delta_rule_torch(**second, initial_state=s1, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], dim=1), o) < 1e-10
    assert rel_err(s2, s) < 1e-10


def test_transition_matrix_maps_the_initial_state():
    x = _inputs(13, seq_len=150, num_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=8, zero_gate_heads=0)
    h0 = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    _, s, M = chunk_gated_delta_rule_torch(**x, initial_state=h0, output_final_state=True, return_transition=True)
    _, s_zero = chunk_gated_delta_rule_torch(**x, output_final_state=True)
    assert rel_err(M @ h0 + s_zero, s) < 1e-10


def test_strong_decay_forgets_and_zero_gate_remembers():
    """A strongly decaying head loses its initial state; a g = 0 head keeps a trace of it."""
    x = _inputs(17, seq_len=256, num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=8,
                strong_decay_heads=1, zero_gate_heads=1)
    h0 = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    _, s_with = chunk_gated_delta_rule_torch(**x, initial_state=h0, output_final_state=True)
    _, s_without = chunk_gated_delta_rule_torch(**x, output_final_state=True)
    gap = (s_with - s_without).flatten(2).norm(dim=-1)[0]
    assert gap[0] < 1e-12
    assert gap[1] > 1e-6
    o_ref, _ = naive_recurrent_gated_delta_rule(**x, initial_state=h0)
    o, _ = chunk_gated_delta_rule_torch(**x, initial_state=h0)
    assert rel_err(o, o_ref) < 1e-10


def test_half_inputs_match_float64_within_bf16_tolerance():
    x = _inputs(19, seq_len=130, num_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32)
    o_ref, s_ref = chunk_gated_delta_rule_torch(**x, output_final_state=True)
    xb = {n: t.to(torch.bfloat16) if n in "qkv" else t.float() for n, t in x.items()}
    o, s = chunk_gated_delta_rule_torch(**xb, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < 5e-3 and rel_err(s, s_ref) < 5e-3


EXTREME = {"reset": float("-inf"), "-1e30": -1e30, "-1e9": -1e9, "-700": -700.0, "-50": -50.0}


def _extreme_case(value, dtype, seed=0):
    """Packed sequences whose gates take `value` at a few tokens (two in one chunk, one at a
    chunk's first token, one in a 1-token sequence), the usual gates elsewhere."""
    lengths = [150, 1, 70]
    gen = torch.Generator().manual_seed(seed)
    x = make_gdn_inputs(seq_len=sum(lengths), num_heads=1, num_v_heads=3, head_k_dim=8, head_v_dim=8,
                        generator=gen)
    g = x["g"].clone()
    for t, h in ((10, 0), (11, 0), (64, 1), (130, 2), (150, 0), (200, 1)):
        g[0, t, h] = value
    x = {n: t.to(dtype) for n, t in dict(x, g=g).items()}
    h0 = torch.randn(3, 3, 8, 8, generator=gen, dtype=torch.float64).to(dtype)
    return x, h0, random_cu_seqlens(lengths)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-6)])
@pytest.mark.parametrize("name", list(EXTREME))
def test_extreme_gates_match_the_recurrence(name, dtype, tol):
    """g = -inf resets the state exactly (exp(g) = 0), and very negative finite gates decay as
    they should: no NaN, outputs and gradients as the token recurrence gives them."""
    x, h0, cu = _extreme_case(EXTREME[name], dtype)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(1, x["v"].shape[1], 3, 8, generator=gen, dtype=torch.float64).to(dtype)
    dht = torch.randn(3, 3, 8, 8, generator=gen, dtype=torch.float64).to(dtype)
    results = [outputs_and_grads(fn, x, h0, do, dht, cu_seqlens=cu)
               for fn in (chunk_gated_delta_rule, naive_recurrent_gated_delta_rule)]
    for what, ours, ref in zip(("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"), *results):
        assert torch.isfinite(ours).all(), what
        assert rel_err(ours, ref) < tol, (what, rel_err(ours, ref))


def test_a_reset_leaves_earlier_outputs_as_they_were():
    x, h0, cu = _extreme_case(float("-inf"), torch.float64)
    o_reset, _ = chunk_gated_delta_rule(**x, initial_state=h0, cu_seqlens=cu)
    plain = torch.where(torch.isinf(x["g"]), -1.0, x["g"])
    o_plain, _ = chunk_gated_delta_rule(**dict(x, g=plain), initial_state=h0, cu_seqlens=cu)
    assert rel_err(o_reset[:, :10], o_plain[:, :10]) < 1e-14  # tokens before the first reset
    after = chunk_gated_delta_rule(**{n: t[:, 11:150] for n, t in x.items()})[0][:, 0, 0]
    assert rel_err(o_reset[:, 11, 0], after) < 1e-12  # head 0 at token 11 starts from zero


@pytest.mark.parametrize("intra_cp", [3, "off"])
def test_resets_under_the_torch_split(intra_cp):
    from flash_qla_cp import CPContext

    x, h0, cu = _extreme_case(float("-inf"), torch.float64, seed=2)
    want = naive_recurrent_gated_delta_rule(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for exact in (True, False):
        cp = CPContext.single(cu, intra_cp=intra_cp, intra_exact=exact)
        got = chunk_gated_delta_rule(**x, initial_state=h0, output_final_state=True, cp_context=cp)
        for a, b in zip(got, want):
            assert torch.isfinite(a).all() and rel_err(a, b) < 1e-10


def test_positive_and_nan_gates_are_computed_as_written():
    """g > 0 is the recurrence as written (the state grows); a NaN gate makes its head's outputs
    NaN from its 64-token chunk on (the op does not inspect the values: that would cost a host
    sync)."""
    x, h0, cu = _extreme_case(0.3, torch.float64)
    got = chunk_gated_delta_rule(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    want = naive_recurrent_gated_delta_rule(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert all(rel_err(a, b) < 1e-10 for a, b in zip(got, want))
    g = x["g"].clone()
    g[0, 100, 1] = float("nan")  # in the first sequence's second chunk (tokens 64-127)
    o, _ = chunk_gated_delta_rule(**dict(x, g=g), initial_state=h0, cu_seqlens=cu)
    assert torch.isfinite(o[0, :64]).all() and torch.isnan(o[0, 100:150, 1]).all()
    assert torch.isfinite(o[0, :, 0]).all() and torch.isfinite(o[0, 150:]).all()
