"""Per-kernel GPU time of several source trees of this project on one GPU, in turns, so that a
kernel change is compared with its base on the same machine in one device call.

    python tools/compare_trees.py --trees main=.,walk=/tmp/trees/walk --shapes tp1_1x32k,tp1_4x8k --rounds 2

Each round runs `tools/profile_kernels.py` of every tree in turn, in a fresh process with that tree
first on PYTHONPATH (TileLang's kernel cache is shared: a kernel both trees build the same way is
compiled once), and prints, per tree, shape and pass, the kernels' total ms per call and the
kernels whose names contain a --kernels substring. A tree is a checkout or an unpacked archive of
one (`git archive HEAD flash_qla_cp tools benchmarks | xz > .device/trees/NAME.tar.xz`;
`tools/device_session.sh compare` unpacks those). Writes compare_trees.json into --out.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile


def profile(tree: str, shapes: str, intra: str, iters: int, out: str) -> list:
    """profile_kernels.py's entries for one tree (its own copy of the tool and the package)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    run = subprocess.run([sys.executable, os.path.join(tree, "tools", "profile_kernels.py"), "--shapes", shapes,
                          "--intra", intra, "--iters", str(iters), "--out", out], cwd=tree, env=env,
                         capture_output=True, text=True)
    entries = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not entries:
        raise SystemExit(f"profile_kernels.py of {tree} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return entries


def summary(name: str, round_: int, entry: dict, kernels: list) -> dict:
    picked = {k: round(sum(ms for kname, ms, _ in entry["kernels"] if k in kname), 4) for k in kernels}
    return {"tree": name, "round": round_, "shape": entry["shape"], "intra": entry["intra"], "pass": entry["pass"],
            "total_ms": entry["total_ms"], "wall_ms": entry["wall_ms"], **picked}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", required=True, help="NAME=PATH,... (PATH: a checkout or an unpacked archive)")
    ap.add_argument("--shapes", default="tp1_1x32k,tp1_4x8k", help="shapes of benchmarks/bench_kernels.py")
    ap.add_argument("--intra", default="auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--passes", default="fwd,fwdbwd", help="of profile_kernels.py: fwd, fwd_train, fwdbwd")
    ap.add_argument("--kernels", default="bwd_fused,fwd_fused,prepare", help="kernel name substrings to list")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = ap.parse_args()
    trees = []
    for item in args.trees.split(","):
        name, sep, path = item.partition("=")
        if not sep or not os.path.isfile(os.path.join(path, "tools", "profile_kernels.py")):
            ap.error(f"--trees {item!r}: expected NAME=PATH with PATH holding tools/profile_kernels.py")
        trees.append((name, os.path.abspath(path)))
    passes = set(args.passes.split(","))
    kernels = [k for k in args.kernels.split(",") if k]
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="compare_trees_") as scratch:  # profile_kernels.py's own files
        for round_ in range(1, args.rounds + 1):
            for name, path in trees:
                for entry in profile(path, args.shapes, args.intra, args.iters, scratch):
                    if entry["pass"] in passes:
                        rows.append(summary(name, round_, entry, kernels))
                        print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "compare_trees.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
