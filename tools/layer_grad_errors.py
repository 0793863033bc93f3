"""Where the layer's gradient error comes from: the op's gradients (dv, dg, dbeta) inside our
GatedDeltaNet, fused and step by step, each against the same layer in float64 (torch backend),
on the accuracy check of benchmarks/bench_layer.py (its weights, input and output gradient).

    python tools/layer_grad_errors.py [--shape recipe_1x32k] [--tokens 4096] [--seeds 1]

Prints one JSON line: per path, the relative L2 error of each op gradient and of the parameter
gradients that sum them over tokens (dt_bias's, A_log's). A path whose op gradients match the
other's but whose sums do not loses accuracy after the op (the layer-inputs step); one whose dg
is already worse loses it in the op's backward or in the inputs it gave the op. With --seeds N
the input and output gradient are drawn N times (the weights stay bench_layer's): each error is
then the median over the draws, and `fused_ahead` counts the draws where the fused path's error
is the smaller (dt_bias's and A_log's are sums over tokens of 16-32 values each: one draw's
ranking of the two paths is noisy).
"""

import argparse
import json
import os
import statistics
import sys
from unittest import mock

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
sys.path.insert(0, os.path.join(HERE, ".."))

from bench_layer import SHAPES, make_layer  # noqa: E402

from flash_qla_cp import ops  # noqa: E402
from flash_qla_cp.modules import fused_mixer  # noqa: E402
from flash_qla_cp.testing import rel_err  # noqa: E402

# (dq, dk left out: the step path's are taken back through its l2 normalisation, the fused path's not)
OP_GRADS = {"dv": 2, "dg": 3, "dbeta": 4}


def op_gradients(layer, x, dy):
    """The op's gradients in one fwd+bwd of `layer` (fused: its backward's results; step path: the
    op's autograd), with the layer's dt_bias and A_log gradients."""
    seen = {}
    fused_bwd = fused_mixer.chunk_gated_delta_rule_bwd
    step_bwd = ops.chunk_gated_delta_rule_bwd

    def record(real):
        def wrapped(do, dht, ctx):
            grads = real(do, dht, ctx)
            seen.update({name: grads[i].detach().clone() for name, i in OP_GRADS.items()})
            return grads
        return wrapped

    xl = x.clone().requires_grad_(True)
    with mock.patch.object(fused_mixer, "chunk_gated_delta_rule_bwd", record(fused_bwd)), \
            mock.patch.object(ops, "chunk_gated_delta_rule_bwd", record(step_bwd)):
        layer(xl).backward(dy.to(x.dtype))
    seen["ddt_bias"], seen["dA_log"] = layer.dt_bias.grad, layer.A_log.grad
    return seen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="recipe_1x32k", help="a shape of benchmarks/bench_layer.py")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=1, help="draws of the input and output gradient")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    hidden, H, HV, D = SHAPES[args.shape][:4]
    device = torch.device(args.device)
    ref = make_layer("ours", hidden, H, HV, D, device, torch.float64)
    ref.backend = "torch"
    layers = {lib: make_layer(lib, hidden, H, HV, D, device, torch.bfloat16) for lib in ("ours", "ours_steps")}
    draws = {lib: [] for lib in layers}
    for seed in range(args.seeds):
        torch.manual_seed(1 + seed)
        x = torch.randn(1, args.tokens, hidden, device=device, dtype=torch.float64)
        dy = torch.randn_like(x)
        for lib, layer in layers.items():
            ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
            ref.zero_grad()
            layer.zero_grad()
            want = op_gradients(ref, x, dy)
            got = op_gradients(layer, x.to(torch.bfloat16), dy)
            draws[lib].append({k: rel_err(got[k], want[k]) for k in want})
    names = list(draws["ours"][0])
    errors = {lib: {k: f"{statistics.median(d[k] for d in rows):.1e}" for k in names} for lib, rows in draws.items()}
    ahead = {k: sum(f[k] < s[k] for f, s in zip(draws["ours"], draws["ours_steps"])) for k in names}
    print(json.dumps({"shape": args.shape, "tokens": args.tokens, "seeds": args.seeds, "device": str(device),
                      "errors": errors, "fused_ahead": ahead}))


if __name__ == "__main__":
    main()
