#!/usr/bin/env bash
# Session 5, after the review fixes and the out-of-place reduce-scatter (every GPU of one host, defaults,
# NVLink multicast off): bench verify on the defaults and with every schedule pushed; reduce-scatter and
# all-reduce 16 MiB-1 GiB; ZeRO against DDP; a peer that never comes; one data-parallel launch.
# Usage: benchmarks/gpu_s5e.sh OUTDIR
set -uo pipefail
out=${1:-runs/gpu-s5e}
mkdir -p "$out"
. benchmarks/gpu_env.sh
nvidia-smi -L | head -1
LIMIT=150 tr -m dtrain bench verify >"$out/verify.txt"
echo "verify: $(grep -c '^ok' "$out/verify.txt") ok, $(grep -ciE '^(fail|mismatch)|error' "$out/verify.txt") failed"
DTRAIN_COMM_PEER_MODE=push LIMIT=150 tr -m dtrain bench verify >"$out/verify-push.txt"
echo "verify, all pushed: $(grep -c '^ok' "$out/verify-push.txt") ok, $(grep -ciE '^(fail|mismatch)|error' "$out/verify-push.txt") failed"
grep -iE "fail|mismatch|error" "$out/verify.txt" "$out/verify-push.txt" | head -5
LIMIT=120 tr -m dtrain bench comm --collectives reduce_scatter,all_reduce --algorithms native,ring,halving_doubling,auto \
  --min-bytes 16M --max-bytes 1G --factor 4 --iters 20 --trials 3 --out "$out/rs-ar.jsonl" >"$out/rs-ar.log"; echo "exit $?"
for c in reduce_scatter all_reduce; do
  python3 benchmarks/summarize.py "$out/rs-ar.jsonl" --collective $c --algorithms native,ring,halving_doubling,auto | tail -n +3
done
LIMIT=150 tr benchmarks/peers_dp_zero.py --sections zero --stall-s 140 --out "$out/zero.jsonl" | grep "^timed" | paste -sd' '
python3 -c "
import json,sys
for l in open(sys.argv[1]): r=json.loads(l); print(r['variant'], round(r['step_s']*1e3,2), 'ms', round(r.get('ratio_vs_ddp') or 0,3), 'x DDP', r.get('peak_memory_bytes'))
" "$out/zero.jsonl"
NP=2 LIMIT=45 tr benchmarks/peer_missing_demo.py >"$out/missing-peer.txt"; echo "missing-peer demo exit: $?"
grep -E "^rank|watchdog|FATAL" "$out/missing-peer.txt" | cut -c1-250
LIMIT=120 tr benchmarks/peers_dp_zero.py --sections dp --sizes 4 1 --batch-per-rank 32 --stall-s 110 \
  --out "$out/dp-b32.jsonl" | grep "^timed" | paste -sd' '
LIMIT=60 tr benchmarks/replay_host_probe.py >"$out/replay-host-probe.txt"; grep "KiB" "$out/replay-host-probe.txt"
