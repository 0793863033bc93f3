"""How finely to split sequences inside one card (intra-card CP).

The chunked kernels walk a sequence's chunks one after another and run (sequence, head)
pairs side by side on the SMs. With few heads and few long sequences most SMs idle, and the
sequential chain over chunks sets the time. Splitting a sequence into P partitions shortens
the chain P-fold but costs extra work: the exact path reruns every non-first partition
after the state scan (about 2x work), the decay shortcut adds only its warm-up chunks.

Model (units of one chunk-step of one (sequence, head) pair on one SM):
    time(P) = max(longest chain, total work / SMs) + scan overhead
The plan takes the P (a power of two, at most max_partitions) with the smallest time; it
is computed once per call from shapes alone and stored for the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_CHUNKS_PER_PARTITION = 8  # below this the scan and the rerun outweigh the gain


def sm_count(device) -> int | None:
    """The SMs of a CUDA device; None elsewhere (a CPU has no SMs to fill, so 'auto' does not split)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return None


@dataclass(frozen=True)
class SplitDecision:
    partitions: list  # per sequence
    time_split: float
    time_whole: float


def _time(chunks, parts, heads, sms, rerun_factor):
    chain = max((c / p * (rerun_factor if p > 1 else 1.0) for c, p in zip(chunks, parts)), default=0.0)
    work = sum(c * (rerun_factor if p > 1 else 1.0) for c, p in zip(chunks, parts)) * heads
    scan = sum(p - 1 for p in parts) * 0.5  # a partition boundary ~ half a chunk-step (scan + launch)
    return max(chain, work / sms) + scan


def plan_partitions(chunks_per_seq, num_heads, sms, intra_cp="auto", max_partitions=64,
                    min_chunks=MIN_CHUNKS_PER_PARTITION, rerun_factor=2.0) -> SplitDecision:
    """Partitions per sequence. intra_cp: 'auto' (model), 'off' (1) or an int P for every sequence.
    sms: the GPU's SMs, or None without one ('auto' then leaves every sequence whole; the times
    count chunk steps of one worker).

    A sequence never gets more partitions than it has chunks (forced) or chunks / min_chunks (auto).
    """
    chunks = [int(c) for c in chunks_per_seq]
    whole = [1] * len(chunks)
    auto_off = sms is None
    sms = sms or 1
    t_whole = _time(chunks, whole, num_heads, sms, rerun_factor)
    if intra_cp == "off" or not chunks or (intra_cp == "auto" and auto_off):
        return SplitDecision(whole, t_whole, t_whole)
    if isinstance(intra_cp, int) and not isinstance(intra_cp, bool):
        parts = [max(1, min(intra_cp, c)) for c in chunks]
        return SplitDecision(parts, _time(chunks, parts, num_heads, sms, rerun_factor), t_whole)
    best, t_best = whole, t_whole
    P = 2
    while P <= max_partitions:
        parts = [max(1, min(P, c // min_chunks)) for c in chunks]
        t = _time(chunks, parts, num_heads, sms, rerun_factor)
        if t < t_best * 0.95:  # split only for a clear gain
            best, t_best = parts, t
        P *= 2
    return SplitDecision(best, t_best, t_whole)
