#!/usr/bin/env bash
# Session 5, the last run: reduce-scatter pushed out of place from 16 MiB and the ring from 12 MiB (built in),
# on every GPU of one host with the defaults: bench verify, reduce-scatter 4-64 MiB twice, ZeRO against DDP.
# Usage: benchmarks/gpu_s5g.sh OUTDIR
set -uo pipefail
out=${1:-runs/gpu-s5g}
mkdir -p "$out"
. benchmarks/gpu_env.sh
nvidia-smi -L | head -1
LIMIT=150 tr -m dtrain bench verify >"$out/verify.txt"
echo "verify: $(grep -c '^ok' "$out/verify.txt") ok, $(grep -ciE '^(fail|mismatch)|error' "$out/verify.txt") failed"
for run in 1 2; do
  LIMIT=90 tr -m dtrain bench comm --collectives reduce_scatter --algorithms native,ring,halving_doubling,auto \
    --min-bytes 4M --max-bytes 64M --factor 2 --iters 20 --trials 3 --out "$out/rs-$run.jsonl" >/dev/null
  python3 benchmarks/summarize.py "$out/rs-$run.jsonl" --collective reduce_scatter --algorithms native,ring,halving_doubling,auto | tail -n +4
done
LIMIT=150 tr benchmarks/peers_dp_zero.py --sections zero --stall-s 140 --out "$out/zero.jsonl" | grep "^timed" | paste -sd' '
