"""The Gated DeltaNet layer of Qwen3-Next as an nn.Module, on top of `chunk_gated_delta_rule`.

Parameters use the Hugging Face `linear_attn` names and shapes, so its state_dict loads unchanged
and round-trips. proj_layout='qwen3_next' (Qwen3-Next):

    in_proj_qkvz.weight [2*H*dk + 2*HV*dv, D]   rows grouped per key head: (q_h, k_h, v_group_h, z_group_h)
    in_proj_ba.weight   [2*HV, D]               rows grouped per key head: (b_group_h, a_group_h)

proj_layout='qwen3_5' (Qwen3.5): in_proj_qkv [2*H*dk + HV*dv, D] (all q, all k, all v), in_proj_z
[HV*dv, D], in_proj_b and in_proj_a [HV, D]. Both layouts share:

    conv1d.weight       [C, 1, K]               C = 2*H*dk + HV*dv, channels (q, k, v), heads flattened
    dt_bias, A_log      [HV]
    norm.weight         [dv]
    out_proj.weight     [D, HV*dv]

A "group" is the r = HV / H value heads that read key head h (v head index h*r + j).

Two paths. Training-style calls (dense or packed, no padding mask; eager or compiled), a prompt's
prefill and decoding (a cache out without a backward: `fused_mixer_with_states`; single tokens on
the TileLang backend) run fused: the projections into one row per token (`_projection_rows`),
then `fused_mixer` (conv, l2 norm and gates in one step, the op, the gated norm in another) and
out_proj; a cache's conv state enters as rows in front of each sequence (`history_rows.py`);
under context parallelism the two steps are autograd nodes around the CP op (`fused_cp_steps.py`,
the conv halo exchanged inside). Padding masks, a cache out with a backward to come and single
tokens on the torch backend take the step path: the projections split, `short_conv`, `_gates`,
`_core`, the norm, each a torch op (under CP: `short_conv` exchanges the halo, `_core` takes
`cp_context`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..api import chunk_gated_delta_rule
from ..backends import choose_backend
from ..ops import backward_will_run
from ..parallel.conv_halo import exchange_conv_halo
from ..reference.chunked import compute_dtype
from ..reference.layer_steps import ProjectionLayout, continued_positions, layout_columns, token_positions
from ..reference.shapes import expand_qk_heads, l2norm
from ..validation import check_cu_seqlens_values, is_intra_option
from .fused_cp_steps import GatedNorm, LayerInputs
from .fused_mixer import MixerConfig, fused_mixer, fused_mixer_with_states
from .hf_params import gdn_from_qwen3_next
from .history_rows import HistoryRows
from .norm import GatedRMSNorm
from .offsets_read_back import OffsetsReadBack
from .projection_op import projection_rows
from .short_conv import ShortConvolution, last_kept_inputs


def _fail(message: str):
    raise ValueError(f"GatedDeltaNet: {message}")


def _check_padding_mask(mask: torch.Tensor) -> bool:
    """A padding mask holds only 0 / 1 and, per row, one run of ones (left or right padding, or
    both): a hole in the middle would feed the conv zeros where the dropped tokens were, which
    is not the sequence without them. Returns whether it keeps every token. One host sync."""
    binary = (mask == 0) | (mask == 1)
    m = mask.to(torch.int64)
    starts = m[:, :1] + (m[:, 1:] > m[:, :-1]).sum(1, keepdim=True)  # runs of ones per row
    bad_values, holes, keeps_all = torch.stack(
        [(~binary).any(), (binary.all() & (starts > 1).any()), (mask == 1).all()]).tolist()
    if bad_values:
        _fail("attention_mask must hold only 0 (padding) and 1 (token)")
    if holes:
        _fail("attention_mask must mark one run of tokens per row (left or right padding); for several "
              "sequences in a row pack them with cu_seqlens instead")
    return bool(keeps_all)


def _projection_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of a linear projection of x: autocast's where it is on (a bf16 model trained from
    fp32 weights and residuals), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


@dataclass
class GDNCache:
    """Decode state of one layer for N sequences.

    conv_state: [N, C, K-1], the last K-1 inputs of the short conv (before the conv), in the model dtype.
    recurrent_state: [N, HV, dk, dv] fp32 (float64 for a float64 model).
    seen_tokens: tokens consumed so far per call chain (informational).
    """

    conv_state: torch.Tensor
    recurrent_state: torch.Tensor
    seen_tokens: int = 0


def recurrent_step(q, k, v, g, beta, scale, initial_state=None):
    """One token (T == 1) of the gated delta rule, q/k l2-normalised here. Cheaper than a 64-token chunk
    for decoding. Shapes as the op; returns (o [B, 1, HV, V] in v's dtype, state [B, HV, K, V])."""
    dtype = compute_dtype(v)
    HV = v.shape[2]
    qt = expand_qk_heads(l2norm(q), HV)[:, 0].to(dtype)
    kt = expand_qk_heads(l2norm(k), HV)[:, 0].to(dtype)
    vt = v[:, 0].to(dtype)
    B, _, K = qt.shape
    S = initial_state.to(dtype) if initial_state is not None else qt.new_zeros(B, HV, K, vt.shape[-1])
    S = S * g[:, 0].to(dtype).exp()[..., None, None]
    err = vt - torch.einsum("bhkv,bhk->bhv", S, kt)
    S = S + beta[:, 0].to(dtype)[..., None, None] * kt[..., None] * err[..., None, :]
    o = scale * torch.einsum("bhkv,bhk->bhv", S, qt)
    return o[:, None].to(v.dtype), S


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (Qwen3-Next `linear_attn` layout).

    Args:
        hidden_size: model width D.
        num_heads: q/k heads H.
        num_v_heads: value heads HV (a multiple of H; defaults to H). HV > H is GVA.
        head_k_dim, head_v_dim: per-head q/k and v widths.
        conv_size: short conv kernel K (>= 2).
        allow_neg_eigval: beta in (0, 2) instead of (0, 1).
        norm_eps: eps of the gated RMSNorm.
        layer_idx: this layer's index (used by caches).
        backend: passed to `chunk_gated_delta_rule` ('auto', 'torch', 'tilelang').
        intra_cp: the op's intra-card split when no cp_context is given ('auto' by default:
            long sequences split inside the TileLang kernels; 'off'; or
            partitions per sequence).
        proj_layout: 'qwen3_next' (grouped in_proj_qkvz / in_proj_ba) or 'qwen3_5' (separate
            in_proj_qkv / in_proj_z / in_proj_b / in_proj_a); the math is the same.
        save_states: True: the forward keeps for the backward the op's inputs (q, k, g, beta, and
            v where the op's backward reads it) and, on the TileLang backend, its chunk states
            (`chunk_gated_delta_rule`'s save_states), faster; False: the backward recomputes them,
            less memory held between forward and backward.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_v_heads: int | None = None,
        head_k_dim: int = 128,
        head_v_dim: int = 128,
        conv_size: int = 4,
        allow_neg_eigval: bool = False,
        norm_eps: float = 1e-6,
        layer_idx: int | None = None,
        backend: str = "auto",
        proj_layout: str = "qwen3_next",
        intra_cp="auto",
        save_states: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        for name, val in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_v_heads", num_v_heads),
                          ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
            if not isinstance(val, int) or val <= 0:
                _fail(f"{name} must be a positive int, got {val!r}")
        if num_v_heads % num_heads != 0:
            _fail(f"num_v_heads ({num_v_heads}) must be a multiple of num_heads ({num_heads})")
        if not isinstance(conv_size, int) or conv_size < 2:
            _fail(f"conv_size must be an int >= 2, got {conv_size!r}")
        if backend not in ("auto", "torch", "tilelang"):
            _fail(f"backend must be 'auto', 'torch' or 'tilelang', got {backend!r}")
        if not is_intra_option(intra_cp):
            _fail(f"intra_cp must be 'auto', 'off' or a positive int, got {intra_cp!r}")
        if proj_layout not in ("qwen3_next", "qwen3_5"):
            _fail(f"proj_layout must be 'qwen3_next' or 'qwen3_5', got {proj_layout!r}")
        if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not 0 <= norm_eps < math.inf:
            _fail(f"norm_eps must be a finite number >= 0, got {norm_eps!r}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.conv_size = conv_size
        self.allow_neg_eigval = allow_neg_eigval
        self.norm_eps = norm_eps
        self.layer_idx = layer_idx
        self.backend = backend
        self.intra_cp = intra_cp
        self.save_states = bool(save_states)
        self.proj_layout = proj_layout
        self.key_dim = num_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim

        layouts = {"qwen3_next": ProjectionLayout.qwen3_next, "qwen3_5": ProjectionLayout.qwen3_5}
        self.projection_layout = layouts[proj_layout](num_heads, num_v_heads, head_k_dim, head_v_dim)

        factory = dict(device=device, dtype=dtype)
        if proj_layout == "qwen3_next":
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False, **factory)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False, **factory)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False, **factory)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False, **factory)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False, **factory)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False, **factory)
        self.conv1d = ShortConvolution(self.conv_dim, conv_size, bias=False, activation="silu", **factory)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, **factory))
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **factory))
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps, **factory)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **factory)
        self._reset_gate_parameters()

    def _reset_gate_parameters(self):
        """A in [1, 16]; dt in [1e-3, 0.1] log-uniformly, stored as softplus^-1(dt) (Mamba-style)."""
        if self.A_log.is_meta:
            return
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(1, 16).log())
            lo, hi = math.log(1e-3), math.log(1e-1)
            dt = torch.exp(torch.rand(self.num_v_heads, device=self.dt_bias.device) * (hi - lo) + lo).clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        # optimizers that honour this flag keep weight decay off the gates
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_v_heads={self.num_v_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, conv_size={self.conv_size}, "
                f"allow_neg_eigval={self.allow_neg_eigval}, layer_idx={self.layer_idx}, backend={self.backend!r}, "
                f"proj_layout={self.proj_layout!r}")

    # ---- construction from Hugging Face -------------------------------------------------------

    @classmethod
    def from_qwen3_next(cls, hf_layer_or_config, state_dict=None, backend: str = "auto", **overrides):
        """Build from a transformers `Qwen3NextGatedDeltaNet` / `Qwen3_5GatedDeltaNet` (parameters shared,
        not copied) or from its config (+ optional `linear_attn` state_dict, loaded unchanged). The
        projection layout follows the layer / state_dict / config (`hf_params.py`)."""
        return gdn_from_qwen3_next(cls, hf_layer_or_config, state_dict=state_dict, backend=backend, **overrides)

    from_hf = from_qwen3_next  # same for Qwen3.5 layers and configs

    # ---- pieces of the forward ------------------------------------------------------------------

    def _project(self, x):
        """x [B, T, D] -> mixed qkv [B, T, C] (conv input), z [B, T, HV, dv], b, a [B, T, HV]."""
        B, T, _ = x.shape
        if self.proj_layout == "qwen3_5":
            z = self.in_proj_z(x).view(B, T, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        H, r, dk, dv = self.num_heads, self.num_v_heads // self.num_heads, self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(B, T, H, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        ba = self.in_proj_ba(x).view(B, T, H, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        return mixed, z.reshape(B, T, self.num_v_heads, dv), b.reshape(B, T, -1), a.reshape(B, T, -1)

    def _gates(self, b, a):
        """beta = sigmoid(b) (x2 with allow_neg_eigval); g = -exp(A_log) softplus(a + dt_bias); both >= fp32."""
        dtype = torch.promote_types(a.dtype, torch.float32)
        g = -self.A_log.to(dtype).exp() * F.softplus(a.to(dtype) + self.dt_bias.to(dtype))
        beta = b.to(dtype).sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        return g, beta

    def short_conv(self, mixed, cu_seqlens=None, conv_state=None, output_final_state=False, cp_context=None):
        """Causal depthwise conv + SiLU over [B, T, C] -> (y, new conv state or None).

        Under CP, `mixed` is this rank's slice: the conv runs on the local pieces of the sequences,
        the first one continued by the previous rank's last K-1 inputs (the halo; zeros when that
        sequence starts here)."""
        if cp_context is None:
            return self.conv1d(mixed, cu_seqlens=cu_seqlens, conv_state=conv_state,
                               output_final_state=output_final_state)
        halo = exchange_conv_halo(mixed, cp_context, self.conv_size)  # [1, K-1, C]
        local_cu = cp_context.local_cu_seqlens(mixed.device)
        state = halo.transpose(1, 2)
        others = local_cu.numel() - 2  # local pieces after the first start fresh
        if others > 0:
            state = torch.cat([state, state.new_zeros(others, *state.shape[1:])])
        y, _ = self.conv1d(mixed, cu_seqlens=local_cu, conv_state=state)
        return y, None

    def _core(self, q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
              cp_context=None, cu_seqlens_cpu=None):
        """The gated delta rule (q, k l2-normalised inside). CP seam: `cp_context` goes to the op."""
        if initial_state is not None:
            initial_state = initial_state.to(compute_dtype(v))
        if cp_context is None and cu_seqlens is None and q.shape[1] == 1:
            o, state = recurrent_step(q, k, v, g, beta, self.head_k_dim**-0.5, initial_state)
            return o, (state if output_final_state else None)
        extra = ({"intra_cp": self.intra_cp, "cu_seqlens_cpu": cu_seqlens_cpu} if cp_context is None
                 else {"cp_context": cp_context})
        return chunk_gated_delta_rule(
            q, k, v, g, beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens,
            backend=self.backend,
            save_states=self.save_states,
            **extra,
        )

    def _projection_weight(self):
        """The input projections as one weight (rows in `self.projection_layout`'s order): one matmul."""
        return torch.cat([p.weight for p in self._projections()])

    def _projections(self):
        if self.proj_layout == "qwen3_next":
            return (self.in_proj_qkvz, self.in_proj_ba)
        return (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def _projection_rows(self, x):
        """P [B, T, width]: the input projections' outputs, one row per token in `projection_layout`.
        One matmul on the weights put together; where the call has fewer tokens than the layer
        has hidden units (decoding), a matmul per projection and their outputs put together, which
        copies less than the weights."""
        if x.shape[0] * x.shape[1] >= self.hidden_size:
            if torch.compiler.is_compiling():  # P with the strides the fused op takes (projection_op.py)
                dtype = _projection_dtype(x)
                return projection_rows(x.to(dtype), self._projection_weight().to(dtype))
            return F.linear(x, self._projection_weight())
        return torch.cat([F.linear(x, p.weight) for p in self._projections()], dim=-1)

    def _fused_backend(self, x, attention_mask, conv_state, output_final_state, cp_context):
        """The op backend for the fused layer, or None where this call takes the step path: padding
        masks; states out (use_cache) unless it is inference without CP or compilation (a prompt's
        prefill, decoding); on the torch backend its own intra-card split (partitions asked for)
        and single tokens (its one-token recurrence costs less there than a chunk of the chunked
        op); under torch.compile also a cache in (its rows are planned on the host), single tokens
        and CP. Under torch.compile the backend is chosen inside the fused layer's custom op."""
        if attention_mask is not None:
            return None
        if output_final_state and (cp_context is not None or torch.compiler.is_compiling()
                                   or backward_will_run(x, *self.parameters())):
            return None
        split_asked = cp_context is None and self.intra_cp not in ("auto", "off")
        single_token = x.shape[1] == 1
        if torch.compiler.is_compiling():
            steps = split_asked or cp_context is not None or conv_state is not None or single_token
            return None if steps else self.backend
        dtype = _projection_dtype(x)  # what the kernels will read: the projection's output
        backend = choose_backend(self.backend, x.new_empty(0, self.head_k_dim, dtype=dtype),
                                 x.new_empty(0, self.head_v_dim, dtype=dtype))
        return None if backend == "torch" and (split_asked or single_token) else backend

    def _mixer_config(self, backend) -> MixerConfig:
        return MixerConfig(self.projection_layout, self.allow_neg_eigval, self.norm_eps, self.head_k_dim**-0.5,
                           backend, self.intra_cp, self.save_states)

    def _fused_cp_mix(self, x, cu_seqlens, recurrent_state, cp_context, backend):
        """The fused steps around the CP op (`fused_cp_steps.py`): this rank's slice x [1, T, D]."""
        P = self._projection_rows(x)
        T = x.shape[1]
        positions = token_positions(1, T, cp_context.local_cu_seqlens(x.device), x.device)
        if cp_context.first_continues:  # its conv reads the previous rank's last inputs
            first, end, _ = cp_context.layout.segments[0]
            positions = continued_positions(positions, end - first, self.conv_size - 1)
        config = self._mixer_config(backend)
        q, k, v, g, beta, z = LayerInputs.apply(P, self.conv1d.weight, self.A_log, self.dt_bias, positions, config,
                                                cp_context)
        if recurrent_state is not None:
            recurrent_state = recurrent_state.to(compute_dtype(x))
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=config.scale, initial_state=recurrent_state,
                                      cu_seqlens=cu_seqlens, backend=self.backend, save_states=self.save_states,
                                      cp_context=cp_context)
        return self.out_proj(GatedNorm.apply(o, z, self.norm.weight, config))

    def _fused_mix(self, x, cu_seqlens, offsets, conv_state, recurrent_state, backend, output_final_state=False,
                   conv_inputs=False):
        """_mix's results on the fused layer: the states only with output_final_state, the conv inputs
        (a gather of P's conv columns) only where asked for. A cache's conv state goes in as rows in
        front of each sequence (`history_rows.py`). offsets: cu_seqlens' read-back (`_check`), waited
        for once the projection is launched."""
        P = self._projection_rows(x)
        B, T, _ = P.shape
        cu_host = self._host_offsets(offsets, T)
        mixed = P[..., layout_columns(self.projection_layout, "conv", P.device)] if conv_inputs else None
        rows = None
        if conv_state is not None:
            rows = HistoryRows.of(B, T, cu_seqlens, cu_host, self.conv_size - 1, P.device)
            P = rows.extend(P, conv_state, self.projection_layout)
            cu_seqlens, cu_host = rows.cu_seqlens, rows.cu_seqlens_cpu
        config = self._mixer_config(backend)
        if recurrent_state is not None:
            recurrent_state = recurrent_state.to(compute_dtype(x))
        args = (P, self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight, config, recurrent_state,
                cu_seqlens, cu_host)
        positions = rows.positions if rows is not None else None
        final = new_conv_state = None
        if output_final_state:
            y, final, new_conv_state = fused_mixer_with_states(
                *args, positions=positions, last_rows=rows.last_rows if rows is not None else None)
        else:
            y = fused_mixer(*args, positions=positions)
        if rows is not None:
            y = rows.drop(y, B, T)
        return self.out_proj(y), new_conv_state, final, mixed

    def _output(self, o, z):
        B, T = o.shape[:2]
        return self.out_proj(self.norm(o, z).reshape(B, T, self.value_dim))

    # ---- input checks --------------------------------------------------------------------------

    def _check(self, x, attention_mask, cu_seqlens, conv_state, recurrent_state) -> tuple:
        """Validate the forward's inputs; return the number of sequences N, whether an
        attention_mask keeps every token (False without one, or when compiling), and cu_seqlens'
        read-back to the host (an `OffsetsReadBack`; None without cu_seqlens, or when compiling):
        the layer's one read of the offsets, checked by `_host_offsets` where the call first needs
        them, and then taken by the op instead of reading cu_seqlens back again."""
        keeps_all = False
        offsets = None
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            _fail(f"hidden_states must be a 3-D tensor [B, T, hidden_size={self.hidden_size}], got {got}")
        B, T, D = x.shape
        if B == 0:
            _fail(f"hidden_states has batch size 0 ({tuple(x.shape)})")
        if D != self.hidden_size:
            _fail(f"hidden_states last dim is {D}, but the layer was built with hidden_size={self.hidden_size}")
        if not x.is_floating_point():
            _fail(f"hidden_states must be floating point, got {x.dtype}")
        weight = self.out_proj.weight
        if x.device != weight.device:
            _fail(f"hidden_states is on {x.device}, the layer's parameters on {weight.device}")
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            _fail(f"hidden_states is {x.dtype}, the layer's parameters {weight.dtype}: cast one to the other "
                  f"(e.g. layer.to({x.dtype})) or run under torch.autocast")
        if attention_mask is not None:
            if cu_seqlens is not None:
                _fail("pass either attention_mask (padding) or cu_seqlens (packing), not both")
            if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, T):
                got = (tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
                       else type(attention_mask).__name__)
                _fail(f"attention_mask must be a [B, T] = {(B, T)} padding mask (1 = keep), got {got}")
            if not torch.compiler.is_compiling():  # (values: a host read, which a traced call cannot make)
                keeps_all = _check_padding_mask(attention_mask)
        N = B
        if cu_seqlens is not None:
            if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64) \
                    or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
                _fail("cu_seqlens must be a 1-D int32/int64 tensor [N+1]")
            if B != 1:
                _fail(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={B}")
            N = cu_seqlens.numel() - 1
            if not torch.compiler.is_compiling():  # (values: a host read, which a traced call cannot make)
                if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
                    # (a replay would keep the plan made from the captured values, whatever cu_seqlens holds then)
                    _fail("a packed call (cu_seqlens) cannot be captured in a CUDA graph: the call is planned "
                          "from cu_seqlens' values on the host; capture dense batches, or call the op "
                          "chunk_gated_delta_rule with cu_seqlens_cpu")
                offsets = OffsetsReadBack.of(cu_seqlens)
        if conv_state is not None:
            W = self.conv_size - 1
            if conv_state.dim() != 3 or conv_state.shape[0] != N or conv_state.shape[1] != self.conv_dim \
                    or conv_state.shape[2] < W:
                _fail(f"conv_state must be [N={N}, C={self.conv_dim}, >= {W}], got {tuple(conv_state.shape)}")
        if recurrent_state is not None:
            want = (N, self.num_v_heads, self.head_k_dim, self.head_v_dim)
            if tuple(recurrent_state.shape) != want:
                _fail(f"recurrent state must be [N, HV, dk, dv] = {want}, got {tuple(recurrent_state.shape)}")
        for name, state in (("conv_state", conv_state), ("recurrent state", recurrent_state)):
            if state is not None and (not state.is_floating_point() or state.device != x.device):
                _fail(f"{name} must be floating point on hidden_states' device {x.device}, "
                      f"got {state.dtype} on {state.device}")
        return N, keeps_all, offsets

    @staticmethod
    def _host_offsets(offsets, T: int):
        """The host copy of cu_seqlens once it has arrived (None without one), its values checked."""
        if offsets is None:
            return None
        cu_host = offsets.result()
        check_cu_seqlens_values(cu_host.tolist(), T)
        return cu_host

    # ---- forward -------------------------------------------------------------------------------

    def _mix(self, hidden_states, attention_mask=None, cu_seqlens=None, conv_state=None, recurrent_state=None,
             output_final_state=False, cp_context=None, conv_inputs=False):
        """The layer. Returns (output [B, T, D], new conv state, new recurrent state, conv input [B, T, C]);
        the fused path returns the conv input only with conv_inputs (it is a gather from P there), and
        the states only with output_final_state."""
        num_seqs = hidden_states.shape[0] if isinstance(hidden_states, torch.Tensor) else 0
        offsets = None
        if cp_context is None:
            num_seqs, keeps_all, offsets = self._check(hidden_states, attention_mask, cu_seqlens, conv_state,
                                                       recurrent_state)
            if keeps_all:  # a mask without padding changes nothing: the call can run fused
                attention_mask = None
        else:
            # the op checks cu_seqlens and the state against the global batch the plan was built for
            self._check(hidden_states, None, None, None, None)
            if attention_mask is not None or conv_state is not None or output_final_state:
                _fail("under context parallelism pass packed sequences (cu_seqlens); attention_mask, "
                      "cache and use_cache are not supported")
        B, T, _ = hidden_states.shape
        if T == 0:  # nothing to mix: an empty output, the states handed on unchanged
            self._host_offsets(offsets, T)
            return self._empty_call(hidden_states, num_seqs, conv_state, recurrent_state, output_final_state)
        fused = self._fused_backend(hidden_states, attention_mask, conv_state, output_final_state, cp_context)
        if fused is not None and cp_context is not None:
            return self._fused_cp_mix(hidden_states, cu_seqlens, recurrent_state, cp_context, fused), None, None, None
        if fused is not None:
            return self._fused_mix(hidden_states, cu_seqlens, offsets, conv_state, recurrent_state, fused,
                                   output_final_state, conv_inputs)
        cu_host = self._host_offsets(offsets, T)
        keep = None
        if attention_mask is not None:
            # padded tokens: zero input (nothing leaks through the conv), g = beta = 0 (the state passes
            # through untouched), zero output; selected, not multiplied, so that NaN in padding stays there
            keep = attention_mask.to(device=hidden_states.device, dtype=torch.bool)
            hidden_states = torch.where(keep[..., None], hidden_states, 0.0)
        mixed, z, b, a = self._project(hidden_states)
        g, beta = self._gates(b, a)
        if keep is not None:
            g = torch.where(keep[..., None], g, 0.0)
            beta = torch.where(keep[..., None], beta, 0.0)

        conv_out, new_conv_state = self.short_conv(mixed, cu_seqlens, conv_state, output_final_state, cp_context)
        if keep is not None and output_final_state:
            # right padding: the history to carry is the last real inputs, not the trailing pad zeros
            new_conv_state = last_kept_inputs(mixed, keep, self.conv_size - 1, conv_state)
        B, T, _ = conv_out.shape
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)

        o, new_state = self._core(q, k, v, g, beta, recurrent_state, output_final_state, cu_seqlens, cp_context,
                                  cu_host)
        if keep is not None:
            o = torch.where(keep[..., None, None], o, 0.0)
        return self._output(o, z), new_conv_state, new_state, mixed

    def _empty_call(self, x, num_seqs, conv_state, recurrent_state, output_final_state):
        """_mix's results for T = 0 tokens (num_seqs sequences, all empty)."""
        B = x.shape[0]
        out = x.new_zeros(B, 0, self.hidden_size)
        mixed = x.new_zeros(B, 0, self.conv_dim)
        if not output_final_state:
            return out, None, None, mixed
        state_dtype = compute_dtype(x)
        if conv_state is None:
            conv_state = x.new_zeros(num_seqs, self.conv_dim, self.conv_size - 1)
        if recurrent_state is None:
            recurrent_state = torch.zeros(num_seqs, self.num_v_heads, self.head_k_dim, self.head_v_dim, dtype=state_dtype,
                                          device=x.device)
        return out, conv_state, recurrent_state, mixed

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: GDNCache | None = None,
        use_cache: bool = False,
        initial_state: torch.Tensor | GDNCache | None = None,
        cp_context=None,
    ):
        """hidden_states [B, T, D] -> output [B, T, D], or (output, GDNCache) with use_cache=True.

        attention_mask: [B, T] padding mask, 1 = real token. Padded tokens are skipped: they do not
            reach the conv window of later tokens nor the state, and their output is 0. Works for left
            and right padding (left padding keeps the cache usable for decoding).
        cu_seqlens: [N+1] offsets of sequences packed along T (B == 1); the conv does not cross them.
            Read back to the host once per tensor while it is unchanged (torch's in-place ops change
            it; a tensor whose memory something else writes must be passed as a new tensor).
        cache: state from a previous call (use_cache=True) to continue N sequences.
        initial_state: [N, HV, dk, dv] recurrent state only (conv history taken as zeros), or a GDNCache.
        cp_context: context-parallel plan, passed to the core op (and the conv seam) when given.
        """
        if isinstance(initial_state, GDNCache):
            if cache is not None:
                _fail("pass the previous state either as cache or as initial_state, not both")
            cache, initial_state = initial_state, None
        if cache is not None and initial_state is not None:
            _fail("pass the previous state either as cache or as initial_state, not both")
        if cache is not None and not isinstance(cache, GDNCache):
            _fail(f"cache must be a GDNCache (from a call with use_cache=True), got {type(cache).__name__}")
        conv_state = cache.conv_state if cache is not None else None
        recurrent_state = cache.recurrent_state if cache is not None else initial_state
        out, new_conv, new_state, _ = self._mix(
            hidden_states, attention_mask, cu_seqlens, conv_state, recurrent_state, use_cache, cp_context
        )
        if not use_cache:
            return out
        seen = (cache.seen_tokens if cache is not None else 0) + hidden_states.shape[1]
        return out, GDNCache(new_conv, new_state, seen)
