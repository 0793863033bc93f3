"""Quick GPU check of the fused backward walk on check_split's varlen_odd_p8
case (where v2's race showed): three runs must give bitwise equal gradients, and each gradient
must agree with the three-kernel backward to within bf16 noise (no float64 reference: fast).

    python tests/gpu/check_walk_determinism.py      (exit 1 on a mismatch)
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from check_split import make_case, run  # noqa: E402

from flash_qla_cp.kernels import tilelang_bwd_impl as bwd  # noqa: E402


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    case = make_case([16384, 1000, 3001], False, 4, 2, 128, seed=0)
    with bwd.switches(FUSED_WALK="off"):
        three = run(case, torch.bfloat16, "tilelang", 8)
    with bwd.switches(FUSED_WALK="on"):
        runs = [run(case, torch.bfloat16, "tilelang", 8) for _ in range(3)]
    same = all(torch.equal(r[k], runs[0][k]) for r in runs[1:] for k in runs[0])
    diff = {k: round(rel(runs[0][k], three[k]), 6) for k in three}
    nan = [k for k in runs[0] if not torch.isfinite(runs[0][k]).all()]
    ok = same and not nan and all(v < 1e-2 for v in diff.values())
    print(json.dumps({"ok": ok, "deterministic": same, "nan": nan, "ws_vs_three_kernels": diff}), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
