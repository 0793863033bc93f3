"""A small hybrid language model: Gated DeltaNet blocks with (optionally) every k-th block softmax attention.

Each block is ``x + mixer(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``; the mixer is
`flash_qla_cp.GatedDeltaNet` or, for every ``attn_every``-th block
(Qwen3-Next's pattern: blocks attn_every-1, 2*attn_every-1, ...), causal softmax attention with
RoPE through torch SDPA. The embedding and the LM head are tied.

Inputs are packed: ``input_ids`` [1, T] holds several documents delimited by ``cu_seqlens``.
Attention never crosses a document edge (one SDPA call per document) and RoPE positions restart
at each document.

Context parallel: pass ``cp_context`` (a `flash_qla_cp.CPContext`) and this rank's
contiguous slice of the global packed row. The GDN blocks hand the context to the module;
attention blocks all-gather K and V over the CP group (differentiably: the backward sums the
key/value gradients over the group and keeps this rank's slice) and attend this rank's queries
to the keys of their documents up to this rank's last token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from flash_qla_cp import GatedDeltaNet

__all__ = ["HybridLMConfig", "HybridLM", "TokenLayout", "RMSNorm", "CausalSelfAttention", "SwiGLU", "training_flops"]


@dataclass
class HybridLMConfig:
    vocab_size: int = 258
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2
    num_v_heads: int | None = None  # GDN value heads (GVA); default num_heads
    head_k_dim: int | None = None  # default hidden_size // num_heads
    head_v_dim: int | None = None  # default head_k_dim
    attn_every: int = 0  # 0: no attention blocks; k: blocks k-1, 2k-1, ... are softmax attention
    attn_heads: int | None = None  # default num_heads
    intermediate_size: int | None = None  # SwiGLU width; default ~8/3 * hidden, multiple of 32
    conv_size: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    gdn_kwargs: dict = field(default_factory=dict)  # extra keyword arguments for GatedDeltaNet

    def __post_init__(self):
        self.num_v_heads = self.num_v_heads or self.num_heads
        self.head_k_dim = self.head_k_dim or self.hidden_size // self.num_heads
        self.head_v_dim = self.head_v_dim or self.head_k_dim
        self.attn_heads = self.attn_heads or self.num_heads
        if self.intermediate_size is None:
            self.intermediate_size = 32 * math.ceil(self.hidden_size * 8 / 3 / 32)
        if self.hidden_size % self.attn_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of attn_heads {self.attn_heads}")

    def is_attention(self, layer: int) -> bool:
        return self.attn_every > 0 and (layer + 1) % self.attn_every == 0


@dataclass
class TokenLayout:
    """Where this rank's tokens sit in the packed global row.

    cu_seqlens_global: document offsets of the global row (python ints).
    starts: the first global token of every CP rank, plus the row length at the end
    (rank r holds [starts[r], starts[r + 1])). rank/group: this rank in the CP group.
    """

    cu_seqlens_global: list[int]
    starts: list[int]
    rank: int = 0
    group: object = None

    @property
    def start(self) -> int:
        return self.starts[self.rank]

    @property
    def end(self) -> int:
        return self.starts[self.rank + 1]

    @property
    def size(self) -> int:
        return len(self.starts) - 1

    def local_cu_seqlens(self) -> list[int]:
        """Document offsets of this rank's slice, relative to its first token."""
        s, e = self.start, self.end
        return [0] + [c - s for c in self.cu_seqlens_global if s < c < e] + [e - s]

    def local_positions(self) -> torch.Tensor:
        """Position of each local token inside its document (RoPE positions)."""
        s, e = self.start, self.end
        pos = torch.empty(e - s, dtype=torch.int64)
        cu = self.cu_seqlens_global
        for a, b in zip(cu[:-1], cu[1:]):
            lo, hi = max(a, s), min(b, e)
            if lo < hi:
                pos[lo - s : hi - s] = torch.arange(lo - a, hi - a)
        return pos


def layout_from_cu_seqlens(cu_seqlens, length: int) -> TokenLayout:
    cu = [0, length] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    return TokenLayout(cu, [0, length], 0, None)


def cp_context_layout(ctx) -> TokenLayout:
    """Read the rank layout from a `flash_qla_cp.CPContext` (equal contiguous slices)."""
    cu = [int(c) for c in ctx.cu_seqlens_global]
    L = ctx.seq_len_global // ctx.world
    return TokenLayout(cu, [r * L for r in range(ctx.world + 1)], int(ctx.rank), ctx.group)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # in fp32 whatever x's dtype; torch's rms_norm is one fused kernel each way on CUDA (a
        # hand-written one ran ~6 and saved an fp32 copy of its output for the backward)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, device, dtype=torch.float32):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    ang = positions.to(device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x: [B, T, H, D]; cos/sin: [T, D/2] (rotate-half convention)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class _GatherSequence(torch.autograd.Function):
    """All-gather [B, T_r, ...] slices of unequal T_r over a group along dim 1; backward sums the
    gradient over the group and returns this rank's slice."""

    @staticmethod
    def forward(ctx, x, group, sizes, rank):
        import torch.distributed as dist

        ctx.group, ctx.sizes, ctx.rank = group, sizes, rank
        tmax = max(sizes)
        pad = x.new_zeros(x.shape[0], tmax, *x.shape[2:])
        pad[:, : x.shape[1]] = x
        bufs = [torch.empty_like(pad) for _ in sizes]
        dist.all_gather(bufs, pad.contiguous(), group=group)
        return torch.cat([b[:, :n] for b, n in zip(bufs, sizes)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        lo = sum(ctx.sizes[: ctx.rank])
        return grad[:, lo : lo + ctx.sizes[ctx.rank]].contiguous(), None, None, None


def gather_sequence(x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    sizes = [b - a for a, b in zip(layout.starts[:-1], layout.starts[1:])]
    return _GatherSequence.apply(x, layout.group, sizes, layout.rank)


class CausalSelfAttention(nn.Module):
    """Multi-head causal softmax attention with RoPE, document-local (varlen) and CP-aware."""

    def __init__(self, hidden: int, heads: int, rope_theta: float = 10000.0):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.rope_theta = rope_theta
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, layout: TokenLayout, positions: torch.Tensor):
        from torch.nn.attention.bias import causal_lower_right

        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).unbind(2)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        s, e = layout.start, layout.end
        if layout.size > 1:
            kv = gather_sequence(torch.stack((k, v), dim=2), layout)  # [B, T_global, 2, H, Dh]
            k_all, v_all = kv.unbind(2)
        else:
            k_all, v_all = k, v
        outs = []
        cu = layout.cu_seqlens_global
        for a, b in zip(cu[:-1], cu[1:]):
            lo, hi = max(a, s), min(b, e)
            if lo >= hi:
                continue
            qd = q[:, lo - s : hi - s].transpose(1, 2)
            if layout.size > 1:
                kd, vd = k_all[:, a:hi].transpose(1, 2), v_all[:, a:hi].transpose(1, 2)
            else:
                kd, vd = k[:, lo - s : hi - s].transpose(1, 2), v[:, lo - s : hi - s].transpose(1, 2)
            if kd.shape[2] == qd.shape[2]:
                od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
            else:
                od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=causal_lower_right(qd.shape[2], kd.shape[2]))
            outs.append(od.transpose(1, 2))
        o = torch.cat(outs, dim=1).reshape(B, T, D)
        return self.o(o)


class Block(nn.Module):
    def __init__(self, cfg: HybridLMConfig, layer: int):
        super().__init__()
        self.is_attention = cfg.is_attention(layer)
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if self.is_attention:
            self.mixer = CausalSelfAttention(cfg.hidden_size, cfg.attn_heads, cfg.rope_theta)
        else:
            self.mixer = GatedDeltaNet(
                hidden_size=cfg.hidden_size,
                num_heads=cfg.num_heads,
                num_v_heads=cfg.num_v_heads,
                head_k_dim=cfg.head_k_dim,
                head_v_dim=cfg.head_v_dim,
                conv_size=cfg.conv_size,
                **cfg.gdn_kwargs,
            )
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, layout, positions, cu_seqlens_local, cp_context):
        h = self.norm1(x)
        if self.is_attention:
            h = self.mixer(h, layout, positions)
        else:
            h = self.mixer(h, cu_seqlens=cu_seqlens_local, cp_context=cp_context)
            if isinstance(h, tuple):
                h = h[0]
        x = x + h
        return x + self.mlp(self.norm2(x))


class HybridLM(nn.Module):
    def __init__(self, cfg: HybridLMConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        # activation checkpointing: keep only each block's input, recompute the block in the
        # backward (memory per token falls roughly by the number of blocks; ~1/3 more compute)
        self.checkpoint_blocks = False
        self._init_weights()

    def _init_weights(self):
        std = self.config.init_std
        nn.init.normal_(self.embed.weight, std=std)
        scaled = std / math.sqrt(2 * self.config.num_layers)
        for block in self.blocks:
            mods = [block.mlp]
            if block.is_attention:
                mods.append(block.mixer)
            for m in mods:  # the GDN module initialises its own parameters
                for name, p in m.named_parameters():
                    nn.init.normal_(p, std=scaled if name.startswith(("o.", "down.")) else std)

    @property
    def lm_head_weight(self):
        return self.embed.weight

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cp_context=None) -> torch.Tensor:
        """input_ids [1, T] (this rank's slice under CP) -> logits [1, T, vocab] (fp32).

        Without CP, `cu_seqlens` [N + 1] delimits the packed documents (None: one document).
        Under CP, `cp_context` describes the global row and this rank's slice; `cu_seqlens` is
        ignored (the local offsets are derived from the context).
        """
        if input_ids.dim() != 2 or (input_ids.shape[0] != 1 and (cu_seqlens is not None or cp_context is not None)):
            raise ValueError(f"HybridLM: packed input must be [1, T], got {tuple(input_ids.shape)}")
        T = input_ids.shape[1]
        if cp_context is not None:
            layout = cp_context_layout(cp_context)
            if layout.end - layout.start != T:
                raise ValueError(f"HybridLM: cp_context gives this rank {layout.end - layout.start} tokens, input has {T}")
            cu_local = None
        else:
            layout = layout_from_cu_seqlens(cu_seqlens, T)
            cu_local = cu_seqlens
        if cu_local is not None:
            cu_local = cu_local.to(device=input_ids.device, dtype=torch.int32)
        positions = layout.local_positions()
        x = self.embed(input_ids)
        for block in self.blocks:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                # non-reentrant: the recompute replays the CP collectives in the same order on every rank
                x = torch.utils.checkpoint.checkpoint(block, x, layout, positions, cu_local, cp_context,
                                                      use_reentrant=False)
            else:
                x = block(x, layout, positions, cu_local, cp_context)
        x = self.norm(x)
        return F.linear(x, self.lm_head_weight).float()


GDN_CHUNK = 64  # the chunk of the op's chunked form (flash_qla_cp.constants.CHUNK)


def training_flops(model: HybridLM, doc_lengths) -> float:
    """Model FLOPs of one training step (forward and backward: 3 x the forward) over packed documents
    of `doc_lengths` tokens, counting what the model computes, not what is re-run by checkpointing:

    - every weight matmul: 2 FLOPs per weight element per token (the tied LM head included, the
      embedding lookup not); the short conv likewise;
    - the GDN core in its chunked form, per token and value head (C = 64): 6 K V for the state
      (its read by q and k, its update), 2 C (2 K + V) + 2 C^2 inside the chunk (q k^T, the UT
      transform, P v);
    - causal attention: 2 x 2 x hidden per (query, key) pair of a document (L (L + 1) / 2 pairs).
    """
    cfg = model.config
    tokens = sum(doc_lengths)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d)))
    weights += model.lm_head_weight.numel()
    forward = 2 * weights * tokens
    C = GDN_CHUNK
    for block in model.blocks:
        if block.is_attention:
            forward += 4 * cfg.hidden_size * sum(n * (n + 1) // 2 for n in doc_lengths)
        else:
            gdn = block.mixer
            K, V = gdn.head_k_dim, gdn.head_v_dim
            forward += tokens * gdn.num_v_heads * (6 * K * V + 2 * C * (2 * K + V) + 2 * C * C)
    return 3.0 * forward
