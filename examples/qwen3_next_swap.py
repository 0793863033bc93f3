"""Swap a transformers Qwen3-Next model's Gated DeltaNet layers for flash_qla_cp's, check the logits, train.

    python examples/qwen3_next_swap.py --steps 20
    torchrun --standalone --nproc-per-node 2 examples/qwen3_next_swap.py --cp 2 --linear-only --steps 20

1. builds a tiny random `Qwen3NextForCausalLM` (byte vocabulary, dense MLPs; every 4th layer full
   attention unless --linear-only), and a copy with `replace_qwen3_next_gdn` applied (same weights);
2. checks that both give the same logits on corpus text (fp32, relative error < 1e-4);
3. trains the swapped model for --steps AdamW steps on the shipped corpus. Each step is one stream of
   --seq-len tokens (documents concatenated, BOS/EOS between them, as in plain causal-LM pretraining).

Under CP (--cp > 1, torchrun) each rank feeds its contiguous slice of the stream and the swapped GDN
layers get the `CPContext` through the model's forward kwargs (`cp_context=`). transformers' own
full-attention layers know nothing of CP, so CP needs --linear-only (for a hybrid model under CP see
examples/hybrid_lm). The loss is the mean over all tokens of the
stream on every rank, the same with or without CP.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch
import torch.nn.functional as F


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per step (global)")
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--linear-only", action="store_true", help="no full-attention layers (needed for --cp > 1)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default="auto", help="GDN backend: auto | torch | tilelang")
    p.add_argument("--metrics-out", default=None, help="rank 0 writes one JSON line per step")
    return p


def tiny_config(args, vocab_size: int):
    import transformers

    layer_types = [
        "full_attention" if (not args.linear_only and (i + 1) % 4 == 0) else "linear_attention"
        for i in range(args.layers)
    ]
    heads = max(1, args.hidden // 32)
    return transformers.Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers, layer_types=layer_types,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=32, intermediate_size=2 * args.hidden,
        linear_num_key_heads=heads, linear_num_value_heads=2 * heads, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4,
        mlp_only_layers=list(range(args.layers)),  # dense MLPs (no MoE) for a tiny CPU model
        max_position_embeddings=max(4096, args.seq_len), tie_word_embeddings=True,
    )


def use_torch_reference_kernels():
    """transformers binds its Qwen3-Next layer to FLA's / causal_conv1d's Triton kernels whenever those
    packages import, even on a machine with no GPU. On the CPU, point the layer back at transformers'
    own torch implementations (only the reference model uses them)."""
    import inspect

    from transformers.models.qwen3_next import modeling_qwen3_next as modeling

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        fn = getattr(modeling, name, None)
        if fn is not None:
            setattr(modeling, name, inspect.unwrap(fn))


def main(argv=None) -> list[float]:
    import transformers

    from flash_qla_cp.modules import Qwen3NextGatedDeltaNetFlash, replace_qwen3_next_gdn
    from hybrid_lm.data import ByteTokenizer, DocumentPacker
    from hybrid_lm.trainer import Dist, all_reduce_grads

    args = build_parser().parse_args(argv)
    d = Dist(args.cp, args.device)
    log = (lambda msg: print(msg, flush=True)) if d.rank == 0 else (lambda msg: None)
    try:
        if d.cp > 1 and not args.linear_only:
            raise SystemExit("--cp > 1 needs --linear-only: transformers' full-attention layers are not CP-aware")
        if d.dp > 1:
            raise SystemExit("this example runs CP only: use --cp equal to the number of processes")
        if args.seq_len % d.cp:
            raise SystemExit(f"--seq-len must be a multiple of --cp {d.cp}")
        if d.device.type == "cpu":
            torch.set_num_threads(1)  # small CPU ops: more threads only contend
            use_torch_reference_kernels()
        torch.manual_seed(args.seed)
        tok = ByteTokenizer()
        ref = transformers.Qwen3NextForCausalLM(tiny_config(args, tok.vocab_size)).to(d.device)
        model = copy.deepcopy(ref)
        n = replace_qwen3_next_gdn(model, backend=args.backend)
        assert all(isinstance(layer.linear_attn, Qwen3NextGatedDeltaNetFlash)
                   for layer in model.model.layers if hasattr(layer, "linear_attn"))
        packer = DocumentPacker(args.seq_len, seed=args.seed)

        # 1. same logits as transformers' own layers (one process's full stream, fp32)
        probe = packer.batch(10_000).input_ids[: min(256, args.seq_len)][None].to(d.device)
        with torch.no_grad():
            a, b = ref(probe, use_cache=False).logits.float(), model(probe, use_cache=False).logits.float()
        err = ((a - b).norm() / b.norm()).item()
        log(f"swapped {n} GDN layers; logits relative error vs transformers: {err:.2e}")
        if err > 1e-4:
            raise SystemExit(f"logits differ after the swap: relative error {err:.2e}")
        del ref

        # 2. train the swapped model
        cp_context = None
        if d.cp > 1:
            from flash_qla_cp import CPContext

            cp_context = CPContext.build(torch.tensor([0, args.seq_len], dtype=torch.int32), group=d.cp_group)
        lo, hi = cp_context.token_range if cp_context is not None else (0, args.seq_len)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
        model.train()
        losses, t0 = [], time.perf_counter()
        for step in range(args.steps):
            batch = packer.batch(step)
            ids = batch.input_ids  # one stream: predict every next token
            labels = torch.cat([ids[1:], ids.new_full((1,), -100)])
            n_targets = int((labels != -100).sum())
            x, y = ids[lo:hi][None].to(d.device), labels[lo:hi].to(d.device)
            kwargs = {"cp_context": cp_context} if cp_context is not None else {}
            pos = torch.arange(lo, hi, device=d.device)[None]
            logits = model(input_ids=x, position_ids=pos, use_cache=False, **kwargs).logits
            loss_sum = F.cross_entropy(logits[0].float(), y, ignore_index=-100, reduction="sum")
            opt.zero_grad(set_to_none=True)
            (loss_sum / n_targets).backward()
            all_reduce_grads(model, d)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss = d.all_reduce_sum(loss_sum.detach().double().reshape(1)).item() / n_targets
            losses.append(loss)
            if args.metrics_out and d.rank == 0:
                with open(args.metrics_out, "a") as f:
                    f.write(json.dumps({"step": step + 1, "loss": loss}) + "\n")
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                log(f"step {step + 1:4d} | loss {loss:.4f} | elapsed {time.perf_counter() - t0:.1f}s")
        return losses
    finally:
        d.close()


if __name__ == "__main__":
    main(sys.argv[1:])
