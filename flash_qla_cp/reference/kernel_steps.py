"""Torch forms of single kernel steps, the oracles the kernels' CPU and GPU tests compare with:
the prepare kernel's G and Ag, the v-head sum, and the intra-card split's warm-up tables.
"""

from __future__ import annotations

import torch

from ..constants import CHUNK, WARMUP_LOG_DECAY


def torch_prepare(k, g, beta, cu_seqlens):
    """G and Ag of the prepare kernel in torch (packed [1, T] inputs, float64 inside)."""
    Tn, H = k.shape[1], k.shape[2]
    HV = g.shape[2]
    grp = HV // H
    C = CHUNK
    G = torch.zeros(1, Tn, HV, dtype=torch.float32, device=k.device)
    Ag = torch.zeros(1, Tn, HV, C, dtype=k.dtype, device=k.device)
    edges = cu_seqlens.tolist()
    for n in range(len(edges) - 1):
        for t0 in range(edges[n], edges[n + 1], C):
            L = min(edges[n + 1] - t0, C)
            kc = k[0, t0 : t0 + L].double().repeat_interleave(grp, dim=1).transpose(0, 1)  # [HV, L, K]
            gc = g[0, t0 : t0 + L].double().cumsum(0).transpose(0, 1)  # [HV, L]
            bc = beta[0, t0 : t0 + L].double().transpose(0, 1)
            lm = torch.tril(bc[..., None] * (kc @ kc.transpose(-1, -2)), -1)
            eye = torch.eye(L, dtype=torch.float64, device=k.device)
            m = torch.linalg.solve_triangular(eye + lm, eye.expand_as(lm), upper=False, unitriangular=True)
            ag = torch.tril(m * torch.exp(gc[..., :, None] - gc[..., None, :])) * bc[..., None, :]
            G[0, t0 : t0 + L] = gc.transpose(0, 1).float()
            Ag[0, t0 : t0 + L, :, :L] = ag.transpose(0, 1).to(k.dtype)
    return G, Ag


def sum_v_head_parts(parts, out):
    """out[..., h, :] = sum over j of parts[..., h, j, :], rounded once to out's dtype: the torch
    form of `kernels/hopper/v_head_sum.py` (its reference; the GPU backward runs the kernel).

    The bf16 / fp16 parts are added in fp32 in v-head order and rounded once, exactly as torch.sum
    does, so the result is bitwise the same. (On the H200 at TP1 1 x 32k torch.sum over the
    size-2 dimension took 0.27 ms per tensor and an add of the two strided halves 0.18 ms; the
    kernel reads each token's parts contiguously.)
    """
    acc = parts[..., 0, :].float()
    for j in range(1, parts.shape[-2]):
        acc.add_(parts[..., j, :])
    out.copy_(acc)


def partition_chunk_ends(part_cu: list) -> dict:
    """Chunk bookkeeping of the partitions, chunks numbered as in `host_chunk_table`: per chunk
    the token row ending it ('chunk_last_row') and the number of its partition's last chunk
    ('chunk_part_last') and first chunk ('chunk_part_first'); per partition its first and last
    chunk ('part_first', 'part_last'; 0 for an empty partition) and whether it has any
    ('part_nonempty'). CPU tensors; only the torch references below use them (the kernel
    `build_decay_tables_kernel` needs part_cu alone), so plans do not build them."""
    rows, chunk_part_first, chunk_part_last, first, last, nonempty = [], [], [], [], [], []
    for a, b in zip(part_cu, part_cu[1:]):
        n = -(-(b - a) // CHUNK)
        first.append(len(rows) if n else 0)
        last.append(len(rows) + n - 1 if n else 0)
        nonempty.append(n > 0)
        for c in range(n):
            rows.append(a + min((c + 1) * CHUNK, b - a) - 1)
            chunk_part_first.append(len(rows) - 1 - c)
            chunk_part_last.append(len(rows) - 1 - c + n - 1)
    as_t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return {"chunk_last_row": as_t(rows), "chunk_part_first": as_t(chunk_part_first),
            "chunk_part_last": as_t(chunk_part_last), "part_first": as_t(first), "part_last": as_t(last),
            "part_nonempty": torch.tensor(nonempty, dtype=torch.bool)}


def _chunk_ends(plan, device) -> dict:
    return {name: t.to(device) for name, t in partition_chunk_ends(plan.part_cu).items()}


def _chunk_decays(g_cum: torch.Tensor, idx: dict):
    """[HV, NC] float64: each partition chunk's decay (its value of g_cum at its last row,
    clamped to <= 0) and the running sum over the chunks up to and including it. Scans along
    the last dimension only (torch's scan over chunks as dim 0 took 0.09 ms on the H200)."""
    HV, NC = g_cum.shape[-1], idx["chunk_last_row"].numel()
    decay = torch.empty(HV, NC, dtype=torch.float64, device=g_cum.device)
    decay.copy_(g_cum[0].index_select(0, idx["chunk_last_row"]).t()).clamp_(max=0.0)
    return decay, decay.cumsum(1)


def _count_per_partition(qualifies: torch.Tensor, idx: dict) -> torch.Tensor:
    """[HV, NP]: how many chunks of each partition have `qualifies` ([HV, NC] int32) set; 0 for
    an empty partition. A second scan instead of atomics."""
    upto = qualifies.cumsum(1)
    first = idx["part_first"]
    count = upto.index_select(1, idx["part_last"]) - upto.index_select(1, first) + qualifies.index_select(1, first)
    return torch.where(idx["part_nonempty"], count, 0)


def warmup_starts(g_cum: torch.Tensor, plan, threshold: float = WARMUP_LOG_DECAY) -> torch.Tensor:
    """[NP, HV] int32: per partition and v-head, the chunk where the summary walk may start
    (torch reference of `build_decay_tables_kernel`'s starts).

    The state entering chunk c reaches the partition's end damped by at least
    exp(sum of the chunk decays from c to the end), so the walk can start from zero at the
    last chunk c where that sum is below `threshold`; the partition's M is then dropped too.
    -1 where the decay never gets there (walk every chunk, keep M). `g_cum` is the prepare
    kernel's chunk-local cumulative gate [1, T, HV] (its value at a chunk's last row is the
    chunk's decay). Since g <= 0 the sums shrink towards the end, so the qualifying chunks are
    0 .. start and start = their count - 1. No atomics, no host sync.
    """
    idx = _chunk_ends(plan, g_cum.device)
    if idx["chunk_last_row"].numel() == 0:
        return torch.full((plan.num_parts, g_cum.shape[-1]), -1, dtype=torch.int32, device=g_cum.device)
    decay, before = _chunk_decays(g_cum, idx)
    to_end = before.index_select(1, idx["chunk_part_last"]) - before + decay
    count = _count_per_partition((to_end < threshold).to(torch.int32), idx)
    return (count - 1).t().to(torch.int32).contiguous()


def dh_warmup_chunks(g_cum: torch.Tensor, plan, threshold: float = WARMUP_LOG_DECAY) -> torch.Tensor:
    """[NP, HV] int32: per partition and v-head, how many of its first chunks the backward's
    first dh walk must cover (the mirror of `warmup_starts`; torch reference of
    `build_decay_tables_kernel`'s dh_walk).

    That walk computes the gradient reaching the partition's start from its own outputs, with a
    zero gradient at its end. A gradient entering at chunk W comes back to the start damped by
    at least exp(sum of the decays of chunks 0 .. W - 1), so the walk may stop at the first W
    where that sum is below `threshold` (W = all chunks where it never gets there, 0 for an
    empty partition). With g <= 0 the qualifying chunks are a suffix, so W = chunks - count + 1.
    """
    idx = _chunk_ends(plan, g_cum.device)
    if idx["chunk_last_row"].numel() == 0:
        return torch.zeros(plan.num_parts, g_cum.shape[-1], dtype=torch.int32, device=g_cum.device)
    decay, before = _chunk_decays(g_cum, idx)
    start = idx["chunk_part_first"]
    from_start = before - (before.index_select(1, start) - decay.index_select(1, start))
    count = _count_per_partition((from_start < threshold).to(torch.int32), idx)
    chunks = (idx["part_last"] - idx["part_first"] + 1) * idx["part_nonempty"]
    walk = torch.where(count > 0, chunks - count + 1, chunks)
    return torch.where(idx["part_nonempty"], walk, 0).t().to(torch.int32).contiguous()
