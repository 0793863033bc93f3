"""Intra-card CP: cut long sequences into partitions run side by side as extra varlen sequences.

Each partition p > 0 of a sequence gets its incoming state in one of two ways:
  * exact: the state-only pass gives (h_p, M_p) of the previous partitions; a short scan
    S_in(p) = M_{p-1} S_in(p-1) + h_{p-1} gives the true state; the partition is then run
    (batched with the others) from it.
  * warm-up shortcut: if the summed log decay over the W chunks before the partition is
    below `threshold` for every head, the state carried in from before that window is
    damped by at least exp(threshold) (||I - beta k k^T|| <= 1 for unit k and beta in
    [0, 2]), so the partition starts from zero W chunks early and drops the warm-up
    outputs. This is an approximation, taken only when asked for (`exact=False`). A g = 0 head never
    qualifies, so such batches stay exact.
Partitions 0 (user initial state) and warm-up ones are final after one batched pass ("A");
exact ones run in a second batched pass ("B") once the scan is done.
Backward uses the same plan: pass B with the local cotangent gives each exact partition's
dS_in, a reverse scan with M^T gives the true dS_out, then A and B run backward with it.

Why this is not the TileLang split's policy (`kernels/split.py`): the TileLang kernels compute
each partition's (h, M) and the scan on the GPU and walk every partition once, so the split
costs a few chunks per cut and is planned to fill the SMs. Here the op runs around the cuts:
an exact partition is run twice (state-only pass, then from its true state), so the cost model
(`cost_model.py`) weighs that rerun, and the shortcut is a whole-partition approximation tested
over a window for every head at once (hence its own, opt-out threshold).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constants import CHUNK
from ..reference.chunked import GATE_FLOOR, compute_dtype
from .cost_model import plan_partitions, sm_count
from .transition import segment_transitions

FIRST, WARM, EXACT = "first", "warm", "exact"


@dataclass
class Partition:
    seq: int  # local sequence index
    start: int  # first token whose output this partition produces
    end: int
    run_from: int  # first token fed to the kernel (< start for warm-up)
    mode: str


@dataclass
class IntraPlan:
    partitions: list  # in sequence order, then position
    num_seqs: int
    empty_seqs: list

    @property
    def is_trivial(self) -> bool:
        return all(p.mode == FIRST for p in self.partitions)


def build_plan(cu_edges, g, num_heads, intra_cp="auto", exact=True, threshold=-10.0, window=2,
               sms=None, chunk=CHUNK) -> IntraPlan:
    """Cut sequences at chunk boundaries (cost model or forced count) and pick each cut's mode."""
    lengths = [b - a for a, b in zip(cu_edges, cu_edges[1:])]
    chunks = [-(-n // chunk) for n in lengths]
    sms = sms if sms is not None else sm_count(g.device)
    counts = plan_partitions(chunks, num_heads, sms, intra_cp=intra_cp).partitions
    cuts = []  # (seq, start, end)
    for n, (a, c, p) in enumerate(zip(cu_edges, chunks, counts)):
        if c == 0:
            continue
        bounds = [a + min(lengths[n], (c * i // p) * chunk) for i in range(p + 1)]
        cuts += [(n, s, e) for s, e in zip(bounds, bounds[1:]) if e > s]
    # decay over each look-back window, for all windows at once (one host sync)
    starts = [s for n, s, e in cuts if s != cu_edges[n]]
    use_warm = [False] * len(starts)
    if starts and not exact:
        lo = torch.tensor([max(cu_edges[n], s - window * chunk) for n, s, e in cuts if s != cu_edges[n]])
        hi = torch.tensor(starts)
        g64 = g[0].to(torch.float64).clamp(min=GATE_FLOOR)  # a -inf gate (a reset) counts as a strong decay
        csum = torch.cat([g64.new_zeros(1, g64.shape[-1]), g64.cumsum(0)])
        decay = csum[hi.to(g.device)] - csum[lo.to(g.device)]  # [cuts, HV]
        full = (hi - lo == window * chunk).to(g.device)
        use_warm = ((decay.max(-1).values < threshold) & full).tolist()
    parts, i = [], 0
    for n, s, e in cuts:
        if s == cu_edges[n]:
            parts.append(Partition(n, s, e, s, FIRST))
        else:
            warm = use_warm[i]
            i += 1
            parts.append(Partition(n, s, e, s - window * chunk if warm else s, WARM if warm else EXACT))
    empty = [n for n, c in enumerate(chunks) if c == 0]
    return IntraPlan(parts, len(lengths), empty)


def _index(parts, device):
    """Token index of the batched run, cu_seqlens of it, and which rows are real outputs."""
    idx, cu, keep = [], [0], []
    for p in parts:
        idx.append(torch.arange(p.run_from, p.end))
        keep.append(torch.arange(p.start, p.end) - p.run_from + cu[-1])
        cu.append(cu[-1] + p.end - p.run_from)
    idx = torch.cat(idx).to(device)
    keep = torch.cat(keep).to(device)
    return idx, torch.tensor(cu, dtype=torch.int32, device=device), keep


class _Run:
    """One batched local call over a set of partitions."""

    def __init__(self, parts, device):
        self.parts = parts
        self.idx, self.cu, self.keep = _index(parts, device)
        self.out_idx = self.idx[self.keep]  # global token of every kept row
        self.ctx = None

    def take(self, x):
        return x.index_select(1, self.idx)


class IntraEngine:
    """Local engine (same fwd/bwd contract as inter.OpEngine) that splits sequences on one card."""

    def __init__(self, base, intra_cp="auto", exact=True, threshold=-10.0, window=2, sms=None):
        self.base, self.intra_cp, self.exact = base, intra_cp, exact
        self.threshold, self.window, self.sms = threshold, window, sms

    def fwd(self, q, k, v, g, beta, scale, h0, cu_seqlens):
        edges = cu_seqlens.tolist()
        plan = build_plan(edges, g, v.shape[2], self.intra_cp, self.exact, self.threshold, self.window, self.sms)
        if plan.is_trivial:
            o, fin, ctx = self.base.fwd(q, k, v, g, beta, scale, h0, cu_seqlens)
            return o, fin, ("whole", ctx)
        dev, sdt = q.device, compute_dtype(q, k, v)
        xs = (q, k, v, g, beta)
        parts = plan.partitions
        pos = {id(p): i for i, p in enumerate(parts)}
        a_parts = [p for p in parts if p.mode != EXACT]
        e_parts = [p for p in parts if p.mode == EXACT]
        S_out = [None] * len(parts)  # state leaving each partition
        o = torch.zeros_like(v)

        run_a = _Run(a_parts, dev)
        h0_a = torch.stack([h0[p.seq] if p.mode == FIRST else torch.zeros_like(h0[0]) for p in a_parts])
        o_a, fin_a, run_a.ctx = self.base.fwd(*(run_a.take(x) for x in xs), scale, h0_a.contiguous(), run_a.cu)
        o.index_copy_(1, run_a.out_idx, o_a.index_select(1, run_a.keep))
        for i, p in enumerate(a_parts):
            S_out[pos[id(p)]] = fin_a[i].to(sdt)

        M = {}
        run_b = None
        if e_parts:
            # (h, M) only where the next partition is exact too: a chain link
            links = [p for p in e_parts if pos[id(p)] + 1 < len(parts) and parts[pos[id(p)] + 1].mode == EXACT]
            if links:
                run_t = _Run(links, dev)
                Ms, hs = segment_transitions(*(run_t.take(x) for x in (k, v, g, beta)), run_t.cu)
                for i, p in enumerate(links):
                    M[pos[id(p)]] = Ms[i].to(sdt)
                    S_out[pos[id(p)]] = hs[i].to(sdt)  # still missing M @ S_in; added in the scan
            S_in = []
            for p in e_parts:  # in order: a chain's predecessors are finished first
                j = pos[id(p)]
                s = S_out[j - 1]
                S_in.append(s)
                if j in M:
                    S_out[j] = M[j] @ s + S_out[j]
            run_b = _Run(e_parts, dev)
            o_b, fin_b, run_b.ctx = self.base.fwd(*(run_b.take(x) for x in xs), scale,
                                                  torch.stack(S_in).to(h0.dtype).contiguous(), run_b.cu)
            o.index_copy_(1, run_b.out_idx, o_b)
            for i, p in enumerate(e_parts):
                S_out[pos[id(p)]] = fin_b[i].to(sdt)

        last = {}
        for i, p in enumerate(parts):
            last[p.seq] = i
        finals = torch.stack([S_out[last[n]] if n in last else h0[n].to(sdt) for n in range(plan.num_seqs)])
        return o, finals.to(h0.dtype), ("split", plan, run_a, run_b, M, [x.shape for x in xs], [x.dtype for x in xs])

    def bwd(self, do, dht, ctx):
        if ctx[0] == "whole":
            return self.base.bwd(do, dht, ctx[1])
        _, plan, run_a, run_b, M, shapes, dtypes = ctx
        parts = plan.partitions
        pos = {id(p): i for i, p in enumerate(parts)}
        sdt = dht.dtype
        grads = [torch.zeros(s, dtype=d, device=do.device) for s, d in zip(shapes, dtypes)]
        dh0 = torch.zeros_like(dht)
        is_last = [i + 1 == len(parts) or parts[i + 1].seq != p.seq for i, p in enumerate(parts)]
        zero = torch.zeros_like(dht[0])

        def local_dout(i):
            return dht[parts[i].seq] if is_last[i] else zero

        dS_in = [None] * len(parts)
        if run_b is not None:
            e_idx = [pos[id(p)] for p in run_b.parts]
            do_b = do.index_select(1, run_b.idx)
            chained = any(i in M for i in e_idx)
            first = self.base.bwd(do_b, torch.stack([local_dout(i) for i in e_idx]), run_b.ctx)
            for r, i in enumerate(e_idx):
                dS_in[i] = first[5][r].to(sdt)
            for i in reversed(e_idx):  # fold the chain back: dS_in(i) += M_i^T dS_in(i + 1)
                if i in M:
                    dS_in[i] = dS_in[i] + M[i].transpose(-1, -2) @ dS_in[i + 1]

        def dout(i):
            nxt = i + 1
            if nxt < len(parts) and parts[nxt].mode == EXACT and parts[nxt].seq == parts[i].seq:
                return dS_in[nxt]
            return local_dout(i)

        if run_b is not None:
            res = self.base.bwd(do_b, torch.stack([dout(i) for i in e_idx]), run_b.ctx) if chained else first
            for gr, r in zip(grads, res[:5]):
                gr.index_add_(1, run_b.idx, r)

        a_idx = [pos[id(p)] for p in run_a.parts]
        do_a = torch.zeros(1, run_a.idx.numel(), *do.shape[2:], dtype=do.dtype, device=do.device)
        do_a.index_copy_(1, run_a.keep, do.index_select(1, run_a.out_idx))
        res = self.base.bwd(do_a, torch.stack([dout(i) for i in a_idx]).to(sdt), run_a.ctx)
        for gr, r in zip(grads, res[:5]):
            gr.index_add_(1, run_a.idx, r)
        for r, i in enumerate(a_idx):
            if parts[i].mode == FIRST:
                dh0[parts[i].seq] = res[5][r]
        for n in plan.empty_seqs:
            dh0[n] = dht[n]
        return (*grads, dh0)
