"""GPU: does a backward switch change the gradients? Runs the TileLang backward on the same inputs
with a tilelang_bwd_impl switch off and on (twice on), and reports per gradient how many elements
differ, in which rows of their chunk, the largest difference, and whether the two runs with the
switch on agree bitwise.

    python tests/gpu/compare_bwd_switch.py --switch POISON_BUFFERS [--out DIR]   (poisoned scratch buffers must change nothing)

Cases: GVA with two v-heads per qk-head, varlen with odd lengths (fused walk forced on) and 4 x 2k
on 16 / 32 heads (the fused walk by default). Writes compare_bwd_switch.json under --out.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from check_bwd import NAMES, case_inputs  # noqa: E402

from flash_qla_cp.kernels import tilelang_bwd_impl as bwd  # noqa: E402

CASES = {  # name: (T, H, HV, lengths, FUSED_WALK)
    "h2hv4_varlen_odd": (1943, 2, 4, [1, 63, 64, 65, 200, 517, 1033], "on"),
    "h16hv32_4x2k": (8192, 16, 32, [2048] * 4, "auto"),
}


def grads(x, cu, h0, dht, do, switches):
    with bwd.switches(**switches):
        out = bwd.tilelang_chunk_gated_delta_rule_bwd(do, dht, x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5,
                                                      h0, cu, None)
    torch.cuda.synchronize()
    return [None if t is None else t.clone() for t in out]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", required=True, help="a boolean switch of tilelang_bwd_impl")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    result = {}
    for name, (T, H, HV, lengths, fused) in CASES.items():
        x, cu, h0, dht, do = case_inputs(1, T, H, HV, 128, 128, torch.bfloat16, lengths, True, True, 0)
        base = grads(x, cu, h0, dht, do, {"FUSED_WALK": fused, args.switch: False})
        on = [grads(x, cu, h0, dht, do, {"FUSED_WALK": fused, args.switch: True}) for _ in range(2)]
        info = {}
        for gname, a, b, c in zip(NAMES, base, on[0], on[1]):
            if a is None:
                continue
            differ = a != b
            per_token = a.dim() >= 3 and a.shape[1] == T  # dq .. dbeta: rows are tokens (dh0 is not)
            rows = differ.reshape(a.shape[1], -1).any(-1).nonzero()[:, 0] if per_token else torch.zeros(0)
            info[gname] = {"elements_differ": int(differ.sum()), "of": differ.numel(),
                           "max_abs_diff": float((a.float() - b.float()).abs().max()),
                           "max_abs": float(a.float().abs().max()),
                           "switch_on_runs_equal": bool(torch.equal(b, c)),
                           "rows_in_chunk": torch.bincount(rows % 64, minlength=64).tolist() if rows.numel() else []}
        result[name] = info
        print(name, json.dumps({g: {k: v for k, v in d.items() if k != "rows_in_chunk"} for g, d in info.items()}),
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare_bwd_switch.json"), "w") as f:
        json.dump({"switch": args.switch, "cases": result}, f, indent=1)


if __name__ == "__main__":
    main()
