"""Where a warp-specialised kernel's warps wait: per-instruction stall samples from ncu, summed
per warp role, per kind of instruction and per ncu stall reason.

    python tools/ncu_stalls.py ncu_sass.csv[.xz] [--top 20]

Input: `ncu -i REPORT --page source --print-source sass --csv` (the `ncu` phase of
tools/device_session.sh writes it). The roles are told apart by the `USETMAXREG`
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

KINDS = (  # first match wins (a retry branch of an mbarrier try-wait is classed before these)
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
    with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if '"Source"' in line or line.startswith("Address"))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def kinds_of(rows):
    """Kind of each instruction; the conditional branch that retries an mbarrier try-wait
    (SYNCS.PHASECHK ... @!P BRA back) is where a warp waiting for a barrier sits."""
    out, last_try = [], -10
    for i, row in enumerate(rows):
        src = row["Source"]
        if "PHASECHK" in src:
            last_try = i
        if "BRA" in src and i - last_try <= 6 and src.strip().startswith("@"):
            out.append("mbarrier wait")
        else:
            out.append(next((name for name, pat in KINDS if pat.search(src)), "other"))
    return out


def segments(rows, kinds, col, total):
    """Samples between consecutive synchronising instructions (wgmma waits, barriers): which
    stretch of the branch's code the time goes to, with its GEMM shapes."""
    out, acc, start, gemms = [], 0.0, 0, Counter()
    for i, (row, kind) in enumerate(zip(rows, kinds)):
        acc += number(row[col])
        if "GMMA" in row["Source"]:
            gemms[next(w for w in row["Source"].split() if "GMMA" in w)] += 1
        if kind in ("wgmma wait", "mbarrier wait", "named barrier") or i == len(rows) - 1:
            if 100 * acc / total >= 0.3:
                shapes = " ".join(f"{n}x{g}" for g, n in gemms.items())
                out.append(f"   {100 * acc / total:5.1f}%  #{start:5d}-{i:5d}  [{kind}] {shapes}")
            acc, start, gemms = 0.0, i + 1, Counter()
    return out


def reasons(rows, reason_cols, shown=6):
    """The region's stall samples by ncu's reason (stall_barrier: block-wide barriers, stall_long_sb:
    waiting for global memory, stall_wait: fixed latencies, ...), the largest first."""
    sums = Counter({c.removeprefix("stall_"): sum(number(r[c]) for r in rows) for c in reason_cols})
    region = sum(sums.values()) or 1.0
    return ", ".join(f"{name} {100 * v / region:.0f}%" for name, v in sums.most_common(shown) if v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv_path")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--segments", action="store_true",
                    help="also list the stretches between synchronising instructions (>= 0.3%% each)")
    args = ap.parse_args()
    rows = read_rows(args.csv_path)
    cols = list(rows[0].keys())
    sample_col = next(c for c in cols if "Warp Stall Sampling (All" in c)
    reason_cols = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    region, per_region = 0, defaultdict(list)
    for row in rows:
        if "USETMAXREG" in row["Source"]:
            region += 1
        per_region[region].append(row)
    total = sum(number(r[sample_col]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} samples ({sample_col})")
    for reg, rs in sorted(per_region.items()):
        samples = sum(number(r[sample_col]) for r in rs)
        kind_list = kinds_of(rs)
        kinds = Counter()
        for r, kind in zip(rs, kind_list):
            kinds[kind] += number(r[sample_col])
        print(f"\n== region {reg}: {len(rs)} instructions, {100 * samples / total:.1f}% of samples")
        print("   by kind: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in kinds.most_common() if v))
        print("   by reason (% of the region): " + reasons(rs, reason_cols))
        top = sorted(range(len(rs)), key=lambda i: -number(rs[i][sample_col]))[: args.top]
        for i in sorted(top):
            r = rs[i]
            print(f"   {100 * number(r[sample_col]) / total:5.1f}%  #{i:5d}  {r['Source'][:90]}")
        if args.segments:
            print("   -- segments")
            print("\n".join(segments(rs, kind_list, sample_col, total)))


if __name__ == "__main__":
    main()
