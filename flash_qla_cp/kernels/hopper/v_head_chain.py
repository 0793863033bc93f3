"""The v-head chain of the fused backward walk (`bwd_fused.py`, chain_v_heads): how the blocks of
one qk-head's v-heads sum their dq / dk rows without a kernel of their own.

Under GVA every v-head of a qk-head contributes to the same dq and dk rows. The walk's blocks of
one (sequence or partition, qk-head) form one cluster, a block per v-head (cluster rank = v-head
within the group), so that they run at the same time. Rank 0 stores its rows of a chunk; rank r
adds its rows to them where they lie, by bf16x2 / f16x2 reductions (`red`, performed in L2: the
thread neither waits for them nor holds the old rows) once rank r - 1 has landed its own; the
last rank's leave the sum. Each addend and each partial sum is rounded to the output dtype once; the
order of the additions is fixed, so the result is deterministic. Against per-v-head parts and a
sum kernel (at 1 x 32k, 32 v-heads: 268 MB of parts per tensor written, then read again and 134 MB
written) the chain writes into the result's 134 MB once per v-head. H100, TP1 1 x 32k: the walk
1.561 ms against 1.455 without the chain, fwd+bwd kernels 2.513 against 2.671 (the sum kernel's
0.26 ms gone). Slower ways measured: reading the rows back (load, fp32 add, store; each load's
L2 latency left in the pace-setting grad warpgroup, walk 2.05 ms, also with the rows prefetched
into L1), and TileLang's atomic add (`atomicAdd` on bf16x2 compiles to an ATOM, which waits for
the old value: walk 2.29 ms).

The hand-over is a count in each block's shared memory of the chunks whose rows the block before
has published. When the block before reaches its next chunk, its grad warpgroup meets at a named
barrier (its dq / dk stores or reductions of the last chunk all issued) and one thread fences at
cluster scope and adds 1 to the count: they were issued half a chunk before, so the fence rarely
waits; the last chunk's count is raised after the walk. In the reader one thread waits with an
acquire until the count passes its chunk, then the warpgroup's barrier orders everyone's
reductions after it (one fence per chunk, not one per thread). A count rather than an mbarrier:
the block before may run any number of chunks ahead without a phase coming round again. No block
waits for a later rank, so the chain cannot deadlock; each rank runs about a chunk behind the one
before, and every block of a cluster is resident at once (the cluster launch guarantees it).
"""

# Device functions of the hand-over and the adds (the kernel's prelude). The count starts at zero
# in every block of the cluster before any block may raise it (thread 0 writes it, then a cluster
# barrier).
CHAIN_PRELUDE = r"""
__device__ __forceinline__ void fqc_cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
__device__ __forceinline__ void fqc_publish(int* count, int peer, int bar_id) {
  // the group's stores before the barrier, then one thread's release to the next block
  asm volatile("bar.sync %0, 128;" :: "r"(bar_id) : "memory");
  if (threadIdx.x % 128 == 0) {
    unsigned local = (unsigned)__cvta_generic_to_shared(count), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(peer));
    asm volatile("fence.acq_rel.cluster;\n\tred.relaxed.cluster.shared::cluster.add.s32 [%0], 1;"
                 :: "r"(remote) : "memory");
  }
}
__device__ __forceinline__ void fqc_wait_count(int* count, int target, int bar_id) {
  // one thread acquires, the barrier orders the group's adds after it
  if (threadIdx.x % 128 == 0) {
    unsigned local = (unsigned)__cvta_generic_to_shared(count);
    int seen;
    do {
      asm volatile("ld.acquire.cluster.shared::cta.s32 %0, [%1];" : "=r"(seen) : "r"(local) : "memory");
    } while (seen < target);
  }
  asm volatile("bar.sync %0, 128;" :: "r"(bar_id) : "memory");
}
// The chain's column-pair adds as reductions in L2 (TileLang's AtomicAddx2 is an atomicAdd, an
// ATOM that waits for the old value; a RED does not)
#include <tl_templates/cuda/common.h>
#include <tl_templates/cuda/atomic.h>
__device__ __forceinline__ void fqc_red_add_pair(bfloat16_t* dst, float2 x) {
  __nv_bfloat162 v = __float22bfloat162_rn(x);
  asm volatile("red.global.add.noftz.bf16x2 [%0], %1;" :: "l"(dst), "r"(*reinterpret_cast<unsigned*>(&v)) : "memory");
}
__device__ __forceinline__ void fqc_red_add_pair(half_t* dst, float2 x) {
  __half2 v = __float22half2_rn(x);
  asm volatile("red.global.add.noftz.f16x2 [%0], %1;" :: "l"(dst), "r"(*reinterpret_cast<unsigned*>(&v)) : "memory");
}
#define AtomicAddx2 fqc_red_add_pair
"""

# Named barrier of the grad warpgroup's hand-over (TileLang's own syncs use ids 0-5, the fused
# walk's tail 8)
CHAIN_BARRIER = 9

# Largest v-head group the chain takes: one cluster per qk-head, and 8 blocks is the portable
# cluster size. Larger groups write per-v-head parts.
MAX_CHAIN_GROUP = 8
