#!/usr/bin/env bash
# The GPU numbers of issue 3 and the transport comparison of issue 5, on every GPU of this host, in one call:
#   1. data parallel against DDP (1, 2, 4 GPUs) and ZeRO 1/2 against ZeroRedundancyOptimizer (peers_dp_zero.py)
#   2. tensor parallel against DTensor's, pipeline against torch.distributed.pipelining (peers_tp_pp.py)
#   3. dtrain train end to end on NCCL: dp2 x pp2 and dp2 x tp2
#   4. all-reduce 1 MiB - 1 GiB, native NCCL and our algorithms, over NVLink, then with NCCL_P2P_DISABLE=1
#      (host shared memory), then with NCCL_SHM_DISABLE=1 as well (sockets): the seed text's comparison.
#   5. the pipeline bubble and activation memory, p = 2 and 4 (pipeline_bubble.py)
# Usage: benchmarks/gpu_peers.sh OUTDIR [parts...]   parts: dp tp pp bubble comm train graphs (default: dp tp pp comm train)
set -uo pipefail
out=${1:-runs/gpu-peers}; shift || true
parts=${*:-dp tp pp comm train}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
# each part under a time limit, so that one that stalls costs its limit and not the whole call
tr() { timeout "${LIMIT:-150}" torchrun --nproc-per-node "$n" "$@" 2>&1 | grep --line-buffered -v -iE "warn|^\s*$"; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | head -1
for part in $parts; do
  start=$SECONDS
  case $part in
    dp) tr benchmarks/peers_dp_zero.py --out "$out/dp-zero.jsonl" | cut -c1-220 ;;
    tp) LIMIT=120 tr benchmarks/peers_tp_pp.py --sections tp --stall-s 100 --tp-dim 8192 --tp-tokens 16384 --out "$out/tp.jsonl" \
          | cut -c1-200 ;;
    pp) LIMIT=150 tr benchmarks/peers_tp_pp.py --sections pp --pp-width 4096 --pp-batch 8192 --microbatches 4 8 16 32 \
          --pp-warmup 2 --pp-iters 3 --pp-trials 3 --pp-budget-s 3 --stall-s 40 --out "$out/pp.jsonl" ;;
    bubble) # p = 2 on GPUs 0-1, then p = 4; at p = 4 interleaved apart: our 1F1B can deadlock on NCCL (docs/pipeline-gpu.md)
      bub() { timeout "$1" torchrun --nproc-per-node "$2" benchmarks/pipeline_bubble.py --layers 32 --width 4096 \
          --batch 8192 --stall-s 40 "${@:3}" 2>&1 | grep --line-buffered -v -iE "warn|^\s*$|^Thread 0x|no Python frame"; }
      bub 100 2 --out "$out/bubble-p2.jsonl"
      bub 100 4 --schedules gpipe 1f1b --microbatches 16 8 4 1 2 --out "$out/bubble-p4.jsonl"
      bub 80 4 --schedules interleaved-1f1b --microbatches 16 8 4 --out "$out/bubble-p4-interleaved.jsonl"
      python3 benchmarks/pipeline_bubble.py --report "$out"/bubble-p*.jsonl --plot "$out/bubble.png" ;;
    graphs) LIMIT=60 tr -m dtrain bench comm --algorithms ring,native --graphs --min-bytes 1M --max-bytes 4M \
          --out "$out/graphs.jsonl" | tail -3 ;;
    train)
      LIMIT=100 tr -m dtrain.train --dp 2 --pp 2 --microbatches 4 --preset small --batch-size 64 --steps 60 --out "$out/train-dp2pp2" | tail -2
      LIMIT=100 tr -m dtrain.train --dp 2 --tp 2 --preset small --batch-size 64 --steps 60 --out "$out/train-dp2tp2" | tail -2
      cp "$out/train-dp2pp2/metrics.jsonl" "$out/train-dp2pp2.jsonl"; cp "$out/train-dp2tp2/metrics.jsonl" "$out/train-dp2tp2.jsonl"
      rm -rf "$out/train-dp2pp2" "$out/train-dp2tp2" ;;
    comm)
      algos=native,ring,tree,recursive_doubling,halving_doubling,direct,auto
      tr -m dtrain bench comm --algorithms $algos --min-bytes 1M --max-bytes 1G --factor 4 --iters 10 --trials 3 \
        --out "$out/comm-nvlink.jsonl" >"$out/comm.log"
      NCCL_P2P_DISABLE=1 tr -m dtrain bench comm --algorithms native,ring,direct --min-bytes 1M --max-bytes 1G \
        --factor 4 --iters 5 --trials 3 --out "$out/comm-shm.jsonl" >>"$out/comm.log"
      NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 tr -m dtrain bench comm --algorithms native,ring --min-bytes 1M \
        --max-bytes 256M --factor 4 --iters 3 --trials 3 --out "$out/comm-socket.jsonl" >>"$out/comm.log"
      rm -f "$out"/comm-*.png; grep -iE "error|Traceback" "$out/comm.log" | head -5
      for f in "$out"/comm-*.jsonl; do echo "$f"; python3 benchmarks/summarize.py "$f" --algorithms native,ring,direct,auto; done ;;
  esac
  echo "part $part: $((SECONDS - start)) s"
done
