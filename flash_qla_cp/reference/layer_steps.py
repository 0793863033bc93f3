"""Torch forms of the GatedDeltaNet layer's steps around the op, each with a hand-written backward
(no autograd graph: they also run inside the fused layer's autograd.Function, `modules/fused_mixer.py`).

The layer's projections write one row per token, P [NT, width] (`ProjectionLayout` says where each
part lives in a row). Two steps take it to the op and back:

- `op_inputs_forward`: causal short conv + SiLU over the q, k, v channels, q and k l2-normalised per
  head, g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) (x2 with allow_neg_eigval).
- `gated_norm_forward`: the op's output o through rmsnorm(o) * weight * silu(z), z read from P.

These are the CPU path of the fused layer and the oracles of its Hopper kernels
(`kernels/hopper/layer_inputs*.py`, `gated_norm*.py`), which compute in the same order: every value
in fp32 (float64 for a float64 model) from the stored inputs, rounded once when written.

Packed sequences are described per token by `positions` (int [NT]: the token's index inside its
sequence): a conv tap t - s exists when positions[t] >= s, and t + s lies in the same sequence when
positions[t + s] == positions[t] + s. `history` [K - 1, C] (optional) holds the conv inputs before
the first token, read where the first sequence's positions count from K - 1 (context parallelism:
the previous rank's last inputs, `continued_positions`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .chunked import compute_dtype

L2NORM_EPS = 1e-6  # the op's use_qk_l2norm_in_kernel eps (shapes.l2norm)


@dataclass(frozen=True)
class ProjectionLayout:
    """Where the parts of one token's projection row live. With H key heads of width dk, r = HV / H
    value heads per key head of width dv: column of q head h, element d = q_offset + h * q_head_stride + d
    (k the same); of v head h * r + j, element d = v_offset + h * v_head_stride + j * dv + d (z the same);
    of b for v head h * r + j: b_offset + h * b_head_stride + j (a the same)."""

    width: int
    num_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    q_offset: int
    q_head_stride: int
    k_offset: int
    k_head_stride: int
    v_offset: int
    v_head_stride: int
    z_offset: int
    z_head_stride: int
    b_offset: int
    b_head_stride: int
    a_offset: int
    a_head_stride: int

    @classmethod
    def qwen3_next(cls, H, HV, dk, dv):
        """[in_proj_qkvz; in_proj_ba]: per key head (q, k, v group, z group), then per key head (b group, a group)."""
        r = HV // H
        per_head = 2 * dk + 2 * r * dv
        ba = H * per_head
        return cls(ba + 2 * HV, H, HV, dk, dv, 0, per_head, dk, per_head, 2 * dk, per_head, 2 * dk + r * dv, per_head,
                   ba, 2 * r, ba + r, 2 * r)

    @classmethod
    def qwen3_5(cls, H, HV, dk, dv):
        """[in_proj_qkv; in_proj_z; in_proj_b; in_proj_a]: all q, all k, all v, all z, all b, all a."""
        r = HV // H
        key, value = H * dk, HV * dv
        z = 2 * key + value
        b = z + value
        return cls(b + 2 * HV, H, HV, dk, dv, 0, dk, key, dk, 2 * key, r * dv, z, r * dv, b, r, b + HV, r)

    def z_only(self) -> "ProjectionLayout":
        """The layout of z alone, [NT, HV * dv] by v-head (the gated norm's view of a copied z)."""
        r, dv = self.group, self.head_v_dim
        return ProjectionLayout(self.num_v_heads * dv, self.num_heads, self.num_v_heads, self.head_k_dim, dv,
                                0, 0, 0, 0, 0, 0, 0, r * dv, 0, 0, 0, 0)

    @property
    def group(self) -> int:
        return self.num_v_heads // self.num_heads

    def _value_columns(self, offset, head_stride, width):
        h = torch.arange(self.num_heads)[:, None, None]
        j = torch.arange(self.group)[None, :, None]
        d = torch.arange(width)[None, None, :]
        return (offset + h * head_stride + j * width + d).reshape(-1)

    def conv_columns(self) -> torch.Tensor:
        """Columns of the conv's channels (all q, all k, all v: the order of conv1d.weight)."""
        h = torch.arange(self.num_heads)[:, None]
        d = torch.arange(self.head_k_dim)[None, :]
        q = (self.q_offset + h * self.q_head_stride + d).reshape(-1)
        k = (self.k_offset + h * self.k_head_stride + d).reshape(-1)
        v = self._value_columns(self.v_offset, self.v_head_stride, self.head_v_dim)
        return torch.cat([q, k, v])

    def z_columns(self) -> torch.Tensor:
        return self._value_columns(self.z_offset, self.z_head_stride, self.head_v_dim)

    def z_block(self, rows: torch.Tensor) -> torch.Tensor:
        """The z columns of contiguous rows [NT, width] as a view [NT, H, group * dv] (by v-head)."""
        NT = rows.shape[0]
        return rows.as_strided((NT, self.num_heads, self.group * self.head_v_dim), (self.width, self.z_head_stride, 1),
                               rows.storage_offset() + self.z_offset)

    def b_columns(self) -> torch.Tensor:
        return self._value_columns(self.b_offset, self.b_head_stride, 1)

    def a_columns(self) -> torch.Tensor:
        return self._value_columns(self.a_offset, self.a_head_stride, 1)


@functools.lru_cache(maxsize=None)
def layout_columns(layout: ProjectionLayout, part: str, device: torch.device) -> torch.Tensor:
    """`layout`'s columns of a part ('conv', 'z', 'a' or 'b') as an index tensor on `device`, made once:
    a host-to-device copy waits for the GPU's queue, so a layer call should not make one."""
    return getattr(layout, f"{part}_columns")().to(device)


def token_positions(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """int32 [batch * seq_len]: each token's index inside its sequence (rows of a batch, or the
    sequences packed by cu_seqlens)."""
    if cu_seqlens is None:
        return torch.arange(seq_len, device=device, dtype=torch.int32).repeat(batch)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=batch * seq_len)
    return (torch.arange(batch * seq_len, device=device) - starts).to(torch.int32)


def continued_positions(positions: torch.Tensor, first_length: int, width: int) -> torch.Tensor:
    """`positions` with the first sequence's `first_length` tokens counted from `width`
    (= conv_size - 1): it continues a sequence whose last `width` conv inputs are the history."""
    shifted = positions.clone()
    shifted[:first_length] += width
    return shifted


def _with_history(x, positions, history):
    """x, positions with the history rows in front (counted 0 .. W - 1)."""
    if history is None:
        return x, positions
    W = history.shape[0]
    return torch.cat([history.to(x.dtype), x]), torch.cat([torch.arange(W, device=x.device, dtype=positions.dtype),
                                                           positions])


def _shifted(x: torch.Tensor, s: int, positions: torch.Tensor) -> torch.Tensor:
    """x[t - s] where token t - s is in t's sequence, else 0 (x [NT, C])."""
    if s == 0:
        return x
    out = torch.zeros_like(x)
    out[s:] = x[:-s]
    return out * (positions >= s)[:, None]


def _ahead(x: torch.Tensor, s: int, positions: torch.Tensor) -> torch.Tensor:
    """x[t + s] where token t + s is in t's sequence, else 0 (the transpose of `_shifted`)."""
    if s == 0:
        return x
    out = torch.zeros_like(x)
    same = positions[s:] == positions[:-s] + s
    out[:-s] = x[s:] * same[:, None]
    return out


def _conv(x, weight, positions):
    """Pre-activation causal depthwise conv: y[t] = sum_i weight[:, i] x[t - (K-1) + i] (x [NT, C] in the compute dtype)."""
    K = weight.shape[1]
    y = torch.zeros_like(x)
    for i in range(K):
        y = y + weight[:, i] * _shifted(x, K - 1 - i, positions)
    return y


def _silu_grad(y):
    s = torch.sigmoid(y)
    return s * (1 + y * (1 - s))


def _l2norm_backward(s, dn, eps=L2NORM_EPS):
    """Gradient through n = s / sqrt(sum(s^2) + eps) over the last dim."""
    r = torch.rsqrt(s.pow(2).sum(-1, keepdim=True) + eps)
    return r * dn - s * r.pow(3) * (s * dn).sum(-1, keepdim=True)


def _split_heads(layout, x, NT):
    key = layout.num_heads * layout.head_k_dim
    q, k, v = x.split([key, key, layout.num_v_heads * layout.head_v_dim], dim=-1)
    return (q.reshape(NT, layout.num_heads, layout.head_k_dim), k.reshape(NT, layout.num_heads, layout.head_k_dim),
            v.reshape(NT, layout.num_v_heads, layout.head_v_dim))


def _conv_inputs(P, layout, conv_weight, positions, history, dtype):
    """(conv columns of P, the conv's inputs x with the history rows in front, their positions, the
    weight [C, K]), in the compute dtype: what the step's forward and backward both convolve."""
    cols = layout_columns(layout, "conv", P.device)
    x, pos = _with_history(P[:, cols].to(dtype), positions, history)
    return cols, x, pos, conv_weight.reshape(x.shape[1], -1).to(dtype)


def _gate_inputs(P, layout, dtype):
    """(a columns, b columns, a, b): where P holds the gates' inputs, and those inputs in the compute dtype."""
    a_cols, b_cols = layout_columns(layout, "a", P.device), layout_columns(layout, "b", P.device)
    return a_cols, b_cols, P[:, a_cols].to(dtype), P[:, b_cols].to(dtype)


def op_inputs_forward(P, layout: ProjectionLayout, conv_weight, A_log, dt_bias, positions, allow_neg_eigval=False,
                      history=None):
    """P [NT, width] -> q, k [NT, H, dk] (l2-normalised), v [NT, HV, dv] in P's
    dtype; g, beta [NT, HV] in the compute dtype (fp32, or float64 for float64 P)."""
    dtype = compute_dtype(P)
    NT = P.shape[0]
    _, x, pos, w = _conv_inputs(P, layout, conv_weight, positions, history, dtype)
    y = F.silu(_conv(x, w, pos)[x.shape[0] - NT :])
    q, k, v = _split_heads(layout, y, NT)
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
    _, _, a, b = _gate_inputs(P, layout, dtype)
    g = -A_log.to(dtype).exp() * F.softplus(a + dt_bias.to(dtype))
    beta = torch.sigmoid(b) * _beta_scale(allow_neg_eigval)
    return q.to(P.dtype), k.to(P.dtype), v.to(P.dtype), g, beta


def _beta_scale(allow_neg_eigval) -> float:
    return 2.0 if allow_neg_eigval else 1.0


def op_inputs_backward(dq, dk, dv, dg, dbeta, dz, P, layout: ProjectionLayout, conv_weight, A_log, dt_bias,
                       positions, allow_neg_eigval, dP, history=None):
    """Gradients of `op_inputs_forward`: writes the q, k, v, b, a columns of dP [NT, width] (P's
    dtype), and the gated norm's dz [NT, HV, dv] into its z columns (every column of dP written);
    returns (d conv_weight, d A_log, d dt_bias, d history or None) in the inputs' dtypes.
    dq, dk [NT, H, dk], or [NT, HV, dk]: per-v-head parts, summed over each qk-head's v-heads."""
    dtype = compute_dtype(P)
    NT, H = P.shape[0], layout.num_heads
    dq, dk = (d.reshape(NT, H, -1, d.shape[-1]).to(dtype).sum(2) for d in (dq, dk))
    cols, x, pos, w = _conv_inputs(P, layout, conv_weight, positions, history, dtype)
    W = x.shape[0] - NT  # history rows in front
    y = _conv(x, w, pos)[W:]
    s = F.silu(y)
    sq, sk, _ = _split_heads(layout, s, NT)
    dsq = _l2norm_backward(sq, dq.to(dtype))
    dsk = _l2norm_backward(sk, dk.to(dtype))
    ds = torch.cat([dsq.reshape(NT, -1), dsk.reshape(NT, -1), dv.reshape(NT, -1).to(dtype)], dim=-1)
    dy = torch.cat([ds.new_zeros(W, ds.shape[1]), ds * _silu_grad(y)])  # no outputs at the history rows
    K = w.shape[1]
    dx = torch.zeros_like(dy)
    dw = torch.empty_like(w)
    for i in range(K):
        dx = dx + w[:, i] * _ahead(dy, K - 1 - i, pos)
        dw[:, i] = (dy * _shifted(x, K - 1 - i, pos)).sum(0)
    dP[:, cols] = dx[W:].to(dP.dtype)
    dhistory = dx[:W].to(history.dtype) if history is not None else None

    a_cols, b_cols, a, b = _gate_inputs(P, layout, dtype)
    dg, dbeta = dg.to(dtype), dbeta.to(dtype)
    A = A_log.to(dtype).exp()
    pre = a + dt_bias.to(dtype)
    da = -A * torch.sigmoid(pre) * dg  # d softplus = sigmoid
    dA_log = (dg * (-A * F.softplus(pre))).sum(0)  # dg/dA_log = g
    sb = torch.sigmoid(b)
    db = dbeta * _beta_scale(allow_neg_eigval) * sb * (1 - sb)
    dP[:, a_cols] = da.to(dP.dtype)
    dP[:, b_cols] = db.to(dP.dtype)
    dP[:, layout_columns(layout, "z", P.device)] = dz.reshape(NT, -1).to(dP.dtype)
    return (dw.reshape(conv_weight.shape).to(conv_weight.dtype), dA_log.to(A_log.dtype), da.sum(0).to(dt_bias.dtype),
            dhistory)


def gated_norm_forward(o, P, layout: ProjectionLayout, weight, eps):
    """o [NT, HV, dv] -> rmsnorm(o) * weight * silu(z) as [NT, HV * dv] in o's dtype."""
    dtype = compute_dtype(o)
    NT = o.shape[0]
    z = P[:, layout_columns(layout, "z", P.device)].reshape(o.shape).to(dtype)
    of = o.to(dtype)
    n = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (n * weight.to(dtype) * F.silu(z)).to(o.dtype).reshape(NT, -1)


def gated_norm_backward(dy, o, P, layout: ProjectionLayout, weight, eps):
    """Gradients of `gated_norm_forward`: (do [NT, HV, dv] in o's dtype, dz [NT, HV, dv] in P's dtype
    (by v-head; `ProjectionLayout.z_block` places it in P's layout), d weight in its dtype)."""
    dtype = compute_dtype(o)
    zc = layout_columns(layout, "z", P.device)
    z = P[:, zc].reshape(o.shape).to(dtype)
    of = o.to(dtype)
    dyf = dy.reshape(o.shape).to(dtype)
    r = torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    n = of * r
    w = weight.to(dtype)
    gate = F.silu(z)
    dz = dyf * n * w * _silu_grad(z)
    dn = dyf * gate * w
    dweight = (dyf * gate * n).sum((0, 1))
    do = r * (dn - n * (dn * n).mean(-1, keepdim=True))
    return do.to(o.dtype), dz.to(P.dtype), dweight.to(weight.dtype)
