#!/usr/bin/env bash
# The GPU runs session 3 left for session 4 (run there; results in docs/benchmarks.md, "The peer-memory
# transport", and docs/pipeline-gpu.md), on every GPU of one host, each part under its own time limit:
#   replay  the persistent all-reduce sweep that segfaulted, twice: with the peer window made at 2 GiB up front
#           (DTRAIN_COMM_PEER_WINDOW_BYTES, so it never re-rendezvouses), then as before; the first run that
#           dies says which it was
#   direct  direct all-gather / all-to-all / all-reduce with a round's passes rotated (rank r reads r+1 first)
#   dp      data parallel against DDP with the peer transport, eager, then with persistent replays
#   pp      1F1B p = 4, m = 2 and interleaved m = 4, which deadlocked before gradients got their own group
# Usage: benchmarks/gpu_next.sh OUTDIR [parts...]   (NVLink multicast stays off)
set -uo pipefail
out=${1:-runs/gpu-next}; shift || true
parts=${*:-replay direct dp pp}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
tr() { timeout "${LIMIT:-150}" torchrun --nproc-per-node "$n" "$@" 2>&1 | grep --line-buffered -v -iE "warn|^\s*$"; }
sweep="--collectives all_reduce --algorithms native,ring,halving_doubling,recursive_doubling,direct,tree,auto"
sweep="$sweep --min-bytes 16K --max-bytes 1G --factor 4 --iters 20 --trials 3"
for part in $parts; do
  start=$SECONDS
  case $part in
    replay)
      DTRAIN_COMM_TRANSPORT=peer DTRAIN_COMM_PERSISTENT=1 DTRAIN_COMM_PEER_WINDOW_BYTES=2G LIMIT=120 \
        tr -m dtrain bench comm $sweep --out "$out/replay-presized.jsonl" | grep -A12 -m1 "Fatal Python" ;
      echo "presized: $(grep -c . "$out/replay-presized.jsonl" 2>/dev/null) rows"
      DTRAIN_COMM_TRANSPORT=peer DTRAIN_COMM_PERSISTENT=1 LIMIT=120 \
        tr -m dtrain bench comm $sweep --out "$out/replay-growing.jsonl" | grep -A12 -m1 "Fatal Python" ;
      echo "growing: $(grep -c . "$out/replay-growing.jsonl" 2>/dev/null) rows" ;;
    direct)
      DTRAIN_COMM_TRANSPORT=peer LIMIT=120 tr -m dtrain bench comm --collectives all_gather,all_to_all,all_reduce \
        --algorithms native,direct,ring --min-bytes 1M --max-bytes 256M --factor 4 --iters 10 --trials 3 \
        --out "$out/direct-rotated.jsonl" >/dev/null
      for c in all_gather all_to_all all_reduce; do
        python3 benchmarks/summarize.py "$out/direct-rotated.jsonl" --collective $c --algorithms native,direct,ring
      done ;;
    dp)
      DTRAIN_COMM_TRANSPORT=peer LIMIT=170 tr benchmarks/peers_dp_zero.py --out "$out/dp-peer-eager.jsonl" | cut -c1-200
      DTRAIN_COMM_TRANSPORT=peer DTRAIN_COMM_PERSISTENT=1 LIMIT=170 tr benchmarks/peers_dp_zero.py \
        --out "$out/dp-peer-persistent.jsonl" | cut -c1-200 ;;
    pp)
      LIMIT=150 tr benchmarks/peers_tp_pp.py --sections pp --pp-width 4096 --pp-batch 8192 --microbatches 2 4 8 \
        --pp-warmup 2 --pp-iters 3 --pp-trials 3 --pp-budget-s 3 --stall-s 45 --out "$out/pp.jsonl" | cut -c1-200 ;;
  esac
  echo "part $part: $((SECONDS - start)) s"
done
