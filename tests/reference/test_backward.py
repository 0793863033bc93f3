"""The hand-written chunked backward (kernels/reference_backward.py) equals autograd through the
torch chunked forward, in float64: the per-chunk formulas the TileLang backward implements."""

import pytest
import torch

from flash_qla_cp.reference import (chunk_gated_delta_rule_bwd_reference, chunk_gated_delta_rule_torch,
                                    naive_recurrent_gated_delta_rule)
from flash_qla_cp.testing import make_gdn_inputs, outputs_and_grads, random_cu_seqlens, rel_err

NAMES = ("q", "k", "v", "g", "beta")


@pytest.mark.parametrize(
    "batch, lengths, heads, v_heads, dk, dv, with_h0, with_dht",
    [
        (2, [200], 2, 4, 16, 32, True, True),  # dense batch, odd length, GVA
        (1, [1, 64, 135, 77], 1, 3, 16, 16, True, False),  # varlen: one token, a full chunk, odd ends
        (1, [130], 2, 2, 32, 16, False, True),  # no initial state
    ],
)
def test_hand_written_backward_matches_autograd(batch, lengths, heads, v_heads, dk, dv, with_h0, with_dht):
    gen = torch.Generator().manual_seed(sum(lengths) + v_heads)
    T = sum(lengths)
    cu = None if batch > 1 else random_cu_seqlens(lengths)
    x = make_gdn_inputs(batch=batch, seq_len=T, num_heads=heads, num_v_heads=v_heads, head_k_dim=dk,
                        head_v_dim=dv, generator=gen)  # includes strongly decaying and g = 0 heads
    n = batch if cu is None else len(lengths)
    h0 = torch.randn(n, v_heads, dk, dv, generator=gen, dtype=torch.float64) if with_h0 else None
    do = torch.randn(batch, T, v_heads, dv, generator=gen, dtype=torch.float64)
    dht = torch.randn(n, v_heads, dk, dv, generator=gen, dtype=torch.float64) if with_dht else None

    leaves = {name: x[name].clone().requires_grad_(True) for name in NAMES}
    h0_leaf = None if h0 is None else h0.clone().requires_grad_(True)
    o, final = chunk_gated_delta_rule_torch(**leaves, initial_state=h0_leaf, output_final_state=True, cu_seqlens=cu)
    loss = (o * do).sum() + ((final * dht).sum() if dht is not None else 0.0)
    loss.backward()

    got = chunk_gated_delta_rule_bwd_reference(*(x[name] for name in NAMES), do, initial_state=h0, dht=dht,
                                               cu_seqlens=cu)
    for name, grad in zip(NAMES, got[:5]):
        assert grad.shape == x[name].shape and grad.dtype == x[name].dtype
        assert rel_err(grad, leaves[name].grad) < 1e-10, name
    if with_h0:
        assert rel_err(got[5], h0_leaf.grad) < 1e-10
    else:
        assert got[5] is None


def test_chunk_layout_packs_every_chunk_once_without_padding_to_the_longest():
    """The torch path's cost is the number of chunk rows it walks: one row per chunk of each
    sequence (sum of ceil(len / 64)), never sequences x longest (one long document packed with
    many one-token ones used to cost 300 x its length)."""
    from flash_qla_cp.reference.shapes import ChunkLayout, sequence_bounds

    lengths = [20000] + [1] * 300 + [0, 65]
    cu = random_cu_seqlens(lengths)
    layout = ChunkLayout.build(sequence_bounds(1, sum(lengths), cu), sum(lengths), sum(lengths), 64, "cpu")
    per_seq = [-(-n // 64) for n in lengths]
    assert layout.num_chunks == sum(per_seq) == 313 + 300 + 2
    assert [layout.rows(c).stop - layout.rows(c).start for c in range(len(layout.active))] == layout.active
    assert layout.active[0] == sum(n > 0 for n in lengths) and layout.active[2:] == [1] * (313 - 2)
    tokens = layout.index[layout.index < sum(lengths)]
    assert torch.equal(tokens.sort().values, torch.arange(sum(lengths)))  # every token exactly once


def test_skewed_packing_matches_the_recurrence_forward_and_backward():
    lengths = [300, 0, 1, 1, 1, 64, 1, 129]
    cu = random_cu_seqlens(lengths)
    gen = torch.Generator().manual_seed(5)
    x = make_gdn_inputs(seq_len=sum(lengths), num_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, generator=gen)
    h0 = torch.randn(len(lengths), 2, 8, 8, generator=gen, dtype=torch.float64)
    do = torch.randn(1, sum(lengths), 2, 8, generator=gen, dtype=torch.float64)
    dht = torch.randn(len(lengths), 2, 8, 8, generator=gen, dtype=torch.float64)
    grads = [outputs_and_grads(fn, x, h0, do, dht, cu_seqlens=cu)
             for fn in (chunk_gated_delta_rule_torch, naive_recurrent_gated_delta_rule)]
    for a, b in zip(*grads):
        assert rel_err(a, b) < 1e-10
    hand = chunk_gated_delta_rule_bwd_reference(**x, do=do, initial_state=h0, dht=dht, cu_seqlens=cu)
    for a, b in zip(hand, grads[1][2:]):
        assert rel_err(a, b) < 1e-10
