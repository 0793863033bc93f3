"""Side-by-side timing of chunked Gated DeltaNet kernels on one GPU.

Libraries (same inputs, same process, same timing method):
  ours      flash_qla_cp's public chunk_gated_delta_rule(backend="tilelang") with its defaults
            (intra_cp="auto": long sequences on few heads are split inside the kernels,
            kernels/split.py; the TileLang backward)
  ours_nosplit  the same with intra_cp="off" (one CTA walks a whole sequence per head and tile)
  ours_recompute  the same as ours with save_states=False: the backward recomputes the chunk
            states instead of reading the ones the forward kept (less memory, one more walk)
  ours_3wg  the same as ours with KernelOptions(four_warpgroups=False)
  ours_unfused  the same as ours with KernelOptions(fused_walk="off") (the three-kernel backward)
  flashqla  FlashQLA (PyPI flash-qla 0.1.3, TileLang), its public chunk_gated_delta_rule with
            its defaults (auto intra-card CP on)
  fla       FLA (fla-core 0.6.0) Triton kernels, with FLA_FLASH_QLA=0 and
            FLA_DISABLE_BACKEND_DISPATCH=1 set before import so FLA's own kernels run

Usage:  python benchmarks/bench_kernels.py [--shapes a,b] [--libs ours,flashqla,fla] [--no-bwd]
        [--out DIR] [--rep MS] [--graphs] [--merge EARLIER.json]
Writes bench_kernels.json and bench_kernels.md into DIR (default $OUT, else benchmarks/results).
--merge keeps the earlier file's rows of shapes this run does not measure (each row names the run
that measured it; the speed-ups compare rows of one shape, so always of one process).

Accuracy: every library's forward output and final state are compared with the torch chunked
reference computed in float32 on the same GPU (relative L2 error, columns o_err / ht_err).

Timing: triton.testing.do_bench (warm-up, then the median of repeated launches, L2 flushed
between runs by do_bench). Eager by default, the same for all. FLA and ours get cu_seqlens_cpu
(a host copy of the offsets), so neither reads them back from the GPU.
--graphs adds columns timed by replaying each call captured in a CUDA graph (what a training
loop under CUDA graphs pays: no host launch cost), for every library whose call can be
captured; a call that waits for the GPU on the host cannot, and its row says so.
Forward+backward sets the inputs' .grad to None before each backward, so the gradients are
written rather than added into.
"""

import os

os.environ.setdefault("FLA_FLASH_QLA", "0")
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from flash_qla_cp.testing import cuda_graph_replay  # noqa: E402
from result_files import refuse_other_gpu, refuse_unknown_shapes, runs_with_rows  # noqa: E402

CHUNK = 64

# name: (B, T, H, HV, K, V, n_varlen_seqs (random uneven lengths), a tuple of lengths, or None)
SHAPES = {
    "tp1_1x8k": (1, 8192, 16, 32, 128, 128, None),
    "tp1_1x32k": (1, 32768, 16, 32, 128, 128, None),
    "tp1_4x8k": (4, 8192, 16, 32, 128, 128, None),
    "tp1_varlen8_32k": (1, 32768, 16, 32, 128, 128, 8),
    # one long document among short ones (a packed training batch): the walks' balance
    "tp1_varlen_skew_32k": (1, 32768, 16, 32, 128, 128, (24576,) + (1024,) * 8),
    "tp8_1x32k": (1, 32768, 2, 4, 128, 128, None),
    "tp8_1x128k": (1, 131072, 2, 4, 128, 128, None),
    "tp4_1x64k": (1, 65536, 4, 8, 128, 128, None),
}


def varlen_cu(total, n, seed=0):
    """n sequence lengths summing to `total`, uneven and not multiples of 64."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, generator=g) + 0.3
    lens = (w / w.sum() * total).long().clamp_min(1)
    lens[-1] = total - lens[:-1].sum()
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    return cu


def seq_lengths(B, T, cu):
    if cu is None:
        return [T] * B
    return (cu[1:] - cu[:-1]).tolist()


def flop_count(B, T, H, HV, K, V, cu):
    """Forward FLOPs of the chunked algorithm (C = 64), counted per v-head and chunk of length L:

      K K^T (L^2 K) + triangular inverse (L^3 / 3) + Ag [v | exp(G) k] (L^2 (V + K))
      + w S (L K V) + q S (L K V) + q k^T (L^2 K) + P v_new (L^2 V) + k^T v_new (L K V)

    each multiply-add counted as 2 FLOPs. Masked (upper-triangle) work counts in full, as the
    libraries all do it with dense tiles. Forward+backward is counted as 3x forward (the usual
    convention: backward ~ 2x forward); it is a normaliser for comparison, not a measurement.
    """
    total = 0
    for n_tok in seq_lengths(B, T, cu):
        full, rem = divmod(n_tok, CHUNK)
        for L, cnt in ((CHUNK, full), (rem, 1 if rem else 0)):
            per = L * L * K + L**3 / 3 + L * L * (V + K) + 3 * L * K * V + L * L * K + L * L * V
            total += 2 * per * cnt
    return total * HV


def byte_count(B, T, H, HV, K, V, cu, dtype_bytes=2, bwd=False):
    """Minimal HBM traffic: read q, k, v (dtype), g and beta (fp32), write o (dtype) and the final
    state (fp32). Forward+backward adds: read q, k, v, g, beta, do again, write dq, dk, dv (dtype)
    and dg, dbeta (fp32). Intermediates (chunk states, A) are not counted: they are the
    implementation's choice, so the GB/s column is a lower bound on the traffic achieved."""
    N = B if cu is None else len(cu) - 1
    tok = B * T
    qk = 2 * tok * H * K * dtype_bytes
    vv = tok * HV * V * dtype_bytes
    gb = 2 * tok * HV * 4
    fwd = qk + vv + gb + tok * HV * V * dtype_bytes + N * HV * K * V * 4
    if not bwd:
        return fwd
    return fwd + (qk + vv + gb + tok * HV * V * dtype_bytes) + (qk + vv + gb)


def make_inputs(B, T, H, HV, K, V, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, device="cuda", generator=g).to(dtype)
    rate = torch.exp(torch.linspace(-4, 1, HV, device="cuda"))
    gg = (-rate * F.softplus(torch.randn(B, T, HV, device="cuda", generator=g) + 0.5)).float()
    beta = torch.sigmoid(torch.randn(B, T, HV, device="cuda", generator=g)).float()
    return q, k, v, gg, beta


def shape_inputs(name):
    """(q, k, v, g, beta, cu) for a named shape; varlen shapes come packed [1, B*T, ...] with
    cu_seqlens (CPU int64), dense ones as [B, T, ...] with cu None."""
    B, T, H, HV, K, V, nseq = SHAPES[name]
    q, k, v, g, beta = make_inputs(B, T, H, HV, K, V)
    if not nseq:
        return q, k, v, g, beta, None
    packed = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    return (*packed, shape_cu(name))


def shape_cu(name):
    """cu_seqlens (CPU int64) of a varlen shape: its given lengths or random uneven ones."""
    B, T, nseq = SHAPES[name][0], SHAPES[name][1], SHAPES[name][6]
    if isinstance(nseq, tuple):
        assert sum(nseq) == B * T
        cu = torch.zeros(len(nseq) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor(nseq), 0)
        return cu
    return varlen_cu(B * T, nseq)


def lib_versions():
    out = {"torch": torch.__version__}
    for mod in ("triton", "tilelang", "fla", "flash_qla"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            out[mod] = f"not importable: {exc!r}"[:200]
    return out


# bench libraries that run ours with other kernel options
OPTION_LIBS = {
    "ours_3wg": dict(four_warpgroups=False),
    "ours_unfused": dict(fused_walk="off"),
}


def build_fns(lib, q, k, v, g, beta, cu, scale, with_train_fwd=False):
    """(fwd_fn, fwdbwd_fn or error string) for one library; with_train_fwd adds a third: the
    fwd+bwd's forward alone (inputs needing grad, states kept for a backward that never comes),
    so that fwd+bwd minus it is the backward's time."""
    cu32 = None if cu is None else cu.to(device="cuda", dtype=torch.int32)
    cu64 = None if cu is None else cu.to(device="cuda", dtype=torch.int64)
    do = torch.randn_like(v)

    def grads_inputs():
        return [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]

    def backward(o, ins):
        # gradients written, not accumulated (a training step after zero_grad(set_to_none=True)):
        # otherwise every library's time includes torch adding into .grad (~0.38 ms at 1x32k)
        for t in ins:
            t.grad = None
        o.backward(do)

    def fns(fwd, train_fwd, ins):
        def fwdbwd():
            backward(train_fwd(), ins)

        return (fwd, fwdbwd, train_fwd) if with_train_fwd else (fwd, fwdbwd)

    if lib in ("ours", "ours_nosplit", "ours_recompute", *OPTION_LIBS):
        from flash_qla_cp import KernelOptions
        from flash_qla_cp import chunk_gated_delta_rule as ours_op

        intra = "off" if lib == "ours_nosplit" else "auto"
        keep = lib != "ours_recompute"
        options = KernelOptions(**OPTION_LIBS.get(lib, {}))
        cu_cpu = None if cu is None else cu.to(torch.int32).cpu()  # as FLA gets it: no read-back

        def fwd():
            with torch.no_grad():
                return ours_op(q, k, v, g, beta, scale=scale, output_final_state=True, cu_seqlens=cu32,
                               backend="tilelang", intra_cp=intra, cu_seqlens_cpu=cu_cpu, kernel_options=options)

        ins = grads_inputs()

        def train_fwd():
            return ours_op(*ins, scale=scale, output_final_state=False, cu_seqlens=cu32, backend="tilelang",
                           intra_cp=intra, save_states=keep, cu_seqlens_cpu=cu_cpu, kernel_options=options)[0]

        return fns(fwd, train_fwd, ins)

    if lib == "flashqla":
        from flash_qla import chunk_gated_delta_rule as fq

        def fwd():
            with torch.no_grad():
                return fq(q, k, v, g, beta, scale=scale, output_final_state=True, cu_seqlens=cu32)

        ins = grads_inputs()

        def train_fwd():
            return fq(*ins, scale=scale, output_final_state=False, cu_seqlens=cu32)[0]

        return fns(fwd, train_fwd, ins)

    if lib == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fl

        cu_cpu = None if cu is None else cu.cpu()

        def fwd():
            with torch.no_grad():
                return fl(q, k, v, g, beta, scale=scale, output_final_state=True, cu_seqlens=cu64,
                          cu_seqlens_cpu=cu_cpu)

        ins = grads_inputs()

        def train_fwd():
            return fl(*ins, scale=scale, output_final_state=False, cu_seqlens=cu64, cu_seqlens_cpu=cu_cpu)[0]

        return fns(fwd, train_fwd, ins)
    raise ValueError(lib)


def each_call(shapes, libs):
    """(shape, lib, pass, fn) for the forward ("fwd") and fwd+bwd ("fwdbwd") of every library on
    every shape's bench inputs (fwd+bwd left out where a library has none): the loop of the
    host-time tools."""
    for sname in shapes:
        q, k, v, g, beta, cu = shape_inputs(sname)
        for lib in libs:
            fwd, fwdbwd = build_fns(lib, q, k, v, g, beta, cu, q.shape[-1] ** -0.5)
            for name, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
                if callable(fn):
                    yield sname, lib, name, fn


def reference_outputs(q, k, v, g, beta, cu, scale):
    """(o, final state) of the torch chunked reference in float32 on the GPU."""
    from flash_qla_cp.reference.chunked import chunk_gated_delta_rule_torch

    with torch.no_grad():
        o, ht = chunk_gated_delta_rule_torch(q.float(), k.float(), v.float(), g, beta, scale, None, True,
                                             None if cu is None else cu.cuda())
    return o, ht


def rel_l2(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def measure(fn, rep_ms):
    import triton.testing

    fn()  # first call: compile / autotune
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median")
    return ms, peak


def measured_peaks(rep=200):
    """(bf16 matmul TFLOP/s, copy GB/s) of this GPU, measured now: the floors the '% of floor'
    columns compare with (a large square GEMM; a 1 GiB copy, read and write counted)."""
    import triton.testing

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_ms = triton.testing.do_bench(lambda: a @ b, rep=rep, return_mode="median")
    src = torch.empty(2**28, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=rep, return_mode="median")
    return 2 * n**3 / gemm_ms / 1e9, 2 * 2**30 / copy_ms / 1e6  # (the buffers go with the call)


def floor_ms(flops, nbytes, meta):
    """The time the work cannot go below: its FLOPs at the measured matmul rate or its bytes at
    the measured copy bandwidth, whichever is longer."""
    return max(flops / meta["matmul_tflops"] / 1e9, nbytes / meta["copy_gbps"] / 1e6)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--libs", default="ours,flashqla,fla")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--graphs", action="store_true", help="also time replays of CUDA-graph captured calls")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms of timed launches)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--merge", default=None,
                    help="an earlier bench_kernels.json whose rows of the shapes not run here are kept")
    ap.add_argument("--md-from", default=None,
                    help="only rebuild the markdown table from this bench_kernels.json (no GPU needed)")
    args = ap.parse_args()
    if args.md_from:
        with open(args.md_from) as f:
            d = json.load(f)
        md = os.path.splitext(args.md_from)[0] + ".md"
        with open(md, "w") as f:
            f.write(to_markdown(d["meta"], d["rows"], partial=d.get("partial", False)))
        print(md)
        return
    os.makedirs(args.out, exist_ok=True)
    libs = [x for x in args.libs.split(",") if x]
    shapes = [x for x in args.shapes.split(",") if x]
    refuse_unknown_shapes(ap, shapes, SHAPES)

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(["python", "benchmarks/bench_kernels.py", *sys.argv[1:]]),
        "versions": lib_versions(),
        "timing": ("triton.testing.do_bench median, eager" + (" and CUDA-graph replays" if args.graphs else
                                                               " (no CUDA graphs)")
                   + "; fwd+bwd with .grad set to None before each backward"),
        "flops": flop_count.__doc__.strip(),
        "bytes": byte_count.__doc__.strip(),
    }
    if args.merge:
        refuse_other_gpu(ap, args.merge, meta["gpu"])
    meta["matmul_tflops"], meta["copy_gbps"] = measured_peaks()
    torch.cuda.empty_cache()
    print(json.dumps({"matmul_tflops": meta["matmul_tflops"], "copy_gbps": meta["copy_gbps"]}), flush=True)
    rows = []
    for sname in shapes:
        B, T, H, HV, K, V, nseq = SHAPES[sname]
        q, k, v, g, beta, cu = shape_inputs(sname)
        Bx = 1 if cu is not None else B
        scale = K**-0.5
        fl_f = flop_count(Bx, B * T // Bx, H, HV, K, V, cu)
        by_f = byte_count(Bx, B * T // Bx, H, HV, K, V, cu)
        by_fb = byte_count(Bx, B * T // Bx, H, HV, K, V, cu, bwd=True)
        ref = reference_outputs(q, k, v, g, beta, cu, scale)
        for lib in libs:
            row = {"shape": sname, "B": B, "T": T, "H": H, "HV": HV, "K": K, "V": V,
                   "varlen_seqs": len(nseq) if isinstance(nseq, tuple) else nseq, "lib": lib}
            try:
                fwd, fwdbwd, train_fwd = build_fns(lib, q, k, v, g, beta, cu, scale, with_train_fwd=True)
            except Exception as exc:  # noqa: BLE001
                row["fwd_error"] = row["fwdbwd_error"] = repr(exc)[:500]
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            try:
                got = fwd()
                row.update(o_err=rel_l2(got[0], ref[0]), ht_err=rel_l2(got[1], ref[1]))
                del got
                ms, peak = measure(fwd, args.rep)
                row.update(fwd_ms=ms, fwd_tflops=fl_f / ms / 1e9, fwd_gbps=by_f / ms / 1e6, fwd_peak_mib=peak / 2**20,
                           fwd_pct_floor=100 * floor_ms(fl_f, by_f, meta) / ms)
            except Exception as exc:  # noqa: BLE001
                row["fwd_error"] = (repr(exc) + " | " + traceback.format_exc()[-800:])[:1500]
            if args.no_bwd:
                row["fwdbwd_error"] = "skipped (--no-bwd)"
            elif isinstance(fwdbwd, str):
                row["fwdbwd_error"] = fwdbwd
            else:
                try:
                    ms, peak = measure(fwdbwd, args.rep)
                    row.update(fwdbwd_ms=ms, fwdbwd_tflops=3 * fl_f / ms / 1e9, fwdbwd_gbps=by_fb / ms / 1e6,
                               fwdbwd_peak_mib=peak / 2**20, fwdbwd_pct_floor=100 * floor_ms(3 * fl_f, by_fb, meta) / ms)
                    # the backward alone: fwd+bwd minus its own forward (inputs needing grad)
                    row["train_fwd_ms"] = measure(train_fwd, args.rep)[0]
                    row["bwd_ms"] = ms - row["train_fwd_ms"]
                except Exception as exc:  # noqa: BLE001
                    row["fwdbwd_error"] = (repr(exc) + " | " + traceback.format_exc()[-800:])[:1500]
            if args.graphs:
                for name, fn in (("fwd", fwd), ("fwdbwd", None if args.no_bwd else fwdbwd),
                                 ("train_fwd", None if args.no_bwd else train_fwd)):
                    if callable(fn) and f"{name}_ms" in row:
                        try:
                            replay = cuda_graph_replay(fn)
                            if isinstance(replay, str):
                                row[f"{name}_graph_error"] = replay
                            else:
                                row[f"{name}_graph_ms"] = measure(replay, args.rep)[0]
                        except Exception as exc:  # noqa: BLE001
                            row[f"{name}_graph_error"] = repr(exc)[:300]
            if "fwdbwd_graph_ms" in row and "train_fwd_graph_ms" in row:
                row["bwd_graph_ms"] = row["fwdbwd_graph_ms"] - row["train_fwd_graph_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
                json.dump({"meta": meta, "rows": rows, "partial": True}, f, indent=1)
        del q, k, v, g, beta
        torch.cuda.empty_cache()

    if args.merge:
        with open(args.merge) as f:
            meta, rows = merged_results(meta, rows, json.load(f))
    with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "bench_kernels.md"), "w") as f:
        f.write(to_markdown(meta, rows))
    print(to_markdown(meta, rows))


def merged_results(meta, rows, earlier):
    """(meta, rows) of this run plus the rows of `earlier` (a bench_kernels.json) for shapes this run
    did not measure. Each row names its run (`measured`: the run's date); meta["runs"] lists the runs
    that still have rows, each once, with its command and the peaks its % of floor used."""
    here = {r["shape"] for r in rows}
    kept = [{"measured": earlier["meta"]["date"], **r} for r in earlier["rows"] if r["shape"] not in here]
    rows = [{"measured": meta["date"], **r} for r in rows] + kept
    rows.sort(key=lambda r: list(SHAPES).index(r["shape"]) if r["shape"] in SHAPES else len(SHAPES))

    def run_of(m):
        return {k: m[k] for k in ("date", "command", "matmul_tflops", "copy_gbps") if k in m}

    return {**meta, "runs": runs_with_rows(earlier["meta"], meta, rows, run_of)}, rows


def _fmt(row, key, nd=3):
    v = row.get(key)
    return "-" if v is None else f"{v:.{nd}f}"


def to_markdown(meta, rows, partial=False):
    out = [
        f"# Kernel benchmark — {meta['gpu']}, {meta['date']}" + (" (partial: run cut short)" if partial else ""),
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "",
        (f"Command: `{meta.get('command', 'python benchmarks/bench_kernels.py')}`" if "runs" not in meta else
         "Runs (each row's `measured` names its run; a shape's rows come from one run, one process):\n\n"
         + "\n".join(f"- {run['date']}: `{run['command']}`" + (
             f" (peaks {run['matmul_tflops']:.0f} TFLOP/s, {run['copy_gbps']:.0f} GB/s)" if "matmul_tflops" in run else "")
                   for run in meta["runs"])),
        "",
        f"Timing: {meta['timing']}. TFLOP/s and GB/s use the counts documented in bench_kernels.py "
        "(fwd+bwd FLOPs = 3x fwd).",
        "",
        ("% of floor: the time the work cannot go below (its FLOPs at the bf16 matmul rate or its bytes at "
         "the copy bandwidth, whichever is longer, both measured in the row's run"
         + ("" if "runs" in meta else f": {meta['matmul_tflops']:.0f} TFLOP/s, {meta['copy_gbps']:.0f} GB/s")
         + ") over the measured time." if "matmul_tflops" in meta else "% of floor: not measured in this run."),
        "",
        "Speed-up columns: FlashQLA's time / this library's time on the same shape (> 1: faster than "
        "FlashQLA). o err / ht err: relative L2 error of the output / final state against the float32 "
        "torch reference. bwd ms: fwd+bwd ms minus the time of its forward alone (the same call, inputs "
        "needing grad, no backward).",
        "",
        "| shape | lib | fwd ms | x FlashQLA | fwd TFLOP/s | fwd GB/s | fwd % of floor | fwd peak MiB | fwd+bwd ms "
        "| x FlashQLA | bwd ms | x FlashQLA | fwd+bwd TFLOP/s | fwd+bwd % of floor | fwd+bwd peak MiB | o err | ht err "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    peer = {(r["shape"], key): r.get(key) for r in rows if r["lib"] == "flashqla" for key in ("fwd_ms", "fwdbwd_ms", "bwd_ms")}

    def speedup(r, key):
        mine, theirs = r.get(key), peer.get((r["shape"], key))
        return "-" if not mine or not theirs else f"{theirs / mine:.2f}"

    def sci(r, key):
        return "-" if r.get(key) is None else f"{r[key]:.1e}"

    graphs = any(k in r for r in rows for k in ("fwd_graph_ms", "fwd_graph_error"))
    if graphs:
        out[-2] = out[-2].replace(" | note |", " | graph fwd ms | x FlashQLA | graph fwd+bwd ms | x FlashQLA "
                                  "| graph bwd ms | x FlashQLA | note |")
        out[-1] += "---|---|---|---|---|---|"
        peer.update({(r["shape"], key): r.get(key) for r in rows if r["lib"] == "flashqla"
                     for key in ("fwd_graph_ms", "fwdbwd_graph_ms", "bwd_graph_ms")})
    for r in rows:
        note = "; ".join(r[k][:160].replace("|", "/").replace("\n", " ")
                          for k in ("fwd_error", "fwdbwd_error", "fwd_graph_error", "fwdbwd_graph_error") if k in r)
        out.append(
            f"| {r['shape']} | {r['lib']} | {_fmt(r, 'fwd_ms')} | {speedup(r, 'fwd_ms')} | {_fmt(r, 'fwd_tflops', 1)} | "
            f"{_fmt(r, 'fwd_gbps', 0)} | {_fmt(r, 'fwd_pct_floor', 0)} | {_fmt(r, 'fwd_peak_mib', 0)} | "
            f"{_fmt(r, 'fwdbwd_ms')} | {speedup(r, 'fwdbwd_ms')} | {_fmt(r, 'bwd_ms')} | {speedup(r, 'bwd_ms')} | "
            f"{_fmt(r, 'fwdbwd_tflops', 1)} | {_fmt(r, 'fwdbwd_pct_floor', 0)} | {_fmt(r, 'fwdbwd_peak_mib', 0)} | "
            f"{sci(r, 'o_err')} | {sci(r, 'ht_err')} | "
            + (f"{_fmt(r, 'fwd_graph_ms')} | {speedup(r, 'fwd_graph_ms')} | {_fmt(r, 'fwdbwd_graph_ms')} | "
               f"{speedup(r, 'fwdbwd_graph_ms')} | {_fmt(r, 'bwd_graph_ms')} | {speedup(r, 'bwd_graph_ms')} | "
               if graphs else "")
            + f"{note} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
