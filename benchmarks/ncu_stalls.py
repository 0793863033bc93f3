"""Where a warp-specialised kernel's warps wait: per-instruction stall samples from ncu, summed
per warp role and per kind of instruction.

    python benchmarks/ncu_stalls.py ncu_sass.csv[.xz] [--top 20]

Input: `ncu -i REPORT --page source --print-source sass --csv` (the `ncu` phase of
tests/gpu/device_session.sh writes it). The roles are told apart by the `USETMAXREG`
instruction each warpgroup's branch starts with (setmaxnreg): region 0 is the common prologue,
regions 1.. the branches in the order the compiler laid them out (for our ws kernels: the
consumers, then the loader; check the top instructions to name them).
"""

import argparse
import csv
import io
import lzma
import re
from collections import Counter, defaultdict

KINDS = (  # first match wins
    ("wgmma wait", re.compile(r"WARPGROUP\.(DEPBAR|ARRIVE)|WARPSYNC")),
    ("wgmma", re.compile(r"HGMMA|WGMMA")),
    ("mbarrier wait", re.compile(r"SYNCS\.PHASECHK|SYNCS\.ARRIVE")),
    ("named barrier", re.compile(r"\bBAR\b|BAR\.")),
    ("shared ld/st", re.compile(r"\b(LDS|STS|LDSM|STSM)")),
    ("global ld/st", re.compile(r"\b(LDG|STG|LD\.|ST\.)")),
    ("shuffle", re.compile(r"SHFL")),
    ("math", re.compile(r"\b(FFMA|FMUL|FADD|MUFU|FMNMX|F2F|F2FP|HADD2|HMUL2|HFMA2|FSETP|FSEL)")),
)


def read_rows(path):
    raw = lzma.open(path, "rt") if path.endswith(".xz") else open(path)
    text = raw.read()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if '"Source"' in line or line.startswith("Address"))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv_path")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    rows = read_rows(args.csv_path)
    cols = list(rows[0].keys())
    sample_col = next(c for c in cols if "Warp Stall Sampling (All" in c)
    region, per_region = 0, defaultdict(list)
    for row in rows:
        if "USETMAXREG" in row["Source"]:
            region += 1
        per_region[region].append(row)
    total = sum(number(r[sample_col]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} samples ({sample_col})")
    for reg, rs in sorted(per_region.items()):
        samples = sum(number(r[sample_col]) for r in rs)
        kinds = Counter()
        for r in rs:
            kind = next((name for name, pat in KINDS if pat.search(r["Source"])), "other")
            kinds[kind] += number(r[sample_col])
        print(f"\n== region {reg}: {len(rs)} instructions, {100 * samples / total:.1f}% of samples")
        print("   by kind: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in kinds.most_common() if v))
        top = sorted(range(len(rs)), key=lambda i: -number(rs[i][sample_col]))[: args.top]
        for i in sorted(top):
            r = rs[i]
            print(f"   {100 * number(r[sample_col]) / total:5.1f}%  #{i:5d}  {r['Source'][:90]}")


if __name__ == "__main__":
    main()
