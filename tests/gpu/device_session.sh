#!/usr/bin/env bash
# One call of the device tool: unpack the package bundle (and a TileLang kernel cache carried from
# an earlier call), run the named phases, and hand the cache back under $OUT for the next call.
#
#   run(command="bash tests/gpu/device_session.sh check_fwd check_cp bench", carry=[".device"])
#   then, here: cp <files_at>/tlcache.tar.xz .device/   (next call compiles nothing it has seen)
#   kernels new to the device can be compiled into that archive beforehand on a CPU machine:
#   python tests/gpu/precompile_cache.py SPEC_FILE (e.g. tests/gpu/precompile_specs_check_bwd.py,
#   or the kernels.jsonl a call returns: the kernels it used)
#
# Phases: check_fwd check_bwd check_walk check_split check_cp bench ncu tune_fwd trace_fwd tune_split profile long_seq
# launch_paths (SHAPE) host_overhead sync_probe (SHAPES, LIBS) host_timeline (SHAPE, PASSES, TIMELINE_ARGS e.g. --profile). SHAPES / LIBS narrow the
# benchmark (GRAPHS=1 adds CUDA-graph replay timings, also to tune_split; BENCH_NAME names its output folder; SHAPES / PARTS / FWD_BV / SPLIT_H the split sweep);
# NCU_KERNEL / SHAPE / NCU_LIB / NCU_NAME / NCU_ARGS (e.g. --fwd-only) the ncu phase's kernel, shape, library (ours, flashqla) and file names; PROFILE_LIB the
# profile phase's library; CP_CHECKS the CP checks (intra, inter); CHECK_FWD_ARGS check_fwd.py's options (default "--quick");
# VARIANTS tune_fwd.py's kernel variants; CHECK_BWD_ARGS check_bwd.py's options (default
# "--quick --no-bench"; e.g. "--no-bench --h-kernel ws"; CHECK_BWD_OUT its output folder); SEQ_LENS the long-sequence ladder
# (with activation checkpointing). CHECK_SPLIT_ARGS / TUNE_SPLIT_ARGS pass more options (e.g. --fused-walk-on).
set -uo pipefail
cd "$(dirname "$0")/../.."
# several invocations in one device call (different options per phase) unpack once
[ -d /tmp/site ] || tar -xJf .device/site.tar.xz -C /tmp || exit 1
[ -d /tmp/tlcache ] || { [ -f .device/tlcache.tar.xz ] && tar -xJf .device/tlcache.tar.xz -C /tmp; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=/tmp/tlcache
export FLASH_QLA_CP_TILELANG_BWD=1  # the GPU checks and timings cover the TileLang backward (its default)
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
# every kernel the run builds (compiled, or loaded from the cache) is listed for precompile_cache.py
export FLASH_QLA_CP_KERNEL_LOG="$OUT/kernels.jsonl"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for phase in "$@"; do
  echo "== $phase $(date -u +%T)"
  case $phase in
    check_fwd) timeout "${CHECK_TIMEOUT:-300}" python tests/gpu/check_fwd.py ${CHECK_FWD_ARGS:---quick} --out "$OUT/check_fwd" 2>&1 \
                 | grep -v TileLang | tail -20 ;;
    trace_fwd) timeout "${BENCH_TIMEOUT:-300}" python benchmarks/trace_fwd.py --out "$OUT/trace_fwd" ${SHAPE:+--shape "$SHAPE"} \
                 ${VARIANTS:+--variants "$VARIANTS"} 2>&1 | grep '^{' | cut -c1-700 ;;
    tune_fwd) timeout "${BENCH_TIMEOUT:-420}" python benchmarks/tune_fwd.py --out "$OUT/tune_fwd" ${SHAPES:+--shapes "$SHAPES"} \
                ${VARIANTS:+--variants "$VARIANTS"} 2>&1 | grep -v TileLang | tail -12 | cut -c1-600 ;;
    check_bwd) timeout "${CHECK_TIMEOUT:-400}" python tests/gpu/check_bwd.py ${CHECK_BWD_ARGS:---quick --no-bench} \
                 --out "$OUT/${CHECK_BWD_OUT:-check_bwd}" 2>&1 | grep -v TileLang | tail -20 ;;
    check_walk) timeout "${CHECK_TIMEOUT:-300}" python tests/gpu/check_walk_determinism.py 2>&1 | grep -v TileLang | tail -5 ;;
    check_split) timeout "${CHECK_TIMEOUT:-400}" python tests/gpu/check_split.py ${CHECK_SPLIT_ARGS:-} 2>&1 | grep -v TileLang | tee "$OUT/check_split.log" | cut -c1-700 ;;
    tune_split) timeout "${BENCH_TIMEOUT:-420}" python benchmarks/tune_split.py --out "$OUT/tune_split" \
                  ${SHAPES:+--shapes "$SHAPES"} ${PARTS:+--parts "$PARTS"} ${FWD_BV:+--fwd-block-v "$FWD_BV"} \
                  ${SPLIT_H:+--split-h-kernels "$SPLIT_H"} ${GRAPHS:+--graphs} ${TUNE_SPLIT_ARGS:-} 2>&1 \
                  | grep '^{' | cut -c1-400 ;;
    profile) timeout 240 python benchmarks/profile_kernels.py --out "$OUT/profile" ${SHAPES:+--shapes "$SHAPES"} \
               ${INTRA:+--intra "$INTRA"} ${PROFILE_LIB:+--lib "$PROFILE_LIB"} 2>&1 | grep '^{' | cut -c1-1500 ;;
    ncu)  # per-instruction stall samples of one kernel (NCU_KERNEL) on one shape; read with benchmarks/ncu_stalls.py
      timeout 400 /usr/local/cuda/bin/ncu --section SpeedOfLight --section SourceCounters --section WarpStateStats \
        --import-source no -k "regex:${NCU_KERNEL:-gdn_bwd_fused_ws}" --launch-skip 1 --launch-count 1 -f -o "$OUT/${NCU_NAME:-ncu}" \
        python benchmarks/run_shape.py "${SHAPE:-tp1_1x32k}" ${NCU_LIB:+--lib "$NCU_LIB"} ${NCU_ARGS:-} 2>&1 | grep -v "Parallel Compiling" | tail -4
      /usr/local/cuda/bin/ncu -i "$OUT/${NCU_NAME:-ncu}.ncu-rep" --page details > "$OUT/${NCU_NAME:-ncu}_details.txt" 2>&1
      /usr/local/cuda/bin/ncu -i "$OUT/${NCU_NAME:-ncu}.ncu-rep" --page source --print-source sass --csv 2>/dev/null | xz -9 > "$OUT/${NCU_NAME:-ncu}_sass.csv.xz"
      rm -f "$OUT/${NCU_NAME:-ncu}.ncu-rep"; grep -E "Duration|Registers Per|Issue Slots Busy|No Eligible" "$OUT/${NCU_NAME:-ncu}_details.txt" ;;
    check_cp) timeout "${CHECK_TIMEOUT:-300}" python tests/gpu/check_cp.py ${CP_CHECKS:-intra inter} 2>&1 | grep -v TileLang | tee "$OUT/check_cp.log" | cut -c1-600 ;;
    bench) timeout "${BENCH_TIMEOUT:-420}" python benchmarks/bench_kernels.py --out "$OUT/${BENCH_NAME:-bench}" ${GRAPHS:+--graphs} \
             ${SHAPES:+--shapes "$SHAPES"} ${LIBS:+--libs "$LIBS"} 2>&1 | grep '^{' | cut -c1-300 ;;
    launch_paths) timeout "${BENCH_TIMEOUT:-300}" python benchmarks/launch_paths.py --out "$OUT/launch_paths" \
                    ${SHAPE:+--shape "$SHAPE"} 2>&1 | grep -v TileLang | tail -20 | cut -c1-400 ;;
    host_overhead) timeout "${BENCH_TIMEOUT:-300}" python benchmarks/host_overhead.py --out "$OUT/host_overhead" \
                     ${SHAPES:+--shapes "$SHAPES"} ${LIBS:+--libs "$LIBS"} 2>&1 | grep '^{' | cut -c1-300 ;;
    host_timeline) for pass in ${PASSES:-fwd fwdbwd}; do
        timeout "${BENCH_TIMEOUT:-300}" python benchmarks/host_timeline.py --out "$OUT/host_timeline_$pass" --pass "$pass" \
          ${SHAPE:+--shape "$SHAPE"} ${TIMELINE_ARGS:-} 2>&1 | grep -v TileLang | tail -45 | cut -c1-300
      done ;;
    sync_probe) timeout "${BENCH_TIMEOUT:-300}" python benchmarks/sync_probe.py --out "$OUT/sync_probe" \
                  ${SHAPES:+--shapes "$SHAPES"} ${LIBS:+--libs "$LIBS"} 2>&1 | grep '^{' | cut -c1-900 ;;
    long_seq)
      for L in ${SEQ_LENS:-262144 524288}; do
        echo "-- seq-len $L (--checkpoint-blocks)" | tee -a "$OUT/long_seq.log"
        timeout 200 python examples/pretrain.py --device cuda --cp 1 --seq-len "$L" --min-doc-bytes $((L / 2)) \
          --layers 8 --hidden 1024 --heads 8 --v-heads 16 --head-dim 128 --attn-every 0 --steps 4 \
          --log-every 1 --lr 1e-3 --checkpoint-blocks 2>&1 | grep -vi "tilelang\|warn" | tail -6 | tee -a "$OUT/long_seq.log"
      done ;;
    *) echo "unknown phase $phase" ;;
  esac
done
# NO_CACHE_OUT=1 on all but the last invocation of a call: packing the cache takes ~30-60 s
[ -n "${NO_CACHE_OUT:-}" ] || tar -C /tmp -cJf "$OUT/tlcache.tar.xz" tlcache 2>/dev/null
ls -la "$OUT"
