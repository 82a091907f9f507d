#!/usr/bin/env bash
# Session 5, the final code on every GPU of one host with dtrain's defaults (NVLink multicast off): the
# watchdog's per-call cost, a replayed call's host time, bench verify, a peer that never comes, the all-reduce
# with the built-in rule (no rules file), and data parallel against DDP at 32 and 16 sequences a GPU.
# Usage: benchmarks/gpu_s5d.sh OUTDIR
set -uo pipefail
out=${1:-runs/gpu-s5d}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset DTRAIN_COMM_TRANSPORT DTRAIN_COMM_PERSISTENT DTRAIN_COMM_PEER_MODE DTRAIN_COMM_TIMEOUT DTRAIN_COMM_RULES
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
tr() { timeout "${LIMIT:-120}" torchrun --nproc-per-node "${NP:-$n}" "$@" 2>&1 | grep --line-buffered -v -iE "warn|^\s*$"; }
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
python3 - "$out" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(sys.argv[1] + "/dp-b*.jsonl")):
    rows = [json.loads(l) for l in open(path)]
    one = [r for r in rows if r["ranks"] == 1][0]["tokens_per_s"]
    print(path.split("/")[-1], " ".join(f"{r['variant']} {r['ratio_vs_ddp'] or 0:.3f}x {r['tokens_per_s'] / r['ranks'] / one:.3f}" for r in rows if r["ranks"] == 4))
PY
