"""The benchmarks' result files: merging a run into an earlier one keeps one process per shape; the
cold-start benchmark's table."""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_kernels  # noqa: E402


def _run(date, shapes, ms):
    meta = {"date": date, "command": f"bench {','.join(shapes)}", "gpu": "gpu", "versions": {}, "timing": "t",
            "matmul_tflops": 700.0, "copy_gbps": 3000.0}
    rows = [{"shape": s, "lib": lib, "fwd_ms": ms} for s in shapes for lib in ("ours", "flashqla")]
    return meta, rows


def test_merge_keeps_the_other_shapes_and_names_each_run_once():
    first = dict(zip(("meta", "rows"), _run("d1", ["tp1_1x8k", "tp1_1x32k"], 1.0)))
    meta, rows = bench_kernels.merged_results(*_run("d2", ["tp1_1x32k", "tp8_1x32k"], 2.0), first)
    by_shape = {(r["shape"], r["lib"]): r for r in rows}
    assert sorted(by_shape) == sorted((s, lib) for s in ("tp1_1x8k", "tp1_1x32k", "tp8_1x32k")
                                      for lib in ("ours", "flashqla"))
    # a re-measured shape takes the new run's rows, both libraries from that one run
    assert {r["measured"] for r in rows if r["shape"] == "tp1_1x32k"} == {"d2"}
    assert by_shape[("tp1_1x8k", "ours")] == {"measured": "d1", "shape": "tp1_1x8k", "lib": "ours", "fwd_ms": 1.0}
    assert [r["shape"] for r in rows][::2] == ["tp1_1x8k", "tp1_1x32k", "tp8_1x32k"]  # the table's order
    assert [run["date"] for run in meta["runs"]] == ["d1", "d2"]
    md = bench_kernels.to_markdown(meta, rows)
    assert "- d1: `bench tp1_1x8k,tp1_1x32k`" in md and "- d2: `bench tp1_1x32k,tp8_1x32k`" in md

    # merging again drops a run none of whose rows are left
    meta3, rows3 = bench_kernels.merged_results(*_run("d3", ["tp1_1x8k"], 3.0), {"meta": meta, "rows": rows})
    assert [run["date"] for run in meta3["runs"]] == ["d2", "d3"]
    assert {r["measured"] for r in rows3} == {"d2", "d3"}


def test_layer_table_gives_each_row_over_fla_on_the_same_shape_and_mode():
    import bench_layer

    meta = {"gpu": "gpu", "date": "d", "command": "c", "versions": {}, "accuracy": {}}
    rows = [{"shape": "qwen3_next_1x32k", "lib": lib, "mode": mode, "fwd_ms": fwd, "fwdbwd_ms": 2 * fwd,
             "fwdbwd_peak_gib": 1.0}
            for lib, mode, fwd in (("fla", "eager", 8.0), ("fla", "compile", 4.0), ("ours", "eager", 2.0),
                                   ("ours", "compile", 2.0))]
    rows.append({"shape": "recipe_1x32k", "lib": "ours", "mode": "eager", "fwd_ms": 1.0})  # no FLA row
    table = {tuple(cell.strip() for cell in line.split("|")[1:4]): line.split("|")
             for line in bench_layer.to_markdown(meta, rows).splitlines() if line.startswith("| qwen") or
             line.startswith("| recipe")}
    assert table[("qwen3_next_1x32k", "ours", "eager")][5].strip() == "0.25"
    assert table[("qwen3_next_1x32k", "ours", "compile")][5].strip() == "0.50"
    assert table[("qwen3_next_1x32k", "ours", "compile")][7].strip() == "0.50"
    assert table[("recipe_1x32k", "ours", "eager")][5].strip() == "-"


def test_layer_benchmark_refuses_to_merge_rows_of_another_gpu(tmp_path):
    import json
    import subprocess

    earlier = tmp_path / "bench_layer.json"
    earlier.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200", "date": "d", "command": "c"}, "rows": []}))
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_layer.py")
    run = subprocess.run([sys.executable, script, "--device", "cpu", "--shapes", "tiny", "--libs", "ours",
                          "--merge", str(earlier), "--out", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2
    assert "measured on NVIDIA H200, this GPU is cpu" in run.stderr
    assert not (tmp_path / "bench_layer.md").exists()


def test_cold_start_table_splits_the_first_call(tmp_path):
    """bench_cold_start on the CPU (torch backend: nothing to build) runs its fresh processes and
    writes each case's CUDA start, first call with its kernel rounds (none here) and the rest."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_cold_start.py")
    subprocess.run([sys.executable, script, "--device", "cpu", "--tokens", "64", "--hidden", "32", "--heads", "2",
                    "--v-heads", "4", "--head-dim", "16", "--out", str(tmp_path)], check=True, capture_output=True)
    result = json.loads((tmp_path / "bench_cold_start.json").read_text())
    for case in ("cold", "warm"):
        assert result[case]["build_rounds"] == [] and result[case]["first_call_s"] > 0
        assert result[case]["cuda_start_s"] >= 0
    table = (tmp_path / "bench_cold_start.md").read_text()
    assert "| cache | CUDA start s | first call s | of that, kernel rounds (kernels: s) | rest s | steady ms |" in table
    cold = result["cold"]
    assert f"| cold | {cold['cuda_start_s']} | {cold['first_call_s']} | - | {cold['first_call_s']} |" in table
