"""Warm-up tables of the intra-card split (sm_90a; `kernels/split.py`), one launch: per
partition and v-head, where the state summary may start and how many chunks the backward's
first dh walk must cover (torch forms: `reference.kernel_steps.warmup_starts` /
`dh_warmup_chunks`).
"""

# (no `from __future__ import annotations`: TileLang evaluates the kernel signatures)

from .common import CHUNK, import_tilelang


def build_decay_tables_kernel(HV: int, threshold: float):
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
