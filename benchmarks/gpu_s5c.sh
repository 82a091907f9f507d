#!/usr/bin/env bash
# Session 5, final run, on every GPU of one host with dtrain's defaults (NVLink multicast off):
#   rules   all-reduce, all-gather, reduce-scatter sweep writing rules, then a second launch following them
#   probe   replay_host_probe.py (the watchdog's events made ahead)
#   train   dtrain train dp2 x tp2 and dp2 x pp2 (windows for two kinds of subgroup in one job)
#   tp      tensor parallel against DTensor (4 GPUs)
#   zero    ZeRO-1/2 against DDP and ZeroRedundancyOptimizer
#   dp      data parallel against DDP, 1 and 4 GPUs: three launches at 32 sequences a GPU, one at 16
# Usage: benchmarks/gpu_s5c.sh OUTDIR [parts...]
set -uo pipefail
out=${1:-runs/gpu-s5c}; shift || true
parts=${*:-rules probe train tp zero dp}
mkdir -p "$out"
. benchmarks/gpu_env.sh
nvidia-smi -L | head -1
for part in $parts; do
  start=$SECONDS
  case $part in
    rules)
      export DTRAIN_COMM_RULES="$out/rules.json"; rm -f "$DTRAIN_COMM_RULES"
      for run in 1 2; do
        extra=""; [ $run = 1 ] && extra="--rules-out"
        LIMIT=150 tr -m dtrain bench comm --collectives all_reduce,all_gather,reduce_scatter \
          --algorithms native,ring,halving_doubling,recursive_doubling,direct,auto --min-bytes 1M --max-bytes 1G \
          --factor 4 --iters 20 --trials 3 --out "$out/colls-$run.jsonl" $extra >"$out/colls-$run.log"; echo "exit $?"
        grep -vE "^\s*[│┃|]|^[┏┡└━┃]" "$out/colls-$run.log" | tail -6 | cut -c1-300
        for c in all_reduce all_gather reduce_scatter; do
          python3 benchmarks/summarize.py "$out/colls-$run.jsonl" --collective $c --algorithms native,ring,auto | tail -n +3
        done
      done
      python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['rules'])" "$DTRAIN_COMM_RULES"
      unset DTRAIN_COMM_RULES ;;
    probe)
      LIMIT=60 tr benchmarks/replay_host_probe.py >"$out/replay-host-probe.txt"; grep "KiB" "$out/replay-host-probe.txt" ;;
    train)
      LIMIT=100 tr -m dtrain.train --dp 2 --tp 2 --preset small --batch-size 64 --steps 60 --out "$out/t-dp2tp2" | tail -2 | cut -c1-250
      LIMIT=100 tr -m dtrain.train --dp 2 --pp 2 --microbatches 4 --preset small --batch-size 64 --steps 60 --out "$out/t-dp2pp2" | tail -2 | cut -c1-250
      cp "$out/t-dp2tp2/metrics.jsonl" "$out/train-dp2tp2.jsonl"; cp "$out/t-dp2pp2/metrics.jsonl" "$out/train-dp2pp2.jsonl"
      rm -rf "$out/t-dp2tp2" "$out/t-dp2pp2" ;;
    tp)
      LIMIT=120 tr benchmarks/peers_tp_pp.py --sections tp --sizes 4 1 --stall-s 110 --out "$out/tp.jsonl" | grep -vE "^\s*$" | cut -c1-200 | tail -4 ;;
    zero)
      LIMIT=150 tr benchmarks/peers_dp_zero.py --sections zero --stall-s 140 --out "$out/zero.jsonl" | grep -vE "^\s*$" | cut -c1-200 | tail -6 ;;
    dp)
      for b in 32 32 32 16; do
        LIMIT=120 tr benchmarks/peers_dp_zero.py --sections dp --sizes 4 1 --batch-per-rank $b --stall-s 110 \
          --out "$out/dp-b$b-$SECONDS.jsonl" | grep "^timed" | paste -sd' '; echo " (b=$b)"
      done
      python3 benchmarks/dp_summary.py "$out"
      ;;
  esac
  echo "part $part: $((SECONDS - start)) s"
done
