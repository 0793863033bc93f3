"""kernels/chunk_grads_torch.py (the grad kernel's stand-in for head dims past 128): given the
chunk states the backward walks write, every chunk's dq, dk, dg, dbeta at once equal the
hand-written backward's, in float64, on varlen GVA inputs with odd lengths."""

import pytest
import torch

from flash_qla_cp.kernels.chunk_grads_torch import chunk_grads_from_states
from flash_qla_cp.kernels.reference_backward import chunk_gated_delta_rule_bwd_reference, ut_inverse
from flash_qla_cp.kernels.reference_chunked import _decay_diff, _from_chunks, _to_chunks
from flash_qla_cp.kernels.shapes import expand_qk_heads, padded_chunk_index, sequence_bounds
from flash_qla_cp.kernels.tilelang_common import chunk_table
from flash_qla_cp.testing import chunk_local_cumsum, make_gdn_inputs, random_cu_seqlens, rel_err

C = 64


def walks(x, do, h0, dht, cu, scale):
    """What the h walk and the dh walk write, in float64: the state entering and the gradient of
    the state leaving every chunk (chunk-table order), v - exp(G) k S, dvn and dv per token, and
    the initial state's gradient."""
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    T, HV = q.shape[1], v.shape[2]
    index, _ = padded_chunk_index(sequence_bounds(1, T, cu), T, T, C, q.device)
    qc, kc, vc, gc, bc, doc = (_to_chunks(t, index, C, torch.float64)
                               for t in (expand_qk_heads(q, HV), expand_qk_heads(k, HV), v, g, beta, do))
    G = gc.cumsum(-1)
    GL = G[..., -1]
    Tm = ut_inverse(kc, G, bc)
    Ag, eG, tail = Tm * bc[..., None, :], torch.exp(G)[..., None], torch.exp(GL[..., None] - G)[..., None]
    P = scale * (qc @ kc.transpose(-1, -2)) * _decay_diff(G, True)
    NT = qc.shape[2]
    S_in, dS_out = [None] * NT, [None] * NT
    vres, dvn, dv = torch.zeros_like(vc), torch.zeros_like(vc), torch.zeros_like(vc)
    S = h0
    for c in range(NT):
        S_in[c] = S
        vres[:, :, c] = vc[:, :, c] - eG[:, :, c] * (kc[:, :, c] @ S)
        S = torch.exp(GL[:, :, c])[..., None, None] * S + (tail[:, :, c] * kc[:, :, c]).transpose(-1, -2) @ (
            Ag[:, :, c] @ vres[:, :, c])
    dS = dht
    for c in reversed(range(NT)):
        dS_out[c] = dS
        dvn[:, :, c] = P[:, :, c].transpose(-1, -2) @ doc[:, :, c] + tail[:, :, c] * (kc[:, :, c] @ dS)
        t = dv[:, :, c] = Ag[:, :, c].transpose(-1, -2) @ dvn[:, :, c]
        dS = torch.exp(GL[:, :, c])[..., None, None] * dS + (scale * eG[:, :, c] * qc[:, :, c]).transpose(-1, -2) @ \
            doc[:, :, c] - (eG[:, :, c] * kc[:, :, c]).transpose(-1, -2) @ t
    ctab = chunk_table(cu)
    seq, j = ctab[:, 0].long(), ctab[:, 1].long()
    h_states = torch.stack(S_in, 1)[seq, j]  # [NC, HV, K, V]
    dh_states = torch.stack(dS_out, 1)[seq, j]
    tokens = [_from_chunks(x, index, T)[None] for x in (vres, dvn, dv)]
    return dict(h_states=h_states, dh_states=dh_states, vres=tokens[0], dvn=tokens[1], dv=tokens[2], dh0=dS,
                chunk_table=ctab)


@pytest.mark.parametrize("heads, v_heads, dim, batch", [(2, 4, 16, 2), (1, 1, 32, 200)])
def test_chunk_grads_equal_the_hand_written_backward(heads, v_heads, dim, batch):
    lengths = [1, 63, 64, 65, 130]
    cu = random_cu_seqlens(lengths)
    gen = torch.Generator().manual_seed(dim + v_heads)
    x = make_gdn_inputs(seq_len=sum(lengths), num_heads=heads, num_v_heads=v_heads, head_k_dim=dim,
                        head_v_dim=dim // 2, generator=gen)  # strong decay and g = 0 heads included
    n = len(lengths)
    h0 = torch.randn(n, v_heads, dim, dim // 2, generator=gen, dtype=torch.float64)
    dht = torch.randn(n, v_heads, dim, dim // 2, generator=gen, dtype=torch.float64)
    do = torch.randn(1, sum(lengths), v_heads, dim // 2, generator=gen, dtype=torch.float64)
    scale = dim**-0.5

    want = chunk_gated_delta_rule_bwd_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], do, scale=scale,
                                                initial_state=h0, dht=dht, cu_seqlens=cu)
    w = walks(x, do, h0, dht, cu, scale)
    gcum = chunk_local_cumsum(x["g"], cu)
    got = chunk_grads_from_states(x["q"], x["k"], do, w["vres"], w["dvn"], gcum, x["beta"], w["h_states"],
                                  w["dh_states"], cu, w["chunk_table"], scale, chunks_per_batch=batch)
    for name, a, b in zip(("dq", "dk", "dg", "dbeta"), got, (want[0], want[1], want[3], want[4])):
        assert a.shape == b.shape, name
        assert rel_err(a.to(b.dtype), b) < 1e-10, name


def test_wide_heads_backward_end_to_end_with_stand_in_walks():
    """The TileLang backward at K = V = 256 on the CPU, with WIDE_GRADS = "torch": the two walks
    replaced by torch stand-ins that write what the kernels write (from `walks`, float64, into
    the kernels' bf16 / fp32 buffers), the rest as on the GPU (buffer plumbing,
    `chunk_grads_from_states`). All six
    gradients against the hand-written backward, within the bf16 limits of the GPU checks."""
    from unittest import mock

    from flash_qla_cp.kernels import tilelang_bwd_impl

    lengths = [1, 63, 64, 65, 130]
    cu = random_cu_seqlens(lengths).to(torch.int32)
    gen = torch.Generator().manual_seed(3)
    x = make_gdn_inputs(seq_len=sum(lengths), num_heads=1, num_v_heads=2, head_k_dim=256, head_v_dim=256,
                        generator=gen)
    x = {n: (t.to(torch.bfloat16).double() if n in "qkv" else t) for n, t in x.items()}  # what bf16 sees
    n, T = len(lengths), sum(lengths)
    h0 = torch.randn(n, 2, 256, 256, generator=gen, dtype=torch.float64) * 0.1
    dht = torch.randn(n, 2, 256, 256, generator=gen, dtype=torch.float64) * 0.1
    do = torch.randn(1, T, 2, 256, generator=gen, dtype=torch.float64).to(torch.bfloat16).double()
    scale = 256**-0.5
    want = chunk_gated_delta_rule_bwd_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], do, scale=scale,
                                                initial_state=h0, dht=dht, cu_seqlens=cu)
    w = walks(x, do, h0, dht, cu, scale)
    gcum = chunk_local_cumsum(x["g"], cu)
    built = []

    def compile_kernel(factory, **params):
        built.append(factory.__name__)

        def prepare(k, g, beta, cu_, ctab, g_out, a_out):
            g_out.copy_(gcum)
            a_out.zero_()  # Ag: read by the walks only, which are stood in for

        def h_walk(k, v, ag, gc, cu_, offsets, order, h0_, h_out, vres_out):
            h_out.copy_(w["h_states"])
            vres_out.copy_(w["vres"])

        def dh_walk(q, k, do_, ag, gc, cu_, offsets, order, dht_, dh_out, dvn_out, dv_out, dh0_out):
            dh_out.copy_(w["dh_states"])
            dvn_out.copy_(w["dvn"])
            dv_out.copy_(w["dv"])
            dh0_out.copy_(w["dh0"])

        return {"build_prepare_kernel": prepare, "build_bwd_h_kernel": h_walk,
                "build_bwd_dh_kernel": dh_walk}[factory.__name__]

    bf = {n: (t.to(torch.bfloat16) if n in "qkv" else t.float()) for n, t in x.items()}
    with mock.patch.object(tilelang_bwd_impl, "compile_kernel", compile_kernel), \
            mock.patch.object(tilelang_bwd_impl, "WIDE_GRADS", "torch"), \
            mock.patch("flash_qla_cp.kernels.tilelang_fwd.compile_kernel", compile_kernel), \
            mock.patch.object(tilelang_bwd_impl.tilelang_common, "sm_count", lambda device: 132):
        got = tilelang_bwd_impl.tilelang_chunk_gated_delta_rule_bwd(
            do.to(torch.bfloat16), dht.float(), bf["q"], bf["k"], bf["v"], bf["g"], bf["beta"], scale, h0.float(),
            cu, None)
    assert built == ["build_prepare_kernel", "build_bwd_h_kernel", "build_bwd_dh_kernel"]
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_err(a.double(), b) < 1e-2, (name, rel_err(a.double(), b))
