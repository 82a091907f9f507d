#!/usr/bin/env bash
# Our algorithms on the peer-memory transport (dtrain.comm.peer) against NCCL, on every GPU of one host:
#   1. bench verify: every (collective, algorithm) through peer memory against NCCL's result
#   2. all-reduce 16 KiB - 1 GiB: native NCCL and our algorithms on the peer transport (DTRAIN_COMM_TRANSPORT=peer),
#      persistent (DTRAIN_COMM_PERSISTENT=1: replayed as CUDA graphs from the second call) and eager
#   3. the same on the point-to-point transport (NCCL send/recv), for the side-by-side
#   4. all-gather, reduce-scatter, broadcast, all-to-all 1 MiB - 256 MiB on the peer transport
# Usage: benchmarks/gpu_peer.sh OUTDIR   (NVLink multicast stays off)
set -uo pipefail
out=${1:-runs/gpu-peer}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DTRAIN_COMM_TRANSPORT=peer
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
tr() { timeout "${LIMIT:-120}" torchrun --nproc-per-node "$n" "$@" 2>&1 | grep --line-buffered -v -iE "warn|^\s*$"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | head -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "triton", triton.__version__)'
all="native,ring,direct,halving_doubling,recursive_doubling,tree,auto"
start=$SECONDS
LIMIT=100 tr -m dtrain bench verify >"$out/verify-peer.txt"; grep -ciE "fail|error" "$out/verify-peer.txt"; tail -2 "$out/verify-peer.txt"
echo "verify: $((SECONDS - start)) s"; start=$SECONDS
DTRAIN_COMM_PERSISTENT=1 LIMIT=150 tr -m dtrain bench comm --collectives all_reduce --algorithms $all --min-bytes 16K --max-bytes 1G --factor 4 \
  --iters 20 --trials 3 --out "$out/comm-peer.jsonl" >"$out/comm-peer.log"
echo "comm peer: $((SECONDS - start)) s"; start=$SECONDS
DTRAIN_COMM_PERSISTENT=0 LIMIT=120 tr -m dtrain bench comm --collectives all_reduce --algorithms native,ring,halving_doubling,direct,auto \
  --min-bytes 16K --max-bytes 1G --factor 4 --iters 20 --trials 3 --out "$out/comm-peer-eager.jsonl" >"$out/comm-peer-eager.log"
echo "comm peer eager: $((SECONDS - start)) s"; start=$SECONDS
DTRAIN_COMM_TRANSPORT=p2p LIMIT=120 tr -m dtrain bench comm --collectives all_reduce --algorithms native,ring,direct,halving_doubling \
  --min-bytes 1M --max-bytes 1G --factor 4 --iters 10 --trials 3 --out "$out/comm-p2p.jsonl" >"$out/comm-p2p.log"
echo "comm p2p: $((SECONDS - start)) s"; start=$SECONDS
LIMIT=120 tr -m dtrain bench comm --collectives all_gather,reduce_scatter,broadcast,all_to_all \
  --algorithms native,ring,direct,tree,halving_doubling,recursive_doubling,auto --min-bytes 1M --max-bytes 256M --factor 4 \
  --iters 10 --trials 2 --out "$out/collectives-peer.jsonl" >"$out/collectives-peer.log"
echo "collectives peer: $((SECONDS - start)) s"
rm -f "$out"/*.png
grep -hiE "error|Traceback" "$out"/*.log | head -5
for f in "$out"/comm-*.jsonl; do echo "$f"; python3 benchmarks/summarize.py "$f" --algorithms native,ring,direct,halving_doubling,recursive_doubling,auto; done
for c in all_gather reduce_scatter broadcast all_to_all; do
  python3 benchmarks/summarize.py "$out/collectives-peer.jsonl" --collective $c --algorithms native,ring,direct,tree,halving_doubling,recursive_doubling,auto
done
