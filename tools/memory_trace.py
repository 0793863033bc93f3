"""Peak memory of one training step of the long-sequence recipe, estimated on a CPU machine.

    python tools/memory_trace.py --seq-len 16384 [--checkpoint-blocks] [--top 12]
    python tools/memory_trace.py --layer qwen3_next_1x32k    # one fwd+bwd of our GatedDeltaNet
    python tools/memory_trace.py --op tp1_1x32k              # one fwd+bwd of the op

`--layer` takes a shape of benchmarks/bench_layer.py, `--op` one of benchmarks/bench_kernels.py
(the op with its defaults); both count their inputs too, as those benchmarks' peak column does.

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
sys.path[:0] = [ROOT] + [os.path.join(ROOT, d) for d in ("tools", "examples", "benchmarks")]

from precompile_cache import MatmulsSkipped, layer_shape, recording  # noqa: E402


def _emptied(ref) -> bool:
    """Whether a storage still alive was resized to nothing (memory freed while a tensor, e.g. one
    autograd saved, still refers to it)."""
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes() == 0


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
        for key in [k for k, (ref, _, _) in self.live.items() if ref.expired() or _emptied(ref)]:
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


def layer_step(name):
    """One fwd+bwd of our GatedDeltaNet on a shape of benchmarks/bench_layer.py: (trace, tokens)."""
    from bench_layer import call

    trace = LiveStorages()
    with recording(132):
        layer, cu, shape = layer_shape(name)
        with trace:
            x = torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True)
            y = call(layer, "ours", x, cu)
            trace.phase = "backward"
            y.backward(torch.ones_like(y))
    return trace, x.shape[0] * x.shape[1]


def op_step(name):
    """One fwd+bwd of the op on a shape of benchmarks/bench_kernels.py: (trace, tokens)."""
    from bench_kernels import SHAPES, shape_cu

    from flash_qla_cp import chunk_gated_delta_rule

    B, T, H, HV, K, V, nseq = SHAPES[name]
    cu = shape_cu(name).to(torch.int32) if nseq else None
    if nseq:
        B, T = 1, B * T
    trace = LiveStorages()
    with recording(132), trace:
        q, k = (torch.zeros(B, T, H, K, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        v = torch.zeros(B, T, HV, V, dtype=torch.bfloat16, requires_grad=True)
        g, beta = (torch.zeros(B, T, HV, requires_grad=True) for _ in range(2))
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu,
                                      cu_seqlens_cpu=cu.cpu() if cu is not None else None)
        trace.phase = "backward"
        o.backward(torch.ones_like(o))
    return trace, B * T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--checkpoint-blocks", action="store_true")
    ap.add_argument("--layer", help="a shape of benchmarks/bench_layer.py: one fwd+bwd of our GatedDeltaNet")
    ap.add_argument("--op", help="a shape of benchmarks/bench_kernels.py: one fwd+bwd of the op")
    ap.add_argument("--top", type=int, default=12, help="how many of the allocations alive at the peak to list")
    args = ap.parse_args()
    if args.layer:
        trace, T = layer_step(args.layer)
        what = f"our layer's fwd+bwd, {args.layer}"
    elif args.op:
        trace, T = op_step(args.op)
        what = f"the op's fwd+bwd, {args.op}"
    else:
        trace, T = training_step(args.seq_len, args.checkpoint_blocks), args.seq_len
        what = f"training step, {'with' if args.checkpoint_blocks else 'without'} --checkpoint-blocks"
    print(f"peak {trace.peak / 2**30:.2f} GiB = {trace.peak / T / 1024:.1f} KiB per token ({T} tokens, {what})")
    by_kind = collections.Counter()
    count = collections.Counter()
    for size, kind in trace.at_peak:
        by_kind[kind] += size
        count[kind] += 1
    for kind, size in by_kind.most_common(args.top):
        print(f"{size / 2**20:8.0f} MiB {size / T / 1024:8.1f} KiB/token  {count[kind]:3d} x {kind}")


if __name__ == "__main__":
    main()
