#!/usr/bin/env bash
# Session 5, the final code on every GPU of one host with dtrain's defaults (NVLink multicast off): the
# watchdog's per-call cost, a replayed call's host time, bench verify, a peer that never comes, the all-reduce
# with the built-in rule (no rules file), and data parallel against DDP at 32 and 16 sequences a GPU.
# Usage: benchmarks/gpu_s5d.sh OUTDIR
set -uo pipefail
out=${1:-runs/gpu-s5d}
mkdir -p "$out"
. benchmarks/gpu_env.sh
nvidia-smi -L | head -1
python3 benchmarks/watchdog_probe.py 2>&1 | grep " us$" | tee "$out/watchdog-probe.txt"
LIMIT=60 tr benchmarks/replay_host_probe.py >"$out/replay-host-probe.txt"; grep "KiB" "$out/replay-host-probe.txt"
LIMIT=150 tr -m dtrain bench verify >"$out/verify.txt"
echo "verify: $(grep -c '^ok' "$out/verify.txt") ok, $(grep -ciE '^(fail|mismatch)|error' "$out/verify.txt") failed"
NP=2 LIMIT=45 tr benchmarks/peer_missing_demo.py >"$out/missing-peer.txt"; echo "missing-peer demo exit: $?"
grep -E "^rank|watchdog|FATAL" "$out/missing-peer.txt" | cut -c1-330
LIMIT=90 tr -m dtrain bench comm --collectives all_reduce --algorithms native,ring,halving_doubling,auto \
  --min-bytes 1M --max-bytes 1G --factor 4 --iters 20 --trials 3 --out "$out/ar-final.jsonl" >/dev/null
python3 benchmarks/summarize.py "$out/ar-final.jsonl" --collective all_reduce --algorithms native,ring,halving_doubling,auto | tail -n +4
for b in 32 16; do
  LIMIT=120 tr benchmarks/peers_dp_zero.py --sections dp --sizes 4 1 --batch-per-rank $b --stall-s 110 \
    --out "$out/dp-b$b.jsonl" | grep "^timed" | paste -sd' '
done
python3 benchmarks/dp_summary.py "$out"
