"""Pretraining loop for the hybrid GDN LM, as a library (`main(argv)`), for 1 process or torchrun.

    torchrun --standalone --nproc-per-node 2 examples/pretrain.py --cp 2 --steps 100 --seq-len 2048

Parallelism: world = dp * cp. Ranks [g*cp, (g+1)*cp) form CP group g. Every step the packer
yields one global packed row of --seq-len tokens; it is cut into dp equal rows (documents
crossing a cut are split there), and CP group g's row is cut into cp contiguous slices described
by a `CPContext`, one per rank. The parameters are replicated.

Loss: each rank sums the token cross-entropy of its own tokens and divides by the number of
targets in the whole global batch (identical on every rank), so the sum over ranks is the
global token mean -- the same number with or without CP. Gradients are sum-all-reduced over all
ranks (CP and DP together), which makes them exactly the gradient of that global mean.

Checkpoints (`--save DIR`, `--resume DIR`): DIR/checkpoint.pt, a plain dict with the model and
optimizer state_dicts, the step, the RNG states and the arguments, written by rank 0. The data
order is a pure function of (seed, step), so a resumed run continues the same loss curve.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import random
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flash_qla_cp import CPContext

from .data import IGNORE_INDEX, ByteTokenizer, DocumentPacker, PackedBatch
from .model import HybridLM, HybridLMConfig, training_flops

CHECKPOINT_NAME = "checkpoint.pt"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _intra_cp(text: str):
    if text in ("auto", "off"):
        return text
    try:
        return _positive_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be off, auto or a number of partitions, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Pretrain a small hybrid Gated DeltaNet LM (flash_qla_cp).")
    p.add_argument("--steps", type=_positive_int, default=100, help="total optimizer steps (a resumed run stops here too)")
    p.add_argument("--seq-len", type=_positive_int, default=2048, help="tokens per step, global (all ranks together)")
    p.add_argument("--cp", type=_positive_int, default=1, help="context-parallel degree; world size must be a multiple")
    p.add_argument("--layers", type=_positive_int, default=4)
    p.add_argument("--hidden", type=_positive_int, default=128)
    p.add_argument("--heads", type=_positive_int, default=2, help="GDN q/k heads (and attention heads)")
    p.add_argument("--v-heads", type=_positive_int, default=None, help="GDN value heads (GVA); default --heads")
    p.add_argument("--head-dim", type=_positive_int, default=None, help="GDN head dim; default hidden // heads")
    p.add_argument("--attn-every", type=_non_negative_int, default=0, help="every k-th block is softmax attention (0: none)")
    p.add_argument("--cp-intra", default=None, type=_intra_cp,
                   help="intra-card CP split inside each rank: off | auto | N partitions (CPContext.build(intra_cp=); "
                        "with --cp 1 the op's intra_cp). Default: auto on CUDA (split inside the TileLang "
                        "kernels for sequences of 16k tokens and more), off on CPU")
    p.add_argument("--lr", type=_positive_float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=_ratio, default=1.0,
                   help="cosine decay to lr * ratio over --decay-steps (1.0: constant after warm-up)")
    p.add_argument("--decay-steps", type=_non_negative_int, default=0, help="cosine horizon (0: --steps)")
    p.add_argument("--warmup", type=_non_negative_int, default=0, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=_non_negative_float, default=0.1)
    p.add_argument("--clip", type=_non_negative_float, default=1.0, help="global grad-norm clip (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-doc-bytes", type=_non_negative_int, default=64,
                   help="merge consecutive corpus paragraphs into documents of at least this many bytes "
                        "(large values make long documents that span CP ranks)")
    p.add_argument("--save", default=None, help="checkpoint directory to write (at the end and every --save-every)")
    p.add_argument("--save-every", type=_non_negative_int, default=0)
    p.add_argument("--resume", default=None, help="checkpoint directory to resume from (if it holds one)")
    p.add_argument("--log-every", type=_positive_int, default=10)
    p.add_argument("--metrics-out", default=None, help="rank 0 appends one JSON line per step (step, loss, ...)")
    p.add_argument("--recompute-states", action="store_true",
                   help="GDN backward recomputes the chunk states instead of keeping them from the forward "
                        "(less memory between forward and backward, one more state walk; save_states=False)")
    p.add_argument("--checkpoint-blocks", action="store_true",
                   help="activation checkpointing per block: far less activation memory, ~1/3 more compute")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="auto: bf16 autocast on GPU, fp32 on CPU")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "tilelang"), help="GDN kernel backend")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    p.add_argument("--timeout", type=_positive_float, default=5.0,
                   help="minutes a collective may wait for the other ranks before the job fails (a stalled "
                        "or failed rank then ends the run on every rank instead of hanging)")
    p.add_argument("--peak-tflops", type=_positive_float, default=None,
                   help="the device's dense bf16 peak, for the model FLOP utilisation (MFU) in the log; "
                        "default: 989 on H100 / H200 with bf16, else no MFU")
    p.add_argument("--threads", type=_non_negative_int, default=1,
                   help="CPU threads per process (0: cores / local processes). 1 is the default: small CPU "
                        "ops gain little from more and collapse when the cores are shared")
    return p


def peak_tflops(args, device: torch.device, bf16: bool):
    """Dense bf16 TFLOP/s of one device for the MFU column: --peak-tflops, else H100 / H200 SXM's
    989 when training in bf16, else None (no MFU printed)."""
    if args.peak_tflops is not None:
        return args.peak_tflops
    if device.type == "cuda" and bf16 and any(n in torch.cuda.get_device_name(device) for n in ("H100", "H200")):
        return 989.0
    return None


def step_doc_lengths(batch: PackedBatch, dp: int) -> list[int]:
    """Lengths of the documents of one global step (every DP row's)."""
    rows = batch.split(dp) if dp > 1 else [batch]
    return [n for row in rows for n in (row.cu_seqlens[1:] - row.cu_seqlens[:-1]).tolist()]


# ----------------------------------------------------------------------------- distributed set-up


class Dist:
    """World, CP and DP layout of this process."""

    def __init__(self, cp: int, device_arg: str, timeout_minutes: float = 5.0):
        self.launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if device_arg == "auto":
            device_arg = "cuda" if torch.cuda.is_available() else "cpu"
        if device_arg == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("--device cuda but CUDA is not available")
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device(device_arg)
        if cp < 1 or self.world % cp:
            raise SystemExit(f"--cp {cp} must divide the world size {self.world}")
        self.cp, self.dp = cp, self.world // cp
        self.cp_rank, self.dp_rank = self.rank % cp, self.rank // cp
        self.cp_group = None
        if self.launched and self.world > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            kw = {"device_id": self.device} if self.device.type == "cuda" else {}
            # a rank that stalls or dies makes the others' next collective fail after this long
            # (torch's default is 30 minutes); the failed rank's exit then ends the torchrun job
            timeout = datetime.timedelta(minutes=timeout_minutes)
            dist.init_process_group(backend=backend, timeout=timeout, **kw)
            for g in range(self.dp):  # every rank must take part in creating every group
                ranks = list(range(g * cp, (g + 1) * cp))
                grp = dist.new_group(ranks, timeout=timeout)
                if g == self.dp_rank:
                    self.cp_group = grp
        elif self.world > 1:
            raise SystemExit("WORLD_SIZE > 1 without RANK: launch with torchrun")

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def barrier(self):
        if self.distributed:
            dist.barrier()

    def close(self):
        if self.distributed:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- data slicing


def parse_intra(text, device_type: str = "cpu"):
    """--cp-intra: 'auto' / 'off' stay strings, a number becomes the partition count; not given:
    'auto' on CUDA (the TileLang kernels split where heads are few), 'off' on CPU."""
    if text is None:
        return "auto" if device_type == "cuda" else "off"
    return _intra_cp(str(text))


def build_cp_context(row: PackedBatch, d: Dist, intra=None):
    """The CPContext of this rank for the CP group's row (None when cp == 1)."""
    if d.cp == 1:
        return None
    return CPContext.build(row.cu_seqlens, group=d.cp_group, intra_cp=parse_intra(intra, d.device.type))


def local_slice(row: PackedBatch, d: Dist, cp_context) -> tuple[int, int]:
    if cp_context is None:
        return 0, row.num_tokens
    return cp_context.token_range


# ----------------------------------------------------------------------------- model / optimizer


def model_config(args, device_type: str = "cpu") -> HybridLMConfig:
    gdn_kwargs = {}
    if args.backend != "auto":
        gdn_kwargs["backend"] = args.backend
    if args.cp == 1:  # no CPContext then: the op's own intra-card switch
        gdn_kwargs["intra_cp"] = parse_intra(args.cp_intra, device_type)
    if args.recompute_states:
        gdn_kwargs["save_states"] = False
    return HybridLMConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_v_heads=args.v_heads,
        head_k_dim=args.head_dim,
        head_v_dim=args.head_dim,
        attn_every=args.attn_every,
        gdn_kwargs=gdn_kwargs,
    )


def make_optimizer(model, args):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.dim() < 2 or "embed" in name or getattr(p, "_no_weight_decay", False)
        (no_decay if skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {"foreach": False} if next(model.parameters()).device.type == "cpu" else {}
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **kw)


def lr_at(step: int, args) -> float:
    """Learning rate of (0-based) step `step`."""
    if args.warmup and step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.min_lr_ratio >= 1.0:
        return args.lr
    horizon = args.decay_steps or args.steps
    t = min(1.0, (step - args.warmup) / max(1, horizon - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def all_reduce_grads(model, d: Dist):
    if not d.distributed:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    i = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[i : i + n].view_as(p).clone()
        i += n


# ----------------------------------------------------------------------------- checkpoints


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all(state["cuda"])
        except Exception:  # a different GPU count: keep the fresh seeds
            pass


def save_checkpoint(path_dir: str, model, optimizer, step: int, args, d: Dist):
    if d.rank == 0:
        os.makedirs(path_dir, exist_ok=True)
        payload = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "rng": rng_state(),
            "args": vars(args),
        }
        tmp = os.path.join(path_dir, CHECKPOINT_NAME + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, os.path.join(path_dir, CHECKPOINT_NAME))
    d.barrier()


def checkpoint_file(resume: str, save: str | None) -> str | None:
    """The checkpoint --resume names: DIR/checkpoint.pt, or the file itself. None only where a run
    resumes from its own --save directory that holds none yet (a first run); any other path
    without a checkpoint is an error, never a silent start from step 0."""
    if os.path.isfile(resume):
        return resume
    path = os.path.join(resume, CHECKPOINT_NAME)
    if os.path.isfile(path):
        return path
    if save is not None and os.path.abspath(resume) == os.path.abspath(save):
        return None
    raise SystemExit(f"--resume {resume}: no checkpoint there (expected {path} or a checkpoint file)")


def load_checkpoint(path: str, model, optimizer, args) -> int:
    """Load a checkpoint written by `save_checkpoint`; returns its step. Unreadable files and
    checkpoints of another model configuration end the run with a message naming --resume."""
    try:  # on the CPU: the RNG states must stay CPU byte tensors; load_state_dict moves the rest
        payload = torch.load(path, map_location="cpu", weights_only=False)
        state, optim, rng, step = payload["model"], payload["optimizer"], payload["rng"], int(payload["step"])
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same message
        raise SystemExit(f"--resume {path}: not a readable checkpoint ({type(exc).__name__}: {exc})") from None
    try:
        model.load_state_dict(state)
    except RuntimeError:
        saved = payload.get("args", {})
        keys = ("layers", "hidden", "heads", "v_heads", "head_dim", "attn_every")
        differ = {k: (saved.get(k), getattr(args, k, None)) for k in keys if saved.get(k) != getattr(args, k, None)}
        raise SystemExit(f"--resume {path}: the checkpoint is of another model configuration "
                         f"(flag: checkpoint's, this run's): {differ}") from None
    optimizer.load_state_dict(optim)
    set_rng_state(rng)
    return step


# ----------------------------------------------------------------------------- main loop


def _log(d: Dist, msg: str):
    if d.rank == 0:
        print(msg, flush=True)


def main(argv=None) -> list[float]:
    """Run training; returns the per-step global losses (on every rank)."""
    args = build_parser().parse_args(argv)
    d = Dist(args.cp, args.device, args.timeout)
    threads = torch.get_num_threads()
    try:
        return _train(args, d)
    finally:
        torch.set_num_threads(threads)
        d.close()


def _train(args, d: Dist) -> list[float]:
    if d.rank == 0:  # the kernel build rounds of a first step (tens of seconds on a cold cache) in the log
        logging.basicConfig(format="%(message)s")
        logging.getLogger("flash_qla_cp").setLevel(logging.INFO)
    if d.device.type == "cpu":
        threads = args.threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        torch.set_num_threads(threads)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        if d.device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.seq_len % (d.dp * d.cp):
        raise SystemExit(f"--seq-len {args.seq_len} must be a multiple of dp * cp = {d.dp * d.cp}")
    use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and d.device.type == "cuda")
    autocast = torch.autocast(d.device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()

    # identical initialisation on every rank (and broadcast from rank 0 to be sure)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    cfg = model_config(args, d.device.type)
    model = HybridLM(cfg).to(d.device)
    model.checkpoint_blocks = args.checkpoint_blocks
    if d.distributed:
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    optimizer = make_optimizer(model, args)
    packer = DocumentPacker(args.seq_len, seed=args.seed, min_doc_bytes=args.min_doc_bytes)

    start_step = 0
    if args.resume:
        path = checkpoint_file(args.resume, args.save)
        if path is None:
            _log(d, f"no checkpoint in {args.resume} yet: starting at step 0")
        else:
            start_step = load_checkpoint(path, model, optimizer, args)
            _log(d, f"resumed from {path} at step {start_step}")
    n_params = sum(p.numel() for p in model.parameters())
    _log(
        d,
        f"world {d.world} = dp {d.dp} x cp {d.cp} | device {d.device} | {'bf16 autocast' if use_bf16 else 'fp32'} | "
        f"params {n_params / 1e6:.2f}M | layers {cfg.num_layers} (attention every {cfg.attn_every or '-'}) | "
        f"hidden {cfg.hidden_size} | tokens/step {args.seq_len} | steps {start_step}->{args.steps}",
    )

    peak = peak_tflops(args, d.device, use_bf16)
    losses: list[float] = []
    t0 = time.perf_counter()
    t_last, tokens_since, flops_since = t0, 0, 0.0
    metrics = open(args.metrics_out, "a") if (args.metrics_out and d.rank == 0) else None
    try:
        for step in range(start_step, args.steps):
            batch = packer.batch(step)
            n_targets = batch.num_targets if d.dp == 1 else sum(r.num_targets for r in batch.split(d.dp))
            row = batch if d.dp == 1 else batch.split(d.dp)[d.dp_rank]
            cp_context = build_cp_context(row, d, args.cp_intra)
            lo, hi = local_slice(row, d, cp_context)
            ids = row.input_ids[lo:hi].to(d.device)[None]
            labels = row.labels[lo:hi].to(d.device)
            cu = row.cu_seqlens.to(d.device) if cp_context is None else None

            lr = lr_at(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                logits = model(ids, cu_seqlens=cu, cp_context=cp_context)
            loss_sum = F.cross_entropy(logits[0].float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
            (loss_sum / n_targets).backward()
            all_reduce_grads(model, d)
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()

            global_loss = d.all_reduce_sum(loss_sum.detach().double().reshape(1)).item() / n_targets
            losses.append(global_loss)
            tokens_since += args.seq_len
            flops_since += training_flops(model, step_doc_lengths(batch, d.dp))
            done = step + 1
            if metrics is not None:
                metrics.write(json.dumps({"step": done, "loss": global_loss, "lr": lr}) + "\n")
                metrics.flush()
            if args.log_every and (done % args.log_every == 0 or done == args.steps):
                if d.device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.perf_counter()
                tps = tokens_since / max(now - t_last, 1e-9)
                window = losses[-(tokens_since // args.seq_len):]
                mem = f" | peak GiB {torch.cuda.max_memory_allocated() / 2**30:.1f}" if d.device.type == "cuda" else ""
                mfu = (f" | MFU {100 * flops_since / max(now - t_last, 1e-9) / (d.world * peak * 1e12):.1f}%"
                       if peak else "")
                _log(d, f"step {done:5d} | loss {global_loss:.4f} | avg {sum(window) / len(window):.4f} | lr {lr:.2e} | "
                        f"tokens/s {tps:,.0f}{mfu} | elapsed {now - t0:.1f}s{mem}")
                t_last, tokens_since, flops_since = now, 0, 0.0
            if args.save and args.save_every and done % args.save_every == 0 and done != args.steps:
                save_checkpoint(args.save, model, optimizer, done, args, d)
        if args.save:
            save_checkpoint(args.save, model, optimizer, args.steps if args.steps > start_step else start_step, args, d)
            _log(d, f"saved {os.path.join(args.save, CHECKPOINT_NAME)}")
    finally:
        if metrics is not None:
            metrics.close()
    if losses:
        _log(d, f"done: {len(losses)} steps in {time.perf_counter() - t0:.1f}s, final loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
