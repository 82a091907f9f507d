#!/usr/bin/env bash
# The GPU numbers of docs/benchmarks.md: verify every algorithm against NCCL, calibrate the cost model, then
# time all-reduce (8 KiB - 1 GiB; eager and CUDA-graph captured) and the other collectives beside native NCCL,
# on every GPU of this host, then probe point-to-point latency, bandwidth and host cost.
# Usage: benchmarks/gpu.sh OUTDIR   (NVLink multicast stays off: NCCL_NVLS_ENABLE=0)
set -uo pipefail
out=${1:-runs/gpu}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DTRAIN_CALIBRATION="$out/calibration-cuda.json"
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
run() { torchrun --nproc-per-node "$n" -m dtrain "$@"; }
{
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"
run bench verify 2>&1 | grep -v -i warn | tee "$out/verify.txt"
run bench calibrate --out "$DTRAIN_CALIBRATION" 2>&1 | grep -v -i warn
run bench comm --collectives all_reduce --min-bytes 8K --max-bytes 1G --factor 2 --iters 20 --graphs \
  --out "$out/gpu-all_reduce.jsonl" 2>&1 | grep -v -i warn
run bench comm --collectives all_gather,reduce_scatter,broadcast,all_to_all --min-bytes 8K --max-bytes 256M \
  --factor 4 --iters 10 --out "$out/gpu-collectives.jsonl" 2>&1 | grep -v -i warn
torchrun --nproc-per-node "$n" benchmarks/p2p_probe.py 2>&1 | grep KiB | tee "$out/probe.txt"
