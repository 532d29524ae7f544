#!/bin/bash
# configs/hybrid.yaml with rollout.rebalance true vs false: 3 interleaved rounds (order alternating), mrl run each.
# Usage from the repository root: bash benchmarks/2026-12-06/hybrid_rebalance/run.sh OUTDIR
set -u
out=${1:?output folder}; mkdir -p "$out"
cp configs/hybrid.yaml "$out/hybrid_on.yaml"
sed 's/rebalance: true/rebalance: false/' configs/hybrid.yaml > "$out/hybrid_off.yaml"
for r in 0 1 2; do
  order="on off"; [ $((r % 2)) = 1 ] && order="off on"
  for v in $order; do
    start=$(date +%s.%N)
    mrl run --config "$out/hybrid_$v.yaml" --quiet --json "$out/r${r}_$v.json" > "$out/r${r}_$v.log" 2>&1
    echo "$r $v rc=$? wall=$(echo "$(date +%s.%N) - $start" | bc) load=$(cat /proc/loadavg)" >> "$out/rounds.txt"
  done
done
