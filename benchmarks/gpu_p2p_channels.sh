#!/usr/bin/env bash
# Does NCCL's point-to-point path get more bandwidth with more channels a peer or bigger NVLink chunks?
# Our algorithms run over NCCL send/recv, whose per-pair rate (130-160 GB/s at 16-64 MiB on 4 H200s) limits
# ring and direct well below NCCL's own all-reduce. Same sweep, three settings, one call:
#   default | NCCL_MIN_P2P_NCHANNELS=32 | that and NCCL_P2P_NVL_CHUNKSIZE=2 MiB
# Usage: benchmarks/gpu_p2p_channels.sh OUTDIR
set -uo pipefail
out=${1:-runs/gpu-p2p}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
sweep() {
  timeout 90 torchrun --nproc-per-node "$n" -m dtrain bench comm --algorithms native,ring,direct --min-bytes 16M \
    --max-bytes 1G --factor 4 --iters 10 --trials 3 --out "$out/p2p-$1.jsonl" >"$out/p2p-$1.log" 2>&1
  rm -f "$out/p2p-$1.png"
  python3 benchmarks/summarize.py "$out/p2p-$1.jsonl" --algorithms native,ring,direct | tail -5
}
echo "default"; sweep default
echo "NCCL_MIN_P2P_NCHANNELS=32"; NCCL_MIN_P2P_NCHANNELS=32 sweep channels32
echo "NCCL_MIN_P2P_NCHANNELS=32 NCCL_P2P_NVL_CHUNKSIZE=2097152"
NCCL_MIN_P2P_NCHANNELS=32 NCCL_P2P_NVL_CHUNKSIZE=2097152 sweep channels32-chunk2m
