"""Registers, spills and SASS instruction count of kernels as the device compiles them (sm_90a,
no GPU; needs nvcc), to compare a kernel change or a pass configuration before a device call.

    python tools/kernel_sass.py "bwd_fused_ws[k128_1000walks]" "prepare[k128_1000walks]"
    python tools/kernel_sass.py "layer_inputs[qwen3_next_k128]" --config TL_DISABLE_SAFE_MEMORY_ACCESS=1

Each case (a name of `kernels.lowering.lowering_cases()`, as the lowering tests list them) is
lowered with the pass configuration the runtime compiles it with (`hopper.common.pass_configs`),
changed by --config NAME=VALUE entries (names of `tilelang.PassConfigKey`), built into a cubin by
nvcc (`-Xptxas -v`) and disassembled by cuobjdump (the CUDA toolkit's, else the one Triton ships).
Prints one JSON line per case. The SASS count is static (instructions in the binary), not what
a launch executes.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CUDA_BIN = "/usr/local/cuda/bin"


def tool_path(name: str) -> str | None:
    """Path of a CUDA tool: on PATH, in the CUDA toolkit, or (cuobjdump) the copy Triton ships."""
    candidates = [shutil.which(name), os.path.join(CUDA_BIN, name)]
    if name == "cuobjdump":
        try:
            import triton.backends.nvidia as nvidia_backend

            candidates.append(os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", name))
        except ImportError:
            pass
    return next((path for path in candidates if path and os.path.exists(path)), None)


def find_tool(name: str) -> str:
    found = tool_path(name)
    if found is None:
        raise SystemExit(f"{name} not found (install a CUDA toolkit; `pip install \"tilelang[nvcc]\"` has nvcc)")
    return found


def parse_config(entries, key_names):
    """{PassConfigKey value: parsed value} from NAME=VALUE entries (1 / 0 are booleans)."""
    import tilelang

    configs = {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        if not sep or name not in key_names:
            raise SystemExit(f"--config {entry!r}: expected NAME=VALUE with NAME one of tilelang.PassConfigKey's")
        configs[getattr(tilelang.PassConfigKey, name)] = {"1": True, "0": False}.get(value, value)
    return configs


def measure(case, extra_configs: dict, workdir: str, shown_configs: dict | None = None) -> dict:
    """Lower, build and disassemble one lowering case (shown_configs: --config as given, for the output)."""
    import tilelang

    from flash_qla_cp.kernels.lowering import lower_spec

    kernel = lower_spec(case.spec, extra_configs=extra_configs)
    source = os.path.join(workdir, "kernel.cu")
    cubin = os.path.join(workdir, "kernel.cubin")
    with open(source, "w") as f:
        f.write(kernel.source)
    includes = [os.path.join(os.path.dirname(tilelang.__file__), p) for p in ("src", "3rdparty/cutlass/include")]
    build = subprocess.run([find_tool("nvcc"), "-cubin", "-arch=sm_90a", "-std=c++17", "-O3", "--use_fast_math",
                            "-Xptxas", "-v", "-w", "-o", cubin, source] + [f"-I{p}" for p in includes],
                           capture_output=True, text=True)
    if build.returncode != 0:
        raise SystemExit(f"{case.name}: nvcc failed:\n{build.stderr[-2000:]}")
    ptxas = build.stdout + build.stderr
    sass = subprocess.run([find_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout

    def number(pattern):
        found = re.search(pattern, ptxas)
        return int(found.group(1)) if found else None

    return {"case": case.name, "config": shown_configs or {},
            "registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "shared_memory_bytes": kernel.shared_memory_bytes,
            # each instruction's line starts with its address as a comment, /*0a40*/
            "sass_instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass, flags=re.M))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+", help="lowering case names, e.g. 'bwd_fused_ws[k128_1000walks]'")
    ap.add_argument("--config", action="append", default=[], help="NAME=VALUE of tilelang.PassConfigKey (repeatable)")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    import tilelang

    from flash_qla_cp.kernels.lowering import lowering_cases

    extra = parse_config(args.config, {k for k in dir(tilelang.PassConfigKey) if k.isupper()})
    cases = {c.name: c for c in lowering_cases()}
    unknown = [name for name in args.cases if name not in cases]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(cases)}")
    shown = dict(entry.split("=", 1) for entry in args.config)
    with tempfile.TemporaryDirectory(prefix="kernel_sass_") as workdir:
        for name in args.cases:
            print(json.dumps(measure(cases[name], extra, workdir, shown)), flush=True)


if __name__ == "__main__":
    main()
