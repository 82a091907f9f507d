#!/usr/bin/env bash
# Session 7: how transfers share a GPU's NVLink port (benchmarks/port_probe.py), and on a card not yet run so,
# every collective captured whole (gpu_s6.sh's graph-a, graph-b). One launch of the machine:
#   port     benchmarks/port_probe.py: lone and concurrent reads, pushes and sums through one GPU's port
#   graph-a, graph-b  as gpu_s6.sh
# Usage: benchmarks/gpu_s7.sh OUTDIR [parts...]
set -uo pipefail
out=${1:-runs/gpu-s7}; shift || true
parts=${*:-port graph-a graph-b}
mkdir -p "$out"
. benchmarks/gpu_env.sh
for part in $parts; do
  start=$SECONDS
  case $part in
    port)
      LIMIT=240 tr benchmarks/port_probe.py --out "$out/port.jsonl" >"$out/port.log"; echo "exit $?"
      grep -E "MiB|barrier" "$out/port.log" ;;
    *) benchmarks/gpu_s6.sh "$out" "$part" ;;
  esac
  echo "part $part: $((SECONDS - start)) s"
done
