#!/usr/bin/env bash
# Session 5, second run, on every GPU of one host with dtrain's defaults (NVLink multicast off):
#   rules   the all-reduce sweep with auto following the rules the first run measured (its launch died silently)
#   verify  bench verify after the scratch-buffer change
#   probe   replay_host_probe.py after the watchdog's event reuse
#   colls   reduce-scatter, all-gather, all-to-all, 16-256 MiB (replays now that their work buffer is kept)
#   dp      data parallel against DDP, 1 and 4 GPUs, 16 sequences a GPU, twice; then 32 a GPU
# Usage: benchmarks/gpu_s5b.sh OUTDIR [parts...]
set -uo pipefail
out=${1:-runs/gpu-s5b}; shift || true
parts=${*:-rules verify probe colls dp}
mkdir -p "$out"
. benchmarks/gpu_env.sh
nvidia-smi -L | head -1
sweep="--collectives all_reduce --algorithms native,ring,halving_doubling,auto --min-bytes 1M --max-bytes 1G --factor 4"
for part in $parts; do
  start=$SECONDS
  case $part in
    rules)
      DTRAIN_COMM_RULES=docs/data/gpu-h100x4-s5-rules-cuda-peer.json LIMIT=120 tr -m dtrain bench comm $sweep \
        --iters 20 --trials 3 --out "$out/ar-rules.jsonl" >"$out/ar-rules.log"
      grep -vE "^\s*[│┃|]|^[┏┡└━]" "$out/ar-rules.log" | tail -25 | cut -c1-300
      python3 benchmarks/summarize.py "$out/ar-rules.jsonl" --collective all_reduce \
        --algorithms native,ring,halving_doubling,auto | tail -n +4 ;;
    verify)
      LIMIT=150 tr -m dtrain bench verify >"$out/verify.txt"
      echo "verify: $(grep -c '^ok' "$out/verify.txt") ok, $(grep -ciE '^(fail|mismatch)|error' "$out/verify.txt") failed"
      grep -iE "fail|mismatch|error" "$out/verify.txt" | head -5 ;;
    probe)
      LIMIT=60 tr benchmarks/replay_host_probe.py >"$out/replay-host-probe.txt"; grep "KiB" "$out/replay-host-probe.txt" ;;
    colls)
      LIMIT=120 tr -m dtrain bench comm --collectives reduce_scatter,all_gather,all_to_all \
        --algorithms native,ring,direct,auto --min-bytes 16M --max-bytes 256M --factor 4 --iters 20 --trials 3 \
        --out "$out/colls.jsonl" >"$out/colls.log"; tail -3 "$out/colls.log" | cut -c1-300
      for c in reduce_scatter all_gather all_to_all; do
        python3 benchmarks/summarize.py "$out/colls.jsonl" --collective $c --algorithms native,ring,direct,auto | tail -n +3
      done ;;
    dp)
      for b in 16 16 32; do
        LIMIT=170 tr benchmarks/peers_dp_zero.py --sections dp --sizes 4 1 --batch-per-rank $b --stall-s 160 \
          --out "$out/dp-b$b-$SECONDS.jsonl" | grep -vE "^\s*$" | cut -c1-220 | tail -8
      done ;;
  esac
  echo "part $part: $((SECONDS - start)) s"
done
