#!/usr/bin/env bash
# Session 6: the simulator's 1-16 MiB band and the collectives not yet measured on the default path, on every GPU
# of one host with dtrain's defaults (NVLink multicast off). One launch of the machine runs:
#   host    every collective and algorithm (NCCL's too) at 16 KiB, 100 calls a run: the launch's host
#           calibration (``host_us``: the host's time to issue one replayed call)
#   sweep-a all-reduce, all-gather, reduce-scatter, all-to-all: every algorithm, 1 MiB-1 GiB, factor 4
#   sweep-b broadcast, reduce, gather, scatter, the same (``time_us`` and ``host_us`` per point)
#   graph-a, graph-b  the same collectives, 16 KiB-1 GiB, each call also captured whole as a CUDA graph and
#           replayed ("ring+graph", "native+graph": the devices' time, with the API's Python out of the loop)
#   tuning  NCCL's choice of algorithm and protocol per collective and size (NCCL_DEBUG_SUBSYS=TUNING,COLL)
# Usage: benchmarks/gpu_s6.sh OUTDIR [parts...]
set -uo pipefail
out=${1:-runs/gpu-s6}; shift || true
parts=${*:-host sweep-a sweep-b tuning}
mkdir -p "$out"
. benchmarks/gpu_env.sh
nvidia-smi -L | head -1
colls=all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,reduce,gather,scatter
for part in $parts; do
  start=$SECONDS
  case $part in
    host)
      LIMIT=150 tr -m dtrain bench comm --collectives $colls --min-bytes 16K --max-bytes 16K --iters 100 --trials 3 \
        --out "$out/host.jsonl" >"$out/host.log"; echo "exit $?" ;;
    sweep-a|sweep-b|graph-a|graph-b)
      set=all_reduce,all_gather,reduce_scatter,all_to_all; [ ${part#*-} = b ] && set=broadcast,reduce,gather,scatter
      extra="--min-bytes 1M"; [ ${part%-*} = graph ] && extra="--min-bytes 16K --graphs"
      LIMIT=300 tr -m dtrain bench comm --collectives $set $extra --max-bytes 1G --factor 4 --iters 20 \
        --trials 3 --out "$out/$part.jsonl" >"$out/$part.log"; echo "exit $?"
      grep -vE "^\s*[│┃|]|^[┏┡└━┃]" "$out/$part.log" | tail -3 | cut -c1-300 ;;
    tuning)
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING,COLL LIMIT=90 tr -m dtrain bench comm --collectives $colls \
        --algorithms native --min-bytes 16K --max-bytes 1G --factor 4 --iters 1 --trials 1 --warmup 0 --warm-s 0 \
        --out "$out/tuning.jsonl" >"$out/tuning.log"; echo "exit $?"
      # one line per distinct message, the host/pid prefix and the per-call addresses cut
      grep "NCCL INFO" "$out/tuning.log" | sed -E 's/^.*NCCL INFO //; s/0x[0-9a-f]+/0x/g; s/opCount [0-9a-f]+/opCount/' \
        | sort | uniq -c | sort -k2 | head -1500 >"$out/tuning.txt"
      wc -l "$out/tuning.txt"; grep -m5 "Bytes ->" "$out/tuning.txt" | cut -c1-200 ;;
  esac
  echo "part $part: $((SECONDS - start)) s"
done
