#!/usr/bin/env bash
# One call of the device tool: unpack the package bundle (and a TileLang kernel cache carried from
# an earlier call), run the named phases, and hand the cache back under $OUT for the next call.
#
#   run(command="bash tools/device_session.sh tests bench", carry=[".device"])
#   then, here: cp <files_at>/tlcache.tar.xz .device/   (the next call compiles nothing it has seen)
#   kernels new to the device can be compiled into that archive beforehand on a CPU machine:
#   python tools/precompile_cache.py --log kernels.jsonl (the kernels a call returned) or
#   --bench-shapes tp1_1x32k,... / --gpu-tests / --train-recipe 131072,...
#
# Phases:
#   tests      pytest -m gpu tests/gpu (TESTS narrows it, e.g. TESTS="tests/gpu/test_op.py -k split")
#   bench      benchmarks/bench_kernels.py (SHAPES, LIBS narrow it; GRAPHS=1 adds CUDA-graph replays; MERGE=1
#              keeps the rows of benchmarks/results/bench_kernels_<gpu>.json of shapes it does not re-measure)
#   bench_layer  benchmarks/bench_layer.py: our GatedDeltaNet against FLA's (LAYER_SHAPES, LIBS, BENCH_ARGS; MERGE=1
#              keeps the rows of benchmarks/results/bench_layer_<gpu>.json it does not re-measure)
#   decode     benchmarks/bench_decode.py: prefill and decoding with a cache, ours and FLA's (DECODE_ARGS)
#   tune_split tools/tune_split.py (SHAPES, PARTS)
#   tune_layer tools/tune_layer.py: block sizes of the layer's kernels around the op (LAYER_SHAPES)
#   tune_prepare  tools/tune_prepare.py: the prepare kernel's register caps (SHAPES)
#   profile    tools/profile_kernels.py (SHAPES, INTRA, PROFILE_LIB)
#   compare    tools/compare_trees.py: the kernels of this checkout ("main") and of each tree archived in
#              .device/trees/NAME.tar.xz, profiled in turns on this GPU (SHAPES, INTRA, ROUNDS)
#   profile_layer  tools/profile_layer.py: per-kernel time of the layer, ours and FLA's (LAYER_SHAPES, LIBS;
#              PROFILE_ARGS=--compile: under torch.compile)
#   host_timeline  tools/host_timeline.py (SHAPE, PASSES, TIMELINE_ARGS e.g. --profile)
#   ncu        ncu stall samples of one kernel (NCU_KERNEL, SHAPE, INTRA, NCU_NAME), read with tools/ncu_stalls.py
#   long_seq   the long-sequence training ladder with activation checkpointing (SEQ_LENS, STEPS; CKPT=0 without)
#   cold_start benchmarks/bench_cold_start.py (COLD_ARGS, e.g. --no-precompile)
#   compile_times  tools/compile_times.py --first-call on SHAPE (a bench_layer shape), into an empty cache
#              and then the carried one; PER_KERNEL=1 adds each kernel's lowering and build times, one after
#              another (PER_KERNEL=bwd_fused: only the kernels whose factory name contains that)
#   grad_errors  tools/layer_grad_errors.py: the op's gradients inside the layer against float64 (SHAPE; SEEDS
#              draws of the input, default 8: medians, and in how many the fused path is ahead)
set -uo pipefail
cd "$(dirname "$0")/.."
# several invocations in one device call (different options per phase) unpack once
[ -d /tmp/site ] || tar -xJf .device/site.tar.xz -C /tmp || exit 1
[ -d /tmp/tlcache ] || { [ -f .device/tlcache.tar.xz ] && tar -xJf .device/tlcache.tar.xz -C /tmp; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=/tmp/tlcache
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
# every kernel the run builds (compiled, or loaded from the cache) is listed for precompile_cache.py
export FLASH_QLA_CP_KERNEL_LOG="$OUT/kernels.jsonl"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# h100 / h200: the suffix of the result files in benchmarks/results (cards differ in speed)
GPU_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]00' | tr 'H' 'h')
GPU_TAG=${GPU_TAG:-gpu}
# MERGE=1: bench_layer keeps the rows of benchmarks/results/bench_layer_$GPU_TAG.json it does not re-measure
[ "${MERGE:-0}" = 1 ] && [ -f "benchmarks/results/bench_layer_$GPU_TAG.json" ] \
  && MERGE_ARG="--merge benchmarks/results/bench_layer_$GPU_TAG.json"
[ "${MERGE:-0}" = 1 ] && [ -f "benchmarks/results/bench_kernels_$GPU_TAG.json" ] \
  && MERGE_KERNELS_ARG="--merge benchmarks/results/bench_kernels_$GPU_TAG.json"
for phase in "$@"; do
  echo "== $phase $(date -u +%T)"
  case $phase in
    tests) timeout "${TEST_TIMEOUT:-540}" python -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/gpu} \
             --junitxml "$OUT/gpu_tests.xml" 2>&1 | grep -v TileLang | tail -40 ;;
    bench) timeout "${BENCH_TIMEOUT:-420}" python benchmarks/bench_kernels.py --out "$OUT/${BENCH_NAME:-bench_$GPU_TAG}" ${GRAPHS:+--graphs} \
             ${SHAPES:+--shapes "$SHAPES"} ${LIBS:+--libs "$LIBS"} ${MERGE_KERNELS_ARG:-} 2>&1 | grep '^{' | cut -c1-300 ;;
    bench_layer) timeout "${BENCH_TIMEOUT:-540}" python benchmarks/bench_layer.py --out "$OUT/bench_layer_$GPU_TAG" \
                   ${LAYER_SHAPES:+--shapes "$LAYER_SHAPES"} ${LIBS:+--libs "$LIBS"} ${MERGE_ARG:-} ${BENCH_ARGS:-} 2>&1 \
                   | grep '^{' | cut -c1-400 ;;
    decode) timeout "${BENCH_TIMEOUT:-300}" python benchmarks/bench_decode.py --graphs --out "$OUT/bench_decode_$GPU_TAG" \
              ${DECODE_ARGS:-} 2>&1 | grep '^{' | cut -c1-300 ;;
    tune_split) timeout "${BENCH_TIMEOUT:-420}" python tools/tune_split.py --out "$OUT/tune_split" \
                  ${SHAPES:+--shapes "$SHAPES"} ${PARTS:+--parts "$PARTS"} 2>&1 | grep '^{' | cut -c1-400 ;;
    tune_layer) timeout "${BENCH_TIMEOUT:-300}" python tools/tune_layer.py --out "$OUT/tune_layer" \
                  ${LAYER_SHAPES:+--shapes "$LAYER_SHAPES"} 2>&1 | grep '^{' | cut -c1-300 ;;
    tune_prepare) timeout "${BENCH_TIMEOUT:-200}" python tools/tune_prepare.py --out "$OUT/tune_prepare" \
                    ${SHAPES:+--shapes "$SHAPES"} 2>&1 | grep '^{' | cut -c1-300 ;;
    profile) timeout 240 python tools/profile_kernels.py --out "$OUT/profile" ${SHAPES:+--shapes "$SHAPES"} \
               ${INTRA:+--intra "$INTRA"} ${PROFILE_LIB:+--lib "$PROFILE_LIB"} 2>&1 | grep '^{' | cut -c1-1500 ;;
    profile_layer) timeout 300 python tools/profile_layer.py --out "$OUT/profile_layer" \
                     ${LAYER_SHAPES:+--shapes "$LAYER_SHAPES"} ${LIBS:+--libs "$LIBS"} ${PROFILE_ARGS:-} 2>&1 | grep '^{' | cut -c1-2500 ;;
    host_timeline) for pass in ${PASSES:-fwd fwdbwd}; do
        timeout "${BENCH_TIMEOUT:-300}" python tools/host_timeline.py --out "$OUT/host_timeline_$pass" --pass "$pass" \
          ${SHAPE:+--shape "$SHAPE"} ${TIMELINE_ARGS:-} 2>&1 | grep -v TileLang | tail -45 | cut -c1-300
      done ;;
    compare)
      trees="main=$PWD"
      for archive in .device/trees/*.tar.xz; do
        [ -e "$archive" ] || continue
        name=$(basename "$archive" .tar.xz)
        mkdir -p "/tmp/trees/$name" && tar -xJf "$archive" -C "/tmp/trees/$name" && trees="$trees,$name=/tmp/trees/$name"
      done
      timeout "${BENCH_TIMEOUT:-500}" python tools/compare_trees.py --trees "$trees" ${SHAPES:+--shapes "$SHAPES"} \
        ${INTRA:+--intra "$INTRA"} --rounds "${ROUNDS:-2}" --out "$OUT/compare" 2>&1 | grep '^{' | cut -c1-400 ;;
    ncu)  # per-instruction stall samples of one kernel (NCU_KERNEL) on one shape's fwd+bwd
      timeout 400 /usr/local/cuda/bin/ncu --section SpeedOfLight --section SourceCounters --section WarpStateStats \
        --import-source no -k "regex:${NCU_KERNEL:-gdn_bwd_fused_ws}" --launch-skip 1 --launch-count 1 -f -o "$OUT/${NCU_NAME:-ncu}" \
        python tools/profile_kernels.py --shapes "${SHAPE:-tp1_1x32k}" ${INTRA:+--intra "$INTRA"} --iters 2 --out "$OUT/ncu_profile" 2>&1 | tail -4
      /usr/local/cuda/bin/ncu -i "$OUT/${NCU_NAME:-ncu}.ncu-rep" --page details > "$OUT/${NCU_NAME:-ncu}_details.txt" 2>&1
      /usr/local/cuda/bin/ncu -i "$OUT/${NCU_NAME:-ncu}.ncu-rep" --page source --print-source sass --csv 2>/dev/null | xz -9 > "$OUT/${NCU_NAME:-ncu}_sass.csv.xz"
      rm -f "$OUT/${NCU_NAME:-ncu}.ncu-rep"; grep -E "Duration|Registers Per|Issue Slots Busy|No Eligible" "$OUT/${NCU_NAME:-ncu}_details.txt" ;;
    long_seq)
      ckpt=$([ "${CKPT:-1}" = 1 ] && echo --checkpoint-blocks)
      for L in ${SEQ_LENS:-262144 524288}; do
        echo "-- seq-len $L ${ckpt:-(no checkpointing)}" | tee -a "$OUT/long_seq.log"
        timeout "${RUN_TIMEOUT:-200}" python examples/pretrain.py --device cuda --cp 1 --seq-len "$L" --min-doc-bytes $((L / 2)) \
          --layers 8 --hidden 1024 --heads 8 --v-heads 16 --head-dim 128 --attn-every 0 --steps "${STEPS:-4}" \
          --log-every 1 --lr 1e-3 $ckpt 2>&1 | grep -vi "tilelang\|warn" | tail -6 | tee -a "$OUT/long_seq.log"
      done ;;
    cold_start) timeout "${BENCH_TIMEOUT:-540}" python benchmarks/bench_cold_start.py --out "$OUT/cold_start" ${COLD_ARGS:-} \
                  2>&1 | grep '^{' | cut -c1-300 ;;
    compile_times)  # where a cold first call's time goes on this machine: rounds (--first-call), then per kernel
      timeout "${BENCH_TIMEOUT:-300}" python tools/compile_times.py --first-call --shape "${SHAPE:-qwen3_next_1x32k}" \
        2>&1 | grep '^{' | cut -c1-600
      # the same first call on the carried cache (a warm start)
      timeout 120 python tools/compile_times.py --first-call --shape "${SHAPE:-qwen3_next_1x32k}" --cache /tmp/tlcache \
        2>&1 | grep '^{' | cut -c1-600
      # PER_KERNEL=1: each kernel alone, one after another (PER_KERNEL=bwd_fused: only those kernels)
      [ -n "${PER_KERNEL:-}" ] && timeout "${BENCH_TIMEOUT:-300}" python tools/compile_times.py \
        --shape "${SHAPE:-qwen3_next_1x32k}" --out "$OUT/compile_times" \
        $([ "${PER_KERNEL}" != 1 ] && echo --only "$PER_KERNEL") 2>&1 | grep '^{' | cut -c1-300 ;;
    grad_errors) timeout "${BENCH_TIMEOUT:-200}" python tools/layer_grad_errors.py --shape "${SHAPE:-recipe_1x32k}" \
                   --seeds "${SEEDS:-8}" 2>&1 | grep '^{' | cut -c1-700 ;;
    *) echo "unknown phase $phase" ;;
  esac
done
# NO_CACHE_OUT=1 on all but the last invocation of a call: packing the cache takes ~30-60 s
[ -n "${NO_CACHE_OUT:-}" ] || tar -C /tmp -cJf "$OUT/tlcache.tar.xz" tlcache 2>/dev/null
ls -la "$OUT"
