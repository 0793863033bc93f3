#!/usr/bin/env bash
# Long-sequence GPU recipe: one node, NGPU GPUs, CP degree CP (NGPU / CP data-parallel replicas).
# Each step packs SEQ_LEN tokens (global) of long documents (paragraphs of the corpus merged to
# >= MIN_DOC_BYTES bytes), so sequences span CP ranks; GDN runs the TileLang kernels (Hopper, bf16,
# head dim 128) with inter-card CP (state passing over NCCL) and, inside each rank, the
# intra-card split of the TileLang kernels where few heads would leave SMs idle (CP_INTRA). Every
# ATTN_EVERY-th block is softmax attention (SDPA, K/V all-gathered over the CP group; 0: none).
#   NGPU=8 CP=8 SEQ_LEN=524288 bash launch/train_long.sh          # 64k tokens per GPU
#   NGPU=1 CP=1 SEQ_LEN=65536 bash launch/train_long.sh --steps 20 # one-GPU smoke run
# Resumes from $SAVE_DIR when it holds a checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
NGPU=${NGPU:-8}
CP=${CP:-$NGPU}
SEQ_LEN=${SEQ_LEN:-$((65536 * NGPU))}
MIN_DOC_BYTES=${MIN_DOC_BYTES:-$((SEQ_LEN / 2))}
SAVE_DIR=${SAVE_DIR:-runs/long}
ATTN_EVERY=${ATTN_EVERY:-4}
[ "${SKIP_SETUP:-0}" = 1 ] || bash launch/setup.sh
exec python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" examples/pretrain.py \
  --device cuda --cp "$CP" --cp-intra "${CP_INTRA:-auto}" --seq-len "$SEQ_LEN" --min-doc-bytes "$MIN_DOC_BYTES" \
  --layers 8 --hidden 1024 --heads 8 --v-heads 16 --head-dim 128 --attn-every "$ATTN_EVERY" \
  --steps 1000 --lr 1e-3 --warmup 100 --min-lr-ratio 0.1 --clip 1.0 --log-every 10 \
  --save "$SAVE_DIR" --save-every 200 --resume "$SAVE_DIR" "$@"
