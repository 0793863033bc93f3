"""Intra-card split on the TileLang backend: the host plan (which partitions) and the launches of
its kernels (exact, no host round trips).

One long sequence on few heads leaves most SMs idle: every block walks all chunks of its
sequence in order. Each sequence is cut at chunk boundaries into P partitions that run side by
side as if they were separate sequences:

1. `hopper.split_decay_tables`: per partition and v-head, where the gates have decayed past the
   fp32 resolution (the warm-up shortcut's starts, the backward's dh walk lengths).
2. `hopper.split_summary`: per partition, the affine map S_out = M S_in + h of its chunks, from a
   zero start (walked from the warm-up start; M dropped where the start is past chunk 0).
3. `hopper.split_scan`: per sequence, S_in(p + 1) = M_p S_in(p) + h_p on the GPU.
4. The ordinary fused forward then runs every partition from its true incoming state; a
   sequence's last partition writes the sequence's final state (`SplitPlan.final_rows`).

The partitions reuse G and Ag of the prepare kernel unchanged (cuts fall on chunk boundaries,
so the chunk-local quantities are the same). The backward runs over the same partitions
(`kernels/backward.py`). The torch backend splits around the op instead (`parallel/intra.py`):
it has no GPU-side scan, so it re-runs partitions and follows a cost model of its own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..constants import CHUNK
from . import runtime
from .hopper.split_scan import build_partition_scan_kernel
from .tables import host_chunk_offsets, host_chunk_table, walk_order

# Partitions keep at least this many chunks (1k tokens); the auto rule aims at one backward walk
# per SM (the fused walk runs one block per SM over (partition, v-head) pairs). H200, bf16,
# K = V = 128, fwd+bwd replayed: TP8 1x32k 0.584 ms with partitions of 16 chunks (P = 32) against
# 0.651 with 32 (P = 16). More partitions cost the forward a little (0.181 -> 0.205 ms there): the
# rule is for training.
MIN_CHUNKS_PER_PART = 16
MAX_PARTS = 64
# Uneven varlen batches: a sequence walked in more than this many times the chunk steps an SM
# gets with the batch's work spread evenly is cut further (`balance_partitions`).
LONG_WALK_SLACK = 1.5
# Largest head dim the split runs at: its partition scan keeps a K x K map in fp32 shared memory,
# 573 KB at K = V = 256 (lowered for sm_90a; a block may have 227 KB). Wider heads stay whole.
SPLIT_MAX_HEAD_DIM = 128


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
                "final_rows": torch.tensor(self.final_rows(), **i32).to(device),
                "seq_rows": torch.arange(self.num_seqs, **i32).to(device),
                "seq_cu": torch.tensor(self.seq_cu, **i32).to(device),
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
    def num_seqs(self) -> int:
        return len(self.seq_parts) - 1

    @property
    def is_trivial(self) -> bool:
        return not self.split_parts

    def last_parts(self) -> list:
        return [self.seq_parts[n + 1] - 1 for n in range(len(self.seq_parts) - 1)]

    def final_rows(self) -> list:
        """Per partition, the row of the final states its walk writes: its sequence's index if it
        ends that sequence, else -1 (the fused forward's `ht_rows`)."""
        rows = [-1] * self.num_parts
        for n, p in enumerate(self.last_parts()):
            rows[p] = n
        return rows

    def first_parts(self) -> list:
        return self.seq_parts[:-1]


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


def scan_block_v(V: int, num_seqs: int, HV: int, sm_count: int) -> int:
    """V tile of the partition scan. Each step of a block loads the whole K x K map M, whatever
    its tile, so narrower tiles shorten a step while their blocks still fit on the SMs at once:
    16 when they do, else 32. H200, one scan alone:
    TP8 1x128k (32 partitions, 4 v-heads) 0.067 -> 0.041 ms at 16; TP1 1x32k (32 v-heads, 256
    blocks at 16) 0.014 at 32 vs 0.017 at 16. The states are the same for every tile."""
    if V % 32:
        return V
    return 16 if (V // 16) * num_seqs * HV <= sm_count else 32


@dataclass(frozen=True)
class SplitSpecs:
    """The split forward's kernels (from `forward.plan_forward`)."""

    decay_tables: runtime.KernelSpec
    summary: runtime.KernelSpec
    scan: runtime.KernelSpec  # forward scan, entering at zero or at the initial states


def decay_tables(spec: runtime.KernelSpec, gcum: torch.Tensor, plan: SplitPlan):
    """(warm-up starts, dh walk lengths), each [NP, HV] int32, in one launch (torch forms:
    `reference.kernel_steps.warmup_starts` / `dh_warmup_chunks`). gcum [1, T, HV] fp32."""
    HV = gcum.shape[-1]
    starts = torch.empty(plan.num_parts, HV, dtype=torch.int32, device=gcum.device)
    walk = torch.empty(plan.num_parts, HV, dtype=torch.int32, device=gcum.device)
    runtime.compile_kernel(spec)(runtime.kernel_operand(gcum), plan.device_tensors(gcum.device)["part_cu"], starts,
                                 walk)
    return starts, walk


def state_summaries(spec: runtime.KernelSpec, k, v, ag, gcum, plan: SplitPlan, starts: torch.Tensor):
    """(h [NP,HV,K,V], M [NP,HV,K,K]) fp32 of the partitions of split sequences (other rows
    are left unset), each walked from its warm-up start. Inputs packed [1, T, ...]."""
    K, (HV, V) = k.shape[3], v.shape[2:]
    NP = plan.num_parts
    h = torch.empty(NP, HV, K, V, dtype=torch.float32, device=k.device)
    M = torch.empty(NP, HV, K, K, dtype=torch.float32, device=k.device)
    if plan.split_parts:
        dev = plan.device_tensors(k.device)
        runtime.compile_kernel(spec)(k, v, ag, gcum, dev["part_cu"], dev["todo"], starts, h, M)
    return h, M


def scan_spec(HV: int, K: int, V: int, reverse: bool, num_seqs: int, sms: int, use_s0: bool) -> runtime.KernelSpec:
    """The partition scan for `num_seqs` sequences; without use_s0 it enters at zero and reads no
    entry states (no zero fill on the host)."""
    extra = {} if use_s0 else {"use_s0": False}
    return runtime.KernelSpec.of(build_partition_scan_kernel, HV=HV, K=K, V=V, reverse=bool(reverse),
                                 block_v=scan_block_v(V, num_seqs, HV, sms), **extra)


def scan_partitions(spec: runtime.KernelSpec, m, add, seq_parts_dev, s0):
    """[NP, HV, K, V] fp32: the state entering each partition (or, with a reverse scan spec, the
    gradient of the state leaving it). s0: each sequence's entry [N, HV, K, V] fp32, or None
    where `spec` enters at zero."""
    NP, HV, K, _ = m.shape
    V = add.shape[-1]
    add = runtime.kernel_operand(add)
    out = torch.empty(NP, HV, K, V, dtype=torch.float32, device=m.device)
    # entering at zero, the s0 argument is a placeholder of the right rank (not read)
    runtime.compile_kernel(spec)(runtime.kernel_operand(m), add, seq_parts_dev,
                                 runtime.kernel_operand(s0) if s0 is not None else add[:1], out)
    return out
