"""Inter-card CP: ranks hold contiguous slices of the packed stream; one all_gather per direction.

Rank r's tokens split into a *head* (segment 0 when its sequence began on an earlier rank)
and a *tail* (every other segment; their initial states are the user's, known up front).

Forward: run the tail; publish S_out of the last segment if it goes on (a pass-through rank,
whose only segment is the head, publishes (h, M) from the state-only pass instead); one
all_gather; scan the predecessors for S_in; run the head with it.
Backward mirrors it with M^T: the head's dS_in (partial on pass-through ranks) travels in one
all_gather, a reverse scan gives dS_out of the last segment, then the remaining local
backward runs with the true cotangent. No gradient of M is needed: every token's gradient
comes from a local backward seeded with the true S_in and the true dS_out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import ops
from ..ops import put_tensors, take_tensors
from ..reference.chunked import compute_dtype
from .context import CPContext, CPError, comm_device
from .transition import segment_transitions


class OpEngine:
    """Local compute = the library op on one rank's segments (torch on CPU, TileLang on Hopper)."""

    def __init__(self, backend="auto", intra_cp="off", save_states=False, kernel_options=None):
        # save_states: the TileLang forward keeps its chunk states for `bwd` (only worth it when
        # a backward follows; see api.chunk_gated_delta_rule)
        self.backend, self.intra_cp, self.save_states = backend, intra_cp, save_states
        self.kernel_options = kernel_options

    def fwd(self, q, k, v, g, beta, scale, h0, cu_seqlens):
        return ops.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=scale, initial_state=h0,
                                              output_final_state=True, cu_seqlens=cu_seqlens, backend=self.backend,
                                              intra_cp=self.intra_cp, save_states=self.save_states,
                                              kernel_options=self.kernel_options)

    def bwd(self, do, dht, ctx):
        return ops.chunk_gated_delta_rule_bwd(do, dht, ctx)


@dataclass
class _Region:
    """A contiguous run of local segments computed by one local call."""

    start: int
    end: int
    seq_ids: list
    cu: torch.Tensor
    ctx: object = None


def _region(segments, lo, hi, device):
    segs = segments[lo:hi]
    if not segs:
        return None
    a = segs[0][0]
    cu = torch.tensor([0] + [e - a for _, e, _ in segs], dtype=torch.int32, device=device)
    return _Region(a, segs[-1][1], [n for _, _, n in segs], cu)


def _gather(payload: torch.Tensor, cp: CPContext) -> list:
    """all_gather on the group's device (gloo: CPU, even for CUDA payloads); results on payload's."""
    dev = comm_device(cp.group)
    mine = payload.to(dev).contiguous()
    got = [torch.empty_like(mine) for _ in range(cp.world)]
    dist.all_gather(got, mine, group=cp.group)
    return [t.to(payload.device) for t in got]


def _all_reduce(x: torch.Tensor, cp: CPContext) -> torch.Tensor:
    buf = x.to(comm_device(cp.group)).contiguous()
    dist.all_reduce(buf, group=cp.group)
    return buf.to(x.device)


def _exchange(cp: CPContext, build, *shape_and_dtype):
    """all_gather whatever `build()` makes; a failure on any rank is raised on every rank.

    The payload's last element is an error flag, so a rank that failed still takes part
    (with a payload of the agreed size) instead of leaving the others waiting. (Last, so each
    returned body starts where its buffer does: aligned for the kernels that read it.)
    """
    size, dtype, device = shape_and_dtype
    error = None
    try:
        body = build().reshape(-1).to(dtype)
        assert body.numel() == size
    except Exception as exc:  # re-raised below, after the collective
        error, body = exc, torch.zeros(size, dtype=dtype, device=device)
    flag = torch.tensor([0.0 if error is None else 1.0], dtype=dtype, device=device)
    got = _gather(torch.cat([body.to(device), flag]), cp) if cp.world > 1 else [torch.cat([body, flag])]
    flags = torch.stack([t[-1] for t in got]).tolist()  # one host sync
    failed = [r for r, f in enumerate(flags) if f != 0]
    if failed:
        msg = f"context-parallel GDN failed on rank(s) {failed}"
        if error is not None:
            raise CPError(f"{msg}: {error}") from error
        raise CPError(msg)
    return [t[:-1] for t in got]


def _scan_forward(cp, states, mats, HV, K, V):
    """S_in of this rank's head: compose the chain of pass-through predecessors."""
    lays = cp.layouts
    j = cp.rank - 1
    while lays[j].passes_through:
        j -= 1  # j publishes an S_out that does not depend on its own S_in
    S = states[j].view(HV, K, V)
    for i in range(j + 1, cp.rank):
        S = mats[i].view(HV, K, K) @ S + states[i].view(HV, K, V)
    return S


def _scan_backward(cp, dstates, mats, HV, K, V):
    """dS_out of this rank's last segment: dS_in of the next ranks, folded back through M^T."""
    lays = cp.layouts
    e = cp.rank + 1
    while lays[e].passes_through:
        e += 1  # e's dS_in is complete: its head ends inside e
    dS = dstates[e].view(HV, K, V)
    for i in range(e - 1, cp.rank, -1):
        dS = dstates[i].view(HV, K, V) + mats[i].view(HV, K, K).transpose(-1, -2) @ dS
    return dS


def _cut(x, region):
    return x[:, region.start : region.end]


class InterCP(torch.autograd.Function):
    """(q, k, v, g, beta, h0) local tensors -> (o local, final states [N_global] or None)."""

    @staticmethod
    def forward(fctx, q, k, v, g, beta, h0, cp: CPContext, engine, scale, output_final_state):
        lay = cp.layout
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        sdt = compute_dtype(q, k, v)
        dev = q.device
        N = cp.num_seqs_global
        h0_user = h0.to(sdt) if h0 is not None else torch.zeros(N, HV, K, V, dtype=sdt, device=dev)
        nh = 1 if lay.first_continues else 0
        head = _region(lay.segments, 0, nh, dev)
        tail = _region(lay.segments, nh, len(lay.segments), dev)
        xs = (q, k, v, g, beta)
        carry_M = cp.carries_transition
        outs, finals = {}, {}

        def run(region, S0):
            o, fin, region.ctx = engine.fwd(*(_cut(x, region) for x in xs), scale, S0.contiguous(), region.cu)
            outs[region.start] = o
            for i, n in enumerate(region.seq_ids):
                finals[n] = fin[i]

        def publish():
            S_out = torch.zeros(HV, K, V, dtype=sdt, device=dev)
            M = torch.zeros(HV, K, K, dtype=sdt, device=dev) if carry_M else None
            if tail is not None:
                run(tail, h0_user[tail.seq_ids])
                if lay.last_continues:
                    S_out = finals[tail.seq_ids[-1]]
            elif lay.passes_through:
                Ms, hs = segment_transitions(*(_cut(x, head) for x in (k, v, g, beta)), head.cu)
                M, S_out = Ms[0].to(sdt), hs[0].to(sdt)
                fctx.own_M = M
            return torch.cat([S_out.reshape(-1)] + ([M.reshape(-1)] if carry_M else []))

        fctx.own_M = None
        size = HV * K * V + (HV * K * K if carry_M else 0)
        got = _exchange(cp, publish, size, sdt, dev)
        if head is not None:
            states = [t[: HV * K * V] for t in got]
            mats = [t[HV * K * V :] for t in got] if carry_M else None
            S_in = _scan_forward(cp, states, mats, HV, K, V)
            run(head, S_in[None])
        o = torch.cat([outs[s] for s in sorted(outs)], dim=1)

        # final states of the sequences owned here (empty sequences keep their initial state)
        own = [finals[n] if n in finals else h0_user[n] for n in lay.owned]
        final = _gather_finals(cp, own, HV, K, V, sdt, dev) if output_final_state else None

        # saved the autograd way, the regions' local contexts too: an input modified in place before
        # the backward raises, and activation checkpointing drops and recomputes what they kept
        kept, fctx.kept_counts = [], []
        for region in (head, tail):
            if region is not None:
                region.ctx, tensors = take_tensors(region.ctx)
                kept += tensors
                fctx.kept_counts.append(len(tensors))
        fctx.save_for_backward(q, k, v, g, beta, h0, *kept)
        fctx.cp, fctx.engine, fctx.head, fctx.tail = cp, engine, head, tail
        fctx.shapes = (HV, K, V, sdt)
        fctx.has_h0 = h0 is not None
        fctx.h0_dtype = h0.dtype if h0 is not None else None
        fctx.output_final_state = output_final_state
        return o, final

    @staticmethod
    def backward(fctx, do, dfinal):
        kept = fctx.saved_tensors[6:]  # (reading them raises if an input was modified in place)
        cp, engine, head, tail = fctx.cp, fctx.engine, fctx.head, fctx.tail
        start = 0
        for region, count in zip([r for r in (head, tail) if r is not None], fctx.kept_counts):
            region.ctx = put_tensors(region.ctx, kept[start : start + count])
            start += count
        lay = cp.layout
        HV, K, V, sdt = fctx.shapes
        dev = do.device
        N = cp.num_seqs_global
        do = do.contiguous()
        # final_state is replicated on every rank: its gradient is the sum of all ranks' (as
        # for an all_gather); the sum is only needed for the rows owned here.
        if fctx.output_final_state and dfinal is not None:
            dfinal = dfinal.to(sdt).clone(memory_format=torch.contiguous_format)
            if cp.world > 1:
                dfinal = _all_reduce(dfinal, cp)
        else:
            dfinal = torch.zeros(N, HV, K, V, dtype=sdt, device=dev)
        owned = set(lay.owned)
        zero = torch.zeros(HV, K, V, dtype=sdt, device=dev)

        def local_dht(region, dS_out):
            rows = []
            for i, n in enumerate(region.seq_ids):
                last_here = i == len(region.seq_ids) - 1 and region.end == cp.local_len and lay.last_continues
                rows.append(dS_out if last_here else (dfinal[n] if n in owned else zero))
            return torch.stack(rows)

        grads = {}

        def run_bwd(region, dS_out):
            r = engine.bwd(_cut(do, region), local_dht(region, dS_out), region.ctx)
            grads[region.start] = r
            return r

        carry_M = cp.carries_transition

        def publish():
            dS_in = zero
            if head is not None:
                # complete unless the head passes through (then dS_out is still missing: use 0)
                dS_in = run_bwd(head, zero)[5][0].to(sdt)
            parts = [dS_in.reshape(-1)]
            if carry_M:
                M = fctx.own_M if fctx.own_M is not None else torch.zeros(HV, K, K, dtype=sdt, device=dev)
                parts.append(M.reshape(-1))
            return torch.cat(parts)

        size = HV * K * V + (HV * K * K if carry_M else 0)
        got = _exchange(cp, publish, size, sdt, dev)
        dS_out = zero
        if lay.last_continues:
            dstates = [t[: HV * K * V] for t in got]
            mats = [t[HV * K * V :] for t in got] if carry_M else None
            dS_out = _scan_backward(cp, dstates, mats, HV, K, V)
        if tail is not None:
            run_bwd(tail, dS_out)
        elif lay.passes_through:
            run_bwd(head, dS_out)  # now with the true dS_out; replaces the partial pass

        parts = [grads[s] for s in sorted(grads)]
        dq, dk, dv, dg, dbeta = (torch.cat([p[i] for p in parts], dim=1) for i in range(5))
        dh0 = None
        if fctx.has_h0:
            # each rank returns the rows of sequences that start here; summing over ranks gives all
            dh0 = torch.zeros(N, HV, K, V, dtype=sdt, device=dev)
            if tail is not None:
                dh0[tail.seq_ids] = grads[tail.start][5].to(sdt)
            for n in lay.owned:
                if cp.cu_seqlens_global[n] == cp.cu_seqlens_global[n + 1]:
                    dh0[n] = dfinal[n]
            dh0 = dh0.to(fctx.h0_dtype)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None


def _gather_finals(cp, own, HV, K, V, sdt, dev):
    """Every rank gets all N_global final states: all_gather of the owned rows, padded to the max."""
    counts = [len(lay.owned) for lay in cp.layouts]
    width = max(counts)
    block = torch.zeros(width, HV, K, V, dtype=sdt, device=dev)
    if own:
        block[: len(own)] = torch.stack(own)
    got = _gather(block, cp) if cp.world > 1 else [block]
    return torch.cat([t[:c] for t, c in zip(got, counts)]).contiguous()
