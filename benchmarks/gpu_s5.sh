#!/usr/bin/env bash
# Session 5 on every GPU of one host (NVLink multicast off), with dtrain's defaults (no DTRAIN_COMM_* set:
# the peer transport and graph replays are now the CUDA default):
#   1. bench verify: every (collective, algorithm) against NCCL's result
#   2. all-reduce 1 MiB - 1 GiB: native, ring, halving-doubling, auto; writes measured rules for auto
#   3. the same sweep again, auto following those rules (a second launch of everything)
#   4. the eager path (DTRAIN_COMM_PERSISTENT=0), 16 MiB - 1 GiB
#   5. replay_host_probe.py: where a replayed call's host time goes
#   6. peer_missing_demo.py: a peer that never comes, on 2 GPUs
# Usage: benchmarks/gpu_s5.sh OUTDIR
set -uo pipefail
out=${1:-runs/gpu-s5}
mkdir -p "$out"
. benchmarks/gpu_env.sh
export DTRAIN_COMM_RULES="$out/rules-cuda-peer.json"
rm -f "$DTRAIN_COMM_RULES"
nvidia-smi -L | head -4; python3 -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())'
start=$SECONDS
LIMIT=150 tr -m dtrain bench verify >"$out/verify.txt"
echo "verify: $(grep -c '^ok' "$out/verify.txt") ok, $(grep -ciE '^(fail|mismatch)|error' "$out/verify.txt") failed ($((SECONDS - start)) s)"
grep -iE "fail|mismatch|error" "$out/verify.txt" | head -5
sweep="--collectives all_reduce --algorithms native,ring,halving_doubling,auto --min-bytes 1M --max-bytes 1G --factor 4"
for run in 1 2; do
  start=$SECONDS
  extra=""; [ $run = 1 ] && extra="--rules-out"
  LIMIT=120 tr -m dtrain bench comm $sweep --iters 20 --trials 3 --out "$out/ar-default-$run.jsonl" $extra | grep -i "rules"
  echo "== all-reduce, defaults, launch $run ($((SECONDS - start)) s)"
  python3 benchmarks/summarize.py "$out/ar-default-$run.jsonl" --collective all_reduce \
    --algorithms native,ring,halving_doubling,auto | tail -n +4
done
python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[\"rules\"])" "$DTRAIN_COMM_RULES"
start=$SECONDS
DTRAIN_COMM_PERSISTENT=0 LIMIT=90 tr -m dtrain bench comm --collectives all_reduce --algorithms native,ring,auto \
  --min-bytes 16M --max-bytes 1G --factor 4 --iters 20 --trials 3 --out "$out/ar-eager.jsonl" >/dev/null
echo "== all-reduce, eager ($((SECONDS - start)) s)"
python3 benchmarks/summarize.py "$out/ar-eager.jsonl" --collective all_reduce --algorithms native,ring,auto | tail -n +4
LIMIT=60 tr benchmarks/replay_host_probe.py | tee "$out/replay-host-probe.txt"
NP=2 LIMIT=45 tr benchmarks/peer_missing_demo.py >"$out/missing-peer.txt"; echo "missing-peer demo exit: $?"
grep -vE "^\s*$" "$out/missing-peer.txt" | cut -c1-400 | head -20
