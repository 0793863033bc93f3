"""Compile the TileLang kernels of a model's GDN layers ahead of a job.

    python -m flash_qla_cp.precompile --heads 16 --v-heads 32 --head-dim 128 [--dtype bf16]
        [--layer qwen3_next [--conv-size 4] [--norm-eps 1e-6] [--allow-neg-eigval]] [--list]
    python -m flash_qla_cp.precompile --config path/to/model [--dtype bf16] [--list]

`--config` reads the heads, head dims, projection layout, conv width, norm eps and dtype of a
Hugging Face Qwen3-Next / Qwen3.5 model from its config.json (the file, or the model's directory)
and includes the fused layer's kernels.

Fills TileLang's kernel cache (TILELANG_CACHE_DIR, ~/.tilelang/cache by default) with every kernel
the forward and backward plans may choose for that head configuration on this GPU: dense and
packed batches of any number of sequences, with and without initial / final states, unsplit and
split by the intra-card CP, kept chunk states or not, the fused or the three-kernel backward;
with `--layer`, also `GatedDeltaNet`'s fused layer kernels for that projection layout.
Calls then load their kernels from the cache instead of compiling them. `--list` prints the
kernels without compiling (no GPU needed); `--sms` sets the SM count (default: the GPU's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import torch

from .backends import TILELANG_HEAD_DIMS
from .kernels import runtime
from .kernels.backward import plan_backward
from .kernels.forward import gated_norm_key, plan_forward
from .kernels.layer import plan_gated_norm, plan_layer_inputs
from .modules.hf_params import kwargs_from_config
from .reference.layer_steps import ProjectionLayout

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# walks = sequences (or partitions) x 1: the plans' tiles change where a grid starts to fill the GPU
WALK_COUNTS = tuple(2**i for i in range(13))


def forward_plans(H: int, HV: int, K: int, V: int, dtype: str, sms: int, walks: int, saves=(False, True),
                  gated_norm: tuple | None = None):
    """Every forward plan of `walks` walks for these heads on a GPU of `sms` SMs: dense and packed,
    with and without initial / final states, kept chunk states as `saves` lists, unsplit and (K, V
    <= 128) split into partitions of few sequences; gated_norm as `plan_forward` takes it."""
    split_seqs = (1, max(1, walks // 8)) if max(K, V) <= 128 and walks >= 2 else ()
    for varlen in (False, True):
        for use_h0 in (False, True):
            for final in (False, True):
                for save in saves:
                    for seqs in (0, *split_seqs):
                        yield plan_forward(H, HV, K, V, dtype, K**-0.5, varlen, use_h0, final, False, walks, sms,
                                           seqs, save, gated_norm=gated_norm)


def backward_plans(H: int, HV: int, K: int, V: int, dtype: str, sms: int, walks: int, sum_v_heads: bool = True):
    """Every backward plan of `walks` walks for these heads: with and without initial states,
    final-state gradients and kept chunk states, unsplit and (K, V <= 128) split; sum_v_heads as
    `plan_backward` takes it (False: the fused layer's, which takes per-v-head parts)."""
    split_seqs = (1, max(1, walks // 8)) if max(K, V) <= 128 and walks >= 2 else ()
    for use_h0 in (False, True):
        for use_dht in (False, True):
            for saved in (False, True):
                for seqs in (0, *split_seqs):
                    yield plan_backward(H, HV, K, V, dtype, K**-0.5, use_h0, use_dht, walks, sms, seqs, saved,
                                        sum_v_heads=sum_v_heads)


def head_config_specs(H: int, HV: int, K: int, V: int, dtype: str, sms: int) -> list:
    """Every KernelSpec the plans choose for these heads on a GPU of `sms` SMs, once each, in the
    order the plans name them."""
    specs = {}
    for walks in WALK_COUNTS:
        for plan in forward_plans(H, HV, K, V, dtype, sms, walks):
            specs.update(dict.fromkeys(plan.specs()))
        for plan in backward_plans(H, HV, K, V, dtype, sms, walks):
            specs.update(dict.fromkeys([plan.prepare, *plan.specs()]))
    return list(specs)


LAYOUTS = {"qwen3_next": ProjectionLayout.qwen3_next, "qwen3_5": ProjectionLayout.qwen3_5}


def layer_specs(H: int, HV: int, K: int, V: int, dtype: str, layout: str, conv_size: int, allow_neg_eigval: bool,
                norm_eps: float, sms: int) -> list:
    """The fused GatedDeltaNet layer's kernels (`kernels/layer.py`) for one projection layout, and
    the op's inference walks that apply its gated norm (on a GPU of `sms` SMs)."""
    lay = LAYOUTS[layout](H, HV, K, V)
    norm = gated_norm_key(lay.width, lay.z_offset, lay.z_head_stride, norm_eps)
    walks = {plan.fused: None for count in WALK_COUNTS
             for plan in forward_plans(H, HV, K, V, dtype, sms, count, saves=(False,), gated_norm=norm)
             if plan.applies_norm}
    # the inputs step's backward reads dq, dk summed, or as the op's per-v-head parts (GVA), which
    # the backward walks then write (no v-head chain)
    inputs = [*plan_layer_inputs(lay, conv_size, dtype, allow_neg_eigval).specs()]
    parts_backward = {}
    if HV > H:
        inputs.append(plan_layer_inputs(lay, conv_size, dtype, allow_neg_eigval, HV // H).backward)
        parts_backward = {spec: None for count in WALK_COUNTS
                          for plan in backward_plans(H, HV, K, V, dtype, sms, count, sum_v_heads=False)
                          for spec in plan.specs()}
    return [*inputs, *plan_gated_norm(lay, dtype, norm_eps).specs(), *walks, *parts_backward]


def config_settings(path: str) -> dict:
    """The precompile settings of a Hugging Face Qwen3-Next / Qwen3.5 config.json (`path`: the file
    or the model's directory): heads, head dims, layer layout, conv width, norm eps, and the dtype
    where the config names bf16 or fp16 (else None)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        outer = config = json.load(f)
    if "linear_num_key_heads" not in config:  # (multimodal Qwen3.5 configs nest the language model's)
        config = config.get("text_config") or {}
    if "linear_num_key_heads" not in config:
        raise ValueError(f"{path}: no linear_num_key_heads, not a Qwen3-Next / Qwen3.5 config")
    layer = kwargs_from_config(SimpleNamespace(**config))
    named = [c.get(key) for c in (config, outer) for key in ("dtype", "torch_dtype")]
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(next((d for d in named if d), None))
    return {"heads": layer["num_heads"], "v_heads": layer["num_v_heads"], "head_k_dim": layer["head_k_dim"],
            "head_v_dim": layer["head_v_dim"], "layer": layer["proj_layout"], "conv_size": layer["conv_size"],
            "norm_eps": layer["norm_eps"], "dtype": dtype}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flash_qla_cp.precompile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="a Hugging Face Qwen3-Next / Qwen3.5 config.json or model directory (instead "
                                     "of --heads ... --layer ...)")
    ap.add_argument("--heads", type=int, default=None, help="q / k heads (H)")
    ap.add_argument("--v-heads", type=int, default=None, help="v heads (HV, a multiple of H; default H)")
    ap.add_argument("--head-dim", type=int, default=128, help="K and V, unless --head-k-dim / --head-v-dim")
    ap.add_argument("--head-k-dim", type=int, default=None)
    ap.add_argument("--head-v-dim", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="comma-separated: bf16, fp16 (default: the config's, else bf16)")
    ap.add_argument("--layer", choices=sorted(LAYOUTS), default=None,
                    help="also the fused GatedDeltaNet layer's kernels for this projection layout")
    ap.add_argument("--conv-size", type=int, default=None, help="the layer's short conv width (with --layer; "
                                                                "default 4)")
    ap.add_argument("--norm-eps", type=float, default=None, help="the layer's gated RMSNorm eps (with --layer; "
                                                                 "default 1e-6)")
    ap.add_argument("--allow-neg-eigval", action="store_true", help="the layer's beta in (0, 2) (with --layer)")
    ap.add_argument("--sms", type=int, default=None, help="SM count (default: the GPU's)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--list", action="store_true", help="print the kernels, compile nothing")
    args = ap.parse_args(argv)
    if (args.config is None) == (args.heads is None):
        ap.error("give either --config or --heads")
    if args.config is not None:
        model_options = ("v_heads", "head_k_dim", "head_v_dim", "layer", "conv_size", "norm_eps")
        given = [f"--{name.replace('_', '-')}" for name in model_options if getattr(args, name) is not None]
        if given:
            ap.error(f"--config sets the model's heads and layer; leave out {', '.join(given)}")
        try:
            settings = config_settings(args.config)
        except (OSError, ValueError, KeyError) as exc:
            ap.error(f"--config {args.config}: {exc}")
        config_dtype = settings.pop("dtype")
        vars(args).update(settings, dtype=args.dtype or config_dtype)
    args.dtype = args.dtype or "bf16"
    args.conv_size = 4 if args.conv_size is None else args.conv_size
    args.norm_eps = 1e-6 if args.norm_eps is None else args.norm_eps
    H, HV = args.heads, args.v_heads or args.heads
    K, V = args.head_k_dim or args.head_dim, args.head_v_dim or args.head_dim
    if H < 1 or HV % H or min(K, V) < 1:
        ap.error(f"--v-heads ({HV}) must be a positive multiple of --heads ({H}); head dims must be positive")
    if K not in TILELANG_HEAD_DIMS or V not in TILELANG_HEAD_DIMS:
        ap.error(f"the TileLang kernels support head dims {TILELANG_HEAD_DIMS}, got K={K}, V={V}")
    if any(d not in DTYPES for d in args.dtype.split(",")):
        ap.error(f"--dtype must name {sorted(DTYPES)}, got {args.dtype!r}")
    if args.sms is not None and args.sms < 1:
        ap.error(f"--sms must be a positive SM count, got {args.sms}")
    if args.workers < 1:
        ap.error(f"--workers must be at least 1, got {args.workers}")
    if not 0 <= args.norm_eps < math.inf:
        ap.error(f"--norm-eps must be a finite number >= 0, got {args.norm_eps}")
    if args.sms is None and not torch.cuda.is_available():
        ap.error("no GPU here: pass --sms (an H200 has 132) to list or compile for one")
    sms = args.sms or runtime.sm_count(torch.device("cuda"))
    specs = [s for d in args.dtype.split(",") for s in head_config_specs(H, HV, K, V, DTYPES[d], sms)]
    if args.layer:
        if not 2 <= args.conv_size <= 16:
            ap.error(f"--conv-size must be 2 to 16 (the layer kernels' window), got {args.conv_size}")
        specs += [s for d in args.dtype.split(",") for s in layer_specs(
            H, HV, K, V, DTYPES[d], args.layer, args.conv_size, args.allow_neg_eigval, args.norm_eps, sms)]
    if args.list:
        for spec in specs:
            print(spec.name, spec.kwargs)
        print(f"{len(specs)} kernels")
        return 0
    start = time.time()
    for i in range(0, len(specs), args.workers):  # in batches: progress on a long compile
        runtime.precompile(specs[i : i + args.workers], num_workers=args.workers)
        print(f"{min(i + args.workers, len(specs))} of {len(specs)} kernels ready, {time.time() - start:.0f} s",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
