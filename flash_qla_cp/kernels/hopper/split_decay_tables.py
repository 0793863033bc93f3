"""Warm-up tables of the intra-card split (sm_90a; `kernels/split.py`), one launch: per
partition and v-head, where the state summary may start and how many chunks the backward's
first dh walk must cover (torch forms: `reference.kernel_steps.warmup_starts` /
`dh_warmup_chunks`).
"""

# (no `from __future__ import annotations`: TileLang evaluates the kernel signatures)

from .common import CHUNK, import_tilelang

LANES = 32


def build_decay_tables_kernel(HV: int, threshold: float):
    """PrimFunc: grid (NP, HV), one warp per (partition, v-head). Writes both tables of the
    torch references `warmup_starts` (starts) and `dh_warmup_chunks` (dh_walk) from the chunk
    decays (g_cum at each chunk's last row, clamped to <= 0), summed in float64.

    The dh walk ends at the first chunk where the decay from the partition's start passes the
    threshold, the warm-up starts at the last chunk where the decay to its end does. Both scans
    run 32 chunks at a time, one chunk per lane (from the start and from the end), and stop at
    the batch where they cross: with real gates a warp reads one or two batches, every chunk only
    for a g = 0 head. Loading the chunks one after another (one thread per pair) spent a memory
    latency per chunk: 14 us per forward at TP1 1 x 32k (H100). Each lane adds its batch's
    decays in chunk order after the sum of the earlier batches, so every prefix sum is the
    serial one, bit for bit.

    Arguments: g_cum [1,T,HV] fp32 (chunk-local cumulative gate), part_cu [NP+1] int32,
    starts [NP,HV] int32, dh_walk [NP,HV] int32.
    """
    _, T = import_tilelang()
    TT = T.dynamic("tokens")
    NP1 = T.dynamic("num_parts_plus_one")
    f64 = "float64"
    limit = T.float64(threshold)

    def chunk_decay(g_cum, t0, length, h, c, present):
        # chunk c's decay (g_cum at its last row, clamped to <= 0) in float64; 0 where not present
        return T.if_then_else(
            present, T.Cast(f64, T.min(g_cum[0, t0 + T.min((c + 1) * CHUNK, length) - 1, h], 0.0)), T.float64(0))

    @T.prim_func
    def gdn_decay_tables(
        g_cum: T.Tensor((1, TT, HV), "float32"),
        part_cu: T.Tensor((NP1,), "int32"),
        starts: T.Tensor((NP1 - 1, HV), "int32"),
        dh_walk: T.Tensor((NP1 - 1, HV), "int32"),
    ):
        with T.Kernel(NP1 - 1, HV, threads=LANES) as (p, h):
            lane = T.get_thread_binding()
            # this batch's chunk decays (from the start / from the end) and each lane's verdict
            head_s = T.alloc_shared((LANES,), f64)
            tail_s = T.alloc_shared((LANES,), f64)
            head_hit = T.alloc_shared((LANES,), "int32")
            tail_hit = T.alloc_shared((LANES,), "int32")
            head_sum = T.alloc_var(f64)  # decay of the batches before, the same in every lane
            tail_sum = T.alloc_var(f64)
            head_pre = T.alloc_var(f64)
            tail_pre = T.alloc_var(f64)
            walk = T.alloc_var("int32")
            start = T.alloc_var("int32")
            head_open = T.alloc_var("int32")
            tail_open = T.alloc_var("int32")
            t0 = part_cu[p]
            length = part_cu[p + 1] - t0
            n = T.ceildiv(length, CHUNK)
            head_sum = T.float64(0)
            tail_sum = T.float64(0)
            walk = n
            start = -1
            for b in T.serial(T.ceildiv(n, LANES)):
                # uniform across the warp: every lane holds the same walk / start
                head_open = T.if_then_else(walk == n, 1, 0)
                tail_open = T.if_then_else(start < 0, 1, 0)
                if head_open + tail_open > 0:
                    i = b * LANES + lane
                    c_head = T.min(i, n - 1)  # lanes past the partition read its last chunk, then add 0
                    c_tail = T.max(n - 1 - i, 0)
                    head_s[lane] = chunk_decay(g_cum, t0, length, h, c_head, i < n)
                    tail_s[lane] = chunk_decay(g_cum, t0, length, h, c_tail, i < n)
                    T.sync_threads()
                    head_pre = head_sum
                    tail_pre = tail_sum
                    for m in T.unroll(LANES):
                        if m <= lane:
                            head_pre = head_pre + head_s[m]
                            tail_pre = tail_pre + tail_s[m]
                    head_hit[lane] = T.if_then_else((i < n) and (head_pre < limit), i + 1, n)
                    tail_hit[lane] = T.if_then_else((i < n) and (tail_pre < limit), n - 1 - i, -1)
                    T.sync_threads()
                    # the first crossing in scan order: the smallest walk, the largest start
                    for m in T.unroll(LANES):
                        head_sum = head_sum + head_s[m]
                        tail_sum = tail_sum + tail_s[m]
                        if head_open > 0:
                            walk = T.min(walk, head_hit[m])
                        if tail_open > 0:
                            start = T.max(start, tail_hit[m])
                    T.sync_threads()
            if lane == 0:
                starts[p, h] = start
                dh_walk[p, h] = walk

    return gdn_decay_tables
