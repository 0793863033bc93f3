"""Hashes of every kernel's lowered CUDA source (sm_90a, no GPU), to show that a change of host
code or of file layout leaves the kernels as they were.

    python tools/kernel_source_hashes.py --out before.json          # on the old checkout
    python tools/kernel_source_hashes.py --compare before.json      # on the new one

Cases are those of `flash_qla_cp.kernels.lowering.lowering_cases()`, keyed by factory name and
parameters (so renamed cases still pair up). Two lowerings of one kernel differ only in the
numbering of TileLang's reduction workspaces; those names are normalised before hashing.
"""

import argparse
import hashlib
import json
import re
import sys
from concurrent.futures import ProcessPoolExecutor


def normalised(source: str) -> str:
    source = re.sub(r"red_buf\w*", "red_buf", source)
    return re.sub(r"workspace(_\d+)?\b", "workspace", source)


def _key(spec) -> str:
    return f"{spec.name}({', '.join(f'{k}={v!r}' for k, v in spec.params)})"


def _hash(index: int):
    from flash_qla_cp.kernels.lowering import lower_spec, lowering_cases

    spec = lowering_cases()[index].spec
    lowered = lower_spec(spec)
    return _key(spec), hashlib.sha256(normalised(lowered.source).encode()).hexdigest(), lowered.shared_memory_bytes


def main():
    from flash_qla_cp.kernels.lowering import lowering_cases

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write {case: [sha256, shared memory bytes]} here")
    ap.add_argument("--compare", help="a file written by --out: report every case that differs")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    with ProcessPoolExecutor(args.workers) as pool:
        hashes = {key: [h, smem] for key, h, smem in pool.map(_hash, range(len(lowering_cases())))}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(hashes, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        common = sorted(set(before) & set(hashes))
        differ = [k for k in common if before[k] != hashes[k]]
        for key in differ:
            print("differs:", key)
        print(f"{len(common) - len(differ)} of {len(common)} common kernels identical; "
              f"{len(set(hashes) - set(before))} new, {len(set(before) - set(hashes))} gone")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
