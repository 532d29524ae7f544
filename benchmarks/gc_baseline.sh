#!/usr/bin/env bash
# Vanilla TRL's own speed with TRL's default activation (gradient) checkpointing vs without, on the embedded job of
# each bundled comparison config: `mrl run --vanilla --threads 0` (every core, vanilla's best thread setting),
# 3 repetitions per setting, the order alternating. Output: one line per run (steps/s, final reward, load).
#   bash benchmarks/gc_baseline.sh [OUT_DIR]
set -euo pipefail
out=${1:-mrl-gc-baseline}
mkdir -p "$out"
for job in compare_small compare_kl; do
  python - "$job" "$out" <<'PY'
import sys

import yaml

from mrl_plugins.config import load_yaml
from mrl_plugins.run import checkpointing_arg

job, out = sys.argv[1:]
data = load_yaml(job)
train = data["train"]
on = {**data, "train": {**train, "trl_args": {**(train.get("trl_args") or {}), checkpointing_arg(): True}}}
yaml.safe_dump(on, open(f"{out}/{job}_gc_on.yaml", "w"))
yaml.safe_dump(data, open(f"{out}/{job}_gc_off.yaml", "w"))  # the embedded job's presets train without it
PY
  for rep in 1 2 3; do
    order="on off"
    [ "$rep" = 2 ] && order="off on"
    for gc in $order; do
      json="$out/${job}_gc_${gc}_$rep.json"
      mrl run --config "$out/${job}_gc_$gc.yaml" --vanilla --threads 0 --quiet --json "$json" >/dev/null 2>&1
      python -c "import json; r = json.load(open('$json')); print('$job gc=$gc rep=$rep', round(r['steps_per_s'], 3), \
'steps/s, final reward', round(r['final_reward'], 3), 'load', open('/proc/loadavg').read().split()[0])"
    done
  done
done
