"""Peak memory of one training step of the long-sequence recipe, estimated on a CPU machine.

    python tools/memory_trace.py --seq-len 16384 [--checkpoint-blocks] [--top 12]

Runs the recipe's model (examples/hybrid_lm: 8 GDN blocks, hidden 1024, 8 / 16 heads of 128,
bf16 autocast) for one forward + backward with the TileLang host code on CPU tensors: every kernel
launch is recorded instead of run (tools/precompile_cache.py's `recording`) and matmuls return
uninitialised outputs, so the buffers are the GPU run's and nothing heavy is computed. Every
tensor storage an op creates is counted until it is freed; the peak and what was alive at the
peak are printed per token. Allocator slack is not counted (the GPU's max_memory_allocated reads
~5-10% higher).
"""

import argparse
import collections
import os
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools"), os.path.join(ROOT, "examples")]

from precompile_cache import MatmulsSkipped, recording  # noqa: E402


class LiveStorages(MatmulsSkipped):
    """Bytes of the tensor storages ops created and that are still alive; the peak and its contents
    (matmuls skipped: their outputs' shapes and dtypes are what matters here, not the values)."""

    def __init__(self):
        super().__init__()
        self.live = {}  # storage id -> (weak ref, bytes, what made it)
        self.now = self.peak = 0
        self.at_peak = []
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for key in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(key)[1]
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.live:
                    size = t.untyped_storage().nbytes()
                    self.live[ref.cdata] = (ref, size, f"{self.phase} {func.__name__} {tuple(t.shape)} {t.dtype}")
                    self.now += size
        if self.now > self.peak:
            self.peak, self.at_peak = self.now, [(size, what) for _, size, what in self.live.values()]
        return out


def training_step(seq_len, checkpoint_blocks):
    from hybrid_lm.model import HybridLM, HybridLMConfig

    cfg = HybridLMConfig(vocab_size=258, hidden_size=1024, num_layers=8, num_heads=8, num_v_heads=16,
                         head_k_dim=128, attn_every=0)
    model = HybridLM(cfg)
    model.checkpoint_blocks = checkpoint_blocks
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len))
    cu = torch.tensor([0, seq_len // 2, seq_len], dtype=torch.int32)  # two documents, as packing gives
    trace = LiveStorages()
    with recording(132):
        with trace, torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids, cu_seqlens=cu)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab_size), ids.view(-1))
        trace.phase = "backward"
        with trace:
            loss.backward()
    return trace


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--checkpoint-blocks", action="store_true")
    ap.add_argument("--top", type=int, default=12, help="how many of the allocations alive at the peak to list")
    args = ap.parse_args()
    trace = training_step(args.seq_len, args.checkpoint_blocks)
    T = args.seq_len
    print(f"peak {trace.peak / 2**30:.2f} GiB = {trace.peak / T / 1024:.1f} KiB per token "
          f"({T} tokens, {'with' if args.checkpoint_blocks else 'without'} --checkpoint-blocks)")
    by_kind = collections.Counter()
    count = collections.Counter()
    for size, what in trace.at_peak:
        by_kind[what] += size
        count[what] += 1
    for what, size in by_kind.most_common(args.top):
        print(f"{size / T / 1024:8.1f} KiB/token  {count[what]:3d} x {what}")


if __name__ == "__main__":
    main()
