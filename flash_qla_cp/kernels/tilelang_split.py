"""Intra-card sequence split inside the TileLang kernels (exact, no host round trips).

One long sequence on few heads leaves most SMs idle: every CTA walks all chunks of its
sequence in order. Here each sequence is cut at chunk boundaries into P partitions that run
side by side as if they were separate sequences:

1. `build_state_summary_kernel`: per partition, the affine map of its chunks,
   S_out = M S_in + h, from a zero start. h is the recurrence on v; M is the same recurrence
   run on the identity with zero input (columns of [h | M] are independent, so the grid
   covers V + K columns in blocks). No q and no output: three GEMMs per chunk.
   Warm-up shortcut (`warmup_starts`, per partition and v-head): where the gates decay by more
   than WARMUP_LOG_DECAY over the partition's last chunks, whatever entered before them is
   damped below fp32 resolution, so h walks only those chunks and M is 0. With real gates
   that is a chunk or a few, so the split costs little beyond the scan.
2. `build_partition_scan_kernel`: per sequence, S_in(p + 1) = M_p S_in(p) + h_p on the GPU
   (fp32 state, tf32 products), P - 1 steps. The backward runs the same kernel in reverse
   with M^T: dS_out(p - 1) = M_p^T dS_out(p) + dS_local(p).
3. The ordinary fused forward kernel then runs every partition from its true incoming state.

The warm-up starts and the backward's dh walk lengths come from `build_decay_tables_kernel`
(one launch); `warmup_starts` / `dh_warmup_chunks` are their torch references.

The partitions reuse G and Ag of the prepare kernel unchanged (cuts fall on chunk
boundaries, so the chunk-local quantities are the same). The backward kernels take the
partitions as sequences too; see `tilelang_bwd_impl.py` ("split" in `saved`).
"""

# (no `from __future__ import annotations`: TileLang evaluates the kernel signatures)

import functools
from dataclasses import dataclass, field

import torch

from . import tilelang_common
from .tilelang_common import CHUNK, compile_kernel, import_tilelang, kernel_operand, tl_dtype, walk_order

LOG2E = 1.4426950408889634
# Partitions keep at least this many chunks (1k tokens). The auto rule aims at one backward walk
# per SM (the fused walk runs one block per SM over (partition, v-head) pairs). H200, bf16,
# K = V = 128, fwd+bwd ms by partitions per sequence, CUDA-graph replays
# (benchmarks/results/tune_split_walks_h200_2026-12-03.json): TP1 1x8k P = 1 1.32, P = 2 1.30,
# P = 4 1.08; TP8 1x32k P = 4 1.21, P = 8 0.84, P = 16 0.78; TP8 1x128k P = 16 2.46, P = 32 2.07;
# TP1 1x32k P = 4 3.68 (P = 8 was ~2% slower, sixth session). With the fused walk and the kept
# chunk states, TP8 1x32k P = 16 0.651 vs P = 32 (partitions of 16 chunks: 128 walks, the fused
# walk) 0.584 (results/tune_split_tp8_p32_h200_2026-12-04.json), hence 16 rather than 32 here.
# More partitions cost the forward a little (TP8 1x32k 0.181 -> 0.205 ms, TP1 1x8k 0.257 -> 0.266):
# the rule is for training.
MIN_CHUNKS_PER_PART = 16
MAX_PARTS = 64
# Uneven varlen batches: a sequence walked in more than this many times the chunk steps an SM
# gets with the batch's work spread evenly is cut further (`balance_partitions`).
LONG_WALK_SLACK = 1.5
# A state damped by exp(-16) ~ 1.1e-7 (the fp32 resolution) may be dropped. The bound
# ||prod_t exp(g_t) (I - beta_t k_t k_t^T)|| <= exp(sum g) needs beta_t ||k_t||^2 <= 2, i.e. no
# step that expands the state: the layer's l2-normalised k and sigmoid beta give that, and
# inputs without it make the recurrence itself grow without bound. g <= 0 by definition.
WARMUP_LOG_DECAY = -16.0
# Largest head dim the split runs at: its partition scan keeps a K x K map in fp32 shared memory,
# 573 KB at K = V = 256 (lowered for sm_90a; a block may have 227 KB). Wider heads stay whole.
SPLIT_MAX_HEAD_DIM = 128

__all__ = [
    "SplitPlan",
    "host_chunk_table",
    "plan_split",
    "auto_partitions",
    "balance_partitions",
    "warmup_starts",
    "dh_warmup_chunks",
    "WARMUP_LOG_DECAY",
    "build_state_summary_kernel",
    "build_partition_scan_kernel",
    "build_decay_tables_kernel",
    "decay_tables",
    "state_summaries",
    "scan_partitions",
]


# ----------------------------------------------------------------------------------------
# Host-side plan
# ----------------------------------------------------------------------------------------
def walk_blocks(num_seqs: int, HV: int, V: int) -> int:
    """Blocks of an unsplit backward walk: (sequence, v-head) pairs, times the 128-column
    slices of V (the fused walk holds at most 128 columns of the state)."""
    return max(1, num_seqs * HV * -(-V // 128))


def auto_partitions(n_chunks: int, num_seqs: int, HV: int, V: int, sms: int) -> int:
    """Partitions for a sequence of `n_chunks` chunks (a power of two; 1 means no split): P
    doubles while the walks after doubling still fit on the SMs (one block each) and every
    partition keeps MIN_CHUNKS_PER_PART chunks. The forward's and the backward's split are the
    same."""
    blocks = walk_blocks(num_seqs, HV, V)
    parts = 1
    while parts < MAX_PARTS and blocks * 2 * parts <= sms and n_chunks // (2 * parts) >= MIN_CHUNKS_PER_PART:
        parts *= 2
    return parts


def balance_partitions(n_chunks: int, per_sm_chunks: float) -> int:
    """Partitions (a power of two) that keep one sequence's walks within LONG_WALK_SLACK x
    `per_sm_chunks`, the chunk steps per SM of the whole batch spread evenly. Without it a batch
    of many short documents and one long one (too many walks in all for `auto_partitions` to cut
    anything) runs for as long as the long document's walk, with most SMs idle at the end.
    Walks of two minimal partitions are as short as cutting can make them: no target below that."""
    target = max(LONG_WALK_SLACK * per_sm_chunks, 2 * MIN_CHUNKS_PER_PART)
    parts = 1
    while (parts < MAX_PARTS and n_chunks / parts > target
           and n_chunks // (2 * parts) >= MIN_CHUNKS_PER_PART):
        parts *= 2
    return parts


@dataclass
class SplitPlan:
    """Partitions of every sequence (host lists) and their device copies."""

    part_cu: list  # token offsets of the partitions, [NP + 1]
    seq_parts: list  # partitions of sequence n are seq_parts[n] .. seq_parts[n + 1] - 1
    split_parts: list  # partitions of sequences cut into >= 2 (they need a summary)
    seq_cu: list = field(default_factory=list)  # the sequences' own offsets
    _on_device: dict = field(default_factory=dict, repr=False)

    def device_tensors(self, device) -> dict:
        """Index tensors of the plan on `device`, built once per plan (plans are cached, so
        repeated calls with the same cu_seqlens make no host-to-device copies)."""
        key = str(device)
        if key not in self._on_device:
            i32 = dict(dtype=torch.int32)
            self._on_device[key] = {
                "part_cu": torch.tensor(self.part_cu, **i32).to(device),
                "seq_parts": torch.tensor(self.seq_parts, **i32).to(device),
                "todo": torch.tensor(self.split_parts, **i32).to(device),
                "first_parts": torch.tensor(self.first_parts(), dtype=torch.int64).to(device),
                "last_parts": torch.tensor(self.last_parts(), dtype=torch.int64).to(device),
                "part_chunk_table": host_chunk_table(self.part_cu, device),
                "seq_chunk_table": host_chunk_table(self.seq_cu, device),
                "part_chunk_offsets": host_chunk_offsets(self.part_cu, device),
                "seq_chunk_offsets": host_chunk_offsets(self.seq_cu, device),
                "part_order": walk_order(torch.tensor(self.part_cu)).to(device),
                "seq_order": walk_order(torch.tensor(self.seq_cu)).to(device),
            }
        return self._on_device[key]

    @property
    def num_parts(self) -> int:
        return len(self.part_cu) - 1

    @property
    def is_trivial(self) -> bool:
        return not self.split_parts

    def last_parts(self) -> list:
        return [self.seq_parts[n + 1] - 1 for n in range(len(self.seq_parts) - 1)]

    def first_parts(self) -> list:
        return self.seq_parts[:-1]


def host_chunk_table(offsets: list, device) -> torch.Tensor:
    """[NC, 2] int32 (segment, chunk in segment) of packed segments given by host `offsets`;
    the same table as `tilelang_common.chunk_table` without reading the offsets back from the GPU."""
    counts = torch.tensor([-(-(b - a) // CHUNK) for a, b in zip(offsets, offsets[1:])], dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(len(counts)), counts)
    local = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts)[seg]
    return torch.stack([seg, local], 1).to(torch.int32).to(device)


def host_chunk_offsets(offsets: list, device) -> torch.Tensor:
    """[N + 1] int32: where each segment's chunks start in the packed chunk numbering."""
    counts = [-(-(b - a) // CHUNK) for a, b in zip(offsets, offsets[1:])]
    return torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


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


def _chunk_ends(plan: "SplitPlan", device) -> dict:
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


def warmup_starts(g_cum: torch.Tensor, plan: "SplitPlan", threshold: float = WARMUP_LOG_DECAY) -> torch.Tensor:
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


def dh_warmup_chunks(g_cum: torch.Tensor, plan: "SplitPlan", threshold: float = WARMUP_LOG_DECAY) -> torch.Tensor:
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


def plan_split(cu_host, HV: int, V: int, parts="auto", sms: int = 132) -> SplitPlan:
    """Cut each sequence of `cu_host` (host ints) at chunk boundaries into partitions.

    parts: 'auto' (per sequence the larger of `auto_partitions` and `balance_partitions`) or an
    int P (at most one per chunk). The
    backward runs over the same partitions.
    Empty sequences keep one empty partition so that every sequence has a first and a last.
    Plans are cached: a training loop with fixed shapes builds each one once.
    """
    return _plan_split(tuple(int(x) for x in cu_host), int(HV), int(V), parts, int(sms))


@functools.lru_cache(maxsize=256)
def _plan_split(cu_host: tuple, HV: int, V: int, parts, sms: int) -> SplitPlan:
    lengths = [b - a for a, b in zip(cu_host, cu_host[1:])]
    num_seqs = len(lengths)
    chunk_counts = [-(-length // CHUNK) for length in lengths]
    # chunk steps per SM with every walk of the batch spread evenly (one block per SM)
    per_sm_chunks = walk_blocks(1, HV, V) * sum(chunk_counts) / max(1, sms)
    part_cu, seq_parts, split_parts = [cu_host[0]], [0], []
    for n, (length, chunks) in enumerate(zip(lengths, chunk_counts)):
        if parts == "auto":
            P = max(auto_partitions(chunks, num_seqs, HV, V, sms), balance_partitions(chunks, per_sm_chunks))
        else:
            P = max(1, min(int(parts), chunks))
        start = cu_host[n]
        first = len(part_cu) - 1
        for i in range(1, P + 1):
            part_cu.append(start + min(length, (chunks * i // P) * CHUNK))
        seq_parts.append(len(part_cu) - 1)
        if P > 1:
            split_parts += list(range(first, first + P))
    return SplitPlan(part_cu, seq_parts, split_parts, list(cu_host))


# ----------------------------------------------------------------------------------------
# Kernel 1: (h, M) of every partition
# ----------------------------------------------------------------------------------------
def build_state_summary_kernel(H: int, HV: int, K: int, V: int, dtype: str, block_c: int = 64,
                               threads: int = 128, num_stages: int = 2):
    """PrimFunc: grid ((V + K) / block_c, len(todo), HV). Column block c0 < V runs the
    recurrence on v[:, c0:c0+block_c] from zero and writes h; c0 >= V runs it on zero input
    from the identity's columns and writes M. Packed [1, T] inputs; partitions by part_cu.

    Arguments: k [1,T,H,K], v [1,T,HV,V], ag [1,T,HV,64] dtype; gc [1,T,HV] fp32;
    part_cu [NP+1] int32; todo [NT] int32 (partitions to summarise); starts [NP,HV] int32
    (`warmup_starts`: h walks from that chunk and M is 0; -1: every chunk, M kept);
    h_out [NP,HV,K,V] fp32; m_out [NP,HV,K,K] fp32.
    """
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    grp = HV // H
    BC = block_c
    assert HV % H == 0 and V % BC == 0 and K % BC == 0 and BC % 16 == 0
    NB = (V + K) // BC

    Ttot = T.dynamic("num_tokens")
    NP1 = T.dynamic("num_parts_plus_one")
    NP = T.dynamic("num_parts")
    NT = T.dynamic("num_todo")

    @T.prim_func
    def gdn_state_summary(
        k: T.Tensor((1, Ttot, H, K), dtype),
        v: T.Tensor((1, Ttot, HV, V), dtype),
        ag: T.Tensor((1, Ttot, HV, C), dtype),
        gc: T.Tensor((1, Ttot, HV), acc),
        part_cu: T.Tensor((NP1,), "int32"),
        todo: T.Tensor((NT,), "int32"),
        starts: T.Tensor((NP, HV), "int32"),
        h_out: T.Tensor((NP, HV, K, V), acc),
        m_out: T.Tensor((NP, HV, K, K), acc),
    ):
        with T.Kernel(NB, NT, HV, threads=threads) as (bc, bt, bhv):
            p = todo[bt]
            bh = bhv // grp
            c0 = bc * BC
            v_col = T.min(c0, V - BC)  # M blocks read a (discarded) v tile too: one code path

            k_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, BC), dtype)
            a_s = T.alloc_shared((C, C), dtype)
            g_s = T.alloc_shared((C,), acc)
            gl_s = T.alloc_shared((C,), acc)
            h_s = T.alloc_shared((K, BC), dtype)
            w_s = T.alloc_shared((C, BC), dtype)
            vd_s = T.alloc_shared((C, BC), dtype)

            s_f = T.alloc_fragment((K, BC), acc)
            x_f = T.alloc_fragment((C, BC), acc)
            vn_f = T.alloc_fragment((C, BC), acc)
            glast = T.alloc_var(acc)

            # warm-up shortcut: the walk starts at chunk `first` (h) or not at all (dropped M)
            first = T.max(starts[p, bhv], 0)
            dropped = (c0 >= V) and (starts[p, bhv] >= 0)
            t_start = part_cu[p] + first * C
            seq_len = part_cu[p + 1] - t_start
            n_chunks = T.ceildiv(seq_len, C)
            for i, j in T.Parallel(K, BC):
                s_f[i, j] = T.if_then_else((c0 >= V) and (i == c0 - V + j) and (not dropped), T.float32(1),
                                           T.float32(0))

            for c in T.Pipelined(T.if_then_else(dropped, 0, n_chunks), num_stages=num_stages):
                t0 = t_start + c * C
                L = T.min(seq_len - c * C, C)
                # whole tiles, as in the fused forward: rows >= L are masked out of the update
                T.copy(k[0, t0 : t0 + C, bh, :], k_s)
                T.copy(v[0, t0 : t0 + C, bhv, v_col : v_col + BC], v_s)
                T.copy(ag[0, t0 : t0 + C, bhv, :], a_s)
                for i in T.Parallel(C):
                    g_s[i] = gc[0, t0 + T.min(i, L - 1), bhv]
                for i in T.Parallel(C):
                    gl_s[i] = g_s[i]
                T.copy(s_f, h_s)
                T.gemm(k_s, h_s, x_f, clear_accum=True)
                # loads, masks and shared stores in loops of their own (the elementwise rule,
                # tilelang_common). The v tile is always loaded (finite), so M blocks zero it by
                # a factor.
                for i, j in T.Parallel(C, BC):
                    x_f[i, j] = (T.cast(v_s[i, j], acc) * T.if_then_else(c0 < V, T.float32(1), T.float32(0))
                                 - T.exp2(gl_s[i] * LOG2E) * x_f[i, j])
                T.copy(x_f, w_s)
                T.gemm(a_s, w_s, vn_f, clear_accum=True)
                glast = gl_s[C - 1]
                for i, j in T.Parallel(C, BC):
                    vn_f[i, j] = vn_f[i, j] * T.exp2((glast - gl_s[i]) * LOG2E)
                for i, j in T.Parallel(C, BC):
                    vn_f[i, j] = T.if_then_else(i < L, vn_f[i, j], T.float32(0))
                T.copy(vn_f, vd_s)
                for i, j in T.Parallel(K, BC):
                    s_f[i, j] = s_f[i, j] * T.exp2(glast * LOG2E)
                T.gemm(k_s, vd_s, s_f, transpose_A=True)

            if c0 < V:
                T.copy(s_f, h_out[p, bhv, :, c0 : c0 + BC])
            else:
                T.copy(s_f, m_out[p, bhv, :, c0 - V : c0 - V + BC])

    return gdn_state_summary


# ----------------------------------------------------------------------------------------
# Kernel 2: the scan over partitions
# ----------------------------------------------------------------------------------------
def build_partition_scan_kernel(HV: int, K: int, V: int, reverse: bool, block_v: int = 32, threads: int = 128,
                                use_s0: bool = True):
    """PrimFunc: grid (V / block_v, N, HV). For the partitions of sequence n in order
    (reverse: last to first) writes out[p] = S, then S = m[p] S + add[p] (not after the
    final one); the next step's m and add load while this step multiplies. S starts from s0[n]
    (the initial state, or the final-state gradient), or from zero without use_s0 (s0 is then
    not read: any [N0, HV, K, V] fp32 tensor, no zero fill on the host). (Skipping the product
    where the summary dropped m[p] was tried: a branch inside the pipelined loop made the H200
    scan 30x slower and wrong, so m = 0 is multiplied like any other.)

    Arguments: m [NP,HV,K,K] fp32 (M, or M^T for the reverse scan), add [NP,HV,K,V] fp32,
    seq_parts [N+1] int32, s0 [N,HV,K,V] fp32, out [NP,HV,K,V] fp32.
    """
    _, T = import_tilelang()
    acc = "float32"
    BV = block_v
    assert V % BV == 0 and BV % 16 == 0
    NP = T.dynamic("num_parts")
    N1 = T.dynamic("num_seqs_plus_one")
    N0 = T.dynamic("n_s0")

    @T.prim_func
    def gdn_partition_scan(
        m: T.Tensor((NP, HV, K, K), acc),
        add: T.Tensor((NP, HV, K, V), acc),
        seq_parts: T.Tensor((N1,), "int32"),
        s0: T.Tensor((N0, HV, K, V), acc),
        out: T.Tensor((NP, HV, K, V), acc),
    ):
        with T.Kernel(V // BV, N1 - 1, HV, threads=threads) as (bv, n, bhv):
            v0 = bv * BV
            p_first = seq_parts[n]
            n_parts = seq_parts[n + 1] - p_first
            m_s = T.alloc_shared((K, K), acc)
            a_s = T.alloc_shared((K, BV), acc)
            st_s = T.alloc_shared((BV, K), acc)  # S^T: the tf32 MMA wants both operands K-major
            s_f = T.alloc_fragment((K, BV), acc)

            if use_s0:
                T.copy(s0[n, bhv, :, v0 : v0 + BV], s_f)
            else:
                T.clear(s_f)
            # every sequence has >= 1 partition; the loads of step i + 1 overlap step i's product
            for i in T.Pipelined(n_parts - 1, num_stages=2):
                p = (p_first + n_parts - 1 - i) if reverse else (p_first + i)
                T.copy(m[p, bhv, :, :], m_s)
                T.copy(add[p, bhv, :, v0 : v0 + BV], a_s)
                T.copy(s_f, out[p, bhv, :, v0 : v0 + BV])
                for r, c in T.Parallel(K, BV):
                    st_s[c, r] = s_f[r, c]
                T.copy(a_s, s_f)
                T.gemm(m_s, st_s, s_f, transpose_B=True)
            T.copy(s_f, out[p_first if reverse else p_first + n_parts - 1, bhv, :, v0 : v0 + BV])

    return gdn_partition_scan


# ----------------------------------------------------------------------------------------
# Kernel 3: the warm-up tables, one launch instead of ~50 small torch ops
# ----------------------------------------------------------------------------------------
def build_decay_tables_kernel(HV: int, threshold: float = WARMUP_LOG_DECAY):
    """PrimFunc: grid (NP, ceil(HV / 32)), one thread per (partition, v-head). Writes both
    tables of the torch references `warmup_starts` (starts) and `dh_warmup_chunks` (dh_walk)
    from the chunk decays (g_cum at each chunk's last row, clamped to <= 0), summed in float64.
    The dh walk ends at the first chunk where the decay from the partition's start passes the
    threshold, the warm-up starts at the last chunk where the decay to its end does: a scan
    from each end that stops reading there, so with real gates each thread reads a few chunks
    (all of them for a g = 0 head). The torch versions launch ~50 tiny kernels per forward,
    host time that was most of the split forward at few heads (TP8 1x32k on the H200: ~1 ms
    per call for 0.29 ms of kernels).

    Arguments: g_cum [1,T,HV] fp32 (chunk-local cumulative gate), part_cu [NP+1] int32,
    starts [NP,HV] int32, dh_walk [NP,HV] int32.
    """
    _, T = import_tilelang()
    TT = T.dynamic("tokens")
    NP1 = T.dynamic("num_parts_plus_one")
    f64 = "float64"
    limit = T.float64(threshold)

    @T.prim_func
    def gdn_decay_tables(
        g_cum: T.Tensor((1, TT, HV), "float32"),
        part_cu: T.Tensor((NP1,), "int32"),
        starts: T.Tensor((NP1 - 1, HV), "int32"),
        dh_walk: T.Tensor((NP1 - 1, HV), "int32"),
    ):
        with T.Kernel(NP1 - 1, T.ceildiv(HV, 32), threads=32) as (p, hb):
            h = hb * 32 + T.get_thread_binding()
            acc = T.alloc_var(f64)
            start = T.alloc_var("int32")
            walk = T.alloc_var("int32")
            if h < HV:
                t0 = part_cu[p]
                length = part_cu[p + 1] - t0
                n = T.ceildiv(length, CHUNK)
                # decay from the start, chunk by chunk, until it passes the threshold
                acc = T.float64(0)
                walk = n
                for c in T.serial(n):
                    if walk == n:
                        acc = acc + T.Cast(f64, T.min(g_cum[0, t0 + T.min((c + 1) * CHUNK, length) - 1, h], 0.0))
                        if acc < limit:
                            walk = c + 1
                # decay to the end, from the last chunk backwards, until it passes the threshold
                acc = T.float64(0)
                start = -1
                for i in T.serial(n):
                    if start < 0:
                        acc = acc + T.Cast(f64, T.min(g_cum[0, t0 + T.min((n - i) * CHUNK, length) - 1, h], 0.0))
                        if acc < limit:
                            start = n - 1 - i
                starts[p, h] = start
                dh_walk[p, h] = walk

    return gdn_decay_tables


# ----------------------------------------------------------------------------------------
# Python wrappers
# ----------------------------------------------------------------------------------------
def decay_tables(gcum: torch.Tensor, plan: SplitPlan):
    """(warm-up starts, dh walk lengths), each [NP, HV] int32: what `warmup_starts` and
    `dh_warmup_chunks` compute, in one kernel launch. gcum [1, T, HV] fp32 on the GPU."""
    HV = gcum.shape[-1]
    starts = torch.empty(plan.num_parts, HV, dtype=torch.int32, device=gcum.device)
    walk = torch.empty(plan.num_parts, HV, dtype=torch.int32, device=gcum.device)
    kern = compile_kernel(build_decay_tables_kernel, HV=HV)
    kern(kernel_operand(gcum), plan.device_tensors(gcum.device)["part_cu"], starts, walk)
    return starts, walk


def state_summaries(k, v, ag, gcum, plan: SplitPlan, starts: torch.Tensor):
    """(h [NP,HV,K,V], M [NP,HV,K,K]) fp32 of the partitions of split sequences (other rows
    are left unset), each walked from its warm-up start (`decay_tables`). Inputs packed
    [1, T, ...]."""
    _, _, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    NP = plan.num_parts
    h = torch.empty(NP, HV, K, V, dtype=torch.float32, device=k.device)
    M = torch.empty(NP, HV, K, K, dtype=torch.float32, device=k.device)
    if plan.split_parts:
        dev = plan.device_tensors(k.device)
        kern = compile_kernel(build_state_summary_kernel, H=H, HV=HV, K=K, V=V, dtype=tl_dtype(k.dtype))
        kern(k, v, ag, gcum, dev["part_cu"], dev["todo"], starts, h, M)
    return h, M


def scan_block_v(V: int, num_seqs: int, HV: int, sm_count: int) -> int:
    """V tile of the partition scan. Each step of a block loads the whole K x K map M, whatever
    its tile, so narrower tiles shorten a step while their blocks still fit on the SMs at once:
    16 when they do, else 32. H200, one scan alone (results/tune_scan_h200_2026-12-04.json):
    TP8 1x128k (32 partitions, 4 v-heads) 0.067 -> 0.041 ms at 16; TP1 1x32k (32 v-heads, 256
    blocks at 16) 0.014 at 32 vs 0.017 at 16. The states are the same for every tile."""
    if V % 32:
        return V
    return 16 if (V // 16) * num_seqs * HV <= sm_count else 32


def scan_partitions(m, add, seq_parts_dev, s0, reverse: bool, num_seqs: int = None):
    """Run the partition scan: [NP, HV, K, V] fp32 (state entering each partition, or with
    reverse=True the gradient of the state leaving it). s0: each sequence's entry [N, HV, K, V]
    fp32, or None for zero (then num_seqs gives N): the kernel starts from zero itself (use_s0
    off) instead of reading a zero-filled tensor, one fill launch less per scan (H200, TP8 1x32k
    eager fwd+bwd 1.389 -> 1.314 ms with both scans so, results/bench_kernels_h200_2026-12-04_switches.md)."""
    NP, HV, K, _ = m.shape
    V = add.shape[-1]
    add = kernel_operand(add)
    use_s0 = s0 is not None
    n_seqs = s0.shape[0] if use_s0 else num_seqs
    out = torch.empty(NP, HV, K, V, dtype=torch.float32, device=m.device)
    kern = compile_kernel(build_partition_scan_kernel, HV=HV, K=K, V=V, reverse=bool(reverse),
                          block_v=scan_block_v(V, n_seqs, HV, tilelang_common.sm_count(m.device)),
                          **({} if use_s0 else {"use_s0": False}))
    # without use_s0 the s0 argument is a placeholder of the right rank (not read)
    kern(kernel_operand(m), add, seq_parts_dev, kernel_operand(s0) if use_s0 else add[:1], out)
    return out


def split_kernel_specs(H, HV, K, V, dtype):
    """[(factory, params)] of the split-only kernels (for `precompile` and the CI lowering)."""
    dtype = tl_dtype(dtype)
    tiles = sorted({scan_block_v(V, 1, HV, 10**6), scan_block_v(V, 1, HV, 0)})  # both tiles it may pick
    return [
        (build_state_summary_kernel, dict(H=H, HV=HV, K=K, V=V, dtype=dtype)),
        *[(build_partition_scan_kernel, dict(HV=HV, K=K, V=V, reverse=rev, block_v=bv, **entry))
          for bv in tiles for rev in (False, True) for entry in ({}, {"use_s0": False})],
        (build_decay_tables_kernel, dict(HV=HV)),
    ]
