"""tools/compare_trees.py on the CPU: each tree's own profile_kernels.py runs in turn, in rounds,
with that tree first on the path; its entries are cut to the passes and kernels asked for."""

import json
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(__file__), "..", "tools", "compare_trees.py")

# a tree's profile tool, standing in for tools/profile_kernels.py: one entry per pass, its kernel
# times telling which tree it is (the tree's own module, imported through PYTHONPATH)
FAKE_PROFILE = """
import json, tree_id
for p in ("fwd", "fwd_train", "fwdbwd"):
    print(json.dumps({"shape": "s", "intra": "auto", "pass": p, "total_ms": tree_id.MS, "wall_ms": tree_id.MS,
                      "kernels": [["gdn_bwd_fused_ws_kernel", tree_id.MS / 2, 1], ["gdn_fwd_prepare", 0.1, 1]]}))
"""


def _tree(root, name, ms):
    os.makedirs(os.path.join(root, name, "tools"))
    with open(os.path.join(root, name, "tools", "profile_kernels.py"), "w") as f:
        f.write(FAKE_PROFILE)
    with open(os.path.join(root, name, "tree_id.py"), "w") as f:
        f.write(f"MS = {ms}\n")
    return os.path.join(root, name)


def test_trees_profiled_in_turns_and_cut_to_the_asked_passes_and_kernels(tmp_path):
    base, change = _tree(tmp_path, "base", 2.0), _tree(tmp_path, "change", 1.0)
    run = subprocess.run([sys.executable, TOOL, "--trees", f"main={base},walk={change}", "--rounds", "2",
                          "--passes", "fwdbwd", "--kernels", "bwd_fused", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [(r["tree"], r["round"]) for r in rows] == [("main", 1), ("walk", 1), ("main", 2), ("walk", 2)]
    assert {r["pass"] for r in rows} == {"fwdbwd"}
    assert [r["bwd_fused"] for r in rows] == [1.0, 0.5, 1.0, 0.5]
    with open(tmp_path / "out" / "compare_trees.json") as f:
        assert json.load(f) == rows


def test_a_tree_without_the_profile_tool_is_refused(tmp_path):
    run = subprocess.run([sys.executable, TOOL, "--trees", f"main={tmp_path}"], capture_output=True, text=True)
    assert run.returncode != 0 and "tools/profile_kernels.py" in run.stderr
