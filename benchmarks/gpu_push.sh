#!/usr/bin/env bash
# The push form of the peer transport against the pull form, on every GPU of one host (NVLink multicast off):
#   1. bench verify with DTRAIN_COMM_PEER_MODE=push: every (collective, algorithm) against NCCL's result
#   2. all-reduce 1 MiB - 1 GiB, native and ring / halving-doubling / auto, pull then push, eager then with
#      graph replays (DTRAIN_COMM_PERSISTENT=1): four sweeps, one launch each, in one command
# Usage: benchmarks/gpu_push.sh OUTDIR
set -uo pipefail
out=${1:-runs/gpu-push}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DTRAIN_COMM_TRANSPORT=peer
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
tr() { timeout "${LIMIT:-120}" torchrun --nproc-per-node "$n" "$@" 2>&1 | grep --line-buffered -v -iE "warn|^\s*$"; }
start=$SECONDS
DTRAIN_COMM_PEER_MODE=push LIMIT=120 tr -m dtrain bench verify >"$out/verify-push.txt"
echo "verify push: $(grep -c '^ok' "$out/verify-push.txt") ok, $(grep -ciE '^(fail|mismatch)|error' "$out/verify-push.txt") failed ($((SECONDS - start)) s)"
sweep="--collectives all_reduce --algorithms native,ring,halving_doubling,auto --min-bytes 1M --max-bytes 1G"
for mode in pull push; do
  for graphs in 0 1; do
    start=$SECONDS
    DTRAIN_COMM_PEER_MODE=$mode DTRAIN_COMM_PERSISTENT=$graphs LIMIT=90 tr -m dtrain bench comm $sweep --factor 4 \
      --iters 20 --trials 3 --out "$out/ar-$mode-graphs$graphs.jsonl" >/dev/null
    echo "== $mode, graphs=$graphs ($((SECONDS - start)) s)"
    python3 benchmarks/summarize.py "$out/ar-$mode-graphs$graphs.jsonl" --collective all_reduce \
      --algorithms native,ring,halving_doubling,auto | tail -n +4
  done
done
